"""The search tool: a global concurrency cap, a timeout per attempt, bounded retries, and a
circuit breaker (`orchestrator.tools.runner`, which every tool shares; search's probe is the
retriever's /ready).

An exhausted retry budget is an explicit outcome (`SearchOutcome.error`): the rollout shows the
policy a failure observation, records the error on the turn, flags the sample as an
infrastructure failure (left out of training by default) and counts it. Nothing becomes a
silent empty `<information></information>` (slime's client defect).

The breaker opens when a search's retries are exhausted and the retriever's /ready fails too
(an outage, or a restarted retriever still loading its index, whose /health answers at once;
not a bad query), or after `breaker_failures` exhausted searches in a row (a retriever that
says it is ready but fails searches). While it is open, searches wait (the retriever's /ready
probed every `breaker_probe_s`) instead of turning a retriever outage into
training data that says searching does not pay; so do the searches that were in flight when it
went down: they try again once it is back. A search waits at most `breaker_max_wait_s` in all.
The first successful probe closes the breaker. Open/closed is a gauge, a log line each way,
and the orchestrator's /ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.config import SearchConfig
from orchestrator.observation import format_docs
from orchestrator.tools.base import ToolError, ToolResult
from orchestrator.tools.metrics import SearchMetrics
from orchestrator.tools.runner import ToolRunner
from retriever.client import RetrieverBadRequest


class SearchClient(Protocol):
    async def search(self, queries: list[str], topk: int | None = None) -> list[list[Any]]: ...

    async def ready(self) -> bool: ...


@dataclass
class SearchOutcome:
    docs: Sequence[Any] = field(default_factory=list)  # retriever.client.SearchHit
    attempts: int = 0
    latency_s: float = 0.0
    error: str = ""


def _is_retryable(exc: BaseException) -> bool:
    # Bad requests (4xx other than 429) fail the same way every time; everything else
    # (timeouts, refused connections, 5xx, 429) may be a restarting or overloaded retriever.
    return not isinstance(exc, RetrieverBadRequest | ToolError)


class SearchTool:
    """The `search` tool (orchestrator.tools.base.Tool) with its runner (`SearchConfig`)."""

    name = "search"
    description = "Search the corpus; returns the top documents, each with its title."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "What to search for."}},
        "required": ["query"],
    }

    def __init__(self, client: SearchClient, cfg: SearchConfig) -> None:
        self.client = client
        self.cfg = cfg
        self.runner = ToolRunner(
            cfg.limits,
            SearchMetrics(self.name),
            ready=self.ready,
            retryable=_is_retryable,
            service="retriever",
        )

    @property
    def breaker_open(self) -> bool:
        return self.runner.breaker_open

    async def ready(self) -> bool:
        return await self.client.ready()

    async def _docs(self, query: str) -> Sequence[Any]:
        return (await self.client.search([query], self.cfg.topk))[0]

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """One attempt (the runner retries): the documents as the Search-R1 format renders
        them."""
        docs = await self._docs(str(arguments["query"]))
        return ToolResult(format_docs(docs), [str(d.id) for d in docs])

    async def search(self, query: str) -> SearchOutcome:
        """A search under the runner's guarantees; never raises for the retriever's trouble."""
        out = await self.runner.run(lambda: self._docs(query))
        return SearchOutcome(
            docs=out.value or [], attempts=out.attempts, latency_s=out.latency_s, error=out.error
        )
