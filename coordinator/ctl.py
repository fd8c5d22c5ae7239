"""`tether ctl`: drive tether servers through checkpoints from a shell (SPEC 7).

`add_ctl_parser` adds the `ctl` command to `tether`'s subparsers and `run_ctl` runs a
parsed command, returning the exit code; `main` does both, for ``python -m
coordinator.ctl``. The work is `coordinator.controller`'s; this module reads the
configuration, prints, and maps failures to exit codes:

    0 ok, 1 anything else, 2 usage, 3 blocked, 4 conflict or phase (every 409),
    5 not found or corrupt (no_checkpoint, corrupt_checkpoint, incompatible_state, and
    any failed restore after the dry runs passed: the restored servers were aborted)

With ``--json`` stdout gets exactly one JSON document, the result or
``{"error": {code, detail, server, status, ...}}``; otherwise results go to stdout,
errors to stderr, and progress lines to stdout when it is a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.checkpoint.store import PARTICIPANT_NAME, list_checkpoints, validate_checkpoint_id
from tether.coordinator.controller import (
    Blocked,
    Controller,
    RestoreFailed,
    Server,
)
from tether.routing.errors import TetherError

__all__ = [
    "EXIT_BLOCKED",
    "EXIT_CONFLICT",
    "EXIT_FAILED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "TOKEN_ENV",
    "add_ctl_parser",
    "exit_code",
    "main",
    "run_ctl",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_BLOCKED = 3
EXIT_CONFLICT = 4
EXIT_NOT_FOUND = 5
TOKEN_ENV = "TETHER_CONTROL_TOKEN"

_NOT_FOUND = frozenset({"no_checkpoint", "corrupt_checkpoint", "incompatible_state"})
_NAME = PARTICIPANT_NAME  # a server's name is its participant's (`<service>@<host_id>`)
_CONFIG_KEYS = frozenset({"checkpoint_root", "server"})
_SERVER_KEYS = frozenset({"name", "url", "token_file"})
# Commands that read or write the checkpoint root, so cannot run without one.
_NEEDS_ROOT = frozenset({"checkpoint", "commit", "restore", "list"})
_TAKES_CHECKPOINT_ID = frozenset({"checkpoint", "prepare", "commit", "resume", "restore"})


class _Usage(Exception):
    """The command line or the configuration is wrong (exit 2)."""


def exit_code(error: BaseException) -> int:
    """The exit code `tether ctl` ends with after `error`."""
    if isinstance(error, Blocked):
        return EXIT_BLOCKED
    if isinstance(error, RestoreFailed):
        return EXIT_NOT_FOUND
    if isinstance(error, TetherError):
        if error.code in _NOT_FOUND:
            return EXIT_NOT_FOUND
        if error.code == "invalid_checkpoint_id":
            return EXIT_USAGE
        if error.status == 409:
            return EXIT_CONFLICT
    return EXIT_FAILED


# -- arguments ---------------------------------------------------------------------


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive and finite: {text!r}")
    return value


def _attempt(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an attempt number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    return value


def add_ctl_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add `ctl` and its commands to `tether`'s subparsers (dispatch with `run_ctl`)."""
    ctl = subparsers.add_parser(
        "ctl", help="drive tether servers through checkpoints",
        description="Drive tether servers through checkpoints over their control API.",
    )
    ctl.add_argument("--server", action="append", default=[], metavar="[NAME=]URL",
                     help="a server, in order; repeat for several (replaces the config's)")
    ctl.add_argument("--config", metavar="FILE", help="TOML: [[server]] name, url, token_file")
    ctl.add_argument("--checkpoint-root", metavar="DIR",
                     help="the servers' checkpoint root (overrides the config's)")
    ctl.add_argument("--token-file", metavar="F",
                     help=f"the control token for servers without their own (else ${TOKEN_ENV})")
    ctl.add_argument("--json", action="store_true", help="print one JSON document")
    commands = ctl.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")

    take = commands.add_parser("checkpoint", help="prepare, commit, write, resume")
    take.add_argument("--id", help="the checkpoint ID (default: a new time-based one)")
    take.add_argument("--scope-file", metavar="F", help="JSON list of episode IDs kept, or null")
    take.add_argument("--state-file", metavar="F", help="JSON stored as controller_state")
    take.add_argument("--deadline", type=_seconds, default=60.0, metavar="S",
                      help="each prepare's and commit's deadline (default 60)")
    take.add_argument("--lease", type=_seconds, default=300.0, metavar="S",
                      help="the lease each prepare and renew asks for (default 300)")

    prepare = commands.add_parser("prepare", help="prepare every server, in order")
    prepare.add_argument("--id", required=True)
    prepare.add_argument("--deadline", type=_seconds, metavar="S")
    commit = commands.add_parser("commit", help="commit every server, then write CHECKPOINT.json")
    commit.add_argument("--id", required=True)
    commit.add_argument("--scope-file", metavar="F")
    commit.add_argument("--deadline", type=_seconds, metavar="S")
    resume = commands.add_parser("resume", help="resume every server, in reverse order")
    resume.add_argument("--id", required=True)

    restore = commands.add_parser("restore", help="restore a checkpoint onto fresh servers")
    which = restore.add_mutually_exclusive_group()
    which.add_argument("--id", help="the checkpoint ID")
    which.add_argument("--latest", action="store_true", help="the latest complete (default)")
    restore.add_argument("--no-resume", action="store_true", help="leave the servers restored")
    restore.add_argument("--deadline", type=_seconds, default=60.0, metavar="S",
                         help="each restore's deadline (default 60)")

    retire = commands.add_parser("retire", help="retire an episode's attempt everywhere")
    retire.add_argument("--id", required=True, metavar="EPISODE_ID")
    retire.add_argument("--attempt", required=True, type=_attempt, metavar="N")
    forget = commands.add_parser("forget", help="drop episodes' retire marks everywhere")
    forget.add_argument("--id", required=True, nargs="+", action="extend", metavar="EPISODE_ID")

    commands.add_parser("status", help="every server's status")
    commands.add_parser("list", help="the checkpoints in the root, newest first")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``ctl ...`` arguments (without the leading ``ctl``) and run them."""
    parser = argparse.ArgumentParser(prog="tether")
    add_ctl_parser(parser.add_subparsers(dest="command", required=True))
    return run_ctl(parser.parse_args(["ctl", *(sys.argv[1:] if argv is None else argv)]))


# -- configuration -----------------------------------------------------------------


@dataclass(frozen=True)
class _Settings:
    servers: list[Server]
    root: str | None


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise _Usage(f"cannot read the token file {path}: {exc}") from None
    if not token:
        raise _Usage(f"the token file {path} is empty")
    return token


def _read_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise _Usage(f"cannot read {what} {path} as JSON: {exc}") from None


def _read_scope(path: str | None) -> list[str] | None:
    if path is None:
        return None
    scope = _read_json(path, "the scope file")
    if scope is None:
        return None
    if not isinstance(scope, list) or not all(isinstance(e, str) and e for e in scope):
        raise _Usage(f"the scope file {path} must hold a JSON list of episode IDs, or null")
    return scope


def _parse_server(value: str) -> tuple[str | None, str]:
    name, sep, rest = value.partition("=")
    if sep and _NAME.fullmatch(name):
        return name, rest
    return None, value


def _check_url(url: str, where: str) -> str:
    if not re.match(r"https?://[^/]", url):
        raise _Usage(f"{where}: {url!r} is not an http:// or https:// URL")
    return url


def _load_config(path: str) -> tuple[list[tuple[str | None, str, str | None]], str | None]:
    """The config's servers `(name, url, token_file)` and checkpoint root; relative paths
    are taken from the config file's directory."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise _Usage(f"cannot read the config {path}: {exc}") from None
    base = Path(path).parent

    def local(value: Any, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise _Usage(f"{path}: `{key}` must be a non-empty string")
        return str(base / Path(value).expanduser())

    unknown = set(data) - _CONFIG_KEYS
    if unknown:
        raise _Usage(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(_CONFIG_KEYS)})")
    root = local(data["checkpoint_root"], "checkpoint_root") if "checkpoint_root" in data else None
    tables = data.get("server", [])
    if not isinstance(tables, list):
        raise _Usage(f"{path}: `server` must be an array of tables ([[server]])")
    servers: list[tuple[str | None, str, str | None]] = []
    for number, table in enumerate(tables, 1):
        where = f"{path}: server {number}"
        if not isinstance(table, dict):
            raise _Usage(f"{where} is not a table")
        unknown = set(table) - _SERVER_KEYS
        if unknown:
            raise _Usage(f"{where}: unknown keys {sorted(unknown)}")
        name = table.get("name")
        if name is not None and not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise _Usage(f"{where}: bad name {name!r}")
        url = table.get("url")
        if not isinstance(url, str):
            raise _Usage(f"{where} has no `url`")
        token_file = local(table["token_file"], "token_file") if "token_file" in table else None
        servers.append((name, _check_url(url, where), token_file))
    return servers, root


