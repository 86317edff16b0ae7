"""Planning: an admitted mini-batch becomes per-consumer shares cut into micro-batches.

Works on :class:`~knitdata.record.TrajectoryMeta` only (no payloads, no storage). The plan is a pure,
deterministic function of the admitted mini-batch, the layout and the options: a freshly built pipeline
fed the same puts plans the same micro-batches, which exact resume relies on.

Assignment (shares). The assignment units are groups (kept whole unless ``allow_split_groups``), taken
largest first (by tokens). Each unit's *home* is the node holding most of its bytes. With ``locality`` on,
a unit goes to the least-loaded consumer on its home node, unless that consumer would exceed
``(1 + balance_tolerance) * total_tokens / num_consumers`` while another consumer is less loaded: then it
goes to the least-loaded consumer overall (token balance). Without ``locality`` it is plain
longest-processing-time balancing.

Micro-batches. Each share is cut under ``token_budget`` (tokens = prompt + response, before padding) with
first-fit decreasing. ``K`` is the largest count over consumers (at least 1); a share that needs fewer is
rebalanced into ``K`` bins when that stays within the budget, and padded with explicit empty
micro-batches otherwise, so every consumer runs exactly ``K`` micro-batches per mini-batch. A single
trajectory larger than the budget gets a micro-batch of its own.

Cost. The least-loaded searches run on heaps of integer keys ``load * consumers + rank`` (one over all
consumers, one per node, each holding one entry per rank that is raised to the rank's key when found
stale), so a unit costs O(log consumers), and the search over all consumers runs only when its answer can
change the choice. Everything else is numpy or C-level passes over the trajectories laid out unit after
unit: their counts read as one buffer (:attr:`~knitdata.record.TrajectoryMeta.packed`), unit sums, the unit
order, where units are, the bytes that stay local, and the shares: slices of whole units when each unit's
trajectories arrived in order (as admission lists a group), else one sort by ``(rank, seq)``. Plans are
:class:`PlannedMicroBatch` named tuples, each with its :class:`MicroBatchInfo`, built in one pass per field over
all micro-batches (:func:`~knitdata.planner.records.planned_rows`). The choices, tie-breaking included (least load, then
lowest rank), are those of a linear search (see ``benchmarks/planner_before_after.py`` and ``python -m benchmarks
control --scale`` for the cost).

Mini-batches below :attr:`Planner.vectorize_from` trajectories (or of ``2**22`` or more), or whose
``num_tokens``, ``nbytes`` or ``seq`` are not all integers of magnitude below ``2**40``, are assigned with
Python lists instead (the same choices: numpy's per-call cost dominates small mini-batches, and int64 must
hold the sums).

Modules: :mod:`~knitdata.planner.records` (:class:`MicroBatchInfo`, :class:`PlannedMicroBatch`,
:class:`MiniBatchPlan`), :mod:`~knitdata.planner.core` (:class:`Planner`) and
:mod:`~knitdata.planner.columns` (the passes over trajectories).
"""

from __future__ import annotations

from knitdata.planner.core import Planner
from knitdata.planner.records import AdmittedLike, MicroBatchInfo, MiniBatchPlan, PlannedMicroBatch

__all__ = ["AdmittedLike", "MicroBatchInfo", "PlannedMicroBatch", "MiniBatchPlan", "Planner"]
