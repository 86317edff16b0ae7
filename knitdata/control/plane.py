"""The one control plane: admission, placement, planning, commits and release, on metadata only.

:class:`ControlPlane` is engine-neutral. The embedded engine calls it directly in the pipeline's process;
the Ray engine hosts the very same class inside one coordinator actor and forwards calls to it. Every
argument and return value is JSON-like (dicts, lists, strings, numbers), so the two engines cannot drift.
Payload bytes never pass through it: a storage unit holds them, and the plane asks the engine to drop
them through the ``releaser`` callback it was given.

The plane is a facade over parts of one concern each, sharing one :class:`~knitdata.control.state.PlaneState`:

* :class:`~knitdata.control.admit.Admission` (``plane.admission``): puts, admission and planning, withdrawals,
  in-flight counts, end of stream;
* :class:`~knitdata.control.positions.Positions` (``plane.positions``): hand-outs, commits, restores, replay
  fingerprints, the trainer's version;
* :class:`~knitdata.control.leases.Leases` (``plane.leasing``): one live iterator per rank, the entries it takes,
  consumer processes' reports;
* :class:`~knitdata.control.reporting.Reporting` (``plane.reporting``): counters and diagnostics;
* :class:`~knitdata.control.durability.Durability` (``plane.durability``): state, journal, recovery.

Its calls (:data:`SURFACE`) are the parts' own methods, declared once where each part defines them
(:func:`~knitdata.control.surface.control_call`): a caller reaches a call on its part (``plane.positions.commit``),
typed; :class:`Control` is what every engine's ``control`` provides (this plane, or on Ray a client whose parts
are proxies of the same types). The journal's operations (:data:`JOURNALED_OPS`) are the calls marked journaled.
The shared state is :attr:`ControlPlane.state`.

Example:
    >>> from knitdata import BatchSpec, ConsumerLayout
    >>> plane = ControlPlane({"spec": BatchSpec({"a": 2}, num_minibatches=1, group_size=1).to_dict(),
    ...                       "layout": ConsumerLayout.uniform(1, 1).to_dict()}, {"node0": "node0"},
    ...                       lambda unit, ids, wait: None)
    >>> plane.positions.report_version(3)
    >>> plane.reporting.stats()["version"], sorted(JOURNALED_OPS)[:3]
    (3, ['admit_batches', 'admit_many', 'close'])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

from knitdata.admission import AdmissionPolicy, AdmittedMiniBatch
from knitdata.control.admit import Admission
from knitdata.control.durability import Durability
from knitdata.control.journal import Journal
from knitdata.control.leases import Leases
from knitdata.control.ledger import Ledger
from knitdata.control.positions import Positions
from knitdata.control.reporting import Reporting
from knitdata.control.reshape import Reshaping
from knitdata.control.state import (
    LEASE_TTL_S,
    PLANE_DEFAULTS,
    PRODUCER_TTL_S,
    RELEASE_MODES,
    PlaneState,
    entry_fingerprint,
    fenced_message,
    fields_of,
)
from knitdata.control.surface import CONTROL_CALLS, ControlCall
from knitdata.errors import KnitdataError, StateError
from knitdata.planner import MiniBatchPlan
from knitdata.reclaim import Graveyard

__all__ = ["Control", "ControlPlane", "SURFACE", "JOURNALED_OPS", "FIRE_AND_FORGET", "RELEASE_MODES", "PLANE_DEFAULTS",
           "LEASE_TTL_S", "PRODUCER_TTL_S", "fenced_message", "entry_fingerprint", "fields_of"]

#: The parts of a plane by attribute name.
PARTS: dict[str, type] = {"admission": Admission, "positions": Positions, "leasing": Leases,
                          "reporting": Reporting, "ledger": Ledger,
                          "reshaping": Reshaping}
#: Every call of the control surface by name (declared by the parts).
SURFACE: Mapping[str, ControlCall] = MappingProxyType({n: c for n, c in CONTROL_CALLS.items() if c.part in PARTS})
#: The calls recorded in the journal (every call that can change the plane's state).
JOURNALED_OPS: frozenset[str] = frozenset(n for n, c in SURFACE.items() if c.journaled)
#: The calls a remote caller sends without waiting for a result.
FIRE_AND_FORGET: frozenset[str] = frozenset(n for n, c in SURFACE.items() if c.fire_and_forget)


class Control(Protocol):
    """The control plane as every engine's ``control`` provides it: its parts, each with its control calls.

    In process these are the plane's own parts (:class:`ControlPlane`); on another process proxies of the same
    types (:func:`~knitdata.control.surface.remote_part`). Only the calls marked with
    :func:`~knitdata.control.surface.control_call` are reachable through a proxy.
    """

    @property
    def admission(self) -> Admission:
        """Puts, admission and planning, withdrawals, in-flight counts, the staleness bound, end of stream."""

    @property
    def positions(self) -> Positions:
        """Hand-outs, commits, seeks, replay fingerprints, the trainer's version."""

    @property
    def leasing(self) -> Leases:
        """Leases of the ranks' iterators, the entries they take, consumer processes' reports."""

    @property
    def reporting(self) -> Reporting:
        """Counters and diagnostics."""

    @property
    def reshaping(self) -> Reshaping:
        """Layout history and reshapes."""

    @property
    def ledger(self) -> Ledger:
        """The rollout ledger and checkpoint cuts."""


