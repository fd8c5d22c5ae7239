"""The public API of each package is exactly its `__all__`, and every name resolves."""

from __future__ import annotations

import importlib

import pytest

EXPECTED = {
    "tether": {
        "CLOSE_FOLLOWS_HEADER", "CookieCodec", "Episode", "Participant", "SessionFence",
        "SessionHolder", "SessionKind", "SessionState", "TetherError", "__version__",
        "checkpointable", "cookie_kind", "declare", "declare_participant", "ended",
        "in_process", "lost_verification", "mcp_kind", "mint_session_token", "run",
        "seed_rejected", "session_id_or_none", "session_lost", "tether_error_response",
        "worker_of",
    },
    "tether.routing": {
        "CLOSE_FOLLOWS_HEADER", "ERRORS", "ClaimStore", "CookieCodec", "ErrorCode",
        "FileClaimStore", "SessionFence",
        "SessionHolder", "SessionId", "SessionKind", "TetherError", "WorkerId", "cookie_kind",
        "declare", "ended", "lost_verification", "mcp_kind", "mint_session_token",
        "seed_rejected", "session_id_or_none", "session_lost", "tether_error_response",
        "worker_of",
    },
    "tether.coordinator": {
        "Blocked", "ControlError", "Controller", "ControllerError", "RestoreFailed",
        "ServeOptions", "Server",
        "ServerClient", "serve",
    },
    "tether.checkpoint": {
        "Checkpointer", "Episode", "Participant", "SessionState", "checkpointable",
        "declare_participant",
        "declared_participant", "in_process", "resolve_latest",
    },
}


@pytest.mark.parametrize("package", sorted(EXPECTED))
def test_package_exports_exactly_its_public_names(package: str) -> None:
    module = importlib.import_module(package)
    assert set(module.__all__) == EXPECTED[package]
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_routing_imports_neither_checkpoint_nor_coordinator() -> None:
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent / "routing"
    pattern = re.compile(r"^\s*(from|import)\s+tether\.(checkpoint|coordinator)\b", re.MULTILINE)
    offenders = [p.name for p in root.glob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
