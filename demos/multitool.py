"""The demo's second task (`searchr1 demo --task multi-tool`): search + arithmetic in the
chat template's function-calling format, the calculator served by an MCP server.

The world: fictional people (one-token names, as in `demos.world`) with a birth year in
1900-1999, one passage each (`"Name"\\nName is a <profession> who was born in <year>.`).
A question names two of them, the one born later first: "How many years apart were X and Y
born?"; the gold answer is the (positive) difference of their years, an integer.

A solving trajectory has three turns:
1. two `search` calls in one message (they run concurrently), one per name;
2. one `calculate` call (PyPI's `mcp-server-calculator` over stdio) on "<year X> - <year Y>";
3. `<answer> N </answer>`, N copied from the calculator's result.

The warm start (`MultiToolSampler`) imitates such trajectories token-exactly, with random facts
(no fact of the world is shown), mixed with guesses (`<answer>` with a random number at once):
the warm-started policy mostly guesses, is right when it uses the tools, and GRPO has that gap
to discover, as in the Search-R1 demo (docs/local.md).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demos.warmstart import Demo, MaskedResponse, Phase, WarmStartConfig
from demos.world import PROFESSIONS, unique_words, write_jsonl
from orchestrator.formats.function_calling import ToolTurns
from orchestrator.observation import format_docs
from orchestrator.prompt import prompt_token_ids
from orchestrator.tasks.multi_tool import MCP_CALCULATOR, calculator_command, calculator_tool
from orchestrator.tools.search import SearchTool
from retriever.client import SearchHit

TASK = "multi-tool"  # orchestrator/tasks/multi_tool.py
DATA_SOURCE = "synthetic_years"
YEARS = (1900, 1999)
# GRPO: at the demo template's lr (1e-3) 2 of 5 training seeds collapsed from one warm start
# (an update at step 2 or 4 moved the policy's first tokens off the call format, KL 0.03 ->
# 0.19; every sample failed from then on, so no group had a signal to recover with); half the
# step and more of them (docs/benchmarks.md, "Demo, multi-tool task").
RL_STEPS = 20
RL_LR = 5e-4
EXTRA_VOCAB_PER_NAME = 4  # each name also without a leading space (`"query": "Name"`)
INSTRUCTION = (
    "Answer the question. Use search to look facts up and calculate for arithmetic. "
    "Give the final answer inside <answer> and </answer>."
)


@dataclass(frozen=True)
class BornPerson:
    name: str
    profession: str
    year: int


@dataclass(frozen=True)
class YearsQuestion:
    question: str
    answers: list[str]
    split: str  # "train" | "test"
    data_source: str


@dataclass(frozen=True)
class YearsWorld:
    people: list[BornPerson]
    questions: list[YearsQuestion]

    def corpus_rows(self) -> list[dict[str, str]]:
        """Search-R1 corpus rows: `{"id", "contents": "\\"Title\\"\\nbody"}`."""
        return [{"id": str(i), "contents": years_passage(p)} for i, p in enumerate(self.people)]

    def entity_names(self) -> list[str]:
        """The made-up names: the demo tokenizer makes each one token."""
        return [p.name for p in self.people]

    def split(self, split: str) -> list[YearsQuestion]:
        return [q for q in self.questions if q.split == split]


def years_passage(p: BornPerson) -> str:
    return f'"{p.name}"\n{p.name} is a {p.profession} who was born in {p.year}.'


def years_question(later: str, earlier: str) -> str:
    """The names in quotes: they then tokenize as in the calls' JSON (`"query": "Name"`), one
    token each (without quotes a name after a space is another token)."""
    return f'How many years apart were "{later}" and "{earlier}" born?'


def prompt_text(question: str) -> str:
    return f"{INSTRUCTION}\nQuestion: {question}\n"


def generate_years_world(
    seed: int = 0, *, n_people: int = 400, n_questions: int = 400, test_fraction: float = 0.2
) -> YearsWorld:
    """A deterministic world: `n_people` people, `n_questions` pairs of people born in
    different years (the later-born named first), split into train and test."""
    if n_people < 2 or n_questions < 1 or not 0 < test_fraction < 1:
        raise ValueError("need n_people >= 2, n_questions >= 1 and test_fraction in (0, 1)")
    rng = random.Random(seed)
    names = unique_words(rng, n_people, 3, set())
    people = [BornPerson(n, rng.choice(PROFESSIONS), rng.randint(*YEARS)) for n in names]
    questions = []
    seen: set[tuple[str, str]] = set()
    while len(questions) < n_questions:
        a, b = rng.sample(people, 2)
        if a.year == b.year:
            continue
        later, earlier = (a, b) if a.year > b.year else (b, a)
        if (later.name, earlier.name) in seen:
            continue
        seen.add((later.name, earlier.name))
        split = "test" if rng.random() < test_fraction else "train"
        answer = str(later.year - earlier.year)
        questions.append(
            YearsQuestion(years_question(later.name, earlier.name), [answer], split, DATA_SOURCE)
        )
    return YearsWorld(people, questions)


def write_years_world(world: YearsWorld, out: Path) -> dict[str, Path]:
    """`corpus.jsonl` (for the index) and the train/test rows in the Search-R1 parquet-row
    shape (`prompt`, `reward_model.ground_truth.target`), as JSON lines."""
    paths = {"corpus": write_jsonl(out / "corpus.jsonl", world.corpus_rows())}
    for split in ("train", "test"):
        rows = (make_years_row(q, i) for i, q in enumerate(world.split(split)))
        paths[split] = write_jsonl(out / f"{split}.jsonl", rows)
    return paths


def make_years_row(q: YearsQuestion, index: int) -> dict[str, Any]:
    return {
        "data_source": q.data_source,
        "prompt": [{"role": "user", "content": prompt_text(q.question)}],
        "ability": "fact-reasoning+arithmetic",
        "reward_model": {"style": "rule", "ground_truth": {"target": list(q.answers)}},
        "extra_info": {"split": q.split, "index": index},
    }


def calculator_tool_config() -> tuple[dict[str, Any], str]:
    """(the `rollout.tools` entry of the calculator, the name the policy calls it by): the
    multi-tool task's (orchestrator/tasks/multi_tool.py), which refuses to start without
    PyPI's `mcp-server-calculator`, naming it."""
    return calculator_tool(calculator_command()), MCP_CALCULATOR


