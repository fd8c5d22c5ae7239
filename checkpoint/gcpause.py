"""Garbage collection paused while a checkpoint builds or reads many objects at once.

Unpacking a 110,000-entry index, or installing 100,000 states, allocates millions of
containers that all survive; each allocation burst triggers collections that traverse
them (and the app's heap) again and again: 0.12 s to read such an index with collection
paused, 0.36-0.56 s without. Nothing built here is garbage, so nothing is lost by
waiting until the end.

What was tracked before the pause is frozen (`gc.freeze`) for its length, unless the app
froze objects itself (then its frozen heap is left as it is): a full
collection the app's own growth had made due (0.3 s over 100,000 states) is then not
run by the pause's first allocation after it ends, inside a commit, but when the app's
own allocations next call for it. What the pause built and kept (an index, installed
states) goes with the frozen heap straight to the oldest generation: otherwise the first
young collection after the pause traverses all of it (0.03 s for a 110,000-entry index).
That includes whatever other tasks allocated during the pause (an export's spans awaits),
garbage cycles too: a full collection, not a young one, frees those.

Pauses nest and may come from several threads (reads run in `asyncio.to_thread`):
collection resumes when the last one ends, and only if it was enabled when the first
began.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["paused"]

_lock = threading.Lock()
_depth = 0
_resume = False
_froze = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Pause automatic collection for the block (a no-op if the app disabled it)."""
    global _depth, _resume, _froze
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
            # An app that froze its own heap keeps it frozen: unfreeze would undo that.
            _froze = gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _froze:
                    gc.freeze()  # the pause's survivors join what was frozen...
                    gc.unfreeze()  # ...and all of it goes to the oldest generation
                if _resume:
                    gc.enable()