def _settings(args: argparse.Namespace, command: str) -> _Settings:
    specs: list[tuple[str | None, str, str | None]] = []
    root: str | None = None
    if args.config is not None:
        specs, root = _load_config(args.config)
    if args.server:
        specs = []
        for value in args.server:
            name, url = _parse_server(value)
            specs.append((name, _check_url(url, "--server"), None))
    if args.checkpoint_root is not None:
        root = args.checkpoint_root
    if command in _NEEDS_ROOT and root is None:
        raise _Usage(f"`{command}` needs the checkpoint root: --checkpoint-root or "
                     "checkpoint_root in the config")
    if command == "list":
        return _Settings([], root)
    if not specs:
        raise _Usage("no servers: give --server [NAME=]URL or --config FILE")
    shared: str | None = None
    servers: list[Server] = []
    for name, url, token_file in specs:
        if token_file is not None:
            token = _read_token(token_file)
        else:
            if shared is None:
                if args.token_file is not None:
                    shared = _read_token(args.token_file)
                else:
                    shared = os.environ.get(TOKEN_ENV, "").strip()
                    if not shared:
                        raise _Usage(f"no control token for {name or url}: give --token-file, "
                                     f"token_file in the config, or set ${TOKEN_ENV}")
            token = shared
        servers.append(Server(name, url, token))
    return _Settings(servers, root)


