"""The base of the admission policies: ready groups per source, quotas, in-flight counts, state."""

from __future__ import annotations

import abc
import heapq
import operator
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from knitdata.admission.bound import FUTURE_SLACK
from knitdata.admission.bounded import BoundedAdmission, ReadyGroup
from knitdata.admission.composition import completion_exists
from knitdata.admission.spec import AdmittedMiniBatch, BatchSpec
from knitdata.errors import ConfigError, KnitdataError, QuotaInfeasibleError, StateError, ValidationError
from knitdata.record import TrajectoryMeta

__all__ = ["ReadyGroup", "AdmissionPolicy", "BoundedAdmission", "StatefulAdmission"]


def _count(x: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    """An int of a loaded state in ``lo..hi`` (:class:`~knitdata.errors.StateError` otherwise)."""
    if isinstance(x, bool) or not isinstance(x, int) or x < lo or (hi is not None and x > hi):
        raise StateError(f"{what} must be an int in {lo}..{'' if hi is None else hi}, got {str(x)[:50]}")
    return x


def _check_completable(p: AdmissionPolicy) -> None:
    """Raise :class:`~knitdata.errors.StateError` unless what is left of ``p``'s quotas fills its mini-batches left
    within the bounds: every state of a policy that keeps its train batch completable does (``keeps_completable``)."""
    left = p._M - p._k
    if not completion_exists(p._remaining(), left, p._mm, p._bounds):
        raise StateError(
            f"admitted {p._admitted} (groups of {p._g}) after {p._k} of {p._M} mini-batches leaves quotas {p._Q} that "
            f"{left} mini-batches of {p._mm} groups cannot complete within the bounds {p._bounds}: not a state of the "
            f"{p.name} policy")


class StatefulAdmission(BoundedAdmission):
    """The state of :class:`AdmissionPolicy` (:meth:`state_dict`, :meth:`load_state_dict`): JSON, no pickle."""

    name: str
    keeps_completable: bool
    continuous: bool
    _g: int
    _b: int
    _seq: int
    _pending: dict[str, list[TrajectoryMeta]]
    _pending_ids: dict[str, set[str]]
    _pending_members: dict[str, int]
    _ready: dict[str, deque[ReadyGroup]]
    _by_version: dict[str, list[tuple[int, int, ReadyGroup]]]
    _max_reported: int | None
    _plan_key: tuple[int, int] | None
    max_staleness: Any
    on_stale: str
    version_offset: int | None

    def offer(self, metas: Iterable[TrajectoryMeta]) -> None:
        """See :meth:`AdmissionPolicy.offer`."""
        raise NotImplementedError

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
            fresh: Any = type(self).__new__(type(self))
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


class AdmissionPolicy(StatefulAdmission, abc.ABC):
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
                if self._bound is not None:
                    self._bound.readied(t.source, grp.version)
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
        if self._bound is not None:
            self._bound.unready(grp.source, grp.version)
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
        if self._bound is not None:
            self._bound.unready(s, grp.version)
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

    def _committed(self, rem: Mapping[str, int], K: int, lo: dict[str, int],
                   hi: dict[str, int]) -> tuple[dict[str, int], dict[str, int]] | None:
        """Wait mode: raise the composition limits ``lo`` so that the step takes at least what each source's
        committed groups need now to meet their last steps (:meth:`StalenessBound.least
        <knitdata.admission.bound.StalenessBound.least>`); ``None``: some of those are reserved or incomplete,
        wait for them. Without a bound in wait mode, or when they cannot all make it, the limits as given."""
        b = self._bound
        if b is None or b.on_stale != "wait":
            return lo, hi
        low = dict(lo)
        floor = sum(L for L, _ in self._bounds.values())
        for s, R in rem.items():
            L, H = self._bounds[s]
            top = min(H, R - K * L)  # most of s this step may take, whatever is ready
            per_step = min(H, self._mm - floor + L)  # the others take at least their lower bounds
            need = min(b.least(s, self.step, K, R, per_step), top)
            if need > hi[s]:
                return None  # the groups it needs are reserved or incomplete: wait for them
            low[s] = max(low[s], need)
        if sum(low.values()) > self._mm:
            return lo, hi  # not all of them can make it: as without commitments
        return low, hi

    def _compose(self, lo: Mapping[str, int], hi: Mapping[str, int]) -> list[ReadyGroup]:
        """Take ``lo_s`` groups of every source, then fill by preference up to ``hi_s``.

        Preference: oldest ``gen_version`` at the head of the source's queue (with a bound: the earliest to expire,
        ``gen_version + eta_s``), then the source furthest behind its linear target ``(k+1) q_s / M``, then arrival
        order. In wait mode the earliest to expire is counted from the first later step whose deadline taking the
        group relieves: a group that the steps up to its own last step must take of its source anyway (their lower
        bounds, what the quota forces) leaves this step's slot to another source's group that must join by then.
        """
        etas = self._bound.etas if self._bound is not None else dict.fromkeys(self._Q, 0)
        taken: list[ReadyGroup] = []
        x = dict.fromkeys(self._Q, 0)
        for s, n in lo.items():
            for _ in range(n):
                taken.append(self._pop(s))
            x[s] = n
        left = self._mm - len(taken)
        k1, M, step = self._k + 1, self._M, self.step
        heap: list[tuple[int, int, int, float, int, str]] = []
        b = self._bound
        wait = b is not None and b.on_stale == "wait" and b.offset is not None and b.mode != "unknown"
        forced = self._forced(self._remaining(), self._M - self._k - 1) if wait else {}

        def push(s: str) -> None:
            if x[s] < hi[s]:
                h = self._head(s)
                if h is not None:
                    behind = k1 * self._Q[s] / M - (self._admitted[s] + x[s])
                    surplus = 0  # wait mode: among groups due by the same step, the source most over its floor
                    urgent = 0  # wait mode: the first step after this one whose deadline the group relieves
                    if wait:
                        assert b is not None and b.offset is not None
                        d = h.version + etas[s] - b.offset
                        # (the groups taken are no longer ready: committed() counts only the rest)
                        surplus = b.committed(s, step, d) - (d - step) * self._bounds[s][0]
                        row = forced[s]
                        urgent = max(d - step, len(row))
                        for n in range(max(0, d - step), len(row)):
                            if b.committed(s, step, step + n) > row[n]:
                                urgent = n
                                break
                    heapq.heappush(heap, (urgent, h.version + etas[s], -surplus, -behind, h.seq, s))

        for s in self._Q:
            push(s)
        while left > 0:
            s = heapq.heappop(heap)[-1]
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