class ControlPlane:
    """Admission, placement, planning, leases, commits and release of one pipeline. Thread-safe.

    Its control calls are those of :data:`SURFACE`, made on its parts (``plane.positions.commit(...)``); it
    provides :class:`Control`.

    Args:
        config: JSON-like options: ``spec`` (a :class:`~knitdata.admission.BatchSpec` dict), ``layout`` (a
            :class:`~knitdata.placement.ConsumerLayout` dict) and the keys of :data:`PLANE_DEFAULTS`.
        unit_nodes: ``{storage unit id: layout node}``, one unit per node.
        releaser: ``releaser(unit_id, ids, wait)`` drops payloads from a unit (called under the plane's lock:
            keep it non-blocking, e.g. an asynchronous actor call, unless ``wait`` is true).
        policy: An admission policy object to use instead of ``config["admission"]`` (in-process only).
        on_plan: Called as ``on_plan(admitted, plan)`` after each mini-batch is planned (in-process only).
        journal: Record every state-changing call here (:class:`~knitdata.control.journal.Journal`), so that
            :meth:`recover` can rebuild the state after a restart.
        graveyard: Keep what a release forgets (metadata, plan entries) there, to be freed later off the releasing
            thread (:class:`~knitdata.reclaim.Graveyard`; ``None``: freed at release). In-process only.

    Raises:
        ConfigError: Inconsistent options.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        unit_nodes: Mapping[str, str],
        releaser: Callable[[str, list[str], bool], Any],
        *,
        policy: AdmissionPolicy | None = None,
        on_plan: Callable[[AdmittedMiniBatch, MiniBatchPlan], None] | None = None,
        journal: Journal | None = None,
        graveyard: Graveyard | None = None,
    ) -> None:
        s = PlaneState(config, unit_nodes, releaser, policy=policy, on_plan=on_plan, journal=journal,
                       graveyard=graveyard)
        self.state = s
        self.admission = Admission(s)
        self.positions = Positions(s)
        self.leasing = Leases(s, self.positions)
        self.reporting = Reporting(s)
        self.reshaping = Reshaping(s)
        # a snapshot: the shared state's slice, then the replay marks', the admission part's, the observations' and
        # the reshape part's own
        self.durability = Durability(s, self._replay, JOURNALED_OPS,
                                     (s.replay, self.admission, s.observed, self.reshaping))
        self.ledger = Ledger(s, self.durability.state_dict, self.durability.load_state_dict)
        #: The journaled calls by name, bound to their parts (the journal records a call by its name).
        self._ops: dict[str, Callable[..., Any]] = {
            n: getattr(getattr(self, c.part), n) for n, c in SURFACE.items() if c.journaled}

    def _replay(self, op: str, args: list[Any]) -> Any:
        """Apply the journal record ``(op, args)`` (a call of :data:`JOURNALED_OPS`) to its part."""
        return self._ops[op](*args)

    def recover(self, path: str) -> int:
        """See :meth:`knitdata.control.durability.Durability.recover`."""
        return self.durability.recover(path)

    def compact(self) -> None:
        """See :meth:`knitdata.control.durability.Durability.compact`."""
        self.durability.compact()

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`knitdata.control.durability.Durability.state_dict`."""
        return self.durability.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """See :meth:`knitdata.control.durability.Durability.load_state_dict`."""
        self.durability.load_state_dict(state)

    @classmethod
    def from_state_dict(
        cls,
        state: Mapping[str, Any],
        releaser: Callable[[str, list[str], bool], Any],
        *,
        policy: AdmissionPolicy | None = None,
        on_plan: Callable[[AdmittedMiniBatch, MiniBatchPlan], None] | None = None,
        journal: Journal | None = None,
    ) -> ControlPlane:
        """A plane built from a :meth:`state_dict` alone (its configuration and units are in it).

        Raises:
            StateError: A malformed state.
        """
        if not isinstance(state, Mapping) or not isinstance(state.get("config"), Mapping) \
                or not isinstance(state.get("unit_nodes"), Mapping):
            raise StateError(f"not a control-plane snapshot (no config and unit_nodes): {str(state)[:200]}")
        try:
            plane = cls(state["config"], state["unit_nodes"], releaser, policy=policy, on_plan=on_plan,
                        journal=journal)
        except KnitdataError as e:
            raise StateError(f"the snapshot's configuration is invalid: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise StateError(f"the snapshot's configuration is malformed ({type(e).__name__}: {e})") from e
        plane.load_state_dict(state)
        return plane
