"""Content-addressed media of one storage unit: one copy per digest, counted references.

A group's members share their prompt's image, clip or video, and an agent's turns carry the same screenshots
turn after turn. A :class:`MediaStore` keeps one copy of each media item by its content digest
(:attr:`MediaItem.digest <knitdata.record.MediaItem.digest>`) with a reference count over the trajectories
that use it: a trajectory's stored record refers to the table's copy, :meth:`MediaStore.hold` takes a
trajectory's references (storing the items it brings for the first time), :meth:`MediaStore.drop` gives them
back and frees an item when its last trajectory goes. A producer that knows a digest the pipeline holds puts
:meth:`MediaItem.ref <knitdata.record.MediaItem.ref>` instead of the pixels; a reference to a digest nobody
holds is refused with :class:`~knitdata.errors.MediaRefError`.

Invariants (checked by ``tests/_media_checks.py`` after every scenario of the conformance suite):

* the sum of the reference counts equals the number of (trajectory, media index) pairs held;
* :attr:`MediaStore.bytes` equals the sum of the held items' bytes, each distinct digest counted once;
* an item is held exactly while some trajectory refers to it (nothing freed while referenced, nothing leaked).

The table has its own lock, a leaf: it never calls out while holding it (``resolve`` runs outside), so a unit
may resolve a reference from another unit's table while holding its own unit's lock.

Example:
    >>> import torch
    >>> from knitdata.record import MediaItem
    >>> table = MediaStore()
    >>> img = MediaItem("image", tensor=torch.zeros(3, 8, 8, dtype=torch.uint8))
    >>> held, new = table.hold("t0", [img])
    >>> held2, new2 = table.hold("t1", [MediaItem.ref("image", img.digest)])
    >>> (new, new2, held2[0] is held[0], table.refs(img.digest), table.bytes)
    (192, 0, True, 2, 192)
    >>> table.drop("t0"), table.drop("t1"), len(table)
    (0, 192, 0)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from knitdata.errors import MediaRefError, ValidationError
from knitdata.record import MediaItem

__all__ = ["MediaStore", "Resolver"]

#: Finds a digest this table does not hold elsewhere (another unit of the pipeline): the item, or ``None``.
Resolver = Callable[[str], "MediaItem | None"]


class _Entry:
    __slots__ = ("item", "nbytes", "refs")

    def __init__(self, item: MediaItem, nbytes: int) -> None:
        self.item = item
        self.nbytes = nbytes
        self.refs = 0


class MediaStore:
    """One unit's media, one copy per digest, with a reference count over the trajectories using each (thread-safe).

    Attributes:
        resolved: References resolved by :meth:`hold` so far.
        copied_in: Items brought in through ``resolve`` (held by another unit) so far.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._by_traj: dict[str, tuple[str, ...]] = {}
        self._bytes = 0
        self._pairs = 0
        self._logical = 0  # bytes per-trajectory copies would hold: sum over pairs of the item's bytes
        self.resolved = 0
        self.copied_in = 0

    # ------------------------------------------------------------------ reading
    def holds(self, digest: str) -> bool:
        """Whether an item of ``digest`` is held."""
        return digest in self._entries

    def get(self, digest: str) -> MediaItem | None:
        """The held item of ``digest`` (the one copy), or ``None``."""
        e = self._entries.get(digest)
        return None if e is None else e.item

    def refs(self, digest: str) -> int:
        """References to ``digest`` (0 when not held)."""
        e = self._entries.get(digest)
        return 0 if e is None else e.refs

    def digests_of(self, traj_id: str) -> tuple[str, ...]:
        """The digests ``traj_id`` holds, in media order (empty when it holds none)."""
        return self._by_traj.get(traj_id, ())

    def traj_ids(self) -> list[str]:
        """The trajectories holding references here."""
        with self._lock:
            return list(self._by_traj)

    def __contains__(self, traj_id: object) -> bool:
        return traj_id in self._by_traj

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Bytes held: each distinct item once."""
        return self._bytes

    @property
    def pairs(self) -> int:
        """(trajectory, media index) pairs held: the sum of the reference counts."""
        return self._pairs

    def stats(self) -> dict[str, int]:
        """``media_items``, ``media_bytes``, ``media_refs``, ``media_bytes_saved`` (what per-trajectory copies
        would hold beyond ``media_bytes``), ``media_resolved``, ``media_copied_in``."""
        with self._lock:
            return {"media_items": len(self._entries), "media_bytes": self._bytes, "media_refs": self._pairs,
                    "media_bytes_saved": self._logical - self._bytes, "media_resolved": self.resolved,
                    "media_copied_in": self.copied_in}

    def canonical(self, items: Sequence[MediaItem]) -> list[MediaItem]:
        """``items`` with each held digest replaced by the held item (others, references included, unchanged)."""
        entries = self._entries
        out = []
        for m in items:
            e = entries.get(m.digest)
            out.append(m if e is None else e.item)
        return out

    # ------------------------------------------------------------------ holding
    def _found_elsewhere(self, items: Sequence[MediaItem], resolve: Resolver | None) -> dict[str, MediaItem]:
        """Items for the references this table lacks, from ``resolve`` (called without the lock)."""
        if resolve is None:
            return {}
        with self._lock:
            missing = {m.digest for m in items if m.reference and m.digest not in self._entries}
        found: dict[str, MediaItem] = {}
        for d in missing:
            item = resolve(d)
            if item is not None and not item.reference and item.digest == d:
                found[d] = item
        return found

    def _plan_locked(self, traj_id: str, items: Sequence[MediaItem],
                     found: dict[str, MediaItem]) -> tuple[list[MediaItem], dict[str, MediaItem], int]:
        """The canonical items, the new entries and their bytes; raises before changing anything."""
        entries = self._entries
        canonical: list[MediaItem] = []
        new: dict[str, MediaItem] = {}
        new_bytes = 0
        for i, m in enumerate(items):
            d = m.digest
            e = entries.get(d)
            held = e.item if e is not None else new.get(d)
            if held is None:
                if m.reference:
                    held = found.get(d)
                    if held is None:
                        raise MediaRefError(trajectory_id=traj_id, digest=d, kind=m.kind, index=i)
                else:
                    held = m
                new[d] = held
                new_bytes += held.nbytes
            if held.kind != m.kind or (m.sample_rate is not None and held.sample_rate != m.sample_rate):
                raise ValidationError(
                    f"{m.kind} (sample rate {m.sample_rate}) of digest {d} differs from the held item of that digest "
                    f"({held.kind}, sample rate {held.sample_rate})", trajectory_id=traj_id, field=f"media.{i}")
            canonical.append(held)
        return canonical, new, new_bytes

    def plan(self, traj_id: str, items: Sequence[MediaItem], *, resolve: Resolver | None = None) -> int:
        """The bytes :meth:`hold` would add for these items now (changes nothing).

        Raises:
            MediaRefError: A reference to a digest neither held here nor found by ``resolve``.
            ValidationError: An item's kind or sample rate differs from the held item of its digest.
        """
        found = self._found_elsewhere(items, resolve)
        with self._lock:
            return self._plan_locked(traj_id, items, found)[2]

    def hold(self, traj_id: str, items: Sequence[MediaItem], *,
             resolve: Resolver | None = None) -> tuple[list[MediaItem], int]:
        """Take ``traj_id``'s references to its media, storing the items held for the first time (all or nothing).

        A held digest gets one more reference and its held item takes the given one's place; an item not held is
        stored (its bytes counted once); a reference not held is looked up with ``resolve`` (another unit of the
        pipeline) and copied in. A trajectory using one digest twice holds two references.

        Args:
            traj_id: The trajectory (not holding media here yet).
            items: Its media, in order (items with content and references).
            resolve: Finds a digest not held here elsewhere (``None``: nowhere else).

        Returns:
            ``(canonical items in order, bytes newly held)``.

        Raises:
            MediaRefError: A reference to a digest not held here nor found by ``resolve``; nothing changed.
            ValidationError: ``traj_id`` holds media here already, or an item's kind or sample rate differs from the
                held item of its digest; nothing changed.
        """
        found = self._found_elsewhere(items, resolve)
        with self._lock:
            if traj_id in self._by_traj:
                raise ValidationError("holds media in this table already", trajectory_id=traj_id, field="id")
            canonical, new, new_bytes = self._plan_locked(traj_id, items, found)
            entries = self._entries
            for d, item in new.items():
                entries[d] = _Entry(item, item.nbytes)
                if item is found.get(d):
                    self.copied_in += 1
            for m, held in zip(items, canonical):
                entries[held.digest].refs += 1
                self._logical += held.nbytes
                if m.reference:
                    self.resolved += 1
            if canonical:
                self._by_traj[traj_id] = tuple(m.digest for m in canonical)
            self._pairs += len(canonical)
            self._bytes += new_bytes
            return canonical, new_bytes

    def drop(self, traj_id: str) -> int:
        """Give back ``traj_id``'s references; free each item whose last reference goes (unknown ids: 0).

        Returns:
            The bytes freed.
        """
        with self._lock:
            digests = self._by_traj.pop(traj_id, None)
            if not digests:
                return 0
            freed = 0
            entries = self._entries
            for d in digests:
                e = entries[d]
                e.refs -= 1
                self._logical -= e.nbytes
                if e.refs == 0:
                    del entries[d]
                    freed += e.nbytes
            self._pairs -= len(digests)
            self._bytes -= freed
            return freed

    def check(self) -> dict[str, Any]:
        """Recount from the per-trajectory lists and compare with the counters (for tests and drills).

        Returns:
            ``{"ok": bool, "pairs": n, "refs": sum of counts, "bytes": counted, "distinct_bytes": recounted}``.
        """
        with self._lock:
            want: dict[str, int] = {}
            for ds in self._by_traj.values():
                for d in ds:
                    want[d] = want.get(d, 0) + 1
            refs = {d: e.refs for d, e in self._entries.items()}
            distinct = sum(e.nbytes for e in self._entries.values())
            pairs = sum(len(ds) for ds in self._by_traj.values())
            ok = want == refs and distinct == self._bytes and pairs == self._pairs == sum(refs.values())
            return {"ok": ok, "pairs": pairs, "refs": sum(refs.values()), "bytes": self._bytes,
                    "distinct_bytes": distinct}
