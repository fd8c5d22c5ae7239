"""Session and worker IDs as the router checks them."""

from __future__ import annotations

import re

from tether.routing.types import MAX_SESSION_ID_LENGTH, session_id_or_none


def test_a_session_id_is_1_to_256_characters_each_from_space_to_tilde() -> None:
    rule = re.compile(r"[\x20-\x7e]{1,256}")
    values = [chr(code) for code in range(0x3100)]  # every ASCII character and beyond
    values += [f"a{chr(code)}b" for code in range(0x100)]
    values += ["", "tp-0", "two words", "a" * MAX_SESSION_ID_LENGTH,
               "a" * (MAX_SESSION_ID_LENGTH + 1), "\u00a0", "x\u200by", "é"]
    for value in values:
        expected = value if rule.fullmatch(value) else None
        assert session_id_or_none(value) == expected, repr(value)


def test_what_is_not_a_string_names_no_session() -> None:
    for value in (None, 7, b"tp-0", ["tp-0"], {"id": "tp-0"}):
        assert session_id_or_none(value) is None
