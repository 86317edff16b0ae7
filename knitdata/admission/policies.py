"""The four admission policies and :func:`make_policy`."""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

from knitdata.admission.base import AdmissionPolicy, ReadyGroup
from knitdata.admission.composition import composition_limits, even_completion
from knitdata.admission.spec import BatchSpec
from knitdata.errors import ConfigError
from knitdata.registry import Registry

__all__ = [
    "POLICIES",
    "ConstraintPreservingAdmission",
    "FifoAdmission",
    "LinearTargetAdmission",
    "TrainBatchAdmission",
    "make_policy",
]


class TrainBatchAdmission(AdmissionPolicy):
    """Wait until every source's remaining quota is ready, then release all ``M`` mini-batches.

    Preserves quotas (and bounds); maximal staleness. Mini-batch compositions follow the same
    preference as :class:`ConstraintPreservingAdmission` (oldest first).
    """

    name = "train_batch"
    keeps_completable = True

    def __init__(self, spec: BatchSpec, *, continuous: bool = False,
                 max_staleness: int | Mapping[str, int] | None = None, on_stale: str = "drop",
                 version_offset: int | None = 0) -> None:
        super().__init__(spec, continuous=continuous, max_staleness=max_staleness, on_stale=on_stale,
                         version_offset=version_offset)
        least = None if self._bound is None else min(self._bound.etas.values())
        if least is not None and least < spec.num_minibatches - 1:
            raise ConfigError(
                f"train_batch admission cannot keep max_staleness={max_staleness} with M={spec.num_minibatches} "
                f"mini-batches: the whole train batch is generated before its first mini-batch, so its last one is "
                f"at least M - 1 = {spec.num_minibatches - 1} versions stale; raise the bound or use "
                "constraint_preserving admission")

    def _needed(self, have: Mapping[str, int]) -> dict[str, int]:
        return {s: max(0, r - have[s]) for s, r in self._remaining().items()}  # the whole train batch

    def _choose(self) -> dict[str, int] | list[ReadyGroup] | None:
        rem = self._remaining()
        if any(self._ready_n[s] < r for s, r in rem.items()):
            return None
        K = self._M - self._k - 1
        lim = composition_limits(rem, self._ready_n, K, self._mm, self._bounds)
        assert lim is not None, "a complete train batch must be admissible"
        return self._compose(*(self._committed(rem, K, *lim) or lim))


class FifoAdmission(AdmissionPolicy):
    """Release the first ``m`` ready trajectories (whole groups, arrival order) as a mini-batch.

    Ignores quotas and bounds: lowest delay, but the source mix of a train batch drifts (the
    benchmark counts the violations). It never raises :class:`~knitdata.errors.QuotaInfeasibleError`. With
    ``max_staleness`` and ``on_stale="wait"`` it takes the groups that expire first (``gen_version + eta_s``, then
    arrival order), so that every group a producer reserved finds its slot.
    """

    name = "fifo"
    preserves_quotas = False

    def _choose(self) -> dict[str, int] | list[ReadyGroup] | None:
        if sum(self._ready_n.values()) < self._mm:
            return None
        b = self._bound
        if b is not None and b.on_stale == "wait" and b.short(self.step, self._mm):
            return None  # a reserved group must join this step to meet its bound: wait for it
        # wait mode with a bound: the group that expires first first (a producer's reserved groups keep their slots)
        etas = self._bound.etas if self._bound is not None and self._oldest_first else None
        heap = []
        for s in self._Q:
            h = self._head(s)
            if h is not None:
                heap.append((0 if etas is None else h.version + etas[s], h.seq, s))
        heapq.heapify(heap)
        taken: list[ReadyGroup] = []
        while len(taken) < self._mm:
            _, _, s = heapq.heappop(heap)
            taken.append(self._pop(s))
            h = self._head(s)
            if h is not None:
                heapq.heappush(heap, (0 if etas is None else h.version + etas[s], h.seq, s))
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

    def __init__(self, spec: BatchSpec, *, continuous: bool = False,
                 max_staleness: int | Mapping[str, int] | None = None, on_stale: str = "drop",
                 version_offset: int | None = 0) -> None:
        super().__init__(spec, continuous=continuous, max_staleness=max_staleness, on_stale=on_stale,
                         version_offset=version_offset)
        self._schedule = even_completion(self._Q, self._M)

    def _choose(self) -> dict[str, int] | list[ReadyGroup] | None:
        x = self._schedule[self._k]
        if any(self._ready_n[s] < n for s, n in x.items()):
            return None
        return dict(x)

    def _plan_columns(self) -> list[dict[str, int]]:
        return self._schedule[self._k:]

    def _needed(self, have: Mapping[str, int]) -> dict[str, int]:
        return {s: max(0, n - have[s]) for s, n in self._schedule[self._k].items()}  # its fixed composition


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
    keeps_completable = True

    def _choose(self) -> dict[str, int] | list[ReadyGroup] | None:
        rem = self._remaining()
        K = self._M - self._k - 1
        lim = composition_limits(rem, self._ready_n, K, self._mm, self._bounds)
        if lim is None:
            return None
        b = self._bound
        if b is not None and b.on_stale == "wait":
            most = {s: min(H, rem[s] - K * L) for s, (L, H) in self._bounds.items()}  # this step, ready or not
            if b.short(self.step, self._mm, self._forced(rem, K), most):
                return None  # a reserved group of some source must join this step to meet its bound: wait for it
        lim2 = self._committed(rem, K, *lim)
        return None if lim2 is None else self._compose(*lim2)


#: The admission policy classes by name (``Pipeline(admission=name)``, :func:`make_policy`), the four built-in ones
#: first, then any registered since (``POLICIES.register(name, cls)``).
POLICIES: Registry[type[AdmissionPolicy]] = Registry(
    "admission policy", accepts=lambda c: isinstance(c, type) and issubclass(c, AdmissionPolicy))
for _cls in (TrainBatchAdmission, FifoAdmission, LinearTargetAdmission, ConstraintPreservingAdmission):
    POLICIES.register(_cls.name, _cls)


def make_policy(name: str, spec: BatchSpec, **kw: Any) -> AdmissionPolicy:
    """Build the admission policy registered as ``name`` in :data:`POLICIES`.

    Args:
        name: One of ``"train_batch"``, ``"fifo"``, ``"linear_target"``, ``"constraint_preserving"`` (or a name
            registered since).
        spec: The batch specification.
        **kw: Passed to the policy (``continuous=``, ``max_staleness=``, ``on_stale=``, ``version_offset=``).

    Raises:
        ConfigError: Unknown name (the message names the choices).
    """
    return POLICIES.get(name)(spec, **kw)