# -- output ------------------------------------------------------------------------


class _Output:
    """Prints results, errors and (on a terminal, without --json) progress."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.tty = not as_json and sys.stdout.isatty()

    def progress(self, line: str) -> None:
        if self.tty:
            print(f"... {line}", flush=True)

    def result(self, doc: Any, human: str) -> None:
        print(json.dumps(doc, indent=2) if self.as_json else human, flush=True)

    def error(self, code: str, detail: Any, *, server: str | None = None, **extra: Any) -> None:
        if self.as_json:
            body = {"code": code, "detail": detail, "server": server, **extra}
            print(json.dumps({"error": body}, indent=2, default=str), flush=True)
            return
        where = f" from {server}" if server else ""
        lines = [f"tether ctl: {code}{where}: {_text(detail)}"]
        for blocker in extra.get("blockers") or []:
            lines.append(f"  {_blocker(blocker)}")
        total, shown = extra.get("blockers_total"), len(extra.get("blockers") or [])
        if isinstance(total, int) and total > shown:
            lines.append(f"  ... and {total - shown} more")
        if extra.get("aborted"):
            lines.append(f"  aborted the restore on: {', '.join(extra['aborted'])}")
        print("\n".join(lines), file=sys.stderr, flush=True)

    def failure(self, error: TetherError) -> None:
        body = error.body()
        code, detail = body.pop("code"), body.pop("detail")
        body.setdefault("server", None)
        body.setdefault("status", error.status)
        notes = getattr(error, "__notes__", None)
        if notes:
            body["notes"] = list(notes)
        self.error(code, detail, **body)
        if notes and not self.as_json:
            print("\n".join(f"  {note}" for note in notes), file=sys.stderr, flush=True)


def _text(detail: Any) -> str:
    return detail if isinstance(detail, str) else json.dumps(detail)


def _blocker(blocker: Any) -> str:
    if not isinstance(blocker, dict):
        return str(blocker)
    parts = [str(blocker.get("kind", "?"))]
    for key in ("worker", "id"):
        if blocker.get(key) is not None:
            parts.append(f"{key}={blocker[key]}")
    if blocker.get("detail"):
        parts.append(f"- {_text(blocker['detail'])}")
    return " ".join(parts)


def _size(count: Any) -> str:
    if not isinstance(count, int):
        return "? B"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _records(records: Any) -> str:
    if not isinstance(records, dict):
        return "? records"
    return f"{records.get('sessions', '?')} sessions, {records.get('episodes', '?')} episodes"


def _checkpoint_text(summary: dict[str, Any], verb: str) -> str:
    total = summary["timings"].get("total_s", 0.0)
    lines = [f"{verb} {summary['checkpoint_id']} in {total:.2f} s"]
    for server in summary["servers"]:
        lines.append(
            f"  {server['name']}: {_records(server.get('records'))}, "
            f"{_size(server.get('bytes'))}, manifest {server['manifest_digest'][:12]}"
        )
    return "\n".join(lines)


def _restore_text(result: dict[str, Any]) -> str:
    after = "resumed" if result["resumed"] else "left restored (resume or abort them)"
    lines = [f"restored {result['checkpoint_id']}, {after}"]
    for name, answer in result["servers"].items():
        held = answer.get("held_episodes")
        lines.append(
            f"  {name}: {answer.get('installed_sessions', '?')} sessions installed, "
            f"{len(held) if isinstance(held, list) else '?'} episodes held"
        )
    return "\n".join(lines)


def _status_text(statuses: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, status in statuses.items():
        workers = status.get("workers") or []
        sessions = sum(w.get("sessions") or 0 for w in workers if isinstance(w, dict))
        active = f" {status['checkpoint_id']}" if status.get("checkpoint_id") else ""
        lines.append(
            f"{name}: {status.get('phase')}{active}, {len(workers)}/"
            f"{status.get('expected_workers', '?')} workers, {sessions} sessions, "
            f"{len(status.get('held_episodes') or [])} held episodes, "
            f"{status.get('blockers_total', 0)} blockers, root {status.get('checkpoint_root')}"
        )
        for blocker in status.get("blockers") or []:
            lines.append(f"  {_blocker(blocker)}")
    return "\n".join(lines)


def _list_text(root: str, checkpoints: list[dict[str, Any]]) -> str:
    if not checkpoints:
        return f"no checkpoints in {root}"
    return "\n".join(
        f"{c['id']}  {c['created_at'] or '-':27}  "
        f"{'complete' if c['complete'] else 'incomplete':10}  {', '.join(c['participants'])}"
        for c in checkpoints
    )


# -- running -----------------------------------------------------------------------


def run_ctl(args: argparse.Namespace) -> int:
    """Run a parsed `tether ctl` command; return its exit code."""
    out = _Output(args.json)
    command: str = args.ctl_command
    try:
        settings = _settings(args, command)
        if command == "list":
            assert settings.root is not None
            checkpoints = list_checkpoints(settings.root)
            out.result({"checkpoint_root": settings.root, "checkpoints": checkpoints},
                       _list_text(settings.root, checkpoints))
            return EXIT_OK
        # Files are read before any server is touched, so a typo changes nothing.
        scope = _read_scope(getattr(args, "scope_file", None))
        state_file = getattr(args, "state_file", None)
        state = None if state_file is None else _read_json(state_file, "the state file")
        cid = getattr(args, "id", None) if command in _TAKES_CHECKPOINT_ID else None
        if cid is not None:
            cid = _checkpoint_id(cid)
        return asyncio.run(_run(args, _Call(command, settings, cid, scope, state), out))
    except _Usage as error:
        out.error("usage", str(error))
        return EXIT_USAGE
    except TetherError as error:
        out.failure(error)
        return exit_code(error)
    except KeyboardInterrupt:
        out.error("interrupted", "interrupted")
        return 130


def _checkpoint_id(value: str) -> str:
    try:
        return validate_checkpoint_id(value)
    except TetherError:
        raise _Usage(f"bad checkpoint ID {value!r}: [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}, "
                     "not `latest`") from None


@dataclass(frozen=True)
class _Call:
    command: str
    settings: _Settings
    checkpoint_id: str | None
    scope: list[str] | None
    state: Any


async def _run(args: argparse.Namespace, call: _Call, out: _Output) -> int:
    command, settings, cid, scope, state = (
        call.command, call.settings, call.checkpoint_id, call.scope, call.state
    )
    async with Controller(settings.servers, settings.root, progress=out.progress) as controller:
        if command == "checkpoint":
            summary = await controller.checkpoint(
                cid, scope, state, deadline_s=args.deadline, lease_s=args.lease
            )
            out.result(summary, _checkpoint_text(summary, "checkpoint"))
        elif command == "prepare":
            assert cid is not None  # argparse requires --id
            answers = await controller.prepare(cid, deadline_s=args.deadline)
            doc = {"checkpoint_id": cid, "servers": answers}
            lines = []
            for name, answer in answers.items():
                lines.append(f"{name}: {answer.get('state')}")
                lines += [f"  {_blocker(b)}" for b in answer.get("blockers") or []]
            out.result(doc, "\n".join(lines))
            if any(a.get("state") != "prepared" for a in answers.values()):
                return EXIT_BLOCKED
        elif command == "commit":
            assert cid is not None  # argparse requires --id
            summary = await controller.commit(cid, scope, deadline_s=args.deadline)
            out.result(summary, _checkpoint_text(summary, "committed"))
        elif command == "resume":
            assert cid is not None  # argparse requires --id
            answers = await controller.resume(cid)
            out.result({"checkpoint_id": cid, "servers": answers},
                       f"resumed {', '.join(answers)}")
        elif command == "restore":
            result = await controller.restore(
                cid or "latest", resume=not args.no_resume, deadline_s=args.deadline
            )
            out.result(result, _restore_text(result))
        elif command == "retire":
            answers = await controller.retire(args.id, args.attempt)
            out.result({"servers": answers}, "\n".join(
                f"{name}: retired {json.dumps(a.get('retired'))}" for name, a in answers.items()
            ))
        elif command == "forget":
            answers = await controller.forget(args.id)
            out.result({"servers": answers}, "\n".join(
                f"{name}: forgot {json.dumps(a.get('forgotten'))}" for name, a in answers.items()
            ))
        elif command == "status":
            statuses = await controller.status()
            out.result({"servers": statuses}, _status_text(statuses))
        else:  # pragma: no cover - argparse allows only the commands above
            raise _Usage(f"unknown command {command!r}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
