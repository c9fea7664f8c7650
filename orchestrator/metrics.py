"""Prometheus metrics of the orchestrator (module-level by prometheus-client's design)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from orchestrator.sample import Sample, Status

SAMPLES = Counter("searchr1_rollout_samples_total", "Finished rollout samples", ["status"])
GROUPS_PUBLISHED = Counter("searchr1_rollout_groups_published_total", "Groups on the bus")
GROUP_SKIP_REASONS = ("already_published", "stale", "error", "filtered", "surplus")
GROUPS_SKIPPED = Counter(
    "searchr1_rollout_groups_skipped_total", "Groups not published", ["reason"]
)
DISCARDED_TOKENS = Counter(
    "searchr1_rollout_discarded_tokens_total",
    "Model tokens generated for groups that are never trained",
    ["reason"],  # stale | error | filtered (group_filter) | surplus (over-sampling)
)
STALE_REGENERATED = Counter(
    "searchr1_rollout_stale_regenerated_total", "Groups regenerated for exceeding max_staleness"
)
ROLLOUT_LOG_FAILURES = Counter(
    "searchr1_rollout_log_failures_total",
    "Rollout log writes that failed (a full disk...); the rollouts go on",
)
RESPONSE_TOKENS = Counter("searchr1_rollout_response_tokens_total", "Response tokens", ["kind"])
TURNS = Histogram(
    "searchr1_rollout_turns_per_sample", "Generation calls per sample", buckets=(1, 2, 3, 4, 6, 8)
)
SEARCHES = Histogram(
    "searchr1_rollout_searches_per_sample", "Searches per sample", buckets=(0, 1, 2, 3, 4, 6, 8)
)
RESPONSE_LEN = Histogram(
    "searchr1_rollout_response_length_tokens",
    "Response length in tokens (model + observation)",
    buckets=(64, 128, 256, 512, 1024, 2048, 4096, 8192),
)
OBS_FRACTION = Gauge(
    "searchr1_rollout_observation_fraction", "Observation share of response tokens (last step)"
)
REWARD_MEAN = Gauge("searchr1_rollout_reward_mean", "Mean reward of the last step")
EM_MEAN = Gauge("searchr1_rollout_em_mean", "Mean exact match of the last step")
TRUNCATION_RATE = Gauge(
    "searchr1_rollout_truncation_rate", "Share of samples ending on a token budget (last step)"
)
INVALID_ACTION_RATE = Gauge(
    "searchr1_rollout_invalid_action_rate", "Share of turns with no valid action (last step)"
)
STALENESS = Histogram(
    "searchr1_rollout_staleness_versions",
    "Engine weight version at publish minus the sample's weight version",
    buckets=(0, 1, 2, 3, 4, 8),
)
WEIGHT_WAIT = Gauge(
    "searchr1_rollout_weight_wait_seconds",
    "How long the current wait for the engine to serve a step's weights has lasted (0: none)",
)
STEP = Gauge("searchr1_rollout_step", "Last finished rollout step")
THROUGHPUT = Gauge("searchr1_rollout_samples_per_second", "Samples per second (last step)")
SEARCH_LATENCY = Histogram(
    "searchr1_search_latency_seconds",
    "Search wall time including retries",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
SEARCH_RETRIES = Counter("searchr1_search_retries_total", "Search attempts retried")
SEARCH_FAILURES = Counter(
    "searchr1_search_failures_total", "Searches failed after all retries", ["error"]
)
# The error label is the exception's class name; these are the retriever client's and the
# tool runner's (orchestrator.tools.runner).
SEARCH_FAILURE_ERRORS = (
    "CircuitOpen",
    "TimeoutError",
    "RetrieverUnavailable",
    "RetrieverBadRequest",
)
RETRIEVER_BREAKER_OPEN = Gauge(
    "searchr1_retriever_circuit_open", "1 while searches wait for a retriever that is down"
)
EVAL_SCORE = Gauge(
    "searchr1_eval_score",
    "Greedy validation score on the fixed subset (last evaluation)",
    ["data_source", "metric"],
)
PREFIX_TOKENS = Counter(
    "searchr1_rollout_prefix_tokens_total",
    "Input tokens of generate calls that an engine's prefix cache could serve (turn first: the "
    "prompt, shared by a group; later: the previous call's input and output), source "
    "cacheable; and those the engine reported as cached (meta_info.cached_tokens), source "
    "cached. cached / cacheable per turn is the hit rate of the routing and the cache.",
    ["turn", "source"],
)
ENGINE_RETRIES = Counter("searchr1_rollout_engine_retries_total", "Generate calls retried")
ENGINE_ABORTS = Counter(
    "searchr1_rollout_engine_aborts_total", "Generate calls aborted by the engine and re-issued"
)


def observe_sample(s: Sample) -> None:
    SAMPLES.labels(s.status.value if s.status else "unknown").inc()
    n_obs = len(s.loss_mask) - sum(s.loss_mask)
    RESPONSE_TOKENS.labels("model").inc(sum(s.loss_mask))
    RESPONSE_TOKENS.labels("observation").inc(n_obs)
    TURNS.observe(len(s.turns))
    SEARCHES.observe(sum(t.searches for t in s.turns))
    RESPONSE_LEN.observe(len(s.response_ids))


def step_summary(samples: list[Sample], seconds: float) -> dict[str, float]:
    """Aggregates of one step: set the gauges and return them (for logs and eval)."""
    n = max(len(samples), 1)
    tokens = sum(len(s.loss_mask) for s in samples)
    obs = tokens - sum(sum(s.loss_mask) for s in samples)
    turns = [t for s in samples for t in s.turns]
    budget = (Status.RESPONSE_BUDGET, Status.MAX_TURNS, Status.TRUNCATED, Status.CONTEXT_LIMIT)
    summary = {
        "samples": float(len(samples)),
        "reward_mean": sum(s.reward for s in samples) / n,
        "em_mean": sum(s.reward_components.get("em", 0.0) for s in samples) / n,
        "observation_fraction": obs / tokens if tokens else 0.0,
        "truncation_rate": sum(s.status in budget for s in samples) / n,
        "invalid_action_rate": (
            sum(t.action == "invalid" for t in turns) / len(turns) if turns else 0.0
        ),
        "turns_mean": len(turns) / n,
        "searches_mean": sum(t.searches for t in turns) / n,
        "search_errors": float(sum(bool(t.error) for t in turns)),
        "samples_per_s": len(samples) / seconds if seconds > 0 else 0.0,
    }
    REWARD_MEAN.set(summary["reward_mean"])
    EM_MEAN.set(summary["em_mean"])
    OBS_FRACTION.set(summary["observation_fraction"])
    TRUNCATION_RATE.set(summary["truncation_rate"])
    INVALID_ACTION_RATE.set(summary["invalid_action_rate"])
    THROUGHPUT.set(summary["samples_per_s"])
    return summary


# Fault counters exported at 0 from start-up: a dashboard's rate() shows 0 on a healthy run,
# not "No data" until the first fault.
for _reason in GROUP_SKIP_REASONS:
    GROUPS_SKIPPED.labels(_reason)
for _error in SEARCH_FAILURE_ERRORS:
    SEARCH_FAILURES.labels(_error)
