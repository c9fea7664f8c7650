"""Every HTTP service, as a real process, fuzzed from its own OpenAPI document (Schemathesis):
each generated request gets a 2xx or a 4xx with a message -- never a 5xx, a dropped connection
or a hang -- a canary client keeps being served meanwhile, and the service is /ready after.
A few hundred requests here; bench/fuzz.py runs the same over >= 20,000."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.fuzz_http import fuzz_service, summary_line
from harness.fuzz_targets import SERVICES, Target, fuzz_targets

# ~60 s of the 2-core machine: run by `dev.py slow` (CI), not the default suite.
pytestmark = pytest.mark.slow

EXAMPLES = 8


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str):  # type: ignore[no-untyped-def]
    with fuzz_targets(tmp_path_factory.mktemp("fuzz"), Path(tiny_model_dir)) as started:
        yield {t.name: t for t in started}


@pytest.mark.parametrize("service", SERVICES)
def test_fuzzed_service_never_fails(targets: dict[str, Target], service: str) -> None:
    t = targets[service]
    report = fuzz_service(t.name, t.url, examples=EXAMPLES, **t.options)
    print(summary_line([report]))
    assert report.requests >= 20
    assert report.clean, "\n".join(report.failures[:10])
