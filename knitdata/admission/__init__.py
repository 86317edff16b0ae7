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

Modules: :mod:`~knitdata.admission.spec` (:class:`BatchSpec`, :class:`AdmittedMiniBatch`),
:mod:`~knitdata.admission.composition` (the feasibility check), :mod:`~knitdata.admission.base`
(:class:`AdmissionPolicy`), :mod:`~knitdata.admission.bounded` (its staleness-bound part),
:mod:`~knitdata.admission.policies` (the four policies, :func:`make_policy`) and :mod:`~knitdata.admission.bound`
(the hard staleness bound ``max_staleness`` every policy can keep, in the trainer's reported versions).
"""

from __future__ import annotations

from knitdata.admission.base import AdmissionPolicy
from knitdata.admission.bound import ON_STALE, StalenessBound
from knitdata.admission.composition import completion_exists, composition_limits, even_completion
from knitdata.admission.policies import (
    POLICIES,
    ConstraintPreservingAdmission,
    FifoAdmission,
    LinearTargetAdmission,
    TrainBatchAdmission,
    make_policy,
)
from knitdata.admission.spec import AdmittedMiniBatch, BatchSpec

__all__ = [
    "BatchSpec",
    "AdmittedMiniBatch",
    "AdmissionPolicy",
    "StalenessBound",
    "ON_STALE",
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
