"""What every engine provides to the pipeline and the datasets (:class:`Engine`)."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

from knitdata.handoff import HEARTBEAT_S, ControlSender
from knitdata.metrics import ConsumerMetrics
from knitdata.placement import ConsumerLayout
from knitdata.record import Trajectory
from knitdata.storage.base import StorageUnit

__all__ = ["Engine", "ENGINES"]

#: The engines :class:`knitdata.pipeline.Pipeline` knows.
ENGINES: tuple[str, ...] = ("embedded", "ray")


class Engine(abc.ABC):
    """One pipeline's storage units and the handle on its control plane.

    ``control`` has the methods of :class:`knitdata.control.ControlPlane` with the same arguments and results
    (JSON-like), called directly (embedded) or forwarded to the coordinator actor (Ray). ``report_consumer``
    may return before it takes effect. Consumers' hand-outs, commits and lease renewals go through
    :attr:`sender`, off the trainer's thread.

    Attributes:
        kind: ``"embedded"`` or ``"ray"``.
        name: The pipeline's name (how other processes attach; ``None`` for the embedded engine).
        layout: Consumers by node.
        config: The control plane's options (JSON-like).
        supports_worker_processes: Whether a dataset may run in DataLoader worker processes.
    """

    kind: str = ""
    name: str | None = None
    supports_worker_processes: bool = False
    #: Seconds between the lease renewals of this process's consumers (how fast an older iterator lets go).
    heartbeat_s: float = HEARTBEAT_S

    def __init__(self, layout: ConsumerLayout, config: Mapping[str, Any]) -> None:
        self.layout = layout
        self.config = dict(config)
        self._metrics = [ConsumerMetrics(r) for r in range(layout.num_consumers)]
        self._sender: ControlSender | None = None

    @property
    def sender(self) -> ControlSender:
        """This process's :class:`~knitdata.handoff.ControlSender` of the pipeline (made on first use)."""
        if self._sender is None:
            self._sender = ControlSender(self.control, heartbeat_s=self.heartbeat_s)
        return self._sender

    @property
    @abc.abstractmethod
    def control(self) -> Any:
        """The control plane (or a forwarder with its methods)."""

    @property
    @abc.abstractmethod
    def units(self) -> Mapping[str, StorageUnit]:
        """The storage units by id."""

    def flush_reports(self) -> None:
        """Send what this process's consumers queued for the control plane (hand-outs, commits, version) now."""
        if self._sender is not None:
            self._sender.flush()

    @property
    def num_consumers(self) -> int:
        """Number of consumer ranks."""
        return self.layout.num_consumers

    @property
    def release(self) -> str:
        """The release mode."""
        return str(self.config.get("release", "step"))

    def metrics(self, rank: int) -> ConsumerMetrics:
        """This process's metrics of consumer ``rank``."""
        return self._metrics[rank]

    def local_units(self, rank: int) -> frozenset[str]:
        """The units on the node of ``rank``."""
        node = self.layout.node_of(rank)
        return frozenset(u for u, unit in self.units.items() if unit.node == node)

    @abc.abstractmethod
    def read(self, items: Sequence[Sequence[Any]], *, mode: str, step: int) -> list[Trajectory]:
        """Payloads of ``items`` (``[id, unit, nbytes]`` entries of a plan) in order, one request per unit.

        Raises:
            TrajectoryLostError: Naming every payload that could be neither read nor recovered.
        """

    def close_units(self) -> None:
        """Refuse further puts on every unit (producers waiting for room wake up)."""
        for unit in self.units.values():
            unit.close()

    def shutdown(self) -> None:  # noqa: B027 - optional
        """Release what the engine holds beyond the pipeline's life (actors)."""
