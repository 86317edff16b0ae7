"""Ray storage units: one actor per training node, payloads in that node's Ray object store.

A :class:`StorageUnitActor` is pinned to its node with ``NodeAffinitySchedulingStrategy(soft=False)``. A
producer encodes a trajectory with :func:`knitdata.codec.encode_trajectory` (raw buffers + JSON header +
CRC32, never pickle) and sends the record as a ``numpy.uint8`` array; the actor ``ray.put`` s it, so the
object lives in the object store of the unit's node and is owned by the unit. A consumer asks the unit
for the :class:`ray.ObjectRef` s of the ids it needs and ``ray.get`` s them: on the same node that is a
read-only view of shared memory (no copy), decoded with ``decode_trajectory(buf, copy=False)``; on another
node Ray pulls the object once over the network, and :class:`~knitdata.storage.ray_metrics.TransferMeter`
counts those bytes as cross-node (the Ray node holding the object -- its owning unit's node, or Ray's
object locations on request -- against the reader's node).

Memory bound: a unit accounts each payload by ``Trajectory.nbytes`` and accepts a put when
``used + n <= capacity_bytes`` or when it is empty (the bound of :mod:`knitdata.storage.base`). A full unit
answers ``"full"`` and the client waits for room (:meth:`RayStorageUnit.put` with ``timeout``), then raises
:class:`~knitdata.errors.StoreFull`. Object store memory per node must exceed the unit's capacity plus
what consumers on the node pull in from other nodes. With a spill directory, a payload past the capacity
is kept only in the unit's :class:`~knitdata.spill.SpillStore` (webdataset tar shards, bounded on disk)
and reloaded into the object store, for that read only, when a consumer fetches it.

Failure: if a unit's actor dies, every payload it owned is gone from Ray (owner died). Reads then raise
:class:`~knitdata.errors.TrajectoryLostError` naming the lost ids, unless a ``recover`` callback (e.g. a
spill written through, see :class:`SpillRecovery`) returns them.

Connecting to Ray (binding, token authentication, the host watch, bounded gets) is in
:mod:`knitdata.storage.ray_connect`. Importing this module without Ray installed raises :class:`~knitdata.errors.OptionalDependencyError`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from knitdata.errors import (
    ConfigError,
    EngineError,
    KnitdataError,
    OptionalDependencyError,
    StoreFull,
    TrajectoryLostError,
    ValidationError,
)

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as _e:  # pragma: no cover - exercised by monkeypatching in tests
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.storage.ray_unit)") from _e

import numpy as np

from knitdata.codec import decode_trajectory, encode_trajectory
from knitdata.record import Trajectory
from knitdata.storage.base import StorageStats, StorageUnit
from knitdata.storage.ray_connect import (
    LOOPBACK,
    NAMESPACE,
    check_loopback,
    connect,
    current_node,
    host_gone_error,
    ray_get,
)
from knitdata.storage.ray_metrics import TransferMeter

__all__ = [
    # the connection helpers live in knitdata.storage.ray_connect; these are also here for drivers written before
    "LOOPBACK",
    "NAMESPACE",
    "connect",
    "check_loopback",
    "current_node",
    "StorageUnitActor",
    "RayStorageUnit",
    "SpillRecovery",
    "spill_directory",
    "read_records",
]

_LOST_ERRORS: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.ActorUnavailableError,
)
_LOST_OR_TIMEOUT: tuple[type[BaseException], ...] = (*_LOST_ERRORS, ray.exceptions.GetTimeoutError)
_MISSING_OR_LOST: tuple[type[BaseException], ...] = (ValueError, *_LOST_ERRORS)  # get_actor: ValueError if none
_ON_DISK = "on-disk"  # marks a payload that spilled over: only in the unit's spill store
#: Records up to this many bytes stay in the unit actor's own memory and travel inline in its replies (a
#: ``ray.put`` costs about 1 ms per object whatever its size; Ray inlines replies below 100 KiB).
INLINE_MAX_BYTES = 64 << 10
#: Seconds a storage unit keeps retrying the admission of a put while the coordinator restarts.
ADMIT_TIMEOUT_S = 120.0
_log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- spill
def spill_directory(spill_dir: str | os.PathLike[str], unit_id: str) -> str:
    """The :class:`~knitdata.spill.SpillStore` directory of one unit under a shared ``spill_dir``."""
    return os.path.join(os.fspath(spill_dir), unit_id.replace("/", "_"))


class SpillRecovery:
    """Serves the payloads of dead units from their write-through spill shards (thread-safe).

    Each unit with a ``spill_dir`` writes every accepted payload through to a
    :class:`knitdata.spill.SpillStore` (webdataset tar shards) in ``spill_directory(spill_dir, unit_id)``
    and releases it there too. After the unit's actor dies, this opens the store once
    (:meth:`SpillStore.open <knitdata.spill.SpillStore.open>` rebuilds exactly the unreleased samples) and
    returns records by id. Open it in one process only (the coordinator): opening rewrites the release log.

    Args:
        spill_dir: The shared spill directory.
    """

    def __init__(self, spill_dir: str | os.PathLike[str]) -> None:
        self.spill_dir = os.fspath(spill_dir)
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def records(self, unit_id: str, traj_ids: Sequence[str]) -> dict[str, bytes]:
        """Codec records of the ids found in the unit's spill (absent ids are left out)."""
        from knitdata.spill import SpillStore

        with self._lock:
            store = self._stores.get(unit_id)
            if store is None:
                directory = spill_directory(self.spill_dir, unit_id)
                if not os.path.isdir(directory):
                    return {}
                store = self._stores[unit_id] = SpillStore.open(directory, repair=False)
            out: dict[str, bytes] = {}
            for tid in traj_ids:
                if tid in store:
                    out[tid] = bytes(encode_trajectory(store.get(tid)))
            return out

    def close(self) -> None:
        """Close the opened stores."""
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()


