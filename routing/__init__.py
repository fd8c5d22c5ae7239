"""Routing: every request of a session reaches the worker that holds it.

What an app author imports; everything else in the package is internal.
"""

from routing.claims import ClaimStore, FileClaimStore
from routing.errors import ERRORS, ErrorCode, TetherError
from routing.fence import (
    SessionFence,
    lost_verification,
    seed_rejected,
    session_lost,
    tether_error_response,
)
from routing.kinds import (
    CookieCodec,
    SessionHolder,
    SessionKind,
    cookie_kind,
    declare,
    mcp_kind,
    mint_session_token,
)
from routing.router import ended, worker_of
from routing.types import SessionId, WorkerId

__all__ = [
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
    "session_lost",
    "tether_error_response",
    "worker_of",
]
