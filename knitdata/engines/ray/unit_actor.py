"""The Ray storage-unit actor (one per training node, payloads in its node's object store) and spill recovery.

:class:`StorageUnitActor` holds the payloads of one unit as codec records; clients talk to it through
:class:`knitdata.engines.ray.unit.RayStorageUnit`. :class:`SpillRecovery` serves a dead unit's payloads from its
write-through spill shards. See :mod:`knitdata.engines.ray.unit` for the memory bound and the failure model.
Importing this module without Ray installed raises :class:`~knitdata.errors.OptionalDependencyError`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from knitdata.control.records import Admitted, Stored
from knitdata.errors import EngineError, OptionalDependencyError, StoreFull
from knitdata.observe import trace as tracing

try:
    import ray
except ImportError as _e:  # pragma: no cover - exercised by monkeypatching in tests
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.engines.ray.unit_actor)") from _e

import numpy as np

from knitdata.codec import decode_trajectory, encode_media, encode_trajectory
from knitdata.engines.ray.connect import current_node
from knitdata.engines.ray.media import (
    MEDIA_SPILL_PREFIX,
    SpillRecovery,
    UnitMedia,
    media_spill_id,
    spill_directory,
)

__all__ = ["StorageUnitActor", "SpillRecovery", "spill_directory", "media_spill_id", "INLINE_MAX_BYTES",
           "ADMIT_TIMEOUT_S"]

_ON_DISK = "on-disk"  # marks a payload that spilled over: only in the unit's spill store
#: Records up to this many bytes stay in the unit actor's own memory and travel inline in its replies (a
#: ``ray.put`` costs about 1 ms per object whatever its size; Ray inlines replies below 100 KiB).
INLINE_MAX_BYTES = 64 << 10
#: Seconds a storage unit keeps retrying the admission of a put while the coordinator restarts.
ADMIT_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------------------- the actor
class _UnitState:
    """The unit's bookkeeping (plain Python; the actor wraps it)."""

    def __init__(self, unit_id: str, capacity_bytes: int, spill_dir: str | None, node_name: str | None,
                 spill_bytes: int | None = None, resume: bool = False, media_dedup: bool = True) -> None:
        self.unit_id = unit_id
        self.media: UnitMedia | None = UnitMedia() if media_dedup else None
        self.node_name = node_name
        self.capacity_bytes = capacity_bytes
        self.node = current_node()
        self.spill: Any = None
        if spill_dir:
            from knitdata.storage.spill import SpillStore

            max_bytes = spill_bytes if spill_bytes is not None else 4 * capacity_bytes + (64 << 20)
            directory = spill_directory(spill_dir, unit_id)
            if resume and os.path.isdir(directory) and os.listdir(directory):
                # a whole-job restart: the unreleased payloads of the previous run, served from disk
                self.spill = SpillStore.open(directory, max_bytes=max(max_bytes, 1 << 30))
            else:
                self.spill = SpillStore(directory, max_bytes=max_bytes)
        # id -> (ObjectRef | inline numpy record | _ON_DISK | None while being put, accounted memory bytes,
        # record bytes, media references it holds in the media table)
        self.items: dict[str, tuple[Any, int, int, int]] = {}
        if resume and self.spill is not None:
            self._resume_from_spill()
        self.cond = threading.Condition()
        self.used = self.high = 0
        self.counters = dict.fromkeys(
            ("puts", "rejected_puts", "gets", "get_requests", "bytes_fetched", "releases", "written_through",
             "spilled_over", "reloaded", "media_gets", "media_bytes_fetched"), 0
        )
        self.put_wait_s = 0.0
        self.closed = False

    def fits(self, n: int) -> bool:
        return self.used + n <= self.capacity_bytes or self.used == 0

    def _resume_from_spill(self) -> None:
        """A whole-job restart: the unreleased payloads of the previous run, served from disk, with their media
        counts rebuilt from the spilled trajectories (media stored once keep one sample per digest)."""
        spill = self.spill
        ids = spill.ids()
        media_keys = [t for t in ids if t.startswith(MEDIA_SPILL_PREFIX)]
        for tid in ids:
            if not tid.startswith(MEDIA_SPILL_PREFIX):
                self.items[tid] = (_ON_DISK, 0, 0, 0)
        table = self.media
        if table is None:
            return
        for key in media_keys:
            item = spill.get(key).media[0]
            table.entries[item.digest] = [_ON_DISK, 0, 0, 0, item.kind, int(item.nbytes)]
        for tid in list(self.items):
            refs = [m for m in spill.get(tid).media if m.reference]
            if refs:
                if any(m.digest not in table.entries for m in refs):
                    continue  # its media sample is gone: read as lost, like any payload the spill lacks
                table.hold(tid, [[m.digest, m.kind, 0, False] for m in refs], {}, None)
                self.items[tid] = (_ON_DISK, 0, 0, len(refs))
        for d in [d for d, e in table.entries.items() if e[3] == 0]:  # nothing refers to it any more
            del table.entries[d]
            spill.release(media_spill_id(d))


