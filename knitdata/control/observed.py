"""What a control plane observes for reporting: staleness, version report times, per source puts and admissions,
consumers' metrics and transfer totals (:class:`Observations`, held by the shared state as ``observed``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from knitdata.control.records import PlanEntry
from knitdata.observe import trace as tracing
from knitdata.observe.metrics import TransferMeter
from knitdata.record import TrajectoryMeta
from knitdata.staleness import PutLog, StalenessSplit, TokenStaleness

__all__ = ["Observations"]

_first = itemgetter(0)  # the trajectory id of a queue item ``[id, unit, nbytes]``


class Observations:
    """What the plane observes for reporting (:class:`~knitdata.control.reporting.Reporting` reads it; the parts
    that see an event record it): staleness, version report times, per source puts and admissions, consumers'
    metrics and transfer totals. Only :attr:`staleness` is in snapshots (:meth:`state_dict`); the rest counts
    since this plane started.

    Args:
        sources: The batch spec's sources.
        num_consumers: Ranks of the layout.
    """

    def __init__(self, sources: Iterable[str], num_consumers: int) -> None:
        self.version_times: deque[float] = deque(maxlen=1024)
        self.staleness: deque[int] = deque(maxlen=10_000)
        self.token_staleness = TokenStaleness()  # per token
        self.staleness_split = StalenessSplit()  # generating / queued
        # knitdata.observe: per source trajectories put and admitted, staleness per source and per rank, seconds
        # from put to admission
        self.source_counts: dict[str, dict[str, int]] = {src: {"puts": 0, "admitted": 0} for src in sources}
        self.staleness_by_source: dict[str, deque[int]] = {src: deque(maxlen=10_000) for src in self.source_counts}
        self.staleness_by_rank: list[deque[int]] = []
        self.put_times: dict[str, float] = {}  # pending id -> when it was put (monotonic)
        self.admission_delay: deque[float] = deque(maxlen=10_000)
        self.consumer_stats: list[dict[str, Any] | None] = []
        self.transfer = TransferMeter()
        self.resize(num_consumers)

    def resize(self, num_consumers: int, reset: bool = False) -> None:
        """Keep one per-rank slot for each of ``num_consumers`` ranks (``reset``: empty them all)."""
        n = num_consumers
        stats, by_rank = ([], []) if reset else (self.consumer_stats, self.staleness_by_rank)
        self.consumer_stats = (stats + [None] * n)[:n]
        self.staleness_by_rank = (by_rank + [deque(maxlen=1000) for _ in range(n - len(by_rank))])[:n]

    def state_dict(self) -> dict[str, Any]:
        """This part of a snapshot: ``{"staleness": [...]}``."""
        return {"staleness": list(self.staleness)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Continue from a checked snapshot ``d`` (the per-rank slots are sized by :meth:`resize`)."""
        self.staleness = deque(d["staleness"], maxlen=self.staleness.maxlen)

    def record_handouts(self, rank: int, handouts: Sequence[tuple[PlanEntry, int]], planned: Mapping[int, Any],
                        held_metas: Callable[[Iterable[str]], list[TrajectoryMeta]], put_log: PutLog) -> None:
        """Staleness of entries of ``rank`` handed out to a trainer, ``(entry, policy version)`` in hand-out order
        (a report's hand-outs up to its next release, recorded together): per trajectory, overall, per rank, per
        source and per token. ``planned``: the rank's staleness sums made when its entries were planned (by entry);
        ``held_metas``: the metas of ids still held; ``put_log``: the puts' versions and times."""
        if not handouts:
            return
        version = handouts[0][1]
        for _e, v in handouts:
            if v != version:  # the trainer's version changed within these: one at a time
                for e, v2 in handouts:
                    self.record_handouts(rank, [(e, v2)], planned, held_metas, put_log)
                return
        gens: list[int] = []
        for e, _v in handouts:
            gens += e.info.gen_versions
        values = list(map(version.__sub__, gens))
        self.staleness.extend(values)
        self.staleness_by_rank[rank].extend(values)
        by_source = self.staleness_by_source
        sums = [planned.get(e.j, False) for e, _v in handouts]
        now = time.monotonic()
        split = self.staleness_split
        before = split.totals() if tracing.tracer is not None else None
        if len(by_source) == 1 and False not in sums:
            # one source (puts of others are refused), the sums planned with the entries: no trajectory visited
            token = self.token_staleness
            for x in sums:
                if x is not None:
                    token.record_sums(version, x[0])
                    split.record_sums(version, now, x[1])
            for only in by_source.values():
                only.extend(values)
            if before is not None:
                self.trace_split(before)
            return
        ids: list[str] = []
        for e, _v in handouts:
            ids += map(_first, e.items)
        metas = held_metas(ids)
        self.token_staleness.record(version, metas)
        split.record_sums(version, now, put_log.sums(metas))
        if before is not None:
            self.trace_split(before)
        if len(by_source) == 1 and len(metas) == len(values):
            # one source, every trajectory held: ``values`` are theirs, in order
            for only in by_source.values():
                only.extend(values)
            return
        for m in metas:
            dq = by_source.get(m.source)
            if dq is not None:
                dq.append(version - m.gen_version)

    def trace_split(self, before: tuple[int, int, int, float]) -> None:
        """Trace the staleness split of the hand-outs recorded since :meth:`StalenessSplit.totals` was ``before``
        (a ``staleness`` counter: mean versions generating and queued, mean seconds queued)."""
        tr = tracing.tracer
        means = self.staleness_split.means_since(before)
        if tr is not None and means is not None:
            tr.counter("staleness", means)
