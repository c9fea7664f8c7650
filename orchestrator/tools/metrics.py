"""Prometheus metrics of tool calls, labelled by tool (module-level by prometheus-client's
design). The search tool also keeps its original `searchr1_search_*` series (dashboards and
alerts read them)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from orchestrator import metrics as legacy

OUTCOMES = ("ok", "failed", "malformed", "unknown")
UNKNOWN = "<unknown>"  # the tool label of calls to a name no tool has (or none could be read)
TOOL_CALLS = Counter(
    "searchr1_tool_calls_total",
    "Tool calls by outcome: ok | failed (after retries, or the tool's own error) | "
    "malformed (unparsable call or arguments that fail the schema) | unknown (no such tool)",
    ["tool", "outcome"],
)
TOOL_LATENCY = Histogram(
    "searchr1_tool_latency_seconds",
    "Tool call wall time including retries and waits for the breaker",
    ["tool"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TOOL_RETRIES = Counter("searchr1_tool_retries_total", "Tool call attempts retried", ["tool"])
TOOL_FAILURES = Counter(
    "searchr1_tool_failures_total",
    "Tool calls failed after all retries, by error type",
    ["tool", "error"],
)
TOOL_BREAKER_OPEN = Gauge(
    "searchr1_tool_circuit_open", "1 while a tool's circuit breaker is open", ["tool"]
)
for _outcome in ("malformed", "unknown"):
    TOOL_CALLS.labels(UNKNOWN, _outcome)


class RunnerMetrics:
    """What a `ToolRunner` records, for one tool."""

    def __init__(self, tool: str) -> None:
        self.tool = tool
        # Exported at 0 from start-up: a panel over rate(...) shows 0, not "No data".
        for outcome in OUTCOMES:
            TOOL_CALLS.labels(tool, outcome)
        for error in ("CircuitOpen", "TimeoutError"):
            TOOL_FAILURES.labels(tool, error)
        TOOL_RETRIES.labels(tool)
        TOOL_BREAKER_OPEN.labels(tool)

    def retry(self) -> None:
        TOOL_RETRIES.labels(self.tool).inc()

    def failure(self, error: str) -> None:
        TOOL_FAILURES.labels(self.tool, error).inc()

    def latency(self, seconds: float) -> None:
        TOOL_LATENCY.labels(self.tool).observe(seconds)

    def breaker(self, is_open: bool) -> None:
        TOOL_BREAKER_OPEN.labels(self.tool).set(1 if is_open else 0)


class SearchMetrics(RunnerMetrics):
    """The search tool's: the labelled series and the original ones."""

    def retry(self) -> None:
        super().retry()
        legacy.SEARCH_RETRIES.inc()

    def failure(self, error: str) -> None:
        super().failure(error)
        legacy.SEARCH_FAILURES.labels(error).inc()

    def latency(self, seconds: float) -> None:
        super().latency(seconds)
        legacy.SEARCH_LATENCY.observe(seconds)

    def breaker(self, is_open: bool) -> None:
        super().breaker(is_open)
        legacy.RETRIEVER_BREAKER_OPEN.set(1 if is_open else 0)
