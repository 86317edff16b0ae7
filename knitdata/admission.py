"""Admission: which finished trajectories form the next mini-batch.

A train batch of ``B`` trajectories has a quota ``q_s`` per source and is cut into ``M`` mini-batches of
``m = B / M`` trajectories each. Admission sees metadata only (:class:`~knitdata.record.TrajectoryMeta`),
admits whole groups, and emits :class:`AdmittedMiniBatch` objects in order. Four policies ship:

- :class:`TrainBatchAdmission`: wait for the whole train batch, then release its ``M`` mini-batches.
- :class:`FifoAdmission`: the first ``m`` finished trajectories (whole groups), quotas ignored.
- :class:`LinearTargetAdmission`: mini-batch ``k`` brings every source to its cumulative linear target.
- :class:`ConstraintPreservingAdmission`: admit as soon as *any* composition keeps every quota and bound
  feasible; the feasibility check is exact and O(S) per mini-batch (see its docstring for the proof).

Internally everything is counted in *groups* (``group_size`` trajectories each): quotas, bounds and
mini-batch sizes are multiples of the group size (bounds are rounded inward to whole groups).

Cost: ready groups live in one deque per source; per-source counters replace scans, so a ``poll`` that
admits nothing costs O(S), and admitting a mini-batch costs O(m / g · log S). Nothing is O(B).
"""

from __future__ import annotations

import abc
import heapq
import operator
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from knitdata.errors import ConfigError, KnitdataError, QuotaInfeasibleError, StateError, ValidationError
from knitdata.record import TrajectoryMeta

__all__ = [
    "BatchSpec",
    "AdmittedMiniBatch",
    "AdmissionPolicy",
    "TrainBatchAdmission",
    "FifoAdmission",
    "LinearTargetAdmission",
    "ConstraintPreservingAdmission",
    "POLICIES",
    "make_policy",
    "composition_limits",
    "completion_exists",
    "even_completion",
]


