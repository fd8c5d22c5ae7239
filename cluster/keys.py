"""Every Redis key a cluster uses, named in one place (SPEC 12).

All keys of a service start with `tether:{service}:`; `service` and host IDs are checked
by `name_problem`, so a key never holds a separator or a glob character where it
should not::

    tether:{service}:claim:{session_id}        string: the claimant's worker ID (no TTL)
    tether:{service}:worker:{worker_id}:claims set: the session IDs that worker claimed
    tether:{service}:host:{host_id}            string: the host's record (JSON), with a TTL
    tether:{service}:epoch:{host_id}           integer: the host's latest epoch (INCR)
    tether:{service}:joined:{host_id}          string: `<token> <epoch>` of its last join,
                                               with the record's TTL
    tether:{service}:hosts                     set: host IDs that published a record

The `hosts` set lets a reader find every host record without a SCAN of the whole
keyspace (which holds every claim); readers prune the IDs whose record expired.
"""

from __future__ import annotations

import re

from tether.routing.types import SessionId, WorkerId

PREFIX = "tether"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def name_problem(value: object) -> str | None:
    """Why `value` cannot name a service or a host, or None when it can: 1 to 63 letters,
    digits, `.`, `_` or `-`, starting with a letter or digit. The message names the value,
    not the flag, so a caller can prefix one (`--host-id: ...`)."""
    if isinstance(value, str) and _NAME.fullmatch(value):
        return None
    return (
        f"{value!r} must be 1 to 63 letters, digits, '.', '_' or '-', "
        "starting with a letter or digit"
    )


def _checked(what: str, value: str) -> str:
    problem = name_problem(value)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")
    return value


class ServiceKeys:
    """The key names of one service; the prefixes are built (and the service name
    checked) once, since a claim's key is built on every lookup."""

    def __init__(self, service: str) -> None:
        self.service = _checked("service", service)
        self.prefix = f"{PREFIX}:{service}:"
        self._claim = f"{self.prefix}claim:"
        self._host = f"{self.prefix}host:"
        self.hosts = f"{self.prefix}hosts"
        """The set of host IDs that published a record (pruned when records expire)."""
        self.claimants = f"{self.prefix}claimants"
        """The set of workers that claimed sessions and were not swept since: a host finds
        the dead among them even if no live host saw them die."""
        self.trusted = f"{self.prefix}trusted"
        """Holds the Redis run ID under which the claims are known complete: until then
        (and under another run: a snapshot brought the marker back) a lookup that finds
        no claim cannot tell a new session from a lost claim."""
        self.untrusted_since = f"{self.prefix}untrusted-since"
        """`<run ID> <ms>`: when this Redis was first seen without `trusted` (names the
        re-assertion round every host takes part in)."""

    def claim(self, session_id: SessionId) -> str:
        """The claim of one session: holds the claimant's worker ID."""
        return self._claim + session_id

    def worker_claims(self, worker: WorkerId) -> str:
        """The set of session IDs one worker claimed, so a dead worker's can be swept."""
        return f"{self.prefix}worker:{worker}:claims"

    @property
    def host_prefix(self) -> str:
        """What every host record's key starts with (a script builds them from it)."""
        return self._host

    def joined(self, host_id: str) -> str:
        """A host's last join, so that its retry (the reply was lost) answers the same."""
        return f"{self.prefix}joined:{_checked('host ID', host_id)}"

    def host(self, host_id: str) -> str:
        """One host's record in the live set (expires unless refreshed)."""
        return self._host + _checked("host ID", host_id)

    def epoch(self, host_id: str) -> str:
        """The counter that numbers a host's incarnations (never expires)."""
        return f"{self.prefix}epoch:{_checked('host ID', host_id)}"
