"""knitdata: moves reinforcement-learning trajectories from rollout to training.

The layout follows the data's path, one module per stage:

================  ===========================================================================
stage             module
================  ===========================================================================
record            :mod:`knitdata.record` (``Trajectory``), :mod:`knitdata.codec` (wire/disk)
admission         :mod:`knitdata.admission`, :mod:`knitdata.staleness`
placement         :mod:`knitdata.placement`, :mod:`knitdata.planner`
storage           :mod:`knitdata.storage` (embedded, Ray), :mod:`knitdata.spill`, :mod:`knitdata.shards`
consumer dataset  :mod:`knitdata.pipeline`, :mod:`knitdata.dataset`
collate           :mod:`knitdata.collate` (tokens), :mod:`knitdata.media`, :mod:`knitdata.multimodal`
prefetch          :mod:`knitdata.prefetch`
encoder           :mod:`knitdata.encoder` (``SharedEncoding``)
================  ===========================================================================

Names below are imported on first use, so ``import knitdata`` stays light and the optional extras
(ray, matplotlib, transferqueue) stay optional.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from knitdata import errors
from knitdata.errors import *  # noqa: F403  (the error hierarchy: every name of knitdata.errors.__all__)
from knitdata.record import MediaItem, Trajectory, TrajectoryMeta

__version__ = "0.1.0"

#: Public name -> module that defines it (imported lazily).
_LAZY: dict[str, str] = {
    "encode_trajectory": "knitdata.codec",
    "decode_trajectory": "knitdata.codec",
    "BatchSpec": "knitdata.admission",
    "AdmittedMiniBatch": "knitdata.admission",
    "AdmissionPolicy": "knitdata.admission",
    "TrainBatchAdmission": "knitdata.admission",
    "FifoAdmission": "knitdata.admission",
    "LinearTargetAdmission": "knitdata.admission",
    "ConstraintPreservingAdmission": "knitdata.admission",
    "make_policy": "knitdata.admission",
    "StalenessTracker": "knitdata.staleness",
    "ConsumerLayout": "knitdata.placement",
    "ConsumerAwarePlacement": "knitdata.placement",
    "IndexModPlacement": "knitdata.placement",
    "Planner": "knitdata.planner",
    "Pipeline": "knitdata.pipeline",
    "ControlPlane": "knitdata.control",
    "ray_address": "knitdata.engines.ray",
    "TrajectoryDataset": "knitdata.dataset",
    "TokenCollator": "knitdata.collate",
    "MicroBatch": "knitdata.collate",
    "MicroBatchInfo": "knitdata.collate",
    "Prefetcher": "knitdata.prefetch",
    "MultimodalCollator": "knitdata.multimodal",
    "MultimodalBatch": "knitdata.multimodal",
    "MediaTable": "knitdata.multimodal",
    "SharedEncoding": "knitdata.encoder",
    "grad_sync": "knitdata.encoder",
    "patchify": "knitdata.media",
    "image_item": "knitdata.media",
    "audio_item": "knitdata.media",
    "write_shards": "knitdata.shards",
    "read_shards": "knitdata.shards",
    "ShardDataset": "knitdata.shards",
    "SpillStore": "knitdata.spill",
}

__all__ = ["__version__", "Trajectory", "TrajectoryMeta", "MediaItem", *errors.__all__, *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'knitdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover
    from knitdata.admission import (  # noqa: F401
        AdmissionPolicy,
        AdmittedMiniBatch,
        BatchSpec,
        ConstraintPreservingAdmission,
        FifoAdmission,
        LinearTargetAdmission,
        TrainBatchAdmission,
        make_policy,
    )
    from knitdata.codec import decode_trajectory, encode_trajectory  # noqa: F401
    from knitdata.collate import MicroBatch, MicroBatchInfo, TokenCollator  # noqa: F401
    from knitdata.control import ControlPlane  # noqa: F401
    from knitdata.dataset import TrajectoryDataset  # noqa: F401
    from knitdata.encoder import SharedEncoding, grad_sync  # noqa: F401
    from knitdata.engines.ray import ray_address  # noqa: F401
    from knitdata.media import audio_item, image_item, patchify  # noqa: F401
    from knitdata.multimodal import MediaTable, MultimodalBatch, MultimodalCollator  # noqa: F401
    from knitdata.pipeline import Pipeline  # noqa: F401
    from knitdata.placement import ConsumerAwarePlacement, ConsumerLayout, IndexModPlacement  # noqa: F401
    from knitdata.planner import Planner  # noqa: F401
    from knitdata.prefetch import Prefetcher  # noqa: F401
    from knitdata.shards import ShardDataset, read_shards, write_shards  # noqa: F401
    from knitdata.spill import SpillStore  # noqa: F401
    from knitdata.staleness import StalenessTracker  # noqa: F401
