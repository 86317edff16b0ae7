"""The user-facing pipeline: producers put, admission decides, the planner assigns, consumers iterate.

:class:`Pipeline` is one facade over one control plane (:class:`knitdata.control.ControlPlane`) and one of two
engines that differ only in where payload bytes live:

* ``engine="embedded"`` (the default): one process; producers and consumers are threads; no servers.
* ``engine="ray"``: the control plane in a coordinator actor and one storage-unit actor per node of the
  layout, so producers, torchrun/Accelerate ranks and DataLoader workers in other processes (or nodes)
  share the pipeline: they attach with :meth:`Pipeline.attach` by its name.

Every engine has the same put path (validation and media decoding in the producer; the payload stored on the
unit this process's replica of the placement picks; then one admission call, which on Ray the storage unit
makes itself, so a put is one round trip), the same :class:`~knitdata.dataset.TrajectoryDataset`, state format, defaults and errors.

Memory: each storage unit holds at most ``max(capacity_bytes, largest trajectory)`` bytes; producers wait up
to ``put_timeout`` for room, then get :class:`~knitdata.errors.StoreFull` naming the ranks whose uncommitted
micro-batches hold the store (or, with ``spill_dir``, overflow goes to tar shards on disk).

Example:
    >>> from knitdata.admission import BatchSpec
    >>> pipe = Pipeline(BatchSpec({"math": 8, "code": 8}, num_minibatches=2), num_consumers=2)
    >>> ds = pipe.dataset(0, fetch="iter")  # iterate it in rank 0 (a thread or a torchrun process)
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from knitdata import trace as tracing
from knitdata.admission import AdmissionPolicy, AdmittedMiniBatch, BatchSpec, make_policy
from knitdata.consumer import DEFAULT_TIMEOUT_S
from knitdata.control import PLANE_DEFAULTS, RELEASE_MODES, acquire_rollout, fields_of
from knitdata.control.plane import Control
from knitdata.engines.base import ENGINES, Engine, engine_class, engine_names
from knitdata.errors import (
    ConfigError,
    EngineError,
    FieldTypeError,
    KnitdataError,
    PipelineClosedError,
    StoreFull,
    ValidationError,
)
from knitdata.handoff import ProducerPresence
from knitdata.metrics import ConsumerMetrics
from knitdata.placement import ConsumerLayout, Placement, make_placement
from knitdata.planner import MiniBatchPlan
from knitdata.producer import PutRouter
from knitdata.record import Trajectory, TrajectoryMeta
from knitdata.storage.base import StorageUnit

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from knitdata.checkpoint import CheckpointInfo, RestoreReport, RolloutLedger
    from knitdata.dataset import TrajectoryDataset
    from knitdata.fetch import FetchMode

__all__ = ["Pipeline", "PipelineClosedError", "ENGINES", "RELEASE_MODES", "DEFAULT_TIMEOUT_S", "PUT_TIMEOUT"]

#: ``timeout`` of :meth:`Pipeline.put` / :meth:`Pipeline.put_many` meaning "the pipeline's ``put_timeout``".
PUT_TIMEOUT: Literal["put_timeout"] = "put_timeout"


def _loss_tokens(traj: Trajectory) -> int:
    if traj.loss_mask is None:
        return int(traj.response_ids.numel())
    return int((traj.loss_mask != 0).sum())


def _dist_rank() -> int | None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


class Pipeline:
    """Producers put trajectories; consumers iterate their micro-batches. Thread-safe; any engine.

    Args:
        spec: The batch specification (quotas per source, mini-batches per train batch, group size).
        admission: A policy name (``"constraint_preserving"``, ``"linear_target"``, ``"fifo"``,
            ``"train_batch"``), or an :class:`~knitdata.admission.AdmissionPolicy` built on ``spec``
            (embedded engine only: an object cannot move to the coordinator actor).
        admission_options: Keyword arguments for :func:`~knitdata.admission.make_policy` (e.g. ``continuous=True``).
        layout: Consumers by node; default: ``num_consumers`` ranks on one node.
        num_consumers: Number of ranks when ``layout`` is not given.
        engine: ``"embedded"`` or ``"ray"``.
        capacity_bytes: Capacity of each storage unit (one per node).
        token_budget: Most tokens (prompt + response) per micro-batch; a longer trajectory is refused at put.
        placement: ``"consumer_aware"`` or ``"index_mod"`` (baseline).
        allow_split_groups: Let one group's members go to different consumers.
        balance_tolerance: See :class:`~knitdata.planner.Planner`.
        put_timeout: Default seconds a put waits for room (``None``: no limit; ``0``: fail at once).
        spill_dir: Spill payloads that do not fit in ``capacity_bytes`` to tar shards under this directory (Ray:
            also written through, so payloads of a dead unit are recovered).
        spill_bytes: Disk budget per unit when spilling.
        release: When a payload leaves storage. A consumer *commits* a position with
            :meth:`~knitdata.dataset.TrajectoryDataset.commit` (after saving its state); payloads before a
            committed position are released. ``"step"``: also commit automatically when the rank starts its next
            mini-batch (one iterator per rank; with DataLoader worker processes only explicit commits count), so a
            consumer that crashes mid-step and restores its last step-boundary state receives that step again.
            ``"commit"``: explicit commits only. ``"handout"``: release as soon as a micro-batch is handed out (the
            least memory; a restore then needs a new pipeline fed the same puts).
        producer_timeout_s: Seconds consumers keep waiting for data once every producer stopped without
            :meth:`close`: its threads that put ended, or its process died (no report for
            :data:`~knitdata.control.plane.PRODUCER_TTL_S`). Then they raise
            :class:`~knitdata.errors.IncompleteStreamError` naming the producers and what admission waits for.
            ``None``: wait (up to the dataset's ``timeout``). A handle counts as a producer from its first put.
        check_media: Decode every encoded media item once at :meth:`put` (in the producer) and refuse bad ones.
        on_plan: Called as ``on_plan(admitted, plan)`` for each planned mini-batch (embedded engine; keep it cheap).
        max_staleness: Admit nothing staler than this many versions, as the trainer reports them
            (:meth:`report_version`); an int or ``{source: int}`` (every source); ``None``: no bound
            (docs/concepts.md, "A hard staleness bound").
        on_stale: ``"drop"`` (:meth:`dropped` lists what to regenerate) or ``"wait"`` (also :meth:`acquire_rollout`;
            needs ``max_staleness``).
        version_offset: The trainer's version at its first step, for the bound; ``None`` (default): learned from
            the first :meth:`report_version` (see docs/concepts.md).
        engine_options: Ray: ``name`` (default ``"knitdata"``; other processes attach with it), ``address``
            (``None``: this process's Ray, else a new local loopback-only one), ``nodes`` (layout node -> Ray node
            id), ``loopback_only`` (default ``True``), ``detached`` (keep the actors after this process exits),
            ``timeout_s``, ``journal_dir`` (default ``spill_dir``: journal the coordinator's decisions there, so
            that Ray restarts it after a crash and it recovers them), ``journal_compact_every`` (10,000: records
            between snapshots of the coordinator's state; ``0``: never), ``resume`` (``True``: restart a run whose
            every process died from its journal and spill shards; consumers load their saved states, producers
            put again what was not acknowledged). The embedded engine takes none.
        trace: Record a trace of the run into this path (default: the environment variable ``KNITDATA_TRACE``;
            ``None``: none): every process of the pipeline writes a part file ``<trace>.<role>.<host>-<pid>.json``
            (on Ray the coordinator, the units and each process that attaches, too), merged into ``trace`` by
            :meth:`shutdown` or ``knitdata trace PATH`` (Chrome trace-event JSON; :mod:`knitdata.trace`).

    Raises:
        ConfigError: Inconsistent options.
        OptionalDependencyError: ``engine="ray"`` without ``ray`` installed.
    """

    def __init__(
        self,
        spec: BatchSpec,
        *,
        admission: str | AdmissionPolicy = "constraint_preserving",
        admission_options: Mapping[str, Any] | None = None,
        layout: ConsumerLayout | None = None,
        num_consumers: int | None = None,
        engine: str = "embedded",
        capacity_bytes: int = 1 << 30,
        token_budget: int = 8192,
        placement: str | Placement = "consumer_aware",
        allow_split_groups: bool = False,
        balance_tolerance: float = 0.1,
        put_timeout: float | None = 60.0,
        spill_dir: str | os.PathLike[str] | None = None,
        spill_bytes: int = 16 << 30,
        release: str = "step",
        producer_timeout_s: float | None = 15.0,
        check_media: bool = True,
        on_plan: Callable[[AdmittedMiniBatch, MiniBatchPlan], None] | None = None,
        engine_options: Mapping[str, Any] | None = None,
        max_staleness: int | Mapping[str, int] | None = None,
        on_stale: str = "drop",
        trace: str | os.PathLike[str] | None = None,
        version_offset: int | None = None,
    ) -> None:
        if not isinstance(spec, BatchSpec):
            raise ConfigError(f"spec must be a knitdata.admission.BatchSpec, got {type(spec).__name__}")
        if engine not in engine_names():
            raise ConfigError(f"unknown engine {engine!r}; choose one of {engine_names()}")
        cls_ = engine_class(engine)
        if release not in RELEASE_MODES:
            raise ConfigError(f"release must be one of {RELEASE_MODES}, got {release!r}")
        if layout is not None and not isinstance(layout, ConsumerLayout):
            raise ConfigError(
                f"layout must be a knitdata.placement.ConsumerLayout (e.g. ConsumerLayout(['node0', 'node0'])), "
                f"got {type(layout).__name__}")
        if producer_timeout_s is not None and (isinstance(producer_timeout_s, bool)
                                               or not isinstance(producer_timeout_s, (int, float))
                                               or producer_timeout_s < 0):
            raise ConfigError(f"producer_timeout_s must be a non-negative number of seconds or None, got "
                              f"{producer_timeout_s!r}")
        if isinstance(balance_tolerance, bool) or not isinstance(balance_tolerance, (int, float)) or balance_tolerance < 0:
            raise ConfigError(f"balance_tolerance must be a non-negative number, got {balance_tolerance!r}")
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget <= 0:
            raise ConfigError(f"token_budget must be a positive int, got {token_budget!r}")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if layout is None:
            layout = ConsumerLayout.single_node(1 if num_consumers is None else num_consumers)
        elif num_consumers is not None and num_consumers != layout.num_consumers:
            raise ConfigError(f"num_consumers={num_consumers} disagrees with the layout's {layout.num_consumers} ranks")
        policy: AdmissionPolicy | None = None
        if max_staleness is not None or on_stale != "drop" or version_offset is not None:
            if isinstance(admission, AdmissionPolicy):
                raise ConfigError("max_staleness / on_stale / version_offset apply to an admission given by name (or "
                                  "build the policy with them)")
            opts_ = dict(admission_options or {})
            admission_options = {**opts_, "max_staleness": dict(max_staleness) if isinstance(max_staleness, Mapping)
                                 else max_staleness, "on_stale": on_stale,
                                 "version_offset": opts_.get("version_offset", version_offset)}
        if isinstance(admission, AdmissionPolicy):
            if admission_options:
                raise ConfigError("admission_options only apply when admission is given by name")
            if admission.spec != spec:
                raise ConfigError("the admission policy was built on a different BatchSpec")
            policy = admission
            admission_name = admission.name or type(admission).__name__
        else:
            make_policy(admission, spec, **dict(admission_options or {}))  # validates here, not in an actor
            admission_name = admission
        if isinstance(placement, Placement):
            placement_name = "consumer_aware" if placement.consumer_aware else "index_mod"
            if not cls_.in_process or type(placement) is not type(make_placement(placement_name, placement.units)):
                raise ConfigError("give the placement by name ('consumer_aware' or 'index_mod')")
        else:
            make_placement(placement, list(layout.nodes))
            placement_name = placement
        config = {**PLANE_DEFAULTS, "spec": spec.to_dict(), "layout": layout.to_dict(), "admission": admission_name,
                  "admission_options": dict(admission_options or {}), "token_budget": token_budget,
                  "placement": placement_name, "allow_split_groups": bool(allow_split_groups),
                  "balance_tolerance": float(balance_tolerance), "release": release,
                  "producer_timeout_s": None if producer_timeout_s is None else float(producer_timeout_s)}
        opts = dict(engine_options or {})
        opts.pop("cross_process", None)  # every Ray pipeline serves other processes now
        trace_path = os.fspath(trace) if trace is not None else os.environ.get(tracing.ENV) or None
        if trace_path is not None:
            # this process merges the trace when its tracing ends too (its exit), with what every process wrote
            tracing.start(trace_path, "main" if cls_.in_process else "driver").merge_on_close = True
            if not cls_.in_process:
                opts["trace"] = trace_path  # the coordinator and the units trace too; attaching processes follow
        eng = cls_.build(layout, config, capacity_bytes, spill_dir=spill_dir, spill_bytes=spill_bytes, policy=policy,
                         on_plan=on_plan, options=opts)
        self._setup(eng, put_timeout=put_timeout, check_media=check_media, owner=True)
        self.capacity_bytes = capacity_bytes

    def _setup(self, engine: Engine, *, put_timeout: float | None, check_media: bool, owner: bool) -> None:
        self._engine = engine
        self.spec = BatchSpec.from_dict(engine.config["spec"])
        self.layout = engine.layout
        self.put_timeout = put_timeout
        self.check_media = check_media
        self._owner = owner
        self._closed_here = False
        self._version_listeners: list[Callable[[int, float], None]] = []
        self._listeners_lock = threading.Lock()
        self._router = PutRouter(engine)  # this process's replica of the placement (one-round-trip puts)
        self._presence: ProducerPresence | None = None  # made at the first put: this handle is a producer
        self.restore_report: RestoreReport | None = None  # what restore() restored
        #: The trace this pipeline's processes record (``Pipeline(trace=...)``), or ``None``.
        self.trace_path: str | None = tracing.tracer.path if tracing.tracer is not None else None

    @classmethod
    def attach(
        cls,
        name: str = "knitdata",
        *,
        address: str | None = None,
        loopback_only: bool = True,
        put_timeout: float | None = 60.0,
        check_media: bool = True,
        timeout_s: float = 60.0,
    ) -> Pipeline:
        """Attach to a Ray-engine pipeline created in another process (producers, ranks, evaluation jobs).

        Args:
            name: The pipeline's name (``engine_options["name"]`` of its creator).
            address: The Ray cluster's address (:func:`knitdata.ray_address` in the creating process, or
                ``"auto"``); ``None``: the Ray this process is attached to, else a new local one.
            loopback_only: Refuse a cluster with a node that is not on 127.0.0.1.
            put_timeout: Default seconds a put waits for room.
            check_media: Decode media at put in this process.
            timeout_s: Bound on each call to the coordinator.

        Raises:
            EngineError: No pipeline of that name on the cluster. OptionalDependencyError: No ``ray``.
        """
        engine = engine_class("ray", what="Pipeline.attach")
        self = cls.__new__(cls)
        eng: Any = engine.attach(name, address=address, loopback_only=loopback_only, timeout_s=timeout_s)
        self._setup(eng, put_timeout=put_timeout, check_media=check_media, owner=False)
        self.capacity_bytes = int(eng.info["capacity_bytes"])
        return self

    # ------------------------------------------------------------------ properties
    @property
    def engine(self) -> str:
        """The kind of the pipeline's engine class: ``"embedded"``, ``"ray"`` (or a registered engine's)."""
        return self._engine.kind

    @property
    def name(self) -> str | None:
        """The pipeline's name on its Ray cluster (``None`` on the embedded engine)."""
        return self._engine.name

    @property
    def address(self) -> str | None:
        """The Ray cluster's address other processes attach to (``None`` on the embedded engine)."""
        return self._engine.address

    @property
    def num_consumers(self) -> int:
        """Number of consumers (ranks)."""
        return self.layout.num_consumers

    @property
    def release(self) -> str:
        """The release mode."""
        return self._engine.release

    @property
    def units(self) -> Mapping[str, StorageUnit]:
        """The storage units by id."""
        return dict(self._engine.units)

    @property
    def control(self) -> Control:
        """The control plane's parts (:class:`~knitdata.control.plane.Control`: the plane's own on the embedded
        engine, proxies of the same types on the Ray engine)."""
        return self._engine.control

    @property
    def policy(self) -> AdmissionPolicy:
        """The admission policy (embedded engine; do not call it directly while the pipeline runs).

        Raises:
            EngineError: On the Ray engine (it lives in the coordinator actor).
        """
        if not self._engine.in_process:
            raise EngineError("the admission policy runs in the coordinator actor on the Ray engine; read stats()")
        return self._engine.local_plane().state.policy

    @property
    def planner(self) -> Any:
        """The planner (embedded engine).

        Raises:
            EngineError: On the Ray engine (it lives in the coordinator actor).
        """
        if not self._engine.in_process:
            raise EngineError("the planner runs in the coordinator actor on the Ray engine; read stats()")
        return self._engine.local_plane().state.planner

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (by any process)."""
        if self._closed_here:
            return True
        return bool(self.stats_light()["closed"])

    @property
    def version(self) -> int:
        """The policy version last reported by the trainer."""
        return int(self.stats_light()["version"])

    def stats_light(self) -> dict[str, Any]:
        """The control plane's counters only (no unit or consumer round trips).

        What this process's consumers queued for the control plane (hand-outs, commits, versions) is sent first.
        """
        self._engine.flush_reports()
        return dict(self._engine.control.reporting.stats())

    # ------------------------------------------------------------------ producer side
    def put(self, traj: Trajectory, *, timeout: float | None | Literal["put_timeout"] = PUT_TIMEOUT) -> TrajectoryMeta:
        """Store a finished trajectory and offer it to admission (one round trip in the common case).

        Validation and media decoding run here, in the producer's process; the payload goes straight to the
        storage unit placement picks (never through the control plane), and that unit asks the control plane
        to admit it. Only a full unit costs more: the put then waits for room, up to ``timeout``.

        Args:
            traj: The trajectory (validated again here; do not mutate it afterwards).
            timeout: Seconds to wait for storage room (``None``: no limit, ``0``: fail at once); by default the
                pipeline's ``put_timeout``.

        Returns:
            Its metadata (with ``location`` and ``seq``).

        Raises:
            FieldTypeError / ValidationError / MediaError: A bad trajectory (the message names it and the
                field or media item), or one longer than ``token_budget`` (field ``num_tokens``); nothing else
                is affected.
            StoreFull: No room within ``timeout``; the message names the ranks holding the store.
            PipelineClosedError: After :meth:`close`.
            QuotaInfeasibleError: Admission found the quotas impossible (also raised to consumers).
        """
        return self._put_batch([traj], timeout)[0]

    def put_many(self, trajs: Sequence[Trajectory], *,
                 timeout: float | None | Literal["put_timeout"] = PUT_TIMEOUT) -> list[TrajectoryMeta]:
        """Store a batch of finished trajectories and offer them to admission: one round trip per storage unit.

        Every trajectory is validated (and its media decoded) here. This process's replica of the placement picks
        each payload's unit (members of a group stay together); the payloads go to their unit, which admits them
        with one control call (on Ray the unit's actor makes it, so the producer waits for one round trip). A bad
        trajectory (an unknown source, a duplicate id, a withdrawn group, other fields) refuses the whole part
        of the batch bound for its unit: in the common case, one unit, nothing of the batch is kept.

        Args:
            trajs: The trajectories, in arrival order.
            timeout: Seconds each payload may wait for storage room; default :attr:`put_timeout`.

        Returns:
            The metadata of each trajectory, in order.

        Raises:
            FieldTypeError: As :meth:`put`; nothing of the batch is stored.
            ValidationError: As :meth:`put` (a bad field, an unknown source, a duplicate id, a withdrawn group):
                nothing of the batch bound for that trajectory's unit is kept (parts of the batch bound for other
                units, put before, stay accepted). The message names the trajectory and field.
            StoreFull: No room within ``timeout``: the payloads not yet stored (this one and every later one)
                are refused; the earlier ones stay accepted.
            PipelineClosedError: After :meth:`close`.
        """
        trajs = list(trajs)
        if not trajs:
            return []
        return self._put_batch(trajs, timeout)

    def _put_batch(self, trajs: Sequence[Trajectory], timeout: float | None | Literal["put_timeout"]) -> list[TrajectoryMeta]:
        """The put path of :meth:`put` and :meth:`put_many`: checks, placement replica, one round trip per unit."""
        plane = self._engine.control
        presence = self._presence
        if presence is None:
            presence = self._presence = ProducerPresence()
            self._engine.sender.add_producer(presence)
        presence.note()
        if self._engine.sender.version_pending:  # a put of the new weights' output must not overtake their report
            self._engine.flush_reports()
        checked = [self._checked(t) for t in trajs]
        timeout = self.put_timeout if timeout == PUT_TIMEOUT else timeout
        token = uuid.uuid4().hex
        items = [[m, n, f"{token}:{i}"] for i, (m, n) in enumerate(checked)]
        by_unit: dict[str, list[int]] = {}
        for i, unit_id in enumerate(self._router.route([m for m, _n in checked])):
            by_unit.setdefault(unit_id, []).append(i)
        out: list[TrajectoryMeta | None] = [None] * len(trajs)
        t0 = tracing.now_us() if tracing.tracer is not None else 0.0
        for unit_id, idx in by_unit.items():
            unit = self._engine.units[unit_id]
            rest = idx
            while rest:
                try:
                    res = unit.put_admit([trajs[i] for i in rest], [items[i] for i in rest], plane.admission.admit_many)
                except EngineError as e:
                    self._raise_closed(e)
                    raise
                n = res["stored"]
                if res["admit"] is not None:
                    self._router.take(res["admit"], rest[:n], out)
                rest = rest[n:]
                if rest:  # the unit is full: wait for room with a blocking put of the next one
                    self._put_waiting(unit_id, trajs, items, rest, timeout, out)
                    rest = rest[1:]
        tr = tracing.tracer
        if tr is not None:  # one event per burst of puts of this thread
            if len(checked) == 1:
                tr.burst("put", "producer", t0, tracing.now_us(), checked[0][0]["source"])
            else:
                by_source: dict[str, int] = {}
                for m, _n in checked:
                    by_source[m["source"]] = by_source.get(m["source"], 0) + 1
                tr.burst("put", "producer", t0, tracing.now_us(), by_source)
        return [m for m in out if m is not None]

    def _put_waiting(self, unit_id: str, trajs: Sequence[Trajectory], items: Sequence[Sequence[Any]], rest: Sequence[int],
                     timeout: float | None, out: list[TrajectoryMeta | None]) -> None:
        plane = self._engine.control
        unit = self._engine.units[unit_id]
        k = rest[0]
        try:
            unit.put(trajs[k], timeout=timeout)
        except StoreFull as e:
            for i in rest:
                plane.admission.note_rejected(trajs[i].id, "store_full")
            self._engine.flush_reports()  # this process's consumers' hand-outs and commits, for an exact answer
            holders = plane.reporting.holders(unit_id)
            more = f" (and {len(rest) - 1} more of this batch not yet stored)" if len(rest) > 1 else ""
            raise StoreFull(f"trajectory {trajs[k].id!r}{more} refused: storage unit {unit_id!r} is held by {holders}. "
                            f"{e}") from e
        except EngineError as e:
            plane.admission.note_rejected(trajs[k].id, "closed")
            self._raise_closed(e)
            raise
        except ValidationError:  # the id is held there already (not this put's payload)
            plane.admission.note_rejected(trajs[k].id, "id")
            raise
        except BaseException as e:  # interrupted while it waited: it may have been stored
            unit.release([trajs[k].id])
            plane.admission.note_rejected(trajs[k].id, type(e).__name__)
            raise
        try:
            ans = plane.admission.admit_many(unit_id, [list(items[k])])
        except BaseException:
            unit.release([trajs[k].id])
            raise
        if ans["accepted"][0] is None:
            unit.release([trajs[k].id])
        self._router.take(ans, [k], out)

    def _raise_closed(self, e: EngineError) -> None:
        if self.stats_light()["closed"]:
            raise PipelineClosedError("the pipeline was closed (end of stream); build a new Pipeline to continue") from e

    def _checked(self, traj: Any) -> tuple[dict[str, Any], int]:
        """The checks of the put path in the producer (type, fields, media decoding): ``(metadata, loss tokens)``.

        A refusal is counted by the control plane by its cause, then raised.
        """
        plane = self._engine.control
        if not isinstance(traj, Trajectory):
            plane.admission.note_rejected(None, "traj")
            raise FieldTypeError(f"put() takes a knitdata.Trajectory, got {type(traj).__name__}", field="traj")
        try:
            traj.validate()
            budget = int(self._engine.config["token_budget"])
            if traj.num_tokens > budget:
                raise ValidationError(
                    f"{traj.num_tokens} tokens (prompt {traj.prompt_ids.numel()} + response "
                    f"{traj.response_ids.numel()}) exceed the pipeline's token_budget of {budget} per micro-batch: "
                    "truncate it, or create the pipeline with a larger token_budget",
                    trajectory_id=traj.id, field="num_tokens")
            if self.check_media and traj.media:
                from knitdata.media import check_media_item

                for i, item in enumerate(traj.media):
                    check_media_item(item, trajectory_id=traj.id, index=i)
        except KnitdataError as e:
            cause = getattr(e, "field", None) or ("media" if traj.media else type(e).__name__)
            plane.admission.note_rejected(traj.id, cause.split(".")[0])
            raise
        meta = traj.meta().to_dict()
        meta["fields"] = fields_of(traj.scalars, {k: str(v.dtype).replace("torch.", "") for k, v in traj.tensors.items()})
        return meta, _loss_tokens(traj)

    def set_in_flight(self, counts: Mapping[str, int]) -> None:
        """Tell admission how many trajectories per source are still coming for this train batch.

        Raises:
            QuotaInfeasibleError: A source can no longer deliver its quota.
        """
        self._engine.control.admission.set_in_flight(dict(counts))

    # the staleness bound (max_staleness): knitdata.control.admit, docs/concepts.md "A hard staleness bound"
    def rollout_capacity(self, version: int | None = None) -> dict[str, int]:
        """Prompts (groups) per source that may start with ``version`` (default: the last reported) within the bound
        (:meth:`~knitdata.admission.AdmissionPolicy.rollout_capacity`; ConfigError without one)."""
        return dict(self._engine.control.admission.rollout_capacity(version))

    def acquire_rollout(self, counts: Mapping[str, int] | str, n: int = 1, *, version: int | None = None,
                        timeout: float | None = 60.0) -> None:
        """Block until the bound has room, then reserve ``counts`` prompts per source (or ``n`` of one source);
        see :func:`knitdata.control.acquire_rollout` (raises :class:`~knitdata.errors.RolloutThrottled`)."""
        acquire_rollout(self._engine, {counts: n} if isinstance(counts, str) else dict(counts), version, timeout)

    def release_rollout(self, counts: Mapping[str, int]) -> None:
        """Give back reservations (:meth:`acquire_rollout`) of prompts that will not be generated."""
        self._engine.control.admission.unreserve_rollout(dict(counts))

    def dropped(self) -> list[dict[str, Any]]:
        """The groups the bound dropped since the last call, to regenerate (``{"group", "source", "version",
        "trajectories", "tokens", "step"}`` each; payloads already freed)."""
        return list(self._engine.control.admission.take_dropped())

    def withdraw(self, group: str) -> list[TrajectoryMeta]:
        """Drop a group that rollout aborted or a filter rejected; frees its stored members.

        Call it when a member of a group was refused at :meth:`put`, so that the train batch can complete.
        Later members of the group are refused.

        Returns:
            The members that were waiting for admission (``[]`` if unknown or already admitted).
        """
        return [TrajectoryMeta.from_dict(d) for d in self._engine.control.admission.withdraw(group)]

    def report_version(self, version: int) -> None:
        """The trainer reports its new policy version (after an optimizer step).

        Staleness of each trajectory handed out afterwards is measured against it; listeners added in this
        process with :meth:`add_version_listener` are called (weight-sync timing hooks). It is sent by this
        process's background sender, after the hand-outs before it, off the trainer's thread; a put from this process
        sends it first (so output of the new weights never reaches the plane before their report). A version lower
        than the last one is a rollback (a job restored from a checkpoint reports its version again): accepted.

        Raises:
            ValidationError: Not a non-negative int.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValidationError(f"version must be a non-negative int, got {version!r}", field="version")
        self._engine.sender.report_version(version)
        now = time.monotonic()
        with self._listeners_lock:
            listeners = list(self._version_listeners)
        for fn in listeners:
            fn(version, now)

    def add_version_listener(self, fn: Callable[[int, float], None]) -> None:
        """Call ``fn(version, monotonic_time)`` on every :meth:`report_version` of this process."""
        with self._listeners_lock:
            self._version_listeners.append(fn)

    def close(self) -> dict[str, Any]:
        """End of stream: no more puts; consumers finish the admitted mini-batches and stop. Idempotent.

        Returns:
            What was dropped (``dropped_trajectories``, ``dropped_groups``, ``by_source``): trajectories stored but
            never admitted (an incomplete train batch or group). If any, a warning says so and consumers raise
            :class:`~knitdata.errors.IncompleteStreamError` once they have every admitted mini-batch.
        """
        report = dict(self._engine.control.admission.close())
        if self._presence is not None:  # a closed pipeline needs no producer presence
            self._engine.sender.remove_producer(self._presence)
        self._engine.on_close()
        if report.get("dropped_trajectories") and not self._closed_here:
            warnings.warn(
                f"knitdata: pipeline closed with {report['dropped_trajectories']} trajectories never admitted "
                f"(groups {report['dropped_groups'][:10]}, by source {report['by_source']})", stacklevel=2)
        self._closed_here = True
        return report

    def shutdown(self) -> None:
        """Close the pipeline and free what the engine holds (Ray: kill the coordinator and unit actors); with a
        trace, the processes' parts are flushed and merged into it (:meth:`write_trace`)."""
        try:
            self.close()
        except KnitdataError:
            pass
        if self.trace_path is not None:
            self._engine.flush_trace()
        self._engine.shutdown()
        if self.trace_path is not None and self._owner:
            self.write_trace()

    def write_trace(self) -> dict[str, Any] | None:
        """Flush this process's trace events and merge every part written so far into :attr:`trace_path`
        (:func:`knitdata.trace.merge`; ``knitdata trace PATH`` does the same later, with the parts of processes
        that ended since). Returns the merge's summary, or ``None`` without a trace."""
        if self.trace_path is None:
            return None
        if tracing.tracer is not None:
            tracing.tracer.flush()
        return tracing.merge(self.trace_path)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        """The creator's ``with`` block ended: shut the pipeline down (Ray) or close it (embedded); with a trace,
        merge the parts written so far into :attr:`trace_path` (:meth:`write_trace`; the creator's process merges
        again when it exits, with what was recorded after the block)."""
        if self._owner and self._engine.shutdown_on_exit:
            self.shutdown()
            return
        self.close()
        if self._owner and self.trace_path is not None:
            try:
                self.write_trace()
            except (KnitdataError, OSError):
                if exc[0] is None:
                    raise  # else the block's own error goes on (a merge error would hide it)

    # ------------------------------------------------------------------ consumer side
    def dataset(
        self,
        rank: int | None = None,
        *,
        fetch: str | FetchMode = "iter",
        collate: Callable[..., Any] | None = None,
        media_collator: Callable[..., Any] | None = None,
        prefetch_depth: int = 2,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        max_minibatches: int | None = None,
        timeout: float | None = 1800.0,
        replica: int | None = None,
        num_replicas: int | None = None,
    ) -> TrajectoryDataset:
        """The :class:`~knitdata.dataset.TrajectoryDataset` of consumer ``rank``.

        Its keywords are the dataset's options (:class:`~knitdata.consumer.DatasetOptions`, declared once).

        Args:
            rank: The consumer (the data-parallel rank with ``replica``); default ``torch.distributed.get_rank()``
                (without ``replica`` only).
            fetch: ``"sample"``, ``"eager"`` or ``"iter"``, the name of another registered
                :class:`~knitdata.fetch.FetchMode`, or a :class:`~knitdata.fetch.FetchMode`.
            collate: ``collate(trajectories, info) -> MicroBatch``; default :class:`~knitdata.collate.TokenCollator`.
            media_collator: ``media_collator(list_of_micro_batches) -> MultimodalBatch`` (e.g.
                :class:`~knitdata.multimodal.MultimodalCollator`): the media table of the rank's share of each
                mini-batch; ``None``: no media table.
            prefetch_depth: Micro-batches prepared ahead in ``iter`` mode. With a ``media_collator`` at least a
                mini-batch's micro-batches plus one: the next share (payloads and media table) is prepared while the
                current mini-batch computes, so two shares are in memory at most.
            device: Device the prefetch thread copies micro-batches to (``iter`` mode).
            pin_memory: Pin micro-batches on the prefetch thread (default: when CUDA is used).
            max_minibatches: Each iteration stops after this many mini-batches (``None``: until drained).
            timeout: Most seconds to wait for the next micro-batch before :class:`~knitdata.errors.DataTimeoutError`
                (``None``: no limit).
            replica: This dataset's tensor/pipeline-parallel replica of data-parallel rank ``rank`` (its peers receive
                the same micro-batches; :func:`knitdata.replica_layout` derives ``rank``, ``replica`` and
                ``num_replicas`` from a ``DeviceMesh``). ``None``: the rank has one consumer, which acts as replica 0.
            num_replicas: Replicas per data-parallel rank, given with ``replica`` (registered with the control plane;
                every replica of every rank must pass the same number).

        Raises:
            ConfigError: Bad options, no rank given outside an initialized process group (or with ``replica``),
                or ``num_replicas`` other than the one registered first.
        """
        from knitdata.dataset import TrajectoryDataset

        if rank is None and replica is not None:
            raise ConfigError("replica=... needs the data-parallel rank: pass rank=... (knitdata.replica_layout)")
        if rank is None:
            rank = _dist_rank()
            if rank is None:
                raise ConfigError("no rank given and torch.distributed is not initialized: pass rank=...")
        return TrajectoryDataset(
            self._engine, rank, fetch=fetch, collate=collate, media_collator=media_collator,
            prefetch_depth=prefetch_depth, device=device, pin_memory=pin_memory, max_minibatches=max_minibatches,
            timeout=timeout, replica=replica, num_replicas=num_replicas,
        )

    def reshape(self, states: Sequence[Any], layout: ConsumerLayout | int | None = None) -> dict[str, Any]:
        """Continue this live pipeline on ``layout`` (or that many ranks on its first node) from the states of all
        its stopped old ranks; returns the merged state every new rank loads. See "Resume onto another number of
        ranks" in the docs and :meth:`knitdata.control.reshape.Reshaping.reshape`.

        Raises:
            StateError: An incomplete or inconsistent set of states (:func:`knitdata.merge_rank_states`).
        """
        from knitdata.control.rankstates import merge_rank_states

        merged = merge_rank_states(states)
        new = layout if isinstance(layout, ConsumerLayout) else self.layout if layout is None else \
            ConsumerLayout.single_node(layout, self.layout.nodes[0])
        self._engine.control.reshaping.reshape(merged, new.to_dict())
        self._engine.set_layout(new)
        self.layout = new
        return merged

    def metrics(self, rank: int) -> ConsumerMetrics:
        """This process's metrics of consumer ``rank`` (shared by its datasets)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_consumers:
            raise ConfigError(f"rank must be an int in 0..{self.num_consumers - 1}, got {rank!r}")
        return self._engine.metrics(rank)

    def kill_unit(self, unit_id: str) -> None:
        """Ray engine: kill one storage unit's actor (failure drills and tests).

        Raises:
            EngineError: On the embedded engine.
        """
        self._engine.kill_unit(unit_id)

    # ------------------------------------------------------------------ whole-pipeline checkpoint
    @property
    def ledger(self) -> RolloutLedger:
        """The rollout ledger the producer reports its prompts to (:class:`~knitdata.checkpoint.RolloutLedger`)."""
        from knitdata.checkpoint import RolloutLedger
        return RolloutLedger(self._engine.control.ledger)

    def checkpoint(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        """Save the whole pipeline to the directory ``path``: :func:`knitdata.checkpoint.write_checkpoint`."""
        from knitdata.checkpoint import write_checkpoint
        return write_checkpoint(self._engine, path, options={
            "capacity_bytes": self.capacity_bytes, "put_timeout": self.put_timeout, "check_media": self.check_media})

    @classmethod
    def restore(cls, path: str | os.PathLike[str], *, rank_states: Sequence[Any] | Mapping[str, Any] | None = None,
                allow_config_change: bool = False, **options: Any) -> Pipeline:
        """A new pipeline continuing the checkpoint at ``path``, in any process: see
        :func:`knitdata.checkpoint.restore_pipeline` for ``options`` (the topology, or :class:`Pipeline` keywords).
        Onto another number of ranks (``layout=...``), pass ``rank_states``, the saved states of all old ranks (or
        their merged state); every new rank then loads ``pipe.restore_report.merged_state``."""
        from knitdata.checkpoint import restore_pipeline
        return restore_pipeline(cls, path, lambda p: p._engine, rank_states=rank_states,
                                allow_config_change=allow_config_change, **options)

    def lost_groups(self) -> dict[str, dict[str, Any]]:
        """The groups lost with a dead storage unit and not in its spill: :func:`knitdata.checkpoint.lost_groups`."""
        from knitdata.checkpoint import lost_groups
        return lost_groups(self._engine)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """JSON-serializable counters: control plane, storage per unit, per-consumer metrics."""
        out = {"engine": self.engine, **self.stats_light()}
        units: dict[str, Any] = {}
        for u, unit in self._engine.units.items():
            try:
                units[u] = unit.stats().to_dict()
            except KnitdataError:
                units[u] = None
            except Exception:  # noqa: BLE001 - a dead unit's actor
                units[u] = None
        out["units"] = units
        reported = out.pop("consumers", None) or []
        local = [self._engine.metrics(r).to_dict() for r in range(self.num_consumers)]
        out["consumers"] = [loc if loc["microbatches"] or not (i < len(reported) and reported[i]) else reported[i]
                            for i, loc in enumerate(local)]
        meter = self._engine.meter
        if meter is not None:  # this process's counters not flushed yet, plus what others reported
            from knitdata.metrics import TransferMeter

            total = TransferMeter()
            total.merge(out.get("transfer") or {})
            total.merge(meter.to_dict())
            out["transfer"] = total.to_dict()
        return out

    def step_metrics(self, rank: int | None = None, *, prefix: str = "knitdata/") -> dict[str, float | int]:
        """:meth:`stats` as one flat ``{"knitdata/...": number}`` dict for a logger (see
        :func:`knitdata.monitor.flat_metrics`); with ``rank``, that rank's wait, bytes and staleness too.

        A rank's trainer calls :meth:`TrajectoryDataset.step_metrics <knitdata.dataset.TrajectoryDataset.step_metrics>`
        instead (its own process's figures, one control-plane call).
        """
        from knitdata.monitor import flat_metrics

        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or not 0 <= rank < self.num_consumers):
            raise ConfigError(f"rank must be an int in 0..{self.num_consumers - 1} or None, got {rank!r}")
        return flat_metrics(self.stats(), rank=rank, prefix=prefix)

    def status_table(self) -> str:
        """A compact text table of this pipeline: per source finished/admitted/ready/quota, per rank position,
        micro-batches planned ahead, data wait and staleness, store fill, the journal (what ``knitdata status``
        prints for a Ray pipeline; see :func:`knitdata.monitor.status_table`)."""
        from knitdata.monitor import status_table

        return status_table({"name": self.name, **self.stats()})

    def flush_meter(self) -> None:
        """Ray engine: send this process's put/read byte counters to the coordinator (and zero them here)."""
        self._engine.flush_meter()

    def __repr__(self) -> str:
        return (f"Pipeline(engine={self.engine!r}, name={self.name!r}, consumers={self.num_consumers}, "
                f"nodes={list(self.layout.nodes)}, capacity_bytes={self.capacity_bytes})")
