"""The Ray engine: the pipeline across processes and nodes (DESIGN.md §4 "Engines", issue 6).

Pieces (all on one Ray cluster):

* one **storage unit** actor per training node (:class:`~knitdata.storage.ray_unit.StorageUnitActor`,
  hard node affinity), payloads in that node's object store as codec records (no pickle);
* one **coordinator** actor (:class:`CoordinatorActor`) holding the control plane on metadata only: the
  admission policy (:mod:`knitdata.admission`), the placement (:mod:`knitdata.placement`), the planner
  (:mod:`knitdata.planner`), each consumer's queue of planned micro-batches, commits and releases, and the
  summed cross-node counters;
* **producers** in any process: :meth:`RayClient.put` asks the coordinator for a unit (placement), sends
  the record straight to that unit's actor, then offers the metadata to admission (payload bytes never
  pass through the coordinator);
* **consumers**: :class:`~knitdata.storage.ray_dataset.RayTrajectoryDataset`, an ``IterableDataset`` for one rank (explicit, or taken
  from ``torch.distributed``), usable in the rank's process and in DataLoader worker processes: worker
  ``w`` of ``W`` takes the rank's micro-batches ``j`` with ``j % W == w`` (the DataLoader's in-order
  round robin then yields them in plan order, each exactly once).

Micro-batch index ``j``: the position of a micro-batch in its rank's plan (0, 1, 2, ... over mini-batches).
A dataset's state is the next ``j`` of each worker: a few integers, JSON-serializable.

Release: with ``release="commit"`` (default) a payload is released when its consumer **commits** a state
past its micro-batch (:meth:`~knitdata.storage.ray_dataset.RayTrajectoryDataset.commit` with the dataset's or the StatefulDataLoader's
state, typically right after saving a checkpoint): a trainer restarted from that state receives exactly
the micro-batches after it, from the still-running cluster, even those its loader had prefetched before
the crash. With ``release="handout"`` a payload is released as soon as its micro-batch is handed out (no
commits needed; a restart then needs a new pipeline fed the same puts, as on the embedded engine).
Storage memory is bounded by each unit's ``capacity_bytes``; producers block (then ``StoreFull``) while
consumers have not committed.

Binding: nothing listens beyond what the user says. :func:`~knitdata.storage.ray_unit.connect` with
``address=None`` (the default) starts a local Ray bound to ``127.0.0.1`` with the dashboard off; with an
address it attaches to that cluster and, with ``loopback_only=True`` (the default), refuses one with a node
that is not on loopback.

Plugging into :class:`knitdata.pipeline.Pipeline`: ``Pipeline(..., engine="ray", engine_options={...})``
calls :func:`make_units` (through ``build_units``): the control plane stays in that process, the payloads
go to Ray units on the nodes (one process, any number of nodes). For producers and consumers in other
processes (ranks, DataLoader workers) the control plane must live in the cluster: that is
:class:`RayPipeline`, which :meth:`RayPipeline.from_pipeline_args` builds from ``Pipeline``'s arguments.

Example (producer process and two consumer ranks)::

    # driver / producer
    pipe = RayPipeline(BatchSpec({"math": 8}, num_minibatches=2), layout=ConsumerLayout(["n0", "n1"]),
                       name="run1", address="127.0.0.1:6379", token_budget=4096)
    for traj in rollout():
        pipe.put(traj)
    pipe.close()
    # each trainer rank r (torchrun, after init_process_group)
    ds = RayTrajectoryDataset("run1", address="127.0.0.1:6379")        # rank from torch.distributed
    loader = ds.stateful_loader(num_workers=2)
    for mb in loader:
        ...
        if checkpoint_now:
            state = loader.state_dict(); save(state); ds.commit(state)
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from knitdata.errors import (
    ConfigError,
    EngineError,
    KnitdataError,
    OptionalDependencyError,
    QuotaInfeasibleError,
    StateError,
    ValidationError,
)

try:
    import ray
except ImportError as _e:  # pragma: no cover - exercised by monkeypatching in tests
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.storage.ray_engine)") from _e


from knitdata.admission import AdmittedMiniBatch, BatchSpec, make_policy
from knitdata.placement import ConsumerLayout, make_placement
from knitdata.planner import Planner
from knitdata.record import Trajectory, TrajectoryMeta
from knitdata.storage.base import StorageUnit
from knitdata.storage.ray_metrics import TransferMeter
from knitdata.storage.ray_unit import (
    NAMESPACE,
    RayStorageUnit,
    SpillRecovery,
    alive_nodes,
    connect,
    current_address,
    current_node,
)

__all__ = [
    "CoordinatorActor",
    "RayClient",
    "RayPipeline",
    "make_units",
    "resolve_nodes",
    "RELEASE_MODES",
]

#: When payloads leave storage (see the module docstring).
RELEASE_MODES: tuple[str, ...] = ("commit", "handout")
#: How many withdrawn group ids the coordinator remembers to refuse late members.
_WITHDRAWN_MEMORY = 1 << 16


def _coordinator_name(name: str) -> str:
    return f"{name}/coordinator"


def resolve_nodes(layout: ConsumerLayout, nodes: Mapping[str, str] | Sequence[str] | None = None) -> dict[str, str]:
    """Map each node name of ``layout`` to a Ray node id.

    Args:
        layout: Consumers by node.
        nodes: ``{layout node name: Ray node id}``, or Ray node ids in the order of ``layout.nodes``;
            default: the alive Ray nodes in Ray's order (the head first).

    Raises:
        ConfigError: More layout nodes than Ray nodes, or an unknown Ray node id.
    """
    alive = alive_nodes()
    if nodes is None:
        if len(layout.nodes) > len(alive):
            raise ConfigError(f"the layout has {len(layout.nodes)} nodes but the Ray cluster only {len(alive)} alive; "
                              "add nodes or pass nodes={layout node: Ray node id}")
        return dict(zip(layout.nodes, alive))
    mapping = dict(nodes) if isinstance(nodes, Mapping) else dict(zip(layout.nodes, nodes))
    missing = [n for n in layout.nodes if n not in mapping]
    unknown = [v for v in mapping.values() if v not in alive]
    if missing or unknown:
        raise ConfigError(f"nodes: layout nodes without a Ray node {missing}, Ray node ids not alive {unknown}")
    return {n: mapping[n] for n in layout.nodes}


def make_units(
    layout: ConsumerLayout,
    capacity_bytes: int,
    *,
    address: str | None = None,
    nodes: Mapping[str, str] | Sequence[str] | None = None,
    name: str = "knitdata",
    spill_dir: str | os.PathLike[str] | None = None,
    spill_bytes: int | None = None,
    loopback_only: bool = True,
) -> dict[str, StorageUnit]:
    """One Ray storage unit per node of ``layout`` (the hook of ``knitdata.pipeline.build_units``).

    With this, ``Pipeline(..., engine="ray", engine_options={"address": ...})`` keeps its control plane in
    the calling process and its payloads in the Ray object stores of the nodes. For producers and
    consumers in other processes use :class:`RayPipeline` / :class:`RayClient`.

    Args:
        layout: Consumers by node; unit ids are the layout's node names.
        capacity_bytes: Capacity of each unit.
        address: Ray cluster address; ``None`` starts a local loopback-only Ray (see module docstring).
        nodes: See :func:`resolve_nodes`.
        name: Actor name prefix.
        spill_dir: Write payloads through to spill shards under this shared directory (recovery when a unit
            dies; payloads past ``capacity_bytes`` stay on disk and are reloaded on fetch).
        spill_bytes: Disk bound of each unit's spill store.
        loopback_only: Refuse non-loopback nodes.
    """
    connect(address, loopback_only=loopback_only)
    mapping = resolve_nodes(layout, nodes)
    return dict(RayStorageUnit.create_many([(n, mapping[n]) for n in layout.nodes], capacity_bytes, prefix=name,
                                           spill_dir=spill_dir, spill_bytes=spill_bytes))


# -------------------------------------------------------------------------------------- coordinator
class _Coordinator:
    """The control plane (plain Python, thread-safe); :class:`CoordinatorActor` hosts it in Ray."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)
        self.name = config["name"]
        self.spec = BatchSpec.from_dict(config["spec"])
        self.layout = ConsumerLayout.from_dict(config["layout"])
        self.policy = make_policy(config["admission"], self.spec, **dict(config.get("admission_options") or {}))
        self.release_mode = config.get("release", "commit")
        node_map: dict[str, str] = config["nodes"]
        self.units = RayStorageUnit.create_many(
            [(n, node_map[n]) for n in self.layout.nodes], int(config["capacity_bytes"]), prefix=self.name,
            spill_dir=config.get("spill_dir"), spill_bytes=config.get("spill_bytes"))
        self.placement_name = config["placement"]
        self.placement = make_placement(self.placement_name, list(self.units))
        self.planner = Planner(self.layout, int(config["token_budget"]),
                               allow_split_groups=bool(config.get("allow_split_groups", False)),
                               locality=self.placement.consumer_aware,
                               balance_tolerance=float(config.get("balance_tolerance", 0.1)))
        self.recovery = SpillRecovery(config["spill_dir"]) if config.get("spill_dir") else None
        self.cond = threading.Condition()
        self.seq = 0
        # puts in progress: id -> (unit, metadata dict, seq); a producer that died mid-put leaves one behind
        self.putting: dict[str, tuple[str, dict[str, Any], int]] = {}
        # field names every trajectory carries (set by the first accepted put), so every micro-batch collates
        self.schema: dict[str, list[str]] | None = None
        # recently withdrawn groups: a late member is refused instead of starting a group that never completes
        self.withdrawn: OrderedDict[str, None] = OrderedDict()
        self.live: dict[str, TrajectoryMeta] = {}
        self.loss: dict[str, int] = {}
        n = self.layout.num_consumers
        self.queues: list[dict[int, dict[str, Any]]] = [{} for _ in range(n)]
        self.planned = [0] * n  # entries appended per rank
        self.committed = [0] * n  # entries below are released and forgotten
        self.closed = False
        self.error: str | None = None
        self.meter = TransferMeter()
        self.counts = {"puts": 0, "rejected": 0, "withdrawn": 0, "admitted_minibatches": 0,
                       "admitted_trajectories": 0, "planned_local_bytes": 0, "planned_remote_bytes": 0,
                       "released": 0}
        self.version = 0

    # producer side -------------------------------------------------------------------------------
    def reserve(self, meta: dict[str, Any]) -> dict[str, Any]:
        with self.cond:
            self._check_open()
            tid = meta["id"]
            if meta["source"] not in self.spec.quotas:
                raise ValidationError(f"unknown source {meta['source']!r}; the batch spec has {list(self.spec.sources)}",
                                      trajectory_id=tid, field="source")
            if tid in self.live:
                raise ValidationError("was already put and is still held; ids must be unique", trajectory_id=tid,
                                      field="id")
            if meta["group"] in self.withdrawn:
                raise ValidationError(f"its group {meta['group']!r} was withdrawn (aborted or filtered); a late "
                                      "member is not accepted", trajectory_id=tid, field="group")
            fields = meta.get("fields")
            if self.schema is not None and fields is not None:
                for kind in ("scalars", "tensors"):
                    have, want = set(fields.get(kind, ())), set(self.schema[kind])
                    if have != want:
                        missing, extra = sorted(want - have), sorted(have - want)
                        raise ValidationError(
                            f"carries {kind} {sorted(have)} but this pipeline's trajectories carry {sorted(want)} "
                            f"(missing {missing}, unexpected {extra}); every trajectory needs the same fields so "
                            "that any micro-batch collates", trajectory_id=tid, field=f"{kind}.{(missing or extra)[0]}")
            stale = self.putting.pop(tid, None)
            if stale is not None:
                # a retry after the producer died mid-put (or a concurrent duplicate, which then loses): drop the
                # orphaned payload synchronously, so it cannot race the retry's own put into the same unit
                old_unit, old_meta, _ = stale
                self.units[old_unit].release([tid])
                self.placement.unplace(TrajectoryMeta.from_dict(old_meta), old_unit)
                self.counts["rejected"] += 1
            m = TrajectoryMeta.from_dict({**meta, "seq": self.seq, "location": None})
            self.seq += 1
            unit = self.placement.place(m)
            self.putting[tid] = (unit, {**m.to_dict(), "fields": fields}, m.seq)
            return {"seq": m.seq, "unit": unit}

    def unreserve(self, meta: dict[str, Any], unit: str) -> None:
        with self.cond:
            cur = self.putting.get(meta["id"])
            if cur is None or cur[2] != meta.get("seq"):
                return  # superseded by a retry, which owns the placement now
            del self.putting[meta["id"]]
            self.placement.unplace(TrajectoryMeta.from_dict(meta), unit)
            self.counts["rejected"] += 1

    def offer(self, meta: dict[str, Any], loss_tokens: int) -> None:
        m = TrajectoryMeta.from_dict(meta)
        with self.cond:
            cur = self.putting.get(m.id)
            if cur is None or cur[2] != m.seq:
                raise ValidationError(
                    "this put was superseded by a newer put of the same id (a retry); it was not accepted",
                    trajectory_id=m.id, field="id")
            del self.putting[m.id]
            if self.closed or self.error is not None:
                self._release_metas([m])
                raise EngineError("the pipeline was closed while this put was in progress; it was not accepted")
            if m.group in self.withdrawn:  # withdrawn while this put was in progress
                self._release_metas([m])
                raise ValidationError(f"its group {m.group!r} was withdrawn while this put was in progress; it was "
                                      "not accepted", trajectory_id=m.id, field="group")
            self.live[m.id] = m
            self.loss[m.id] = int(loss_tokens)
            try:
                self.policy.offer([m])
            except BaseException:
                self._release_metas([m])
                raise
            if self.schema is None and cur[1].get("fields") is not None:
                self.schema = {k: list(v) for k, v in cur[1]["fields"].items()}
            self.counts["puts"] += 1
            self._poll()

    def set_in_flight(self, counts: Mapping[str, int]) -> None:
        with self.cond:
            self._check_open()
            try:
                self.policy.set_in_flight(counts)
            except QuotaInfeasibleError as e:  # the quotas can no longer be met: the pipeline stops
                self._fail(e)
                raise
            self._poll()  # any other error (a misspelt source...) rejected the call and changed nothing

    def withdraw(self, group: str) -> list[dict[str, Any]]:
        with self.cond:
            metas = self.policy.withdraw(group)
            self.withdrawn[group] = None
            while len(self.withdrawn) > _WITHDRAWN_MEMORY:
                self.withdrawn.popitem(last=False)
            self._release_metas(metas)
            self.counts["withdrawn"] += len(metas)
            self.placement.forget_group(group)
            if not self.closed:
                self._poll()
            return [m.to_dict() for m in metas]

    def report_version(self, version: int) -> None:
        with self.cond:
            if version < self.version:
                raise ValidationError(f"version {version} is older than the last reported {self.version}",
                                      field="version")
            self.version = int(version)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for u in self.units.values():
            u.close()

    # consumer side -------------------------------------------------------------------------------
    def entries(self, rank: int, j: int, timeout_s: float) -> dict[str, Any]:
        """Entries ``j..`` up to the end of ``j``'s mini-batch, or ``{"end": True}``, or ``{"wait": True}``."""
        self._check_rank(rank)
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                if self.error is not None:
                    raise EngineError(f"the pipeline stopped after an admission error: {self.error}")
                if j < self.planned[rank]:
                    q = self.queues[rank]
                    if j not in q:
                        raise StateError(
                            f"micro-batch {j} of rank {rank} was already committed and released (its consumer "
                            f"committed up to {self.committed[rank]}); resume from the last committed state"
                        )
                    first = q[j]
                    out = [first]
                    k = j + 1
                    while k in q and q[k]["minibatch"] == first["minibatch"]:
                        out.append(q[k])
                        k += 1
                    return {"entries": out}
                if self.closed:
                    return {"end": True}
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return {"wait": True}
                self.cond.wait(remaining)

    def commit(self, rank: int, upto: int) -> int:
        """Release the rank's entries below ``upto``; returns the new committed index."""
        self._check_rank(rank)
        with self.cond:
            upto = min(int(upto), self.planned[rank])
            for j in range(self.committed[rank], upto):
                e = self.queues[rank].pop(j, None)
                if e is not None:
                    self._release_entry(e)
            self.committed[rank] = max(self.committed[rank], upto)
            return self.committed[rank]

    def handed_out(self, rank: int, j: int) -> None:
        """``release="handout"``: release entry ``j`` now."""
        self._check_rank(rank)
        with self.cond:
            e = self.queues[rank].pop(j, None)
            if e is not None:
                self._release_entry(e)
            while self.committed[rank] < self.planned[rank] and self.committed[rank] not in self.queues[rank]:
                self.committed[rank] += 1

    def recover(self, unit_id: str, ids: list[str]) -> dict[str, bytes]:
        if self.recovery is None:
            return {}
        return self.recovery.records(unit_id, ids)

    def report(self, meter: Mapping[str, Any]) -> None:
        self.meter.merge(meter)

    def unit_handles(self) -> dict[str, Any]:
        return {u: [unit.actor, unit.handle_info()] for u, unit in self.units.items()}

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "units": {u: unit.ray_node for u, unit in self.units.items()},
                "layout": self.layout.to_dict(), "placement": self.placement_name, "release": self.release_mode,
                "num_consumers": self.layout.num_consumers, "nodes": self.config["nodes"],
                "spill_dir": self.config.get("spill_dir")}

    def stats(self) -> dict[str, Any]:
        with self.cond:
            out = {**self.counts, "closed": self.closed, "held_trajectories": len(self.live),
                   "planned": list(self.planned), "committed": list(self.committed), "version": self.version,
                   "ready_not_admitted": self.policy.ready_counts(), "transfer": self.meter.to_dict()}
        out["units"] = {u: unit.stats().to_dict() if self._alive(unit) else None for u, unit in self.units.items()}
        return out

    def kill_unit(self, unit_id: str) -> None:
        self.units[unit_id].kill()

    def shutdown(self) -> None:
        self.close()
        for u in self.units.values():
            try:
                u.kill()
            except Exception:  # noqa: BLE001 - already dead
                pass
        if self.recovery is not None:
            self.recovery.close()

    # internals (lock held) -------------------------------------------------------------------------
    @staticmethod
    def _alive(unit: RayStorageUnit) -> bool:
        try:
            ray.get(unit.actor.info.remote(), timeout=5)
            return True
        except Exception:  # noqa: BLE001 - dead or unreachable
            return False

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.layout.num_consumers:
            raise ConfigError(f"rank must be an int in 0..{self.layout.num_consumers - 1}, got {rank!r}")

    def _check_open(self) -> None:
        if self.closed:
            raise EngineError("the pipeline is closed (end of stream); build a new pipeline to continue")
        if self.error is not None:
            raise EngineError(f"the pipeline stopped after an admission error: {self.error}")

    def _fail(self, e: BaseException) -> None:
        self.error = str(e)
        self.cond.notify_all()

    def _release_metas(self, metas: Sequence[TrajectoryMeta]) -> None:
        by_unit: dict[str, list[TrajectoryMeta]] = {}
        for m in metas:
            if m.location is not None:
                by_unit.setdefault(m.location, []).append(m)
            self.live.pop(m.id, None)
            self.loss.pop(m.id, None)
        for u, ms in by_unit.items():
            self.units[u].release_async([m.id for m in ms])
            self.placement.released(u, sum(m.nbytes for m in ms))
            self.counts["released"] += len(ms)

    def _release_entry(self, e: Mapping[str, Any]) -> None:
        self._release_metas([self.live[tid] for tid, _u, _n in e["items"] if tid in self.live])

    def _poll(self) -> None:
        try:
            admitted: list[AdmittedMiniBatch] = self.policy.poll(time.monotonic())
        except KnitdataError as e:
            self._fail(e)
            raise
        for mb in admitted:
            plan = self.planner.plan(mb, self.loss)
            self.counts["admitted_minibatches"] += 1
            self.counts["admitted_trajectories"] += len(mb.trajectories)
            self.counts["planned_local_bytes"] += plan.local_bytes
            self.counts["planned_remote_bytes"] += plan.remote_bytes
            for m in mb.trajectories:
                self.placement.forget_group(m.group)
            for rank, row in enumerate(plan.microbatches):
                for pmb in row:
                    j = self.planned[rank]
                    self.queues[rank][j] = {
                        "j": j, "minibatch": pmb.minibatch, "info": pmb.to_info().to_dict(),
                        "items": [[m.id, m.location, m.nbytes] for m in pmb.trajectories],
                    }
                    self.planned[rank] = j + 1
        if admitted:
            self.cond.notify_all()