def apply_to_stack_config(data: dict[str, Any], calculator: dict[str, Any]) -> None:
    """The task's settings over the demo's stack config (`configs/demo-cpu.yaml`)."""
    rollout = data["orchestrator"]["rollout"]
    rollout["action_format"] = "function_calling"
    rollout["tools"] = ["search", calculator]
    rollout["max_turns"] = 3  # searches, the calculation, the answer
    rollout.pop("stop", None)  # function calling stops on the end-of-turn token
    data["orchestrator"]["reward"] = {"function": "em"}  # the last <answer> of the response
    data["trainer"]["optim"]["lr"] = RL_LR


def tool_schemas(calculator: str) -> list[dict[str, Any]]:
    """The schemas the rollout passes to the chat template (search's, and the calculator's as
    mcp-server-calculator declares it). The demo's template does not render them; a template
    that does would get the same text at RL time."""
    calc_params = {
        "type": "object",
        "properties": {"expression": {"title": "Expression", "type": "string"}},
        "required": ["expression"],
    }
    return [
        {
            "type": "function",
            "function": {
                "name": SearchTool.name,
                "description": SearchTool.description,
                "parameters": SearchTool.parameters,
            },
        },
        {
            "type": "function",
            "function": {
                "name": calculator,
                "description": "Calculates/evaluates the given expression.",
                "parameters": calc_params,
            },
        },
    ]


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call as Qwen2.5's template shows it to the model."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def demonstration_texts(world: YearsWorld, calculator: str) -> list[str]:
    """Text for the demo tokenizer's vocabulary: the calls' JSON becomes few tokens."""
    a, b = world.people[0].name, world.people[1].name
    search = "\n".join(call_text("search", {"query": n}) for n in (a, b))
    calc = call_text(calculator, {"expression": "1987 - 1925"})
    bare = "\n".join(world.entity_names())  # each name as the JSON and the quotes split it
    return [prompt_text(q.question) for q in world.questions[:50]] + [search, calc, bare] * 30


