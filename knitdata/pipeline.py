"""The user-facing pipeline: producers put, admission decides, the planner assigns, consumers iterate.

:class:`Pipeline` ties DESIGN.md §2 together on one engine. Producers call :meth:`Pipeline.put` (any
thread); the payload goes to a storage unit chosen by placement, its metadata to admission, and every
mini-batch admitted is planned at once (metadata only, under one lock: cheap). Each consumer (rank)
iterates :meth:`Pipeline.dataset`, a :class:`~knitdata.dataset.TrajectoryDataset` that follows its part of
the plans and fetches payloads on demand.

Engines are selected in one place, :func:`build_units`: ``"embedded"`` (one process; producers and
consumers are threads; one in-process storage unit per node of the layout) and ``"ray"`` (coming in
``knitdata.storage.ray_engine``).

Release (DESIGN.md §4): a payload leaves its storage unit when its consumer hands out the micro-batch
that holds it (the dataset's state then moves past it), when its group is withdrawn, or when a consumer
is positioned past it (``load_state_dict``). Memory: each unit holds at most
``max(capacity_bytes, largest trajectory)`` bytes; producers wait up to ``put_timeout`` for room.

Example:
    >>> from knitdata.admission import BatchSpec
    >>> pipe = Pipeline(BatchSpec({"math": 8, "code": 8}, num_minibatches=2), num_consumers=2)
    >>> ds = pipe.dataset(rank=0, fetch="iter")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from knitdata.admission import AdmissionPolicy, AdmittedMiniBatch, BatchSpec, make_policy
from knitdata.errors import (
    ConfigError,
    EngineError,
    FieldTypeError,
    KnitdataError,
    OptionalDependencyError,
    QuotaInfeasibleError,
    ValidationError,
)
from knitdata.metrics import ConsumerMetrics, summarize
from knitdata.placement import ConsumerLayout, Placement, make_placement
from knitdata.planner import MiniBatchPlan, PlannedMicroBatch, Planner
from knitdata.record import Trajectory, TrajectoryMeta
from knitdata.storage.base import StorageUnit

if TYPE_CHECKING:  # pragma: no cover
    from knitdata.dataset import TrajectoryDataset

__all__ = ["Pipeline", "PipelineClosedError", "ENGINES", "RELEASE_MODES", "build_units"]

#: When payloads leave storage (DESIGN.md §4 Release): see :class:`Pipeline`.
RELEASE_MODES: tuple[str, ...] = ("step", "commit", "handout")

#: Engines :func:`build_units` knows.
ENGINES: tuple[str, ...] = ("embedded", "ray")

_DEFAULT = object()
#: How many withdrawn group ids a pipeline remembers to refuse late members.
_WITHDRAWN_MEMORY = 1 << 16


class PipelineClosedError(EngineError):
    """The pipeline was closed (end of stream): no more puts or admissions."""


def build_units(
    engine: str,
    layout: ConsumerLayout,
    capacity_bytes: int,
    options: Mapping[str, Any] | None = None,
    *,
    spill_dir: str | os.PathLike[str] | None = None,
    spill_bytes: int = 16 << 30,
) -> dict[str, StorageUnit]:
    """Create one storage unit per node of ``layout`` on ``engine`` (the one place engines are chosen).

    The Ray engine plugs in as a module ``knitdata.storage.ray_engine`` exposing
    ``make_units(layout, capacity_bytes, **options) -> Mapping[str, StorageUnit]`` (unit id -> unit, one per
    node of the layout, each a :class:`~knitdata.storage.base.StorageUnit` whose ``node`` names the layout's
    node it lives on).

    Args:
        engine: ``"embedded"`` or ``"ray"``.
        layout: Consumers by node; one unit per node, its id is the node name.
        capacity_bytes: Capacity of each unit.
        options: Engine-specific options (passed to the Ray engine's ``make_units``).
        spill_dir: Give each unit a :class:`~knitdata.spill.SpillStore` in ``spill_dir/<unit id>`` for payloads
            that do not fit in memory (embedded engine; passed as ``spill_dir`` to the Ray engine).
        spill_bytes: Disk budget of each unit's spill store.

    Raises:
        ConfigError: Unknown engine.
        EngineError: The Ray engine is not available in this version.
        OptionalDependencyError: ``ray`` is not installed.
    """
    if engine == "embedded":
        from knitdata.storage.embedded import EmbeddedStorageUnit

        if options:
            raise ConfigError(f"the embedded engine takes no engine options, got {sorted(options)}")
        units: dict[str, StorageUnit] = {}
        for node in layout.nodes:
            spill = None
            if spill_dir is not None:
                from knitdata.spill import SpillStore

                spill = SpillStore(os.path.join(os.fspath(spill_dir), node), max_bytes=spill_bytes)
            units[node] = EmbeddedStorageUnit(node, capacity_bytes, spill=spill)
        return units
    if engine == "ray":
        try:
            import ray  # noqa: F401
        except ModuleNotFoundError as e:
            raise OptionalDependencyError("ray", "ray", "engine='ray'") from e
        try:
            ray_engine = importlib.import_module("knitdata.storage.ray_engine")
        except ModuleNotFoundError as e:
            if e.name != "knitdata.storage.ray_engine":
                raise
            raise EngineError(
                "engine='ray' is coming in the Ray engine (knitdata.storage.ray_engine), which is not part of "
                "this version; use engine='embedded' (one process, producers and consumers as threads)"
            ) from e
        opts = dict(options or {})
        if spill_dir is not None:
            opts.setdefault("spill_dir", os.fspath(spill_dir))
        return dict(ray_engine.make_units(layout, capacity_bytes, **opts))
    raise ConfigError(f"unknown engine {engine!r}; choose one of {ENGINES}")


def _loss_tokens(traj: Trajectory) -> int:
    if traj.loss_mask is None:
        return int(traj.response_ids.numel())
    return int((traj.loss_mask != 0).sum())


class Pipeline:
    """Producers put trajectories; consumers iterate their micro-batches. Thread-safe.

    Args:
        spec: The batch specification (quotas per source, mini-batches per train batch, group size).
        admission: A policy name (``"constraint_preserving"``, ``"linear_target"``, ``"fifo"``,
            ``"train_batch"``) or an :class:`~knitdata.admission.AdmissionPolicy` built on ``spec``.
        admission_options: Keyword arguments for :func:`~knitdata.admission.make_policy` (e.g.
            ``continuous=True``).
        layout: Consumers by node; default: ``num_consumers`` ranks on one node.
        num_consumers: Number of ranks when ``layout`` is not given.
        engine: ``"embedded"`` (default) or ``"ray"``. With ``"ray"`` the payloads live in Ray storage-unit
            actors, one per node of the layout (``engine_options``: ``address``, ``name``, ``nodes``...); add
            ``"cross_process": True`` to ``engine_options`` to get a
            :class:`~knitdata.storage.ray_engine.RayPipeline`, whose control plane runs in a Ray actor so that
            consumers and producers in other processes attach to it (torchrun ranks, DataLoader workers).
        capacity_bytes: Capacity of each storage unit (one per node).
        token_budget: Most tokens per micro-batch.
        placement: ``"consumer_aware"`` (default) or ``"index_mod"`` (baseline), or a
            :class:`~knitdata.placement.Placement` over the layout's node names.
        allow_split_groups: Let one group's members go to different consumers.
        balance_tolerance: See :class:`~knitdata.planner.Planner`.
        put_timeout: Default seconds a put waits for room (``None``: no limit; ``0``: fail at once).
        spill_dir: Spill payloads that do not fit in ``capacity_bytes`` to tar shards under this directory
            (one :class:`~knitdata.spill.SpillStore` per unit) instead of making producers wait.
        spill_bytes: Disk budget per unit when spilling.
        release: When a payload leaves storage (DESIGN.md §4 Release). A consumer *commits* a position when
            it calls :meth:`~knitdata.dataset.TrajectoryDataset.commit` (after saving its state); payloads
            before a committed position are released. ``"step"`` (default) also commits automatically when
            the consumer starts its next mini-batch, so each consumer holds at most its current and previous
            mini-batch share: a consumer that crashes mid-step and restores the state it saved at the last
            step boundary receives that step again. ``"commit"`` releases only on explicit commits (restore
            from any uncommitted state; producers wait when the store fills up). ``"handout"`` releases as
            soon as a micro-batch is handed out (the least memory; a restore needs a new pipeline fed the
            same puts). With ``"step"`` each unit must hold about two mini-batches of its consumers (the
            previous one stays until the next one is admitted); smaller stores need ``"handout"``.
        check_media: Decode every encoded media item once at :meth:`put` and refuse bad ones there
            (:func:`knitdata.media.check_media_item`), so a corrupt image cannot fail a consumer's mini-batch.
        on_plan: Called as ``on_plan(admitted, plan)`` under the pipeline lock for each admitted
            mini-batch (keep it cheap; for tests and monitoring).
        engine_options: Engine-specific options.

    Raises:
        ConfigError: Inconsistent options.
    """

    def __new__(cls, spec: BatchSpec, **kwargs: Any) -> Any:
        """``engine="ray"`` with ``engine_options={"cross_process": True, ...}`` builds a
        :class:`~knitdata.storage.ray_engine.RayPipeline` (control plane in a Ray actor, so ranks, DataLoader
        workers and producers in other processes can attach); otherwise a plain :class:`Pipeline`."""
        opts = dict(kwargs.get("engine_options") or {})
        if kwargs.get("engine") == "ray" and opts.pop("cross_process", False):
            try:
                from knitdata.storage.ray_engine import RayPipeline
            except ModuleNotFoundError as e:
                if e.name and e.name.split(".")[0] == "ray":
                    raise OptionalDependencyError("ray", "ray", "engine='ray'") from e
                raise
            return RayPipeline.from_pipeline_args(spec, **{**kwargs, "engine_options": opts})
        return super().__new__(cls)

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
        check_media: bool = True,
        on_plan: Callable[[AdmittedMiniBatch, MiniBatchPlan], None] | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(spec, BatchSpec):
            raise ConfigError(f"spec must be a knitdata.admission.BatchSpec, got {type(spec).__name__}")
        if release not in RELEASE_MODES:
            raise ConfigError(f"release must be one of {RELEASE_MODES}, got {release!r}")
        self.release = release
        self.check_media = check_media
        if layout is not None and not isinstance(layout, ConsumerLayout):
            raise ConfigError(
                f"layout must be a knitdata.placement.ConsumerLayout (e.g. ConsumerLayout(['node0', 'node0'])), "
                f"got {type(layout).__name__}"
            )
        if isinstance(balance_tolerance, bool) or not isinstance(balance_tolerance, (int, float)) or balance_tolerance < 0:
            raise ConfigError(f"balance_tolerance must be a non-negative number, got {balance_tolerance!r}")
        if layout is None:
            layout = ConsumerLayout.single_node(1 if num_consumers is None else num_consumers)
        elif num_consumers is not None and num_consumers != layout.num_consumers:
            raise ConfigError(f"num_consumers={num_consumers} disagrees with the layout's {layout.num_consumers} ranks")
        if isinstance(admission, AdmissionPolicy):
            if admission_options:
                raise ConfigError("admission_options only apply when admission is given by name")
            if admission.spec != spec:
                raise ConfigError("the admission policy was built on a different BatchSpec")
            policy = admission
        else:
            policy = make_policy(admission, spec, **dict(admission_options or {}))
        self.spec = spec
        self.layout = layout
        self.engine = engine
        self.capacity_bytes = capacity_bytes
        self.put_timeout = put_timeout
        self._units = build_units(engine, layout, capacity_bytes, engine_options, spill_dir=spill_dir,
                                  spill_bytes=spill_bytes)
        unit_ids = list(self._units)
        self._placement = make_placement(placement, unit_ids) if isinstance(placement, str) else placement
        self._planner = Planner(
            layout,
            token_budget,
            allow_split_groups=allow_split_groups,
            locality=self._placement.consumer_aware,
            balance_tolerance=balance_tolerance,
            unit_nodes={u: unit.node for u, unit in self._units.items()},
        )
        self._local_units = [
            frozenset(u for u, unit in self._units.items() if unit.node == layout.node_of(r))
            for r in range(layout.num_consumers)
        ]
        self._policy = policy
        self._on_plan = on_plan
        self._cond = threading.Condition()
        self._seq = 0
        self._putting: set[str] = set()
        # field names every trajectory carries (set by the first put), so that every micro-batch collates
        self._schema: tuple[frozenset[str], frozenset[str]] | None = None
        # recently withdrawn groups: a late member is refused instead of starting a group that never completes
        self._withdrawn: OrderedDict[str, None] = OrderedDict()
        self._live: dict[str, TrajectoryMeta] = {}
        self._loss: dict[str, int] = {}
        self._plans: dict[int, MiniBatchPlan] = {}
        self._first_open_step = 0  # plans below this were planned and already garbage-collected
        self._last_step = -1
        n = layout.num_consumers
        self._position: list[tuple[int, int]] = [(0, 0)] * n
        # micro-batches handed out but not committed yet, per rank, in plan order (release "step"/"commit")
        self._held: list[deque[PlannedMicroBatch]] = [deque() for _ in range(n)]
        self._metrics = [ConsumerMetrics(r) for r in range(n)]
        self._iterators: list[weakref.ref | None] = [None] * n
        self._closed = False
        self._error: BaseException | None = None
        self._counts = {"puts": 0, "rejected": 0, "withdrawn": 0, "admitted_minibatches": 0, "admitted_trajectories": 0}
        self._version = 0
        self._version_times: deque[float] = deque(maxlen=1024)
        self._staleness: deque[int] = deque(maxlen=10_000)
        self._version_listeners: list[Callable[[int, float], None]] = []

    # ------------------------------------------------------------------ properties
    @property
    def num_consumers(self) -> int:
        """Number of consumers (ranks)."""
        return self.layout.num_consumers

    @property
    def units(self) -> Mapping[str, StorageUnit]:
        """The storage units by id."""
        return dict(self._units)

    @property
    def planner(self) -> Planner:
        """The planner."""
        return self._planner

    @property
    def policy(self) -> AdmissionPolicy:
        """The admission policy (do not call it directly while the pipeline runs)."""
        return self._policy

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def version(self) -> int:
        """The policy version last reported by the trainer."""
        return self._version

    # ------------------------------------------------------------------ producer side
    def put(self, traj: Trajectory, *, timeout: Any = _DEFAULT) -> TrajectoryMeta:
        """Store a finished trajectory and offer it to admission.

        Args:
            traj: The trajectory (validated again here; do not mutate it afterwards).
            timeout: Seconds to wait for storage room; default :attr:`put_timeout`.

        Returns:
            Its metadata (with ``location`` and ``seq``).

        Raises:
            FieldTypeError / ValidationError / MediaError: A bad trajectory (the message names it and the
                field or media item); nothing else is affected.
            StoreFull: No room within ``timeout``; the trajectory was not accepted.
            PipelineClosedError: After :meth:`close`.
            QuotaInfeasibleError: Admission found the quotas impossible (also raised to consumers).
        """
        if not isinstance(traj, Trajectory):
            raise FieldTypeError(f"put() takes a knitdata.Trajectory, got {type(traj).__name__}", field="traj")
        traj.validate()
        if self.check_media and traj.media:
            from knitdata.media import check_media_item

            for i, item in enumerate(traj.media):
                check_media_item(item, trajectory_id=traj.id, index=i)
        if traj.source not in self.spec.quotas:
            raise ValidationError(
                f"unknown source {traj.source!r}; the batch spec has {list(self.spec.sources)}",
                trajectory_id=traj.id,
                field="source",
            )
        timeout = self.put_timeout if timeout is _DEFAULT else timeout
        with self._cond:
            self._check_open()
            self._check_schema_locked(traj)
            if traj.group in self._withdrawn:
                raise ValidationError(
                    f"its group {traj.group!r} was withdrawn (aborted or filtered); a late member is not accepted",
                    trajectory_id=traj.id,
                    field="group",
                )
            if traj.id in self._live or traj.id in self._putting:
                raise ValidationError("was already put and is still held; ids must be unique", trajectory_id=traj.id, field="id")
            seq = self._seq
            self._seq += 1
            meta = traj.meta(seq=seq)
            unit_id = self._placement.place(meta)
            self._putting.add(traj.id)
        try:
            self._units[unit_id].put(traj, timeout=timeout)
        except BaseException as e:
            with self._cond:
                self._putting.discard(traj.id)
                self._units[unit_id].release([traj.id])  # the unit may have stored it before failing
                self._placement.unplace(meta, unit_id)
                self._counts["rejected"] += 1
                closed = self._closed
            if closed and isinstance(e, EngineError):
                raise PipelineClosedError("the pipeline was closed while this put waited for room") from e
            raise
        meta = dataclasses.replace(meta, location=unit_id)
        with self._cond:
            self._putting.discard(traj.id)
            if self._closed:
                self._live[traj.id] = meta  # so that the release below also undoes its placement
                self._drop_unadmitted([meta])
                raise PipelineClosedError("the pipeline was closed while this put was in progress; it was not accepted")
            if traj.group in self._withdrawn:  # withdrawn while this put waited for room
                self._live[traj.id] = meta
                self._drop_unadmitted([meta])
                raise ValidationError(
                    f"its group {traj.group!r} was withdrawn while this put was in progress; it was not accepted",
                    trajectory_id=traj.id,
                    field="group",
                )
            try:
                self._live[traj.id] = meta
                # again: a concurrent put may have set the schema while this one was stored
                self._check_schema_locked(traj)
                self._loss[traj.id] = _loss_tokens(traj)
                self._policy.offer([meta])
            except BaseException:
                self._drop_unadmitted([meta])
                raise
            if self._schema is None:  # set by the first accepted put only
                self._schema = (frozenset(traj.scalars), frozenset(traj.tensors))
            self._counts["puts"] += 1
            self._poll_locked()
        return meta

    def _check_schema_locked(self, traj: Trajectory) -> None:
        if self._schema is None:
            return
        scalars, tensors = self._schema
        for kind, have, want in (("scalars", frozenset(traj.scalars), scalars), ("tensors", frozenset(traj.tensors), tensors)):
            if have != want:
                missing, extra = sorted(want - have), sorted(have - want)
                name = (missing or extra)[0]
                raise ValidationError(
                    f"carries {kind} {sorted(have)} but this pipeline's trajectories carry {sorted(want)} "
                    f"(missing {missing}, unexpected {extra}); every trajectory needs the same fields so that "
                    "any micro-batch collates",
                    trajectory_id=traj.id,
                    field=f"{kind}.{name}",
                )

    def set_in_flight(self, counts: Mapping[str, int]) -> None:
        """Tell admission how many trajectories per source are still coming for this train batch.

        Raises:
            QuotaInfeasibleError: A source can no longer deliver its quota.
        """
        with self._cond:
            self._check_open()
            try:
                self._policy.set_in_flight(counts)
            except QuotaInfeasibleError as e:  # fatal; a bad argument (ValidationError) only fails this call
                self._fail(e)
                raise
            self._poll_locked()

    def withdraw(self, group: str) -> list[TrajectoryMeta]:
        """Drop a group that rollout aborted or a filter rejected; frees its stored members.

        Returns:
            The members that were waiting for admission (``[]`` if unknown or already admitted).
        """
        with self._cond:
            metas = self._policy.withdraw(group)
            self._withdrawn[group] = None
            while len(self._withdrawn) > _WITHDRAWN_MEMORY:
                self._withdrawn.popitem(last=False)
            self._drop_unadmitted(metas)
            self._counts["withdrawn"] += len(metas)
            self._placement.forget_group(group)
            if not self._closed:
                self._poll_locked()
            return metas

    def report_version(self, version: int) -> None:
        """The trainer reports its new policy version (after an optimizer step).

        Staleness of each trajectory handed out afterwards is measured against it; listeners added with
        :meth:`add_version_listener` are called (weight-sync timing hooks).

        Raises:
            ValidationError: A version lower than the last one reported.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValidationError(f"version must be a non-negative int, got {version!r}", field="version")
        now = time.monotonic()
        with self._cond:
            if version < self._version:
                raise ValidationError(f"version {version} is older than the last reported {self._version}", field="version")
            self._version = version
            self._version_times.append(now)
            listeners = list(self._version_listeners)
        for fn in listeners:
            fn(version, now)

    def add_version_listener(self, fn: Callable[[int, float], None]) -> None:
        """Call ``fn(version, monotonic_time)`` on every :meth:`report_version` (e.g. to sync weights)."""
        with self._cond:
            self._version_listeners.append(fn)

    def close(self) -> None:
        """End of stream: no more puts; consumers finish the admitted mini-batches and stop. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for unit in self._units.values():
            unit.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ consumer side
    def dataset(
        self,
        rank: int,
        *,
        fetch: str = "iter",
        collate: Callable[..., Any] | None = None,
        media_collator: Callable[..., Any] | None = None,
        prefetch_depth: int = 2,
        device: Any = None,
        pin_memory: bool | None = None,
        max_minibatches: int | None = None,
    ) -> TrajectoryDataset:
        """The :class:`~knitdata.dataset.TrajectoryDataset` of consumer ``rank``.

        Args:
            rank: The consumer.
            fetch: ``"sample"``, ``"eager"`` or ``"iter"`` (DESIGN.md §4).
            collate: Turns trajectories into a micro-batch; default :class:`~knitdata.collate.TokenCollator`.
            media_collator: E.g. :class:`~knitdata.multimodal.MultimodalCollator`; builds the media table of
                the consumer's share of each mini-batch.
            prefetch_depth: Micro-batches prepared ahead in ``iter`` mode.
            device: Copy micro-batches to this device on the prefetch thread (``iter`` mode).
            pin_memory: Pin micro-batches (default: when CUDA is used).
            max_minibatches: Stop each iteration after this many mini-batches.
        """
        from knitdata.dataset import TrajectoryDataset

        return TrajectoryDataset(
            self,
            rank,
            fetch=fetch,
            collate=collate,
            media_collator=media_collator,
            prefetch_depth=prefetch_depth,
            device=device,
            pin_memory=pin_memory,
            max_minibatches=max_minibatches,
        )

    def metrics(self, rank: int) -> ConsumerMetrics:
        """Metrics of consumer ``rank`` (shared by its datasets)."""
        self._check_rank(rank)
        return self._metrics[rank]

    # internal API of TrajectoryDataset ----------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_consumers:
            raise ConfigError(f"rank must be an int in 0..{self.num_consumers - 1}, got {rank!r}")

    def _claim(self, rank: int, it: Any) -> None:
        """Register ``it`` as the one live iterator of ``rank`` (two would hand out the same micro-batches)."""
        with self._cond:
            ref = self._iterators[rank]
            cur = ref() if ref is not None else None
            if cur is not None and cur is not it and not cur.done:
                raise EngineError(
                    f"rank {rank} is already being iterated by another live iterator; each rank has one consumer: "
                    "finish or close() the other dataset/iterator first (a dataset's new iter() closes its own "
                    "previous one)"
                )
            self._iterators[rank] = weakref.ref(it)

    def _unclaim(self, rank: int, it: Any) -> None:
        with self._cond:
            ref = self._iterators[rank]
            if ref is not None and ref() in (it, None):
                self._iterators[rank] = None

    def _get_position(self, rank: int) -> tuple[int, int]:
        with self._cond:
            return self._position[rank]

    def _wait_plan(self, step: int, stop: threading.Event | None = None, poll_s: float = 0.05) -> MiniBatchPlan | None:
        """The first plan with minibatch >= ``step``; ``None`` once closed and drained (or ``stop`` set)."""
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                if step < self._first_open_step:
                    raise ValidationError(
                        f"mini-batch {step} was already consumed by every rank and forgotten; resume from a newer "
                        "state, or build a new pipeline and feed it the same puts",
                        field="step",
                    )
                if step <= self._last_step:
                    for s in range(step, self._last_step + 1):
                        plan = self._plans.get(s)
                        if plan is not None:
                            return plan
                if self._closed or (stop is not None and stop.is_set()):
                    return None
                self._cond.wait(poll_s)

    def _fetch(
        self, metas: Sequence[TrajectoryMeta], rank: int, per_trajectory: bool
    ) -> tuple[list[Trajectory], int, int, int]:
        """Payloads of ``metas`` in order: one request per unit, or per trajectory.

        Returns:
            ``(trajectories, bytes, local bytes, requests)``.
        """
        local_units = self._local_units[rank]
        requests = 0
        if per_trajectory:
            trajs = [self._units[m.location].get((m.id,))[0] for m in metas]  # type: ignore[index]
            requests = len(metas)
        else:
            by_unit: dict[str, list[str]] = {}
            for m in metas:
                by_unit.setdefault(m.location, []).append(m.id)  # type: ignore[arg-type]
            if len(by_unit) == 1:
                ((u, ids),) = by_unit.items()
                trajs = self._units[u].get(ids)
            else:
                out: dict[str, Trajectory] = {}
                for u, ids in by_unit.items():
                    for t in self._units[u].get(ids):
                        out[t.id] = t
                trajs = [out[m.id] for m in metas]
            requests = len(by_unit)
        nbytes = local = 0
        for m in metas:
            nbytes += m.nbytes
            if m.location in local_units:
                local += m.nbytes
        return trajs, nbytes, local, requests

    def _commit(self, rank: int, pmb: PlannedMicroBatch) -> None:
        """Consumer ``rank`` handed out ``pmb``: move the rank's position past it and release per ``release``."""
        nxt = (pmb.minibatch + 1, 0) if pmb.is_last else (pmb.minibatch, pmb.microbatch + 1)
        with self._cond:
            if self.release == "handout":
                self._release_locked(pmb.trajectories)
            else:
                held = self._held[rank]
                if self.release == "step" and pmb.microbatch == 0:
                    self._commit_held_locked(rank, (pmb.minibatch, 0))
                if not held or (held[-1].minibatch, held[-1].microbatch) < (pmb.minibatch, pmb.microbatch):
                    held.append(pmb)
            v = self._version
            self._staleness.extend(v - m.gen_version for m in pmb.trajectories)
            if nxt > self._position[rank]:
                self._position[rank] = nxt
                if pmb.is_last:
                    self._gc_locked()

    def _commit_upto(self, rank: int, position: tuple[int, int]) -> int:
        """Consumer ``rank`` committed ``position``: release its held micro-batches before it; returns how many."""
        with self._cond:
            n = self._commit_held_locked(rank, position)
            self._gc_locked()
            return n

    def _commit_held_locked(self, rank: int, position: tuple[int, int]) -> int:
        held = self._held[rank]
        n = 0
        while held and (held[0].minibatch, held[0].microbatch) < position:
            self._release_locked(held.popleft().trajectories)
            n += 1
        return n

    def _seek(self, rank: int, step: int, microbatch: int) -> None:
        """Position consumer ``rank`` at (step, microbatch); micro-batches before it are released (committed).

        Micro-batches at or after the position that were handed out but not committed stay held: a consumer
        restored from an earlier state receives them again (DESIGN.md §4: that is not a duplicate).
        """
        with self._cond:
            self._position[rank] = (step, microbatch)
            self._commit_held_locked(rank, (step, microbatch))
            for plan in self._plans.values():
                self._release_skipped_locked(plan, rank)
            self._gc_locked()

    # ------------------------------------------------------------------ internals (lock held)
    def _check_open(self) -> None:
        if self._closed:
            raise PipelineClosedError("the pipeline is closed (end of stream); build a new Pipeline to continue")
        if self._error is not None:
            raise PipelineClosedError(f"the pipeline stopped after an admission error: {self._error}") from self._error

    def _fail(self, e: BaseException) -> None:
        self._error = e
        self._cond.notify_all()

    def _drop_unadmitted(self, metas: Sequence[TrajectoryMeta]) -> None:
        self._release_locked(metas)

    def _release_locked(self, metas: Sequence[TrajectoryMeta]) -> None:
        by_unit: dict[str, list[str]] = {}
        placed: dict[str, int] = {}
        for m in metas:
            live = self._live.pop(m.id, None)
            self._loss.pop(m.id, None)
            if m.location is not None:
                by_unit.setdefault(m.location, []).append(m.id)
                if live is not None:  # un-place each payload once, by its bytes (spilled ones included)
                    placed[m.location] = placed.get(m.location, 0) + m.nbytes
        for u, ids in by_unit.items():
            self._units[u].release(ids)
        for u, nbytes in placed.items():
            self._placement.released(u, nbytes)

    def _release_skipped_locked(self, plan: MiniBatchPlan, rank: int) -> None:
        pos = self._position[rank]
        held = {(h.minibatch, h.microbatch) for h in self._held[rank]}
        for pmb in plan.microbatches[rank]:
            if (pmb.minibatch, pmb.microbatch) < pos and (pmb.minibatch, pmb.microbatch) not in held:
                self._release_locked(pmb.trajectories)

    def _gc_locked(self) -> None:
        # keep the plans of held (uncommitted) micro-batches: a restore may ask for them again
        low = min([p[0] for p in self._position] + [h[0].minibatch for h in self._held if h])
        for s in [s for s in self._plans if s < low]:
            del self._plans[s]
        self._first_open_step = max(self._first_open_step, min(low, self._last_step + 1))

    def _poll_locked(self) -> None:
        try:
            admitted = self._policy.poll(time.monotonic())
        except KnitdataError as e:
            self._fail(e)
            raise
        planned: list[tuple[AdmittedMiniBatch, MiniBatchPlan]] = []
        for mb in admitted:
            plan = self._planner.plan(mb, self._loss)
            if mb.step <= self._last_step:
                raise AssertionError(f"admission emitted step {mb.step} after {self._last_step}")
            self._plans[mb.step] = plan
            self._last_step = mb.step
            self._counts["admitted_minibatches"] += 1
            self._counts["admitted_trajectories"] += len(mb.trajectories)
            for m in mb.trajectories:
                self._placement.forget_group(m.group)
            for r in range(self.num_consumers):
                self._release_skipped_locked(plan, r)
            planned.append((mb, plan))
        if admitted:
            self._gc_locked()
            self._cond.notify_all()
        if self._on_plan is not None:  # after every plan is registered: a failing hook loses no mini-batch
            for mb, plan in planned:
                self._on_plan(mb, plan)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """JSON-serializable counters: storage per unit, admission, staleness, per-consumer metrics."""
        with self._cond:
            ready = self._policy.ready_counts()
            out = {
                "engine": self.engine,
                "closed": self._closed,
                "version": self._version,
                **self._counts,
                "held_trajectories": len(self._live),
                "ready_not_admitted": ready,
                "plans_open": len(self._plans),
                "release": self.release,
                "held_microbatches": [len(h) for h in self._held],
                "positions": [list(p) for p in self._position],
                "staleness": summarize(self._staleness),
                "version_interval_s": summarize(
                    b - a for a, b in zip(list(self._version_times), list(self._version_times)[1:])
                ),
            }
        out["units"] = {u: unit.stats().to_dict() for u, unit in self._units.items()}
        out["consumers"] = [m.to_dict() for m in self._metrics]
        return out

    def __repr__(self) -> str:
        return (
            f"Pipeline(engine={self.engine!r}, consumers={self.num_consumers}, nodes={list(self.layout.nodes)}, "
            f"capacity_bytes={self.capacity_bytes}, closed={self._closed})"
        )