@ray.remote(num_cpus=0, max_concurrency=16, concurrency_groups={"wait": 256})
class CoordinatorActor:
    """Ray actor hosting the control plane (admission, placement, planning, plan queues, commits).

    Every method takes and returns JSON-like values (metadata only, never payloads). Create it through
    :class:`RayPipeline`. Consumers waiting for the next plan (:meth:`entries`, at most ``poll_s`` each)
    run in their own concurrency group of 256 threads, so they never hold up producers and commits.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self._c = _Coordinator(config)

    def reserve(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Assign a sequence number and a unit to a trajectory about to be put."""
        return self._c.reserve(meta)

    def unreserve(self, meta: dict[str, Any], unit: str) -> None:
        """Undo :meth:`reserve` after a failed put."""
        self._c.unreserve(meta, unit)

    def offer(self, meta: dict[str, Any], loss_tokens: int) -> None:
        """The payload is stored: offer its metadata to admission, plan what is admitted."""
        self._c.offer(meta, loss_tokens)

    def set_in_flight(self, counts: dict[str, int]) -> None:
        """See :meth:`knitdata.admission.AdmissionPolicy.set_in_flight`."""
        self._c.set_in_flight(counts)

    def withdraw(self, group: str) -> list[dict[str, Any]]:
        """Drop a group waiting for admission; returns its members' metadata."""
        return self._c.withdraw(group)

    def report_version(self, version: int) -> None:
        """The trainer's new policy version."""
        self._c.report_version(version)

    def close(self) -> None:
        """End of stream."""
        self._c.close()

    @ray.method(concurrency_group="wait")
    def entries(self, rank: int, j: int, timeout_s: float) -> dict[str, Any]:
        """Planned micro-batches of ``rank`` from ``j`` to the end of its mini-batch (waits up to ``timeout_s``)."""
        return self._c.entries(rank, j, timeout_s)

    def commit(self, rank: int, upto: int) -> int:
        """Release ``rank``'s micro-batches below ``upto``."""
        return self._c.commit(rank, upto)

    def handed_out(self, rank: int, j: int) -> None:
        """Release micro-batch ``j`` of ``rank`` (``release="handout"``)."""
        self._c.handed_out(rank, j)

    def recover(self, unit_id: str, ids: list[str]) -> dict[str, bytes]:
        """Records of a dead unit's payloads from its spill shards (those found)."""
        return self._c.recover(unit_id, ids)

    def report(self, meter: dict[str, Any]) -> None:
        """Add a consumer's or producer's transfer counters."""
        self._c.report(meter)

    def info(self) -> dict[str, Any]:
        """Units, layout, placement, release mode."""
        return self._c.info()

    def unit_handles(self) -> dict[str, Any]:
        """``{unit id: [actor handle, description]}`` (handles stay valid after a unit dies: calls then fail)."""
        return self._c.unit_handles()

    def stats(self) -> dict[str, Any]:
        """JSON-serializable counters."""
        return self._c.stats()

    def kill_unit(self, unit_id: str) -> None:
        """Kill a unit's actor (failure tests)."""
        self._c.kill_unit(unit_id)

    def shutdown(self) -> None:
        """Close and kill the units."""
        self._c.shutdown()


