"""tether: one stateful Starlette app on several uvicorn workers as if it were one
process, and checkpoints of its in-memory state restored onto any number of workers.

What an app author, or a program that starts servers, imports. The controller lives in
`tether.coordinator`; everything else in the subpackages is internal.
"""

from tether._run import run
from tether._version import __version__
from tether.checkpoint import (
    Episode,
    Participant,
    SessionState,
    checkpointable,
    declare_participant,
    in_process,
)
from tether.routing import (
    CLOSE_FOLLOWS_HEADER,
    CookieCodec,
    SessionFence,
    SessionHolder,
    SessionKind,
    TetherError,
    cookie_kind,
    declare,
    ended,
    lost_verification,
    mcp_kind,
    mint_session_token,
    seed_rejected,
    session_id_or_none,
    session_lost,
    tether_error_response,
    worker_of,
)

__all__ = [
    "CLOSE_FOLLOWS_HEADER",
    "CookieCodec",
    "Episode",
    "Participant",
    "SessionFence",
    "SessionHolder",
    "SessionKind",
    "SessionState",
    "TetherError",
    "__version__",
    "checkpointable",
    "cookie_kind",
    "declare",
    "declare_participant",
    "ended",
    "in_process",
    "lost_verification",
    "mcp_kind",
    "mint_session_token",
    "run",
    "seed_rejected",
    "session_id_or_none",
    "session_lost",
    "tether_error_response",
    "worker_of",
]
