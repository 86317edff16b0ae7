"""Placement: which storage unit a put goes to, and the consumer layout (ranks by node).

Works on metadata only. There is one storage unit per node; a unit's id is its node's name.

* :class:`ConsumerAwarePlacement` spreads payloads by bytes over the training nodes' units and keeps the
  members of a group on one unit, so that the planner (which keeps groups whole) can give each group to a
  consumer on the node that holds it: reads stay local.
* :class:`IndexModPlacement` is the consumer-oblivious baseline of TransferQueue's SimpleStorage: the
  ``i``-th put goes to unit ``i % units``.
"""

from __future__ import annotations

import abc
import heapq
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from knitdata.errors import ConfigError, StateError
from knitdata.record import TrajectoryMeta
from knitdata.registry import Registry

__all__ = ["ConsumerLayout", "Placement", "ConsumerAwarePlacement", "IndexModPlacement", "PLACEMENTS", "make_placement"]


class ConsumerLayout:
    """Consumers (data-parallel ranks) grouped by node.

    Args:
        nodes_of_ranks: ``nodes_of_ranks[r]`` is the name of the node rank ``r`` runs on.

    Example:
        >>> layout = ConsumerLayout.uniform(num_nodes=2, ranks_per_node=4)
        >>> layout.node_of(5), layout.ranks_on("node1")
        ('node1', (4, 5, 6, 7))
    """

    def __init__(self, nodes_of_ranks: Sequence[str]) -> None:
        names = list(nodes_of_ranks)
        if not names:
            raise ConfigError("a consumer layout needs at least one rank")
        for n in names:
            if not isinstance(n, str) or not n:
                raise ConfigError(f"node names must be non-empty strings, got {n!r}")
            if n in (".", "..") or any(c in n for c in "/\\\0"):
                raise ConfigError(f"node name {n!r} must not contain '/', '\\' or NUL, nor be '.' or '..' "
                                  "(it names the node's spill directory)")
        self._node_of = tuple(names)
        self._nodes = tuple(dict.fromkeys(names))
        self._ranks = {n: tuple(r for r, m in enumerate(names) if m == n) for n in self._nodes}

    @classmethod
    def single_node(cls, num_consumers: int, node: str = "node0") -> ConsumerLayout:
        """All ``num_consumers`` ranks on one node."""
        if isinstance(num_consumers, bool) or not isinstance(num_consumers, int) or num_consumers <= 0:
            raise ConfigError(f"num_consumers must be a positive int, got {num_consumers!r}")
        return cls([node] * num_consumers)

    @classmethod
    def uniform(cls, num_nodes: int, ranks_per_node: int) -> ConsumerLayout:
        """``num_nodes`` nodes named ``node0..`` with ``ranks_per_node`` consecutive ranks each."""
        if num_nodes <= 0 or ranks_per_node <= 0:
            raise ConfigError(f"num_nodes and ranks_per_node must be positive, got {num_nodes}, {ranks_per_node}")
        return cls([f"node{r // ranks_per_node}" for r in range(num_nodes * ranks_per_node)])

    @property
    def num_consumers(self) -> int:
        """Number of ranks."""
        return len(self._node_of)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node names in order of first appearance."""
        return self._nodes

    def node_of(self, rank: int) -> str:
        """The node of ``rank``."""
        if not 0 <= rank < len(self._node_of):
            raise ConfigError(f"rank {rank} is outside 0..{len(self._node_of) - 1}")
        return self._node_of[rank]

    def ranks_on(self, node: str) -> tuple[int, ...]:
        """The ranks on ``node`` (empty if none)."""
        return self._ranks.get(node, ())

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return {"nodes_of_ranks": list(self._node_of)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ConsumerLayout:
        """Inverse of :meth:`to_dict`."""
        return cls(list(d["nodes_of_ranks"]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConsumerLayout) and other._node_of == self._node_of

    def __hash__(self) -> int:
        return hash(self._node_of)

    def __repr__(self) -> str:
        return f"ConsumerLayout({list(self._node_of)!r})"


class Placement(abc.ABC):
    """Chooses the storage unit of each put. Not thread-safe: the pipeline calls it under its lock.

    Args:
        units: Ids of the storage units, one per node, in layout order.
    """

    #: The name it is registered under in :data:`PLACEMENTS` (``Pipeline(placement=name)``).
    name: str = ""
    #: Whether the planner should prefer consumers on the node holding a payload.
    consumer_aware: bool = False

    def __init__(self, units: Sequence[str]) -> None:
        if not units:
            raise ConfigError("placement needs at least one storage unit")
        self.units = tuple(units)

    @abc.abstractmethod
    def place(self, meta: TrajectoryMeta) -> str:
        """Return the unit for ``meta`` (``meta.seq`` is its arrival index) and account it there."""

    def unplace(self, meta: TrajectoryMeta, unit: str) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`place` for a put that failed (e.g. ``StoreFull``)."""

    def place_at(self, meta: TrajectoryMeta, unit: str) -> None:
        """Account a payload a producer already stored on ``unit`` (the unit it chose from :meth:`view`).

        The one-round-trip put stores first and is admitted after: the producer keeps a replica of this
        placement (:meth:`follow` the last :meth:`view` it was sent, then :meth:`place`), so a single producer's
        puts land exactly where :meth:`place` would have put them; concurrent producers may pick a unit a
        little off balance, which is accounted where it is.

        Raises:
            ConfigError: An unknown unit.
        """
        if unit not in self.units:
            raise ConfigError(f"unknown storage unit {unit!r}; the units are {list(self.units)[:8]}")

    def view(self, limit: int = 64) -> dict[str, Any]:
        """What a producer's replica needs to predict :meth:`place` (JSON; at most ``limit`` units listed)."""
        return {}

    def follow(self, view: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Adopt the control plane's :meth:`view` (on a producer's replica)."""

    def released(self, unit: str, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Tell the placement that ``nbytes`` left ``unit``."""

    def forget_group(self, group: str) -> None:  # noqa: B027 - optional hook
        """Tell the placement that no more members of ``group`` will arrive."""

    def summary(self) -> dict[str, Any]:
        """A short JSON-serializable summary for reports (not a state: see :meth:`state_dict`)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The complete JSON-serializable state, from which :meth:`load_state_dict` continues identically."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (a stateless placement accepts ``{}`` only).

        Raises:
            StateError: A state of another shape.
        """
        if not isinstance(state, Mapping) or dict(state):
            raise StateError(f"{type(self).__name__} has no state; got {str(state)[:100]}")