# ------------------------------------------------------------------------------------------ clients
def _loss_tokens(traj: Trajectory) -> int:
    if traj.loss_mask is None:
        return int(traj.response_ids.numel())
    return int((traj.loss_mask != 0).sum())


_CLIENTS: dict[tuple[int, str], RayClient] = {}
_CLIENTS_LOCK = threading.Lock()


class RayClient:
    """A process's handle on a running Ray pipeline (producers and consumers attach with it by name).

    Args:
        name: The pipeline's name (given to :class:`RayPipeline`).
        address: Ray cluster address; ``None``: this process's Ray, else a local loopback-only one.
        loopback_only: See :func:`~knitdata.storage.ray_unit.connect`.
        put_timeout: Default seconds a put waits for storage room.
        timeout_s: How long to wait for the coordinator to answer.

    Raises:
        EngineError: No pipeline of that name runs on the cluster.
    """

    def __init__(self, name: str = "knitdata", *, address: str | None = None, loopback_only: bool = True,
                 put_timeout: float | None = 60.0, timeout_s: float = 60.0, check_media: bool = True) -> None:
        connect(address, loopback_only=loopback_only)
        self.check_media = check_media
        self.name = name
        self.address = current_address()  # what datasets pickled into other processes attach to
        self.loopback_only = loopback_only
        self.put_timeout = put_timeout
        self.timeout_s = timeout_s
        try:
            self._coord = ray.get_actor(_coordinator_name(name), namespace=NAMESPACE)
        except ValueError as e:
            raise EngineError(f"no knitdata pipeline named {name!r} runs on this Ray cluster; create it with "
                              "RayPipeline(..., name=...) first") from e
        self._attach()

    def _attach(self) -> None:
        self._info = ray.get(self._coord.info.remote(), timeout=self.timeout_s)
        self.meter = TransferMeter()
        handles = ray.get(self._coord.unit_handles.remote(), timeout=self.timeout_s)
        self._units = {u: RayStorageUnit.from_handle(actor, desc, meter=self.meter, placement=self._info["placement"])
                       for u, (actor, desc) in handles.items()}
        self.node = current_node()

    @classmethod
    def shared(cls, name: str, *, address: str | None, loopback_only: bool = True) -> RayClient:
        """One client per (process, pipeline name), created on first use."""
        key = (os.getpid(), name)
        with _CLIENTS_LOCK:
            c = _CLIENTS.get(key)
            if c is None:
                c = _CLIENTS[key] = cls(name, address=address, loopback_only=loopback_only)
            return c

    @property
    def coordinator(self) -> Any:
        """The coordinator actor handle."""
        return self._coord

    @property
    def num_consumers(self) -> int:
        """Number of consumer ranks."""
        return int(self._info["num_consumers"])

    @property
    def layout(self) -> ConsumerLayout:
        """Consumers by node."""
        return ConsumerLayout.from_dict(self._info["layout"])

    @property
    def units(self) -> Mapping[str, RayStorageUnit]:
        """The storage units by id."""
        return dict(self._units)

    @property
    def placement(self) -> str:
        """The placement's name."""
        return str(self._info["placement"])

    def _call(self, method: Any, *args: Any) -> Any:
        try:
            return ray.get(method.remote(*args), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)  # the coordinator's own exception, as the user would see it locally
            if not isinstance(cause, KnitdataError):
                cause = e.as_instanceof_cause()
            if isinstance(cause, KnitdataError):
                raise cause from None
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise EngineError(f"the coordinator of pipeline {self.name!r} is gone: {e}") from e

    # producer side -------------------------------------------------------------------------------
    def put(self, traj: Trajectory, *, timeout: Any = "default") -> TrajectoryMeta:
        """Store a finished trajectory on the unit placement picks and offer it to admission.

        The payload goes from this process straight to the unit's actor (its node's object store).

        Returns:
            Its metadata (with ``seq`` and ``location``).

        Raises:
            StoreFull: No room within ``timeout`` (default :attr:`put_timeout`); nothing was accepted.
            ValidationError / FieldTypeError: A bad trajectory. EngineError: The pipeline is closed.
        """
        if not isinstance(traj, Trajectory):
            raise ValidationError(f"put() takes a knitdata.Trajectory, got {type(traj).__name__}", field="traj")
        traj.validate()
        if self.check_media and traj.media:  # decoded here, in the producer: a bad item never reaches a consumer
            from knitdata.media import check_media_item

            for i, item in enumerate(traj.media):
                check_media_item(item, trajectory_id=traj.id, index=i)
        timeout = self.put_timeout if timeout == "default" else timeout
        meta = traj.meta().to_dict()
        fields = {"scalars": sorted(traj.scalars), "tensors": sorted(traj.tensors)}
        r = self._call(self._coord.reserve, {**meta, "fields": fields})
        meta.update(seq=r["seq"], location=r["unit"])
        try:
            self._units[r["unit"]].put(traj, timeout=timeout)
        except BaseException:
            unit = self._units[r["unit"]]
            try:  # the actor may have stored it before the failure reached us (an interrupted ray.get)
                unit.release_async([traj.id])
            finally:
                self._coord.unreserve.remote(meta, r["unit"])
            raise
        self._call(self._coord.offer, meta, _loss_tokens(traj))
        return TrajectoryMeta.from_dict(meta)

    def set_in_flight(self, counts: Mapping[str, int]) -> None:
        """Tell admission how many trajectories per source are still coming for this train batch."""
        self._call(self._coord.set_in_flight, dict(counts))

    def withdraw(self, group: str) -> list[TrajectoryMeta]:
        """Drop a group waiting for admission (rollout aborted, filter rejected)."""
        return [TrajectoryMeta.from_dict(d) for d in self._call(self._coord.withdraw, group)]

    def report_version(self, version: int) -> None:
        """The trainer reports its new policy version."""
        self._call(self._coord.report_version, int(version))

    def close(self) -> None:
        """End of stream: consumers finish the admitted mini-batches and stop."""
        self._call(self._coord.close)

    def flush_meter(self) -> None:
        """Send this process's put/read counters to the coordinator (and zero them here)."""
        d = self.meter.to_dict()
        self.meter.reset()
        self._call(self._coord.report, d)

    def stats(self) -> dict[str, Any]:
        """The coordinator's counters (admission, plans, commits, units, summed transfer counters)."""
        return self._call(self._coord.stats)

    # consumer side -------------------------------------------------------------------------------
    def dataset(self, rank: int | None = None, **kwargs: Any) -> Any:
        """The :class:`~knitdata.storage.ray_dataset.RayTrajectoryDataset` of ``rank`` (default: from
        ``torch.distributed``); ``kwargs`` are its options (``fetch``, ``collate``, ``prefetch_depth``...)."""
        from knitdata.storage.ray_dataset import RayTrajectoryDataset

        return RayTrajectoryDataset(self.name, address=self.address, rank=rank, loopback_only=self.loopback_only,
                                    **kwargs)

    def commit(self, rank: int, upto: int) -> int:
        """Release ``rank``'s micro-batches below index ``upto``."""
        return int(self._call(self._coord.commit, int(rank), int(upto)))


