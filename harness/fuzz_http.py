"""Schema-driven fuzzing of a running HTTP service (Schemathesis over its own /openapi.json).

    report = fuzz_service("retriever", url, examples=50)
    assert report.clean, report.failures

Every operation of the service's OpenAPI document gets `examples` generated requests in each
generation mode (positive: fits the schema; negative: breaks it somewhere). A request passes
when the answer is a 2xx, or a 4xx whose JSON body carries a message (`detail`, `error` or
`message`) -- plain-text 2xx answers are fine. Counted against the service: a 5xx, a request
with no answer in `timeout_s` (a hang), a dropped connection (a crash), and a service that is
not `/ready` at the end; with a `canary` request, another client sends it over and over while
the fuzzer runs and every answer must be a 2xx. Requests the client itself cannot send (a
header `requests` refuses) are skipped, not counted.

Routes in `skip` are left out; with `token`, the positive pass sends the bearer token except
to the routes in `without_token` (admin routes whose effects would stall the fuzzing itself,
e.g. a pause, or reach other machines: fuzzed as an intruder, they must refuse). The negative
pass never sends the token.
Hypothesis runs with shrinking off: the first failing example is the one reported.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

# Answers over this many bytes are not kept in the failure list.
_SNIPPET = 300


@dataclass
class FuzzReport:
    service: str
    requests: int = 0
    status_5xx: int = 0
    crashes: int = 0
    hangs: int = 0
    no_message: int = 0
    skipped: int = 0
    canary_failures: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        bad = self.status_5xx + self.crashes + self.hangs + self.no_message + self.canary_failures
        return bad == 0

    def add(self, other: FuzzReport) -> None:
        for name in (
            "requests",
            "status_5xx",
            "crashes",
            "hangs",
            "no_message",
            "skipped",
            "canary_failures",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.failures += other.failures


def _has_message(response: requests.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    return any(body.get(k) for k in ("detail", "error", "message"))


def _describe(case: schemathesis.Case, what: str) -> str:
    body = case.body if not isinstance(case.body, bytes) else case.body[:_SNIPPET]
    sent = {"query": case.query, "headers": case.headers, "body": body}
    text = json.dumps(sent, default=repr)[:_SNIPPET]
    return f"{case.method} {case.path}: {what}; sent {text}"


def _record(report: FuzzReport, case: schemathesis.Case, response: requests.Response) -> None:
    status = response.status_code
    if status >= 500:
        report.status_5xx += 1
        report.failures.append(_describe(case, f"{status} {response.text[:_SNIPPET]}"))
    elif status >= 400 and not _has_message(response):
        report.no_message += 1
        report.failures.append(_describe(case, f"{status} without a message"))


def _has_inputs(operation: schemathesis.APIOperation) -> bool:
    return bool(operation.body) or any(
        len(params) for params in (operation.query, operation.headers, operation.path_parameters)
    )


def fuzz_operation(
    report: FuzzReport,
    operation: schemathesis.APIOperation,
    url: str,
    *,
    examples: int,
    mode: GenerationMode,
    headers: dict[str, str] | None,
    timeout_s: float,
    session: requests.Session,
) -> None:
    strategy = operation.as_strategy(generation_mode=mode, headers=headers)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: failures are counted
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @given(case=strategy)
    def one(case: schemathesis.Case) -> None:
        try:
            response = case.call(base_url=url, session=session, timeout=timeout_s)
        except requests.Timeout:
            report.requests += 1
            report.hangs += 1
            report.failures.append(_describe(case, f"no answer in {timeout_s}s"))
            return
        except requests.ConnectionError as e:
            report.requests += 1
            report.crashes += 1
            report.failures.append(_describe(case, f"connection failed: {e}"))
            return
        except (ValueError, UnicodeError, requests.exceptions.InvalidHeader):
            report.skipped += 1  # the client could not send it; the service never saw it
            return
        report.requests += 1
        _record(report, case, response)

    # Unsatisfiable: negative mode where nothing can be broken (an optional header only).
    with contextlib.suppress(Unsatisfiable):
        one()


def fuzz_service(
    service: str,
    url: str,
    *,
    examples: int,
    token: str | None = None,
    skip: Iterable[str] = (),
    without_token: Iterable[str] = (),
    modes: Iterable[GenerationMode] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
    timeout_s: float = 30.0,
    canary: Canary | None = None,
) -> FuzzReport:
    """Fuzz every operation of the service at `url`; the report of what went wrong."""
    with _CanaryThread(url, canary, timeout_s) as watch:
        report = _fuzz_all(service, url, examples, token, skip, without_token, modes, timeout_s)
    report.canary_failures = watch.failures
    report.failures += watch.errors[:5]
    return report


# A well-formed request (method, path, JSON body) that must keep succeeding while fuzzing runs.
Canary = tuple[str, str, dict[str, Any] | None]


class _CanaryThread(threading.Thread):
    """Sends the canary request over and over while the fuzzer runs: another client of the
    service, which must keep getting 2xx answers."""

    def __init__(self, url: str, canary: Canary | None, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.canary, self.timeout_s = url, canary, timeout_s
        self.stop = threading.Event()
        self.failures, self.errors = 0, list[str]()

    def run(self) -> None:
        assert self.canary is not None
        method, path, body = self.canary
        while not self.stop.wait(0.2):
            try:
                r = requests.request(method, self.url + path, json=body, timeout=self.timeout_s)
                ok, what = r.ok, f"{r.status_code} {r.text[:_SNIPPET]}"
            except requests.RequestException as e:
                ok, what = False, repr(e)
            if not ok:
                self.failures += 1
                self.errors.append(f"canary {method} {path}: {what}")

    def __enter__(self) -> _CanaryThread:
        if self.canary is not None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.is_alive():
            self.join()


def _fuzz_all(
    service: str,
    url: str,
    examples: int,
    token: str | None,
    skip: Iterable[str],
    without_token: Iterable[str],
    modes: Iterable[GenerationMode],
    timeout_s: float,
) -> FuzzReport:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=timeout_s)
    skipped, anonymous = set(skip), set(without_token)
    report = FuzzReport(service)
    auth = {"Authorization": f"Bearer {token}"} if token else None
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            if operation.path in skipped:
                continue
            for mode in modes:
                if mode == GenerationMode.NEGATIVE and not _has_inputs(operation):
                    continue  # nothing to break
                trusted = mode == GenerationMode.POSITIVE and operation.path not in anonymous
                headers = auth if trusted else None
                fuzz_operation(
                    report,
                    operation,
                    url,
                    examples=examples,
                    mode=mode,
                    headers=headers,
                    timeout_s=timeout_s,
                    session=session,
                )
    try:
        ready = requests.get(f"{url}/ready", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        ready = False
    if not ready:
        report.crashes += 1
        report.failures.append(f"{service} is not /ready after fuzzing")
    return report


def summary_line(reports: list[FuzzReport]) -> str:
    """The bench's last line."""
    total = FuzzReport("all")
    for r in reports:
        total.add(r)
    return (
        f"requests={total.requests} status_5xx={total.status_5xx} crashes={total.crashes} "
        f"hangs={total.hangs} services={len(reports)}"
    )
