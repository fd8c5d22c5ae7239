"""The reference apps of SPEC section 10 (`tether.examples.counter`, `.episodes`, and the
MCP counter on each line of the official MCP SDK: `.mcp_counter` on 2.x,
`.mcp_counter_v1` on 1.x)."""

from __future__ import annotations

from tether.routing.mcp import sdk_line


def mcp_counter_app() -> str:
    """`module:attribute` of the MCP reference app written for the installed SDK line."""
    module = "mcp_counter_v1" if sdk_line() == 1 else "mcp_counter"
    return f"tether.examples.{module}:app"