class RayPipeline(RayClient):
    """Create a pipeline on a Ray cluster: the coordinator actor and one storage unit per layout node.

    Arguments mirror :class:`knitdata.pipeline.Pipeline`; the control plane runs in the coordinator
    actor, so producers (:class:`RayClient`) and consumers (:class:`~knitdata.storage.ray_dataset.RayTrajectoryDataset`) may live in any
    process attached to the cluster.

    Args:
        spec: The batch specification.
        admission: Policy name.
        admission_options: Keyword arguments of :func:`~knitdata.admission.make_policy`.
        layout: Consumers by node (node names are free; see ``nodes``); default ``num_consumers`` ranks on one node.
        num_consumers: Ranks when ``layout`` is not given.
        capacity_bytes: Capacity of each storage unit.
        token_budget: Most tokens per micro-batch.
        placement: ``"consumer_aware"`` or ``"index_mod"``.
        allow_split_groups: See :class:`~knitdata.planner.Planner`.
        balance_tolerance: See :class:`~knitdata.planner.Planner`.
        put_timeout: Default seconds a put waits for room.
        name: Unique name of the pipeline on the cluster (clients attach with it).
        address: Ray address; ``None`` starts a local loopback-only Ray (``127.0.0.1``, no dashboard).
        nodes: Layout node -> Ray node id (see :func:`resolve_nodes`).
        spill_dir: Write payloads through to spill shards there (recovery when a unit dies; payloads past
            ``capacity_bytes`` stay on disk and are reloaded on fetch).
        spill_bytes: Disk bound of each unit's spill store (default ``4 * capacity_bytes + 64 MiB``).
        release: ``"commit"`` or ``"handout"`` (module docstring).
        loopback_only: Refuse nodes that are not on 127.0.0.1.
        detached: Keep the actors alive after this process exits (shut down with :meth:`shutdown`).
    """

    def __init__(
        self,
        spec: BatchSpec,
        *,
        admission: str = "constraint_preserving",
        admission_options: Mapping[str, Any] | None = None,
        layout: ConsumerLayout | None = None,
        num_consumers: int | None = None,
        capacity_bytes: int = 1 << 30,
        token_budget: int = 8192,
        placement: str = "consumer_aware",
        allow_split_groups: bool = False,
        balance_tolerance: float = 0.1,
        put_timeout: float | None = 60.0,
        name: str = "knitdata",
        address: str | None = None,
        nodes: Mapping[str, str] | Sequence[str] | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
        spill_bytes: int | None = None,
        release: str = "commit",
        loopback_only: bool = True,
        detached: bool = False,
        timeout_s: float = 120.0,
        check_media: bool = True,
    ) -> None:
        if not isinstance(spec, BatchSpec):
            raise ConfigError(f"spec must be a knitdata.admission.BatchSpec, got {type(spec).__name__}")
        if release not in RELEASE_MODES:
            raise ConfigError(f"release must be one of {RELEASE_MODES}, got {release!r}")
        if layout is None:
            layout = ConsumerLayout.single_node(1 if num_consumers is None else num_consumers)
        elif num_consumers is not None and num_consumers != layout.num_consumers:
            raise ConfigError(f"num_consumers={num_consumers} disagrees with the layout's {layout.num_consumers} ranks")
        if not isinstance(placement, str):
            raise ConfigError("the Ray engine takes the placement by name ('consumer_aware' or 'index_mod')")
        make_placement(placement, list(layout.nodes))  # validates the name here, not in the actor
        make_policy(admission, spec, **dict(admission_options or {}))
        connect(address, loopback_only=loopback_only)
        config = {
            "name": name, "spec": spec.to_dict(), "layout": layout.to_dict(), "admission": admission,
            "admission_options": dict(admission_options or {}), "capacity_bytes": int(capacity_bytes),
            "token_budget": int(token_budget), "placement": placement, "allow_split_groups": bool(allow_split_groups),
            "balance_tolerance": float(balance_tolerance), "nodes": resolve_nodes(layout, nodes),
            "spill_dir": os.fspath(spill_dir) if spill_dir is not None else None, "release": release,
            "spill_bytes": spill_bytes,
        }
        try:
            ray.get_actor(_coordinator_name(name), namespace=NAMESPACE)
            raise EngineError(f"a knitdata pipeline named {name!r} already runs on this cluster; pick another name "
                              "or shut it down first")
        except ValueError:
            pass
        self._owner_coord = CoordinatorActor.options(
            name=_coordinator_name(name), namespace=NAMESPACE, lifetime="detached" if detached else None,
        ).remote(config)
        try:
            ray.get(self._owner_coord.info.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError as e:
            raise EngineError(f"the coordinator of pipeline {name!r} failed to start: {e}") from e
        super().__init__(name, address=address, loopback_only=loopback_only, put_timeout=put_timeout,
                         timeout_s=timeout_s, check_media=check_media)

    @classmethod
    def from_pipeline_args(
        cls,
        spec: BatchSpec,
        *,
        engine: str = "ray",
        engine_options: Mapping[str, Any] | None = None,
        on_plan: Any = None,
        **kwargs: Any,
    ) -> RayPipeline:
        """Build from :class:`knitdata.pipeline.Pipeline`'s arguments (``engine_options`` carry the Ray ones).

        Lets ``Pipeline(spec, ..., engine="ray", engine_options={"address": ..., "name": ...})`` hand over to
        this class (see the integration note in the module docstring).

        Raises:
            ConfigError: ``engine`` is not ``"ray"``, ``on_plan`` is given (plans are made in the coordinator
                actor), or the placement/admission is an object rather than a name.
        """
        if engine != "ray":
            raise ConfigError(f"RayPipeline serves engine='ray', not {engine!r}")
        if on_plan is not None:
            raise ConfigError("on_plan is not available on the Ray engine (plans are made in the coordinator actor); "
                              "read RayPipeline.stats() instead")
        if not isinstance(kwargs.get("admission", ""), str):
            raise ConfigError("the Ray engine takes the admission policy by name")
        return cls(spec, **kwargs, **dict(engine_options or {}))

    def kill_unit(self, unit_id: str) -> None:
        """Kill one storage unit's actor (failure drills and tests): its payloads are lost unless spilled."""
        self._call(self._coord.kill_unit, unit_id)

    def shutdown(self) -> None:
        """Close the pipeline and kill its actors."""
        try:
            self._call(self._coord.shutdown)
        finally:
            ray.kill(self._coord, no_restart=True)

    def __enter__(self) -> RayPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def __getattr__(name: str) -> Any:
    # the dataset lives in knitdata.storage.ray_dataset (it imports this module); re-exported lazily
    if name == "RayTrajectoryDataset":
        from knitdata.storage.ray_dataset import RayTrajectoryDataset

        return RayTrajectoryDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
