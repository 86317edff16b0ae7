"""Reporting: the plane's counters, what admission waits for, who holds a unit's memory, consumers' and transfer
metrics, and the messages that explain a stream that ended short."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from knitdata.control.state import PRODUCER_TTL_S, PlaneState
from knitdata.control.surface import Part, control_call, control_part
from knitdata.observe.metrics import summarize

__all__ = ["Reporting", "missing_text", "producers_gone", "incomplete_message", "observation", "journal_summary"]


def missing_text(s: PlaneState) -> str:
    """What admission still waits for: per source needed/ready, incomplete groups."""
    need = s.policy.remaining_quota()
    ready = s.policy.ready_counts()
    srcs = [f"{src}: {need.get(src, 0)} still to admit in train batch {s.policy.train_batch}, "
            f"{ready.get(src, 0)} ready" for src in s.spec.sources]
    groups: dict[str, int] = {}
    for m in s.pending.values():
        groups[m.group] = groups.get(m.group, 0) + 1
    g = s.spec.group_size
    partial = sorted(k for k, n in groups.items() if n < g)
    text = "sources " + "; ".join(srcs)
    if partial:
        shown = ", ".join(f"{k} ({groups[k]} of {g})" for k in partial[:10])
        text += f"; incomplete groups {shown}" + (f" and {len(partial) - 10} more" if len(partial) > 10 else "")
    return text


def producers_gone(s: PlaneState) -> str | None:
    """The message when every producer stopped without close() for ``producer_timeout_s`` (else ``None``)."""
    timeout = s.lease_book.producer_timeout_s
    if timeout is None or not s.lease_book.producers:
        return None
    now = time.monotonic()
    gone = []  # (holder, since when it counts as gone, why)
    for holder, seen, alive, ended in s.lease_book.producers.values():
        if now - seen > PRODUCER_TTL_S:
            gone.append((holder, seen + PRODUCER_TTL_S, f"no report for {now - seen:.0f} s: its process died?"))
        elif not alive:
            gone.append((holder, ended, "the threads that put through it ended"))
        else:
            return None
    last = max(t for _h, t, _w in gone)
    if now - last < timeout:
        return None
    who = "; ".join(f"{h}: {why}" for h, _t, why in gone[:8]) + (f"; and {len(gone) - 8} more" if len(gone) > 8 else "")
    return (f"every producer of this pipeline stopped without close() ({who}) {now - last:.0f} s ago, and admission "
            f"is still waiting for: {missing_text(s)}. Call close() when production ends (in a finally: "
            "block, so that a failing producer closes too), or withdraw() the groups it will not finish; "
            "Pipeline(producer_timeout_s=None) waits instead (up to the dataset's timeout)")


def incomplete_message(rep: Mapping[str, Any]) -> str:
    """The message of :class:`~knitdata.errors.IncompleteStreamError` for a close report that dropped
    trajectories."""
    groups = rep["dropped_groups"]
    members = rep.get("group_members", {})
    shown = ", ".join(f"{k} ({members.get(k, '?')} of {rep.get('group_size')})" for k in groups[:10])
    more = f" and {len(groups) - 10} more" if len(groups) > 10 else ""
    return (f"the pipeline was closed with {rep['dropped_trajectories']} stored trajectories never admitted "
            f"(an incomplete train batch or group): by source {rep['by_source']}, groups {shown}{more}; every "
            "admitted mini-batch was delivered. Complete or withdraw() the groups before close(), or treat this "
            "as the end of the run")


def journal_summary(s: PlaneState) -> dict[str, Any] | None:
    """The journal's segment, its records and the file's bytes (``None`` without a journal)."""
    j = s.journaling.journal
    if j is None:
        return None
    try:
        nbytes = os.path.getsize(j.path)
    except OSError:
        nbytes = -1
    return {"path": j.path, "segment": j.segment, "records": j.records, "bytes": nbytes}


def observation(s: PlaneState) -> dict[str, Any]:
    """What :mod:`knitdata.observe` reads (call under ``s.cond``): per source quota, trajectories put, admitted and
    ready; staleness per source and per rank; seconds from put to admission; the journal."""
    ready = s.policy.ready_counts()
    return {
        "sources": {src: {"quota": int(q), "puts": s.observed.source_counts[src]["puts"],
                          "admitted": s.observed.source_counts[src]["admitted"], "ready": int(ready.get(src, 0))}
                    for src, q in s.spec.quotas.items()},
        "train_batch": s.policy.train_batch,
        "staleness_by_source": {src: summarize(v) for src, v in s.observed.staleness_by_source.items()},
        "staleness_by_rank": [summarize(v) for v in s.observed.staleness_by_rank],
        "admission_delay_s": summarize(s.observed.admission_delay),
        "journal": journal_summary(s),
    }


@control_part("reporting")
class Reporting(Part):
    """Counters and diagnostics of one plane, and the metrics its consumers and processes send."""

    @control_call(fire_and_forget=True)
    def report_consumer(self, rank: int, stats: Mapping[str, Any]) -> None:
        """A consumer's metrics summary (:meth:`knitdata.observe.metrics.ConsumerMetrics.to_dict`), for :meth:`stats`."""
        self.s.check_rank(rank)
        with self.s.cond:
            self.s.observed.consumer_stats[rank] = dict(stats)

    @control_call(fire_and_forget=True)
    def report_transfer(self, meter: Mapping[str, Any]) -> None:
        """Add a process's transfer counters (:meth:`knitdata.observe.metrics.TransferMeter.to_dict`) to the totals."""
        self.s.observed.transfer.merge(meter)

    @control_call()
    def holders(self, unit: str) -> str:
        """Who holds ``unit``'s memory: uncommitted micro-batches per rank, and trajectories awaiting admission."""
        s = self.s
        with s.cond:
            parts = []
            for r, q in enumerate(s.queues):
                n = nb = 0
                for e in q.values():
                    mine = [x for x in e.items if x.unit == unit]
                    if mine:
                        n += 1
                        nb += sum(x.nbytes for x in mine)
                if n:
                    reps = "" if s.replicas is None or s.replicas.num == 1 else (
                        f"; its replicas committed up to {s.replicas.committed[r]}, handed out up to "
                        f"{s.replicas.position[r]}: the slowest holds it")
                    parts.append(f"rank {r}: {n} uncommitted micro-batches ({nb} bytes, committed up to "
                                 f"{s.committed[r]}, handed out up to {s.position[r]}{reps})")
            waiting = [m for m in s.pending.values() if m.location == unit]
            if waiting:
                parts.append(f"{len(waiting)} trajectories waiting for admission ({sum(m.nbytes for m in waiting)} bytes)")
            return "; ".join(parts) if parts else "nothing the control plane knows of (puts in progress only)"

    @control_call()
    def missing(self) -> str:
        """What admission still waits for: per source needed/ready, incomplete groups."""
        with self.s.cond:
            return missing_text(self.s)

    @control_call()
    def stats(self) -> dict[str, Any]:
        """JSON-serializable counters of the control plane."""
        s = self.s
        with s.cond:
            times = list(s.observed.version_times)
            return {
                **s.counts, "closed": s.closed, "version": s.version, "release": s.release_mode,
                "rejected_by_cause": dict(s.rejected_by_cause),
                "held_trajectories": len(s.live), "ready_not_admitted": s.policy.ready_counts(),
                "planned": list(s.planned), "committed": list(s.committed), "positions": list(s.position),
                "held_microbatches": [len(q) for q in s.queues],
                "staleness": summarize(s.observed.staleness), "token_staleness": s.observed.token_staleness.summary(),
                "staleness_split": s.observed.staleness_split.summary(),
                "staleness_bound": s.policy.bound_stats(),
                "version_interval_s": summarize(b - a for a, b in zip(times, times[1:])),
                "close_report": s.close_report, "consumers": list(s.observed.consumer_stats),
                "placement": s.placement.summary(), "transfer": s.observed.transfer.to_dict(),
                **observation(s),
            }
