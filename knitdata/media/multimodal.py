"""Group the media of one consumer's share of a mini-batch into a table of unique items.

:class:`MultimodalCollator` takes the micro-batches of one consumer's share of one mini-batch, *in the
order they will be trained* (call it after any reordering), decodes and preprocesses every media item once
per key, and returns a :class:`MultimodalBatch`:

* per media kind a :class:`MediaTable`: the unique processed inputs packed along their first dimension
  (variable-length patch or frame sequences) with ``offsets`` (``int64 [U + 1]``) and their ``keys``;
* per micro-batch and kind a :class:`MediaOccurrences`: for each media occurrence (in trajectory order, then
  media order) the row of its unique item in the table, the trajectory's position in the micro-batch and
  the item's index in that trajectory's media.

The tables are built without a second copy of the processed inputs: each kind's values are preallocated for its
distinct items and a preprocessing that can (:func:`~knitdata.media.process.patchify`; see
:meth:`~knitdata.media.process.MediaProcessor.process`'s ``out``) writes each item straight into them;
:attr:`MultimodalBatch.pack_stats` counts the bytes written in place and the bytes copied.

:class:`~knitdata.media.encoder.SharedEncoding` encodes each table once and hands every micro-batch its rows.

Example (``micro_batch_1`` holds a trajectory of a new group, then one of ``micro_batch_0``'s group):
    >>> from knitdata import MultimodalCollator, patchify
    >>> collate = MultimodalCollator({"image": patchify(14, size=(224, 224))}, key="provenance")
    >>> mm = collate([micro_batch_0, micro_batch_1])       # lists of Trajectory
    >>> mm.tables["image"].num_items, mm.for_microbatch(1)["image"].index
    (2, tensor([1, 0]))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from knitdata.errors import MediaError
from knitdata.media.process import MediaProcessor, ProcessedMedia, provenance_key
from knitdata.media.video import VideoSampling
from knitdata.record import Trajectory, tensor_digest

__all__ = ["MediaTable", "MediaOccurrences", "MultimodalBatch", "MultimodalCollator", "EqualInputs", "KEY_MODES",
           "segment_rows"]

#: How media items are keyed: by their processed encoder input (equal inputs share a row) or by ``(group, media index)``.
KEY_MODES: tuple[str, ...] = ("digest", "provenance")

#: Values of a processed input compared before the rest (evenly spaced): an input is compared in full only with
#: those that agree on them (:class:`EqualInputs`) ...
_SAMPLED = 256
#: ... and with at most this many: past it, inputs that agree on them are told apart by their digests (each input
#: hashed once), so that many near-equal inputs cost no more than hashing them.
_COMPARED = 8


def segment_rows(offsets: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Rows of the packed values covered by ``items`` (in order, duplicates repeated).

    Args:
        offsets: ``(num_items + 1,)`` row offsets of a packed table (:attr:`MediaTable.offsets`).
        items: Item indices.

    Returns:
        The row indices, item after item.
    """
    if items.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=offsets.device)
    starts = offsets[items]
    lengths = offsets[items + 1] - starts
    total = int(lengths.sum())
    seg_start = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(total, device=offsets.device) - torch.repeat_interleave(seg_start, lengths)
    return torch.repeat_interleave(starts, lengths) + within


