"""Elastic resume: rank states saved with ``N`` ranks (and ``W`` DataLoader workers) continue with ``N'`` (``W'``).

Plans are deterministic, so a rank state names what was handed out: rank ``r`` received its entries
(micro-batches numbered over the run) below its position ``P_r``. A *reshape* closes the layout the states were
saved with (a *segment*: its layout and the positions ``P``) and opens a new one:

* every micro-batch handed out before the save (entry ``j < P_r`` of rank ``r``) is never delivered again;
* the unconsumed remainder of each mini-batch some rank had started is planned again for the new layout, as a
  mini-batch of its own (same ``minibatch`` index, token-balanced, every rank the same number of micro-batches;
  its info's global counts are the remainder's), before any later mini-batch;
* mini-batches no rank had started (admitted or not yet) are planned for the new layout from the start.

The segments are the *layout history* (:meth:`Segments.history`), kept in every rank state taken afterwards, so
that a fresh pipeline refilled with the same puts can plan each mini-batch in the layout it was first handed out
with, take out what was handed out there, and re-plan the rest, segment after segment. The history is bounded:
once every rank of a segment has consumed the remainders it received, the segments before it are summarized by
the index of the first mini-batch it planned whole (``root_whole``; everything before was consumed) and
:func:`merge_rank_states` drops them; at most :data:`MAX_SEGMENTS` segments are kept.

User API: :func:`merge_rank_states` (pure, JSON in and out) turns the states of all old ranks into one merged
state; every new rank loads it (``ds.load_state_dict(merged)``), which makes the control plane apply
:meth:`Reshaping.reshape` once (later identical calls are no-ops). :func:`remainder_of` and :func:`replan` are
the pure planning steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from knitdata.admission import AdmittedMiniBatch
from knitdata.control.fingerprints import FP_EMPTY, entry_fingerprint
from knitdata.control.rankstates import (
    canon,
    check_merged,
    layout_from_runs,
    layout_runs,
    merge_rank_states,
)
from knitdata.control.state import PlaneState
from knitdata.control.surface import Part, control_call, control_part
from knitdata.errors import KnitdataError, StateError
from knitdata.placement import ConsumerLayout
from knitdata.planner import AdmittedLike, MiniBatchPlan, Planner
from knitdata.record import TrajectoryMeta

__all__ = ["MAX_SEGMENTS", "Remainder", "Segments", "Reshaping", "merge_rank_states", "remainder_of", "replan",
           "route", "note_planned", "snapshot_part", "snapshot_layout", "load_snapshot_part"]

#: The most layout segments a history keeps (each reshape before the remainders of the last one were consumed
#: adds one).
MAX_SEGMENTS = 16


@dataclass(frozen=True)
class Remainder:
    """The unconsumed rest of an admitted mini-batch, planned as a mini-batch of its own (an
    :class:`~knitdata.planner.AdmittedLike`): the same indices, its trajectories in ``(seq, id)`` order."""

    train_batch: int
    index: int
    step: int
    trajectories: tuple[TrajectoryMeta, ...]


def _canonical(metas: Iterable[TrajectoryMeta]) -> tuple[TrajectoryMeta, ...]:
    return tuple(sorted(metas, key=lambda m: (m.seq, m.id)))


def remainder_of(plan: MiniBatchPlan, offset: int,
                 positions: Sequence[int]) -> tuple[tuple[TrajectoryMeta, ...], tuple[TrajectoryMeta, ...]]:
    """Split a planned mini-batch into what was not handed out and what was.

    Micro-batch ``i`` of rank ``r`` is the rank's entry ``offset + i``; it was handed out iff
    ``offset + i < positions[r]``.

    Args:
        plan: The mini-batch's plan in the old layout.
        offset: The entry index of its first micro-batch (the same on every rank).
        positions: Each old rank's position (entries below it were handed out).

    Returns:
        ``(remainder, consumed)``, the remainder in ``(seq, id)`` order.
    """
    rest: list[TrajectoryMeta] = []
    done: list[TrajectoryMeta] = []
    for r, row in enumerate(plan.microbatches):
        for i, pmb in enumerate(row):
            (done if offset + i < positions[r] else rest).extend(pmb.trajectories)
    return _canonical(rest), tuple(done)


def replan(planner: Planner, admitted: AdmittedLike, remainder: Sequence[TrajectoryMeta],
           loss_tokens: Mapping[str, int] | None = None) -> MiniBatchPlan:
    """The plan of the remainder of ``admitted`` for ``planner``'s layout (a pure function of its arguments).

    The remainder is planned as a mini-batch of its own (the planner's usual rules: token balance, equal
    micro-batch counts per rank), with ``admitted``'s indices; its trajectories are taken in ``(seq, id)`` order,
    so that the result does not depend on where the remainder was collected.
    """
    return planner.plan(Remainder(admitted.train_batch, admitted.index, admitted.step, _canonical(remainder)),
                        loss_tokens)


# ----------------------------------------------------------------------------------------------- segments
class _Closed:
    """A closed segment at run time: its layout's planner, the positions its ranks had consumed, and where its
    next mini-batch starts."""

    def __init__(self, rec: Mapping[str, Any], base: Planner) -> None:
        self.rec = dict(rec)
        layout = ConsumerLayout.from_dict(rec["layout"])
        self.planner = _planner_like(base, layout)
        self.n = layout.num_consumers
        self.positions = [int(p) for p in rec["positions"]]
        self.top = max(self.positions)
        self.counter = int(rec.get("offset", 0))
        start = rec.get("start_fps")
        self.chains: list[str | None] = (list(start) if start is not None
                                         else [FP_EMPTY if self.counter == 0 else None] * self.n)
        self.checks = {r: (int(f[0]), str(f[1])) for r, f in enumerate(rec.get("fps") or []) if f is not None}


def _planner_like(base: Planner, layout: ConsumerLayout) -> Planner:
    return Planner(layout, base.token_budget, allow_split_groups=base.allow_split_groups, locality=base.locality,
                   balance_tolerance=base.balance_tolerance, unit_nodes=base.unit_nodes)


class Segments:
    """The layout history of a reshaped plane (``PlaneState.segments``).

    Attributes:
        root_whole: Mini-batches below it were consumed entirely (released when admitted, never planned).
        closed: The closed segments, oldest first.
        current: ``{"layout", "offset", "start_fps"}`` of the segment the plane's queues are numbered in.
        first_whole: The first mini-batch planned whole in the current segment (``None``: not yet).
        remainder_entries: The entries per rank the current segment's remainders take (known with
            ``first_whole``); ``remainder_fps`` the ranks' fingerprints there.
        applied: The canonical text of the last merged state applied (a repeated load is a no-op).
    """

    def __init__(self, root_whole: int, closed: Sequence[Mapping[str, Any]], current: Mapping[str, Any],
                 base: Planner) -> None:
        self.root_whole = int(root_whole)
        self.closed = [_Closed(c, base) for c in closed]
        self.current = dict(current)
        self.first_whole: int | None = None
        self.remainder_entries: int | None = None
        self.remainder_fps: list[str | None] | None = None
        self.applied: str | None = None
        if not self.closed:  # a root segment: everything before root_whole was consumed
            self.first_whole = self.root_whole
            self.remainder_entries = int(current.get("offset", 0))
            start = current.get("start_fps")
            self.remainder_fps = list(start) if start is not None else None

    def history(self) -> dict[str, Any]:
        """The static layout history (JSON; the same in every rank state taken in the current segment)."""
        return {"root_whole": self.root_whole, "closed": [c.rec for c in self.closed], "current": self.current}

    def remainder(self, rank: int) -> list[Any] | None:
        """``[first whole mini-batch, remainder entries, rank's fingerprint there]`` once known, else ``None``."""
        if self.first_whole is None or self.remainder_entries is None:
            return None
        fp = None if self.remainder_fps is None else self.remainder_fps[rank]
        return [self.first_whole, self.remainder_entries, fp]


def _release(s: PlaneState, metas: Iterable[TrajectoryMeta]) -> None:
    s.release_metas([s.live[m.id] for m in metas if m.id in s.live], delivered=True)


def route(s: PlaneState, mb: AdmittedLike) -> tuple[MiniBatchPlan | None, tuple[TrajectoryMeta, ...] | None]:
    """The plan of an admitted mini-batch in the current segment, after the closed segments took out what they
    handed out: ``(plan or None when nothing is left, the remainder planned or None when planned whole)``.

    Without a layout history (never reshaped) it is the planner's plan of ``mb``. Called under the lock.

    Raises:
        StateError: A closed segment's micro-batches differ from the fingerprints of the states it was closed
            with (the refill put other trajectories, or in another order); the pipeline stops with it.
    """
    seg: Segments | None = s.replay.segments
    if seg is None:
        return s.planner.plan(mb, s.loss), None
    if mb.step < seg.root_whole:
        _release(s, mb.trajectories)
        return None, None
    items: tuple[TrajectoryMeta, ...] | None = None  # None: the whole mini-batch
    for c in seg.closed:
        if c.counter >= c.top:  # no rank of the segment reached this mini-batch: it passes on unchanged
            continue
        plan = c.planner.plan(mb, s.loss) if items is None else replan(c.planner, mb, items, s.loss)
        off = c.counter
        c.counter += plan.num_microbatches
        _check_closed(s, c, plan, off)
        rest, done = remainder_of(plan, off, c.positions)
        _release(s, done)
        if not rest:
            return None, None
        items = rest
    if items is None:
        return s.planner.plan(mb, s.loss), None
    return replan(s.planner, mb, items, s.loss), items


def _check_closed(s: PlaneState, c: _Closed, plan: MiniBatchPlan, off: int) -> None:
    for r, row in enumerate(plan.microbatches):
        chain = c.chains[r]
        want = c.checks.get(r)
        for i, pmb in enumerate(row):
            if chain is None or want is None or off + i >= want[0]:
                break
            chain = entry_fingerprint(chain, pmb.info.__dict__)
            if off + i + 1 == want[0] and chain != want[1]:
                err = StateError(
                    f"rank {r} of the {c.n}-rank layout the states were saved with: its first {want[0]} micro-batches "
                    f"differ from this pipeline's (mini-batch {pmb.info.minibatch} micro-batch {pmb.info.microbatch} "
                    f"holds {list(pmb.info.trajectory_ids)[:8]}); refill the new job with the same puts in the same "
                    "order as the run that saved the states")
                s.fail(err)
                raise err
        c.chains[r] = chain


def note_planned(s: PlaneState, mb: AdmittedLike, plan: MiniBatchPlan, items: tuple[TrajectoryMeta, ...] | None,
                 off: int) -> None:
    """Record a mini-batch planned in the current segment (before its entries are queued at ``off``), so that a
    live reshape can re-plan it; the first mini-batch planned whole fixes where the segment's remainders end."""
    seg: Segments | None = s.replay.segments
    if seg is not None and items is None and seg.first_whole is None:
        seg.first_whole = int(mb.step)
        seg.remainder_entries = off
        seg.remainder_fps = [s.replay.fps[r].get(off) for r in range(s.layout.num_consumers)]
    s.replay.mb_records[int(mb.step)] = [mb, items, off, plan.num_microbatches, 0]


# ----------------------------------------------------------------------------------------------- the part
@control_part("reshaping")
class Reshaping(Part):
    """Elastic resume on the control plane: install a layout history, reshape onto another number of ranks."""

    def state_dict(self) -> dict[str, Any]:
        """This part's slice of a snapshot: ``reshape`` (:func:`snapshot_part`; see
        :class:`~knitdata.control.durability.StateSlice`)."""
        return {"reshape": snapshot_part(self.s)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore this part's slice (``d["reshape"]``, ``None`` in formats 1 and 2) after the shared state's, and
        size the per-rank observations to the restored layout."""
        s = self.s
        load_snapshot_part(s, d.get("reshape"))
        s.observed.resize(s.layout.num_consumers)

    @control_call()
    def layout_history(self, rank: int) -> dict[str, Any]:
        """What the states of ``rank`` carry about the layout: ``{"layout": the ranks' nodes as runs
        (:func:`layout_runs`), "history": the static layout history or None (never reshaped), "remainder": see
        :meth:`Segments.remainder`, "run": the run's mark or None before its first micro-batch is planned}``."""
        s = self.s
        s.check_rank(rank)
        with s.cond:
            seg: Segments | None = s.replay.segments
            runs = layout_runs(s.layout)
            if seg is None:
                return {"layout": runs, "history": None, "remainder": None, "run": s.replay.run_mark}
            return {"layout": runs, "history": seg.history(), "remainder": seg.remainder(rank),
                    "run": s.replay.run_mark}

    @control_call(journaled=True)
    def install_history(self, history: Mapping[str, Any]) -> None:
        """Continue a run that was reshaped before: a fresh plane plans each mini-batch through ``history`` (the
        ``layout_history`` of the rank states it loads). Idempotent.

        Raises:
            StateError: A plane that planned already with another history, or a history whose current layout
                is not this plane's.
        """
        s = self.s
        with s.cond:
            seg: Segments | None = s.replay.segments
            if seg is not None and canon(seg.history()) == canon(history):
                return
            if seg is not None or s.counts["admitted_minibatches"]:
                raise StateError("this pipeline already planned mini-batches with another layout history: load the "
                                 "states of a reshaped run before the refill starts, into a fresh pipeline")
            self._check_history(history)
            if ConsumerLayout.from_dict(history["current"]["layout"]) != s.layout:
                n = len(history["current"]["layout"]["nodes_of_ranks"])
                raise StateError(f"the states were saved with {n} ranks in another layout than this pipeline's "
                                 f"{s.layout.num_consumers}: merge them (knitdata.merge_rank_states) and load the "
                                 "merged state on every rank")
            self._install(Segments(history["root_whole"], history["closed"], history["current"], s.planner))

    @control_call(journaled=True)
    def reshape(self, merged: Mapping[str, Any], layout: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Continue from the states of all ranks of a run (:func:`merge_rank_states`) with this plane's ranks.

        What the old ranks were handed out is never delivered again; the unconsumed remainder of each
        mini-batch they had started is planned again for the new layout, and later mini-batches are planned for
        it from the start. On a fresh plane (nothing planned yet: a new job, before the refill) the whole history
        is installed; on a live plane (its consumers stopped) the queued micro-batches after the states'
        positions are re-planned at once and every iterator is fenced. Applying the same merged state again is a
        no-op, so every new rank may load it. Call it after a whole-pipeline restore as well.

        Args:
            merged: The merged state.
            layout: The new :class:`~knitdata.placement.ConsumerLayout` (dict); default: this plane's layout
                (a fresh plane built for the new number of ranks).

        Returns:
            ``{"num_consumers": new ranks, "replanned": mini-batches re-planned, "segments": history length}``.

        Raises:
            StateError: A malformed merged state, one of another run or layout history, positions before what
                this plane already released, or fingerprints that differ from this plane's plans.
        """
        s = self.s
        check_merged(merged)
        key = canon(merged)
        with s.cond:
            seg: Segments | None = s.replay.segments
            if seg is not None and seg.applied == key and (layout is None or ConsumerLayout.from_dict(layout) == s.layout):
                return {"num_consumers": s.layout.num_consumers, "replanned": 0, "segments": len(seg.closed) + 1}
            new_layout = s.layout if layout is None else ConsumerLayout.from_dict(layout)
            n_old = int(merged["num_consumers"])
            hist = merged.get("history")
            fresh = seg is None and not s.counts["admitted_minibatches"] and not s.replay.mb_records
            run = merged.get("run")
            mark = s.replay.run_mark
            if run is not None and mark is not None and run != mark:
                raise StateError(f"the merged state's run (mark {run}) is not this pipeline's (mark {mark}): "
                                 "states of another run (its first micro-batch differs: other puts or planning)")
            if hist is not None:
                self._check_history(hist)
            old_current: dict[str, Any]
            if fresh:
                old_current = (dict(hist["current"]) if hist is not None
                               else {"layout": _old_layout(merged, s.layout).to_dict(), "offset": 0,
                                     "start_fps": None})
                closed = list(hist["closed"]) if hist is not None else []
                root_whole = int(hist["root_whole"]) if hist is not None else 0
                replanned = 0
            else:
                mine = None if seg is None else seg.history()
                if canon(mine) != canon(hist) or _old_layout(merged, s.layout) != s.layout:
                    raise StateError(
                        f"the merged state ({n_old} ranks) is not of this pipeline's run and layout "
                        f"({s.layout.num_consumers} ranks, {'another' if mine is not None else 'no'} layout history): "
                        "states of another run, or taken before an earlier reshape")
                self._check_live(merged)
                old_current = {"layout": s.layout.to_dict(),
                               "offset": 0 if seg is None else int(seg.current.get("offset", 0)),
                               "start_fps": None if seg is None else seg.current.get("start_fps")}
                closed = [] if seg is None else [c.rec for c in seg.closed]
                root_whole = 0 if seg is None else seg.root_whole
                replanned = -1
            rec: dict[str, Any] = {**old_current, "positions": list(merged["positions"]),
                                   "fps": list(merged["fingerprints"])}
            start = int(old_current.get("offset") or 0)
            rem = merged.get("remainder")
            closes = True  # the old segment becomes the last closed one
            if all(p == start for p in rec["positions"]):
                closes = False  # nothing handed out in that segment: its remainders flow on into the new one
            elif rem is not None and all(p >= int(rem[1]) for p in rec["positions"]):
                # every rank consumed the remainders it received: this segment becomes the root
                root_whole = int(rem[0])
                closed = [{**rec, "offset": int(rem[1]), "start_fps": list(rem[2])}]
            else:
                closed.append(rec)
            if len(closed) >= MAX_SEGMENTS:
                raise StateError(f"the layout history would hold {len(closed) + 1} segments (at most {MAX_SEGMENTS}): "
                                 "the job was reshaped again and again before its ranks consumed the re-planned "
                                 "remainders; run at least one full mini-batch between reshapes")
            new_seg = Segments(root_whole, closed, {"layout": new_layout.to_dict(), "offset": 0, "start_fps": None},
                               s.planner)
            if not fresh and seg is not None:  # the closed segments kept go on where they are
                for i, c in enumerate(seg.closed):
                    if i < len(new_seg.closed) and canon(new_seg.closed[i].rec) == canon(c.rec):
                        new_seg.closed[i] = c
            if fresh:
                self._install(new_seg)
            else:
                replanned = self._reshape_live(merged, new_seg, new_layout, closes)
            new_seg.applied = key
            if s.replay.run_mark is None:  # the run goes on here: its states keep its mark
                s.replay.run_mark = run
            return {"num_consumers": new_layout.num_consumers, "replanned": replanned,
                    "segments": len(new_seg.closed) + 1}

    # -------------------------------------------------------------------------------- internals
    @staticmethod
    def _check_history(h: Any) -> None:
        try:
            ok = (isinstance(h, Mapping) and isinstance(h["root_whole"], int) and isinstance(h["closed"], list)
                  and all(isinstance(c, Mapping) and len(c["positions"]) == len(c["layout"]["nodes_of_ranks"])
                          for c in h["closed"])
                  and isinstance(h["current"]["layout"]["nodes_of_ranks"], list))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise StateError(f"bad layout history in the state: {h!r:.200}")

    def _install(self, seg: Segments) -> None:
        """Make ``seg`` the plane's history; the current segment's ranks start at its offset (fresh plane)."""
        s = self.s
        s.replay.segments = seg
        self._set_layout(ConsumerLayout.from_dict(seg.current["layout"]))
        off = int(seg.current.get("offset", 0))
        start = seg.current.get("start_fps")
        for r in range(s.layout.num_consumers):
            s.planned[r] = s.committed[r] = s.position[r] = off
            s.replay.start_at(r, off, FP_EMPTY if off == 0 else (None if start is None else start[r]))

    def _set_layout(self, layout: ConsumerLayout, force: bool = False) -> None:
        s = self.s
        if not force and layout == s.layout and len(s.queues) == layout.num_consumers:
            return
        s.layout = layout
        s.config["layout"] = layout.to_dict()
        s.planner = _planner_like(s.planner, layout)
        n = layout.num_consumers
        s.queues = [{} for _ in range(n)]
        s.entry_sums = [{} for _ in range(n)]
        s.planned, s.committed, s.position = [0] * n, [0] * n, [0] * n
        s.replay.reset(n)
        s.observed.resize(n, reset=True)
        s.replicas = None  # the new ranks' replicas register again (their first dataset does)

    def _check_live(self, merged: Mapping[str, Any]) -> None:
        s = self.s
        for r, p in enumerate(merged["positions"]):
            if p > s.planned[r]:
                raise StateError(f"rank {r}: its state lies at micro-batch {p} but this pipeline has planned only "
                                 f"{s.planned[r]} for it so far: the state is newer than this pipeline (saved later "
                                 "in the run than this pipeline has got: beyond the puts it has received, or after "
                                 "the checkpoint it was restored from). Load the states into a fresh pipeline before "
                                 "the refill (it plans from them), reshape this one once it has planned that far, or "
                                 "restore a checkpoint with the rank states saved with it")
            if p < s.committed[r]:
                raise StateError(f"rank {r}: its state lies at micro-batch {p}, before micro-batch {s.committed[r]} "
                                 "up to which its payloads were released (committed); it cannot be resumed here")
            f = merged["fingerprints"][r]
            if f is not None:
                have = s.fp(r, int(f[0]))
                if have is not None and have != f[1]:
                    raise StateError(f"rank {r}: the state's fingerprint of its first {f[0]} micro-batches differs "
                                     "from this pipeline's: a state of another run")

    def _reshape_live(self, merged: Mapping[str, Any], new_seg: Segments, layout: ConsumerLayout,
                      closes: bool) -> int:
        """Re-plan the queued mini-batches of a live plane for ``layout``; fence every iterator. ``closes``: the
        plane's segment is the last closed one of ``new_seg`` (later mini-batches pass it untouched)."""
        s = self.s
        pos = [int(p) for p in merged["positions"]]
        top = max(pos)
        work: list[tuple[Any, tuple[TrajectoryMeta, ...] | None]] = []
        records = s.replay.mb_records
        for m in sorted(records):
            mb, items, off, k, _refs = records[m]
            if off >= top:  # untouched: passes on as it was planned here
                work.append((mb, items))
                continue
            rest: list[TrajectoryMeta] = []
            for r, q in enumerate(s.queues):
                for j in range(off, off + k):
                    if j >= pos[r]:
                        e = q.get(j)
                        if e is None:
                            raise StateError(f"rank {r}: micro-batch {j} after its state's position {pos[r]} was "
                                             "already released; it cannot be resumed here")
                        rest.extend(s.live_metas(e.items))
            work.append((mb, _canonical(rest)) if rest else (mb, ()))
        for r, p in enumerate(pos):  # the handed-out micro-batches leave storage now
            s.commit_upto(r, p)
        records.clear()
        for lease in s.lease_book.leases.values():
            lease.fence_by = f"a reshape onto {layout.num_consumers} ranks"
        for key in [k for k in s.lease_book.leases if k.rank >= layout.num_consumers]:
            del s.lease_book.leases[key]
        first = s.planned[0] if s.planned else 0
        if closes:
            c = new_seg.closed[-1]
            c.counter = max(first, c.top)  # later mini-batches were never handed out in that layout
        s.replay.segments = new_seg
        self._set_layout(layout, force=True)
        n = 0
        for mb, items in work:
            if items == ():
                continue
            plan = s.planner.plan(mb, s.loss) if items is None else replan(s.planner, mb, items, s.loss)
            note_planned(s, mb, plan, items, s.planned[0])
            for rank, row in enumerate(plan.microbatches):
                s.queue_row(rank, row)
            s.forget_if_unqueued(int(mb.step))
            n += 1
        s.cond.notify_all()
        return n


def _old_layout(merged: Mapping[str, Any], plane_layout: ConsumerLayout) -> ConsumerLayout:
    """The layout the merged states were saved with (states without one: this plane's when it has as many
    ranks, else that many ranks on one node)."""
    if merged.get("layout") is not None:
        return layout_from_runs(merged["layout"])
    n = int(merged["num_consumers"])
    return plane_layout if plane_layout.num_consumers == n else ConsumerLayout.single_node(n)


# ----------------------------------------------------------------------------------------------- snapshots
def snapshot_part(s: PlaneState) -> dict[str, Any] | None:
    """The reshape part of a control-plane snapshot (``None`` for a plane never reshaped with nothing queued):
    the current layout, the segments with their run-time counters, and the records of the queued mini-batches."""
    seg: Segments | None = s.replay.segments
    records = [[m, mb.train_batch, mb.index, [t.to_dict() for t in mb.trajectories],
                list(getattr(mb, "group_sizes", ()) or ()), None if items is None else [t.id for t in items], off, k,
                refs] for m, (mb, items, off, k, refs) in sorted(s.replay.mb_records.items())]
    out: dict[str, Any] = {"layout": s.layout.to_dict(), "records": records, "segments": None,
                           "run": s.replay.run_mark}
    if seg is not None:
        out["segments"] = {
            "history": seg.history(), "counters": [[c.counter, list(c.chains)] for c in seg.closed],
            "first_whole": seg.first_whole, "remainder_entries": seg.remainder_entries,
            "remainder_fps": seg.remainder_fps, "applied": seg.applied,
        }
    return out


def snapshot_layout(part: Any) -> ConsumerLayout | None:
    """The current layout a snapshot's reshape part names (``None``: the plane's own).

    Raises:
        StateError: A malformed part.
    """
    if part is None:
        return None
    try:
        return ConsumerLayout.from_dict(part["layout"])
    except (KeyError, TypeError, ValueError, KnitdataError) as e:
        raise StateError(f"control-plane snapshot: bad reshape part ({type(e).__name__}: {e})") from e


def load_snapshot_part(s: PlaneState, part: Any) -> None:
    """Restore what :func:`snapshot_part` saved (after the rest of the snapshot was loaded).

    Raises:
        StateError: A malformed part.
    """
    layout = snapshot_layout(part)
    if layout is None:  # a snapshot of format 1 or 2: never reshaped; records rebuilt from the queues
        s.replay.mb_records, s.replay.segments = _records_from_queues(s), None
        _adopt_layout(s, ConsumerLayout.from_dict(s.base_layout))
        return
    try:
        records: dict[int, list[Any]] = {}
        for m, b, i, metas, sizes, items, off, k, refs in part["records"]:
            trajs = tuple(TrajectoryMeta.from_dict(d) for d in metas)
            by_id = {t.id: t for t in trajs}
            mb = AdmittedMiniBatch(int(b), int(i), int(m), trajs, group_sizes=tuple(int(x) for x in sizes))
            rest = None if items is None else tuple(by_id[str(x)] for x in items)
            records[int(m)] = [mb, rest, int(off), int(k), int(refs)]
        segp = part["segments"]
        seg = None
        if segp is not None:
            h = segp["history"]
            seg = Segments(int(h["root_whole"]), h["closed"], h["current"], s.planner)
            for c, (counter, chains) in zip(seg.closed, segp["counters"]):
                c.counter, c.chains = int(counter), list(chains)
            seg.first_whole, seg.remainder_entries = segp["first_whole"], segp["remainder_entries"]
            seg.remainder_fps, seg.applied = segp["remainder_fps"], segp["applied"]
    except (KeyError, TypeError, ValueError, IndexError, KnitdataError) as e:
        raise StateError(f"control-plane snapshot: bad reshape part ({type(e).__name__}: {e})") from e
    replay = s.replay
    replay.mb_records, replay.segments = records, seg
    replay.run_mark = part.get("run") if isinstance(part.get("run"), str) else None
    _adopt_layout(s, layout)


def _records_from_queues(s: PlaneState) -> dict[int, list[Any]]:
    """Records of the queued mini-batches from the entries alone (a snapshot of format 1 or 2 has none): their
    trajectories in ``(seq, id)`` order, not as admitted, so a later live reshape plans an untouched one from
    that order."""
    found: dict[int, list[Any]] = {}
    for q in s.queues:
        for e in q.values():
            info = e.info
            rec = found.setdefault(e.minibatch, [info, [], e.j - info.microbatch, info.num_microbatches, 0])
            rec[1].extend(s.live_metas(e.items))
            rec[4] += 1
    return {m: [AdmittedMiniBatch(info.train_batch, info.minibatch_in_batch, m, _canonical(metas)), None, off,
                k, refs] for m, (info, metas, off, k, refs) in found.items()}


def _adopt_layout(s: PlaneState, layout: ConsumerLayout) -> None:
    if layout != s.layout:
        s.layout = layout
        s.config["layout"] = layout.to_dict()
        s.planner = _planner_like(s.planner, layout)
