"""The Ray engine: the same control plane in one coordinator actor, one storage-unit actor per node.

Pieces (all on one Ray cluster):

* one **coordinator** actor (:class:`CoordinatorActor`) hosting :class:`knitdata.control.ControlPlane`, the
  very class the embedded engine calls directly; its methods take and return JSON-like values only;
* one **storage unit** actor per training node (:class:`~knitdata.engines.ray.unit_actor.StorageUnitActor`, hard node
  affinity), payloads as codec records in that node's object store (no pickle), read zero-copy on the node;
* any number of processes holding a :class:`RayEngine` handle (the pipeline's creator, producers, torchrun
  ranks, DataLoader workers), attached by the pipeline's name: payload bytes go straight between them and the
  units, never through the coordinator.

Binding: :func:`~knitdata.engines.ray.connect.connect` with ``address=None`` starts a local Ray bound to
``127.0.0.1`` with the dashboard off (or uses the Ray this process is already attached to); with an address
it attaches there and, with ``loopback_only=True`` (the default), refuses a cluster with a non-loopback node.
Before attaching to an address it applies this user's Ray token for a Ray of this user on this machine (Ray's
token authentication) or fails within seconds naming what to set (:func:`~knitdata.engines.ray.connect.prepare_auth`).

Host watch: every attached process watches the cluster's GCS port (:func:`~knitdata.engines.ray.connect.watch_host`);
when the Ray the creator started is gone, calls of the pipeline raise :class:`~knitdata.errors.EngineError`
("the host of knitdata pipeline ... is gone") within seconds instead of hanging until Ray ends the process; a
process still inside :meth:`RayEngine.attach` when the creator dies gets that error too, within
:data:`~knitdata.engines.ray.connect.HOST_GONE_S` seconds of the cluster refusing connections.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from knitdata.errors import ConfigError, EngineError, OptionalDependencyError

try:
    import ray
except ImportError as _e:  # pragma: no cover - exercised by monkeypatching in tests
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.engines.ray.engine)") from _e

from knitdata.codec import decode_trajectory
from knitdata.consumer.fetch import FetchMode
from knitdata.control.records import ItemRef
from knitdata.engines.base import Engine
from knitdata.engines.ray.connect import (
    NAMESPACE,
    alive_nodes,
    attaching,
    call_watched,
    check_host,
    connect,
    current_address,
    current_node,
    hosts_cluster,
    watch_host,
)
from knitdata.engines.ray.control import CoordinatorActor, RayControl
from knitdata.engines.ray.read import decode_records, read_records
from knitdata.engines.ray.unit import RayStorageUnit
from knitdata.observe import trace as tracing
from knitdata.observe.metrics import TransferMeter
from knitdata.placement import ConsumerLayout
from knitdata.record import MediaItem, Trajectory
from knitdata.storage.base import StorageUnit

__all__ = ["RayEngine", "coordinator_name", "ray_address", "resolve_nodes", "MEDIA_CACHE_STEPS"]

#: Steps (mini-batches) whose media a process keeps after reading them, so that each distinct media item of a
#: consumer's share is fetched once whatever the number of trajectories, turns and micro-batches using it: the
#: step being trained and the one ``iter`` prepares ahead, plus one for a rank of this process a step behind.
MEDIA_CACHE_STEPS = 3


def ray_address() -> str:
    """The address of the Ray cluster this process is attached to: pass it to :meth:`Pipeline.attach` elsewhere.

    Raises:
        EngineError: This process is not attached to Ray (create or attach a Ray-engine pipeline first).
    """
    if not ray.is_initialized():
        raise EngineError("this process is not attached to Ray: create a Pipeline(..., engine='ray') first")
    return current_address()


def coordinator_name(name: str) -> str:
    """The Ray actor name of pipeline ``name``'s coordinator."""
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
                              "add nodes or pass engine_options={'nodes': {layout node: Ray node id}}")
        return dict(zip(layout.nodes, alive))
    mapping = dict(nodes) if isinstance(nodes, Mapping) else dict(zip(layout.nodes, nodes))
    missing = [n for n in layout.nodes if n not in mapping]
    unknown = [v for v in mapping.values() if v not in alive]
    if missing or unknown:
        raise ConfigError(f"nodes: layout nodes without a Ray node {missing}, Ray node ids not alive {unknown}")
    return {n: mapping[n] for n in layout.nodes}


