"""The `tether` command: `serve`, `ctl`, `demo`, `--version`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from tether._version import __version__
from tether.coordinator.ctl import add_ctl_parser, run_ctl
from tether.coordinator.options import OptionError, add_serve_flags, options_from
from tether.routing.logs import say


class _OneLineParser(argparse.ArgumentParser):
    """argparse, saying a usage mistake in one line and where to read more, not after
    the whole usage text (its sub-commands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="tether", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tether {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "serve",
        help="serve an app on several uvicorn workers",
        description="Serve APP on several uvicorn workers as if it were one process. Every "
        "flag can also be set as TETHER_<FLAG> (TETHER_WORKERS=4, TETHER_ROOT_PATH=/api).",
    )
    run.add_argument("app", help="module:attribute, imported from --app-dir (default .)")
    add_serve_flags(run)
    demo = commands.add_parser("demo", help="run the whole story on this machine")
    demo.add_argument("--sessions", type=int, default=1000)
    add_ctl_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "ctl":
        sys.exit(run_ctl(args))
    if args.command == "demo":
        from tether.coordinator.demo import main as demo

        sys.exit(demo([f"--sessions={args.sessions}"]))
    if args.command == "serve":
        from tether.coordinator.launcher import serve

        try:
            options = options_from(args.app, vars(args))
        except OptionError as error:
            say(f"tether serve: {error}", "startup_failed", error=True)
            sys.exit(2)
        sys.exit(serve(options))
