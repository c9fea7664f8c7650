"""`searchr1 agent run`: a user's agent program, run N times per row against the gateway.

The program is an async function `agent(base_url, row)`: `base_url` is an OpenAI base URL
of its own session (`<gateway>/sessions/<id>/v1`, so an unmodified `AsyncOpenAI(base_url=...)`
client needs no headers), `row` one row of the data. It returns its reward (a number, or a
dict with `reward` and other numbers as components), or anything a reward function
(`--reward`, `f(row, result)`) scores; with `--task`, the rows are the task's and a program
that returns None is scored by the task's rubric (gateway.rubric). Each row's N sessions form
one GRPO group. A session runs under a deadline; one that fails, times out, has no reward or
whose rubric raises is ended without one, so the gateway dead-letters it (counted there and
here), never trains on it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway import metrics
from gateway.rubric import RubricError, TaskRubric
from searchr1.dotted import load_object

log = logging.getLogger(__name__)

AgentFn = Callable[[str, dict[str, Any]], Awaitable[Any]]
RewardFn = Callable[[dict[str, Any], Any], Any]
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@-]")


def load_program(path: str) -> AgentFn:
    """The agent function named by `path`; ValueError unless it is `async def f(base_url,
    row)`."""
    fn = load_object(path)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent program {path!r} must be an async function (base_url, row)")
    _takes(fn, 2, f"agent program {path!r}")
    return fn  # type: ignore[no-any-return]


def load_reward(path: str) -> RewardFn:
    fn = load_object(path)
    if not callable(fn):
        raise ValueError(f"reward {path!r} is not callable")
    _takes(fn, 2, f"reward {path!r}")
    return fn  # type: ignore[no-any-return]


def _takes(fn: Callable[..., Any], n: int, what: str) -> None:
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError as e:
        raise ValueError(f"{what} must take {n} positional arguments: {e}") from None


def load_rows(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file (or a file holding one JSON list), each an object."""
    text = path.read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: every row must be a JSON object")
    return rows[:limit] if limit else rows


def reward_of(value: Any) -> tuple[float | None, dict[str, float]]:
    """(final reward, components) of what a program or reward function returned."""
    if isinstance(value, bool | int | float):
        reward, components = float(value), {}
    elif isinstance(value, dict) and isinstance(value.get("reward"), bool | int | float):
        reward = float(value["reward"])
        components = {
            str(k): float(v)
            for k, v in value.items()
            if k != "reward" and isinstance(v, int | float) and math.isfinite(v)
        }
    else:
        return None, {}
    return (reward, components) if math.isfinite(reward) else (None, {})


@dataclass
class SessionOutcome:
    session_id: str
    group_id: str
    outcome: str  # rewarded | no_reward | error | timeout | rubric_error
    reward: float | None = None
    error: str = ""
    status: str = ""  # the gateway's: ended | dead_lettered


@dataclass
class RunSummary:
    sessions: list[SessionOutcome] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return dict(Counter(s.outcome for s in self.sessions))

    def mean_reward(self) -> float | None:
        rewards = [s.reward for s in self.sessions if s.reward is not None]
        return sum(rewards) / len(rewards) if rewards else None


class AgentRunner:
    def __init__(
        self,
        gateway_url: str,
        program: AgentFn,
        *,
        reward: RewardFn | None = None,
        task: TaskRubric | None = None,
        samples_per_row: int = 1,
        concurrency: int = 16,
        timeout_s: float = 600.0,
        run_id: str = "run",
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.program = program
        self.reward = reward
        self.task = task
        self.samples_per_row = samples_per_row
        self.timeout_s = timeout_s
        self.run_id = run_id
        self._slots = asyncio.Semaphore(concurrency)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(
            base_url=self.gateway_url, headers=headers, timeout=60.0, transport=transport
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def run(self, rows: list[dict[str, Any]]) -> RunSummary:
        jobs = [
            self._session(i, row, k)
            for i, row in enumerate(rows)
            for k in range(self.samples_per_row)
        ]
        return RunSummary(list(await asyncio.gather(*jobs)))

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self.http.post(path, json=body)
        if resp.status_code >= 400:
            raise RuntimeError(f"gateway {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return dict(resp.json())

    async def _session(self, index: int, row: dict[str, Any], k: int) -> SessionOutcome:
        row_id = str(row.get("id", index))
        group_id = f"{self.run_id}/{index}"
        sid = _UNSAFE.sub("_", f"{self.run_id}.{index}.{k}")
        out = SessionOutcome(sid, group_id, "error")
        context = {"session_id": sid, "group_id": group_id, "row_id": row_id}
        async with self._slots:
            try:
                opened = await self._post(
                    "/v1/sessions",
                    {
                        "id": sid,
                        "group_id": group_id,
                        "group_size": self.samples_per_row,
                        "row_id": row_id,
                        "data_source": str(row.get("data_source", "")),
                        # our deadline ends the session first; the gateway's is the backstop
                        "timeout_s": self.timeout_s + 60.0,
                    },
                )
            except (httpx.HTTPError, RuntimeError) as e:
                out.error = f"could not open the session: {e}"
                log.error("session not opened", extra={**context, "error": out.error})
                metrics.AGENT_SESSIONS.labels("error").inc()
                return out
            base_url = self.gateway_url + opened["base_path"]
            try:
                result = await asyncio.wait_for(self.program(base_url, row), self.timeout_s)
                if self.reward is not None:
                    result = self.reward(row, result)
                    if inspect.isawaitable(result):
                        result = await result
                if result is None and self.task is not None:
                    out.reward, components = await self._task_score(sid, row)
                else:
                    out.reward, components = reward_of(result)
                out.outcome = "rewarded" if out.reward is not None else "no_reward"
                if out.reward is None:
                    out.error = f"no reward: the program returned {result!r:.200}"
            except RubricError as e:
                out.outcome, out.error = "rubric_error", str(e)
                components = {}
            except TimeoutError:
                out.outcome, out.error = "timeout", f"no result within {self.timeout_s}s"
                components = {}
            except Exception as e:
                out.outcome, out.error = "error", f"{type(e).__name__}: {e}"
                components = {}
            metrics.AGENT_SESSIONS.labels(out.outcome).inc()
            if out.outcome != "rewarded":
                log.warning("session without a reward", extra={**context, "error": out.error})
            try:
                body = {"reward": out.reward, "components": components}
                out.status = (await self._post(f"/v1/sessions/{sid}/end", body))["status"]
            except (httpx.HTTPError, RuntimeError) as e:
                out.status = "unknown"
                log.error("session not ended", extra={**context, "error": str(e)})
        return out

    async def _task_score(self, sid: str, row: dict[str, Any]) -> tuple[float, dict[str, float]]:
        """The task's rubric on what the policy generated in session `sid`."""
        assert self.task is not None
        resp = await self.http.get(f"/v1/sessions/{sid}")
        if resp.status_code >= 400:
            raise RuntimeError(
                f"gateway: session {sid}: HTTP {resp.status_code}: {resp.text[:300]}"
            )
        try:  # a hung episode or rubric (a judge over HTTP) is the rubric's failure
            return await asyncio.wait_for(self.task.score(row, dict(resp.json())), self.timeout_s)
        except TimeoutError:
            raise RubricError(f"the task's rubric gave no score within {self.timeout_s}s") from None
