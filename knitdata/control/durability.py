"""Durability: the plane's state as JSON (:meth:`Durability.state_dict` / :meth:`Durability.load_state_dict`),
its journal (every journaled call recorded once applied), compaction, and recovery after a restart.

The state is the snapshot format of the journal (:data:`~knitdata.control.state.SNAPSHOT_FORMAT`; format 1 is
still read). Its ``putting`` key (puts in progress of the removed two-phase put) is always written empty, so
that older readers still load it, and a state whose ``putting`` is not empty is refused.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from knitdata import trace as tracing
from knitdata.control.journal import Journal, dumps_strict, loads_strict, recovery_plan
from knitdata.control.reshape import load_snapshot_part, snapshot_layout, snapshot_part
from knitdata.control.snapshot import decode_snapshot
from knitdata.control.state import SNAPSHOT_FORMAT, PlaneState, RecentIds
from knitdata.errors import CodecError, ConfigError, KnitdataError, StateError
from knitdata.placement import ConsumerLayout, make_placement

__all__ = ["Durability", "REMOVED_OPS"]

#: Journal operations of the two-phase put (``reserve`` ... ``offer``), which no engine called and which was
#: removed: a journal holding one cannot be replayed (a clear :class:`~knitdata.errors.CodecError`).
REMOVED_OPS: frozenset[str] = frozenset({"reserve", "reserve_many", "offer", "offer_many", "unreserve"})


class Durability:
    """State, journal and recovery of one plane.

    Args:
        s: The plane's shared state.
        apply: ``apply(op, args)`` runs one journaled call on the plane (used to replay a journal).
        journaled: The names of the journaled calls (what a journal may hold).
    """

    def __init__(self, s: PlaneState, apply: Callable[[str, list[Any]], Any], journaled: frozenset[str]) -> None:
        self.s = s
        self.apply = apply
        self.journaled = journaled
        s.log = self.log

    def recover(self, path: str) -> int:
        """Rebuild this (fresh) plane's state from the journal at ``path`` and its snapshot, if any.

        The snapshot (``path + ".snapshot"``, written by :meth:`compact`) is loaded when the journal continues
        from it, and only the records after it are replayed; a snapshot of another run (left by a deleted
        journal) is ignored. Calls that raised when they were first made raise again here and are skipped:
        their effects are reproduced. Releases are sent to the units again (they are idempotent): the ones a
        replayed call makes, and after a snapshot the last :data:`~knitdata.control.state.RECENT_RELEASES` ids
        released before it.

        With tracing on (:mod:`knitdata.trace`) the recovery is recorded as a ``restart`` span (args ``journal``,
        ``replayed``, ``snapshot``).

        Returns:
            The number of journal records replayed (after the snapshot).

        Raises:
            CodecError: A damaged journal or snapshot, or a record of an operation this version does not replay
                (one of :data:`REMOVED_OPS`, written by the removed two-phase put).
        """
        s = self.s
        n = 0
        t0 = tracing.now_us()
        with s.cond:
            plan = recovery_plan(path)
            if plan.state is not None:
                try:
                    self.load_state_dict(plan.state)
                except KnitdataError as e:
                    raise CodecError(f"the snapshot of journal {path!r} cannot be loaded: {e}") from e
                for u, ids in list(s.recent_releases):
                    s.releaser(u, list(ids), False)
            s.replaying = True
            try:
                total = 0
                for op, args in Journal.read(path):
                    total += 1
                    if total <= plan.skip:
                        continue
                    self._replay(path, total, op, args)
                    n += 1
                if total < plan.skip:
                    raise CodecError(f"journal {path!r} holds {total} records but its snapshot covers {plan.skip}; "
                                     "the journal is damaged (truncated)")
            finally:
                s.replaying = False
            s.replayed = n
            s.snapshot_loaded = plan.state is not None
        if tracing.tracer is not None:  # the restart: the journal replayed (on the thread that recovered)
            tracing.tracer.span("restart", "coordinator", t0, tracing.now_us(),
                                {"journal": str(path), "replayed": n, "snapshot": s.snapshot_loaded})
        return n

    def _replay(self, path: str, k: int, op: str, args: list[Any]) -> None:
        """Apply journal record ``k`` (``op(*args)``); its own KnitdataError is the call's answer, not damage."""
        if op not in self.journaled:
            if op in REMOVED_OPS:
                raise CodecError(f"journal {path!r} record {k} is a call of {op}(), the two-phase put, which this "
                                 "version of knitdata removed (no engine used it); this journal cannot be replayed: "
                                 "finish the run with the knitdata that wrote it, or start a new journal")
            raise CodecError(f"journal {path!r} record {k}: unknown operation {op!r}; the journal is damaged")
        try:
            self.apply(op, args)
        except KnitdataError:
            pass
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
            raise CodecError(f"journal {path!r} record {k} ({op}) has malformed arguments "
                             f"({type(e).__name__}: {e}); the journal is damaged") from e

    def compact(self) -> None:
        """Write a snapshot of the state next to the journal and start a new, empty journal segment.

        Runs on its own every ``compact_every`` journal records (see :class:`~knitdata.control.journal.Journal`).

        Raises:
            ConfigError: This plane has no journal.
            OSError: The snapshot or the new segment could not be written (the journal is left as it was).
        """
        s = self.s
        if s.journal is None:
            raise ConfigError("this control plane has no journal to compact")
        with s.cond:
            s.journal.compact(self.state_dict())

    def log(self, name: str, args: Sequence[Any]) -> None:
        """Journal one call; compact when the segment is due (under the lock, between calls)."""
        j = self.s.journal
        assert j is not None
        j.append(name, list(args))
        if j.compaction_due:
            try:
                j.compact(self.state_dict())
            except (OSError, KnitdataError) as e:  # the journal stays whole; the next attempt comes later
                warnings.warn(f"journal {j.path!r}: compaction failed, the journal keeps growing: {e}",
                              RuntimeWarning, stacklevel=4)

    def state_dict(self, raw_metas: bool = False) -> dict[str, Any]:
        """The plane's complete state, JSON-serializable, from which :meth:`load_state_dict` continues identically.

        ``raw_metas``: ``live`` and ``pending`` hold the (immutable) :class:`~knitdata.record.TrajectoryMeta`
        objects, for a caller that converts them with ``to_dict()`` after the plane's lock (a checkpoint's cut).

        Holds: admission, placement, queues and positions, held and pending trajectories (and the put tokens of
        the held ones), withdrawn groups, schema, version, counters, close report, the stopping error, staleness,
        and the recent releases. Not: iterator leases, version timestamps, consumers' stats and transfer totals.

        Raises:
            StateError: The configuration is not JSON-serializable.
        """
        s = self.s
        with s.cond:
            try:
                config = loads_strict(dumps_strict({**s.config, "layout": s.base_layout}))
            except (TypeError, ValueError) as e:
                raise StateError(f"the control plane's configuration is not JSON-serializable: {e}") from e
            err = None if s.error is None else {"type": type(s.error).__name__, "message": str(s.error)}
            return {
                "format": SNAPSHOT_FORMAT, "config": config, "unit_nodes": dict(s.unit_nodes),
                "policy": s.policy.state_dict(), "placement": s.placement.state_dict(),
                "seq": s.seq, "putting": [],
                "schema": s.schema, "withdrawn": list(s.withdrawn), "delivered": list(s.delivered),
                "live": list(s.live.values()) if raw_metas else [m.to_dict() for m in s.live.values()],
                "put_tokens": dict(s.put_tokens),
                "pending": list(s.pending.values()) if raw_metas else [m.to_dict() for m in s.pending.values()],
                "loss": dict(s.loss),
                "queues": [[q[j] for j in sorted(q)] for q in s.queues],
                "planned": list(s.planned), "committed": list(s.committed), "position": list(s.position),
                "closed": s.closed, "close_report": s.close_report, "error": err, "version": s.version,
                "staleness": list(s.staleness), "counts": dict(s.counts),
                "rejected_by_cause": dict(s.rejected_by_cause),
                "recent_releases": [[u, list(ids)] for u, ids in s.recent_releases],
                "chains": list(s.chain), "fps": [[[k, v] for k, v in fps.items()] for fps in s.fps],
                "verify_at": [None if v is None else list(v) for v in s.verify_at],
                "reshape": snapshot_part(s),
                **({} if s.replicas is None else {"replicas": s.replicas.to_dict()}),
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the plane's state with a :meth:`state_dict` (of a plane of the same configuration and units).

        Every part is checked before anything changes. Leases, version timestamps, consumers' stats and
        transfer totals are kept as they are.

        Raises:
            StateError: A malformed state, one of another configuration, layout or set of units, or one with puts
                in progress of the removed two-phase put.
        """
        s = self.s
        with s.cond:
            part = state.get("reshape") if isinstance(state, Mapping) else None
            layout = snapshot_layout(part) or ConsumerLayout.from_dict(s.base_layout)
            d = decode_snapshot(state, config={**s.config, "layout": s.base_layout}, unit_nodes=s.unit_nodes,
                                num_consumers=layout.num_consumers, counts=s.counts)
            if d["putting"]:
                raise StateError(f"control-plane snapshot: {len(d['putting'])} puts in progress of the two-phase put "
                                 f"({[p[0] for p in d['putting'][:8]]}), which this version of knitdata removed; "
                                 "this state cannot be continued here")
            placement = make_placement(s.config["placement"], list(s.unit_nodes))
            placement.load_state_dict(d["placement"])
            s.policy.load_state_dict(d["policy"])  # checked whole before it changes anything
            s.placement = placement
            s.seq = d["seq"]
            s.schema = d["schema"]
            s.withdrawn = OrderedDict.fromkeys(d["withdrawn"])
            s.delivered = RecentIds(s.delivered.limit, d["delivered"])
            s.live = {m.id: m for m in d["live"]}
            s.put_tokens = d["put_tokens"]
            s.pending = {m.id: s.live.get(m.id, m) for m in d["pending"]}
            s.loss = d["loss"]
            s.queues = [{e["j"]: e for e in q} for q in d["queues"]]
            s.entry_sums = [{} for _ in s.queues]
            s.planned, s.committed, s.position = d["planned"], d["committed"], d["position"]
            s.closed, s.close_report, s.error = d["closed"], d["close_report"], d["error"]
            s.version = d["version"]
            s.staleness = deque(d["staleness"], maxlen=s.staleness.maxlen)
            s.counts = d["counts"]
            s.rejected_by_cause = d["rejected_by_cause"]
            s.recent_releases = deque((u, ids) for u, ids in d["recent_releases"])
            s.chain, s.fps, s.verify_at = d["chains"], d["fps"], d["verify_at"]
            s.replicas = d.get("replicas")
            s.recent_ids = sum(len(ids) for _u, ids in s.recent_releases)
            load_snapshot_part(s, part)
            n = s.layout.num_consumers
            s.consumer_stats = (s.consumer_stats + [None] * n)[:n]
            s.staleness_by_rank = (s.staleness_by_rank + [deque(maxlen=1000) for _ in range(n)])[:n]
            s.cond.notify_all()
