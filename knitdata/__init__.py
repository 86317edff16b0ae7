"""knitdata: moves reinforcement-learning trajectories from rollout to training.

The layout follows the data's path; each stage is a module or a folder of one-concept modules:

==================  =========================================================================================
stage               where
==================  =========================================================================================
record              :mod:`knitdata.record` (``Trajectory``, ``TrajectoryMeta``), :mod:`knitdata.codec` (wire/disk)
rollout             :mod:`knitdata.rollout` (engine outputs to trajectories: vLLM, SGLang, OpenAI, HF ``generate``;
                    multi-turn, multimodal, partial rollouts)
put (producer)      :mod:`knitdata.pipeline` (``Pipeline.put``), :mod:`knitdata.producer` (the put path: checks,
                    the placement replica, waits for room)
admission           :mod:`knitdata.admission` (``spec``, ``composition``, ``base``, ``policies``),
                    :mod:`knitdata.staleness`
placement           :mod:`knitdata.placement`
planning            :mod:`knitdata.planner` (``records``: ``MicroBatchInfo``; ``core``, ``microbatches``, ``columns``)
control plane       :mod:`knitdata.control`: ``surface`` (the control calls, declared once), ``state``, ``admit``,
                    ``leases``, ``positions``, ``reporting``, ``ledger``, ``reshape`` and ``rankstates`` (elastic
                    resume), ``durability``, ``journal``, ``snapshot``; ``plane`` (the ``ControlPlane`` facade)
storage             :mod:`knitdata.storage` (``base``: the unit protocol; ``media``: media once per digest;
                    ``spill``), :mod:`knitdata.shards` (webdataset export/replay)
engines             :mod:`knitdata.engines` (``base``: ``Engine``, the ``ENGINES`` registry; ``options``), one folder
                    per engine: ``engines/embedded`` (``engine``, ``unit``), ``engines/ray`` (``engine``,
                    ``control``, ``connect``, ``unit_actor``, ``unit``, ``media``, ``read``, ``metrics``)
consumer            :mod:`knitdata.consumer`: ``dataset`` (``TrajectoryDataset``), ``session`` (its control-plane
                    session and stages), ``fetch`` (fetch modes), ``collate`` (tokens), ``prefetch`` and
                    ``staging`` (pinning, side-stream copies), ``handoff`` (leases, the background sender)
media               :mod:`knitdata.media`: ``process`` (decode, preprocess), ``video`` (PyAV), ``multimodal``
                    (the micro-batch's media table), ``encoder`` (``SharedEncoding``); :mod:`knitdata.replicas`
parallel            :mod:`knitdata.parallel` (``replica_layout``: data-parallel rank and replica from a DeviceMesh)
integrations        :mod:`knitdata.integrations` (``accelerate``, ``transformers``, ``trl``, ``verl``)
observe             :mod:`knitdata.observe` (``metrics``, ``monitor``, ``trace``)
checkpoint          :mod:`knitdata.checkpoint` (``Pipeline.checkpoint`` / ``Pipeline.restore``, the rollout ledger)
==================  =========================================================================================

Strategy tables (engines, fetch modes, admission policies, placements, model adapters) are
:mod:`knitdata.registry` registries.

Benchmarks, the simulator and the demo are not part of the package: they live in the repository's top-level
``benchmarks`` package (``python -m benchmarks <name>``).

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
    "TokenStaleness": "knitdata.staleness",
    "ConsumerLayout": "knitdata.placement",
    "ConsumerAwarePlacement": "knitdata.placement",
    "IndexModPlacement": "knitdata.placement",
    "Planner": "knitdata.planner",
    "Pipeline": "knitdata.pipeline",
    "ControlPlane": "knitdata.control",
    "ray_address": "knitdata.engines.ray.engine",
    "TrajectoryDataset": "knitdata.consumer.dataset",
    "TokenCollator": "knitdata.consumer.collate",
    "MicroBatch": "knitdata.consumer.collate",
    "MicroBatchInfo": "knitdata.planner",
    "Prefetcher": "knitdata.consumer.prefetch",
    "MultimodalCollator": "knitdata.media.multimodal",
    "MultimodalBatch": "knitdata.media.multimodal",
    "MediaTable": "knitdata.media.multimodal",
    "SharedEncoding": "knitdata.media.encoder",
    "grad_sync": "knitdata.media.encoder",
    "patchify": "knitdata.media.process",
    "image_item": "knitdata.media.process",
    "audio_item": "knitdata.media.process",
    "video_item": "knitdata.media.video",
    "VideoSampling": "knitdata.media.video",
    "write_shards": "knitdata.shards",
    "read_shards": "knitdata.shards",
    "ShardDataset": "knitdata.shards",
    "SpillStore": "knitdata.storage.spill",
    "ReplicaLayout": "knitdata.parallel",
    "replica_layout": "knitdata.parallel",
    "from_process_groups": "knitdata.parallel",
    "merge_rank_states": "knitdata.control.rankstates",
}

__all__ = ["__version__", "Trajectory", "TrajectoryMeta", "MediaItem", *errors.__all__, *_LAZY]


#: Modules reachable from the package root by their short names (``from knitdata import trace``), kept where they
#: were before the modules moved into folders.
_MODULES = {"trace": "knitdata.observe.trace"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        mod = importlib.import_module(_MODULES[name])
        globals()[name] = mod
        return mod
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'knitdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))


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
    from knitdata.consumer.collate import MicroBatch, TokenCollator  # noqa: F401
    from knitdata.consumer.dataset import TrajectoryDataset  # noqa: F401
    from knitdata.consumer.prefetch import Prefetcher  # noqa: F401
    from knitdata.control import ControlPlane  # noqa: F401
    from knitdata.control.rankstates import merge_rank_states  # noqa: F401
    from knitdata.engines.ray.engine import ray_address  # noqa: F401
    from knitdata.media.encoder import SharedEncoding, grad_sync  # noqa: F401
    from knitdata.media.multimodal import MediaTable, MultimodalBatch, MultimodalCollator  # noqa: F401
    from knitdata.media.process import audio_item, image_item, patchify  # noqa: F401
    from knitdata.media.video import VideoSampling, video_item  # noqa: F401
    from knitdata.parallel import ReplicaLayout, from_process_groups, replica_layout  # noqa: F401
    from knitdata.pipeline import Pipeline  # noqa: F401
    from knitdata.placement import ConsumerAwarePlacement, ConsumerLayout, IndexModPlacement  # noqa: F401
    from knitdata.planner import MicroBatchInfo, Planner  # noqa: F401
    from knitdata.shards import ShardDataset, read_shards, write_shards  # noqa: F401
    from knitdata.staleness import StalenessTracker, TokenStaleness  # noqa: F401
    from knitdata.storage.spill import SpillStore  # noqa: F401
