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
from knitdata.storage.ray_actor import StorageUnitActor
from knitdata.storage.ray_connect import (
    NAMESPACE,
    current_node,
    host_gone_error,
    ray_get,
)
from knitdata.storage.ray_metrics import TransferMeter

__all__ = ["RayStorageUnit", "read_records"]

_LOST_ERRORS: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.ActorUnavailableError,
)
_LOST_OR_TIMEOUT: tuple[type[BaseException], ...] = (*_LOST_ERRORS, ray.exceptions.GetTimeoutError)
_MISSING_OR_LOST: tuple[type[BaseException], ...] = (ValueError, *_LOST_ERRORS)  # get_actor: ValueError if none
_log = logging.getLogger(__name__)


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

    def alive(self, timeout_s: float = 10.0) -> bool:
        """Whether the unit's actor answers within ``timeout_s`` (``False`` once its node or process died)."""
        try:
            ray_get(self._h.actor.info.remote(), timeout=timeout_s)
        except _LOST_OR_TIMEOUT:
            return False
        except ray.exceptions.RayTaskError:
            return False
        return True

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
        _recover_lost(items, lost, out, recover, meter, mode=mode, placement=placement, step=step)
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


def _recover_lost(items: Sequence[tuple[str, RayStorageUnit]], lost: dict[str, list[int]], out: list[Any],
                  recover: Callable[[RayStorageUnit, list[str]], Mapping[str, Any]], meter: TransferMeter | None, *,
                  mode: str, placement: str, step: int) -> None:
    """Fill ``out`` with what ``recover`` finds of the ``lost`` positions (by unit id); ``lost`` keeps the rest.

    Recovered bytes are counted under ``"<mode>+recovered"`` as cross-node (see :func:`read_records`).
    """
    for uid in list(lost):
        unit = items[lost[uid][0]][1]
        found = recover(unit, [items[p][0] for p in lost[uid]])
        still = []
        for p in lost[uid]:
            rec = found.get(items[p][0])
            if rec is None:
                still.append(p)
            else:
                out[p] = rec
                if meter is not None:
                    meter.record_read(len(rec), cross=True, mode=f"{mode}+recovered", placement=placement, step=step)
        if still:
            lost[uid] = still
        else:
            del lost[uid]
