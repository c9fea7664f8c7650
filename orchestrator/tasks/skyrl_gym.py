"""`skyrl-gym`: any skyrl-gym text environment (`BaseTextEnv`) as a multi-turn task.

    task: {name: skyrl-gym, options: {env: gsm8k_multi_turn, train_path: data/train.jsonl,
                                      eval_path: data/test.jsonl, max_turns: 3}}

Rows are skyrl's dataset rows (JSONL or parquet): `{"prompt": [messages], "env_class"?,
"reward_spec": {"ground_truth": ...}, "extra_info": {...}, "data_source"?}`. A row's
`env_class` overrides the `env` option, as in SkyRL. The row's `reward_spec` and `extra_info`
travel in `Prompt.metadata` (JSON) so a prompt alone can rebuild its environment.

Each sample gets its own environment, made as SkyRL makes it:
`skyrl_gym.make(env_class, env_config=OmegaConf(env_config), extras={"reward_spec",
"extra_info", "max_turns"?})`, then `init(prompt)`, then `step(text)` once per model message,
`close()` at the end. skyrl envs are synchronous (search and sql do blocking I/O): make, init,
step and close run in a worker thread, under the loop's per-turn deadline. The env is made on
the first step, not in `episode()`, so that a failing constructor (a missing ground truth) is
an infrastructure failure of that sample, not an exception in the rollout.

Mapping of `step`'s output: `observations` -> `EnvStep.observation` (chat messages, rendered
by the model's chat template, mask 0), `reward` -> the turn's reward, `done` -> done, the
numeric values of `metadata` -> `EnvStep.info`.

Not carried over:
- `postprocessed_action`: an env may rewrite the model's message (cut it at a tag). The ids
  trained on are always the model's own (token-exact), so a rewrite is ignored; each is
  counted (`rewritten_actions`) so an env that relies on it shows up.
- `init` rewriting the prompt: the row's messages are rendered before the env exists, so an
  env whose `init` returns other messages (skyrl's `rlm` adds a system prompt) fails its
  sample saying so, rather than train on a prompt the env did not mean.

Rubric: the sum of the turn rewards (skyrl's envs give per-turn rewards and SkyRL sums them
into the trajectory's return); `em` = 1.0 when some turn's reward reached 1.0, skyrl's full
credit (gsm8k's correct answer); plus the env's own numeric `get_metrics()`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from orchestrator.data import read_rows
from orchestrator.sample import Prompt, Sample
from orchestrator.tasks.base import EnvStep, Episode, Split, Task

MISSING = "task skyrl-gym needs the package skyrl-gym (pip install 'searchr1[envs]')"
RESERVED = {"reward", "em", "rewritten_actions"}


def _golds(reward_spec: Any) -> list[str]:
    """Gold answers for logs and demonstrations: the ground truth as text (a list's items; a
    dict's `target`, as skyrl's search rows have)."""
    truth = reward_spec.get("ground_truth") if isinstance(reward_spec, dict) else None
    if isinstance(truth, dict) and "target" in truth:
        truth = truth["target"]
    if truth is None:
        return []
    if isinstance(truth, list | tuple):
        return [str(t) for t in truth]
    return [truth if isinstance(truth, str) else json.dumps(truth)]


def _numbers(values: Any) -> dict[str, float]:
    """The numeric entries of a dict (metrics must be floats)."""
    if not isinstance(values, dict):
        return {}
    return {str(k): float(v) for k, v in values.items() if isinstance(v, int | float)}


class SkyRLEpisode(Episode):
    """One skyrl env, made on the first message and stepped in a worker thread."""

    def __init__(self, task: SkyRLGymTask, prompt: Prompt) -> None:
        self.task, self.prompt = task, prompt
        self.env: Any = None
        self.rewritten = 0

    def _start(self) -> None:
        meta = self.prompt.metadata
        self.env = self.task.make(meta["env_class"], json.loads(meta.get("extras", "{}")))
        messages, _ = self.env.init([dict(m) for m in self.prompt.messages])
        shown = [{"role": m["role"], "content": m["content"]} for m in self.prompt.messages]
        if [{"role": m.get("role"), "content": m.get("content")} for m in messages] != shown:
            raise RuntimeError(
                f"skyrl env {meta['env_class']!r} rewrote the prompt in init(); the row's "
                "messages are what the model read, so this env is not supported"
            )

    async def step(self, action: str) -> EnvStep:
        if self.env is None:
            await asyncio.to_thread(self._start)
        out = await asyncio.to_thread(self.env.step, action)
        post = out.get("postprocessed_action")
        info = _numbers(out.get("metadata"))
        if post is not None and post != action:  # ignored: the ids are the model's own
            self.rewritten += 1
            info["rewritten_action"] = 1.0
        observation = [dict(m) for m in out.get("observations") or []]
        return EnvStep(
            observation=observation,
            reward=float(out.get("reward") or 0.0),
            done=bool(out.get("done")),
            info=info,
        )

    def metrics(self) -> dict[str, float]:
        if self.env is None:
            return {}
        try:
            found = _numbers(self.env.get_metrics())
        except Exception:  # metrics are a courtesy; the reward does not depend on them
            return {}
        return {k: v for k, v in found.items() if k not in RESERVED}

    async def close(self) -> None:
        if self.env is not None:
            await asyncio.to_thread(self.env.close)


class SkyRLGymTask(Task):
    name = "skyrl-gym"
    description = "A skyrl-gym text environment (gsm8k, gsm8k_multi_turn, ...), one per sample."

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.check_options({"env", "train_path", "eval_path", "env_config", "max_turns"})
        try:
            import skyrl_gym
            from omegaconf import OmegaConf
            from skyrl_gym.envs.registration import registry
        except ImportError as e:
            raise ValueError(MISSING) from e
        self._skyrl, self._omegaconf, self._registry = skyrl_gym, OmegaConf, registry
        self.env = self.options.get("env")
        if self.env is not None:
            self._check_env(str(self.env), "options.env")
        if not self.options.get("train_path"):
            raise ValueError("options.train_path (skyrl-gym rows, JSONL or parquet) is required")
        env_config = self.options.get("env_config") or {}
        if not isinstance(env_config, dict):
            raise ValueError("options.env_config must be a mapping (the env's settings)")
        self.env_config = dict(env_config)
        max_turns = self.options.get("max_turns")
        self.max_turns = None if max_turns is None else int(max_turns)
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError("options.max_turns must be >= 1")

    def _check_env(self, env: str, where: str) -> None:
        if env not in self._registry:
            raise ValueError(
                f"{where}: skyrl-gym has no environment {env!r} (known: "
                f"{', '.join(sorted(self._registry))})"
            )

    def rows(self, split: Split) -> list[Prompt]:
        path = self.options.get("train_path" if split == "train" else "eval_path")
        if not path:
            return []
        prompts = []
        for i, row in enumerate(read_rows(path)):
            where = f"{path} row {i}"
            env = row.get("env_class") or self.env
            if not env:
                raise ValueError(f"{where}: no env_class, and options.env is unset")
            self._check_env(str(env), where)
            try:
                messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
            except (KeyError, TypeError) as e:
                raise ValueError(f"{where}: prompt must be a list of messages ({e})") from e
            if not messages:
                raise ValueError(f"{where}: empty prompt")
            reward_spec = row.get("reward_spec") or {}
            extras = {"reward_spec": reward_spec, "extra_info": row.get("extra_info") or {}}
            source = str(row.get("data_source") or f"{self.name}/{env}")
            prompts.append(
                Prompt(
                    prompt_id=f"{source}/{split}/{i}",
                    data_source=source,
                    messages=messages,
                    golds=_golds(reward_spec),
                    metadata={
                        "split": split,
                        "index": str(i),
                        "env_class": str(env),
                        "extras": json.dumps(extras, default=str),
                    },
                )
            )
        return prompts

    def make(self, env: str, extras: dict[str, Any]) -> Any:
        """A fresh env as SkyRL's generator makes one (`max_turns` in extras when set)."""
        extras = dict(extras)
        if self.max_turns is not None:
            extras["max_turns"] = self.max_turns
        config = self._omegaconf.create(self.env_config)
        return self._skyrl.make(env, env_config=config, extras=extras)

    def episode(self, prompt: Prompt) -> Episode:
        return SkyRLEpisode(self, prompt)

    def score(self, sample: Sample, episode: Episode) -> dict[str, float]:
        """Sum of the env's turn rewards; `em`: some turn earned full credit (1.0)."""
        rewards = [t.reward for t in sample.turns]
        scored = {
            "reward": float(sum(rewards)),
            "em": float(any(r >= 1.0 for r in rewards)),
            "rewritten_actions": 0.0,
        }
        if isinstance(episode, SkyRLEpisode):
            scored["rewritten_actions"] = float(episode.rewritten)
            scored.update(episode.metrics())
        return scored

    def demonstration(self, prompt: Prompt) -> list[str]:
        """The ground truth in gsm8k's answer format (`#### N`), the shape skyrl's math envs
        read; other envs have no scripted policy here."""
        env = prompt.metadata.get("env_class", "")
        if not env.startswith("gsm8k") or not prompt.golds:
            raise NotImplementedError(f"task {self.name!r} has no demonstration for {env!r}")
        return [f"#### {prompt.golds[0]}"]
