"""The path-parameter source (SPEC 4.1): a kind's path templates name the session in the
URL, for REST-style apps (Jupyter's kernels, WebDriver's sessions)."""

from __future__ import annotations

from typing import Any

import pytest

from tether.routing.kinds import SessionKind
from tether.routing.sources import find

KERNELS = SessionKind(paths=("/api/kernels/{session_id}", "/session/{session_id}/..."),
                      token_header=None)


def scope(path: str, root_path: str = "", headers: list[tuple[bytes, bytes]] | None = None,
          kind: str = "http") -> dict[str, Any]:
    return {"type": kind, "path": root_path + path, "root_path": root_path,
            "headers": headers or [], "query_string": b""}


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("/api/kernels/k1", "k1"),
        ("/api/kernels/k1/", "k1"),
        ("/api/kernels/k1/execute", "k1"),
        ("/api/kernels/k1/channels/deep", "k1"),
        ("/session/abc/url", "abc"),
        ("/session/abc", "abc"),
        ("/api/kernels", None),
        ("/api/kernels/", None),
        ("/api/kernelsX/k1", None),
        ("/other/api/kernels/k1", None),
        ("/api/kernels/" + "x" * 257, None),  # longer than any session ID
    ],
)
def test_a_path_template_names_the_session_and_everything_under_it(
    path: str, named: str | None
) -> None:
    assert find(KERNELS, scope(path)).session_id == named


def test_a_websocket_handshake_is_read_by_the_same_templates() -> None:
    assert find(KERNELS, scope("/api/kernels/k9/channels", kind="websocket")).session_id == "k9"


def test_templates_match_below_the_root_path_and_the_kinds_prefix() -> None:
    assert find(KERNELS, scope("/api/kernels/k1", root_path="/jupyter")).session_id == "k1"
    prefixed = SessionKind(paths=("/kernels/{session_id}",), prefix="/v1", token_header=None)
    assert find(prefixed, scope("/v1/kernels/k2")).session_id == "k2"
    assert find(prefixed, scope("/kernels/k2")).session_id == "k2"


def test_a_header_or_cookie_comes_before_the_path() -> None:
    kind = SessionKind(paths=("/api/kernels/{session_id}",), header="x-session",
                       token_header=None)
    found = find(kind, scope("/api/kernels/k1", headers=[(b"x-session", b"from-header")]))
    assert found.session_id == "from-header"


def test_all_templates_are_one_compiled_pattern() -> None:
    assert KERNELS.path_pattern is not None
    assert KERNELS.path_pattern is KERNELS.path_pattern  # compiled once per kind


@pytest.mark.parametrize(
    "template", ["api/{session_id}", "/api/kernels", "/{session_id}/{session_id}"]
)
def test_a_template_without_exactly_one_id_segment_is_refused_when_declared(
    template: str,
) -> None:
    with pytest.raises(ValueError, match="session_id"):
        SessionKind(paths=(template,))