# ----------------------------------------------------------------------------------------- the actor
class _UnitState:
    """The unit's bookkeeping (plain Python; the actor wraps it)."""

    def __init__(self, unit_id: str, capacity_bytes: int, spill_dir: str | None, node_name: str | None,
                 spill_bytes: int | None = None, resume: bool = False) -> None:
        self.unit_id = unit_id
        self.node_name = node_name
        self.capacity_bytes = capacity_bytes
        self.node = current_node()
        self.spill: Any = None
        if spill_dir:
            from knitdata.spill import SpillStore

            max_bytes = spill_bytes if spill_bytes is not None else 4 * capacity_bytes + (64 << 20)
            directory = spill_directory(spill_dir, unit_id)
            if resume and os.path.isdir(directory) and os.listdir(directory):
                # a whole-job restart: the unreleased payloads of the previous run, served from disk
                self.spill = SpillStore.open(directory, max_bytes=max(max_bytes, 1 << 30))
            else:
                self.spill = SpillStore(directory, max_bytes=max_bytes)
        # id -> (ObjectRef | inline numpy record | _ON_DISK | None while being put, accounted memory bytes,
        # record bytes)
        self.items: dict[str, tuple[Any, int, int]] = {}
        if resume and self.spill is not None:
            for tid in self.spill.ids():
                self.items[tid] = (_ON_DISK, 0, 0)
        self.cond = threading.Condition()
        self.used = self.high = 0
        self.counters = dict.fromkeys(
            ("puts", "rejected_puts", "gets", "get_requests", "bytes_fetched", "releases", "written_through",
             "spilled_over", "reloaded"), 0
        )
        self.put_wait_s = 0.0
        self.closed = False

    def fits(self, n: int) -> bool:
        return self.used + n <= self.capacity_bytes or self.used == 0


