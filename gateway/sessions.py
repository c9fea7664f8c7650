"""Sessions and their groups: who they are, their deadlines, rewards and how they end.

A session is one run of an agent (one GRPO sample); it holds its trajectory segments
(`gateway.bridge.Segment`). A group is the N sessions of one task row (`X-Group-Id` +
`X-Group-Size`, or `POST /v1/sessions`); a session named without a group is a group of one.
A session that ends without a final reward, or is still open at its deadline, is dead-lettered
(counted, never trained on). A group is done when all N sessions have ended, or at its deadline
(its open sessions are dead-lettered then); its rewarded sessions are published together.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.bridge import ModelCall, Segment
from gateway.errors import GatewayError
from gateway.metrics import LIVE_SESSIONS

_SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,200}")


@dataclass(frozen=True)
class Ident:
    """Who a request belongs to: its session, and the group it joins when it starts one."""

    session_id: str
    group_id: str | None = None
    group_size: int | None = None
    row_id: str = ""
    data_source: str = ""


@dataclass
class Session:
    id: str
    group: Group
    row_id: str
    data_source: str
    deadline: float  # monotonic
    segments: list[Segment] = field(default_factory=list)
    turns: int = 0  # model calls so far, all segments
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    ended: bool = False
    dead: str = ""  # the dead-letter reason, once it is one
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def turn(self, index: int) -> ModelCall:
        """The record of the session's call `index` (0-based, across segments)."""
        for seg in self.segments:
            for t in seg.turns:
                if t.index == index:
                    return t
        raise GatewayError(
            400, "invalid_turn", f"session {self.id!r} has no turn {index} ({self.turns} so far)"
        )


@dataclass
class Group:
    id: str
    size: int
    deadline: float  # monotonic
    sessions: dict[str, Session] = field(default_factory=dict)  # in the order they joined

    def done(self) -> bool:
        """All its sessions joined and ended (with a reward, or dead-lettered)."""
        return len(self.sessions) == self.size and all(s.ended for s in self.sessions.values())

    def rewarded(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.ended and not s.dead]


def check_session_id(session_id: str) -> str:
    if not _SESSION_ID.fullmatch(session_id):
        raise GatewayError(
            400,
            "invalid_session_id",
            "session id: 1-200 of A-Z a-z 0-9 . _ : @ - (it names trajectories and URL paths)",
        )
    return session_id


class SessionTable:
    """Live sessions and groups, and a bounded memory of ended session ids."""

    def __init__(
        self,
        *,
        max_sessions: int,
        session_timeout_s: float,
        group_timeout_s: float,
        ended_ids_kept: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions = max_sessions
        self.session_timeout_s = session_timeout_s
        self.group_timeout_s = group_timeout_s
        self.ended_ids_kept = ended_ids_kept
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.groups: dict[str, Group] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # session id -> how it ended
        self.ended_groups: OrderedDict[str, None] = OrderedDict()

    def get(self, session_id: str) -> Session:
        """A live session; 409 for one that ended, 404 for one never seen."""
        s = self.sessions.get(session_id)
        if s is not None:
            if s.ended:
                how = f"been dead-lettered ({s.dead})" if s.dead else "ended"
                raise GatewayError(409, "session_ended", f"session {session_id!r} has {how}")
            return s
        if session_id in self.ended:
            raise GatewayError(
                409,
                "session_ended",
                f"session {session_id!r} has ended ({self.ended[session_id]})",
            )
        raise GatewayError(404, "unknown_session", f"unknown session {session_id!r}")

    def find(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def open(self, ident: Ident, timeout_s: float | None = None) -> Session:
        """A new session in its group (made on its first session); 409/429 when it cannot be."""
        sid = check_session_id(ident.session_id)
        if sid in self.sessions or sid in self.ended:
            raise GatewayError(409, "session_exists", f"session {sid!r} exists already")
        if len(self.sessions) >= self.max_sessions:
            raise GatewayError(
                429, "too_many_sessions", f"{self.max_sessions} sessions live (max_sessions)"
            )
        now = self.clock()
        gid = ident.group_id or sid
        size = ident.group_size or 1
        group = self.groups.get(gid)
        if group is None:
            if gid in self.ended_groups:
                raise GatewayError(409, "group_full", f"group {gid!r} is done already")
            group = self.groups[gid] = Group(gid, size, now + self.group_timeout_s)
        elif group.size != size:
            raise GatewayError(
                409, "group_mismatch", f"group {gid!r} has size {group.size}, not {size}"
            )
        if len(group.sessions) >= group.size:
            raise GatewayError(
                409, "group_full", f"group {gid!r} has its {group.size} sessions already"
            )
        s = Session(
            sid,
            group,
            ident.row_id or gid,
            ident.data_source,
            now + (timeout_s or self.session_timeout_s),
        )
        group.sessions[sid] = s
        self.sessions[sid] = s
        LIVE_SESSIONS.set(len(self.sessions))
        return s

    def expired(self) -> tuple[list[Session], list[Group]]:
        """Sessions past their deadline still open, and groups past theirs (not done)."""
        now = self.clock()
        sessions = [s for s in self.sessions.values() if not s.ended and s.deadline < now]
        groups = [g for g in self.groups.values() if g.deadline < now]
        return sessions, groups

    def remove(self, group: Group) -> None:
        """Forget a done group; its id and its sessions' ids are remembered as ended."""
        self.groups.pop(group.id, None)
        self.ended_groups[group.id] = None
        for s in group.sessions.values():
            self.sessions.pop(s.id, None)
            self.ended[s.id] = f"dead-lettered: {s.dead}" if s.dead else "published"
        for kept in (self.ended, self.ended_groups):
            while len(kept) > self.ended_ids_kept:
                kept.popitem(last=False)
        LIVE_SESSIONS.set(len(self.sessions))
