"""The run directory, a contract between processes: its layout, and the columns and Parquet
schema of the logged trajectories. The orchestrator writes the rollout log, the trainer its
metrics file, the demo its evaluations; the inspector reads them all.

    <run>/train_metrics.jsonl            trainer: one line per training step (from step 1)
    <run>/rollouts/steps.jsonl           orchestrator: one line per rollout step (from step 0)
    <run>/rollouts/train/step-*.parquet  orchestrator: the logged samples of each step
    <run>/rollouts/evals.jsonl           held-out evaluations (scores)
    <run>/rollouts/eval/<id>.parquet     their samples
    <run>/*.yaml, eval_*.json            the stack config; the demo's evaluation summaries

The trainer writes its metrics file where `trainer.metrics_jsonl` says; in a run directory it
is `TRAIN_METRICS`. Only the standard library here (pyarrow inside `rollout_schema`): the trainer
imports this module for two key names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

# -- layout ----------------------------------------------------------------------------------

TRAIN_METRICS = "train_metrics.jsonl"
ROLLOUTS = "rollouts"
STEPS = "steps.jsonl"  # under rollouts/
EVALS = "evals.jsonl"  # under rollouts/
TRAIN = "train"  # a logged trajectory's kind, and the folder of its file under rollouts/
EVAL = "eval"
KINDS = (TRAIN, EVAL)
STEP_FILES = "step-*.parquet"  # under rollouts/train/
CONFIGS = "*.yaml"
EVAL_SUMMARIES = "eval_*.json"  # the demo's


def step_stem(step: int) -> str:
    """The name (without `.parquet`) of one rollout step's file under rollouts/train/."""
    return f"step-{step:06d}"


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory."""

    root: Path

    @property
    def rollouts(self) -> Path:
        return self.root / ROLLOUTS

    @property
    def steps(self) -> Path:
        return self.rollouts / STEPS

    @property
    def evals(self) -> Path:
        return self.rollouts / EVALS

    def parquet(self, kind: str, stem: str) -> Path:
        return self.rollouts / kind / f"{stem}.parquet"

    def step_file(self, step: int) -> Path:
        return self.parquet(TRAIN, step_stem(step))

    def eval_file(self, eval_id: str) -> Path:
        return self.parquet(EVAL, eval_id)


# -- the trainer's metrics file: one JSON object per line --------------------------------------

METRICS_STEP = "step"  # the training step, from 1
METRICS_TRAJECTORY_IDS = "trajectory_ids"  # every trajectory the step trained on
METRICS_TRAINER = "trainer"  # host:pid of the trainer process that trained it (the lease's holder)
METRICS_TIME = "time"  # Unix time when it was logged


# -- the rollout log's Parquet files: one row per logged trajectory ---------------------------


class Col(StrEnum):
    """The columns of a rollout-log file (`rollout_schema` gives their types)."""

    KIND = "kind"  # train | eval
    STEP = "step"
    EVAL_ID = "eval_id"
    LOGGED_REASON = "logged_reason"  # group | failed | truncated | invalid | eval
    TRAJECTORY_ID = "trajectory_id"
    GROUP_ID = "group_id"
    SAMPLE_INDEX = "sample_index"
    GROUP_SIZE = "group_size"
    PROMPT_ID = "prompt_id"
    DATA_SOURCE = "data_source"
    QUESTION = "question"
    PROMPT_TOKEN_IDS = "prompt_token_ids"
    PROMPT_TEXT = "prompt_text"
    RESPONSE_TOKEN_IDS = "response_token_ids"
    TOKEN_TEXTS = "token_texts"
    RESPONSE_TEXT = "response_text"
    LOSS_MASK = "loss_mask"
    ROLLOUT_LOGPROBS = "rollout_logprobs"
    HAS_ROLLOUT_LOGPROBS = "has_rollout_logprobs"
    TIS_WEIGHTS = "tis_weights"  # null: not computed by the producer
    SPANS = "spans"
    TURNS = "turns"
    NUM_SEARCHES = "num_searches"
    NUM_INVALID = "num_invalid"
    NUM_TOOL_ERRORS = "num_tool_errors"
    RESPONSE_LEN = "response_len"
    REWARD = "reward"
    REWARD_COMPONENTS = "reward_components"
    EXTRACTED_ANSWER = "extracted_answer"
    GOLD_ANSWERS = "gold_answers"
    FINISH_REASON = "finish_reason"
    ERROR = "error"
    INFRASTRUCTURE_FAILURE = "infrastructure_failure"
    WEIGHT_VERSION = "weight_version"
    MAX_WEIGHT_VERSION = "max_weight_version"
    TEMPERATURE = "temperature"
    CREATED_AT = "created_at"
    FINISHED_AT = "finished_at"


# The trajectory list's columns (small; the token arrays are read for one trajectory only).
SUMMARY_COLUMNS: tuple[Col, ...] = (
    Col.KIND,
    Col.STEP,
    Col.EVAL_ID,
    Col.LOGGED_REASON,
    Col.TRAJECTORY_ID,
    Col.GROUP_ID,
    Col.SAMPLE_INDEX,
    Col.PROMPT_ID,
    Col.DATA_SOURCE,
    Col.QUESTION,
    Col.REWARD,
    Col.FINISH_REASON,
    Col.NUM_SEARCHES,
    Col.NUM_INVALID,
    Col.NUM_TOOL_ERRORS,
    Col.RESPONSE_LEN,
    Col.ERROR,
    Col.INFRASTRUCTURE_FAILURE,
    Col.EXTRACTED_ANSWER,
    Col.GOLD_ANSWERS,
    Col.REWARD_COMPONENTS,
    Col.WEIGHT_VERSION,
)


def rollout_schema() -> pa.Schema:
    """The Parquet schema of a rollout-log file: every `Col`, in order."""
    import pyarrow as pa  # not at the top: the trainer imports this module without pyarrow

    span = pa.struct(
        [("kind", pa.string()), ("start", pa.int32()), ("end", pa.int32()), ("text", pa.string())]
    )
    tool_call = pa.struct(
        [
            ("name", pa.string()),
            ("arguments_json", pa.string()),
            ("result", pa.string()),  # what the policy read back (result or error text)
            ("error", pa.string()),
            ("latency_s", pa.float64()),
            ("attempts", pa.int32()),
        ]
    )
    turn = pa.struct(
        [
            ("index", pa.int32()),
            ("action", pa.string()),
            ("query", pa.string()),
            ("doc_ids", pa.list_(pa.string())),
            ("observation", pa.string()),  # the text the tool call appended (its passages)
            ("tool_latency_s", pa.float64()),
            ("tool_attempts", pa.int32()),
            ("error", pa.string()),
            ("generated_tokens", pa.int32()),
            ("observation_tokens", pa.int32()),
            ("generate_latency_s", pa.float64()),
            ("engine_finish_reason", pa.string()),
            ("weight_version", pa.int64()),
            ("cached_tokens", pa.int32()),  # input tokens served from the engine's cache
            # function calling: each call (absent from logs written before the field)
            ("tool_calls", pa.list_(tool_call)),
            # a task's environment: its reward for the turn (absent before the field)
            ("reward", pa.float64()),
        ]
    )
    types = {
        Col.KIND: pa.string(),
        Col.STEP: pa.int64(),
        Col.EVAL_ID: pa.string(),
        Col.LOGGED_REASON: pa.string(),
        Col.TRAJECTORY_ID: pa.string(),
        Col.GROUP_ID: pa.string(),
        Col.SAMPLE_INDEX: pa.int32(),
        Col.GROUP_SIZE: pa.int32(),
        Col.PROMPT_ID: pa.string(),
        Col.DATA_SOURCE: pa.string(),
        Col.QUESTION: pa.string(),
        Col.PROMPT_TOKEN_IDS: pa.list_(pa.int32()),
        Col.PROMPT_TEXT: pa.string(),
        Col.RESPONSE_TOKEN_IDS: pa.list_(pa.int32()),
        Col.TOKEN_TEXTS: pa.list_(pa.string()),
        Col.RESPONSE_TEXT: pa.string(),
        Col.LOSS_MASK: pa.binary(),
        Col.ROLLOUT_LOGPROBS: pa.list_(pa.float32()),
        Col.HAS_ROLLOUT_LOGPROBS: pa.bool_(),
        Col.TIS_WEIGHTS: pa.list_(pa.float32()),
        Col.SPANS: pa.list_(span),
        Col.TURNS: pa.list_(turn),
        Col.NUM_SEARCHES: pa.int32(),
        Col.NUM_INVALID: pa.int32(),
        Col.NUM_TOOL_ERRORS: pa.int32(),
        Col.RESPONSE_LEN: pa.int32(),
        Col.REWARD: pa.float64(),
        Col.REWARD_COMPONENTS: pa.map_(pa.string(), pa.float64()),
        Col.EXTRACTED_ANSWER: pa.string(),
        Col.GOLD_ANSWERS: pa.list_(pa.string()),
        Col.FINISH_REASON: pa.string(),
        Col.ERROR: pa.string(),
        Col.INFRASTRUCTURE_FAILURE: pa.bool_(),
        Col.WEIGHT_VERSION: pa.int64(),
        Col.MAX_WEIGHT_VERSION: pa.int64(),
        Col.TEMPERATURE: pa.float64(),
        Col.CREATED_AT: pa.float64(),
        Col.FINISHED_AT: pa.float64(),
    }
    return pa.schema([(str(c), types[c]) for c in Col])
