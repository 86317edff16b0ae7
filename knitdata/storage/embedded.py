"""The embedded storage unit: payloads held in this process, handed to consumers without a copy."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any, cast

from knitdata.errors import ConfigError, EngineError, StoreFull, TrajectoryLostError, ValidationError
from knitdata.record import Trajectory
from knitdata.storage.base import StorageStats, StorageUnit

_first, _second = itemgetter(0), itemgetter(1)  # of a held ``(trajectory, nbytes)``

__all__ = ["EmbeddedStorageUnit"]


class EmbeddedStorageUnit(StorageUnit):
    """An in-process, thread-safe storage unit with a capacity in bytes.

    Payloads are stored once (the producer's :class:`~knitdata.record.Trajectory` object itself) and
    :meth:`get` returns that same object: consumers in the same process read it without a copy.
    The memory bound is the one of :mod:`knitdata.storage.base`: ``used <= max(capacity, largest
    trajectory)``.

    With a ``spill`` store (:class:`knitdata.spill.SpillStore`), a payload that does not fit in memory is
    written to disk instead of making the producer wait (while the spill store has room; when it is full too,
    ``put`` waits for memory as without one). Spilled payloads are read back (one positional read and a
    decode) on ``get`` and deleted on ``release``; they do not count in ``used_bytes``, so the memory bound
    is unchanged and disk use is bounded by the spill store's ``max_bytes``.

    Args:
        unit_id: Unique id of the unit.
        capacity_bytes: Capacity in bytes (> 0).
        node: Node name; defaults to ``unit_id``.
        spill: Optional spill store for payloads that do not fit in memory.

    Example:
        >>> unit = EmbeddedStorageUnit("node0", capacity_bytes=1 << 20)
        >>> unit.put(traj, timeout=0) == traj.nbytes  # traj: a Trajectory; put returns the bytes stored
        True
    """

    def __init__(self, unit_id: str, capacity_bytes: int, *, node: str | None = None, spill: Any = None) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.unit_id = unit_id
        self.node = node if node is not None else unit_id
        self.capacity_bytes = capacity_bytes
        self._items: dict[str, tuple[Trajectory, int]] = {}
        self._cond = threading.Condition()
        self._used = 0
        self._high = 0
        self._puts = 0
        self._rejected = 0
        self._put_wait = 0.0
        self._gets = 0
        self._get_requests = 0
        self._bytes_fetched = 0
        self._releases = 0
        self._closed = False
        self._spill = spill
        self._spilled: dict[str, int] = {}
        self._spilling: set[str] = set()
        self._spilled_bytes = 0
        self._spill_puts = 0
        self._spill_gets = 0

    def _fits(self, n: int) -> bool:
        return self._used + n <= self.capacity_bytes or self._used == 0

    def put(self, traj: Trajectory, *, timeout: float | None = None) -> int:
        """Store ``traj``; see :meth:`StorageUnit.put`."""
        n = int(traj.nbytes)
        with self._cond:
            self._check_new(traj.id)
            if self._fits(n):
                self._hold(traj, n)
                return n
            spill = self._spill is not None
            if spill:
                self._spilling.add(traj.id)
        if spill:
            try:
                self._spill.put(traj)
            except StoreFull:
                pass  # disk budget spent too: wait for memory below
            else:
                with self._cond:
                    self._spilling.discard(traj.id)
                    self._spilled[traj.id] = n
                    self._spilled_bytes += n
                    self._spill_puts += 1
                    self._puts += 1
                return n
            finally:
                if traj.id in self._spilling:
                    with self._cond:
                        self._spilling.discard(traj.id)
        with self._cond:
            self._check_new(traj.id)
            if not self._fits(n):
                t0 = time.perf_counter()
                deadline = None if timeout is None else t0 + max(0.0, timeout)
                while not self._fits(n) and not self._closed:
                    remaining = None if deadline is None else deadline - time.perf_counter()
                    if remaining is not None and remaining <= 0:
                        break
                    self._cond.wait(remaining)
                self._put_wait += time.perf_counter() - t0
                if self._closed:
                    raise EngineError(f"storage unit {self.unit_id!r} was closed while a put waited for room")
                if not self._fits(n):
                    self._rejected += 1
                    raise StoreFull(
                        f"storage unit {self.unit_id!r} is full ({self._used} of {self.capacity_bytes} bytes used, "
                        f"trajectory {traj.id!r} needs {n}) and nothing was released within {timeout} s; raise "
                        "capacity_bytes (it must hold at least a mini-batch plus what producers have in flight), "
                        "give the pipeline a spill directory, consume faster, or retry the put"
                    )
            self._hold(traj, n)
        return n

    def try_put(self, traj: Trajectory) -> bool:
        """Store ``traj`` if it fits now (or spills); ``False`` if not, without waiting or counting a refusal."""
        with self._cond:
            self._check_new(traj.id)
            if self._spill is None and not self._fits(int(traj.nbytes)):
                return False
        try:
            self.put(traj, timeout=0)
        except StoreFull:  # another put took the room meanwhile
            with self._cond:
                self._rejected -= 1
            return False
        return True

    def _check_new(self, traj_id: str) -> None:
        if self._closed:
            raise EngineError(f"storage unit {self.unit_id!r} is closed; create a new pipeline to put more")
        if traj_id in self._items or traj_id in self._spilled or traj_id in self._spilling:
            raise ValidationError(f"already held by storage unit {self.unit_id!r}", trajectory_id=traj_id, field="id")

    def _hold(self, traj: Trajectory, n: int) -> None:
        self._items[traj.id] = (traj, n)
        self._used += n
        self._high = max(self._high, self._used)
        self._puts += 1

    def get(self, ids: Sequence[str]) -> list[Trajectory]:
        """Return the stored objects for ``ids`` (no copy; spilled ones are read back); see :meth:`StorageUnit.get`."""
        out: list[Trajectory | None] = []
        nbytes = 0
        spilled_any = False
        with self._cond:
            items, spilled = self._items, self._spilled
            found = list(map(items.get, ids))
            if None not in found:  # the common case: every payload held in memory (C maps, no loop)
                held = cast("list[tuple[Trajectory, int]]", found)
                self._gets += len(held)
                self._get_requests += 1
                self._bytes_fetched += sum(map(_second, held))
                return list(map(_first, held))
            for i in ids:  # one pass: held, spilled, or missing
                e = items.get(i)
                if e is not None:
                    out.append(e[0])
                    nbytes += e[1]
                elif i in spilled:
                    out.append(None)
                    nbytes += spilled[i]
                    spilled_any = True
                else:
                    missing = [j for j in ids if j not in items and j not in spilled]
                    raise TrajectoryLostError(
                        f"storage unit {self.unit_id!r} does not hold the requested payloads (already released "
                        "after their consumer moved past them, withdrawn, or never stored here)",
                        trajectory_ids=missing,
                    )
            self._gets += len(out)
            self._get_requests += 1
            self._bytes_fetched += nbytes
        if not spilled_any:
            return out  # type: ignore[return-value]
        for k, i in enumerate(ids):
            if out[k] is None:
                try:
                    out[k] = self._spill.get(i)
                except KeyError as e:
                    raise TrajectoryLostError(
                        f"storage unit {self.unit_id!r}: spilled payload released while being read", trajectory_ids=[i]
                    ) from e
                with self._cond:
                    self._spill_gets += 1
        return out  # type: ignore[return-value]

    def release(self, ids: Sequence[str]) -> int:
        """Drop ``ids`` (unknown ids ignored) and wake producers waiting for room."""
        freed = 0
        with self._cond:
            popped = list(map(self._items.pop, ids, repeat(None)))
            if None not in popped:  # the common case: every payload held in memory (C maps, no loop)
                freed = sum(map(_second, cast("list[tuple[Trajectory, int]]", popped)))
                self._releases += len(popped)
                if freed:
                    self._used -= freed
                    self._cond.notify_all()
                return freed
            spilled = []
            for i, item in zip(ids, popped):
                if item is not None:
                    freed += item[1]
                    self._releases += 1
                elif i in self._spilled:
                    self._spilled_bytes -= self._spilled.pop(i)
                    self._releases += 1
                    spilled.append(i)
            for i in spilled:
                self._spill.release(i)
            if freed:
                self._used -= freed
                self._cond.notify_all()
        return freed

    def contains(self, traj_id: str) -> bool:
        """Whether ``traj_id`` is held."""
        with self._cond:
            return traj_id in self._items or traj_id in self._spilled

    def stats(self) -> StorageStats:
        """Return a snapshot of the counters."""
        with self._cond:
            return StorageStats(
                unit_id=self.unit_id,
                node=self.node,
                capacity_bytes=self.capacity_bytes,
                used_bytes=self._used,
                high_water_bytes=self._high,
                num_items=len(self._items),
                puts=self._puts,
                rejected_puts=self._rejected,
                put_wait_s=self._put_wait,
                gets=self._gets,
                get_requests=self._get_requests,
                bytes_fetched=self._bytes_fetched,
                releases=self._releases,
                spilled_items=len(self._spilled),
                spilled_bytes=self._spilled_bytes,
                spill_puts=self._spill_puts,
                spill_gets=self._spill_gets,
            )

    def close(self) -> None:
        """Refuse further puts; wake waiting producers. Held payloads stay readable."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items) + len(self._spilled)

    def __repr__(self) -> str:
        return f"EmbeddedStorageUnit({self.unit_id!r}, capacity_bytes={self.capacity_bytes})"
