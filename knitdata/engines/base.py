"""What every engine provides to the pipeline and the datasets (:class:`Engine`), and the engines by name.

An engine is chosen by name (``Pipeline(engine=name)``): :data:`ENGINES` (a :class:`~knitdata.registry.Registry`)
imports the class registered under that name, and the pipeline builds it with :meth:`Engine.build`. What differs between
engines is said by the class (its capabilities, declared here with refusing defaults: :attr:`Engine.in_process`,
:attr:`Engine.supports_worker_processes`, :attr:`Engine.shutdown_on_exit`, :attr:`Engine.copy_free_reads`,
:meth:`Engine.recoverable`, :meth:`Engine.kill_unit`, :meth:`Engine.local_plane`) and done by its methods, never by
checking its name.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from knitdata.consumer.fetch import FetchMode
from knitdata.consumer.handoff import HEARTBEAT_S, ControlSender
from knitdata.control.plane import Control, ControlPlane
from knitdata.control.records import ItemRef
from knitdata.errors import ConfigError, EngineError, ValidationError
from knitdata.observe.metrics import ConsumerMetrics, TransferMeter
from knitdata.placement import ConsumerLayout
from knitdata.record import Trajectory
from knitdata.registry import Registry
from knitdata.storage.base import StorageUnit

__all__ = ["Engine", "ENGINES"]

#: The engine classes by name (``Pipeline(engine=name)``), imported when first chosen: ``"embedded"`` and ``"ray"``,
#: then any registered since (``ENGINES.register_lazy(name, "module:Class")`` or ``ENGINES.register(name, cls)``).
ENGINES: Registry[type[Engine]] = Registry("engine", accepts=lambda e: isinstance(e, type) and issubclass(e, Engine))
ENGINES.register_lazy("embedded", "knitdata.engines.embedded.engine:EmbeddedEngine")
ENGINES.register_lazy("ray", "knitdata.engines.ray.engine:RayEngine")


class Engine(abc.ABC):
    """One pipeline's storage units and the handle on its control plane.

    ``control`` is the control plane's parts (:class:`knitdata.control.plane.Control`): the plane's own parts
    (embedded) or proxies of the same types whose calls go to the coordinator actor (Ray); arguments and results
    are JSON-like. ``reporting.report_consumer`` may return before it takes effect. Consumers' hand-outs, commits
    and lease renewals go through :attr:`sender`, off the trainer's thread.

    Attributes:
        kind: The engine's name (``"embedded"`` or ``"ray"``), for messages and reports.
        name: The pipeline's name (how other processes attach; ``None`` for the embedded engine).
        address: The cluster address other processes attach at (``None``: the pipeline lives in one process).
        meter: This process's transfer counters not yet sent to the control plane (``None``: the engine counts no
            transfers).
        layout: Consumers by node.
        config: The control plane's options (JSON-like).
        supports_worker_processes: Whether a dataset may run in DataLoader worker processes.
        in_process: Whether the control plane (its planner, admission policy and placement objects) lives in this
            process, so that a pipeline may hand it objects and show it.
        shutdown_on_exit: Whether the pipeline's creator shuts the engine down when its ``with`` block ends (the
            engine holds resources beyond the process: actors), rather than only closing the pipeline.
        copy_free_reads: Whether :meth:`read` hands over the stored objects themselves (no copy, no request to
            another process): reading a worker's share of a mini-batch at once then costs no more than reading it
            micro-batch by micro-batch, and saves a read per micro-batch (see :meth:`FetchMode.reads_share`).
    """

    kind: str = ""
    name: str | None = None
    address: str | None = None
    meter: TransferMeter | None = None
    supports_worker_processes: bool = False
    in_process: bool = False
    shutdown_on_exit: bool = False
    copy_free_reads: bool = False
    #: Seconds between the lease renewals of this process's consumers (how fast an older iterator lets go).
    heartbeat_s: float = HEARTBEAT_S
    #: The control plane's parts (in this process, or proxies of the same types): set by the engine when it is
    #: built (an attribute, not a property: a control call is the part's method, with no frame before it).
    control: Control

    def __init__(self, layout: ConsumerLayout, config: Mapping[str, Any]) -> None:
        self.layout = layout
        self.config = dict(config)
        self._metrics = [ConsumerMetrics(r) for r in range(layout.num_consumers)]
        self._sender: ControlSender | None = None
        self._version_listeners: list[Callable[[int, float], None]] = []

    @classmethod
    @abc.abstractmethod
    def build(cls, layout: ConsumerLayout, config: Mapping[str, Any], capacity_bytes: int, *,
              spill_dir: str | os.PathLike[str] | None, spill_bytes: int, policy: Any, on_plan: Any,
              options: Mapping[str, Any]) -> Engine:
        """A new pipeline's engine (``Pipeline(engine=...)``), its ``engine_options`` checked first.

        Raises:
            ConfigError: Options this engine does not take.
        """

    @classmethod
    def attach(cls, name: str, *, address: str | None = None, loopback_only: bool = True,
               timeout_s: float = 60.0) -> Engine:
        """A handle on the running pipeline ``name`` (``Pipeline.attach``), for engines that serve other processes.

        Raises:
            EngineError: This engine's pipelines live in one process.
        """
        raise EngineError(f"a pipeline of the {cls.kind} engine lives in one process: other processes cannot attach")

    @property
    def sender(self) -> ControlSender:
        """This process's :class:`~knitdata.consumer.handoff.ControlSender` of the pipeline (made on first use)."""
        if self._sender is None:
            self._sender = ControlSender(self.control.leasing, heartbeat_s=self.heartbeat_s, inline=self.in_process)
        return self._sender

    @property
    @abc.abstractmethod
    def units(self) -> Mapping[str, StorageUnit]:
        """The storage units by id."""

    def report_version(self, version: int) -> None:
        """Send the trainer's new policy version (:meth:`knitdata.Pipeline.report_version`) through :attr:`sender`,
        then call this process's version listeners.

        Raises:
            ValidationError: Not a non-negative int.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValidationError(f"version must be a non-negative int, got {version!r}", field="version")
        self.sender.report_version(version)
        now = time.monotonic()
        for fn in list(self._version_listeners):  # a copy: a listener may be added meanwhile
            fn(version, now)

    def add_version_listener(self, fn: Callable[[int, float], None]) -> None:
        """Call ``fn(version, monotonic_time)`` on every :meth:`report_version` of this process."""
        self._version_listeners.append(fn)

    def flush_reports(self) -> None:
        """Send what this process's consumers queued for the control plane (hand-outs, commits, version) now."""
        if self._sender is not None:
            self._sender.flush()

    @property
    def num_consumers(self) -> int:
        """Number of consumer ranks."""
        return self.layout.num_consumers

    def set_layout(self, layout: ConsumerLayout) -> None:
        """The control plane was reshaped onto ``layout`` (:meth:`knitdata.Pipeline.reshape`): ranks and metrics
        follow it in this process."""
        old = self._metrics
        self.layout = layout
        self.config["layout"] = layout.to_dict()
        self._metrics = [old[r] if r < len(old) else ConsumerMetrics(r) for r in range(layout.num_consumers)]

    def reshape(self, states: Sequence[Any], layout: ConsumerLayout | int | None = None) -> dict[str, Any]:
        """Continue on ``layout`` (or that many ranks on its first node; ``None``: the same layout) from the states
        of all the stopped old ranks (:meth:`knitdata.Pipeline.reshape`); returns their merged state.

        Raises:
            StateError: An incomplete or inconsistent set of states.
        """
        from knitdata.control.rankstates import merge_rank_states

        merged = merge_rank_states(states)
        new = layout if isinstance(layout, ConsumerLayout) else self.layout if layout is None else \
            ConsumerLayout.single_node(layout, self.layout.nodes[0])
        self.control.reshaping.reshape(merged, new.to_dict())
        self.set_layout(new)
        return merged

    @property
    def release(self) -> str:
        """The release mode."""
        return str(self.config.get("release", "step"))

    def metrics(self, rank: int) -> ConsumerMetrics:
        """This process's metrics of consumer ``rank``.

        Raises:
            ConfigError: ``rank`` is not one of the layout's ranks.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self._metrics):
            raise ConfigError(f"rank must be an int in 0..{len(self._metrics) - 1}, got {rank!r}")
        return self._metrics[rank]

    def local_units(self, rank: int) -> frozenset[str]:
        """The units on the node of ``rank``."""
        node = self.layout.node_of(rank)
        return frozenset(u for u, unit in self.units.items() if unit.node == node)

    @abc.abstractmethod
    def read(self, items: Sequence[ItemRef], *, fetch: FetchMode, step: int) -> list[Trajectory]:
        """Payloads of ``items`` (the :class:`~knitdata.control.records.ItemRef` s of plan entries) in order, decoded.

        Each group of ``fetch.groups(items)`` is read with one request per unit; bytes are counted under
        ``fetch.name`` and ``step``.

        Raises:
            TrajectoryLostError: Naming every payload that could be neither read nor recovered.
        """

    def report_consumer(self, rank: int, stats: Mapping[str, Any]) -> None:
        """A consumer's iterator ended: report its metrics and this process's transfer counters."""
        self.control.reporting.report_consumer(rank, dict(stats))
        self.flush_meter()

    def stats(self) -> dict[str, Any]:
        """The pipeline's JSON-serializable counters: the control plane's (this process's reports sent first), each
        unit's (``None`` for a dead one), each consumer's (this process's metrics where it consumed, else the
        last reported), and the transfer counters (with this process's not sent yet)."""
        self.flush_reports()
        out = {"engine": self.kind, **self.control.reporting.stats()}
        units: dict[str, Any] = {}
        for u, unit in self.units.items():
            try:
                units[u] = unit.stats().to_dict()
            except Exception:  # noqa: BLE001 - a dead unit's actor (any error of the call)
                units[u] = None
        out["units"] = units
        reported = out.pop("consumers", None) or []
        local = [self.metrics(r).to_dict() for r in range(self.num_consumers)]
        out["consumers"] = [loc if loc["microbatches"] or not (i < len(reported) and reported[i]) else reported[i]
                            for i, loc in enumerate(local)]
        if self.meter is not None:  # this process's counters not flushed yet, plus what others reported
            total = TransferMeter()
            total.merge(out.get("transfer") or {})
            total.merge(self.meter.to_dict())
            out["transfer"] = total.to_dict()
        return out

    def recoverable(self, unit_ids: Sequence[str], ids: Sequence[str]) -> list[str]:
        """The ids of ``ids`` that the (dead) units ``unit_ids`` can still give back (from their spill); none by
        default (an engine whose lost units leave their spill behind overrides it)."""
        return []

    def kill_unit(self, unit_id: str) -> None:
        """Kill one storage unit (failure drills and tests).

        Raises:
            EngineError: This engine's units cannot be killed (the default).
        """
        raise EngineError(f"kill_unit is a failure drill of engines with unit processes, not of the {self.kind} "
                          "engine")

    def local_plane(self) -> ControlPlane:
        """The control plane object itself, for engines whose plane lives in this process (:attr:`in_process`).

        Raises:
            EngineError: The plane lives in another process (the default).
        """
        raise EngineError(f"the control plane of the {self.kind} engine lives in another process; read stats()")

    def flush_meter(self) -> None:  # noqa: B027 - optional
        """Send this process's transfer counters to the control plane (engines that count them)."""

    def close_units(self) -> None:
        """Refuse further puts on every unit (producers waiting for room wake up)."""
        for unit in self.units.values():
            unit.close()

    def on_close(self) -> None:  # noqa: B027 - optional
        """The pipeline was closed (end of stream) in this process: what the engine does beyond the control plane."""

    def flush_trace(self) -> None:
        """Write the trace events recorded so far by this process (and, on engines with servers, by them)."""
        from knitdata.observe import trace

        if trace.tracer is not None:
            trace.tracer.flush()

    def shutdown(self) -> None:  # noqa: B027 - optional
        """Release what the engine holds beyond the pipeline's life (actors)."""
