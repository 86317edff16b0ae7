"""The embedded storage unit: payloads held in this process, handed to consumers without a copy.

Media are content-addressed (``media_dedup=True``, the default): the unit keeps one copy of each media item by
digest in a :class:`~knitdata.storage.media.MediaStore`, and each stored trajectory refers to that copy.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any, cast

from knitdata.errors import ConfigError, EngineError, MediaRefError, StoreFull, TrajectoryLostError, ValidationError
from knitdata.reclaim import Graveyard
from knitdata.record import MediaItem, Trajectory
from knitdata.storage.base import StorageStats, StorageUnit
from knitdata.storage.media import MediaStore, Resolver

_first, _second = itemgetter(0), itemgetter(1)  # of a held ``(trajectory, nbytes)`` (nbytes: its own, no media)

__all__ = ["EmbeddedStorageUnit"]


class EmbeddedStorageUnit(StorageUnit):
    """An in-process, thread-safe storage unit with a capacity in bytes.

    Payloads are stored once (the producer's :class:`~knitdata.record.Trajectory` object itself) and
    :meth:`get` returns that same object: consumers in the same process read it without a copy.
    The memory bound is the one of :mod:`knitdata.storage.base`: ``used <= max(capacity, largest
    trajectory)``.

    Media stored once (``media_dedup=True``): the unit holds one copy of each media item by digest with a count
    of the trajectories using it (:class:`~knitdata.storage.media.MediaStore`). A trajectory is accounted its own
    tensors plus the media it brings that the unit does not hold yet; the stored trajectory's media are the
    table's items, so :meth:`get` returns equal digests as the same object. A reference
    (:meth:`MediaItem.ref <knitdata.record.MediaItem.ref>`) is resolved at put from this unit's table, else from
    ``resolve`` (another unit of the pipeline, whose item is then held here too and counted on both units), else
    refused with :class:`~knitdata.errors.MediaRefError` (nothing stored). :meth:`release` gives the references
    back and frees an item with its last trajectory. ``media_dedup=False``: each trajectory keeps its own media,
    accounted in full, and references are refused (the per-trajectory-copies baseline).

    With a ``spill`` store (:class:`knitdata.storage.spill.SpillStore`), a payload that does not fit in memory is
    written to disk instead of making the producer wait (while the spill store has room; when it is full too,
    ``put`` waits for memory as without one). Spilled payloads are read back (one positional read and a
    decode) on ``get`` and deleted on ``release``; they do not count in ``used_bytes``, so the memory bound
    is unchanged and disk use is bounded by the spill store's ``max_bytes``. With ``media_dedup`` a spilled
    trajectory's media stay in memory, in the media table (referenced and counted in ``used_bytes`` like any
    other; its spill record refers to them): so a spill needs room in memory for the media the trajectory brings
    (none for a group's later members or a later turn), later references resolve, and nothing is freed while a
    spilled trajectory refers to it. Only its own tensors go to disk.

    Args:
        unit_id: Unique id of the unit.
        capacity_bytes: Capacity in bytes (> 0).
        node: Node name; defaults to ``unit_id``.
        spill: Optional spill store for payloads that do not fit in memory.
        media_dedup: Keep one copy of each media item (see above); ``False``: per-trajectory copies.
        resolve: Finds a media digest this unit does not hold in another unit of the pipeline (``None``: none);
            the engine sets :attr:`resolve` after building its units.
        graveyard: Released payloads wait there to be freed by the next put, not by the releasing thread (``used_bytes``
            drops at release; :mod:`knitdata.reclaim`). ``None``: freed at release.

    Example:
        >>> unit = EmbeddedStorageUnit("node0", capacity_bytes=1 << 20)
        >>> unit.put(traj, timeout=0) == traj.nbytes  # traj: a Trajectory; put returns the bytes stored
        True
    """

    def __init__(self, unit_id: str, capacity_bytes: int, *, node: str | None = None, spill: Any = None,
                 media_dedup: bool = True, resolve: Resolver | None = None, graveyard: Graveyard | None = None) -> None:
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
        self._media: MediaStore | None = MediaStore() if media_dedup else None
        self.resolve: Resolver | None = resolve
        self.graveyard = graveyard if graveyard is not None else Graveyard(limit=0)  # limit 0: freed at release

    @property
    def media_dedup(self) -> bool:
        """Whether media are stored once per digest (see the class docstring)."""
        return self._media is not None

    @property
    def media(self) -> MediaStore | None:
        """The unit's media table (``None`` with ``media_dedup=False``); read-only use (tests, drills, stats)."""
        return self._media

    def media_item(self, digest: str) -> MediaItem | None:
        """The held media item of ``digest`` (to resolve another unit's reference), or ``None``."""
        return None if self._media is None else self._media.get(digest)

    def _need_locked(self, traj: Trajectory) -> tuple[int, int]:
        """``(own bytes, media bytes it would bring)`` of ``traj`` now; raises MediaRefError for a reference that
        cannot be resolved (nothing changed)."""
        media = traj.media
        if not media:
            return int(traj.nbytes), 0
        table = self._media
        if table is None:
            for i, m in enumerate(media):
                if m.reference:
                    raise MediaRefError(
                        f"refers to media {m.digest} (kind {m.kind}, media index {i}) but the pipeline keeps "
                        "per-trajectory copies (media_dedup=False): put the item with its content",
                        trajectory_id=traj.id, digest=m.digest, kind=m.kind, index=i)
            return int(traj.nbytes), 0
        own = int(traj.nbytes) - sum(m.nbytes for m in media)
        return own, table.plan(traj.id, media, resolve=self.resolve)

    def _hold_media_locked(self, traj: Trajectory) -> tuple[Trajectory, int]:
        """Take ``traj``'s media references: ``(the trajectory to store, media bytes newly held)``."""
        table = self._media
        if table is None or not traj.media:
            return traj, 0
        canonical, new = table.hold(traj.id, traj.media, resolve=self.resolve)
        if any(a is not b for a, b in zip(canonical, traj.media)):
            stored = copy.copy(traj)  # the producer's object keeps its items; the stored one refers to the held ones
            stored.media = canonical
            return stored, new
        return traj, new

    def _fits(self, n: int) -> bool:
        return self._used + n <= self.capacity_bytes or self._used == 0

    def put(self, traj: Trajectory, *, timeout: float | None = None) -> int:
        """Store ``traj``; see :meth:`StorageUnit.put`.

        Returns:
            The bytes accounted for it: its own tensors plus the media it brought (each new digest once).

        Raises:
            MediaRefError: A media reference neither this unit nor another of the pipeline holds (nothing stored).
        """
        self.graveyard.free()  # what releases left to free goes before anything new is held
        with self._cond:
            self._check_new(traj.id)
            own, media_new = self._need_locked(traj)
            if self._fits(own + media_new):
                return self._hold(traj, own)
            spill = self._spill is not None and (media_new == 0 or self._fits(media_new))
            if spill:
                stored, media_new = self._hold_media_locked(traj)  # the media stay in memory (see the class doc)
                self._spilling.add(traj.id)
                self._add_used(media_new)
        if spill:
            try:
                self._spill.put(self._spill_form(stored))
            except StoreFull:
                pass  # disk budget spent too: wait for memory below
            else:
                with self._cond:
                    self._spilling.discard(traj.id)
                    self._spilled[traj.id] = own
                    self._spilled_bytes += own
                    self._spill_puts += 1
                    self._puts += 1
                return own + media_new
            finally:
                if traj.id in self._spilling:
                    with self._cond:
                        self._spilling.discard(traj.id)
                        self._free_media_locked(traj.id)
        with self._cond:
            self._check_new(traj.id)
            own, media_new = self._need_locked(traj)
            if not self._fits(own + media_new):
                t0 = time.perf_counter()
                deadline = None if timeout is None else t0 + max(0.0, timeout)
                while not self._closed:
                    own, media_new = self._need_locked(traj)  # another put may have brought its media meanwhile
                    if self._fits(own + media_new):
                        break
                    remaining = None if deadline is None else deadline - time.perf_counter()
                    if remaining is not None and remaining <= 0:
                        break
                    self._cond.wait(remaining)
                self._put_wait += time.perf_counter() - t0
                self.graveyard.free()  # woken by a release: what it left to free goes first
                if self._closed:
                    raise EngineError(f"storage unit {self.unit_id!r} was closed while a put waited for room")
                if not self._fits(own + media_new):
                    self._rejected += 1
                    raise StoreFull(
                        f"storage unit {self.unit_id!r} is full ({self._used} of {self.capacity_bytes} bytes used, "
                        f"trajectory {traj.id!r} needs {own + media_new}) and nothing was released within {timeout} s; "
                        "raise capacity_bytes (it must hold at least a mini-batch plus what producers have in flight), "
                        "give the pipeline a spill directory, consume faster, or retry the put"
                    )
            return self._hold(traj, own)

    def _spill_form(self, traj: Trajectory) -> Trajectory:
        """What goes to disk for a spilled trajectory: its media as references (they stay in the table)."""
        if self._media is None or not traj.media:
            return traj
        out = copy.copy(traj)
        out.media = [m if m.reference else MediaItem.ref(m.kind, m.digest, sample_rate=m.sample_rate)
                     for m in traj.media]
        return out

    def _add_used(self, n: int) -> None:
        if n:
            self._used += n
            self._high = max(self._high, self._used)

    def _free_media_locked(self, traj_id: str) -> int:
        if self._media is None:
            return 0
        freed = self._media.drop(traj_id)
        if freed:
            self._used -= freed
            self._cond.notify_all()
        return freed

    def try_put(self, traj: Trajectory) -> bool:
        """Store ``traj`` if it fits now (or spills); ``False`` if not, without waiting or counting a refusal."""
        with self._cond:
            self._check_new(traj.id)
            if self._spill is None:
                own, media_new = self._need_locked(traj)
                if not self._fits(own + media_new):
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

    def _hold(self, traj: Trajectory, own: int) -> int:
        stored, media_new = self._hold_media_locked(traj)
        self._items[traj.id] = (stored, own)
        self._add_used(own + media_new)
        self._puts += 1
        return own + media_new

    def get(self, ids: Sequence[str]) -> list[Trajectory]:
        """Return the stored objects for ``ids`` (no copy; spilled ones are read back); see :meth:`StorageUnit.get`.

        With ``media_dedup`` equal digests are the same :class:`~knitdata.record.MediaItem` object, and
        ``bytes_fetched`` counts each distinct media item of the request once.
        """
        out: list[Trajectory | None] = []
        nbytes = 0
        spilled_any = False
        with self._cond:
            items, spilled = self._items, self._spilled
            found = list(map(items.get, ids))
            if None not in found:  # the common case: every payload held in memory (C maps, no loop)
                held = cast("list[tuple[Trajectory, int]]", found)
                trajs = list(map(_first, held))
                self._gets += len(held)
                self._get_requests += 1
                self._bytes_fetched += sum(map(_second, held)) + self._media_bytes_of(trajs)
                return trajs
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
            with self._cond:
                self._bytes_fetched += self._media_bytes_of(out)  # type: ignore[arg-type]
            return out  # type: ignore[return-value]
        for k, i in enumerate(ids):
            if out[k] is None:
                try:
                    t = self._spill.get(i)
                except KeyError as e:
                    raise TrajectoryLostError(
                        f"storage unit {self.unit_id!r}: spilled payload released while being read", trajectory_ids=[i]
                    ) from e
                with self._cond:
                    self._spill_gets += 1
                    if self._media is not None and t.media:
                        t.media = self._media.canonical(t.media)  # the held items (referenced while it is held)
                        if any(m.reference for m in t.media):
                            raise TrajectoryLostError(
                                f"storage unit {self.unit_id!r}: spilled payload released while being read",
                                trajectory_ids=[i])
                out[k] = t
        with self._cond:
            self._bytes_fetched += self._media_bytes_of(out)  # type: ignore[arg-type]
        return out  # type: ignore[return-value]

    def _media_bytes_of(self, trajs: Sequence[Trajectory]) -> int:
        """Bytes of the media of ``trajs``: each distinct item once (dedup) or each occurrence (per-trajectory
        copies, already counted in the trajectories' own bytes: 0)."""
        if self._media is None or not self._media.pairs:
            return 0
        seen: dict[str, int] = {}
        for t in trajs:
            for m in t.media:
                seen[m.digest] = m.nbytes
        return sum(seen.values())

    def release(self, ids: Sequence[str]) -> int:
        """Drop ``ids`` (unknown ids ignored) and wake producers waiting for room.

        Returns:
            The bytes freed: their own tensors and the media items whose last reference went.
        """
        freed = 0
        with self._cond:
            popped = list(map(self._items.pop, ids, repeat(None)))
            self.graveyard.bury(popped)  # freed at the next put (or at once, limit 0)
            table = self._media
            if None not in popped:  # the common case: every payload held in memory (C maps, no loop)
                freed = sum(map(_second, cast("list[tuple[Trajectory, int]]", popped)))
                if table is not None and table.pairs:
                    freed += sum(map(table.drop, ids))
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
                else:
                    continue
                if table is not None:
                    freed += table.drop(i)
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
        """Return a snapshot of the counters (``used_bytes`` counts each distinct media item once)."""
        with self._cond:
            media = self._media.stats() if self._media is not None else {}
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
                **media,
            )

    def media_check(self) -> dict[str, Any]:
        """Recount the media references from the payloads held; see :meth:`StorageUnit.media_check`."""
        with self._cond:
            return _media_check(self._media, self._items, set(self._spilled) | self._spilling)

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


def _media_check(table: MediaStore | None, items: dict[str, tuple[Trajectory, int]], spilled: set[str]) -> dict[str, Any]:
    """:meth:`EmbeddedStorageUnit.media_check` (called under the unit's lock)."""
    if table is None:
        return {"ok": True, "pairs": 0, "refs": 0, "items": 0, "bytes": 0, "distinct_bytes": 0, "leaked": []}
    res = table.check()
    pairs = sum(len(t.media) for t, _n in items.values())
    pairs += sum(len(table.digests_of(i)) for i in spilled)  # their media stay in the table
    stored_ok = all(len(table.digests_of(i)) == len(t.media) and all(table.get(m.digest) is m for m in t.media)
                    for i, (t, _n) in items.items())
    leaked = sorted(i for i in table.traj_ids() if i not in items and i not in spilled)
    ok = bool(res["ok"]) and stored_ok and pairs == res["refs"] and not leaked
    return {"ok": ok, "pairs": pairs, "refs": res["refs"], "items": len(table), "bytes": res["bytes"],
            "distinct_bytes": res["distinct_bytes"], "leaked": leaked}