def _stage(s: _UnitState, content: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """``content`` not held yet by unit ``s``, each as ``[held record, nbytes, record bytes, the record, copied in]``
    (a copy into this node's object store, or inline when small), made outside the lock. ``copied in``: the client
    found it in another unit of the pipeline to resolve a reference (``[record, nbytes, True]``)."""
    if s.media is None:
        return {}
    with s.cond:
        todo = [(d, v) for d, v in content.items() if d not in s.media.entries]
    out: dict[str, list[Any]] = {}
    for d, (rec, n, *copied) in todo:
        arr = np.asarray(rec, dtype=np.uint8).reshape(-1)
        if arr.nbytes <= INLINE_MAX_BYTES:
            held: Any = np.array(arr, dtype=np.uint8, copy=True)
            held.setflags(write=False)
        else:
            held = ray.put(arr)
        out[d] = [held, int(n), int(arr.nbytes), arr, bool(copied and copied[0])]
    return out


# ray's stubs omit the actor options max_concurrency and concurrency_groups
@ray.remote(num_cpus=0, max_concurrency=32, concurrency_groups={"wait": 64})  # type: ignore[call-overload]
class StorageUnitActor:
    """The storage unit of one node (a threaded Ray actor; every method is short or bounded).

    Producers waiting for room (:meth:`wait_room`, at most 0.5 s per call) run in their own concurrency
    group, so they never hold up reads and releases.

    Create it through :meth:`RayStorageUnit.create`, which pins it to its node.
    """

    def __init__(self, unit_id: str, capacity_bytes: int, spill_dir: str | None = None,
                 node_name: str | None = None, spill_bytes: int | None = None, resume: bool = False,
                 media_dedup: bool = True) -> None:
        self._s = _UnitState(unit_id, capacity_bytes, spill_dir, node_name, spill_bytes, resume, media_dedup)
        self._control: Any = None  # the coordinator, set by set_control
        # group commit of the puts' admission calls (see _admit)
        self._gc: dict[str, Any] = {"cond": threading.Condition(), "queue": [], "busy": False, "calls": 0, "puts": 0}

    def info(self) -> dict[str, Any]:
        """``unit_id``, ``node`` (Ray node id), ``node_name``, ``capacity_bytes``, ``pid``, ``spill``,
        ``media_dedup``."""
        s = self._s
        return {"unit_id": s.unit_id, "node": s.node, "node_name": s.node_name or s.node,
                "capacity_bytes": s.capacity_bytes, "pid": os.getpid(),
                "spill": s.spill.directory if s.spill else None, "media_dedup": s.media is not None}

    def put(self, traj_id: str, record: np.ndarray, nbytes: int, media: Sequence[Sequence[Any]] | None = None,
            content: Mapping[str, Sequence[Any]] | None = None) -> str:
        """Store one record; returns ``"ok"``, ``"full"``, ``"dup"``, ``"closed"``, ``"missing:<i>"`` or
        ``"kind:<i>"`` (never blocks).

        With a spill store every record is written through to it; one that does not fit in memory stays on
        disk only (spill-over) and is reloaded into the object store when it is fetched. ``"full"`` then
        means the spill store is full too.

        Media stored once: ``media`` (``[digest, kind, nbytes, is_reference]`` per media item of a record
        written with ``encode_trajectory(..., media="refs")``) makes the unit take a reference to each digest
        it holds, and store the ones it does not hold from ``content`` (``{digest: [encode_media record,
        nbytes]}``) once. ``"missing:<i>"``: media ``i`` is neither held nor in ``content`` (nothing stored):
        the client resends its content, or refuses a reference nobody holds. ``nbytes`` is then the record's own
        bytes (no media); the unit accounts them plus each new item once. A spilled-over record's media stay in
        memory (they need room there unless held already), so nothing a spilled record refers to is freed.
        """
        staged = _stage(self._s, content) if content else {}
        return self._put(traj_id, record, nbytes, media, staged)

    def _put(self, traj_id: str, record: np.ndarray, nbytes: int, media: Sequence[Sequence[Any]] | None,
             staged: Mapping[str, Sequence[Any]]) -> str:
        s = self._s
        table = s.media if media else None
        with s.cond:
            if s.closed:
                return "closed"
            if traj_id in s.items:
                return "dup"
            new: Mapping[str, Sequence[Any]] = {}
            media_new = 0
            if table is not None:
                planned = table.plan(media, staged)  # type: ignore[arg-type]  # media is a sequence here
                if isinstance(planned, str):
                    return planned
                new, media_new = planned
            in_memory = s.fits(nbytes + media_new)
            if not in_memory and (s.spill is None or not (media_new == 0 or s.fits(media_new))):
                return "full"
            accounted = nbytes if in_memory else 0
            if table is not None:
                try:
                    table.hold(traj_id, media, new, s.spill)  # type: ignore[arg-type]
                except StoreFull:
                    return "full"
                s.used += media_new
            s.used += accounted  # reserve before the copy so concurrent puts respect the bound
            s.high = max(s.high, s.used)
            pairs = len(media) if table is not None else 0  # type: ignore[arg-type]  # media is a sequence here
            s.items[traj_id] = (None, accounted, int(record.nbytes), pairs)

        def undo() -> None:
            with s.cond:
                s.items.pop(traj_id, None)
                s.used -= accounted
                if table is not None:
                    s.used -= table.drop(traj_id, s.spill)
                s.cond.notify_all()

        try:
            if s.spill is not None:  # write-through, so a dead unit's payloads stay recoverable
                s.spill.put(decode_trajectory(record.data, copy=False))
            if not in_memory:
                ref: Any = _ON_DISK
            elif record.nbytes <= INLINE_MAX_BYTES:  # small: a copy in this actor's memory, sent inline on reads
                ref = np.array(record, dtype=np.uint8, copy=True)
                ref.setflags(write=False)
            else:  # a copy into this node's object store, owned by this actor
                ref = ray.put(record)
        except StoreFull:
            undo()
            return "full"
        except BaseException:
            undo()
            raise
        with s.cond:
            s.items[traj_id] = (ref, accounted, int(record.nbytes), pairs)
            s.counters["puts"] += 1
            s.counters["written_through"] += s.spill is not None
            s.counters["spilled_over"] += not in_memory
        return "ok"

    def put_batch(self, items: list[tuple[Any, ...]], content: Mapping[str, Sequence[Any]] | None = None) -> list[str]:
        """:meth:`put` for several records in one call, in order; stops at the first one that is not ``"ok"``.

        Each item is ``(id, record, nbytes)`` or ``(id, record, nbytes, media)``; ``content`` is shared by the
        batch (each new media item is sent once per call, whatever the number of records using it).

        Returns:
            One status per record stored or refused (shorter than ``items`` after a refusal).
        """
        staged = _stage(self._s, content) if content else {}
        out: list[str] = []
        for it in items:
            status = self._put(it[0], it[1], it[2], it[3] if len(it) > 3 else None, staged)
            out.append(status)
            if status != "ok":
                break
        return out

    def set_control(self, control: Any) -> None:
        """The coordinator actor handle, which :meth:`put_admit` calls (set by the coordinator as it starts)."""
        self._control = control

    def start_trace(self, path: str) -> float:
        """Trace this unit's process into ``path`` (:mod:`knitdata.observe.trace`), its clock offset measured against the
        coordinator (set by :meth:`set_control` first); returns the offset in microseconds."""
        tr = tracing.start(path, f"unit-{self._s.node_name or self._s.unit_id}")
        if self._control is None:
            return 0.0
        control = self._control
        return tr.sync(lambda: ray.get(control.clock.remote(), timeout=30))

    def flush_trace(self) -> None:
        """Write this process's trace events recorded so far."""
        if tracing.tracer is not None:
            tracing.tracer.flush()

    def trace_parts(self, path: str, known: dict[str, int]) -> dict[str, bytes]:
        """The part files of the trace ``path`` on this unit's node that ``known`` (the merging host's
        :func:`knitdata.observe.trace.part_sizes`) lacks or holds shorter: every process of this node traces there."""
        return tracing.parts_missing_from(path, known)

    def put_admit(self, recs: list[tuple[Any, ...]], items: list[Any],
                  content: Mapping[str, Sequence[Any]] | None = None) -> Stored:
        """The one-round-trip put: store the records that fit now, then admit them with one coordinator call.

        See :meth:`knitdata.storage.base.StorageUnit.put_admit`. Records the coordinator refused are dropped.

        Returns:
            :class:`~knitdata.control.records.Stored`: the records stored and admitted, the coordinator's
            :class:`~knitdata.control.records.Admitted` (or ``None``), the status (``"ok"``, ``"full"``, ``"dup"``,
            ``"closed"``, ``"missing:<i>"`` or ``"kind:<i>"``) and the position of the first record not stored;
            after ``"dup"``, ``"closed"``, ``"missing:<i>"`` or ``"kind:<i>"`` nothing of the batch is kept (nothing
            admitted: the client resends the batch with the media content, or refuses it).
        """
        t0 = tracing.now_us() if tracing.tracer is not None else 0.0
        statuses = self.put_batch(recs, content)
        status = statuses[-1] if statuses else "ok"
        if tracing.tracer is not None:
            tracing.tracer.span("store", "storage", t0, tracing.now_us(),
                                {"unit": self._s.unit_id, "trajectories": len(recs), "status": status})
        n = len(statuses) - (status != "ok")
        ids = [r[0] for r in recs[:n]]
        if status in ("dup", "closed") or status.startswith(("missing:", "kind:")):
            self.release(ids)
            return Stored(0, None, status, n)
        if n == 0:
            return Stored(0, None, status, 0)
        try:
            ans = self._admit(items[:n])
        except BaseException:
            self.release(ids)
            raise
        refused = [tid for tid, a in zip(ids, ans.accepted) if a is None]
        if refused:
            self.release(refused)
        return Stored(n, ans, status, n)

    def _admit(self, items: list[Any]) -> Admitted:
        """Admit one put's items; concurrent puts share one coordinator call (a group commit)."""
        gc = self._gc
        box: dict[str, Any] = {}
        with gc["cond"]:
            gc["queue"].append((items, box))
            while not box and gc["busy"]:
                gc["cond"].wait()
            if box:  # another put's call carried this one
                return self._answer(box)
            batch, gc["queue"] = gc["queue"], []
            gc["busy"] = True
        try:
            answers = self._call_admit([b[0] for b in batch])
            for (_it, bx), ans in zip(batch, answers):
                bx["ans"] = ans
        except BaseException as e:  # noqa: BLE001 - handed to every put of the call
            for _it, bx in batch:
                bx["err"] = e
        finally:
            with gc["cond"]:
                gc["busy"] = False
                gc["calls"] += 1
                gc["puts"] += len(batch)
                gc["cond"].notify_all()
        return self._answer(box)

    @staticmethod
    def _answer(box: Mapping[str, Any]) -> Admitted:
        if "err" in box:
            raise box["err"]
        ans: Admitted = box["ans"]  # this put's own answer (the coordinator answers each batch of a call apart)
        return ans

    def _call_admit(self, batches: list[Any]) -> list[Admitted]:
        control = self._control
        if control is None:
            raise EngineError(f"storage unit {self._s.unit_id!r} has no coordinator yet; retry the put")
        deadline = time.monotonic() + ADMIT_TIMEOUT_S
        while True:  # a restarting coordinator (journaled) answers a retried call as the first one
            try:
                if len(batches) == 1:
                    return [ray.get(control.admit_many.remote(self._s.unit_id, batches[0]),
                                    timeout=max(0.1, deadline - time.monotonic()))]
                return list(ray.get(control.admit_batches.remote(self._s.unit_id, batches),
                                    timeout=max(0.1, deadline - time.monotonic())))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def admit_stats(self) -> dict[str, int]:
        """``{"calls", "puts"}``: coordinator calls made for puts, and puts they carried (group commits)."""
        gc = self._gc
        with gc["cond"]:
            return {"calls": gc["calls"], "puts": gc["puts"]}

    @ray.method(concurrency_group="wait")
    def wait_room(self, nbytes: int, max_wait_s: float) -> bool:
        """Wait up to ``max_wait_s`` until ``nbytes`` fit; returns whether they fit now."""
        s = self._s
        t0 = time.perf_counter()
        with s.cond:
            s.cond.wait_for(lambda: s.fits(nbytes) or s.closed, timeout=max(0.0, max_wait_s))
            s.put_wait_s += time.perf_counter() - t0
            return s.fits(nbytes) and not s.closed

    def count_rejected(self) -> None:
        """Count one put that gave up (``StoreFull`` on the client)."""
        with self._s.cond:
            self._s.counters["rejected_puts"] += 1

    def refs(self, ids: list[str], have: Sequence[str] | None = None) -> tuple[Any, ...]:
        """Return ``([[ref or inline record, record bytes] per held id], [missing ids])`` (refs nested, so not
        resolved; records of at most :data:`INLINE_MAX_BYTES` come inline as ``numpy.uint8`` arrays).

        With ``have`` (the digests the reader holds already; media stored once), a third element: ``{digest:
        [ref or inline media record, record bytes]}`` for each distinct media item the held ids use that is not
        in ``have``: each item once per call, whatever the number of records using it.
        """
        s = self._s
        out: list[Any] = []
        missing: list[str] = []
        on_disk: list[int] = []
        media: dict[str, list[Any]] = {}
        media_on_disk: list[str] = []
        known = set(have) if have is not None else None
        table = s.media
        with s.cond:
            s.counters["get_requests"] += 1
            for tid in ids:
                item = s.items.get(tid)
                if item is None or item[0] is None:
                    missing.append(tid)
                    out.append(None)
                else:
                    if isinstance(item[0], str):  # _ON_DISK (compared by value: the string may come unpickled)
                        on_disk.append(len(out))
                    out.append([item[0], item[2]])
                    s.counters["gets"] += 1
                    s.counters["bytes_fetched"] += item[2]
                    if known is not None and table is not None:
                        for d in table.by_traj.get(tid, ()):
                            if d in known or d in media:
                                continue
                            e = table.entries[d]
                            media[d] = [e[0], e[2]]
                            if isinstance(e[0], str):
                                media_on_disk.append(d)
                            else:
                                s.counters["media_gets"] += 1
                                s.counters["media_bytes_fetched"] += e[2]
                                s.counters["bytes_fetched"] += e[2]
        for k in on_disk:  # spilled over: reload into this node's object store for this read only
            rec = encode_trajectory(s.spill.get(ids[k]))
            out[k] = [ray.put(np.frombuffer(rec, dtype=np.uint8)), len(rec)]
            with s.cond:
                s.counters["reloaded"] += 1
        for d in media_on_disk:  # a resumed unit's media sample: reloaded for this read only
            mrec = encode_media(s.spill.get(media_spill_id(d)).media[0])
            media[d] = [ray.put(np.frombuffer(mrec, dtype=np.uint8)), len(mrec)]
            with s.cond:
                s.counters["reloaded"] += 1
                s.counters["media_gets"] += 1
                s.counters["media_bytes_fetched"] += len(mrec)
                s.counters["bytes_fetched"] += len(mrec)
        if known is None:
            return out, missing
        return out, missing, media

    def release(self, ids: list[str]) -> int:
        """Drop payloads (idempotent) and their media references (an item goes with its last one); returns the
        accounted bytes freed."""
        s = self._s
        freed = 0
        dropped: list[str] = []
        with s.cond:
            for tid in ids:
                item = s.items.get(tid)
                if item is None or item[0] is None:
                    continue
                del s.items[tid]
                freed += item[1]
                if s.media is not None:
                    freed += s.media.drop(tid, s.spill)
                dropped.append(tid)
            s.used -= freed
            s.counters["releases"] += len(dropped)
            s.cond.notify_all()
        if s.spill is not None:
            for tid in dropped:
                s.spill.release(tid)
        return freed

    def media_record(self, digest: str) -> list[Any] | None:
        """``[ref or inline media record, nbytes]`` of ``digest`` if held (another unit resolves a reference to it),
        else ``None``."""
        s = self._s
        with s.cond:
            e = s.media.entries.get(digest) if s.media is not None else None
            if e is None:
                return None
            held, nbytes = e[0], e[5]
        if isinstance(held, str):  # a resumed unit's media sample on disk
            rec = encode_media(s.spill.get(media_spill_id(digest)).media[0])
            held = np.frombuffer(rec, dtype=np.uint8)
        return [held, nbytes]

    def media_check(self) -> dict[str, Any]:
        """Recount the media references from the held trajectories and compare with the counters (tests, drills):
        the format of :meth:`StorageUnit.media_check <knitdata.storage.base.StorageUnit.media_check>`
        (``leaked``: trajectories holding references without being held)."""
        s = self._s
        with s.cond:
            if s.media is None:
                return {"ok": True, "pairs": 0, "refs": 0, "items": 0, "bytes": 0, "distinct_bytes": 0, "leaked": []}
            out = s.media.check()
            leaked = sorted(t for t in s.media.by_traj if t not in s.items)
            held = sum(item[3] for item in s.items.values())  # counted from the payloads held, not the table
            out.update(ok=bool(out["ok"]) and not leaked and held == out["pairs"], items=len(s.media.entries),
                       leaked=leaked, pairs=held)
            return out

    def contains(self, traj_id: str) -> bool:
        """Whether the unit holds ``traj_id``."""
        with self._s.cond:
            item = self._s.items.get(traj_id)
            return item is not None and item[0] is not None

    def spill_stats(self) -> dict[str, int]:
        """``written_through``, ``spilled_over`` (puts kept on disk only) and ``reloaded`` counts."""
        with self._s.cond:
            return {k: self._s.counters[k] for k in ("written_through", "spilled_over", "reloaded")}

    def stats(self) -> dict[str, Any]:
        """Counters as a JSON-serializable dict (fields of :class:`~knitdata.storage.base.StorageStats`)."""
        s = self._s
        with s.cond:
            return {"unit_id": s.unit_id, "node": s.node_name or s.node, "capacity_bytes": s.capacity_bytes, "used_bytes": s.used,
                    "high_water_bytes": s.high, "num_items": len(s.items), "puts": s.counters["puts"],
                    "rejected_puts": s.counters["rejected_puts"], "put_wait_s": s.put_wait_s,
                    "gets": s.counters["gets"], "get_requests": s.counters["get_requests"],
                    "bytes_fetched": s.counters["bytes_fetched"], "releases": s.counters["releases"],
                    **(s.media.stats() if s.media is not None else {})}

    def close(self) -> None:
        """Refuse further puts and wake waiting producers."""
        with self._s.cond:
            self._s.closed = True
            self._s.cond.notify_all()
