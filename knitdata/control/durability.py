"""Durability: the plane's state as JSON (:meth:`Durability.state_dict` / :meth:`Durability.load_state_dict`),
its journal (every journaled call recorded once applied), compaction, and recovery after a restart.

The state is the snapshot format of the journal (:data:`~knitdata.control.state.SNAPSHOT_FORMAT`; format 1 is
still read). Its ``putting`` key (puts in progress of the removed two-phase put) is always written empty, so
that older readers still load it, and a state whose ``putting`` is not empty is refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from knitdata.control.journal import Journal, dumps_strict, loads_strict, recovery_plan
from knitdata.control.reshape import snapshot_layout
from knitdata.control.snapshot import decode_snapshot
from knitdata.control.state import SNAPSHOT_FORMAT, PlaneState
from knitdata.errors import CodecError, ConfigError, KnitdataError, StateError
from knitdata.observe import trace as tracing
from knitdata.placement import ConsumerLayout

__all__ = ["Durability", "REMOVED_OPS", "SNAPSHOT_KEYS", "StateSlice"]

#: The keys of a snapshot, in the order they are written (the journal's snapshots are compared as bytes).
SNAPSHOT_KEYS: tuple[str, ...] = (
    "format", "config", "unit_nodes", "policy", "placement", "seq", "putting", "schema", "withdrawn", "delivered",
    "live", "put_tokens", "pending", "loss", "queues", "planned", "committed", "position", "closed", "close_report",
    "error", "version", "staleness", "counts", "rejected_by_cause", "recent_releases", "chains", "fps", "verify_at",
    "reshape", "replicas")


class StateSlice(Protocol):
    """A part's own slice of a snapshot: the keys it writes, restored from a checked snapshot
    (:func:`~knitdata.control.snapshot.decode_snapshot`)."""

    def state_dict(self) -> dict[str, Any]:
        """This slice's keys, JSON-serializable."""

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore this slice from the checked snapshot ``d`` (after the shared state's)."""

#: Journal operations of the two-phase put (``reserve`` ... ``offer``), which no engine called and which was
#: removed: a journal holding one cannot be replayed (a clear :class:`~knitdata.errors.CodecError`).
REMOVED_OPS: frozenset[str] = frozenset({"reserve", "reserve_many", "offer", "offer_many", "unreserve"})


class Durability:
    """State, journal and recovery of one plane.

    A snapshot is gathered from slices (:class:`StateSlice`): the shared state's
    (:meth:`~knitdata.control.state.PlaneState.state_dict`) and those of the parts that own state of their own,
    each writing and restoring its own keys; this part adds only the frame (format, configuration, units) and
    puts the keys in the order of :data:`SNAPSHOT_KEYS`, so that snapshots stay byte for byte what they were.

    Args:
        s: The plane's shared state.
        apply: ``apply(op, args)`` runs one journaled call on the plane (used to replay a journal).
        journaled: The names of the journaled calls (what a journal may hold).
        slices: The parts' own slices, loaded in this order after the shared state's.
    """

    def __init__(self, s: PlaneState, apply: Callable[[str, list[Any]], Any], journaled: frozenset[str],
                 slices: Sequence[StateSlice] = ()) -> None:
        self.s = s
        self.apply = apply
        self.journaled = journaled
        self.slices = tuple(slices)
        self.journaling = s.journaling
        self.journaling.log = self.log

    def recover(self, path: str) -> int:
        """Rebuild this (fresh) plane's state from the journal at ``path`` and its snapshot, if any.

        The snapshot (``path + ".snapshot"``, written by :meth:`compact`) is loaded when the journal continues
        from it, and only the records after it are replayed; a snapshot of another run (left by a deleted
        journal) is ignored. Calls that raised when they were first made raise again here and are skipped:
        their effects are reproduced. Releases are sent to the units again (they are idempotent): the ones a
        replayed call makes, and after a snapshot the last :data:`~knitdata.control.state.RECENT_RELEASES` ids
        released before it.

        With tracing on (:mod:`knitdata.observe.trace`) the recovery is recorded as a ``restart`` span (args ``journal``,
        ``replayed``, ``snapshot``).

        Returns:
            The number of journal records replayed (after the snapshot).

        Raises:
            CodecError: A damaged journal or snapshot, or a record of an operation this version does not replay
                (one of :data:`REMOVED_OPS`, written by the removed two-phase put).
        """
        s, jr = self.s, self.journaling
        n = 0
        t0 = tracing.now_us()
        with s.cond:
            plan = recovery_plan(path)
            if plan.state is not None:
                try:
                    self.load_state_dict(plan.state)
                except KnitdataError as e:
                    raise CodecError(f"the snapshot of journal {path!r} cannot be loaded: {e}") from e
                s.resend_releases()
            jr.replaying = True
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
                jr.replaying = False
            jr.replayed = n
            jr.snapshot_loaded = plan.state is not None
        if tracing.tracer is not None:  # the restart: the journal replayed (on the thread that recovered)
            tracing.tracer.span("restart", "coordinator", t0, tracing.now_us(),
                                {"journal": str(path), "replayed": n, "snapshot": jr.snapshot_loaded})
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
        j = self.journaling.journal
        if j is None:
            raise ConfigError("this control plane has no journal to compact")
        with self.s.cond:
            j.compact(self.state_dict())

    def log(self, name: str, args: Sequence[Any]) -> None:
        """Journal one call; compact when the segment is due (under the lock, between calls)."""
        j = self.journaling.journal
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
            got: dict[str, Any] = {"format": SNAPSHOT_FORMAT, "config": config, "unit_nodes": dict(s.unit_nodes),
                                   "putting": [], **s.state_dict(raw_metas)}
            for part in self.slices:
                got.update(part.state_dict())
            return {k: got[k] for k in SNAPSHOT_KEYS if k in got}

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
            d["reshape"] = part  # checked by the reshape part's slice
            s.load_state_dict(d)  # the policy first: checked whole before anything changes
            for slice_ in self.slices:
                slice_.load_state_dict(d)
            s.cond.notify_all()
