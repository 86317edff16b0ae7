"""The user-facing pipeline: producers put, admission decides, the planner assigns, consumers iterate.

:class:`Pipeline` is one facade over one control plane (:class:`knitdata.control.ControlPlane`) and one of two
engines that differ only in where payload bytes live:

* ``engine="embedded"`` (the default): one process; producers and consumers are threads; no servers.
* ``engine="ray"``: the control plane in a coordinator actor and one storage-unit actor per node of the
  layout, so producers, torchrun/Accelerate ranks and DataLoader workers in other processes (or nodes)
  share the pipeline: they attach with :meth:`Pipeline.attach` by its name.

Every engine has the same put path (:class:`~knitdata.producer.Producer`: validation and media decoding in the
producer; the payload stored on the unit this process's replica of the placement picks; then one admission call,
which on Ray the storage unit makes itself, so a put is one round trip), the same
:class:`~knitdata.consumer.dataset.TrajectoryDataset`, state format, defaults and errors. The options are declared once
(:class:`~knitdata.engines.options.PipelineOptions`); tests, drills and benchmarks reach the engine behind the
facade through :attr:`Pipeline.internals`.

Memory: each storage unit holds at most ``max(capacity_bytes, largest trajectory)`` bytes; producers wait up
to ``put_timeout`` for room, then get :class:`~knitdata.errors.StoreFull` naming the ranks whose uncommitted
micro-batches hold the store (or, with ``spill_dir``, overflow goes to tar shards on disk).

Example:
    >>> from knitdata.admission import BatchSpec
    >>> pipe = Pipeline(BatchSpec({"math": 8, "code": 8}, num_minibatches=2), num_consumers=2)
    >>> ds = pipe.dataset(0, fetch="iter")  # iterate it in rank 0 (a thread or a torchrun process)
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from knitdata import checkpoint as ckpt
from knitdata.admission import AdmissionPolicy, AdmittedMiniBatch, BatchSpec
from knitdata.checkpoint import CheckpointInfo, RestoreReport, RolloutLedger
from knitdata.consumer.dataset import TrajectoryDataset
from knitdata.consumer.session import DEFAULT_TIMEOUT_S
from knitdata.control import RELEASE_MODES, acquire_rollout
from knitdata.engines.base import ENGINES, Engine
from knitdata.engines.options import PipelineOptions
from knitdata.errors import ConfigError, KnitdataError, PipelineClosedError
from knitdata.observe import monitor
from knitdata.observe import trace as tracing
from knitdata.observe.metrics import ConsumerMetrics
from knitdata.placement import ConsumerLayout, Placement
from knitdata.planner import MiniBatchPlan
from knitdata.producer import PUT_TIMEOUT, Producer
from knitdata.record import Trajectory, TrajectoryMeta
from knitdata.storage.base import StorageUnit

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from knitdata.consumer.fetch import FetchMode

__all__ = ["Pipeline", "PipelineClosedError", "ENGINES", "RELEASE_MODES", "DEFAULT_TIMEOUT_S", "PUT_TIMEOUT"]



def _rank_of(rank: int | None, replica: int | None) -> int:
    """``rank``, or this process's ``torch.distributed`` rank (only without ``replica``)."""
    if rank is not None:
        return rank
    if replica is not None:
        raise ConfigError("replica=... needs the data-parallel rank: pass rank=... (knitdata.replica_layout)")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("no rank given and torch.distributed is not initialized: pass rank=...")
    return int(dist.get_rank())