# ray's stubs omit the actor options max_concurrency and concurrency_groups
@ray.remote(num_cpus=0, max_concurrency=32, concurrency_groups={"wait": 64})  # type: ignore[call-overload]
class StorageUnitActor:
    """The storage unit of one node (a threaded Ray actor; every method is short or bounded).

    Producers waiting for room (:meth:`wait_room`, at most 0.5 s per call) run in their own concurrency
    group, so they never hold up reads and releases.

    Create it through :meth:`RayStorageUnit.create`, which pins it to its node.
    """

    def __init__(self, unit_id: str, capacity_bytes: int, spill_dir: str | None = None,
                 node_name: str | None = None, spill_bytes: int | None = None, resume: bool = False) -> None:
        self._s = _UnitState(unit_id, capacity_bytes, spill_dir, node_name, spill_bytes, resume)
        self._control: Any = None  # the coordinator, set by set_control
        # group commit of the puts' admission calls (see _admit)
        self._gc: dict[str, Any] = {"cond": threading.Condition(), "queue": [], "busy": False, "calls": 0, "puts": 0}

    def info(self) -> dict[str, Any]:
        """``unit_id``, ``node`` (Ray node id), ``node_name``, ``capacity_bytes``, ``pid``, ``spill``."""
        s = self._s
        return {"unit_id": s.unit_id, "node": s.node, "node_name": s.node_name or s.node,
                "capacity_bytes": s.capacity_bytes, "pid": os.getpid(),
                "spill": s.spill.directory if s.spill else None}

    def put(self, traj_id: str, record: np.ndarray, nbytes: int) -> str:
        """Store one record; returns ``"ok"``, ``"full"``, ``"dup"`` or ``"closed"`` (never blocks).

        With a spill store every record is written through to it; one that does not fit in memory stays on
        disk only (spill-over) and is reloaded into the object store when it is fetched. ``"full"`` then
        means the spill store is full too.
        """
        s = self._s
        with s.cond:
            if s.closed:
                return "closed"
            if traj_id in s.items:
                return "dup"
            in_memory = s.fits(nbytes)
            if not in_memory and s.spill is None:
                return "full"
            accounted = nbytes if in_memory else 0
            s.used += accounted  # reserve before the copy so concurrent puts respect the bound
            s.high = max(s.high, s.used)
            s.items[traj_id] = (None, accounted, int(record.nbytes))

        def undo() -> None:
            with s.cond:
                s.items.pop(traj_id, None)
                s.used -= accounted
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
            s.items[traj_id] = (ref, accounted, int(record.nbytes))
            s.counters["puts"] += 1
            s.counters["written_through"] += s.spill is not None
            s.counters["spilled_over"] += not in_memory
        return "ok"

    def put_batch(self, items: list[tuple[str, np.ndarray, int]]) -> list[str]:
        """:meth:`put` for several records in one call, in order; stops at the first one that is not ``"ok"``.

        Returns:
            One status per record stored or refused (shorter than ``items`` after a refusal).
        """
        out: list[str] = []
        for traj_id, record, nbytes in items:
            status = self.put(traj_id, record, nbytes)
            out.append(status)
            if status != "ok":
                break
        return out

    def set_control(self, control: Any) -> None:
        """The coordinator actor handle, which :meth:`put_admit` calls (set by the coordinator as it starts)."""
        self._control = control

    def put_admit(self, recs: list[tuple[str, np.ndarray, int]], items: list[Any]) -> dict[str, Any]:
        """The one-round-trip put: store the records that fit now, then admit them with one coordinator call.

        See :meth:`knitdata.storage.base.StorageUnit.put_admit`. Records the coordinator refused are dropped.

        Returns:
            ``{"stored": n, "status": "ok" | "full" | "dup" | "closed", "index": position of the first record not
            stored, "admit": the coordinator's answer or None}``; after ``"dup"`` or ``"closed"`` nothing of the
            batch is kept.
        """
        statuses = self.put_batch(recs)
        status = statuses[-1] if statuses else "ok"
        n = len(statuses) - (status != "ok")
        ids = [r[0] for r in recs[:n]]
        if status in ("dup", "closed"):
            self.release(ids)
            return {"stored": 0, "status": status, "index": n, "admit": None}
        if n == 0:
            return {"stored": 0, "status": status, "index": 0, "admit": None}
        try:
            ans = self._admit(items[:n])
        except BaseException:
            self.release(ids)
            raise
        refused = [tid for tid, a in zip(ids, ans["accepted"]) if a is None]
        if refused:
            self.release(refused)
        return {"stored": n, "status": status, "index": n, "admit": ans}

    def _admit(self, items: list[Any]) -> dict[str, Any]:
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
    def _answer(box: Mapping[str, Any]) -> dict[str, Any]:
        if "err" in box:
            raise box["err"]
        return dict(box["ans"])

    def _call_admit(self, batches: list[Any]) -> list[dict[str, Any]]:
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

    def refs(self, ids: list[str]) -> tuple[list[Any], list[str]]:
        """Return ``([[ref or inline record, record bytes] per held id], [missing ids])`` (refs nested, so not
        resolved; records of at most :data:`INLINE_MAX_BYTES` come inline as ``numpy.uint8`` arrays)."""
        s = self._s
        out: list[Any] = []
        missing: list[str] = []
        on_disk: list[int] = []
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
        for k in on_disk:  # spilled over: reload into this node's object store for this read only
            rec = encode_trajectory(s.spill.get(ids[k]))
            out[k] = [ray.put(np.frombuffer(rec, dtype=np.uint8)), len(rec)]
            with s.cond:
                s.counters["reloaded"] += 1
        return out, missing

    def release(self, ids: list[str]) -> int:
        """Drop payloads (idempotent); returns the accounted bytes freed."""
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
                dropped.append(tid)
            s.used -= freed
            s.counters["releases"] += len(dropped)
            s.cond.notify_all()
        if s.spill is not None:
            for tid in dropped:
                s.spill.release(tid)
        return freed

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
                    "bytes_fetched": s.counters["bytes_fetched"], "releases": s.counters["releases"]}

    def close(self) -> None:
        """Refuse further puts and wake waiting producers."""
        with self._s.cond:
            self._s.closed = True
            self._s.cond.notify_all()


