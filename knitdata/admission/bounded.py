"""The staleness-bound part of the admission policies (:class:`BoundedAdmission`) and their ready groups."""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from knitdata.admission.bound import StalenessBound, check_counts, check_settings
from knitdata.admission.composition import even_completion
from knitdata.admission.spec import BatchSpec
from knitdata.errors import ConfigError, StateError, ValidationError
from knitdata.record import TrajectoryMeta

__all__ = ["ReadyGroup", "BoundedAdmission"]


@dataclass(slots=True)
class ReadyGroup:
    """A whole group that finished and waits for admission (``seq``: arrival order of its first member)."""

    seq: int
    group: str
    source: str
    metas: tuple[TrajectoryMeta, ...]
    version: int = field(default=0)
    gone: bool = field(default=False)  # admitted, withdrawn or dropped: lazily skipped in the queues



class BoundedAdmission:
    """The staleness-bound part of :class:`AdmissionPolicy` (:mod:`knitdata.admission.bound`): the rollout throttle
    and the groups dropped for regeneration. Every policy has these methods; they raise
    :class:`~knitdata.errors.ConfigError` (or return nothing) without ``max_staleness``."""

    _bound: StalenessBound | None
    _loading: bool
    _Q: dict[str, int]
    _b: int
    _admitted: dict[str, int]
    _ready_n: dict[str, int]
    _ready_groups: dict[str, ReadyGroup]
    _pending_groups: dict[str, int]
    _in_flight: dict[str, int] | None
    preserves_quotas: bool
    _bounds: dict[str, tuple[int, int]]
    _M: int
    _mm: int
    _k: int
    spec: BatchSpec

    @property
    def step(self) -> int:
        """Global index of the next mini-batch (:class:`AdmissionPolicy` defines it)."""
        raise NotImplementedError

    def _init_bound(self, max_staleness: Any, on_stale: str, version_offset: int | None, oldest_first: bool) -> None:
        check_settings(max_staleness, on_stale, version_offset, self.spec.sources)
        per_step = {s: self.spec.group_bounds(s)[1] for s in self._Q}
        self._bound = None if max_staleness is None else StalenessBound(max_staleness, on_stale, version_offset,
                                                                        self._Q, self.spec.num_minibatches, per_step)
        self.max_staleness = self._bound.eta if self._bound is not None else None
        self.on_stale, self.version_offset = on_stale, version_offset
        # with a bound, quota-preserving policies (and fifo in wait mode) take each source's oldest group first
        self._oldest_first = self._bound is not None and (oldest_first or on_stale == "wait")
        self._by_version: dict[str, list[tuple[int, int, ReadyGroup]]] = {s: [] for s in self._Q}
        self._loading = False
        self._max_reported: int | None = None  # the newest version the trainer reported (note_version)
        self._plan_key: tuple[int, int] | None = None
        self._plan_cache: list[dict[str, int]] = []

    def _track(self, grp: ReadyGroup) -> None:
        if self._bound is not None:
            self._bound.push(grp)
            if self._oldest_first:
                heapq.heappush(self._by_version[grp.source], (grp.version, grp.seq, grp))

    def _check_bound_state(self, state: Mapping[str, Any]) -> Any:
        bound = state.get("bound")
        mine = None if self._bound is None else self._bound.settings()
        theirs = None if bound is None else [bound["max_staleness"], bound["on_stale"], bound["version_offset"]]
        if mine != theirs:
            raise StateError(f"state has staleness bound {theirs} (max_staleness, on_stale, version_offset), this "
                             f"policy has {mine}")
        return bound

    def rollout_capacity(self, version: int) -> dict[str, int]:
        """Groups per source that may still start with policy ``version`` and be admitted within the bound, on the
        schedule this policy will admit: a group of source ``s`` started now may join the next ``W_s = version +
        eta_s + 1 - offset - step`` steps (:meth:`StalenessBound.window
        <knitdata.admission.bound.StalenessBound.window>`); the capacity is what the policy's plan of those steps
        holds of ``s`` minus the groups of ``s`` ready, in incomplete groups or reserved. The plan: the rest of the
        current train batch as the policy will take it (linear-target: its fixed schedule; the others: the even
        completion of what is left of each quota, :func:`~knitdata.admission.even_completion`, whose first column
        the policy admits as soon as it is ready), then the even schedule of the quotas for each later train batch
        (AReaL's rule, at most ``(eta + v + 1) * batch`` started by version ``v``, per source). In wait mode it is
        also at most what those steps hold beside the committed groups of every source that must join by then
        (:meth:`StalenessBound.room <knitdata.admission.bound.StalenessBound.room>`). Fifo ignores quotas:
        one room of ``m / g`` groups per step, shared by the sources. So while admission waits for a step and every
        reservation was delivered, a producer at the trainer's version gets room for what that step needs.

        Raises:
            ConfigError: No bound (``max_staleness`` is ``None``).
        """
        return self._capacity(version)[0]

    def _capacity(self, version: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """:meth:`rollout_capacity`, the room beside the committed groups and what the next step needs, per
        source."""
        bound = self._need_bound()
        t = self.step
        windows = {s: bound.window(version, s, t) for s in self._Q}
        if not self.preserves_quotas:  # fifo: one shared room
            occ = sum(self._ready_n.values()) + sum(self._pending_groups.values()) + sum(bound.reserved.values())
            caps = {s: max(0, windows[s] * self._mm - occ) for s in self._Q}
            return caps, caps, dict.fromkeys(caps, 0)
        cum = self._plan_cum()
        K = len(cum) - 1
        floors = {s: lo for s, (lo, _) in self._bounds.items()}
        # wait mode: beside the committed groups of every source and what the steps must take of each anyway
        room = bound.room(t, self._mm, windows, floors,
                          self._forced(self._remaining(), self._M - self._k - 1, inclusive=True))
        have = {s: self._ready_n[s] + self._pending_groups[s] + bound.reserved[s] for s in self._Q}
        need = self._needed(have)
        out: dict[str, int] = {}
        nows: dict[str, int] = {}
        for s, Q in self._Q.items():
            W = windows[s]
            if W <= K:
                p = cum[W][s]
            else:
                n, r = divmod(W - K, self._M)
                p = cum[K][s] + Q * n + bound.schedule_cum[r][s]
            # the room never withholds what admission needs for its next step (no deadlock, even over-committed)
            now = nows[s] = max(0, min(need[s], p - have[s]) if W >= 1 else 0)
            out[s] = max(0, min(p - have[s], room[s]), now)
        return out, room, nows

    def _needed(self, have: Mapping[str, int]) -> dict[str, int]:
        """Groups of each source the next step cannot be admitted without, beyond the ``have`` committed ones: the
        step takes what its composition limits require of each source and the committed groups it can hold; what
        that leaves empty goes, first come first served, to the sources short of their share of the plan. So a
        source whose slot a committed group of another source fills gets nothing (a group started for it would
        expire). Train batch and linear target override this."""
        K, rem = self._M - self._k - 1, self._remaining()
        col = self._plan_cum()[1]
        x: dict[str, int] = {}
        for s, R in rem.items():
            L, H = self._bounds[s]
            lo, hi = max(L, R - K * H), min(H, R - K * L)
            x[s] = max(lo, min(have[s], hi))
        left = max(0, self._mm - sum(x.values()))
        return {s: max(0, x[s] - have[s]) + min(left, max(0, col[s] - x[s])) for s in self._Q}

    def _plan_cum(self) -> list[dict[str, int]]:
        """Cumulative groups per source of the rest of the current train batch as the policy plans it (cached)."""
        key = (self._b, self._k)
        if self._plan_key != key:
            cum = [dict.fromkeys(self._Q, 0)]
            for col in self._plan_columns():
                cum.append({s: cum[-1][s] + col[s] for s in self._Q})
            self._plan_cache, self._plan_key = cum, key
        return self._plan_cache

    def _plan_columns(self) -> list[dict[str, int]]:
        """The compositions the policy plans for the rest of the current train batch (default: the even completion
        of what is left of each quota; its first column is always admissible)."""
        return even_completion(self._remaining(), self._M - self._k)

    def _remaining(self) -> dict[str, int]:
        return {s: self._Q[s] - self._admitted[s] for s in self._Q}

    def out_of_reach(self, counts: Mapping[str, int], version: int) -> str | None:
        """Why ``counts`` can never be reserved with policy ``version`` (``None`` when it may fit, now or later): a
        source asked for whose bound's window (:meth:`StalenessBound.window
        <knitdata.admission.bound.StalenessBound.window>`) is already empty with the trainer's offset known (given
        or learned); the step only grows, so waiting cannot help. ``None`` without a bound."""
        b = self._bound
        if b is None or b.offset is None or b.stats()["offset_mode"] not in ("given", "learned"):
            return None
        t = self.step
        for src, n in counts.items():
            if not n or src not in b.etas or b.window(version, src, t) > 0:
                continue
            eta = b.etas[src]
            return (f"source {src!r} cannot start prompts with policy version {version}: the trainer is at version "
                    f"{b.offset + t} (step {t}, version offset {b.offset}) and max_staleness {eta} admits groups of "
                    f"version >= {b.offset + t - eta} from now on; waiting cannot help (the step only grows): "
                    "generate with newer weights")
        return None

    def reserve(self, counts: Mapping[str, int], version: int) -> bool:
        """Reserve ``counts`` groups per source to start with ``version`` if :meth:`rollout_capacity` has room for all
        (all or nothing); a reservation ends when a new group of that source arrives, or with :meth:`unreserve`.

        Raises:
            ValidationError: A bad count, or more groups of a source than the bound could ever give at once (its
                window of ``eta_s + 1`` steps never holds that many: waiting would be in vain).
        """
        bound = self._need_bound()
        want = check_counts(counts, self.spec.sources, "reserve")
        for s, n in want.items():
            most = bound.most(s, self._mm) if self.preserves_quotas else (bound.etas[s] + 1) * self._mm
            if n > most or (not self.preserves_quotas and sum(want.values()) > most):
                raise ValidationError(
                    f"reserve: {sum(want.values()) if not self.preserves_quotas else n} groups of {s!r} can never fit "
                    f"within max_staleness {bound.etas[s]}: its window of {bound.etas[s] + 1} steps holds at most "
                    f"{most} (quota {self._Q[s]} per train batch of {self._M} mini-batches); reserve fewer at a time",
                    field=f"counts.{s}")
        if self.preserves_quotas and sum(1 for n in want.values() if n) > 1:
            return self._reserve_each(want, version)
        caps, room, _ = self._capacity(version)
        total = None
        if want and not self.preserves_quotas:  # fifo: the sources share one room
            total = min(room[s] for s in want)
        return bound.reserve(want, caps, version, total)

    def _reserve_each(self, want: Mapping[str, int], version: int) -> bool:
        """Reserve groups of several sources one at a time, each within the capacity the ones before leave (they
        share the steps' room, and what the next step needs), all or nothing."""
        bound = self._need_bound()
        saved = dict(bound.reserved), {s: list(v) for s, v in bound.outstanding.items()}
        left = {s: n for s, n in want.items() if n}
        while left:
            took = False
            for s in list(left):
                if bound.reserve({s: 1}, self._capacity(version)[0], version):
                    took = True
                    left[s] -= 1
                    if not left[s]:
                        del left[s]
            if not took:
                bound.reserved, bound.outstanding = saved
                return False
        return True

    def unreserve(self, counts: Mapping[str, int]) -> None:
        """Give back reservations of prompts that will not be generated (floored at 0)."""
        self._need_bound().unreserve(check_counts(counts, self.spec.sources, "unreserve"))

    def take_dropped(self) -> list[dict[str, Any]]:
        """The groups dropped by the bound since the last call, for the producer to regenerate (as new groups)."""
        return [] if self._bound is None else self._bound.take_dropped()

    def pop_released(self) -> list[TrajectoryMeta]:
        """The members of groups dropped since the last call (the caller frees their payloads)."""
        return [] if self._bound is None else self._bound.pop_released()

    def note_version(self, version: int, done_lo: int = 0, done_hi: int | None = None) -> str | None:
        """The trainer reported ``version`` after finishing ``done_lo`` (its slowest rank) to ``done_hi`` (its fastest)
        steps. With a staleness bound, later trajectories newer than it (beyond
        :data:`~knitdata.admission.bound.FUTURE_SLACK`) are refused as versions from the future, and the first report learns the bound's offset (``version_offset=None``: the
        trainer's version at step 0 is ``version - done_lo``) or checks the given one.

        Returns:
            The message when a mini-batch admitted before the report broke the bound under the trainer's real
            versions, or ``version_offset`` understates them (the caller stops the pipeline with it); else ``None``.
        """
        self._max_reported = version if self._max_reported is None else max(self._max_reported, version)
        if self._bound is None:
            return None
        return self._bound.note_version(version, done_lo, done_lo if done_hi is None else done_hi)

    def note_planned(self, microbatches: int) -> None:
        """The mini-batch just admitted was planned into ``microbatches`` micro-batches per rank (the bound counts
        the steps a trainer finished from its hand-outs until its first version report)."""
        if self._bound is not None:
            self._bound.note_planned(microbatches)

    def note_handed(self, rank: int, j: int, version: int = -1) -> str | None:
        """Rank ``rank`` handed out its micro-batch ``j`` under ``version`` (the version its process last reported;
        ``-1``: none yet): the bound learns (or checks) its offset from it (see :meth:`note_version`).

        Returns:
            An error message as :meth:`note_version`, else ``None``.
        """
        if self._bound is None:
            return None
        if version < 0:
            self._bound.note_handed(rank, j + 1)
            return None
        return self._bound.note_handout(j, version)

    def note_resumed(self, rank: int, steps: int) -> None:
        """Rank ``rank`` loaded a state saved after ``steps`` finished mini-batches: until the first version report
        the bound counts them as steps its trainer finished (see :meth:`done_before_report`)."""
        if self._bound is not None:
            self._bound.note_resumed(rank, steps)

    def done_before_report(self, ranks: int) -> tuple[int, int]:
        """The fewest and most admitted steps ``ranks`` ranks finished before their first version report."""
        return (0, 0) if self._bound is None else self._bound.done_before_report(ranks)

    def bound_stats(self) -> dict[str, Any] | None:
        """The bound's settings and drops per source (``None`` without a bound)."""
        return None if self._bound is None else self._bound.stats()

    def _due(self) -> bool:
        """Wait mode: a source with room in this step has a reserved or incomplete group that must join it."""
        b = self._bound
        if b is None or b.on_stale != "wait":
            return False
        t = self.step
        return any((not self.preserves_quotas or self._Q[s] > self._admitted[s]) and b.due(t, s) for s in self._Q)

    def _forced(self, rem: Mapping[str, int], K: int, inclusive: bool = False) -> dict[str, list[int]]:
        """Per source, what the ``n`` steps after this one (``inclusive``: this one and the ``n - 1`` after it; ``n``
        up to the bound's reach) must take of it whatever this step takes: its lower bounds, and in this train batch
        what its quota leaves no room to put later (``rem``: left of each quota, ``K``: steps after this one in the
        train batch)."""
        assert self._bound is not None
        top = max(self._bound.etas.values()) + 3
        span = K + 1 if inclusive else K  # the steps of the train batch that n counts from
        out: dict[str, list[int]] = {}
        for s, R in rem.items():
            L, H = self._bounds[s]
            row = [max(n * L, R - (span - n + (0 if inclusive else 1)) * H) if n <= span else 0
                   for n in range(top + 1)]
            for n in range(span + 1, top + 1):
                row[n] = row[span] + (n - span) * L
            out[s] = [max(0, x) for x in row]
        return out

    def _need_bound(self) -> StalenessBound:
        if self._bound is None:
            raise ConfigError("this needs a staleness bound: build the policy (or Pipeline) with max_staleness=eta")
        return self._bound

    def _expired(self, version: int, source: str) -> bool:
        return self._bound is not None and not self._loading and self._bound.expired(version, self.step, source)

    def _drop(self, grp: ReadyGroup) -> None:
        grp.gone = True
        assert self._bound is not None
        s = grp.source
        self._bound.drop(grp.group, s, grp.version, grp.metas, self.step,
                         self._ready_n[s] == 0 and self._Q[s] > self._admitted[s])
        if self._in_flight is not None:  # regeneration is coming: the supply check counts it
            self._in_flight[grp.source] = self._in_flight.get(grp.source, 0) + len(grp.metas)

    def _expire(self) -> None:
        if self._bound is None:
            return
        for grp in list(self._bound.expiring(self.step)):
            self._ready_n[grp.source] -= 1
            self._bound.unready(grp.source, grp.version)
            del self._ready_groups[grp.group]
            self._drop(grp)
