"""The in-process checkpoint tests' blob app, served by `tether serve`:
`POST /seed_session {session_id, size}` stores `size` deterministic bytes as the
session's state, `GET /blob` answers their sha256 and length."""

from __future__ import annotations

from tests.checkpoint.conftest import blob_app

app = blob_app()
