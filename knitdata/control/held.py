"""What the control plane holds of each stored trajectory, and what a commit leaves it to forget.

:class:`HeldTrajectories` keeps, by trajectory id, the metadata of each trajectory stored and not released
(``live``), the token of the call that put it (``put_tokens``: a retried put is recognised) and its loss-mask tokens
(``loss``). A release forgets its ids in all three tables.

On the embedded engine a commit runs on the trainer's thread. Forgetting there is per-trajectory work nobody waits
for: three dictionary pops per trajectory, each touching an object the trainer's caches lost long ago. With a
graveyard that keeps (:mod:`knitdata.reclaim`), :meth:`HeldTrajectories.forget_later` queues a commit's ids instead,
and every read of the tables forgets them first (:meth:`HeldTrajectories.settle`): the next put reads them, so a
producer's thread pays, and what it forgets waits in the graveyard to be freed. No reader sees a queued id; the queue
is bounded by the graveyard's limit (past it, the commit forgets at once). Without such a graveyard (the Ray engine,
whose plane runs in an actor) a release forgets at once.

:class:`RecentIds` remembers the ids delivered and released, to refuse a producer's retry of such a put.

Example:
    >>> from knitdata.reclaim import Graveyard
    >>> from knitdata.record import TrajectoryMeta
    >>> held = HeldTrajectories(Graveyard(limit=100))
    >>> held.live["t0"] = TrajectoryMeta("t0", "math", "g0", location="u0")
    >>> held.put_tokens["t0"], held.loss["t0"] = "call-1", 12
    >>> held.forget_later(["t0"])
    ['t0']
    >>> "t0" in held.live, held.graveyard.held  # its metadata and put token wait to be freed
    (False, 2)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any

from knitdata.reclaim import Graveyard
from knitdata.record import TrajectoryMeta

__all__ = ["HeldTrajectories", "RecentIds"]

_drain: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator of C calls to its end, keeping nothing


class HeldTrajectories:
    """The plane's tables of held trajectories (call every method under the plane's lock).

    Args:
        graveyard: Where forgotten metadata and put tokens go to be freed (``None``: a graveyard of limit 0, which
            frees at once). One whose limit is above 0 also lets :meth:`forget_later` queue.
    """

    def __init__(self, graveyard: Graveyard | None = None) -> None:
        self.graveyard = graveyard if graveyard is not None else Graveyard(limit=0)
        self._live: dict[str, TrajectoryMeta] = {}
        self._put_tokens: dict[str, str] = {}
        self._loss: dict[str, int] = {}
        self._forget: list[list[str]] = []  # ids of commits, forgotten at the next read
        self._forget_n = 0

    @property
    def live(self) -> dict[str, TrajectoryMeta]:
        """The metadata of the trajectories stored and not released, by id."""
        if self._forget:
            self.settle()
        return self._live

    @property
    def put_tokens(self) -> dict[str, str]:
        """The token of the ``admit_many`` call that put each held trajectory, by id."""
        if self._forget:
            self.settle()
        return self._put_tokens

    @property
    def loss(self) -> dict[str, int]:
        """The loss-mask tokens of each held trajectory, by id."""
        if self._forget:
            self.settle()
        return self._loss

    @property
    def queued(self) -> int:
        """Ids queued by :meth:`forget_later` and not forgotten yet."""
        return self._forget_n

    def load(self, live: dict[str, TrajectoryMeta], put_tokens: dict[str, str], loss: dict[str, int]) -> None:
        """Replace the tables (a loaded snapshot); nothing queued before is forgotten in the new ones."""
        self._forget, self._forget_n = [], 0
        self._live, self._put_tokens, self._loss = live, put_tokens, loss

    def pop(self, ids: Sequence[str]) -> list[TrajectoryMeta | None]:
        """Forget ``ids`` now; returns their metadata in order (``None``: not held). The metadata and put tokens go
        to the graveyard."""
        live = self.live
        popped: list[TrajectoryMeta | None] = list(map(live.pop, ids, repeat(None)))
        grave = self.graveyard
        grave.bury(popped)
        grave.bury(list(map(self._put_tokens.pop, ids, repeat(None))))
        _drain(map(self._loss.pop, ids, repeat(None)))  # ints: nothing worth deferring
        return popped

    def forget_later(self, ids: list[str]) -> list[str] | None:
        """Queue ``ids`` (a new list, kept) to be forgotten at the next read; returns those held, in order, or
        ``None`` when this graveyard frees at once (the caller forgets with :meth:`pop`).

        Each id must be queued once (a commit releases each entry once): until the next read a queued id is still in
        the raw tables, where this method's own membership test would find it again.
        """
        if self.graveyard.limit <= 0:
            return None
        live = self._live
        held = ids if all(map(live.__contains__, ids)) else list(filter(live.__contains__, ids))
        if held:
            self._forget.append(held)
            self._forget_n += len(held)
        return held

    def location(self, tid: str) -> str | None:
        """The storage unit of held trajectory ``tid``, queued to be forgotten or not (``KeyError``: neither)."""
        return self._live[tid].location

    def settle_over_limit(self) -> None:
        """Forget what is queued when it is more than the graveyard's limit (a trainer draining a closed stream, with
        no put to come)."""
        if self._forget_n > self.graveyard.limit:
            self.settle()

    def settle(self) -> None:
        """Forget what :meth:`forget_later` queued (the metadata and put tokens go to the graveyard)."""
        batches, self._forget, self._forget_n = self._forget, [], 0
        live, tokens, loss, grave = self._live, self._put_tokens, self._loss, self.graveyard
        for ids in batches:
            grave.bury(list(map(live.pop, ids, repeat(None))))
            grave.bury(list(map(tokens.pop, ids, repeat(None))))
            _drain(map(loss.pop, ids, repeat(None)))


class RecentIds:
    """The last ``limit`` distinct ids added, oldest first: a bounded ordered set.

    Ids come and go a batch at a time (a micro-batch's released trajectories): a batch is one C ``set.update`` and
    a list kept for the order, and the oldest are forgotten a batch at a time. At its bound, where a long run
    stays, this costs less per id than an ``OrderedDict`` (whose linked nodes are allocated, then freed, one per
    id). An id added again keeps its first place.

    :meth:`add_many` only queues the batch (the trainer's thread releases a mini-batch: no hashing there); the
    first read (``in``, ``len``, iteration; a producer's put asks ``in``) adds the queued batches in order, as
    many ``add_many`` calls would have, and so does an ``add_many`` that queues more than ``limit`` ids.

    Args:
        limit: How many ids are remembered.
        ids: The first ids, oldest first.

    Example:
        >>> r = RecentIds(3, ["a", "b"])
        >>> r.add_many(["c", "a", "d"])
        >>> list(r), "a" in r, len(r)
        (['b', 'c', 'd'], False, 3)
    """

    def __init__(self, limit: int, ids: Iterable[str] = ()) -> None:
        self.limit = int(limit)
        self._set: set[str] = set()
        self._chunks: deque[list[str]] = deque()
        self._n = 0
        self._queued: list[Sequence[str]] = []  # batches added, not folded in yet (in order)
        self._queued_n = 0
        self._add(list(ids))

    def add_many(self, ids: Sequence[str]) -> None:
        """Remember ``ids`` (those not remembered already, in order); forget the oldest beyond the limit.

        ``ids`` is kept as it is until the next read: pass a sequence nobody changes afterwards (a new list)."""
        self._queued.append(ids)
        self._queued_n += len(ids)
        if self._queued_n > self.limit:
            self._fold()

    def _fold(self) -> None:
        queued, self._queued, self._queued_n = self._queued, [], 0
        for ids in queued:
            self._add(ids)

    def _add(self, ids: Sequence[str]) -> None:
        seen = self._set
        if seen.isdisjoint(ids):
            before = len(seen)
            seen.update(ids)
            chunk = list(ids) if len(seen) - before == len(ids) else list(dict.fromkeys(ids))
        else:
            chunk = [i for i in dict.fromkeys(ids) if i not in seen]
            seen.update(chunk)
        if not chunk:
            return
        self._chunks.append(chunk)
        self._n += len(chunk)
        while self._n > self.limit:
            old = self._chunks[0]
            excess = self._n - self.limit
            if len(old) <= excess:
                self._chunks.popleft()
                seen.difference_update(old)
                self._n -= len(old)
            else:
                seen.difference_update(old[:excess])
                self._chunks[0] = old[excess:]
                self._n -= excess

    def __contains__(self, tid: object) -> bool:
        if self._queued:
            self._fold()
        return tid in self._set

    def __len__(self) -> int:
        if self._queued:
            self._fold()
        return self._n

    def __iter__(self) -> Iterator[str]:
        """The ids, oldest first."""
        if self._queued:
            self._fold()
        for chunk in list(self._chunks):
            yield from chunk

