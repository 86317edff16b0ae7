"""Trajectories as webdataset tar shards: export, read back, and a rank-aware, resumable dataset.

A shard is a plain tar file (readable by ``tar``, webdataset, or any tar library); each trajectory is one
webdataset *sample*, the members sharing its id as key. :mod:`knitdata.shards.format` describes the members
and the JSON header. Reading never unpickles.

The package's modules: :mod:`~knitdata.shards.format` (the sample format), :mod:`~knitdata.shards.npy`
(tensors as ``.npy`` members, with :mod:`knitdata.codec`'s dtype rules), :mod:`~knitdata.shards.writer`,
:mod:`~knitdata.shards.reader` and :mod:`~knitdata.shards.dataset` (:class:`ShardDataset`).
"""

from __future__ import annotations

from knitdata.shards.dataset import ShardDataset
from knitdata.shards.format import (
    MAX_JSON_BYTES,
    SHARD_FORMAT,
    SHARD_FORMAT_VERSION,
    EncodedSample,
    ReplayInfo,
    check_key,
    decode_sample,
    encode_sample,
)
from knitdata.shards.reader import (
    DEFAULT_MAX_MEMBER_BYTES,
    BrokenShardError,
    count_samples,
    expand_urls,
    iter_shard_samples,
    read_admitted_batches,
    read_shards,
)
from knitdata.shards.writer import write_admitted_batches, write_shards

__all__ = [
    "SHARD_FORMAT",
    "SHARD_FORMAT_VERSION",
    "MAX_JSON_BYTES",
    "DEFAULT_MAX_MEMBER_BYTES",
    "EncodedSample",
    "ReplayInfo",
    "encode_sample",
    "decode_sample",
    "check_key",
    "write_shards",
    "write_admitted_batches",
    "read_shards",
    "read_admitted_batches",
    "iter_shard_samples",
    "count_samples",
    "expand_urls",
    "ShardDataset",
    "BrokenShardError",
]
