"""The `tether` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tether.coordinator.ctl import add_ctl_parser, run_ctl
from tether.coordinator.launcher import ServeOptions, serve


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tether", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="serve an app on several uvicorn workers")
    run.add_argument("app", help="module:attribute, imported from the current directory")
    run.add_argument("--workers", type=int, default=1)
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=8000)
    run.add_argument("--name", help="the participant's name")
    run.add_argument("--sessions", choices=["cookie", "mcp"],
                     help="a preset for an app that declares no session kind")
    run.add_argument("--checkpoint-root", help="where checkpoints are written")
    run.add_argument("--control-token-file", help="read, or created 0600 if missing")
    run.add_argument("--close-window", type=float, dest="close_window_s",
                     help="seconds a session that is not open keeps its claim (default 300)")
    run.add_argument("--log-format", choices=["console", "json"])
    run.add_argument("--restore", metavar="ID|latest",
                     help="restore this checkpoint, then resume, before serving")
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
        options = ServeOptions(
            app=args.app,
            workers=args.workers,
            host=args.host,
            port=args.port,
            name=args.name,
            sessions=args.sessions,
            checkpoint_root=args.checkpoint_root,
            control_token_file=args.control_token_file,
            close_window_s=args.close_window_s,
            log_format=args.log_format,
            restore=args.restore,
        )
        sys.exit(serve(options))
