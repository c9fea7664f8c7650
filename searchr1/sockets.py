"""TCP options that bound how long a socket we own waits on a silent peer (issue 46 item 6).

A network cut that drops packets without a reset leaves a connection open: reads wait, and
unacknowledged writes are retransmitted with exponential backoff for ~15 minutes (Linux's
`tcp_retries2`). With `tcp_timeout_s` the kernel closes such a connection after that long
instead: keepalive probes find an idle one dead (`TCP_KEEPIDLE` half the bound, then
`TCP_KEEPCNT` probes `TCP_KEEPINTVL` apart), and `TCP_USER_TIMEOUT` ends one whose sent data
stays unacknowledged. Options a platform lacks are left out (macOS has no TCP_USER_TIMEOUT).
Used for every Redis connection (`searchr1.redis_retry.connect`); the weight group's gloo
sockets are torch's, bounded by the group's own timeout instead (`searchr1.weightsync.group`).
"""

from __future__ import annotations

import socket

KEEPALIVE_PROBES = 3


def keepalive_options(tcp_timeout_s: float) -> dict[int, int]:
    """`{option: value}` for IPPROTO_TCP (with SO_KEEPALIVE on) so that a dead peer is found
    within `tcp_timeout_s`: the form redis-py's `socket_keepalive_options` takes."""
    if tcp_timeout_s < 1:
        raise ValueError(f"tcp_timeout_s must be >= 1 s (got {tcp_timeout_s})")
    idle = max(1, int(tcp_timeout_s / 2))
    interval = max(1, int((tcp_timeout_s - idle) / KEEPALIVE_PROBES))
    wanted = {
        "TCP_KEEPIDLE": idle,
        "TCP_KEEPINTVL": interval,
        "TCP_KEEPCNT": KEEPALIVE_PROBES,
        "TCP_USER_TIMEOUT": int(tcp_timeout_s * 1000),  # milliseconds
    }
    return {getattr(socket, k): v for k, v in wanted.items() if hasattr(socket, k)}
