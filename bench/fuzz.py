"""Fuzz every HTTP service, each a real process, from its own OpenAPI document (Schemathesis).

    .venv/bin/python bench/fuzz.py                       # full: >= 20,000 requests
    .venv/bin/python bench/fuzz.py --examples 20 --services retriever,inference

Each operation of each service gets --examples generated requests per generation mode (positive
and negative); operations without inputs yield one. What counts against a service, and the
canary client that keeps sending a valid request meanwhile: harness/fuzz_http.py. The
last line printed is `requests=N status_5xx=N crashes=N hangs=N services=N`; the exit status is
1 when any of those (or a 4xx without a message, or a failed canary) is not zero.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

# The repo root instead of bench/ (a bench/<name>.py must not shadow a stdlib module).
sys.path[0] = str(Path(__file__).resolve().parent.parent)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from harness.fuzz_http import FuzzReport, fuzz_service, summary_line  # noqa: E402
from harness.fuzz_targets import SERVICES, fuzz_targets  # noqa: E402
from inference.tiny_model import make_tiny_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=600, help="per operation and mode")
    ap.add_argument("--services", default=",".join(SERVICES), help="comma-separated")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="a request past this hangs")
    args = ap.parse_args()
    services = [s for s in args.services.split(",") if s]
    reports: list[FuzzReport] = []
    with tempfile.TemporaryDirectory(prefix="searchr1-fuzz-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model")
        with fuzz_targets(work, model, services) as targets:
            for t in targets:
                start = time.perf_counter()
                report = fuzz_service(
                    t.name, t.url, examples=args.examples, timeout_s=args.timeout_s, **t.options
                )
                took = time.perf_counter() - start
                reports.append(report)
                print(
                    f"{t.name}: requests={report.requests} status_5xx={report.status_5xx} "
                    f"crashes={report.crashes} hangs={report.hangs} "
                    f"no_message={report.no_message} canary_failures={report.canary_failures} "
                    f"skipped={report.skipped} seconds={took:.1f} "
                    f"rate={report.requests / took:.0f}/s",
                    flush=True,
                )
                for failure in report.failures[:20]:
                    print(f"  {failure}", flush=True)
    print(summary_line(reports), flush=True)
    return 0 if all(r.clean for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
