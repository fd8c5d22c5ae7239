"""Routing: every request of a session reaches the worker that holds it.

What an app author imports; everything else in the package is internal.
"""

from tether.routing.claims import ClaimStore, FileClaimStore
from tether.routing.errors import ERRORS, ErrorCode, TetherError
from tether.routing.fence import (
    SessionFence,
    lost_verification,
    seed_rejected,
    session_lost,
    tether_error_response,
)
from tether.routing.kinds import (
    CLOSE_FOLLOWS_HEADER,
    CookieCodec,
    SessionHolder,
    SessionKind,
    cookie_kind,
    declare,
    mcp_kind,
    mint_session_token,
)
from tether.routing.router import ended, worker_of
from tether.routing.types import SessionId, WorkerId, session_id_or_none

__all__ = [
    "CLOSE_FOLLOWS_HEADER",
    "ERRORS",
    "ClaimStore",
    "CookieCodec",
    "ErrorCode",
    "FileClaimStore",
    "SessionFence",
    "SessionHolder",
    "SessionId",
    "SessionKind",
    "TetherError",
    "WorkerId",
    "cookie_kind",
    "declare",
    "ended",
    "lost_verification",
    "mcp_kind",
    "mint_session_token",
    "seed_rejected",
    "session_id_or_none",
    "session_lost",
    "tether_error_response",
    "worker_of",
]
