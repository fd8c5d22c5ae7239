"""The public API of each package is exactly its `__all__`, and every name resolves."""

from __future__ import annotations

import importlib

import pytest

EXPECTED = {
    "routing": {
        "ERRORS", "ClaimStore", "CookieCodec", "ErrorCode", "FileClaimStore", "SessionFence",
        "SessionHolder", "SessionId", "SessionKind", "TetherError", "WorkerId", "cookie_kind",
        "declare", "ended", "lost_verification", "mcp_kind", "mint_session_token",
        "seed_rejected", "session_lost", "tether_error_response", "worker_of",
    },
    "coordinator": {
        "Blocked", "ControlError", "Controller", "ControllerError", "ServeOptions", "Server",
        "ServerClient", "serve",
    },
    "checkpoint": {
        "Checkpointer", "Episode", "Participant", "SessionState", "declare_participant",
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
    pattern = re.compile(r"^\s*(from|import)\s+(checkpoint|coordinator)\b", re.MULTILINE)
    offenders = [p.name for p in root.glob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
