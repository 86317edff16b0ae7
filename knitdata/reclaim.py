"""Deferred freeing: what the trainer's thread releases is freed later, on a thread that can wait.

When a consumer commits a mini-batch on the embedded engine, the control plane forgets its trajectories (their
metadata, put tokens and plan entries) and the storage unit drops their payloads, on the trainer's thread, under the
plane's lock. The bookkeeping has to happen there; freeing the objects does not: a trajectory's metadata, its plan
entry's records and, in real use, its payload's tensors (several per trajectory, each a call into the allocator)
are work nobody waits for. A :class:`Graveyard` keeps what was released, and frees it

* at the next put (a producer's thread), before anything is stored: the store and its graveyard together hold no
  more than the store held at its last put (after it, releases only move payloads from one to the other; a release
  made while a put runs may land after that put's free), within the bound the store's capacity states;
* when ``Pipeline.stats()`` or ``Pipeline.shutdown()`` is called, or the engine is dropped;
* at once, on the releasing thread, when more than :attr:`Graveyard.limit` objects are waiting (a trainer draining
  a closed stream, with no put to come).

The store's accounting (``used_bytes``, room for a waiting producer) changes at release, as before: what is freed
later is memory the accounting already gave back. On the Ray engine the release runs in the coordinator's and the
units' actors, never on the trainer's thread, and nothing is deferred.

Example:
    >>> g = Graveyard(limit=4)
    >>> g.bury([object(), object()])
    >>> g.held
    2
    >>> g.free()
    2
    >>> g.held
    0
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Graveyard", "DEFAULT_LIMIT"]

#: Objects a :class:`Graveyard` keeps before the releasing thread frees them itself.
DEFAULT_LIMIT = 1 << 16


class Graveyard:
    """Objects released on a latency-critical thread, freed on the next :meth:`free` (thread-safe).

    Args:
        limit: Objects kept at most: a :meth:`bury` that goes past it frees everything on the calling thread
            (``0``: every bury frees at once, as if there were no graveyard).
    """

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = int(limit)
        self._lock = threading.Lock()
        self._dead: list[list[Any]] = []
        self._held = 0
        self._freed = 0

    def bury(self, objects: list[Any]) -> None:
        """Keep ``objects`` (a list the caller no longer uses) until the next :meth:`free`: an append, no dealloc."""
        with self._lock:
            self._dead.append(objects)
            self._held += len(objects)
            over = self._held > self.limit
        if over:
            self.free()

    def free(self) -> int:
        """Free what is kept, on the calling thread (outside the lock); returns how many objects were kept."""
        if not self._held:  # the common case at a put: nothing to free, no lock
            return 0
        with self._lock:
            dead, self._dead = self._dead, []
            n, self._held = self._held, 0
            self._freed += n
        del dead  # the last references go here
        return n

    @property
    def held(self) -> int:
        """Objects kept and not freed yet."""
        return self._held

    @property
    def freed(self) -> int:
        """Objects freed by :meth:`free` so far."""
        return self._freed

    def __repr__(self) -> str:
        return f"Graveyard(held={self._held}, limit={self.limit})"