class MultiToolSampler:
    """Demonstrations of the task with random facts (see the module doc), token-exact copies of
    what the function-calling rollout builds: the same prompt rendering, the same `tool` turns
    (`ToolTurns`), the model's turns ending at the end-of-turn token, loss mask 0 on results."""

    def __init__(
        self, world: YearsWorld, tokenizer: Any, cfg: WarmStartConfig, calculator: str
    ) -> None:
        self.tok = tokenizer
        self.cfg = cfg
        self.calculator = calculator
        self.schemas = tool_schemas(calculator)
        self.turns = ToolTurns(tokenizer, self.schemas)
        self.eot = tokenizer.eos_token
        self.names = world.entity_names()

    def sample(self, rng: random.Random, *, searched: bool, short_prompt: bool = False) -> Demo:
        """`searched`: the tools are used (else a guess). `short_prompt` is unused (the
        task's prompt is short already); it keeps `DemoSampler`'s signature."""
        del short_prompt
        a, b = rng.sample(self.names, 2)
        ya, yb = rng.sample(range(YEARS[0], YEARS[1] + 1), 2)
        (later, y_later), (earlier, y_earlier) = sorted([(a, ya), (b, yb)], key=lambda p: -p[1])
        answer = str(y_later - y_earlier)
        messages = [{"role": "user", "content": prompt_text(years_question(later, earlier))}]
        prompt = prompt_token_ids(self.tok, messages, tools=self.schemas)
        response = MaskedResponse(self.tok)

        if not searched:
            response.add(f"<answer> {rng.randint(1, YEARS[1] - YEARS[0])} </answer>{self.eot}", 1)
            return Demo(prompt, response.ids, response.mask, searched, answer)
        searches = "\n".join(call_text("search", {"query": n}) for n in (later, earlier))
        response.add(searches + self.eot, 1)
        docs = [
            self._docs(rng, BornPerson(later, rng.choice(PROFESSIONS), y_later)),
            self._docs(rng, BornPerson(earlier, rng.choice(PROFESSIONS), y_earlier)),
        ]
        response.add(self.turns.text(searches + self.eot, [("search", d) for d in docs]), 0)
        calc = call_text(self.calculator, {"expression": f"{y_later} - {y_earlier}"})
        response.add(calc + self.eot, 1)
        response.add(self.turns.text(calc + self.eot, [(self.calculator, answer)]), 0)
        response.add(f"<answer> {answer} </answer>{self.eot}", 1)
        return Demo(prompt, response.ids, response.mask, searched, answer)

    def _docs(self, rng: random.Random, person: BornPerson) -> str:
        """What `search` returns for the person's name: their passage + topk-1 distractors."""
        passages = [years_passage(person)]
        for _ in range(self.cfg.topk - 1):
            other = BornPerson(rng.choice(self.names), rng.choice(PROFESSIONS),
                               rng.randint(*YEARS))  # fmt: skip
            passages.append(years_passage(other))
        return format_docs([SearchHit(str(i), p, None) for i, p in enumerate(passages)])

    def batches(self, phase: Phase, rng: random.Random) -> Iterator[list[Demo]]:
        for _ in range(phase.steps):
            used = [rng.random() < phase.search_rate for _ in range(phase.batch_size)]
            yield [self.sample(rng, searched=u) for u in used]


def warm_start_config(seed: int, topk: int, *, quick: bool = False) -> WarmStartConfig:
    """The task's phases: `copy` (every demonstration uses the tools; the short prompt is the
    task's own) then `mix` (30% use the tools, the rest guess).

    Copying names is learned within ~400 copy steps, copying four-digit years later, and when
    varies: on one machine the copy loss was 0.0009 by step 800 (EM 0.000 -> 0.886), on another
    1,000 steps left the years uncopied and RL had no reward to climb (issue 42: 0.025 -> 0.025;
    after 900 steps the teacher-forced accuracy on digits was 0.62, after ~1,400 0.90;
    docs/benchmarks.md, "Demo, multi-tool task"). So the copy phase runs until 90% of fresh
    demonstrations come out exactly (`WarmStartConfig.copy_until`), from 600 steps, at most
    2,000."""
    if quick:
        return WarmStartConfig(copy_steps=10, copy_batch_size=8, format_steps=0, mix_steps=5,
                               batch_size=8, seed=seed, topk=topk)  # fmt: skip
    return WarmStartConfig(copy_steps=600, copy_batch_size=16, format_steps=0, mix_steps=100,
                           batch_size=16, search_rate=0.3, seed=seed, topk=topk,
                           copy_until=0.9, copy_check_every=100,
                           max_copy_steps=2000)  # fmt: skip


def tool_calls_per_question(eval_parquet: Path) -> dict[str, float]:
    """Calls per question by tool name, from an evaluation's rollout-log file (each turn's
    `query` holds its calls as JSON)."""
    import pyarrow.parquet as pq

    table = pq.read_table(eval_parquet, columns=["turns"]).to_pylist()
    counts: dict[str, int] = {}
    for row in table:
        for turn in row["turns"] or []:
            if turn["action"] not in ("tool", "invalid") or not turn["query"]:
                continue
            for call in json.loads(turn["query"]):
                counts[call.get("name", "")] = counts.get(call.get("name", ""), 0) + 1
    n = max(len(table), 1)
    return {name: c / n for name, c in sorted(counts.items())}
