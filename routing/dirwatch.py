"""Which files of one directory changed: Linux inotify, read without blocking.

The claim store (claims.py) remembers the claimants it read and forgets one as soon as
its file changes, so that routing a request to another worker's session costs no system
call while that session's claim stands. Python's standard library has no inotify, so the
three calls are made through ctypes; where they are missing (not Linux) there is no
watch and nothing is remembered.
"""

from __future__ import annotations

import ctypes
import os
import struct

__all__ = ["DirectoryWatch", "changed_names"]

IN_MODIFY = 0x002
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
_WATCHED = IN_MODIFY | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
"""Every way a file's content or name can change (a claim is linked in and unlinked)."""
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then name
_READ_SIZE = 1 << 16


def changed_names(events: bytes) -> tuple[set[str], int]:
    """The names a read of inotify events says changed, and which of IN_Q_OVERFLOW (any
    name may have changed) and IN_IGNORED (the watch ended with its directory) it holds."""
    names: set[str] = set()
    flags = 0
    offset = 0
    while offset + _EVENT.size <= len(events):
        _, mask, _, length = _EVENT.unpack_from(events, offset)
        offset += _EVENT.size
        flags |= mask & (IN_Q_OVERFLOW | IN_IGNORED)
        name = events[offset : offset + length].rstrip(b"\0")
        offset += length
        if name:
            names.add(name.decode("utf-8", "surrogateescape"))
    return names, flags


class DirectoryWatch:
    """An inotify watch on one directory; `changes` reads what it queued so far."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.ended = False
        """The directory went away: no change is reported any more."""

    @classmethod
    def of(cls, directory: str) -> DirectoryWatch | None:
        """A watch on `directory`, or None where inotify is not to be had."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init, add = libc.inotify_init1, libc.inotify_add_watch
        except (OSError, AttributeError):
            return None
        add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        fd = init(os.O_NONBLOCK | os.O_CLOEXEC)  # (IN_NONBLOCK and IN_CLOEXEC are these)
        if fd < 0:
            return None  # (out of inotify instances: the store reads every time)
        if add(fd, os.fsencode(directory), _WATCHED) < 0:
            os.close(fd)
            return None
        return cls(fd)

    def changes(self) -> set[str] | None:
        """The names changed since the last call (empty: none); None if any may have
        (or the watch `ended`)."""
        names: set[str] = set()
        every = False
        while True:
            try:
                events = os.read(self.fd, _READ_SIZE)
            except BlockingIOError:
                return None if every else names
            changed, flags = changed_names(events)
            names |= changed
            if flags & IN_IGNORED:
                self.ended = True
            every = every or bool(flags)

    def close(self) -> None:
        os.close(self.fd)
