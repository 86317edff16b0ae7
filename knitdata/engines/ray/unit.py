"""Ray storage units: one actor per training node, payloads in that node's Ray object store.

A :class:`StorageUnitActor` is pinned to its node with ``NodeAffinitySchedulingStrategy(soft=False)``. A
producer encodes a trajectory with :func:`knitdata.codec.encode_trajectory` (raw buffers + JSON header +
CRC32, never pickle) and sends the record as a ``numpy.uint8`` array; the actor ``ray.put`` s it, so the
object lives in the object store of the unit's node and is owned by the unit. A consumer asks the unit
for the :class:`ray.ObjectRef` s of the ids it needs and ``ray.get`` s them: on the same node that is a
read-only view of shared memory (no copy), decoded with ``decode_trajectory(buf, copy=False)``; on another
node Ray pulls the object once over the network, and :class:`~knitdata.engines.ray.metrics.TransferMeter`
counts those bytes as cross-node (the Ray node holding the object -- its owning unit's node, or Ray's
object locations on request -- against the reader's node).

Memory bound: a unit accounts each payload by ``Trajectory.nbytes`` and accepts a put when
``used + n <= capacity_bytes`` or when it is empty (the bound of :mod:`knitdata.storage.base`). A full unit
answers ``"full"`` and the client waits for room (:meth:`RayStorageUnit.put` with ``timeout``), then raises
:class:`~knitdata.errors.StoreFull`. Object store memory per node must exceed the unit's capacity plus
what consumers on the node pull in from other nodes. With a spill directory, a payload past the capacity
is kept only in the unit's :class:`~knitdata.storage.spill.SpillStore` (webdataset tar shards, bounded on disk)
and reloaded into the object store, for that read only, when a consumer fetches it.

Media stored once (``media_dedup=True``, the default): a record carries its media as references
(``encode_trajectory(traj, media="refs")``) and the unit keeps one record per media digest
(:func:`~knitdata.codec.encode_media`, in its node's object store or inline when small) with a count of the
payloads using it (:class:`~knitdata.engines.ray.media.UnitMedia`); a payload is accounted its own bytes plus
the items it brings that the unit does not hold yet. A client sends each distinct item once per call and not at
all when it sent it before (:class:`~knitdata.engines.ray.media.MediaSender`; a unit that freed it since
answers "missing" and the content goes again); a producer's :meth:`MediaItem.ref
<knitdata.record.MediaItem.ref>` is resolved here, from another unit (:attr:`RayStorageUnit.resolve`), or
refused with :class:`~knitdata.errors.MediaRefError`. A read fetches each distinct item a request lacks once
(:func:`~knitdata.engines.ray.read.read_records` with ``media``).

Failure: if a unit's actor dies, every payload it owned is gone from Ray (owner died), its media with it. Reads then raise
:class:`~knitdata.errors.TrajectoryLostError` naming the lost ids, unless a ``recover`` callback (e.g. a
spill written through, see :class:`SpillRecovery`) returns them.

Connecting to Ray (binding, token authentication, the host watch, bounded gets) is in
:mod:`knitdata.engines.ray.connect`. Importing this module without Ray installed raises :class:`~knitdata.errors.OptionalDependencyError`.
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
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.engines.ray.unit)") from _e

import numpy as np

from knitdata.codec import encode_trajectory
from knitdata.control.records import Admitted, Stored
from knitdata.engines.ray.connect import (
    NAMESPACE,
    current_node,
    host_gone_error,
    ray_get,
)
from knitdata.engines.ray.media import MediaSender, as_record_array, content_bytes
from knitdata.engines.ray.metrics import TransferMeter
from knitdata.engines.ray.read import LOST_ERRORS, LOST_OR_TIMEOUT, decode_records, read_records
from knitdata.engines.ray.unit_actor import StorageUnitActor
from knitdata.record import MediaItem, Trajectory
from knitdata.storage.base import StorageStats, StorageUnit

__all__ = ["RayStorageUnit", "read_records", "decode_records"]

#: Attempts of one put whose media a unit reported missing (content resent, or a reference resolved elsewhere).
_MEDIA_ATTEMPTS = 4

_LOST_ERRORS = LOST_ERRORS
_LOST_OR_TIMEOUT = LOST_OR_TIMEOUT
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
    media_dedup: bool = True

    @classmethod
    def from_info(cls, actor: Any, info: Mapping[str, Any]) -> _Handle:
        return cls(actor, info["unit_id"], info["node"], info["node_name"], int(info["capacity_bytes"]), info["spill"],
                   bool(info.get("media_dedup", True)))


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


def _count_puts(unit: RayStorageUnit, recs: Sequence[tuple[Any, ...]], content: Mapping[str, Any] | None) -> None:
    """Count ``unit``'s stored records on its meter, the media content of the call with the first one."""
    cross = current_node() != unit.ray_node
    extra = content_bytes(content)
    for r in recs:
        unit.meter.record_put(int(r[1].nbytes) + extra, cross=cross, placement=unit.placement)
        extra = 0


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
        #: The Ray actor handle.
        self.actor: Any = handle.actor
        self.unit_id = handle.unit_id
        self.node = handle.node_name
        self.ray_node = handle.node
        self.capacity_bytes = handle.capacity_bytes
        self.meter = meter if meter is not None else TransferMeter()
        self.placement = placement
        self.media_dedup = handle.media_dedup
        #: Finds a media digest this unit does not hold in another unit of the pipeline: ``(media record,
        #: nbytes)`` or ``None`` (set by the engine; ``None``: nowhere else).
        self.resolve: Callable[[str], tuple[np.ndarray, int] | None] | None = None
        self._media = MediaSender(self.unit_id, self.media_dedup)

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
        media_dedup: bool = True,
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
            spill_dir: Write accepted payloads through to a :class:`~knitdata.storage.spill.SpillStore` under this shared
                directory (recovery after the unit dies, see :class:`SpillRecovery`); payloads past the
                memory capacity then stay on disk only and are reloaded on fetch.
            media_dedup: Keep one copy of each media item by digest with counted references (``False``: each
                record carries its own copy, as before).
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
                 spill_bytes, False, bool(media_dedup))
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
        media_dedup: bool = True,
        **kwargs: Any,
    ) -> dict[str, RayStorageUnit]:
        """Start several units at once (in parallel): ``units`` are ``(unit id = layout node name, Ray node id)``.

        ``detached``: the actors outlive the creating process (end them with :meth:`kill`). ``resume``: a unit
        whose spill directory holds a previous run's shards serves their unreleased payloads (from disk).
        ``media_dedup``: see :meth:`create`.
        """
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        actors = [
            StorageUnitActor.options(  # type: ignore[attr-defined]  # an ActorClass (ray's stubs keep the class)
                name=cls.actor_name(prefix, uid), namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                lifetime="detached" if detached else None,
            ).remote(uid, capacity_bytes, os.fspath(spill_dir) if spill_dir is not None else None, uid, spill_bytes,
                     resume, bool(media_dedup))
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
                "spill": h.spill, "media_dedup": h.media_dedup}

    @property
    def spill_dir(self) -> str | None:
        """The write-through directory, if any."""
        return self._h.spill

    # ---------------------------------------------------------------------------- media stored once
    def media_record(self, digest: str) -> tuple[np.ndarray, int] | None:
        """The media record (:func:`~knitdata.codec.encode_media`) and ``nbytes`` of ``digest`` if this unit holds
        it (to resolve another unit's reference), else ``None`` (also when the unit is dead)."""
        try:
            ans = ray_get(self._h.actor.media_record.remote(digest))
        except _LOST_ERRORS:
            return None
        if ans is None:
            return None
        rec = ans[0] if isinstance(ans[0], np.ndarray) else ray_get(ans[0])
        return as_record_array(rec), int(ans[1])

    def media_check(self) -> dict[str, Any]:
        """The unit's media reference recount (see :meth:`StorageUnit.media_check
        <knitdata.storage.base.StorageUnit.media_check>`; tests and drills)."""
        return dict(ray_get(self._h.actor.media_check.remote()))

    # ---------------------------------------------------------------------------- StorageUnit API
    def put(self, traj: Trajectory, *, timeout: float | None = None) -> int:
        """Encode and store ``traj`` (its media once per unit with ``media_dedup``); see :meth:`put_record`.

        Raises:
            MediaRefError: A media reference no unit of the pipeline holds (nothing stored).
        """
        extra: dict[str, Any] = {}
        for attempt in range(_MEDIA_ATTEMPTS):
            recs, content = self._media.encode([traj], resend=attempt > 0, extra=extra)
            r = recs[0]
            status = self._put_one(r[0], r[1], r[2], r[3] if len(r) > 3 else None, content, timeout=timeout)
            if status == "ok":
                self._media.mark_sent(recs)
                return int(traj.nbytes)
            extra.update(self._media.fix(status, traj, self.resolve))
        raise EngineError(f"storage unit {self.unit_id!r} kept reporting the media of trajectory {traj.id!r} missing "
                          f"after {_MEDIA_ATTEMPTS} attempts (released while put?); retry the put")

    def put_many(self, trajs: Sequence[Trajectory], *, timeout: float | None = None) -> int:
        """Store several payloads with one actor call in the common case (room for all of them).

        Each distinct media item goes once per call (and not at all when the unit holds it already). Stops at
        the first payload that does not fit at once and stores the rest one by one, waiting up to ``timeout``
        each (:meth:`put`).

        Returns:
            How many were stored: all of them, unless an exception says otherwise (its ``stored`` attribute is
            the number stored before it, in order).
        """
        ok = 0
        extra: dict[str, Any] = {}
        try:
            for attempt in range(_MEDIA_ATTEMPTS):
                recs, content = self._media.encode(trajs[ok:], resend=attempt > 0, extra=extra)
                try:
                    statuses = ray_get(self._h.actor.put_batch.remote(recs, content))
                except _LOST_ERRORS as e:
                    raise host_gone_error() or TrajectoryLostError(
                        f"storage unit {self.unit_id!r} is dead; the puts were not stored",
                        trajectory_ids=[t.id for t in trajs[ok:]]) from e
                n = next((k for k, st in enumerate(statuses) if st != "ok"), len(statuses))
                _count_puts(self, recs[:n], content)
                self._media.mark_sent(recs[:n])
                ok += n
                if ok == len(trajs) or not statuses[n].startswith(("missing:", "kind:")):
                    break
                extra.update(self._media.fix(statuses[n], trajs[ok], self.resolve))
            for t in trajs[ok:]:  # no room now: one by one, each waiting for room
                self.put(t, timeout=timeout)
                ok += 1
        except BaseException as e:
            e.stored = ok  # type: ignore[attr-defined]
            raise
        return ok

    def put_admit(self, trajs: Sequence[Trajectory], items: Sequence[Sequence[Any]],
                  admit: Callable[[str, list[Any]], Admitted] | None = None) -> Stored:
        """The one-round-trip put (see :meth:`StorageUnit.put_admit`): the unit's actor stores the records that
        fit now and makes the admission call to the coordinator itself; ``admit`` is unused.

        Each distinct media item goes once per call (not at all when the unit holds it already); when the unit
        lacks one (freed since, or a reference), nothing of the batch is kept and the batch goes again with the
        content (or a reference's item found in another unit).

        Returns:
            The actor's :class:`~knitdata.control.records.Stored` (status ``"ok"``, or ``"full"`` when only the
            first ``stored`` fit), its :class:`~knitdata.control.records.Admitted` carried through.

        Raises:
            ValidationError: An id is already held by this unit. EngineError: The unit is closed.
            MediaRefError: A media reference no unit of the pipeline holds (nothing of the batch stored).
            TrajectoryLostError: The unit's actor is dead. The coordinator's error (a ``KnitdataError``).
        """
        extra: dict[str, Any] = {}
        listed = [list(x) for x in items]
        for attempt in range(_MEDIA_ATTEMPTS):
            recs, content = self._media.encode(trajs, resend=attempt > 0, extra=extra)
            try:
                res: Stored = ray_get(self._h.actor.put_admit.remote(recs, listed, content))
            except ray.exceptions.RayTaskError as e:
                raise _knitdata_cause(e) from None
            except _LOST_ERRORS as e:
                raise host_gone_error() or TrajectoryLostError(
                    f"storage unit {self.unit_id!r} is dead; the puts were not stored",
                    trajectory_ids=[r[0] for r in recs]) from e
            status = res.status
            if not status.startswith(("missing:", "kind:")):
                break
            extra.update(self._media.fix(status, trajs[res.index], self.resolve))
        else:
            raise EngineError(f"storage unit {self.unit_id!r} kept reporting media of this put missing after "
                              f"{_MEDIA_ATTEMPTS} attempts; retry the put")
        if status == "dup":
            raise ValidationError(f"already held by storage unit {self.unit_id!r}", trajectory_id=recs[res.index][0],
                                  field="id")
        if status == "closed":
            raise EngineError(f"storage unit {self.unit_id!r} is closed; create a new pipeline to put more")
        _count_puts(self, recs[:res.stored], content)
        self._media.mark_sent(recs[:res.stored])
        return res

    def put_record(self, traj_id: str, record: Any, nbytes: int, *, timeout: float | None = None) -> int:
        """Store one codec record (its media inline: not shared), waiting up to ``timeout`` seconds for room.

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
        self._put_one(traj_id, as_record_array(record), int(nbytes), None, None, timeout=timeout)
        return int(nbytes)

    def _put_one(self, traj_id: str, arr: np.ndarray, nbytes: int, media: list[Any] | None,
                 content: Mapping[str, Any] | None, *, timeout: float | None) -> str:
        """One record (and the media content it brings), waiting for room: ``"ok"``, or a unit's
        ``"missing:<i>"`` / ``"kind:<i>"`` answer for the caller to act on."""
        arg: Any = ray.put(arr) if arr.nbytes > 100_000 else arr  # put once locally, reuse on retries
        sent = content_bytes(content)
        content_arg: Any = ray.put(content) if sent > 100_000 else content
        need = int(nbytes) + int(sum(int(v[1]) for v in content.values())) if content else int(nbytes)
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        try:
            while True:
                status = ray_get(self._h.actor.put.remote(traj_id, arg, int(nbytes), media, content_arg))
                if status == "ok":
                    cross = current_node() != self.ray_node
                    self.meter.record_put(arr.nbytes + sent, cross=cross, placement=self.placement)
                    return "ok"
                if status.startswith(("missing:", "kind:")):
                    return str(status)
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
                        f"{traj_id!r} needs {need}) and nothing was released within {timeout} s; raise "
                        "capacity_bytes or let consumers commit (release) faster"
                    )
                wait = 0.5 if remaining is None else min(0.5, remaining)
                ray_get(self._h.actor.wait_room.remote(need, wait))
        except _LOST_ERRORS as e:
            raise host_gone_error() or TrajectoryLostError(f"storage unit {self.unit_id!r} is dead; the put was not "
                                                           "stored", trajectory_ids=[traj_id]) from e

    def get(self, ids: Sequence[str]) -> list[Trajectory]:
        """Return the trajectories of ``ids`` in order, decoded zero-copy (read-only tensors on this node); each
        distinct media item is fetched once and equal digests are the same :class:`~knitdata.record.MediaItem`."""
        media: dict[str, MediaItem] = {}
        recs = read_records([(tid, self) for tid in ids], meter=self.meter, placement=self.placement,
                            media=media if self.media_dedup else None)
        return decode_records(recs, media, ids)

    def get_records(self, ids: Sequence[str]) -> list[Any]:
        """Return the codec records of ``ids`` (read-only ``numpy.uint8`` views of the object store; with media
        stored once, records whose media are inline, encoded here)."""
        if not self.media_dedup:
            return read_records([(tid, self) for tid in ids], meter=self.meter, placement=self.placement)
        return [encode_trajectory(t) for t in self.get(ids)]

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