@dataclass
class MediaTable:
    """Unique processed media of one kind, packed along the first dimension.

    Attributes:
        kind: ``"image"``, ``"audio"`` or ``"video"``.
        values: ``[sum of lengths, *feature_shape]``: item ``u`` is ``values[offsets[u]:offsets[u + 1]]``.
        offsets: ``int64 [U + 1]``, starting at 0.
        keys: The ``U`` keys: with ``key="digest"`` the raw key of the row's first item
            (:meth:`~knitdata.media.process.MediaProcessor.raw_key`: its kind, sample rate and content digest; a video's
            :func:`~knitdata.media.video.video_key`), with ``key="provenance"`` its ``(group, index)``.
        sample_rates: ``int64 [U]`` for audio, else ``None``.
        meta: Per-item metadata the model's processor returned with each item, stacked per name: each tensor
            has ``U`` rows (e.g. Qwen2-VL's ``image_grid_thw`` ``int64 [U, 3]``, an audio clip's valid
            feature length ``int64 [U]``); empty for plain preprocessing.
    """

    kind: str
    values: torch.Tensor
    offsets: torch.Tensor
    keys: tuple[Any, ...] = ()
    sample_rates: torch.Tensor | None = None
    meta: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_items(self) -> int:
        """Number of unique items ``U``."""
        return int(self.offsets.numel()) - 1

    @property
    def lengths(self) -> torch.Tensor:
        """``int64 [U]``: rows per item."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def nbytes(self) -> int:
        """Bytes of values, offsets and sample rates."""
        n = self.values.numel() * self.values.element_size() + self.offsets.numel() * 8
        n += sum(m.numel() * m.element_size() for m in self.meta.values())
        return n + (0 if self.sample_rates is None else self.sample_rates.numel() * 8)

    def item(self, u: int) -> torch.Tensor:
        """The processed input of item ``u`` (a view)."""
        return self.values[int(self.offsets[u]) : int(self.offsets[u + 1])]

    def gather(self, items: torch.Tensor | Sequence[int]) -> MediaTable:
        """A table of the given items, in that order, duplicates repeated (what a naive trainer encodes).

        Args:
            items: Item indices into this table.

        Returns:
            A new table (values copied).
        """
        idx = torch.as_tensor(items, dtype=torch.long, device=self.offsets.device).reshape(-1)
        rows = segment_rows(self.offsets, idx)
        lengths = self.offsets[idx + 1] - self.offsets[idx]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=self.offsets.device), torch.cumsum(lengths, 0)])
        rates = None if self.sample_rates is None else self.sample_rates[idx]
        keys = tuple(self.keys[int(i)] for i in idx.tolist()) if self.keys else ()
        meta = {k: m[idx.to(m.device)] for k, m in self.meta.items()}
        return MediaTable(self.kind, self.values[rows], offsets, keys, rates, meta)

    def slice(self, start: int, stop: int) -> MediaTable:
        """Items ``start..stop-1`` as a table whose values are a view of this one's."""
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        rates = None if self.sample_rates is None else self.sample_rates[start:stop]
        meta = {k: m[start:stop] for k, m in self.meta.items()}
        return MediaTable(
            self.kind, self.values[a:b], self.offsets[start : stop + 1] - a, self.keys[start:stop], rates, meta
        )

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MediaTable:
        rates = None if self.sample_rates is None else fn(self.sample_rates)
        meta = {k: fn(m) for k, m in self.meta.items()}
        return MediaTable(self.kind, fn(self.values), fn(self.offsets), self.keys, rates, meta)

    def pin_memory(self) -> MediaTable:
        """A copy in pinned host memory (for asynchronous copies to a GPU)."""
        return self._map(lambda t: t.pin_memory())

    def to(self, device: str | torch.device, non_blocking: bool = False) -> MediaTable:
        """A copy on ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    @staticmethod
    def empty_like(
        kind: str,
        feature_shape: Sequence[int],
        dtype: torch.dtype,
        length: int = 1,
        meta: Mapping[str, torch.Tensor] | None = None,
    ) -> MediaTable:
        """One all-zero item of ``length`` rows: the input of a dummy encode on a rank without media.

        Args:
            kind: Media kind.
            feature_shape: Trailing shape of one row (e.g. ``(C * p * p,)``).
            dtype: Values dtype.
            length: Rows of the dummy item.
            meta: The dummy item's metadata (each tensor with one row), e.g. ``{"image_grid_thw": [[1, 2, 2]]}``.
        """
        values = torch.zeros((length, *feature_shape), dtype=dtype)
        rates = torch.ones(1, dtype=torch.long) if kind == "audio" else None
        m = {k: torch.as_tensor(v) for k, v in (meta or {}).items()}
        return MediaTable(kind, values, torch.tensor([0, length], dtype=torch.long), ("dummy",), rates, m)


@dataclass
class MediaOccurrences:
    """The media occurrences of one kind in one micro-batch, in trajectory order then media order.

    Attributes:
        index: ``int64 [n]``: the unique item (row of the :class:`MediaTable`) of each occurrence.
        trajectory: ``int64 [n]``: position of the holding trajectory in the micro-batch.
        item: ``int64 [n]``: index of the occurrence in that trajectory's ``media`` list.
    """

    index: torch.Tensor
    trajectory: torch.Tensor
    item: torch.Tensor

    def __len__(self) -> int:
        return int(self.index.numel())

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MediaOccurrences:
        return MediaOccurrences(fn(self.index), fn(self.trajectory), fn(self.item))


@dataclass
class MultimodalBatch:
    """Unique media table of one consumer's share of one mini-batch, with per-micro-batch indices.

    Attributes:
        tables: Per kind, the unique processed media.
        occurrences: Per micro-batch (training order), per kind, the occurrences; a kind missing from a
            micro-batch's dict has no occurrence there.
        trajectory_ids: Per micro-batch, the ids of its trajectories (as given to the collator).
        pack_stats: What building the tables cost (:class:`MultimodalCollator`): ``processed_items`` (raw items
            decoded and preprocessed), ``table_bytes`` (bytes of the tables' values), ``placed_bytes`` (of them,
            written by the preprocessing straight into the table) and ``copied_bytes`` (copied into the table
            after preprocessing: items whose preprocessing cannot write into it, a table that grew).
    """

    tables: dict[str, MediaTable]
    occurrences: list[dict[str, MediaOccurrences]]
    trajectory_ids: list[tuple[str, ...]] = field(default_factory=list)
    pack_stats: dict[str, int] = field(default_factory=dict, compare=False)
    _moved: dict[Any, MultimodalBatch] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_microbatches(self) -> int:
        """Number of micro-batches ``K``."""
        return len(self.occurrences)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Media kinds present (sorted)."""
        return tuple(sorted(self.tables))

    @property
    def num_unique(self) -> int:
        """Unique items over all kinds."""
        return sum(t.num_items for t in self.tables.values())

    @property
    def num_occurrences(self) -> int:
        """Media occurrences over all micro-batches and kinds (what a naive trainer encodes)."""
        return sum(len(o) for mb in self.occurrences for o in mb.values())

    @property
    def is_empty(self) -> bool:
        """True when no micro-batch holds media."""
        return self.num_unique == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the tables and index tensors."""
        n = sum(t.nbytes for t in self.tables.values())
        return n + sum(3 * 8 * len(o) for mb in self.occurrences for o in mb.values())

    def for_microbatch(self, i: int) -> dict[str, MediaOccurrences]:
        """The occurrences of micro-batch ``i`` per kind (kinds without occurrences are left out)."""
        if not 0 <= i < self.num_microbatches:
            raise IndexError(f"micro-batch {i} out of range 0..{self.num_microbatches - 1}")
        return self.occurrences[i]

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MultimodalBatch:
        return MultimodalBatch(
            {k: t._map(fn) for k, t in self.tables.items()},
            [{k: o._map(fn) for k, o in mb.items()} for mb in self.occurrences],
            list(self.trajectory_ids),
            dict(self.pack_stats),
        )

    def pin_memory(self) -> MultimodalBatch:
        """A copy in pinned host memory; memoized, so every micro-batch sharing this batch pins it once."""
        key = ("pin",)
        if key not in self._moved:
            self._moved[key] = self._map(lambda t: t.pin_memory())
        return self._moved[key]

    def to(self, device: str | torch.device, non_blocking: bool = False) -> MultimodalBatch:
        """A copy on ``device``; memoized per device, so attaching one batch to K micro-batches copies it once.

        Args:
            device: Target device.
            non_blocking: Asynchronous copy (from pinned memory to a GPU).
        """
        dev = torch.device(device)
        if all(t.values.device == dev for t in self.tables.values()) and self.tables:
            return self
        key = ("to", str(dev))
        if key not in self._moved:
            self._moved[key] = self._map(lambda t: t.to(dev, non_blocking=non_blocking))
        return self._moved[key]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a 1-D ``uint8`` tensor (a view when ``t`` is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _signature(pm: ProcessedMedia) -> tuple[Any, ...]:
    """What equal processed inputs share: kind, sample rate, dtype, shape, metadata (whole: it is small) and
    :data:`_SAMPLED` evenly spaced values."""
    t = pm.tensor.detach()
    flat = t.reshape(-1)
    sample = flat[:: max(1, flat.numel() // _SAMPLED)][:_SAMPLED].cpu()
    meta = tuple((name, str(m.dtype), tuple(m.shape), _flat_bytes(m.cpu()).numpy().tobytes())
                 for name, m in sorted((pm.meta or {}).items()))
    return (pm.kind, pm.sample_rate or 0, str(t.dtype), tuple(t.shape), meta,
            _flat_bytes(sample).numpy().tobytes())


class EqualInputs:
    """The processed inputs seen so far, each under a key: finds the one equal to a new input, if any.

    Equal means what :func:`~knitdata.media.process.processed_digest` identifies (kind, sample rate, dtype, shape, bytes and
    metadata), found by comparing instead of hashing: inputs are grouped by their signature (those fields but the
    bytes, plus :data:`_SAMPLED` evenly spaced values), so a new input is compared in full (a byte comparison) only
    with the inputs that agree on it. Equal inputs always agree on it: none is missed. Should more than
    :data:`_COMPARED` inputs agree on one signature (near-equal inputs, e.g. mostly padding), the later ones of it are
    told apart by their :func:`~knitdata.record.tensor_digest` instead, each hashed once.

    Example:
        >>> import torch
        >>> from knitdata.media.process import ProcessedMedia
        >>> same = EqualInputs()
        >>> same.key(ProcessedMedia("image", torch.ones(4, 8)), "a")
        'a'
        >>> same.key(ProcessedMedia("image", torch.ones(4, 8)), "b")  # equal to the first: its key
        'a'
        >>> same.key(ProcessedMedia("image", torch.zeros(4, 8)), "c")
        'c'
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, ...], list[tuple[ProcessedMedia, Any]]] = {}
        self._hashed: dict[tuple[Any, ...], dict[str, Any]] = {}  # per signature past _COMPARED: digest -> key

    def key(self, pm: ProcessedMedia, new: Any) -> Any:
        """The key of an input equal to ``pm`` seen before; else ``pm`` is kept under ``new``, which is returned."""
        sig = _signature(pm)
        peers = self._seen.setdefault(sig, [])
        if len(peers) < _COMPARED:
            if peers:
                mine = _flat_bytes(pm.tensor)
                for other, k in peers:
                    if torch.equal(mine, _flat_bytes(other.tensor).to(mine.device)):
                        return k
            peers.append((pm, new))
            return new
        hashed = self._hashed.get(sig)
        if hashed is None:  # the first input past the limit: the peers are hashed once, first key kept
            hashed = self._hashed[sig] = {}
            for other, k in peers:
                hashed.setdefault(tensor_digest(other.tensor), k)
        return hashed.setdefault(tensor_digest(pm.tensor), new)


