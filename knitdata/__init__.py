"""knitdata: moves reinforcement-learning trajectories from rollout to training.

The layout follows the data's path: :mod:`~knitdata.record` and :mod:`~knitdata.codec` (the trajectory
and its encoding) -> admission -> placement -> storage -> consumer dataset -> collate -> prefetch ->
encoder.
"""

from knitdata.codec import decode_trajectory, encode_trajectory
from knitdata.errors import (
    CodecError,
    ConfigError,
    EngineError,
    FieldTypeError,
    KnitdataError,
    MediaError,
    OptionalDependencyError,
    QuotaInfeasibleError,
    StateError,
    StoreFull,
    TrajectoryLostError,
    ValidationError,
)
from knitdata.record import MediaItem, Trajectory, TrajectoryMeta

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Trajectory",
    "TrajectoryMeta",
    "MediaItem",
    "encode_trajectory",
    "decode_trajectory",
    "KnitdataError",
    "ValidationError",
    "FieldTypeError",
    "CodecError",
    "ConfigError",
    "QuotaInfeasibleError",
    "StoreFull",
    "StateError",
    "EngineError",
    "TrajectoryLostError",
    "MediaError",
    "OptionalDependencyError",
]
