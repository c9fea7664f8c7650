"""Container health check: GET a service's probe path on loopback; exit 0 when it answers 200.

Stdlib only and no searchr1 import, so it costs a few milliseconds. The port is the one the
service itself reads: `SEARCHR1_<SERVICE>__HTTP__PORT` when set, else the default of the
service's config model (kept equal to `<pkg>/config.py` by tests/unit/deploy/test_drift.py).

    python healthcheck.py retriever            # /ready: the index is loaded
    python healthcheck.py inference /health    # /health: the process is alive
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_PORTS = {
    "retriever": 8000,
    "inference": 30000,
    "orchestrator": 8100,
    "trainer": 8200,
    "gateway": 8300,
}


def port_of(service: str) -> int:
    return int(os.environ.get(f"SEARCHR1_{service.upper()}__HTTP__PORT", DEFAULT_PORTS[service]))


def check(service: str, path: str = "/ready", timeout_s: float = 4.0) -> bool:
    url = f"http://127.0.0.1:{port_of(service)}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in DEFAULT_PORTS:
        sys.exit(f"usage: healthcheck.py {{{','.join(DEFAULT_PORTS)}}} [path]")
    sys.exit(0 if check(*sys.argv[1:]) else 1)