def _meta_sig(meta: Mapping[str, torch.Tensor]) -> str:
    return "{" + ", ".join(f"{k}: {str(v.dtype).removeprefix('torch.')}{list(v.shape)}" for k, v in sorted(meta.items())) + "}"

def _check_packable(kind: str, pm: ProcessedMedia, first: ProcessedMedia, first_where: tuple[str, int],
                    trajectory_id: str, index: int) -> None:
    """Refuse a processed item that cannot be packed with the first of its kind (metadata, dtype, row shape)."""
    t0, i0 = first_where
    ref_meta, pm_meta = first.meta or {}, pm.meta or {}
    if sorted(ref_meta) != sorted(pm_meta) or any(
        pm_meta[m].shape != ref_meta[m].shape or pm_meta[m].dtype != ref_meta[m].dtype for m in ref_meta
    ):
        raise MediaError(
            f"processed {kind} carries metadata {_meta_sig(pm_meta)}, but item {i0} of trajectory {t0!r} carries "
            f"{_meta_sig(ref_meta)}; items of one kind need the same metadata names, shapes and dtypes",
            trajectory_id=trajectory_id,
            item=index,
        )
    ref = first.tensor
    if pm.tensor.dtype != ref.dtype or pm.tensor.shape[1:] != ref.shape[1:]:
        raise MediaError(
            f"processed {kind} has dtype {pm.tensor.dtype} and row shape {tuple(pm.tensor.shape[1:])}, but item "
            f"{i0} of trajectory {t0!r} has {ref.dtype} and {tuple(ref.shape[1:])}; items of one kind are packed "
            "along their first dimension: make preprocessing return [length, *same features]",
            trajectory_id=trajectory_id,
            item=index,
        )


