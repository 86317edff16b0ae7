"""The embedded engine: one process, the control plane called directly, one in-memory unit per layout node."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from knitdata.admission import AdmissionPolicy, AdmittedMiniBatch
from knitdata.consumer.fetch import FetchMode
from knitdata.control import ControlPlane
from knitdata.control.records import ItemRef
from knitdata.engines.base import Engine
from knitdata.engines.embedded.unit import EmbeddedStorageUnit
from knitdata.errors import ConfigError
from knitdata.placement import ConsumerLayout
from knitdata.planner import MiniBatchPlan
from knitdata.reclaim import Graveyard
from knitdata.record import MediaItem, Trajectory
from knitdata.storage.base import StorageUnit

__all__ = ["EmbeddedEngine"]

_first, _unit = itemgetter(0), itemgetter(1)  # of a plan entry's item (ItemRef: id, unit, nbytes)


class EmbeddedEngine(Engine):
    """Units in this process; producers and consumers are threads. No servers.

    Media are stored once per unit (``config["media_dedup"]``, default ``True``; see
    :class:`~knitdata.engines.embedded.unit.EmbeddedStorageUnit`). A media reference put on a unit that does not hold
    its digest is resolved from another unit of the pipeline that does (placement keeps a group on one unit, but a
    later turn may land elsewhere): the item is held by both units, counted on both, freed on each with its last
    trajectory there. A digest no unit holds is refused with :class:`~knitdata.errors.MediaRefError`.

    Args:
        layout: Consumers by node (one unit per node, its id the node name).
        config: The control plane's options.
        capacity_bytes: Capacity of each unit.
        spill_dir: Give each unit a :class:`~knitdata.storage.spill.SpillStore` in ``spill_dir/<unit id>``.
        spill_bytes: Disk budget of each unit's spill store.
        policy: An admission policy object (instead of the one named in ``config``).
        on_plan: Called as ``on_plan(admitted, plan)`` for each planned mini-batch.
    """

    kind = "embedded"
    control: ControlPlane
    in_process = True
    copy_free_reads = True  # a read is a lookup of the producer's own objects (a spilled one is decoded, as in eager)
    heartbeat_s = 0.1  # in-process reports are cheap: an older iterator lets go within 0.1 s

    def __init__(
        self,
        layout: ConsumerLayout,
        config: Mapping[str, Any],
        capacity_bytes: int,
        *,
        spill_dir: str | os.PathLike[str] | None = None,
        spill_bytes: int = 16 << 30,
        policy: AdmissionPolicy | None = None,
        on_plan: Callable[[AdmittedMiniBatch, MiniBatchPlan], None] | None = None,
    ) -> None:
        super().__init__(layout, config)
        #: What the trainer's thread releases (metadata, plan entries, payloads) is freed at the next put, at
        #: ``stats()``, at shutdown or past the graveyard's limit (:mod:`knitdata.reclaim`).
        self.graveyard = grave = Graveyard()
        units: dict[str, StorageUnit] = {}
        for node in layout.nodes:
            spill = None
            if spill_dir is not None:
                from knitdata.storage.spill import SpillStore

                spill = SpillStore(os.path.join(os.fspath(spill_dir), node), max_bytes=spill_bytes)
            units[node] = EmbeddedStorageUnit(node, capacity_bytes, spill=spill,
                                              media_dedup=bool(config.get("media_dedup", True)), graveyard=grave)
        for u in units.values():  # a reference to media another unit holds is copied in from it (counted on both)
            u.resolve = self._resolver(u.unit_id, units)  # type: ignore[attr-defined]
        self._units = units
        self.control = ControlPlane(config, {u: unit.node for u, unit in units.items()},
                                     lambda u, ids, wait: units[u].release(ids), policy=policy, on_plan=on_plan,
                                     graveyard=grave)

    @classmethod
    def build(cls, layout: ConsumerLayout, config: Mapping[str, Any], capacity_bytes: int, *,
              spill_dir: str | os.PathLike[str] | None, spill_bytes: int, policy: Any, on_plan: Any,
              options: Mapping[str, Any]) -> EmbeddedEngine:
        """A new pipeline's embedded engine (it takes no ``engine_options``)."""
        if options:
            raise ConfigError(f"the embedded engine takes no engine options, got {sorted(options)}")
        return cls(layout, config, capacity_bytes, spill_dir=spill_dir,
                   spill_bytes=spill_bytes, policy=policy, on_plan=on_plan)

    @staticmethod
    def _resolver(unit_id: str, units: Mapping[str, StorageUnit]) -> Callable[[str], MediaItem | None]:
        """Finds a media digest in the units other than ``unit_id`` (the first that holds it)."""
        others = [u for k, u in units.items() if k != unit_id and isinstance(u, EmbeddedStorageUnit)]

        def resolve(digest: str) -> MediaItem | None:
            for u in others:
                item = u.media_item(digest)
                if item is not None:
                    return item
            return None

        return resolve

    def local_plane(self) -> ControlPlane:
        """The control plane (it lives in this process)."""
        return self.control

    @property
    def units(self) -> Mapping[str, StorageUnit]:
        """The storage units by id."""
        return self._units

    def read(self, items: Sequence[ItemRef], *, fetch: FetchMode, step: int) -> list[Trajectory]:
        """Payloads in order; one ``get`` per unit and group of ``fetch.groups(items)`` (no copy)."""
        groups = fetch.groups(items)
        if len(groups) == 1:
            return self._get(groups[0])
        return [t for group in groups for t in self._get(group)]

    def _get(self, items: Sequence[ItemRef]) -> list[Trajectory]:
        units = self._units
        held = set(map(_unit, items))
        if len(held) == 1:  # the common case (one unit per node): one get, no regrouping
            return units[held.pop()].get(list(map(_first, items)))
        by_unit: dict[str, list[str]] = {}
        for tid, u, _n in items:
            by_unit.setdefault(u, []).append(tid)
        got = {u: iter(units[u].get(ids)) for u, ids in by_unit.items()}
        return [next(got[u]) for _tid, u, _n in items]  # each unit's answer is in the order it was asked

    def on_close(self) -> None:
        """Close the units: producers waiting for room wake up and fail."""
        self.close_units()

    def stats(self) -> dict[str, Any]:
        """:meth:`Engine.stats <knitdata.engines.base.Engine.stats>`, after freeing what releases left to free (this
        thread: a caller reading the store's figures gets its memory back first; what the control plane's read of its
        tables forgets meanwhile is freed right after)."""
        self.graveyard.free()
        out = super().stats()
        self.graveyard.free()
        return out

    def shutdown(self) -> None:
        """Forget and free what releases left to forget and free."""
        state = self.control.state
        with state.cond:
            state.settle()
        self.graveyard.free()

    def __getstate__(self) -> Any:
        from knitdata.errors import EngineError

        raise EngineError(
            "an embedded-engine pipeline lives in one process and cannot be sent to another (DataLoader worker "
            "processes, multiprocessing): use num_workers=0 (fetch='iter' already prefetches on a thread), or "
            "the Ray engine: Pipeline(..., engine='ray') and Pipeline.attach(name) in other processes")
