"""TCP options that bound how long a socket we own waits on a silent peer (issue 46 item 6).

A network cut that drops packets without a reset leaves a connection open: reads wait, and
unacknowledged writes are retransmitted with exponential backoff for ~15 minutes (Linux's
`tcp_retries2`). With `tcp_timeout_s` the kernel closes such a connection after that long
instead: keepalive probes find an idle one dead (`TCP_KEEPIDLE` half the bound, then
`TCP_KEEPCNT` probes `TCP_KEEPINTVL` apart), and `TCP_USER_TIMEOUT` ends one whose sent data
stays unacknowledged. Options a platform lacks are left out (macOS has no TCP_USER_TIMEOUT).
Used for every Redis connection (`searchr1.redis_retry.connect`) and for the HTTP clients'
connections to the engines and the retriever (`searchr1.json_http`, `HTTP_TCP_TIMEOUT_S`):
a call across a cut fails within the bound and the client's own retry connects again once the
cut heals, instead of waiting for the retransmission backoff (up to 2 minutes between tries) or
its read timeout (600 s for a generation). A slow or frozen peer is not cut off: its kernel
answers the probes and acknowledges what is sent. The weight group's gloo sockets are torch's,
bounded by the group's own timeout instead (`searchr1.weightsync.group`).
"""

from __future__ import annotations

import socket

KEEPALIVE_PROBES = 3
HTTP_TCP_TIMEOUT_S = 30.0  # the HTTP clients' bound (the bus's default `tcp_timeout_s` too)


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


def socket_options(tcp_timeout_s: float) -> list[tuple[int, int, int]]:
    """`(level, option, value)` triples: SO_KEEPALIVE on and `keepalive_options`: the form
    httpx's transport `socket_options` takes (`searchr1.json_http` sets them on aiohttp's)."""
    tcp = [(socket.IPPROTO_TCP, k, v) for k, v in keepalive_options(tcp_timeout_s).items()]
    return [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1), *tcp]