class _Packer:
    """The values of one kind's table, preallocated: preprocessing writes each new item at the tail.

    The buffer is sized at the first item for every distinct item of the kind (``capacity`` items of the first's
    rows) and grows by doubling when later items are longer (that copy is counted). An item whose preprocessing
    could not write into it (its callable has no ``out``, a pass-through input) is copied in (counted); if the
    kind's first item already could not, the kind is packed at the end (one ``torch.cat``, counted), or kept as a
    view when it has one item.
    """

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.buf: torch.Tensor | None = None
        self.tail = 0
        self.rows: list[ProcessedMedia] = []
        self.placed = 0
        self.copied = 0

    def out(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory for a new item of ``shape`` at the tail (fresh memory when it cannot go into the buffer)."""
        n, feat = int(shape[0]), tuple(shape[1:])
        if self.buf is None:
            if self.rows:  # the first item was not written here: this kind is packed at the end
                return torch.empty(shape, dtype=dtype)
            self.buf = torch.empty((n * self.capacity, *feat), dtype=dtype)
        elif self.buf.dtype != dtype or tuple(self.buf.shape[1:]) != feat:
            return torch.empty(shape, dtype=dtype)  # not packable: refused by _check_packable
        if self.tail + n > self.buf.shape[0]:
            grown = torch.empty((max(2 * self.buf.shape[0], self.tail + n), *feat), dtype=dtype)
            grown[: self.tail].copy_(self.buf[: self.tail])
            self.copied += self.tail * _row_bytes(self.buf)
            self.buf = grown
        return self.buf[self.tail : self.tail + n]

    def _at_tail(self, t: torch.Tensor) -> bool:
        b = self.buf
        return (b is not None and t.dtype == b.dtype and t.shape[1:] == b.shape[1:]
                and self.tail + t.shape[0] <= b.shape[0] and t.is_contiguous()
                and t.data_ptr() == b.data_ptr() + self.tail * _row_bytes(b))

    def add(self, pm: ProcessedMedia) -> ProcessedMedia:
        """Take ``pm`` as the next row; returns it with its tensor in the table where it is packed now."""
        t = pm.tensor
        if self.buf is not None:
            if self._at_tail(t):
                self.placed += t.numel() * t.element_size()
            else:
                dest = self.out(tuple(t.shape), t.dtype)
                if self.buf is not None and self._at_tail(dest):
                    dest.copy_(t)
                    self.copied += t.numel() * t.element_size()
                    pm = ProcessedMedia(pm.kind, dest, pm.sample_rate, pm.meta)
                    t = dest
            if self._at_tail(t):
                self.tail += t.shape[0]
        self.rows.append(pm)
        return pm

    def values(self) -> torch.Tensor:
        """The packed values (a view of the buffer when every row is in it)."""
        lst = self.rows
        if self.buf is not None and sum(p.tensor.shape[0] for p in lst) == self.tail:
            return self.buf[: self.tail]
        if len(lst) == 1:
            return lst[0].tensor
        out = torch.cat([p.tensor for p in lst], 0)
        self.copied += out.numel() * out.element_size()
        return out


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


class MultimodalCollator:
    """Build a :class:`MultimodalBatch` from one consumer's micro-batches of one mini-batch.

    Args:
        preprocess: Per kind, the model's preprocessing callable (see :class:`~knitdata.media.process.MediaProcessor`),
            e.g. ``{"image": patchify(14, size=(224, 224))}``.
        key: ``"digest"`` (default): an item is found by its raw content digest (:attr:`MediaItem.digest
            <knitdata.record.MediaItem.digest>`, computed when the item was made and carried through storage:
            nothing is hashed here), so each distinct raw item is decoded and processed once; processed inputs
            of different raw items that are equal share a row too (:class:`EqualInputs`: compared, not hashed).
            Right for every layout: an image shared by different prompts, an agent's screenshots repeated in every
            later turn, episodes of one group that share their first screenshots and diverge after.
            ``"provenance"``: ``(group, media index)``, for GRPO groups whose members carry the same media list
            (free, but only right then): it is wrong for agent episodes, whose siblings carry different
            screenshots under the same index once they diverge, and such a group is refused
            (:class:`~knitdata.errors.MediaError` naming the group and the index): use ``"digest"``.
        image_mode: Pillow mode images are converted to.
        processor: A ready :class:`~knitdata.media.process.MediaProcessor` (overrides ``preprocess``/``image_mode``/
            ``video_sampling``).
        video_sampling: How video frames are sampled (:class:`~knitdata.media.video.VideoSampling`; default 2 per
            second). A video's digest key covers its container bytes and this sampling.

    Raises:
        ValueError: Unknown ``key``.
    """

    def __init__(
        self,
        preprocess: Mapping[str, Callable[..., torch.Tensor | tuple[torch.Tensor, Mapping[str, torch.Tensor]]]] | None = None,
        key: str = "digest",
        *,
        image_mode: str | None = "RGB",
        processor: MediaProcessor | None = None,
        video_sampling: VideoSampling | None = None,
    ):
        if key not in KEY_MODES:
            raise ValueError(f"key must be one of {KEY_MODES}, got {key!r}")
        self.key = key
        self.processor = processor or MediaProcessor(preprocess, image_mode=image_mode, video_sampling=video_sampling)

    def __call__(self, micro_batches: Sequence[Sequence[Trajectory]]) -> MultimodalBatch:
        """Collate the media of the micro-batches (in training order).

        Args:
            micro_batches: Per micro-batch, its trajectories (a micro-batch may be empty or hold no media).

        Returns:
            The batch of unique media tables and per-micro-batch occurrences.

        Raises:
            MediaError: An item cannot be decoded or processed, processed items of one kind cannot be packed
                (trailing shapes or dtypes differ), or (provenance keys) a group's members disagree.
        """
        by_raw: dict[str, ProcessedMedia] = {}  # raw key -> processed (each distinct raw item processed once)
        processed_key: dict[str, Any] = {}  # raw key -> key of the row of its processed input
        same = EqualInputs()  # digest keys: an equal input of another raw item shares its row (compared, not hashed)
        key_to_row: dict[str, dict[Any, int]] = {}
        rows: dict[str, list[ProcessedMedia]] = {}
        prov_key: dict[Any, str] = {}
        first_where: dict[str, tuple[str, int]] = {}
        occ: list[dict[str, tuple[list[int], list[int], list[int]]]] = []
        ids: list[tuple[str, ...]] = []
        raw_key = self.processor.raw_key
        distinct: dict[str, set[Any]] = {}  # per kind, the distinct items (sizes each table's buffer)
        for mb in micro_batches:
            for traj in mb:
                for n, item in enumerate(traj.media):
                    distinct.setdefault(item.kind, set()).add(
                        provenance_key(traj.group, n) if self.key == "provenance" else raw_key(item))
        packers = {kind: _Packer(len(keys)) for kind, keys in distinct.items()}
        processed = 0
        for mb in micro_batches:
            cur: dict[str, tuple[list[int], list[int], list[int]]] = {}
            ids.append(tuple(t.id for t in mb))
            for j, traj in enumerate(mb):
                for n, item in enumerate(traj.media):
                    rk = raw_key(item)
                    if self.key == "provenance":
                        k: Any = provenance_key(traj.group, n)
                        seen = prov_key.setdefault(k, rk)  # the raw key: an audio clip's rate counts too
                        if seen != rk:
                            raise MediaError(
                                f"group {traj.group!r} carries different media under index {n}; provenance keys "
                                "need every member of a group to share its media: use key='digest'",
                                trajectory_id=traj.id,
                                item=n,
                            )
                        kind_rows = key_to_row.setdefault(item.kind, {})
                        if k not in kind_rows:
                            pm = by_raw.get(rk) or self.processor.process(item, trajectory_id=traj.id, index=n,
                                                                          out=packers[item.kind].out)
                            processed += rk not in by_raw
                            by_raw[rk] = pm
                    else:
                        cached = by_raw.get(rk)
                        if cached is None:
                            cached = by_raw[rk] = self.processor.process(item, trajectory_id=traj.id, index=n,
                                                                         out=packers[item.kind].out)
                            processed += 1
                            processed_key[rk] = same.key(cached, rk)
                        pm = cached
                        k = processed_key[rk]
                        kind_rows = key_to_row.setdefault(item.kind, {})
                    if k not in kind_rows:
                        lst = rows.setdefault(item.kind, [])
                        if lst:
                            _check_packable(item.kind, pm, lst[0], first_where[item.kind], traj.id, n)
                        else:
                            first_where[item.kind] = (traj.id, n)
                        kind_rows[k] = len(lst)
                        lst.append(packers[item.kind].add(pm))
                    c = cur.setdefault(item.kind, ([], [], []))
                    c[0].append(kind_rows[k])
                    c[1].append(j)
                    c[2].append(n)
            occ.append(cur)
        tables: dict[str, MediaTable] = {}
        for kind, lst in rows.items():
            lengths = torch.tensor([p.tensor.shape[0] for p in lst], dtype=torch.long)
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
            values = packers[kind].values()
            keys = tuple(key for key, _ in sorted(key_to_row[kind].items(), key=lambda kv: kv[1]))
            rates = torch.tensor([p.sample_rate for p in lst], dtype=torch.long) if kind == "audio" else None
            meta = {m: torch.stack([p.meta[m] for p in lst]) for m in (lst[0].meta or {})}  # type: ignore[index]
            tables[kind] = MediaTable(kind, values, offsets, keys, rates, meta)
        occurrences = [
            {
                kind: MediaOccurrences(*(torch.tensor(v, dtype=torch.long) for v in lists))
                for kind, lists in cur.items()
            }
            for cur in occ
        ]
        stats = {"processed_items": processed,
                 "table_bytes": sum(t.values.numel() * t.values.element_size() for t in tables.values()),
                 "placed_bytes": sum(p.placed for p in packers.values()),
                 "copied_bytes": sum(p.copied for p in packers.values())}
        return MultimodalBatch(tables, occurrences, ids, stats)