class IndexModPlacement(Placement):
    """Baseline: the ``i``-th put goes to unit ``i % len(units)``, oblivious to consumers."""

    name = "index_mod"
    consumer_aware = False

    def place(self, meta: TrajectoryMeta) -> str:
        """Unit ``meta.seq % len(units)``."""
        if meta.seq < 0:
            raise ConfigError(f"IndexModPlacement needs the arrival index (seq) of {meta.id!r}")
        return self.units[meta.seq % len(self.units)]


class ConsumerAwarePlacement(Placement):
    """Spread by bytes over the units; members of a group follow the group's first member.

    The first member of a group goes to the unit with the fewest bytes placed so far (ties: layout order);
    later members go to the same unit. Released bytes are not subtracted: placement, and so every plan,
    depends on the puts alone, never on when consumers commit or restore. The group table is bounded (``max_groups`` most recent).

    Args:
        units: Unit ids (one per node).
        max_groups: Groups remembered at most.
    """

    name = "consumer_aware"
    consumer_aware = True

    def __init__(self, units: Sequence[str], *, max_groups: int = 65536) -> None:
        super().__init__(units)
        self._load = dict.fromkeys(self.units, 0)
        self._groups: OrderedDict[str, str] = OrderedDict()
        self._max_groups = max_groups

    def place(self, meta: TrajectoryMeta) -> str:
        """The group's unit, or the least-loaded unit by bytes."""
        unit = self._groups.get(meta.group)
        if unit is None:
            unit = min(self.units, key=lambda u: self._load[u])
            self._groups[meta.group] = unit
            while len(self._groups) > self._max_groups:
                self._groups.popitem(last=False)
        self._load[unit] += meta.nbytes
        return unit

    def unplace(self, meta: TrajectoryMeta, unit: str) -> None:
        """Undo the byte accounting of a failed put."""
        self._load[unit] -= meta.nbytes

    def place_at(self, meta: TrajectoryMeta, unit: str) -> None:
        """Account ``meta`` on ``unit``, where a producer stored it; a new group is remembered there."""
        super().place_at(meta, unit)
        if meta.group not in self._groups:
            self._groups[meta.group] = unit
            while len(self._groups) > self._max_groups:
                self._groups.popitem(last=False)
        self._load[unit] += meta.nbytes

    def view(self, limit: int = 64) -> dict[str, Any]:
        """``{"load": {unit: bytes placed}}`` of the ``limit`` least-loaded units (ties: layout order)."""
        if len(self.units) <= limit:
            return {"load": dict(self._load)}
        order = {u: i for i, u in enumerate(self.units)}
        best = heapq.nsmallest(limit, self.units, key=lambda u: (self._load[u], order[u]))
        return {"load": {u: self._load[u] for u in best}}

    def follow(self, view: Mapping[str, Any]) -> None:
        """Take the plane's loads; units the view leaves out count as more loaded than any listed."""
        load = view.get("load") if isinstance(view, Mapping) else None
        if not isinstance(load, Mapping) or not load:
            return
        known = {u: int(b) for u, b in load.items() if u in self._load}
        top = max(known.values(), default=0) + 1
        for u in self.units:
            self._load[u] = known.get(u, max(top, self._load[u]))

    def released(self, unit: str, nbytes: int) -> None:
        """Ignored: placement counts the bytes placed so far, so that it depends on the puts alone.

        Counting released bytes would make a trajectory's unit, and so the plan, depend on when consumers
        commit or restore: a restored run would then plan differently from the uninterrupted one.
        """

    def forget_group(self, group: str) -> None:
        """Drop the group's entry (all its members arrived)."""
        self._groups.pop(group, None)

    def summary(self) -> dict[str, Any]:
        """Bytes placed per unit and the number of groups remembered."""
        return {"load": dict(self._load), "groups": len(self._groups)}

    def state_dict(self) -> dict[str, Any]:
        """Bytes placed per unit and the group table ``[[group, unit], ...]``, oldest first."""
        return {"load": dict(self._load), "groups": [[g, u] for g, u in self._groups.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            StateError: A malformed state, or one of another set of units.
        """
        load = state.get("load") if isinstance(state, Mapping) else None
        groups = state.get("groups") if isinstance(state, Mapping) else None
        if (not isinstance(load, Mapping) or set(load) != set(self.units)
                or any(isinstance(v, bool) or not isinstance(v, int) for v in load.values())
                or not isinstance(groups, list)
                or any(not isinstance(x, list) or len(x) != 2 or not isinstance(x[0], str)
                       or not isinstance(x[1], str) or x[1] not in load
                       for x in groups)):
            raise StateError(f"not a consumer-aware placement state of units {list(self.units)}: {str(state)[:200]}")
        self._load = {u: int(load[u]) for u in self.units}
        self._groups = OrderedDict((g, u) for g, u in groups)
        while len(self._groups) > self._max_groups:
            self._groups.popitem(last=False)


#: The placement classes by name (``Pipeline(placement=name)``, :func:`make_placement`): ``"consumer_aware"`` and
#: ``"index_mod"``, then any registered since (``PLACEMENTS.register(name, cls)``).
PLACEMENTS: Registry[type[Placement]] = Registry(
    "placement", accepts=lambda c: isinstance(c, type) and issubclass(c, Placement))
for _cls in (ConsumerAwarePlacement, IndexModPlacement):
    PLACEMENTS.register(_cls.name, _cls)


def make_placement(name: str, units: Sequence[str]) -> Placement:
    """Build the placement registered as ``name`` in :data:`PLACEMENTS` (``"consumer_aware"`` or ``"index_mod"``).

    Raises:
        ConfigError: Unknown name (the message names the choices), or no unit.
    """
    return PLACEMENTS.get(name)(units)