# ---------------------------------------------------------------------------------------- the client
@dataclass
class _Handle:
    actor: Any
    unit_id: str
    node: str
    node_name: str
    capacity_bytes: int
    spill: str | None

    @classmethod
    def from_info(cls, actor: Any, info: Mapping[str, Any]) -> _Handle:
        return cls(actor, info["unit_id"], info["node"], info["node_name"], int(info["capacity_bytes"]), info["spill"])


def _knitdata_cause(e: BaseException) -> BaseException:
    """The ``KnitdataError`` a Ray task error wraps (through nested actor calls), else the error itself."""
    seen = 0
    cur: Any = e
    while isinstance(cur, ray.exceptions.RayTaskError) and seen < 8:
        cause = getattr(cur, "cause", None)
        if cause is None:
            try:
                cause = cur.as_instanceof_cause()
            except Exception:  # noqa: BLE001 - not reconstructible
                break
            if cause is cur:
                break
        cur = cause
        seen += 1
    return cur if isinstance(cur, KnitdataError) else e


def _as_record_array(record: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(record, np.ndarray):
        return record.reshape(-1).view(np.uint8)
    return np.frombuffer(record, dtype=np.uint8)


class RayStorageUnit(StorageUnit):
    """Client of one :class:`StorageUnitActor` (usable from any process attached to the cluster).

    Implements :class:`knitdata.storage.base.StorageUnit`; a process that has no handle attaches by name
    with :meth:`attach`. ``node`` is the node's name in the consumer layout (what the planner matches
    against ranks; the Ray node id when none was given), ``ray_node`` the Ray node id (what the transfer
    counters compare the reader's node with). Reads go through :func:`read_records` (one request per unit, cross-node bytes
    counted).

    Args:
        handle: The actor handle and its description (from :meth:`create` / :meth:`attach`).
        meter: Where this client counts put bytes (a fresh meter when ``None``).
        placement: Placement name the put counters are filed under.
    """

    def __init__(self, handle: _Handle, *, meter: TransferMeter | None = None, placement: str = "") -> None:
        self._h = handle
        self.unit_id = handle.unit_id
        self.node = handle.node_name
        self.ray_node = handle.node
        self.capacity_bytes = handle.capacity_bytes
        self.meter = meter if meter is not None else TransferMeter()
        self.placement = placement

    @staticmethod
    def actor_name(prefix: str, unit_id: str) -> str:
        """Name of a unit's actor in :data:`NAMESPACE`."""
        return f"{prefix}/unit/{unit_id}"

    @classmethod
    def create(
        cls,
        unit_id: str,
        node: str,
        capacity_bytes: int,
        *,
        prefix: str = "knitdata",
        spill_dir: str | os.PathLike[str] | None = None,
        node_name: str | None = None,
        spill_bytes: int | None = None,
        timeout_s: float = 60.0,
        **kwargs: Any,
    ) -> RayStorageUnit:
        """Start a unit's actor on Ray node ``node`` (hard node affinity) and wait until it is up.

        Args:
            unit_id: Unit id (recorded as ``TrajectoryMeta.location``).
            node: Ray node id (hex) the actor must run on.
            capacity_bytes: Capacity in bytes.
            prefix: Name prefix of the actor (one pipeline's actors share it).
            node_name: The node's name in the consumer layout (default: the Ray node id).
            spill_bytes: Disk bound of the spill store (default ``4 * capacity_bytes + 64 MiB``).
            spill_dir: Write accepted payloads through to a :class:`~knitdata.spill.SpillStore` under this shared
                directory (recovery after the unit dies, see :class:`SpillRecovery`); payloads past the
                memory capacity then stay on disk only and are reloaded on fetch.
            timeout_s: How long to wait for the actor to start.
            **kwargs: Passed to :class:`RayStorageUnit`.

        Raises:
            ConfigError: On a bad capacity. EngineError: If the actor did not start in time.
        """
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        actor = StorageUnitActor.options(  # type: ignore[attr-defined]  # an ActorClass (ray's stubs keep the class)
            name=cls.actor_name(prefix, unit_id),
            namespace=NAMESPACE,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            lifetime="detached" if kwargs.pop("detached", False) else None,
        ).remote(unit_id, capacity_bytes, os.fspath(spill_dir) if spill_dir is not None else None, node_name,
                 spill_bytes)
        try:
            info = ray.get(actor.info.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            ray.kill(actor)
            raise EngineError(f"storage unit {unit_id!r} did not start on node {node[:12]} within {timeout_s} s; "
                              "give the node logical CPUs / check that it is alive") from e
        if info["node"] != node:  # hard affinity makes this an invariant
            raise EngineError(f"storage unit {unit_id!r} started on node {info['node']}, not {node}")
        return cls(_Handle.from_info(actor, info), **kwargs)

    @classmethod
    def create_many(
        cls,
        units: Sequence[tuple[str, str]],
        capacity_bytes: int,
        *,
        prefix: str = "knitdata",
        spill_dir: str | os.PathLike[str] | None = None,
        spill_bytes: int | None = None,
        timeout_s: float = 120.0,
        detached: bool = False,
        resume: bool = False,
        **kwargs: Any,
    ) -> dict[str, RayStorageUnit]:
        """Start several units at once (in parallel): ``units`` are ``(unit id = layout node name, Ray node id)``.

        ``detached``: the actors outlive the creating process (end them with :meth:`kill`). ``resume``: a unit
        whose spill directory holds a previous run's shards serves their unreleased payloads (from disk).
        """
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        actors = [
            StorageUnitActor.options(  # type: ignore[attr-defined]  # an ActorClass (ray's stubs keep the class)
                name=cls.actor_name(prefix, uid), namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                lifetime="detached" if detached else None,
            ).remote(uid, capacity_bytes, os.fspath(spill_dir) if spill_dir is not None else None, uid, spill_bytes,
                     resume)
            for uid, node in units
        ]
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            for a in actors:
                ray.kill(a)
            raise EngineError(f"storage units did not start within {timeout_s} s; check that the nodes are alive") from e
        out = {}
        for (uid, node), actor, info in zip(units, actors, infos):
            if info["node"] != node:  # hard affinity makes this an invariant
                raise EngineError(f"storage unit {uid!r} started on node {info['node']}, not {node}")
            out[uid] = cls(_Handle.from_info(actor, info), **kwargs)
        return out

    @classmethod
    def attach(cls, unit_id: str, *, prefix: str = "knitdata", timeout_s: float = 30.0, **kwargs: Any) -> RayStorageUnit:
        """Attach to a running unit by id (from any process attached to the cluster)."""
        try:
            actor = ray.get_actor(cls.actor_name(prefix, unit_id), namespace=NAMESPACE)
            info = ray_get(actor.info.remote(), timeout=timeout_s)
        except _MISSING_OR_LOST as e:
            raise EngineError(f"no storage unit {unit_id!r} (prefix {prefix!r}) is running in this Ray cluster") from e
        return cls(_Handle.from_info(actor, info), **kwargs)

    @classmethod
    def from_handle(cls, actor: Any, desc: Mapping[str, Any], **kwargs: Any) -> RayStorageUnit:
        """Wrap an actor handle and its :meth:`handle_info` (no call to the actor: works for a dead unit)."""
        return cls(_Handle.from_info(actor, desc), **kwargs)

    def handle_info(self) -> dict[str, Any]:
        """The unit's description (as its actor's ``info()``), for :meth:`from_handle`."""
        h = self._h
        return {"unit_id": h.unit_id, "node": h.node, "node_name": h.node_name, "capacity_bytes": h.capacity_bytes,
                "spill": h.spill}

    @property
    def actor(self) -> Any:
        """The Ray actor handle."""
        return self._h.actor

    @property
    def spill_dir(self) -> str | None:
        """The write-through directory, if any."""
        return self._h.spill

    # ---------------------------------------------------------------------------- StorageUnit API
    def put(self, traj: Trajectory, *, timeout: float | None = None) -> int:
        """Encode and store ``traj``; see :meth:`put_record`."""
        return self.put_record(traj.id, encode_trajectory(traj), int(traj.nbytes), timeout=timeout)

    def put_many(self, trajs: Sequence[Trajectory], *, timeout: float | None = None) -> int:
        """Store several payloads with one actor call in the common case (room for all of them).

        Stops at the first payload that does not fit at once and stores the rest one by one, waiting up to
        ``timeout`` each (:meth:`put_record`).

        Returns:
            How many were stored: all of them, unless an exception says otherwise (its ``stored`` attribute is
            the number stored before it, in order).
        """
        recs = [(t.id, _as_record_array(encode_trajectory(t)), int(t.nbytes)) for t in trajs]
        try:
            statuses = ray_get(self._h.actor.put_batch.remote(recs))
        except _LOST_ERRORS as e:
            err: KnitdataError = host_gone_error() or TrajectoryLostError(
                f"storage unit {self.unit_id!r} is dead; the puts were not stored", trajectory_ids=[r[0] for r in recs])
            err.stored = 0  # type: ignore[attr-defined]
            raise err from e
        ok = 0
        for (_tid, arr, _n), st in zip(recs, statuses):
            if st != "ok":
                break
            self.meter.record_put(arr.nbytes, cross=current_node() != self.ray_node, placement=self.placement)
            ok += 1
        for tid, arr, n in recs[ok:]:
            try:
                self.put_record(tid, arr, n, timeout=timeout)
            except BaseException as e:
                e.stored = ok  # type: ignore[attr-defined]
                raise
            ok += 1
        return ok

    def put_admit(self, trajs: Sequence[Trajectory], items: Sequence[Sequence[Any]],
                  admit: Callable[[str, list[Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The one-round-trip put (see :meth:`StorageUnit.put_admit`): the unit's actor stores the records that
        fit now and makes the admission call to the coordinator itself; ``admit`` is unused.

        Raises:
            ValidationError: An id is already held by this unit. EngineError: The unit is closed.
            TrajectoryLostError: The unit's actor is dead. The coordinator's error (a ``KnitdataError``).
        """
        recs = [(t.id, _as_record_array(encode_trajectory(t)), int(t.nbytes)) for t in trajs]
        try:
            res = ray_get(self._h.actor.put_admit.remote(recs, [list(x) for x in items]))
        except ray.exceptions.RayTaskError as e:
            raise _knitdata_cause(e) from None
        except _LOST_ERRORS as e:
            raise host_gone_error() or TrajectoryLostError(
                f"storage unit {self.unit_id!r} is dead; the puts were not stored",
                trajectory_ids=[r[0] for r in recs]) from e
        if res["status"] == "dup":
            raise ValidationError(f"already held by storage unit {self.unit_id!r}", trajectory_id=recs[res["index"]][0],
                                  field="id")
        if res["status"] == "closed":
            raise EngineError(f"storage unit {self.unit_id!r} is closed; create a new pipeline to put more")
        cross = current_node() != self.ray_node
        for _tid, arr, _n in recs[:res["stored"]]:
            self.meter.record_put(arr.nbytes, cross=cross, placement=self.placement)
        return {"stored": int(res["stored"]), "admit": res["admit"]}

    def put_record(self, traj_id: str, record: Any, nbytes: int, *, timeout: float | None = None) -> int:
        """Store one codec record, waiting up to ``timeout`` seconds for room.

        Args:
            traj_id: The trajectory id.
            record: The codec record (bytes-like or ``numpy.uint8`` array).
            nbytes: Bytes to account (``Trajectory.nbytes``).
            timeout: Seconds to wait for room; ``0`` raises at once; ``None`` waits without limit.

        Returns:
            ``nbytes``.

        Raises:
            StoreFull: No room within ``timeout``. ValidationError: The id is already held.
            EngineError: The unit is closed. TrajectoryLostError: The unit's actor is dead.
        """
        arr = _as_record_array(record)
        arg: Any = ray.put(arr) if arr.nbytes > 100_000 else arr  # put once locally, reuse on retries
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        try:
            while True:
                status = ray_get(self._h.actor.put.remote(traj_id, arg, int(nbytes)))
                if status == "ok":
                    self.meter.record_put(arr.nbytes, cross=current_node() != self.ray_node, placement=self.placement)
                    return int(nbytes)
                if status == "dup":
                    raise ValidationError(f"already held by storage unit {self.unit_id!r}", trajectory_id=traj_id,
                                          field="id")
                if status == "closed":
                    raise EngineError(f"storage unit {self.unit_id!r} is closed; create a new pipeline to put more")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._h.actor.count_rejected.remote()
                    raise StoreFull(
                        f"storage unit {self.unit_id!r} is full (capacity {self.capacity_bytes} bytes, trajectory "
                        f"{traj_id!r} needs {nbytes}) and nothing was released within {timeout} s; raise "
                        "capacity_bytes or let consumers commit (release) faster"
                    )
                wait = 0.5 if remaining is None else min(0.5, remaining)
                ray_get(self._h.actor.wait_room.remote(int(nbytes), wait))
        except _LOST_ERRORS as e:
            raise host_gone_error() or TrajectoryLostError(f"storage unit {self.unit_id!r} is dead; the put was not "
                                                           "stored", trajectory_ids=[traj_id]) from e

    def get(self, ids: Sequence[str]) -> list[Trajectory]:
        """Return the trajectories of ``ids`` in order, decoded zero-copy (read-only tensors on this node)."""
        return [decode_trajectory(r, copy=False) for r in self.get_records(ids)]

    def get_records(self, ids: Sequence[str]) -> list[Any]:
        """Return the codec records of ``ids`` (read-only ``numpy.uint8`` views of the object store)."""
        return read_records([(tid, self) for tid in ids], meter=self.meter, placement=self.placement)

    def release(self, ids: Sequence[str]) -> int:
        """Drop payloads (idempotent); returns the bytes freed (0 if the unit is dead)."""
        try:
            return int(ray_get(self._h.actor.release.remote(list(ids))))
        except _LOST_ERRORS:
            return 0

    def release_async(self, ids: Sequence[str]) -> Any:
        """Like :meth:`release`, without waiting (returns the Ray future)."""
        return self._h.actor.release.remote(list(ids))

    def contains(self, traj_id: str) -> bool:
        """Whether the unit holds ``traj_id``."""
        return bool(ray_get(self._h.actor.contains.remote(traj_id)))

    def stats(self) -> StorageStats:
        """The unit's counters."""
        return StorageStats(**ray_get(self._h.actor.stats.remote()))

    def close(self) -> None:
        """Refuse further puts."""
        try:
            ray_get(self._h.actor.close.remote())
        except _LOST_ERRORS:
            pass

    def kill(self) -> None:
        """Kill the unit's actor (its payloads are lost; used for shutdown and failure tests)."""
        ray.kill(self._h.actor, no_restart=True)

    def __repr__(self) -> str:
        return f"RayStorageUnit({self.unit_id!r}, node={self.node!r}, capacity_bytes={self.capacity_bytes})"


# -------------------------------------------------------------------------------------------- reads
def read_records(
    items: Sequence[tuple[str, RayStorageUnit]],
    *,
    meter: TransferMeter | None = None,
    mode: str = "sample",
    placement: str = "",
    step: int = -1,
    recover: Callable[[RayStorageUnit, list[str]], Mapping[str, Any]] | None = None,
    timeout_s: float = 120.0,
    locate: str = "owner",
) -> list[Any]:
    """Fetch the records of ``(trajectory id, unit)`` pairs in one request per unit, in order.

    Bytes are counted on ``meter`` as local or cross-node from Ray's object locations against this
    process's node, before the ``ray.get`` that moves them.

    Args:
        items: ``(id, unit)`` pairs.
        meter: Counters to update (none when ``None``).
        mode: Fetch mode the bytes are filed under.
        placement: Placement the bytes are filed under.
        step: Mini-batch step the bytes are filed under.
        recover: Called with ``(unit, ids)`` for ids a dead or forgetful unit cannot serve; returns the
            records it found (e.g. :meth:`SpillRecovery.records`). Recovered bytes count as cross-node reads
            of shared storage only if they come from another node, which a callback cannot know: they
            are counted under mode ``"<mode>+recovered"`` as cross-node.
        timeout_s: Bound on each Ray call (a dead node never hangs the reader).
        locate: Where an object is, for the counters: ``"owner"`` (default): the Ray node of the unit that
            owns it, where its primary copy lives (exact as long as each payload is read once per node, which
            is how the planner hands them out); ``"ray"``: ``ray.experimental.get_object_locations``, which
            also sees secondary copies pulled earlier by another reader on this node. Ray 2.60 aborted a
            consumer process once ("std::future_error: Promise already satisfied" in
            ``GetLocationFromOwner``) under ``"ray"`` on this 2-core machine, hence the default.

    Returns:
        Records in the order of ``items`` (read-only ``numpy.uint8`` arrays, or ``bytes`` if recovered).

    Raises:
        TrajectoryLostError: Naming every id that could be neither read nor recovered.
    """
    by_unit: dict[str, tuple[RayStorageUnit, list[int]]] = {}
    for idx, (_tid, unit) in enumerate(items):
        by_unit.setdefault(unit.unit_id, (unit, []))[1].append(idx)
    futures = {uid: unit.actor.refs.remote([items[p][0] for p in pos]) for uid, (unit, pos) in by_unit.items()}
    out: list[Any] = [None] * len(items)
    lost: dict[str, list[int]] = {}  # unit id -> positions
    refs: list[Any] = []
    ref_pos: list[int] = []
    ref_len: list[int] = []
    for uid, fut in futures.items():
        unit, pos = by_unit[uid]
        try:
            answer, _missing = ray_get(fut, timeout=timeout_s)
        except _LOST_OR_TIMEOUT:
            lost.setdefault(uid, []).extend(pos)
            continue
        for p, a in zip(pos, answer):
            if a is None:
                lost.setdefault(uid, []).append(p)
            elif isinstance(a[0], np.ndarray):  # a small record, inline in the unit's reply
                out[p] = a[0]
                if meter is not None:
                    meter.record_read(int(a[1]), cross=current_node() != unit.ray_node, mode=mode, placement=placement,
                                      step=step)
            else:
                refs.append(a[0])
                ref_pos.append(p)
                ref_len.append(int(a[1]))
    if refs:
        here = current_node()
        locations: dict[Any, Any] = {}
        if locate == "ray":
            for r in refs:  # one object per call: the narrowest use of the call
                try:
                    locations.update(ray.experimental.get_object_locations([r], timeout_ms=int(timeout_s * 1000)))
                except Exception:  # noqa: BLE001 - owner gone: the gets below find out which ones
                    pass
        elif locate != "owner":
            raise ConfigError(f"locate must be 'owner' or 'ray', got {locate!r}")
        try:
            values = ray_get(refs, timeout=timeout_s)
        except _LOST_OR_TIMEOUT:
            values = []
            for r in refs:  # find out which ones are gone
                try:
                    values.append(ray_get(r, timeout=timeout_s))
                except _LOST_OR_TIMEOUT:
                    values.append(None)
        for r, p, n, v in zip(refs, ref_pos, ref_len, values):
            if v is None:
                lost.setdefault(items[p][1].unit_id, []).append(p)
                continue
            out[p] = v
            if meter is not None:
                nodes = locations.get(r, {}).get("node_ids") or [items[p][1].ray_node]
                meter.record_read(n, cross=here not in nodes, mode=mode, placement=placement, step=step)
    if lost and recover is not None:
        for uid in list(lost):
            unit = by_unit[uid][0]
            want = [items[p][0] for p in lost[uid]]
            found = recover(unit, want)
            still = []
            for p in lost[uid]:
                rec = found.get(items[p][0])
                if rec is None:
                    still.append(p)
                else:
                    out[p] = rec
                    if meter is not None:
                        meter.record_read(len(rec), cross=True, mode=f"{mode}+recovered", placement=placement,
                                          step=step)
            if still:
                lost[uid] = still
            else:
                del lost[uid]
    if lost:
        gone = host_gone_error()
        if gone is not None:
            raise gone
        ids = [items[p][0] for uid in lost for p in lost[uid]]
        units = sorted(lost)
        raise TrajectoryLostError(
            f"storage unit(s) {units} could not serve these payloads (the unit's actor or node died, or they "
            "were released before this read); enable spill (spill_dir=...) to recover from disk, or restart "
            "from the last checkpoint",
            trajectory_ids=ids,
        )
    return out
