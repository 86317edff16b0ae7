"""The base of the admission policies: ready groups per source, quotas, in-flight counts, state."""

from __future__ import annotations

import abc
import heapq
import operator
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from knitdata.admission.bound import FUTURE_SLACK, StalenessBound, check_counts, check_settings
from knitdata.admission.composition import completion_exists, even_completion
from knitdata.admission.spec import AdmittedMiniBatch, BatchSpec
from knitdata.errors import ConfigError, KnitdataError, QuotaInfeasibleError, StateError, ValidationError
from knitdata.record import TrajectoryMeta

__all__ = ["ReadyGroup", "AdmissionPolicy", "BoundedAdmission"]


def _count(x: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    """An int of a loaded state in ``lo..hi`` (:class:`~knitdata.errors.StateError` otherwise)."""
    if isinstance(x, bool) or not isinstance(x, int) or x < lo or (hi is not None and x > hi):
        raise StateError(f"{what} must be an int in {lo}..{'' if hi is None else hi}, got {str(x)[:50]}")
    return x


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
        (AReaL's rule, at most ``(eta + v + 1) * batch`` started by version ``v``, per source). Fifo ignores quotas:
        one room of ``m / g`` groups per step, shared by the sources. So while admission waits for a step and every
        reservation was delivered, a producer at the trainer's version gets room for what that step needs.

        Raises:
            ConfigError: No bound (``max_staleness`` is ``None``).
        """
        bound = self._need_bound()
        t = self.step
        if not self.preserves_quotas:  # fifo: one shared room
            occ = sum(self._ready_n.values()) + sum(self._pending_groups.values()) + sum(bound.reserved.values())
            return {s: max(0, bound.window(version, s, t) * self._mm - occ) for s in self._Q}
        cum = self._plan_cum()
        K = len(cum) - 1
        out: dict[str, int] = {}
        for s, Q in self._Q.items():
            W = bound.window(version, s, t)
            if W <= K:
                p = cum[W][s]
            else:
                n, r = divmod(W - K, self._M)
                p = cum[K][s] + Q * n + bound.schedule_cum[r][s]
            out[s] = max(0, p - self._ready_n[s] - self._pending_groups[s] - bound.reserved[s])
        return out

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
        return bound.reserve(want, self.rollout_capacity(version), not self.preserves_quotas, version)

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

    def steps_done(self, position: int) -> int:
        """Admitted steps wholly before a rank's hand-out ``position`` (until the first report; else 0)."""
        return 0 if self._bound is None else self._bound.steps_done(position)

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
            del self._ready_groups[grp.group]
            self._drop(grp)


def _check_completable(p: AdmissionPolicy) -> None:
    """Raise :class:`~knitdata.errors.StateError` unless what is left of ``p``'s quotas fills its mini-batches left
    within the bounds: every state of a policy that keeps its train batch completable does (``keeps_completable``)."""
    left = p._M - p._k
    if not completion_exists(p._remaining(), left, p._mm, p._bounds):
        raise StateError(
            f"admitted {p._admitted} (groups of {p._g}) after {p._k} of {p._M} mini-batches leaves quotas {p._Q} that "
            f"{left} mini-batches of {p._mm} groups cannot complete within the bounds {p._bounds}: not a state of the "
            f"{p.name} policy")


class AdmissionPolicy(BoundedAdmission, abc.ABC):
    """Base class of the admission policies: holds ready groups and emits mini-batches in order.

    Args:
        spec: The batch specification.
        continuous: ``True`` for a continuous (oversampled) prompt stream: surplus ready trajectories
            carry over to the next train batch and a source that is short of its quota makes admission
            wait instead of raising (rollout can always deliver more). With ``False`` (default),
            :class:`~knitdata.errors.QuotaInfeasibleError` is raised as soon as a source's ready plus
            in-flight trajectories (see :meth:`set_in_flight`) cannot cover its remaining quota. Surplus
            ready groups carry over in both modes.
        max_staleness: ``eta``: never admit a trajectory staler than this many versions, as the trainer reports
            them (``None``: no bound; an int, or ``{source: int}`` naming every source; see
            :mod:`knitdata.admission.bound`). A complete group past it is dropped whole (:meth:`take_dropped`);
            quota-preserving policies then take each source's oldest groups first.
        on_stale: ``"drop"`` or ``"wait"`` (producers also :meth:`reserve` within :meth:`rollout_capacity`; needs
            ``max_staleness``).
        version_offset: The trainer's version at the first mini-batch (step 0); ``None``: learned from the
            trainer's first report (:meth:`note_version`; :class:`~knitdata.Pipeline` does this by default).

    Protocol: call :meth:`offer` with finished trajectories (a group becomes admissible once all its
    ``group_size`` members arrived), optionally :meth:`set_in_flight`, :meth:`withdraw` dropped groups,
    and :meth:`poll` to receive every mini-batch that can be admitted now, in order.
    """

    name: str = ""
    preserves_quotas: bool = True
    keeps_completable: bool = False  #: a loaded state must leave its train batch completable (see _check_completable)

    def __init__(self, spec: BatchSpec, *, continuous: bool = False,
                 max_staleness: int | Mapping[str, int] | None = None, on_stale: str = "drop",
                 version_offset: int | None = 0) -> None:
        if not isinstance(spec, BatchSpec):
            raise ConfigError(f"{type(self).__name__} needs a BatchSpec, got {type(spec).__name__}")
        self.spec = spec
        self.continuous = bool(continuous)
        g = spec.group_size
        self._g = g
        self._M = spec.num_minibatches
        self._mm = spec.minibatch_size // g
        self._Q = {s: q // g for s, q in spec.quotas.items()}
        self._bounds = {s: spec.group_bounds(s) for s in spec.sources}
        self._pending: dict[str, list[TrajectoryMeta]] = {}
        self._pending_members: dict[str, int] = dict.fromkeys(spec.sources, 0)
        self._ready: dict[str, deque[ReadyGroup]] = {s: deque() for s in spec.sources}
        self._ready_n: dict[str, int] = dict.fromkeys(spec.sources, 0)
        self._ready_groups: dict[str, ReadyGroup] = {}
        self._pending_ids: dict[str, set[str]] = {}
        self._admitted: dict[str, int] = dict.fromkeys(spec.sources, 0)
        self._in_flight: dict[str, int] | None = None
        self._b = 0
        self._k = 0
        self._seq = 0
        self._pending_groups: dict[str, int] = dict.fromkeys(spec.sources, 0)
        self._init_bound(max_staleness, on_stale, version_offset, self.preserves_quotas)

    # -- properties ------------------------------------------------------------------------------------
    @property
    def train_batch(self) -> int:
        """Index of the train batch being admitted now."""
        return self._b

    @property
    def minibatch_index(self) -> int:
        """Index ``k`` of the next mini-batch within the current train batch."""
        return self._k

    @property
    def step(self) -> int:
        """Global index of the next mini-batch."""
        return self._b * self._M + self._k

    def ready_counts(self) -> dict[str, int]:
        """Ready (complete, not admitted) trajectories per source."""
        return {s: n * self._g for s, n in self._ready_n.items()}

    def admitted_counts(self) -> dict[str, int]:
        """Trajectories per source admitted so far in the current train batch."""
        return {s: n * self._g for s, n in self._admitted.items()}

    def remaining_quota(self) -> dict[str, int]:
        """Trajectories per source still to admit in the current train batch."""
        return {s: (self._Q[s] - self._admitted[s]) * self._g for s in self._Q}

    # -- input ----------------------------------------------------------------------------------------
    def offer(self, metas: Iterable[TrajectoryMeta]) -> None:
        """Hand over finished trajectories' metadata.

        Raises:
            ValidationError: An unknown source, a trajectory id offered twice within its group, a member
                of a group that is already complete and waiting, or a group whose members name different
                sources. (Ids are not tracked across groups: that would cost a hash lookup per trajectory
                on a set of size ``B / M``; the producer keeps ids unique, the policy keeps groups unique.)
        """
        g = self._g
        for t in metas:
            if not isinstance(t, TrajectoryMeta):
                raise ValidationError(f"offer() takes TrajectoryMeta objects, got {type(t).__name__}", field="meta")
            if t.source not in self._Q:
                raise ValidationError(
                    f"unknown source {t.source!r}; the batch spec knows {list(self._Q)}",
                    trajectory_id=t.id,
                    field="source",
                )
            if t.group in self._ready_groups:
                raise ValidationError(
                    f"group {t.group!r} is already complete with {g} members", trajectory_id=t.id, field="group"
                )
            if self._bound is not None and self._max_reported is not None and not self._loading and \
                    t.gen_version > self._max_reported + FUTURE_SLACK:
                raise ValidationError(
                    f"gen_version {t.gen_version} is newer than any version the trainer reported (newest "
                    f"{self._max_reported}): a version from the future (does the producer count versions as the "
                    "trainer's report_version does?)", trajectory_id=t.id, field="gen_version")
            members = self._pending.get(t.group)
            if members is None:
                members = self._pending[t.group] = []
                ids = self._pending_ids[t.group] = set()
                self._pending_groups[t.source] += 1
                if self._bound is not None:
                    self._bound.arrived(t.source, t.gen_version)
            elif members[0].source != t.source:
                raise ValidationError(
                    f"group {t.group!r} mixes sources {members[0].source!r} and {t.source!r}",
                    trajectory_id=t.id,
                    field="source",
                )
            else:
                ids = self._pending_ids[t.group]
                if t.id in ids:
                    raise ValidationError(
                        f"offered twice (group {t.group!r} is waiting for its other members)", trajectory_id=t.id
                    )
            members.append(t)
            ids.add(t.id)
            self._pending_members[t.source] += 1
            if len(members) == g:
                del self._pending[t.group]
                del self._pending_ids[t.group]
                self._pending_members[t.source] -= g
                self._pending_groups[t.source] -= 1
                grp = ReadyGroup(self._seq, t.group, t.source, tuple(members), min(x.gen_version for x in members))
                self._seq += 1
                if self._bound is not None:
                    self._bound.settled(t.source, members[0].gen_version)
                if self._bound is not None and not self._loading:
                    self._bound.offered(grp.version, self.step)
                if self._expired(grp.version, grp.source):
                    self._drop(grp)
                    continue
                self._ready[t.source].append(grp)
                self._ready_n[t.source] += 1
                self._ready_groups[t.group] = grp
                self._track(grp)

    def set_in_flight(self, counts: Mapping[str, int]) -> None:
        """Tell how many trajectories per source are in flight or still to dispatch for this train batch.

        Counts refer to the current train batch and are cleared when it completes (until set again, the
        rest of each quota is assumed to be coming). Sources not named count as 0.

        Raises:
            QuotaInfeasibleError: (quota-preserving policies, non-continuous mode) a source can no longer
                deliver its remaining quota.
        """
        if not isinstance(counts, Mapping):
            raise ValidationError(f"set_in_flight takes a mapping {{source: count}}, got {type(counts).__name__}",
                                  field="counts")
        c: dict[str, int] = dict.fromkeys(self._Q, 0)
        for s, n in counts.items():
            if s not in c:
                raise ValidationError(f"set_in_flight: unknown source {s!r}; known {list(self._Q)}", field="source")
            try:
                n = operator.index(n)  # ints, numpy ints; not floats, strings or None
            except TypeError:
                raise ValidationError(f"set_in_flight: count for {s!r} must be an int, got {n!r}", field="source") from None
            if int(n) < 0:
                raise ValidationError(f"set_in_flight: count for {s!r} is negative ({n})", field="source")
            c[s] = int(n)
        self._in_flight = c
        self._check_supply()

    def withdraw(self, group: str) -> list[TrajectoryMeta]:
        """Drop a group (rollout aborted it or a filter rejected it).

        Returns:
            The members that were waiting (pending or ready); ``[]`` if the group is unknown or already
            admitted. Does not raise on supply: the next :meth:`poll` or :meth:`set_in_flight` does.
        """
        members = self._pending.pop(group, None)
        if members is not None:
            if self._bound is not None:
                self._bound.settled(members[0].source, members[0].gen_version)
            del self._pending_ids[group]
            self._pending_members[members[0].source] -= len(members)
            self._pending_groups[members[0].source] -= 1
            return list(members)
        grp = self._ready_groups.pop(group, None)
        if grp is None:
            return []
        self._ready_n[grp.source] -= 1
        out: list[TrajectoryMeta] = list(grp.metas)
        grp.metas = ()  # lazily skipped when it reaches the deque head
        grp.gone = True
        return out

    # -- output ---------------------------------------------------------------------------------------
    def poll(self, now: float | None = None) -> list[AdmittedMiniBatch]:
        """Admit every mini-batch that can be admitted now, in order.

        Args:
            now: A timestamp recorded as ``admitted_at``.

        Raises:
            QuotaInfeasibleError: see :meth:`set_in_flight`.
        """
        out: list[AdmittedMiniBatch] = []
        while True:
            self._expire()
            self._check_supply()
            if self._bound is not None and (self._bound.holds(self.step) or self._due()):
                break  # the trainer's version offset is unknown, or a committed group must join this step
            counts = self._choose()
            if counts is None:
                break
            out.append(self._emit(counts, now))
        return out

    @abc.abstractmethod
    def _choose(self) -> dict[str, int] | list[ReadyGroup] | None:
        """Composition of the next mini-batch in groups per source (or the groups), or ``None`` to wait."""

    # -- helpers ------------------------------------------------------------------------------------
    def _head(self, s: str) -> ReadyGroup | None:
        dq = self._ready[s]
        while dq and dq[0].gone:
            dq.popleft()
        if self._oldest_first:  # with a bound: the source's oldest group first
            h = self._by_version[s]
            while h and h[0][2].gone:
                heapq.heappop(h)
            return h[0][2] if h else None
        return dq[0] if dq else None

    def _pop(self, s: str) -> ReadyGroup:
        grp = self._head(s)
        assert grp is not None, "ready counter out of sync"
        if self._oldest_first:
            heapq.heappop(self._by_version[s])
        else:
            self._ready[s].popleft()
        grp.gone = True
        self._ready_n[s] -= 1
        del self._ready_groups[grp.group]
        return grp

    def _check_supply(self) -> None:
        if self.continuous or not self.preserves_quotas or self._in_flight is None:
            return
        for s, Q in self._Q.items():
            need = Q - self._admitted[s]
            if need <= 0:
                continue
            coming = (self._pending_members[s] + self._in_flight.get(s, 0)) // self._g
            if self._ready_n[s] + coming < need:
                raise QuotaInfeasibleError(
                    f"source {s!r} cannot meet its quota in train batch {self._b}: it still needs "
                    f"{need * self._g} trajectories but has {self._ready_n[s] * self._g} ready, "
                    f"{self._pending_members[s]} in incomplete groups and {self._in_flight.get(s, 0)} in flight; "
                    f"dispatch more prompts of {s!r} (oversample) or lower its quota"
                )

    def _compose(self, lo: Mapping[str, int], hi: Mapping[str, int]) -> list[ReadyGroup]:
        """Take ``lo_s`` groups of every source, then fill by preference up to ``hi_s``.

        Preference: oldest ``gen_version`` at the head of the source's queue (with a bound: the earliest to expire,
        ``gen_version + eta_s``), then the source furthest behind its linear target ``(k+1) q_s / M``, then arrival
        order.
        """
        etas = self._bound.etas if self._bound is not None else dict.fromkeys(self._Q, 0)
        taken: list[ReadyGroup] = []
        x = dict.fromkeys(self._Q, 0)
        for s, n in lo.items():
            for _ in range(n):
                taken.append(self._pop(s))
            x[s] = n
        left = self._mm - len(taken)
        k1, M = self._k + 1, self._M
        heap: list[tuple[int, float, int, str]] = []

        def push(s: str) -> None:
            if x[s] < hi[s]:
                h = self._head(s)
                if h is not None:
                    behind = k1 * self._Q[s] / M - (self._admitted[s] + x[s])
                    heapq.heappush(heap, (h.version + etas[s], -behind, h.seq, s))

        for s in self._Q:
            push(s)
        while left > 0:
            _, _, _, s = heapq.heappop(heap)
            taken.append(self._pop(s))
            x[s] += 1
            left -= 1
            push(s)
        return taken

    def _emit(self, choice: dict[str, int] | list[ReadyGroup], now: float | None) -> AdmittedMiniBatch:
        if isinstance(choice, dict):
            groups = self._compose(choice, choice)
        else:
            groups = choice
        trajs: list[TrajectoryMeta] = []
        bound, step = self._bound, self.step
        for grp in groups:
            self._admitted[grp.source] += 1
            trajs.extend(grp.metas)
            if bound is not None:
                bound.note_admitted(step, grp.metas, grp.source)
        mb = AdmittedMiniBatch(self._b, self._k, self._b * self._M + self._k, tuple(trajs), now,
                               tuple(len(grp.metas) for grp in groups))
        self._k += 1
        if self._k == self._M:
            self._k = 0
            self._b += 1
            self._admitted = dict.fromkeys(self._Q, 0)
            self._in_flight = None
        return mb

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return a JSON-serializable snapshot (pending and ready metadata included)."""
        ready: list[list[Any]] = []
        for s in self._Q:
            for grp in self._ready[s]:
                if not grp.gone:
                    ready.append([grp.seq, grp.group, [t.to_dict() for t in grp.metas]])
        ready.sort(key=lambda r: int(r[0]))
        return {
            **({} if self._bound is None else {"bound": self._bound.state_dict()}),
            "policy": self.name,
            "spec": self.spec.to_dict(),
            "continuous": self.continuous,
            "train_batch": self._b,
            "index": self._k,
            "seq": self._seq,
            "admitted": dict(self._admitted),
            "in_flight": None if self._in_flight is None else dict(self._in_flight),
            "pending": [[grp, [t.to_dict() for t in ms]] for grp, ms in self._pending.items()],
            "ready": ready,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a snapshot from :meth:`state_dict`.

        Raises:
            StateError: The snapshot belongs to another policy or another batch spec, or is malformed (any
                malformed state raises it; nothing changes then).
        """
        try:
            if state["policy"] != self.name:
                raise StateError(f"state is for policy {state['policy']!r}, not {self.name!r}")
            if BatchSpec.from_dict(state["spec"]) != self.spec:
                raise StateError(f"state has batch spec {state['spec']}, this policy has {self.spec.to_dict()}")
            bound = self._check_bound_state(state)
            fresh = type(self).__new__(type(self))
            AdmissionPolicy.__init__(fresh, self.spec, continuous=bool(state["continuous"]),
                                     max_staleness=self.max_staleness, on_stale=self.on_stale,
                                     version_offset=self.version_offset)
            fresh._loading = True
            for _grp, ms in state["pending"]:
                if not isinstance(ms, list) or not 0 < len(ms) < self._g:
                    raise StateError(f"a pending group holds 1 to {self._g - 1} members, got {str(ms)[:100]}")
                fresh.offer(TrajectoryMeta.from_dict(d) for d in ms)
            last = -1
            for seq, _grp, ms in state["ready"]:
                if isinstance(seq, bool) or not isinstance(seq, int) or seq <= last or not isinstance(ms, list) \
                        or len(ms) != self._g:
                    raise StateError(f"a ready group is [seq (increasing), group, {self._g} members], got "
                                     f"{str([seq, _grp, ms])[:100]}")
                last = fresh._seq = seq
                fresh.offer(TrajectoryMeta.from_dict(d) for d in ms)
            fresh._seq = _count(state["seq"], "seq", last + 1)
            fresh._b = _count(state["train_batch"], "train_batch")
            fresh._k = _count(state["index"], "index", 0, self._M - 1)
            adm = state["admitted"]
            if not isinstance(adm, Mapping) or set(adm) != set(self._Q):
                raise StateError(f"admitted must name the sources {sorted(self._Q)}, got {str(adm)[:100]}")
            fresh._admitted = {s: _count(adm[s], f"admitted.{s}") for s in self._Q}
            if self.keeps_completable:
                _check_completable(fresh)
            inf = state["in_flight"]
            if inf is not None and (not isinstance(inf, Mapping) or not set(inf) <= set(self._Q)):
                raise StateError(f"in_flight must be null or counts of sources {sorted(self._Q)}, got {str(inf)[:100]}")
            fresh._in_flight = None if inf is None else {s: _count(inf.get(s, 0), f"in_flight.{s}") for s in self._Q}
            if bound is not None and fresh._bound is not None:
                fresh._bound.load_state_dict(bound)
            # the newest reported version: kept by the bound (without one, the next report sets it again)
            fresh._max_reported = None if fresh._bound is None else fresh._bound.max_reported
            fresh._loading = False
        except StateError:
            raise
        except KnitdataError as e:
            raise StateError(f"not a {self.name} admission state: {e}") from e
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            raise StateError(f"not a {self.name} admission state: {e!r}") from e
        for attr in (
            "continuous",
            "_pending",
            "_pending_members",
            "_ready",
            "_ready_n",
            "_ready_groups",
            "_pending_ids",
            "_admitted",
            "_in_flight",
            "_b",
            "_k",
            "_seq", "_bound", "_by_version", "_pending_groups", "_max_reported",
        ):
            setattr(self, attr, getattr(fresh, attr))
        self._plan_key = None
