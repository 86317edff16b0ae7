"""The planner's test double for an admitted mini-batch (:class:`knitdata.planner.AdmittedLike`)."""

from __future__ import annotations

from dataclasses import dataclass

from knitdata.record import TrajectoryMeta


@dataclass(frozen=True)
class Admitted:
    """An admitted mini-batch as the planner reads it (``group_sizes`` empty: the planner scans the group ids)."""

    train_batch: int
    index: int
    step: int
    trajectories: tuple[TrajectoryMeta, ...]
    group_sizes: tuple[int, ...] = ()
