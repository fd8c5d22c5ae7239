"""The server's runtime directory, its open-file limit and its control token."""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
import shutil
import tempfile

from tether.routing.worker import socket_path

SOCKET_PATH_LIMIT = 107
COORDINATOR_SOCKET = "c.sock"
TOKEN_ENV = "TETHER_CONTROL_TOKEN"


class StartupError(RuntimeError):
    """Something `tether serve` needs before any worker starts is wrong; the message is the
    one line it prints: the problem and what to do."""


class RuntimeDirError(StartupError):
    """The runtime directory cannot be made, or cannot hold this server's sockets."""


def make_runtime_dir() -> str:
    """A fresh 0700 directory under `$XDG_RUNTIME_DIR` or /tmp, short enough for every
    socket path in it; fails fast otherwise."""
    from_env = os.environ.get("XDG_RUNTIME_DIR")
    base = from_env or "/tmp"
    try:
        path = tempfile.mkdtemp(prefix="tether-", dir=base)
    except OSError as error:
        fix = "create it or unset XDG_RUNTIME_DIR" if from_env else "check /tmp"
        raise RuntimeDirError(
            f"cannot make a runtime directory in {base!r} "
            f"({error.strerror or error}); {fix}"
        ) from None
    os.chmod(path, 0o700)
    longest = socket_path(path, "0" * 32)  # type: ignore[arg-type]
    if len(longest.encode()) > SOCKET_PATH_LIMIT:
        shutil.rmtree(path, ignore_errors=True)
        raise RuntimeDirError(
            f"runtime directory {path!r} is too long for Unix socket paths "
            f"({len(longest)} > {SOCKET_PATH_LIMIT} bytes); set XDG_RUNTIME_DIR to a shorter path"
        )
    for sub in ("w", "claims"):
        os.mkdir(os.path.join(path, sub), 0o700)
    return path


def remove_runtime_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard limit; return the new (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def resolve_token(
    token_file: str | None, checkpoint_root: str | None, runtime_dir: str
) -> tuple[str, str | None]:
    """The control token and the file it lives in (None when it came from the environment).

    Order: `TETHER_CONTROL_TOKEN`; `token_file` (read, or created 0600); the checkpoint
    root's `.tether-token` (reused if present); a new file in the runtime directory.
    """
    from_env = os.environ.get(TOKEN_ENV)
    if from_env:
        return from_env, None
    if token_file is None:
        base = checkpoint_root if checkpoint_root is not None else runtime_dir
        token_file = os.path.join(base, ".tether-token")
    return read_or_create_token(token_file), token_file


class TokenFileError(StartupError):
    """The control token file cannot be used."""


def read_or_create_token(path: str) -> str:
    """The token in `path`, creating it with a random token (mode 0600) if missing.

    A token file that others can read is refused: the token is the only thing between
    anyone on the machine and the control API."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_token(path)
    except FileNotFoundError:
        raise TokenFileError(
            f"control token file {path!r}: its folder does not exist; create it or pass "
            "another --control-token-file"
        ) from None
    except OSError as error:
        raise TokenFileError(
            f"control token file {path!r} cannot be created ({error.strerror}); pass "
            "another --control-token-file"
        ) from None
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(token + "\n")
    return token


def _read_token(path: str) -> str:
    try:
        mode = os.stat(path).st_mode
        if mode & 0o077:
            raise TokenFileError(
                f"control token file {path!r} can be read by others (mode "
                f"{mode & 0o777:o}); run chmod 600 {path}"
            )
        with open(path, encoding="utf-8") as file:
            token = file.read().strip()
    except (OSError, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise TokenFileError(
            f"control token file {path!r} cannot be read ({reason}); fix its permissions "
            "or pass another --control-token-file"
        ) from None
    if not token:
        raise TokenFileError(
            f"control token file {path!r} is empty; write a token into it, or delete it "
            "and one is made"
        )
    return token