class RayEngine(Engine):
    """A handle on a pipeline hosted on a Ray cluster (create it with :meth:`create`, attach with :meth:`attach`).

    Pickling carries only ``(name, address, loopback_only, timeout_s)``: the copy attaches in the process that
    unpickles it (DataLoader worker processes, other ranks).
    """

    kind = "ray"
    control: RayControl
    supports_worker_processes = True
    shutdown_on_exit = True
    #: The ``engine_options`` :meth:`build` takes.
    OPTIONS = frozenset({"name", "address", "nodes", "loopback_only", "detached", "timeout_s", "journal_dir",
                         "journal_compact_every", "resume", "trace"})
    _owner: Any  # set by create(): the coordinator handle that keeps a non-detached coordinator alive
    meter: TransferMeter  # this process's put/read byte counters (set by __init__)

    def __init__(self, name: str, *, address: str | None = None, loopback_only: bool = True,
                 timeout_s: float = 60.0) -> None:
        connect(address, loopback_only=loopback_only)
        # from here on a dead cluster raises instead of hanging; while attaching, after HOST_GONE_S seconds
        with attaching(name):
            check_host()
            try:
                actor = call_watched(ray.get_actor, coordinator_name(name), namespace=NAMESPACE)
            except ValueError as e:
                raise EngineError(
                    f"no knitdata pipeline named {name!r} runs on the Ray cluster at {current_address()}; create it "
                    "with Pipeline(..., engine='ray', engine_options={'name': ...}) first, and pass the creator's "
                    "cluster address (knitdata.ray_address() in the creating process) to every other process") from e
            self.name = name
            self.address = current_address()
            self.loopback_only = loopback_only
            self.timeout_s = timeout_s
            self._actor = actor
            self.control = RayControl(actor, name, timeout_s)
            info = self.control.plumbing.info()
            super().__init__(ConsumerLayout.from_dict(info["config"]["layout"]), info["config"])
            self.info = info
            watch_host(name, creator_hosts=bool(info.get("creator_hosts")))
            if info.get("trace"):  # the pipeline is traced: this process too, on the coordinator's clock
                tracing.start(str(info["trace"]), "process").sync(self.control.plumbing.clock)
            handles = self.control.plumbing.unit_handles()
        self.meter = TransferMeter()
        self._here = current_node()  # this process's Ray node: what a read's bytes count as local or cross-node to
        placement = str(info["config"].get("placement", ""))
        self._units = {u: RayStorageUnit.from_handle(actor, desc, meter=self.meter, placement=placement)
                       for u, (actor, desc) in handles.items()}
        for uid, unit in self._units.items():  # a reference to media another unit holds: copied in from there
            unit.resolve = self._resolver(uid)
        self._media_lock = threading.Lock()
        self._media_steps: dict[int, dict[str, MediaItem]] = {}  # step -> the media read for it in this process

    @classmethod
    def attach(cls, name: str, *, address: str | None = None, loopback_only: bool = True,
               timeout_s: float = 60.0) -> RayEngine:
        """A handle on the running pipeline ``name`` on the Ray cluster at ``address``."""
        return cls(name, address=address, loopback_only=loopback_only, timeout_s=timeout_s)

    @classmethod
    def build(cls, layout: ConsumerLayout, config: Mapping[str, Any], capacity_bytes: int, *,
              spill_dir: str | os.PathLike[str] | None, spill_bytes: int, policy: Any, on_plan: Any,
              options: Mapping[str, Any]) -> RayEngine:
        """A new pipeline's Ray engine (:meth:`create` with ``options``), the options checked before any Ray call."""
        if policy is not None:
            raise ConfigError("the Ray engine takes the admission policy by name (it runs in the coordinator actor)")
        if on_plan is not None:
            raise ConfigError("on_plan runs in the pipeline's process: use the embedded engine, or read "
                              "Pipeline.stats() on the Ray engine")
        if set(options) - cls.OPTIONS:
            raise ConfigError(f"unknown Ray engine options {sorted(set(options) - cls.OPTIONS)}; known: "
                              f"{sorted(cls.OPTIONS)}")
        return cls.create(layout, config, capacity_bytes, spill_dir=spill_dir, spill_bytes=spill_bytes, **options)

    @classmethod
    def create(
        cls,
        layout: ConsumerLayout,
        config: Mapping[str, Any],
        capacity_bytes: int,
        *,
        name: str = "knitdata",
        address: str | None = None,
        nodes: Mapping[str, str] | Sequence[str] | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
        spill_bytes: int | None = None,
        loopback_only: bool = True,
        detached: bool = False,
        timeout_s: float = 120.0,
        journal_dir: str | os.PathLike[str] | None = None,
        journal_compact_every: int = 10_000,
        resume: bool = False,
        trace: str | os.PathLike[str] | None = None,
    ) -> RayEngine:
        """Start the coordinator and the units of a new pipeline ``name``, and attach to it.

        With a journal (``journal_dir``, default ``spill_dir``) the coordinator journals its decisions and Ray
        restarts it after a crash: it replays the journal, and callers' pending calls are retried. Every
        ``journal_compact_every`` records the coordinator writes a snapshot of its state and starts a new journal
        segment (``0``: never), so a restart replays at most that many records. ``resume``: a
        whole-job restart (every process of the run gone): the coordinator replays the dead run's journal and the
        new units serve its unreleased payloads from the spill shards (the same ``spill_dir``). ``trace``: the
        coordinator, the units and every process that attaches record a trace there (:mod:`knitdata.observe.trace`).

        Raises:
            EngineError: A pipeline of that name already runs, or the actors did not start.
        """
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"engine_options['name'] must be a non-empty string without '/', got {name!r}")
        connect(address, loopback_only=loopback_only)
        jdir = journal_dir if journal_dir is not None else spill_dir
        journal = os.path.join(os.fspath(jdir), f"{name}.journal") if jdir is not None else None
        if resume:
            if journal is None or not os.path.exists(journal) or spill_dir is None:
                raise ConfigError(f"resume=True restarts pipeline {name!r} from its journal and spill shards: give the "
                                  f"same spill_dir (and journal_dir) as the run that died; no journal at {journal!r}")
        elif journal is not None and os.path.exists(journal):
            raise EngineError(f"a journal of a pipeline named {name!r} already exists at {journal!r}: pick another "
                              "name, remove the journal of the finished run, or pass resume=True to restart it")
        setup: dict[str, Any] = {"name": name, "config": dict(config), "capacity_bytes": int(capacity_bytes),
                 "nodes": resolve_nodes(layout, nodes), "spill_bytes": spill_bytes,
                 "spill_dir": os.fspath(spill_dir) if spill_dir is not None else None, "journal": journal,
                 "journal_compact_every": int(journal_compact_every), "creator_hosts": hosts_cluster(),
                 "trace": os.fspath(trace) if trace is not None else None}
        try:
            ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
            raise EngineError(f"a knitdata pipeline named {name!r} already runs on this cluster; pick another name "
                              "or shut it down first (Pipeline.attach(name).shutdown())")
        except ValueError:
            pass
        units = RayStorageUnit.create_many([(n, setup["nodes"][n]) for n in layout.nodes], int(capacity_bytes),
                                           prefix=name, spill_dir=setup["spill_dir"], spill_bytes=spill_bytes,
                                           detached=detached, resume=resume,
                                           media_dedup=bool(config.get("media_dedup", True)))
        handles = {u: [unit.actor, unit.handle_info()] for u, unit in units.items()}
        restarts = -1 if journal is not None else 0  # without a journal a restarted coordinator would be empty
        # an ActorClass (ray's stubs keep the class)
        # pinned to the creator's node: the pipeline survives the loss of another node (its units' payloads aside).
        # Hard: Ray 2.x placed a zero-CPU actor with soft affinity on any node (and so on a node later lost).
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(current_node(), soft=False)
        actor = CoordinatorActor.options(name=coordinator_name(name), namespace=NAMESPACE,  # type: ignore[attr-defined]
                                         lifetime="detached" if detached else None, max_restarts=restarts,
                                         max_task_retries=restarts, scheduling_strategy=here).remote(setup, handles)
        try:
            ray.get(actor.call.remote("info"), timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            ray.kill(actor, no_restart=True)
            for unit in units.values():
                unit.kill()
            raise EngineError(f"the coordinator of pipeline {name!r} failed to start: {e}") from e
        engine = cls(name, loopback_only=loopback_only, timeout_s=timeout_s)
        engine._owner = actor  # keeps a non-detached coordinator alive as long as this handle
        return engine

    @property
    def units(self) -> Mapping[str, StorageUnit]:
        """The storage units by id (actor handles)."""
        return self._units

    def read(self, items: Sequence[ItemRef], *, fetch: FetchMode, step: int) -> list[Trajectory]:
        """Records from the units (zero-copy on the same node), spill recovery for a dead unit, decoded.

        Each group of ``fetch.groups(items)`` is one request per unit; bytes are counted under ``fetch.name``.
        Media stored once: each distinct media item of step ``step`` is fetched once by this process, whatever
        the number of trajectories, turns, micro-batches and reads using it (the media read for a step are kept
        for the :data:`MEDIA_CACHE_STEPS` newest steps, then let go), and equal digests decode to the same
        :class:`~knitdata.record.MediaItem` (zero-copy views of the object store on the unit's node).
        """
        recover = self._recover if self.info.get("spill_dir") else None
        placement = str(self.config.get("placement", ""))
        units = self._units
        media: dict[str, MediaItem] | None = None  # the media this process read for this step, by digest
        if self.config.get("media_dedup", True):
            if step < 0:
                media = {}
            else:
                with self._media_lock:  # steps older than the MEDIA_CACHE_STEPS newest are let go
                    steps = self._media_steps
                    media = steps.get(step)
                    if media is None:
                        media = steps[step] = {}
                        for old in sorted(steps)[:-MEDIA_CACHE_STEPS]:
                            del steps[old]
        recs: list[Any] = []
        for group in fetch.groups(items):
            recs += read_records([(tid, units[u]) for tid, u, _n in group], meter=self.meter, mode=fetch.name,
                                 placement=placement, step=step, recover=recover, media=media,
                                 here=self._here)
        if media is None:
            return [decode_trajectory(r, copy=False) for r in recs]
        return decode_records(recs, media)

    def _resolver(self, unit_id: str) -> Any:
        def resolve(digest: str) -> Any:
            for uid, unit in self._units.items():
                if uid != unit_id:
                    found = unit.media_record(digest)
                    if found is not None:
                        return found
            return None

        return resolve

    def _recover(self, unit: RayStorageUnit, ids: list[str]) -> Mapping[str, Any]:
        return self.control.plumbing.recover(unit.unit_id, ids)

    def flush_meter(self) -> None:
        """Send this process's put/read byte counters to the coordinator (and zero them here); waits for it."""
        d = self.meter.to_dict()
        if not (d["read"] or d["put"]):
            return
        self.meter.reset()
        try:  # waited for (the control surface sends it fire-and-forget): a stats() right after counts it
            ray.get(self._actor.call.remote("report_transfer", d), timeout=self.timeout_s)
        except ray.exceptions.RayActorError:
            self.control.reporting.report_transfer(d)  # restarting: sent as usual (a timed-out call still lands)
        except ray.exceptions.GetTimeoutError:
            pass

    def recoverable(self, unit_ids: Sequence[str], ids: Sequence[str]) -> list[str]:
        """The ids of ``ids`` that the spill shards of the dead units ``unit_ids`` still hold (none without spill)."""
        if not self.info.get("spill_dir"):
            return []
        return self.control.plumbing.recoverable(list(unit_ids), list(ids))

    def kill_unit(self, unit_id: str) -> None:
        """Kill one storage unit's actor (failure drills and tests): its payloads are lost unless spilled."""
        self.control.plumbing.kill_unit(unit_id)

    def flush_trace(self) -> None:
        """Write the trace events recorded so far by this process, the coordinator and the units; then copy the
        part files written on other hosts (each node's unit sends what this host lacks) next to the trace."""
        super().flush_trace()
        self.control.plumbing.flush_trace()
        path = self.info.get("trace")
        if not path:
            return
        known = tracing.part_sizes(path)
        for unit_id, unit in self._units.items():
            try:
                found = ray.get(unit.actor.trace_parts.remote(str(path), known), timeout=self.timeout_s)
            except Exception as e:  # noqa: BLE001 - a dead unit: its node's parts stay there
                warnings.warn(f"trace parts on the node of storage unit {unit_id!r} were not copied ({type(e).__name__}: "
                              f"{e}); copy {path}.* from that host next to {path} and run `knitdata trace {path}`",
                              stacklevel=2)
                continue
            if found:  # written here now, at these sizes: the next unit is not asked for them again
                tracing.write_parts(str(path), found)
                known.update((name, len(data)) for name, data in found.items())

    def shutdown(self) -> None:
        """Close the pipeline and kill its actors."""
        try:
            self.control.plumbing.shutdown()
        finally:
            ray.kill(self._actor, no_restart=True)

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "address": self.address, "loopback_only": self.loopback_only,
                "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["name"], address=state["address"], loopback_only=state["loopback_only"],  # type: ignore[misc]
                      timeout_s=state["timeout_s"])
