"""Writing shards: trajectories, or admitted mini-batches with their replay position, to webdataset tar files."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from knitdata.errors import ConfigError, ValidationError
from knitdata.record import Trajectory
from knitdata.shards.format import EncodedSample, ReplayInfo, encode_sample

__all__ = ["write_shards", "write_admitted_batches"]


def _progress(iterable: Iterable[Any], enabled: bool, desc: str, total: int | None = None) -> Iterable[Any]:
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit="traj")


class _Writer:
    """ShardWriter wrapper: bytes we encode ourselves, PAX headers (long ids), list of written shards."""

    def __init__(self, pattern: str, maxcount: int, maxsize: float, mtime: float | None):
        if "%" not in pattern:
            raise ConfigError(
                f"shard pattern {pattern!r} needs a printf field for the shard number, e.g. 'out-%06d.tar'"
            )
        if maxcount < 1 or maxsize <= 0:
            raise ConfigError(f"maxcount ({maxcount}) and maxsize ({maxsize}) must be positive")
        self.pattern, self.maxcount, self.maxsize, self.mtime = pattern, maxcount, maxsize, mtime
        self.paths: list[str] = []
        self._w: Any = None
        self._seen: set[str] = set()

    def write(self, sample: EncodedSample) -> None:
        import webdataset as wds

        if sample.key in self._seen:
            raise ValidationError("appears twice in one export; shard keys must be unique", trajectory_id=sample.key)
        self._seen.add(sample.key)
        if self._w is None:  # lazily: no empty shard when there is nothing to write
            d = os.path.dirname(self.pattern % 0)
            if d:
                os.makedirs(d, exist_ok=True)
            self._w = wds.ShardWriter(
                self.pattern,
                maxcount=self.maxcount,
                maxsize=self.maxsize,
                verbose=0,
                post=self.paths.append,
                encoder=False,  # never webdataset's .pyd/.pth encoders: values are bytes we made
                format="PAX_FORMAT",
                mtime=self.mtime,
                mode=0o644,
            )
        self._w.write(sample.as_dict())

    def close(self) -> list[str]:
        if self._w is not None:
            self._w.close()
            self._w = None
        return self.paths


def write_shards(
    trajectories: Iterable[Trajectory],
    pattern: str,
    *,
    maxcount: int = 10_000,
    maxsize: float = 1e9,
    progress: bool = False,
    checksum: bool = True,
    mtime: float | None = None,
) -> list[str]:
    """Export trajectories to webdataset tar shards, one sample per trajectory.

    Args:
        trajectories: The trajectories (any iterable; consumed once, memory holds one at a time).
        pattern: Output path with a printf field for the shard number, e.g. ``"out/traj-%06d.tar"``.
        maxcount: Most samples per shard.
        maxsize: Shard size (bytes) after which a new shard starts.
        progress: Show a tqdm progress bar.
        checksum: Store CRC32s of members (checked on read).
        mtime: Fixed member modification time (for reproducible shards); now when ``None``.

    Returns:
        The paths of the written shards, in order (empty when there were no trajectories).

    Raises:
        ValidationError: If an id is not a safe shard key.
        FieldTypeError: If a tensor has an unsupported dtype.
        ConfigError: On a bad pattern or limits.
    """
    w = _Writer(pattern, maxcount, maxsize, mtime)
    total = len(trajectories) if isinstance(trajectories, Sequence) else None
    try:
        for traj in _progress(trajectories, progress, "write shards", total):
            w.write(encode_sample(traj, checksum=checksum))
    finally:
        paths = w.close()
    return paths


def write_admitted_batches(
    batches: Iterable[Any],
    pattern: str,
    *,
    maxcount: int = 10_000,
    maxsize: float = 1e9,
    fetch: Callable[[str], Trajectory] | Mapping[str, Trajectory] | None = None,
    progress: bool = False,
    checksum: bool = True,
    mtime: float | None = None,
) -> list[str]:
    """Export admitted mini-batches (in admission order) so a replay reconstructs the exact order.

    Args:
        batches: Admitted mini-batches, in order: objects with ``train_batch``, ``index``, ``step`` and
            ``trajectories`` (e.g. ``knitdata.admission.AdmittedMiniBatch``). Their ``trajectories`` may be
            :class:`~knitdata.record.Trajectory` objects or metadata with an ``id`` resolved by ``fetch``.
        pattern: Output path pattern, see :func:`write_shards`.
        fetch: Resolves an id to its trajectory (a callable or a mapping); needed when batches hold metadata.
        maxcount: Most samples per shard.
        maxsize: Shard size in bytes after which a new shard starts.
        progress: Show a tqdm progress bar (per mini-batch).
        checksum: Store CRC32s of members.
        mtime: Fixed member modification time.

    Returns:
        The written shard paths, in order.

    Raises:
        ConfigError: If a batch holds metadata and no ``fetch`` was given, or a batch lacks a field.
    """
    w = _Writer(pattern, maxcount, maxsize, mtime)
    try:
        for mb in _progress(batches, progress, "write batches"):
            try:
                b, k, step, items = int(mb.train_batch), int(mb.index), int(mb.step), list(mb.trajectories)
            except AttributeError as e:
                raise ConfigError(f"admitted mini-batch {mb!r} lacks train_batch/index/step/trajectories: {e}") from e
            for pos, item in enumerate(items):
                if isinstance(item, Trajectory):
                    traj = item
                elif fetch is None:
                    raise ConfigError("batches hold metadata, not trajectories: pass fetch= (a mapping or a callable)")
                else:
                    tid = item.id if hasattr(item, "id") else str(item)
                    traj = fetch[tid] if isinstance(fetch, Mapping) else fetch(tid)
                info = ReplayInfo(b, k, step, pos, len(items)).to_dict()
                w.write(encode_sample(traj, replay=info, checksum=checksum))
    finally:
        paths = w.close()
    return paths


# ----------------------------------------------------------------------------------------- reading