# ----------------------------------------------------------------------------------------------------------
# Batch specification
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchSpec:
    """Shape of a train batch: per-source quotas, mini-batch count, group size and optional bounds.

    Attributes:
        quotas: Trajectories per source per train batch (their sum is ``B``).
        num_minibatches: ``M``, the number of mini-batches (optimizer steps) per train batch.
        group_size: Trajectories per group; groups are admitted whole.
        bounds: Optional per-mini-batch ``(lo, hi)`` trajectory counts per source. Sources without an
            entry get ``(0, m)``. Bounds are rounded inward to whole groups.

    Raises:
        ConfigError: Quotas that do not sum to a positive multiple of ``M``, a quota or ``m`` that is not
            a multiple of the group size, or bounds that cannot be met (they cannot sum to ``m``, or a
            source's quota cannot be split into ``M`` mini-batches within its bounds).
    """

    quotas: Mapping[str, int]
    num_minibatches: int
    group_size: int = 1
    bounds: Mapping[str, tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.quotas, Mapping) or not self.quotas:
            raise ConfigError("BatchSpec.quotas must be a non-empty mapping {source: trajectories per train batch}")
        quotas: dict[str, int] = {}
        for s, q in self.quotas.items():
            if not isinstance(s, str) or not s:
                raise ConfigError(f"BatchSpec.quotas: source names must be non-empty strings, got {s!r}")
            if isinstance(q, bool) or not isinstance(q, int) or q < 0:
                raise ConfigError(f"BatchSpec.quotas[{s!r}] must be a non-negative int, got {q!r}")
            quotas[s] = int(q)
        M, g = self.num_minibatches, self.group_size
        if isinstance(M, bool) or not isinstance(M, int) or M < 1:
            raise ConfigError(f"BatchSpec.num_minibatches must be an int >= 1, got {M!r}")
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ConfigError(f"BatchSpec.group_size must be an int >= 1, got {g!r}")
        B = sum(quotas.values())
        if B == 0 or B % M:
            raise ConfigError(
                f"BatchSpec: quotas sum to {B}, which is not a positive multiple of num_minibatches={M}; "
                f"adjust the quotas so that B = M * m"
            )
        m = B // M
        for s, q in quotas.items():
            if q % g:
                raise ConfigError(
                    f"BatchSpec: quota of source {s!r} is {q}, not a multiple of group_size={g}; "
                    f"groups are admitted whole, so use a multiple of {g}"
                )
        if m % g:
            raise ConfigError(
                f"BatchSpec: mini-batch size m = B / M = {B} / {M} = {m} is not a multiple of group_size={g}; "
                f"change B or M so that whole groups fill each mini-batch"
            )
        bounds: dict[str, tuple[int, int]] = {}
        if self.bounds is not None:
            for s, b in self.bounds.items():
                if s not in quotas:
                    raise ConfigError(
                        f"BatchSpec.bounds names source {s!r} which has no quota; known: {sorted(quotas)}"
                    )
                try:
                    lo, hi = (int(b[0]), int(b[1]))
                except (TypeError, ValueError, IndexError) as e:
                    raise ConfigError(f"BatchSpec.bounds[{s!r}] must be a pair (lo, hi) of ints, got {b!r}") from e
                if lo < 0 or hi < lo:
                    raise ConfigError(f"BatchSpec.bounds[{s!r}] = ({lo}, {hi}) must satisfy 0 <= lo <= hi")
                lo_g, hi_g = -(-lo // g), min(hi, m) // g
                if lo_g > hi_g:
                    raise ConfigError(
                        f"BatchSpec.bounds[{s!r}] = ({lo}, {hi}) contains no whole number of groups of size {g}; "
                        f"widen it to include a multiple of {g}"
                    )
                if M * lo_g * g > quotas[s] or M * hi_g * g < quotas[s]:
                    raise ConfigError(
                        f"BatchSpec: source {s!r} has quota {quotas[s]} but its per-mini-batch bounds "
                        f"({lo}, {hi}) (in whole groups: {lo_g * g}..{hi_g * g}) allow only "
                        f"{M * lo_g * g}..{M * hi_g * g} over {M} mini-batches; widen the bounds or change the quota"
                    )
                bounds[s] = (lo, hi)
        object.__setattr__(self, "quotas", dict(sorted(quotas.items())))
        object.__setattr__(self, "bounds", dict(sorted(bounds.items())) if self.bounds is not None else None)
        lo_sum = sum(self.group_bounds(s)[0] for s in quotas) * g
        hi_sum = sum(self.group_bounds(s)[1] for s in quotas) * g
        if not lo_sum <= m <= hi_sum:
            raise ConfigError(
                f"BatchSpec: per-mini-batch bounds sum to {lo_sum}..{hi_sum} (in whole groups), which cannot "
                f"make a mini-batch of m = {m}; widen the bounds"
            )

    @property
    def batch_size(self) -> int:
        """``B``: trajectories per train batch."""
        return sum(self.quotas.values())

    @property
    def minibatch_size(self) -> int:
        """``m = B / M``: trajectories per mini-batch."""
        return self.batch_size // self.num_minibatches

    @property
    def sources(self) -> tuple[str, ...]:
        """Source names, sorted."""
        return tuple(self.quotas)

    def group_bounds(self, source: str) -> tuple[int, int]:
        """Per-mini-batch bounds of ``source`` in whole groups (rounded inward)."""
        g, m = self.group_size, self.minibatch_size
        if self.bounds is None or source not in self.bounds:
            return 0, m // g
        lo, hi = self.bounds[source]
        return -(-lo // g), min(hi, m) // g

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serializable dict."""
        return {
            "quotas": dict(self.quotas),
            "num_minibatches": self.num_minibatches,
            "group_size": self.group_size,
            "bounds": None if self.bounds is None else {s: list(b) for s, b in self.bounds.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BatchSpec:
        """Inverse of :meth:`to_dict`."""
        bounds = d.get("bounds")
        return cls(
            quotas={str(k): int(v) for k, v in d["quotas"].items()},
            num_minibatches=int(d["num_minibatches"]),
            group_size=int(d.get("group_size", 1)),
            bounds=None if bounds is None else {str(k): (int(v[0]), int(v[1])) for k, v in bounds.items()},
        )


@dataclass(frozen=True)
class AdmittedMiniBatch:
    """One admitted mini-batch.

    Attributes:
        train_batch: ``b``, 0-based train batch index.
        index: ``k``, 0-based index within the train batch (``0..M-1``).
        step: Global mini-batch counter ``b * M + k``.
        trajectories: Exactly ``m`` trajectories, whole groups, in admission order.
        admitted_at: The ``now`` passed to :meth:`AdmissionPolicy.poll`, if any.
        group_sizes: How many trajectories each of those groups has, in order (empty: not given). The
            planner takes its assignment units from it instead of scanning every trajectory's group id.
    """

    train_batch: int
    index: int
    step: int
    trajectories: tuple[TrajectoryMeta, ...]
    admitted_at: float | None = None
    group_sizes: tuple[int, ...] = ()

    def counts(self) -> dict[str, int]:
        """Trajectories per source in this mini-batch."""
        out: dict[str, int] = {}
        for t in self.trajectories:
            out[t.source] = out.get(t.source, 0) + 1
        return out


# ----------------------------------------------------------------------------------------------------------
# The exact feasibility check (pure functions, in group units)
# ----------------------------------------------------------------------------------------------------------


def completion_exists(
    remaining: Mapping[str, int], num_left: int, size: int, bounds: Mapping[str, tuple[int, int]]
) -> bool:
    """Whether an integral ``S x K`` matrix exists with row sums ``remaining``, column sums ``size`` and
    entries of row ``s`` within ``bounds[s]`` (``K = num_left``).

    Exact: it exists iff ``sum(remaining) == K * size`` and ``K*lo_s <= remaining_s <= K*hi_s`` for every
    ``s`` (necessity is immediate; :func:`even_completion` constructs the matrix, proving sufficiency).
    """
    if num_left == 0:
        return all(r == 0 for r in remaining.values())
    if sum(remaining.values()) != num_left * size:
        return False
    return all(num_left * bounds[s][0] <= r <= num_left * bounds[s][1] for s, r in remaining.items())


def even_completion(remaining: Mapping[str, int], num_left: int) -> list[dict[str, int]]:
    """Construct the completion of :func:`completion_exists`: each row split as evenly as possible.

    Row ``s`` gets ``floor(r_s / K)`` in every column plus one extra in ``r_s mod K`` columns, chosen
    cyclically with one pointer shared by all rows (sources in sorted order). The cyclic fill hands out
    the ``E = sum_s (r_s mod K)`` extras round-robin, so when ``E`` is a multiple of ``K`` (true whenever
    ``sum(remaining) == K * size``) every column gets exactly ``E / K`` extras and sums to ``size``; each
    entry is ``floor(r_s/K)`` or ``ceil(r_s/K)``, hence within ``[lo_s, hi_s]`` whenever
    ``K*lo_s <= r_s <= K*hi_s``.

    Args:
        remaining: Row sums per source.
        num_left: ``K``, the number of columns.

    Returns:
        ``K`` dicts ``{source: entry}``.
    """
    cols: list[dict[str, int]] = [{} for _ in range(num_left)]
    ptr = 0
    for s in sorted(remaining):
        base, extra = divmod(remaining[s], num_left)
        for c in range(num_left):
            cols[c][s] = base
        for j in range(extra):
            cols[(ptr + j) % num_left][s] += 1
        ptr = (ptr + extra) % num_left
    return cols


def composition_limits(
    remaining: Mapping[str, int],
    ready: Mapping[str, int],
    num_left: int,
    size: int,
    bounds: Mapping[str, tuple[int, int]],
) -> tuple[dict[str, int], dict[str, int]] | None:
    """Per-source ``[lo'_s, hi'_s]`` for the next mini-batch such that the rest stays completable.

    In group units. With ``R_s = remaining[s]`` (quota still to admit in this train batch), ``K =
    num_left`` mini-batches after this one, bounds ``[L_s, H_s]`` and ``r_s = ready[s]``, a composition
    ``x`` (``sum x = size``) is admissible iff ``lo'_s <= x_s <= hi'_s`` for every ``s`` where
    ``lo'_s = max(L_s, R_s - K*H_s)`` and ``hi'_s = min(H_s, R_s - K*L_s, r_s)``: by
    :func:`completion_exists` the rest is completable iff ``K*L_s <= R_s - x_s <= K*H_s`` for every
    ``s`` (the column-sum condition ``sum(R - x) = K*size`` holds by construction). An integral ``x``
    with fixed sum in a box exists iff ``sum lo' <= size <= sum hi'`` and ``lo' <= hi'`` row-wise.

    Returns:
        ``(lo', hi')`` when some composition exists now, else ``None`` (wait for more ready groups).
    """
    lo: dict[str, int] = {}
    hi: dict[str, int] = {}
    lo_sum = hi_sum = 0
    for s, R in remaining.items():
        L, H = bounds[s]
        a = max(L, R - num_left * H)
        b = min(H, R - num_left * L, ready.get(s, 0))
        if a > b:
            return None
        lo[s], hi[s] = a, b
        lo_sum += a
        hi_sum += b
    if not lo_sum <= size <= hi_sum:
        return None
    return lo, hi


# ----------------------------------------------------------------------------------------------------------
# Policies
# ----------------------------------------------------------------------------------------------------------


def _count(x: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    """An int of a loaded state in ``lo..hi`` (:class:`~knitdata.errors.StateError` otherwise)."""
    if isinstance(x, bool) or not isinstance(x, int) or x < lo or (hi is not None and x > hi):
        raise StateError(f"{what} must be an int in {lo}..{'' if hi is None else hi}, got {str(x)[:50]}")
    return x


@dataclass(slots=True)
class _Group:
    seq: int
    group: str
    source: str
    metas: tuple[TrajectoryMeta, ...]
    version: int = field(default=0)


class AdmissionPolicy(abc.ABC):
    """Base class of the admission policies: holds ready groups and emits mini-batches in order.

    Args:
        spec: The batch specification.
        continuous: ``True`` for a continuous (oversampled) prompt stream: surplus ready trajectories
            carry over to the next train batch and a source that is short of its quota makes admission
            wait instead of raising (rollout can always deliver more). With ``False`` (default),
            :class:`~knitdata.errors.QuotaInfeasibleError` is raised as soon as a source's ready plus
            in-flight trajectories (see :meth:`set_in_flight`) cannot cover its remaining quota. Surplus
            ready groups carry over in both modes.

    Protocol: call :meth:`offer` with finished trajectories (a group becomes admissible once all its
    ``group_size`` members arrived), optionally :meth:`set_in_flight`, :meth:`withdraw` dropped groups,
    and :meth:`poll` to receive every mini-batch that can be admitted now, in order.
    """

    name: str = ""
    preserves_quotas: bool = True

    def __init__(self, spec: BatchSpec, *, continuous: bool = False) -> None:
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
        self._ready: dict[str, deque[_Group]] = {s: deque() for s in spec.sources}
        self._ready_n: dict[str, int] = dict.fromkeys(spec.sources, 0)
        self._ready_groups: dict[str, _Group] = {}
        self._pending_ids: dict[str, set[str]] = {}
        self._admitted: dict[str, int] = dict.fromkeys(spec.sources, 0)
        self._in_flight: dict[str, int] | None = None
        self._b = 0
        self._k = 0
        self._seq = 0

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
            members = self._pending.get(t.group)
            if members is None:
                members = self._pending[t.group] = []
                ids = self._pending_ids[t.group] = set()
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
                grp = _Group(self._seq, t.group, t.source, tuple(members), min(x.gen_version for x in members))
                self._seq += 1
                self._ready[t.source].append(grp)
                self._ready_n[t.source] += 1
                self._ready_groups[t.group] = grp

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
            del self._pending_ids[group]
            self._pending_members[members[0].source] -= len(members)
            return list(members)
        grp = self._ready_groups.pop(group, None)
        if grp is None:
            return []
        self._ready_n[grp.source] -= 1
        out: list[TrajectoryMeta] = list(grp.metas)
        grp.metas = ()  # lazily skipped when it reaches the deque head
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
            self._check_supply()
            counts = self._choose()
            if counts is None:
                break
            out.append(self._emit(counts, now))
        return out

    @abc.abstractmethod
    def _choose(self) -> dict[str, int] | list[_Group] | None:
        """Composition of the next mini-batch in groups per source (or the groups), or ``None`` to wait."""

    # -- helpers ------------------------------------------------------------------------------------
    def _head(self, s: str) -> _Group | None:
        dq = self._ready[s]
        while dq and not dq[0].metas:
            dq.popleft()
        return dq[0] if dq else None

    def _pop(self, s: str) -> _Group:
        grp = self._head(s)
        assert grp is not None, "ready counter out of sync"
        self._ready[s].popleft()
        self._ready_n[s] -= 1
        del self._ready_groups[grp.group]
        return grp

    def _remaining(self) -> dict[str, int]:
        return {s: self._Q[s] - self._admitted[s] for s in self._Q}

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

    def _compose(self, lo: Mapping[str, int], hi: Mapping[str, int]) -> list[_Group]:
        """Take ``lo_s`` groups of every source, then fill by preference up to ``hi_s``.

        Preference: oldest ``gen_version`` at the head of the source's queue, then the source furthest
        behind its linear target ``(k+1) q_s / M``, then arrival order.
        """
        taken: list[_Group] = []
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
                    heapq.heappush(heap, (h.version, -behind, h.seq, s))

        for s in self._Q:
            push(s)
        while left > 0:
            _, _, _, s = heapq.heappop(heap)
            taken.append(self._pop(s))
            x[s] += 1
            left -= 1
            push(s)
        return taken

    def _emit(self, choice: dict[str, int] | list[_Group], now: float | None) -> AdmittedMiniBatch:
        if isinstance(choice, dict):
            groups = self._compose(choice, choice)
        else:
            groups = choice
        trajs: list[TrajectoryMeta] = []
        for grp in groups:
            self._admitted[grp.source] += 1
            trajs.extend(grp.metas)
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
                if grp.metas:
                    ready.append([grp.seq, grp.group, [t.to_dict() for t in grp.metas]])
        ready.sort(key=lambda r: int(r[0]))
        return {
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
            fresh = type(self).__new__(type(self))
            AdmissionPolicy.__init__(fresh, self.spec, continuous=bool(state["continuous"]))
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
            inf = state["in_flight"]
            if inf is not None and (not isinstance(inf, Mapping) or not set(inf) <= set(self._Q)):
                raise StateError(f"in_flight must be null or counts of sources {sorted(self._Q)}, got {str(inf)[:100]}")
            fresh._in_flight = None if inf is None else {s: _count(inf.get(s, 0), f"in_flight.{s}") for s in self._Q}
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
            "_seq",
        ):
            setattr(self, attr, getattr(fresh, attr))


class TrainBatchAdmission(AdmissionPolicy):
    """Wait until every source's remaining quota is ready, then release all ``M`` mini-batches.

    Preserves quotas (and bounds); maximal staleness. Mini-batch compositions follow the same
    preference as :class:`ConstraintPreservingAdmission` (oldest first).
    """

    name = "train_batch"

    def _choose(self) -> dict[str, int] | list[_Group] | None:
        rem = self._remaining()
        if any(self._ready_n[s] < r for s, r in rem.items()):
            return None
        lim = composition_limits(rem, self._ready_n, self._M - self._k - 1, self._mm, self._bounds)
        assert lim is not None, "a complete train batch must be admissible"
        return self._compose(*lim)


class FifoAdmission(AdmissionPolicy):
    """Release the first ``m`` ready trajectories (whole groups, arrival order) as a mini-batch.

    Ignores quotas and bounds: lowest delay, but the source mix of a train batch drifts (the
    benchmark counts the violations). It never raises :class:`~knitdata.errors.QuotaInfeasibleError`.
    """

    name = "fifo"
    preserves_quotas = False

    def _choose(self) -> dict[str, int] | list[_Group] | None:
        if sum(self._ready_n.values()) < self._mm:
            return None
        heap = []
        for s in self._Q:
            h = self._head(s)
            if h is not None:
                heap.append((h.seq, s))
        heapq.heapify(heap)
        taken: list[_Group] = []
        while len(taken) < self._mm:
            _, s = heapq.heappop(heap)
            taken.append(self._pop(s))
            h = self._head(s)
            if h is not None:
                heapq.heappush(heap, (h.seq, s))
        return taken


class LinearTargetAdmission(AdmissionPolicy):
    """Mini-batch ``k`` takes a fixed composition that brings each source to its cumulative linear target.

    The per-mini-batch compositions are the even split of each quota over the ``M`` mini-batches
    (:func:`even_completion`: ``floor(q_s/M)`` or ``ceil(q_s/M)`` groups). Each mini-batch holds ``floor`` or
    ``ceil`` of the per-mini-batch share, but the ``e_s = q_s mod M`` extra groups of a source come in one
    cyclic run of consecutive mini-batches (the cyclic fill that keeps every mini-batch at exactly ``m``). So
    the cumulative count after mini-batch ``k`` is within ``e_s (1 - e_s / M)`` groups of ``k q_s / M`` (at most
    ``M / 4``), a bound that is reached: with ``M = 5`` and a quota of 2 groups, one source holds 2 groups after
    the second mini-batch against a target of 0.8; with ``M = 16`` the gap reaches 4 groups. Only when
    ``M`` divides every quota is the schedule exactly linear. Every mini-batch waits for its slowest source.
    """

    name = "linear_target"

    def __init__(self, spec: BatchSpec, *, continuous: bool = False) -> None:
        super().__init__(spec, continuous=continuous)
        self._schedule = even_completion(self._Q, self._M)

    def _choose(self) -> dict[str, int] | list[_Group] | None:
        x = self._schedule[self._k]
        if any(self._ready_n[s] < n for s, n in x.items()):
            return None
        return dict(x)


class ConstraintPreservingAdmission(AdmissionPolicy):
    """Admit a mini-batch as soon as ready groups can fill it without making any quota or bound infeasible.

    State (group units): quota ``Q_s``, admitted ``A_s`` this train batch, ready ``r_s``, ``K = M - k - 1``
    mini-batches after the one being formed, bounds ``[L_s, H_s]``, size ``n = m / g``.

    Exactness argument. A composition ``x`` of the next mini-batch is *safe* iff there is an integral
    completion ``Y`` (``S x K``) with row sums ``R_s - x_s`` (``R_s = Q_s - A_s``), column sums ``n`` and
    entries in ``[L_s, H_s]``. Claim: such ``Y`` exists iff ``sum_s (R_s - x_s) = K n`` and
    ``K L_s <= R_s - x_s <= K H_s`` for every ``s``. Necessity: sum the ``K`` entries of a row, and the
    columns. Sufficiency (constructive, :func:`even_completion`): put ``floor((R_s-x_s)/K)`` in every
    column of row ``s`` and hand out the row remainders cyclically with one shared pointer; since the
    total of remainders is ``K n - K sum floor(.)``, a multiple of ``K``, each column receives the same
    number of extras and sums to ``n``; entries are the floor or ceiling of ``(R_s-x_s)/K``, which lie in
    ``[L_s, H_s]`` because ``(R_s-x_s)/K`` does and the bounds are integers. (Columns are identical
    because all mini-batches have the same size and bounds, which is why no Gale–Ryser sort is needed:
    the check is O(S).) Availability of the later groups is a per-source condition independent of
    ``x``: the remaining need ``R_s - x_s`` must be covered by ``r_s - x_s + f_s``, i.e. ``R_s <= r_s +
    f_s``; it is checked separately (raising :class:`~knitdata.errors.QuotaInfeasibleError`), and it
    does not affect which ``x`` are safe. So the safe set is the box ``max(L_s, R_s - K H_s) <= x_s <=
    min(H_s, R_s - K L_s, r_s)`` intersected with ``sum x = n`` (:func:`composition_limits`); it is
    non-empty iff each interval is and their bounds bracket ``n``. The policy admits iff the safe set is
    non-empty, so it never waits when a safe mini-batch exists, and by induction it never reaches a state
    without a completion (deadlock-free whenever rollout delivers the quotas).

    Choice: the lower ends ``lo'`` are taken first, then the rest one group at a time from the source
    whose head group is oldest (``gen_version``), ties to the source most behind its linear target,
    then arrival order; O(n log S) per mini-batch.

    Timing: on the same arrivals it admits every mini-batch no later than :class:`TrainBatchAdmission`
    (once all quotas are ready a completion exists), and, without per-mini-batch bounds, no later than
    :class:`LinearTargetAdmission` (property-tested). With upper bounds the latter can fail: admitting
    early may use up a source that a later mini-batch needs (kept as a counterexample in
    ``tests/test_admission.py``); no online rule can avoid that without knowing future arrivals.
    """

    name = "constraint_preserving"

    def _choose(self) -> dict[str, int] | list[_Group] | None:
        rem = self._remaining()
        lim = composition_limits(rem, self._ready_n, self._M - self._k - 1, self._mm, self._bounds)
        if lim is None:
            return None
        return self._compose(*lim)


#: Policy name -> class.
POLICIES: dict[str, type[AdmissionPolicy]] = {
    "train_batch": TrainBatchAdmission,
    "fifo": FifoAdmission,
    "linear_target": LinearTargetAdmission,
    "constraint_preserving": ConstraintPreservingAdmission,
}


def make_policy(name: str, spec: BatchSpec, **kw: Any) -> AdmissionPolicy:
    """Build an admission policy by name.

    Args:
        name: One of ``"train_batch"``, ``"fifo"``, ``"linear_target"``, ``"constraint_preserving"``.
        spec: The batch specification.
        **kw: Passed to the policy (``continuous=``).

    Raises:
        ConfigError: Unknown name.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown admission policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(spec, **kw)