class Pipeline:
    """Producers put trajectories; consumers iterate their micro-batches. Thread-safe; any engine.

    Every keyword after ``spec`` (admission, layout, engine, capacity, placement, release, the staleness bound,
    tracing...) is a field of :class:`~knitdata.engines.options.PipelineOptions`, documented there with its default;
    the pipeline checks them all there before its engine is built.

    Args:
        spec: The batch specification (quotas per source, mini-batches per train batch, group size).

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
        media_dedup: bool = True,
    ) -> None:
        options = {k: v for k, v in locals().items() if k not in ("self", "spec")}  # PipelineOptions' fields
        eng = PipelineOptions(**options).build(spec)
        self._setup(eng, capacity_bytes, put_timeout=put_timeout, check_media=check_media, owner=True)

    def _setup(self, engine: Engine, capacity_bytes: int, *, put_timeout: float | None, check_media: bool,
               owner: bool) -> None:
        self.capacity_bytes = capacity_bytes
        self._engine = engine
        self.spec = BatchSpec.from_dict(engine.config["spec"])
        self._producer = Producer(engine, put_timeout=put_timeout, check_media=check_media)
        self._owner = owner
        self._closed_here = False
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
        eng: Any = ENGINES.get("ray", what="Pipeline.attach").attach(name, address=address,
                                                                    loopback_only=loopback_only, timeout_s=timeout_s)
        self = cls.__new__(cls)
        self._setup(eng, int(eng.info["capacity_bytes"]), put_timeout=put_timeout, check_media=check_media, owner=False)
        return self

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
    def layout(self) -> ConsumerLayout:
        """Consumers by node (changed by :meth:`reshape`)."""
        return self._engine.layout

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
    def internals(self) -> Engine:
        """The pipeline's engine, for tests, failure drills and benchmarks (not training code): its control parts
        (``internals.control.positions.commit(...)``), units, ``kill_unit``, ``local_plane()`` (embedded)."""
        return self._engine

    @property
    def put_timeout(self) -> float | None:
        """Default seconds a put waits for room (``None``: no limit)."""
        return self._producer.put_timeout

    @property
    def check_media(self) -> bool:
        """Whether media are decoded (and bad ones refused) at put, in the producer."""
        return self._producer.check_media

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (by any process)."""
        return self._closed_here or bool(self.stats_light()["closed"])

    @property
    def version(self) -> int:
        """The policy version last reported by the trainer."""
        return int(self.stats_light()["version"])

    def stats_light(self) -> dict[str, Any]:
        """The control plane's counters only (no unit or consumer round trips), after what this process's consumers
        queued for it (hand-outs, commits, versions)."""
        self._engine.flush_reports()
        return dict(self._engine.control.reporting.stats())

    def put(self, traj: Trajectory, *, timeout: float | None | Literal["put_timeout"] = PUT_TIMEOUT) -> TrajectoryMeta:
        """Store a finished trajectory and offer it to admission: :meth:`put_many` of ``[traj]``.

        Raises:
            FieldTypeError / ValidationError / MediaError: A bad trajectory (the message names it and the field or
                media item), or one longer than ``token_budget`` (field ``num_tokens``); nothing else is affected.
            StoreFull: No room within ``timeout``; the message names the ranks holding the store.
            PipelineClosedError: After :meth:`close`.
            QuotaInfeasibleError: Admission found the quotas impossible (also raised to consumers).
        """
        return self._producer.put([traj], timeout)[0]

    def put_many(self, trajs: Sequence[Trajectory], *,
                 timeout: float | None | Literal["put_timeout"] = PUT_TIMEOUT) -> list[TrajectoryMeta]:
        """Store finished trajectories and offer them to admission: one round trip per storage unit.

        Validation and media decoding run here, in the producer (:class:`~knitdata.producer.Producer`); this
        process's replica of the placement picks each payload's unit (a group's members stay together), which
        stores it and asks the control plane to admit it (on Ray the unit's actor does). A full unit costs more: the
        put waits for room, up to ``timeout`` (seconds; ``None``: no limit; ``0``: fail at once; default
        :attr:`put_timeout`). Do not mutate a trajectory after its put.

        Returns:
            The metadata of each trajectory (with ``location`` and ``seq``), in order.

        Raises:
            FieldTypeError: As :meth:`put`; nothing of the batch is stored.
            ValidationError: As :meth:`put` (also an unknown source, a duplicate id, a withdrawn group): nothing
                of the batch bound for that trajectory's unit is kept (parts bound for other units, put before, stay
                accepted).
            StoreFull: No room within ``timeout``: this payload and every later one are refused; the earlier ones
                stay accepted.
            PipelineClosedError: After :meth:`close`.
        """
        return self._producer.put(list(trajs), timeout)

    def set_in_flight(self, counts: Mapping[str, int]) -> None:
        """Tell admission how many trajectories per source are still coming for this train batch (raises
        :class:`~knitdata.errors.QuotaInfeasibleError` when a source can no longer deliver its quota)."""
        self._engine.control.admission.set_in_flight(dict(counts))

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
        """Drop a group that rollout aborted or a filter rejected (e.g. a member refused at :meth:`put`, so that the
        train batch can complete); frees its stored members and refuses later ones. Returns the members that were
        waiting for admission (``[]`` if unknown or already admitted)."""
        return [TrajectoryMeta.from_dict(d) for d in self._engine.control.admission.withdraw(group)]

    def report_version(self, version: int) -> None:
        """The trainer reports its new policy version (after an optimizer step).

        Staleness of what is handed out afterwards is measured against it; this process's listeners
        (:meth:`add_version_listener`: weight-sync timing hooks) are called. This process's background sender sends
        it after the hand-outs before it, and before a later put of this process (output of the new weights never
        reaches the plane before their report). A lower version is a rollback (a restored job): accepted.

        Raises:
            ValidationError: Not a non-negative int.
        """
        self._engine.report_version(version)

    def add_version_listener(self, fn: Callable[[int, float], None]) -> None:
        """Call ``fn(version, monotonic_time)`` on every :meth:`report_version` of this process."""
        self._engine.add_version_listener(fn)

    def close(self, *, warn: bool = True) -> dict[str, Any]:
        """End of stream: no more puts; consumers finish the admitted mini-batches and stop. Idempotent.

        Args:
            warn: Warn when stored trajectories were never admitted (``False`` for an owner that closes on purpose
                with work generated ahead, and reports the returned figures itself).

        Returns:
            What was dropped (``dropped_trajectories``, ``dropped_groups``, ``by_source``): stored, never admitted (an
            incomplete train batch or group); if any, a warning says so and consumers raise
            :class:`~knitdata.errors.IncompleteStreamError` once they have every admitted mini-batch.
        """
        report = dict(self._engine.control.admission.close())
        self._producer.close()  # a closed pipeline needs no producer presence
        self._engine.on_close()
        if warn and report.get("dropped_trajectories") and not self._closed_here:
            warnings.warn(
                f"knitdata: pipeline closed with {report['dropped_trajectories']} trajectories never admitted "
                f"(groups {report['dropped_groups'][:10]}, by source {report['by_source']})", stacklevel=2)
        self._closed_here = True
        return report

    def shutdown(self) -> None:
        """Close the pipeline and free what the engine holds (Ray: kill the coordinator and unit actors); with a
        trace, the processes' parts are flushed and merged into it (:meth:`write_trace`)."""
        with contextlib.suppress(KnitdataError):
            self.close()
        if self.trace_path is not None:
            self._engine.flush_trace()
        self._engine.shutdown()
        if self.trace_path is not None and self._owner:
            self.write_trace()

    def write_trace(self) -> dict[str, Any] | None:
        """Flush this process's trace events and merge every part written so far into :attr:`trace_path`
        (:func:`knitdata.observe.trace.merge`, as ``knitdata trace PATH``); the merge's summary, or ``None`` without a trace."""
        if self.trace_path is None:
            return None
        if tracing.tracer is not None:
            tracing.tracer.flush()
        return tracing.merge(self.trace_path)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        """The creator's ``with`` block ended: shut the pipeline down (Ray) or close it (embedded); with a trace, merge
        the parts so far (:meth:`write_trace`; the creator's process merges again at its exit)."""
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
        """The :class:`~knitdata.consumer.dataset.TrajectoryDataset` of consumer ``rank``.

        Its keywords are the dataset's options, declared and documented once: the fields of
        :class:`~knitdata.consumer.session.DatasetOptions` (``fetch="sample" | "eager" | "iter"``, ``collate``,
        ``media_collator``, ``prefetch_depth``, ``device``, ``pin_memory``, ``max_minibatches``, ``timeout``,
        ``replica``, ``num_replicas``).

        Args:
            rank: The consumer (the data-parallel rank with ``replica``); default ``torch.distributed.get_rank()``
                (without ``replica`` only).

        Raises:
            ConfigError: Bad options, no rank given outside an initialized process group (or with ``replica``),
                or ``num_replicas`` other than the one registered first.
        """
        options = {k: v for k, v in locals().items() if k not in ("self", "rank")}  # DatasetOptions' fields
        return TrajectoryDataset(self._engine, _rank_of(rank, replica), **options)

    def reshape(self, states: Sequence[Any], layout: ConsumerLayout | int | None = None) -> dict[str, Any]:
        """Continue this live pipeline on ``layout`` (or that many ranks on its first node) from the states of all
        its stopped old ranks; returns the merged state every new rank loads (docs: "Resume onto another number of
        ranks").

        Raises:
            StateError: An incomplete or inconsistent set of states (:func:`knitdata.merge_rank_states`).
        """
        return self._engine.reshape(states, layout)

    def metrics(self, rank: int) -> ConsumerMetrics:
        """This process's metrics of consumer ``rank`` (shared by its datasets); ConfigError for a bad rank."""
        return self._engine.metrics(rank)

    @property
    def ledger(self) -> RolloutLedger:
        """The rollout ledger the producer reports its prompts to (:class:`~knitdata.checkpoint.RolloutLedger`)."""
        return RolloutLedger(self._engine.control.ledger)

    def checkpoint(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        """Save the whole pipeline to the directory ``path``: :func:`knitdata.checkpoint.write_checkpoint`."""
        return ckpt.write_checkpoint(self._engine, path, options={
            "capacity_bytes": self.capacity_bytes, "put_timeout": self.put_timeout, "check_media": self.check_media})

    @classmethod
    def restore(cls, path: str | os.PathLike[str], *, rank_states: Sequence[Any] | Mapping[str, Any] | None = None,
                allow_config_change: bool = False, **options: Any) -> Pipeline:
        """A new pipeline continuing the checkpoint at ``path``, in any process (``options``: the topology or
        :class:`Pipeline` keywords, :func:`knitdata.checkpoint.restore_pipeline`). Onto another number of ranks
        (``layout=...``) pass ``rank_states`` (all old ranks' states); new ranks load
        ``restore_report.merged_state``."""
        return ckpt.restore_pipeline(cls, path, lambda p: p.internals, rank_states=rank_states,
                                allow_config_change=allow_config_change, **options)

    def lost_groups(self) -> dict[str, dict[str, Any]]:
        """The groups lost with a dead storage unit and not in its spill: :func:`knitdata.checkpoint.lost_groups`."""
        return ckpt.lost_groups(self._engine)

    def stats(self) -> dict[str, Any]:
        """JSON-serializable counters: control plane, units, consumers (:meth:`~knitdata.engines.base.Engine.stats`)."""
        return self._engine.stats()

    def step_metrics(self, rank: int | None = None, *, prefix: str = "knitdata/") -> dict[str, float | int]:
        """:meth:`stats` as one flat ``{"knitdata/...": number}`` dict for a logger
        (:func:`knitdata.observe.monitor.flat_metrics`); with ``rank``, that rank's wait, bytes and staleness too. A rank's
        trainer calls :meth:`TrajectoryDataset.step_metrics <knitdata.consumer.dataset.TrajectoryDataset.step_metrics>`."""
        if rank is not None:
            self.metrics(rank)  # checks it
        return monitor.flat_metrics(self.stats(), rank=rank, prefix=prefix)

    def status_table(self) -> str:
        """This pipeline as a compact text table (``knitdata status``; :func:`~knitdata.observe.monitor.status_table`)."""
        return monitor.status_table({"name": self.name, **self.stats()})

    def flush_meter(self) -> None:
        """Ray engine: send this process's put/read byte counters to the coordinator (and zero them here)."""
        self._engine.flush_meter()

    def __repr__(self) -> str:
        return (f"Pipeline(engine={self.engine!r}, name={self.name!r}, consumers={self.num_consumers}, "
                f"nodes={list(self.layout.nodes)}, capacity_bytes={self.capacity_bytes})")
