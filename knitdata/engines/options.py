"""A new pipeline's options, declared once, checked and turned into its engine (:class:`PipelineOptions`).

:class:`~knitdata.pipeline.Pipeline` keeps a real signature (its keywords and defaults are these fields';
``tests/test_pipeline.py`` checks that they cannot drift apart) and builds its engine with
:meth:`PipelineOptions.build`: every option is checked here, in the creating process, before an engine (or an
actor) exists, and the control plane's config is made from them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from knitdata.admission import AdmissionPolicy, AdmittedMiniBatch, BatchSpec, make_policy
from knitdata.control import PLANE_DEFAULTS, RELEASE_MODES
from knitdata.engines.base import ENGINES, Engine
from knitdata.errors import ConfigError
from knitdata.observe import trace as tracing
from knitdata.placement import PLACEMENTS, ConsumerLayout, Placement, make_placement
from knitdata.planner import MiniBatchPlan

__all__ = ["PipelineOptions"]


def _number(value: object, *, positive_int: bool = False) -> bool:
    if isinstance(value, bool):
        return False
    if positive_int:
        return isinstance(value, int) and value > 0
    return isinstance(value, (int, float)) and value >= 0


@dataclass(frozen=True)
class PipelineOptions:
    """How a new pipeline is built: the keywords of :class:`~knitdata.pipeline.Pipeline` after ``spec``, declared
    once (names, types, defaults, documentation and checks).

    Attributes:
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
            :meth:`~knitdata.consumer.dataset.TrajectoryDataset.commit` (after saving its state); payloads before a
            committed position are released. ``"step"``: also commit automatically when the rank starts its next
            mini-batch (one iterator per rank; with DataLoader worker processes only explicit commits count), so a
            consumer that crashes mid-step and restores its last step-boundary state receives that step again.
            ``"commit"``: explicit commits only. ``"handout"``: release as soon as a micro-batch is handed out (the
            least memory; a restore then needs a new pipeline fed the same puts).
        producer_timeout_s: Seconds consumers keep waiting for data once every producer stopped without
            :meth:`~knitdata.pipeline.Pipeline.close`: its threads that put ended, or its process died (no report for
            :data:`~knitdata.control.plane.PRODUCER_TTL_S`). Then they raise
            :class:`~knitdata.errors.IncompleteStreamError` naming the producers and what admission waits for.
            ``None``: wait (up to the dataset's ``timeout``). A handle counts as a producer from its first put.
        check_media: Decode every encoded media item once at :meth:`~knitdata.pipeline.Pipeline.put` (in the
            producer) and refuse bad ones.
        on_plan: Called as ``on_plan(admitted, plan)`` for each planned mini-batch (embedded engine; keep it cheap).
        max_staleness: Admit nothing staler than this many versions, as the trainer reports them
            (:meth:`~knitdata.pipeline.Pipeline.report_version`); an int or ``{source: int}`` (every source);
            ``None``: no bound (docs/concepts.md, "A hard staleness bound").
        on_stale: ``"drop"`` (:meth:`~knitdata.pipeline.Pipeline.dropped` lists what to regenerate) or ``"wait"``
            (also :meth:`~knitdata.pipeline.Pipeline.acquire_rollout`; needs ``max_staleness``).
        version_offset: The trainer's version at its first step, for the bound; ``None`` (default): learned from
            the first :meth:`~knitdata.pipeline.Pipeline.report_version` (see docs/concepts.md).
        media_dedup: Keep one copy of each media item per storage unit (by content digest) with counted references,
            and resolve a producer's :meth:`MediaItem.ref <knitdata.record.MediaItem.ref>` at put (docs/concepts.md,
            "Media stored once"). ``False``: every trajectory stores its own copy of its media, as before (the
            per-trajectory-copies baseline; references are then refused). Config key ``"media_dedup"``.
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
            :meth:`~knitdata.pipeline.Pipeline.shutdown` or ``knitdata trace PATH`` (Chrome trace-event JSON;
            :mod:`knitdata.observe.trace`).

    Example:
        >>> from knitdata.admission import BatchSpec
        >>> engine = PipelineOptions(num_consumers=2).build(BatchSpec({"a": 4}, num_minibatches=2))
        >>> engine.kind, engine.num_consumers, engine.config["placement"]
        ('embedded', 2, 'consumer_aware')
    """

    admission: str | AdmissionPolicy = "constraint_preserving"
    admission_options: Mapping[str, Any] | None = None
    layout: ConsumerLayout | None = None
    num_consumers: int | None = None
    engine: str = "embedded"
    capacity_bytes: int = 1 << 30
    token_budget: int = 8192
    placement: str | Placement = "consumer_aware"
    allow_split_groups: bool = False
    balance_tolerance: float = 0.1
    put_timeout: float | None = 60.0
    spill_dir: str | os.PathLike[str] | None = None
    spill_bytes: int = 16 << 30
    release: str = "step"
    producer_timeout_s: float | None = 15.0
    check_media: bool = True
    on_plan: Callable[[AdmittedMiniBatch, MiniBatchPlan], None] | None = None
    engine_options: Mapping[str, Any] | None = None
    max_staleness: int | Mapping[str, int] | None = None
    on_stale: str = "drop"
    trace: str | os.PathLike[str] | None = None
    version_offset: int | None = None
    media_dedup: bool = True

    def checked_layout(self) -> ConsumerLayout:
        """The consumer layout: ``layout``, or ``num_consumers`` ranks on one node.

        Raises:
            ConfigError: Not a layout, or ``num_consumers`` disagrees with it.
        """
        layout, n = self.layout, self.num_consumers
        if layout is None:
            return ConsumerLayout.single_node(1 if n is None else n)
        if not isinstance(layout, ConsumerLayout):
            raise ConfigError(f"layout must be a knitdata.placement.ConsumerLayout (e.g. ConsumerLayout(['node0', "
                              f"'node0'])), got {type(layout).__name__}")
        if n is not None and n != layout.num_consumers:
            raise ConfigError(f"num_consumers={n} disagrees with the layout's {layout.num_consumers} ranks")
        return layout

    def config(self, spec: BatchSpec, engine_cls: type[Engine]) -> tuple[dict[str, Any], AdmissionPolicy | None]:
        """The control plane's config (JSON-like) and the admission policy object given, if any.

        Raises:
            ConfigError: An inconsistent or bad option (named).
        """
        if not isinstance(self.media_dedup, bool):
            raise ConfigError(f"media_dedup must be a bool, got {self.media_dedup!r}")
        if self.release not in RELEASE_MODES:
            raise ConfigError(f"release must be one of {RELEASE_MODES}, got {self.release!r}")
        for name, value, ok in (
                ("producer_timeout_s", self.producer_timeout_s, self.producer_timeout_s is None
                 or _number(self.producer_timeout_s)),
                ("balance_tolerance", self.balance_tolerance, _number(self.balance_tolerance)),
                ("token_budget", self.token_budget, _number(self.token_budget, positive_int=True)),
                ("capacity_bytes", self.capacity_bytes, _number(self.capacity_bytes, positive_int=True))):
            if not ok:
                what = "a positive int" if name in ("token_budget", "capacity_bytes") else \
                    "a non-negative number" + (" of seconds or None" if name == "producer_timeout_s" else "")
                raise ConfigError(f"{name} must be {what}, got {value!r}")
        layout = self.checked_layout()
        admission, options = self.admission, dict(self.admission_options or {})
        if self.max_staleness is not None or self.on_stale != "drop" or self.version_offset is not None:
            if isinstance(admission, AdmissionPolicy):
                raise ConfigError("max_staleness / on_stale / version_offset apply to an admission given by name (or "
                                  "build the policy with them)")
            bound = self.max_staleness
            options = {**options, "max_staleness": dict(bound) if isinstance(bound, Mapping) else bound,
                       "on_stale": self.on_stale, "version_offset": options.get("version_offset", self.version_offset)}
        policy: AdmissionPolicy | None = None
        if isinstance(admission, AdmissionPolicy):
            if options:
                raise ConfigError("admission_options only apply when admission is given by name")
            if admission.spec != spec:
                raise ConfigError("the admission policy was built on a different BatchSpec")
            policy, admission_name = admission, admission.name or type(admission).__name__
        else:
            make_policy(admission, spec, **options)  # validates here, not in an actor
            admission_name = admission
        placement = self.placement
        if isinstance(placement, Placement):
            if not engine_cls.in_process or placement.name not in PLACEMENTS \
                    or type(placement) is not PLACEMENTS.get(placement.name):
                raise ConfigError(f"give the placement by name (one of {PLACEMENTS.names()})")
            placement_name = placement.name
        else:
            make_placement(placement, list(layout.nodes))
            placement_name = placement
        config = {**PLANE_DEFAULTS, "spec": spec.to_dict(), "layout": layout.to_dict(), "admission": admission_name,
                  "admission_options": options, "token_budget": self.token_budget, "placement": placement_name,
                  "allow_split_groups": bool(self.allow_split_groups),
                  "balance_tolerance": float(self.balance_tolerance), "release": self.release,
                  "producer_timeout_s": None if self.producer_timeout_s is None else float(self.producer_timeout_s),
                  "media_dedup": self.media_dedup}
        return config, policy

    def build(self, spec: BatchSpec) -> Engine:
        """Check every option and build the new pipeline's engine (with a trace, start this process's tracing).

        Raises:
            ConfigError: A bad or inconsistent option (named), or an unknown engine.
            OptionalDependencyError: The engine's package (``ray``) is not installed.
        """
        if not isinstance(spec, BatchSpec):
            raise ConfigError(f"spec must be a knitdata.admission.BatchSpec, got {type(spec).__name__}")
        engine_cls = ENGINES.get(self.engine)
        config, policy = self.config(spec, engine_cls)
        layout = self.checked_layout()
        opts = dict(self.engine_options or {})
        opts.pop("cross_process", None)  # every Ray pipeline serves other processes now
        trace_path = os.fspath(self.trace) if self.trace is not None else os.environ.get(tracing.ENV) or None
        if trace_path is not None:
            # this process merges the trace when its tracing ends too (its exit), with what every process wrote
            tracing.start(trace_path, "main" if engine_cls.in_process else "driver").merge_on_close = True
            if not engine_cls.in_process:
                opts["trace"] = trace_path  # the coordinator and the units trace too; attaching processes follow
        return engine_cls.build(layout, config, self.capacity_bytes, spill_dir=self.spill_dir,
                                spill_bytes=self.spill_bytes, policy=policy, on_plan=self.on_plan, options=opts)
