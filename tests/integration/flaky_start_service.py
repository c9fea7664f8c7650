"""A child for the supervisor's tests that behaves by plan, one step per start: the trainer
restarted while Redis is frozen, as bench/chaos.py met it (issue 46).

python -m tests.integration.flaky_start_service PORT COUNTER_FILE PLAN

PLAN is a comma list, one entry per start (the last repeats): `ready` serves /ready (200)
until stopped; `ready-die:S` serves it for S seconds, then exits 1 (a crash after it was
ready); `exit:S` exits 1 after S seconds without ever being ready (its dependency did not
answer in time); `hang` never serves (a start that never ends).
"""

from __future__ import annotations

import http.server
import sys
import threading
import time
from pathlib import Path


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/ready" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:  # quiet: the log is the test's evidence
        pass


def main() -> None:
    port, counter, plan = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
    n = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(n + 1))
    step = plan[min(n, len(plan) - 1)]
    action, _, arg = step.partition(":")
    print(f"start {n + 1}: {step}", flush=True)
    if action == "exit":
        time.sleep(float(arg or 0))
        print("redis unreachable for the start-up deadline", flush=True)
        raise SystemExit(1)
    if action == "hang":
        time.sleep(3600)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if action == "ready-die":
        time.sleep(float(arg or 0))
        print("lease lost", flush=True)
        raise SystemExit(1)
    time.sleep(3600)


if __name__ == "__main__":
    main()
