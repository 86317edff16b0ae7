"""Token collate: trajectories to one micro-batch of tensors.

:class:`TokenCollator` turns a sequence of :class:`~knitdata.record.Trajectory` into a :class:`MicroBatch`,
either right-padded (``mode="pad"``, ``[B, T]``) or packed into one row with ``cu_seqlens``
(``mode="pack"``, ``[1, N]``, the layout of variable-length attention kernels). Every token tensor is aligned
with ``input_ids`` (prompt followed by response); ``loss_mask`` is ``float32`` and zero over prompts and
padding. :class:`MicroBatchInfo` is the planner's metadata for the micro-batch (indices, ``is_last``, global
counts for loss scaling, policy versions), JSON-serializable; it is defined where it is produced,
:mod:`knitdata.planner.records`, and re-exported here.

:class:`MicroBatch` has ``pin_memory()`` and ``to(device, non_blocking=...)``, so
``torch.utils.data``'s pin-memory thread and ``accelerate.utils.send_to_device`` handle it as a unit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch

from knitdata.errors import ConfigError, FieldTypeError, ValidationError
from knitdata.planner.records import MicroBatchInfo
from knitdata.record import Trajectory

_id_of = attrgetter("id")

__all__ = ["MicroBatchInfo", "MicroBatch", "TokenCollator", "COLLATE_MODES", "TENSOR_LAYOUTS"]

#: Layouts :class:`TokenCollator` produces.
COLLATE_MODES: tuple[str, ...] = ("pad", "pack")
#: The layouts an extra tensor can be declared with (:class:`TokenCollator` ``tensor_layouts``).
TENSOR_LAYOUTS: tuple[str, ...] = ("token", "stack")

#: Fill value of ``tensors["token_versions"]`` outside responses (prompt and padding).
NO_VERSION: int = -1


def _map_tensors(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _same(a: Any, b: Any, rtol: float, atol: float) -> bool:
    """Deep equality for :meth:`MicroBatch.equals`: tensors by dtype, shape and values; containers element-wise.

    Dataclass fields declared with ``compare=False`` (caches) are skipped.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.device.type != b.device.type:
            return False
        if (rtol or atol) and a.is_floating_point():
            return bool(torch.allclose(a, b.to(a.device), rtol=rtol, atol=atol, equal_nan=True))
        return bool(torch.equal(a, b.to(a.device)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k], rtol, atol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y, rtol, atol) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        if type(a) is not type(b):
            return False
        return all(_same(getattr(a, f.name), getattr(b, f.name), rtol, atol) for f in dataclasses.fields(a) if f.compare)
    return bool(a == b)


@dataclass(eq=False)
class MicroBatch:
    """One micro-batch of token tensors, ready for a forward pass.

    Layouts: ``pad`` gives ``[B, T]`` tensors and an ``attention_mask``; ``pack`` gives ``[1, N]`` tensors,
    no ``attention_mask`` and ``cu_seqlens`` (``int32 [B+1]``) with ``position_ids`` restarting at 0 for
    every sequence. An empty micro-batch (no trajectory) has ``[0, 0]`` token tensors.

    Attributes:
        input_ids: ``int64`` token ids, prompt then response per sequence.
        attention_mask: ``int64`` 1 on real tokens, 0 on padding (pad mode), else ``None``.
        position_ids: ``int64`` positions within each sequence (0 on padding).
        loss_mask: ``float32``, aligned with ``input_ids``: 0 on prompt and padding, the trajectory's loss
            mask (or 1) on its response.
        cu_seqlens: ``int32 [B+1]`` cumulative sequence lengths (pack mode), else ``None``.
        scalars: Per scalar field a ``float32 [B]`` tensor.
        tensors: Extra per-trajectory tensors: response-aligned ones aligned with ``input_ids`` (zeros
            elsewhere; ``token_versions`` uses -1), others stacked ``[B, ...]``.
        info: Planner metadata, or ``None`` when collated without it.
        media: A multimodal batch (anything with ``pin_memory()``/``to()``) or ``None``.
        prompt_lengths: ``int64 [B]`` prompt lengths (row order), or ``None``.
        response_lengths: ``int64 [B]`` response lengths, or ``None``.

    Equality: ``mb1 == mb2`` is :meth:`equals` (exact: every field, tensor dtypes and shapes included, media and
    ``info`` too), so lists of micro-batches compare with ``==``. :meth:`equals` also takes tolerances.
    Micro-batches are not hashable.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor | None
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    info: MicroBatchInfo | None = None
    media: Any = None
    prompt_lengths: torch.Tensor | None = None
    response_lengths: torch.Tensor | None = None

    # ------------------------------------------------------------------ comparison
    def equals(self, other: object, *, rtol: float = 0.0, atol: float = 0.0) -> bool:
        """Whether ``other`` is a micro-batch with the same fields.

        Tensors (nested in dicts, lists and dataclasses too, e.g. the media batch) must have the same dtype,
        shape and device type and, with the default tolerances, equal values (``torch.equal``); with ``rtol`` or
        ``atol`` floating-point values are compared with ``torch.allclose`` (NaNs equal). ``info`` and every other
        value compare with ``==``.

        Args:
            other: Anything; ``False`` unless it is a :class:`MicroBatch`.
            rtol: Relative tolerance for floating-point tensors.
            atol: Absolute tolerance for floating-point tensors.

        Returns:
            ``True`` when every field matches.
        """
        if not isinstance(other, MicroBatch):
            return False
        return all(_same(getattr(self, f.name), getattr(other, f.name), rtol, atol) for f in dataclasses.fields(self))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MicroBatch):
            return NotImplemented
        return self.equals(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    # ------------------------------------------------------------------ derived values
    @property
    def num_sequences(self) -> int:
        """Number of sequences (trajectories) in the micro-batch."""
        if self.response_lengths is not None:
            return int(self.response_lengths.numel())
        if self.cu_seqlens is not None:
            return int(self.cu_seqlens.numel()) - 1
        return int(self.input_ids.shape[0]) if self.input_ids.numel() else 0

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        if self.prompt_lengths is not None and self.response_lengths is not None:
            return int(self.prompt_lengths.sum()) + int(self.response_lengths.sum())
        if self.cu_seqlens is not None:
            return int(self.cu_seqlens[-1])
        if self.attention_mask is not None:
            return int(self.attention_mask.sum())
        return int(self.input_ids.numel())

    @property
    def num_loss_tokens(self) -> float:
        """Sum of ``loss_mask`` (the tokens the loss counts)."""
        return float(self.loss_mask.sum()) if self.loss_mask.numel() else 0.0

    @property
    def is_empty(self) -> bool:
        """True when the micro-batch holds no sequence."""
        return self.num_sequences == 0

    def iter_tensors(self) -> Iterator[torch.Tensor]:
        """Yield every tensor of the micro-batch (media excluded)."""
        for name in ("input_ids", "attention_mask", "position_ids", "loss_mask", "cu_seqlens",
                     "prompt_lengths", "response_lengths"):
            t = getattr(self, name)
            if t is not None:
                yield t
        yield from self.scalars.values()
        yield from self.tensors.values()

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors, media included when it reports ``nbytes``."""
        total = sum(t.numel() * t.element_size() for t in self.iter_tensors())
        media_bytes = getattr(self.media, "nbytes", 0) if self.media is not None else 0
        return total + (int(media_bytes) if isinstance(media_bytes, int) else 0)

    # ------------------------------------------------------------------ movement
    def _apply(self, fn: Any, media_fn: Any) -> MicroBatch:
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("info", "media"):
                continue
            changes[f.name] = _map_tensors(getattr(self, f.name), fn)
        changes["media"] = media_fn(self.media) if self.media is not None else None
        return dataclasses.replace(self, **changes)

    def pin_memory(self) -> MicroBatch:
        """Return a copy whose CPU tensors (media included) are in page-locked memory.

        Pinned memory lets ``to(device, non_blocking=True)`` overlap the copy with compute. On a machine
        without CUDA (CPU-only torch) pinning is impossible and pointless: this returns ``self`` unchanged
        instead of failing, so the same code runs everywhere. Already pinned tensors are not copied again.
        """
        if not torch.cuda.is_available():
            return self

        def pin(t: torch.Tensor) -> torch.Tensor:
            return t if t.device.type != "cpu" or t.is_pinned() else t.pin_memory()

        def pin_media(m: Any) -> Any:
            return m.pin_memory() if hasattr(m, "pin_memory") else m

        return self._apply(pin, pin_media)

    def to(self, device: str | torch.device | int, non_blocking: bool = False) -> MicroBatch:
        """Return a copy with every tensor (media included) on ``device``; ``info`` is kept.

        Args:
            device: Target device (``"cuda"``, ``torch.device("cuda", 1)``, an index, ``"cpu"``).
            non_blocking: Asynchronous copy (effective from pinned memory to CUDA only). The caller must
                synchronize the copying stream with the stream that uses the tensors.
        """
        if isinstance(device, int):
            device = torch.device("cuda", device)

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        def move_media(m: Any) -> Any:
            if not hasattr(m, "to"):
                return m
            try:
                return m.to(device, non_blocking=non_blocking)
            except TypeError:
                return m.to(device)

        return self._apply(move, move_media)

    def record_stream(self, stream: Any) -> None:
        """Mark every tensor (media included when it has ``record_stream``) as used on a CUDA ``stream``."""
        for t in self.iter_tensors():
            if t.device.type == "cuda":
                t.record_stream(stream)
        if self.media is not None and hasattr(self.media, "record_stream"):
            self.media.record_stream(stream)


class TokenCollator:
    """Collate trajectories into a :class:`MicroBatch`.

    Args:
        pad_id: Token id used for padding.
        mode: ``"pad"`` (right padding to the longest sequence) or ``"pack"`` (one row with ``cu_seqlens``).
        pad_to_multiple_of: Round the padded length up to a multiple of this (pad mode: ``T``; pack mode:
            the packed row ``N``, the tail being padding outside every sequence: ``cu_seqlens[-1]`` stays the
            number of real tokens).
        tensor_layouts: The layout of named extra tensors, declared: ``"token"`` (1-D of the response's length
            in every trajectory, aligned with ``input_ids``) or ``"stack"`` (one shape in every trajectory,
            stacked ``[B, ...]``). A tensor that does not fit its declared layout is refused, naming the
            trajectory and field. Undeclared names follow the rule below.

    Extra tensors (``Trajectory.tensors``): a field that is 1-D with the response's length in *every*
    trajectory is aligned with ``input_ids`` like ``loss_mask`` (zeros on prompt and padding); otherwise
    the values are stacked ``[B, ...]`` when all shapes agree. A fixed-size vector whose size happens to
    equal every response length of a micro-batch is therefore aligned there and stacked elsewhere: declare it
    (``tensor_layouts={"emb": "stack"}``) so that its layout does not depend on the data.
    Dtypes are promoted across trajectories. Per-token ``token_versions`` (if any trajectory has them)
    become ``tensors["token_versions"]`` (``gen_version`` where a trajectory has none, -1 off responses).

    Example:
        >>> import torch
        >>> from knitdata import Trajectory
        >>> ts = [Trajectory(id=f"t{i}", source="s", group="g", prompt_ids=torch.arange(2),
        ...                  response_ids=torch.arange(4), tensors={"emb": torch.zeros(4)}) for i in range(2)]
        >>> tuple(TokenCollator()(ts).tensors["emb"].shape), tuple(TokenCollator(tensor_layouts={"emb": "stack"})(ts).tensors["emb"].shape)
        ((2, 6), (2, 4))

    Raises:
        ConfigError: Unknown mode, a non-positive ``pad_to_multiple_of`` or an unknown layout.
    """

    def __init__(self, pad_id: int = 0, mode: str = "pad", pad_to_multiple_of: int | None = None,
                 tensor_layouts: Mapping[str, str] | None = None):
        if mode not in COLLATE_MODES:
            raise ConfigError(f"unknown collate mode {mode!r}; use one of {COLLATE_MODES}")
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ConfigError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}")
        layouts = dict(tensor_layouts or {})
        for name, layout in layouts.items():
            if layout not in TENSOR_LAYOUTS:
                raise ConfigError(f"tensor_layouts[{name!r}] must be one of {TENSOR_LAYOUTS}, got {layout!r}")
        self.pad_id = int(pad_id)
        self.mode = mode
        self.pad_to_multiple_of = pad_to_multiple_of
        self.tensor_layouts = layouts

    def __repr__(self) -> str:
        more = f", tensor_layouts={self.tensor_layouts}" if self.tensor_layouts else ""
        return (f"TokenCollator(pad_id={self.pad_id}, mode={self.mode!r}, "
                f"pad_to_multiple_of={self.pad_to_multiple_of}{more})")

    def _round(self, n: int) -> int:
        m = self.pad_to_multiple_of
        return n if m is None or n == 0 else -(-n // m) * m

    def empty(self, info: MicroBatchInfo | None = None) -> MicroBatch:
        """Return the empty micro-batch (``[0, 0]`` tensors) of this collator's layout."""
        z = torch.zeros(0, 0, dtype=torch.int64)
        return MicroBatch(
            input_ids=z,
            attention_mask=z.clone() if self.mode == "pad" else None,
            position_ids=z.clone(),
            loss_mask=torch.zeros(0, 0, dtype=torch.float32),
            cu_seqlens=torch.zeros(1, dtype=torch.int32) if self.mode == "pack" else None,
            info=info,
            prompt_lengths=torch.zeros(0, dtype=torch.int64),
            response_lengths=torch.zeros(0, dtype=torch.int64),
        )

    def __call__(self, trajs: Sequence[Trajectory], info: MicroBatchInfo | None = None) -> MicroBatch:
        """Collate ``trajs`` (row order kept) into a micro-batch carrying ``info``.

        Raises:
            FieldTypeError: An element is not a Trajectory.
            ValidationError: A scalar or extra tensor is missing from some trajectories, or extra tensors
                of one name cannot be aligned or stacked; the message names the trajectory and field.
        """
        for i, t in enumerate(trajs):
            if not isinstance(t, Trajectory):
                raise FieldTypeError(f"element {i} is a {type(t).__name__}, expected a Trajectory", field="trajs")
        if info is not None and not isinstance(info, MicroBatchInfo):
            raise FieldTypeError(f"expected a MicroBatchInfo, got {type(info).__name__}", field="info")
        if not trajs:
            return self.empty(info)
        # a C map, no generator frame: the dataset passes every micro-batch's info (a plain DataLoader passes none)
        if info is not None and info.trajectory_ids and tuple(map(_id_of, trajs)) != info.trajectory_ids:
            raise ValidationError("info.trajectory_ids do not match the trajectories collated", field="info")

        b = len(trajs)
        plens = [int(t.prompt_ids.numel()) for t in trajs]
        rlens = [int(t.response_ids.numel()) for t in trajs]
        lens = [p + r for p, r in zip(plens, rlens)]
        pack = self.mode == "pack"
        if pack:
            starts = [0] * b
            acc = 0
            for i, n in enumerate(lens):
                starts[i] = acc
                acc += n
            shape = (1, self._round(acc))
        else:
            shape = (b, self._round(max(lens)))

        def slot(i: int, lo: int, hi: int) -> tuple[Any, slice]:
            # (row, columns) of tokens lo..hi of sequence i
            return (0, slice(starts[i] + lo, starts[i] + hi)) if pack else (i, slice(lo, hi))

        input_ids = torch.full(shape, self.pad_id, dtype=torch.int64)
        position_ids = torch.zeros(shape, dtype=torch.int64)
        loss_mask = torch.zeros(shape, dtype=torch.float32)
        attention_mask = None if pack else torch.zeros(shape, dtype=torch.int64)
        for i, t in enumerate(trajs):
            p, n = plens[i], lens[i]
            row, cols = slot(i, 0, p)
            input_ids[row, cols] = t.prompt_ids
            row, cols = slot(i, p, n)
            input_ids[row, cols] = t.response_ids
            loss_mask[row, cols] = 1.0 if t.loss_mask is None else t.loss_mask.to(torch.float32)
            row, cols = slot(i, 0, n)
            position_ids[row, cols] = torch.arange(n, dtype=torch.int64)
            if attention_mask is not None:
                attention_mask[row, cols] = 1

        cu_seqlens = None
        if pack:
            cu_seqlens = torch.zeros(b + 1, dtype=torch.int32)
            cu_seqlens[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)

        return MicroBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            loss_mask=loss_mask,
            cu_seqlens=cu_seqlens,
            scalars=self._scalars(trajs),
            tensors=self._tensors(trajs, shape, slot, plens, rlens, self.tensor_layouts),
            info=info,
            prompt_lengths=torch.tensor(plens, dtype=torch.int64),
            response_lengths=torch.tensor(rlens, dtype=torch.int64),
        )

    @staticmethod
    def _scalars(trajs: Sequence[Trajectory]) -> dict[str, torch.Tensor]:
        names: list[str] = []
        for t in trajs:
            names.extend(k for k in t.scalars if k not in names)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            for t in trajs:
                if name not in t.scalars:
                    raise ValidationError(
                        "missing here but present in other trajectories of the micro-batch; give every "
                        "trajectory the same scalar fields",
                        trajectory_id=t.id,
                        field=f"scalars.{name}",
                    )
            out[name] = torch.tensor([float(t.scalars[name]) for t in trajs], dtype=torch.float32)
        return out

    @staticmethod
    def _tensors(
        trajs: Sequence[Trajectory], shape: tuple[int, int], slot: Any, plens: list[int], rlens: list[int],
        layouts: Mapping[str, str],
    ) -> dict[str, torch.Tensor]:
        names: list[str] = []
        for t in trajs:
            names.extend(k for k in t.tensors if k not in names)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            fname = f"tensors.{name}"
            for t in trajs:
                if name not in t.tensors:
                    raise ValidationError(
                        "missing here but present in other trajectories of the micro-batch; give every "
                        "trajectory the same extra tensors",
                        trajectory_id=t.id,
                        field=fname,
                    )
            vals = [t.tensors[name] for t in trajs]
            dtype = vals[0].dtype
            for v in vals[1:]:
                dtype = torch.promote_types(dtype, v.dtype)
            follows = [v.dim() == 1 and v.numel() == r for v, r in zip(vals, rlens)]  # each follows its response
            declared = layouts.get(name)
            if declared is not None:
                if declared == "token":
                    bad = follows.index(False) if False in follows else -1
                else:
                    bad = next((i for i, v in enumerate(vals) if v.shape != vals[0].shape), -1)
                if bad >= 0:
                    want = (f"1-D of its response length ({rlens[bad]})" if declared == "token"
                            else f"of the shape {tuple(vals[0].shape)} of trajectory {trajs[0].id!r}")
                    raise ValidationError(
                        f"shape {tuple(vals[bad].shape)} is not {want}, as its declared layout {declared!r} "
                        "(tensor_layouts) requires",
                        trajectory_id=trajs[bad].id,
                        field=fname,
                    )
            if declared != "stack" and all(follows):
                aligned = torch.zeros(shape, dtype=dtype)
                for i, v in enumerate(vals):
                    row, cols = slot(i, plens[i], plens[i] + rlens[i])
                    aligned[row, cols] = v.to(dtype)
                out[name] = aligned
            elif all(v.shape == vals[0].shape for v in vals):
                out[name] = torch.stack([v.to(dtype) for v in vals])
            else:
                if any(follows):  # some follow their responses: the culprit is one that does not
                    bad, good = follows.index(False), follows.index(True)
                    raise ValidationError(
                        f"shape {tuple(vals[bad].shape)} is not 1-D of its response length ({rlens[bad]}), while "
                        f"that of trajectory {trajs[good].id!r} does; extra tensors must either follow "
                        "the response tokens or have one shape in every trajectory",
                        trajectory_id=trajs[bad].id,
                        field=fname,
                    )
                bad = next(i for i, v in enumerate(vals) if v.shape != vals[0].shape)
                raise ValidationError(
                    f"shape {tuple(vals[bad].shape)} differs from {tuple(vals[0].shape)} (trajectory "
                    f"{trajs[0].id!r}) and is not 1-D of the response length ({rlens[bad]}); extra tensors must "
                    "either follow the response tokens or have one shape in every trajectory",
                    trajectory_id=trajs[bad].id,
                    field=fname,
                )
        if any(t.token_versions is not None for t in trajs):
            tv = torch.full(shape, NO_VERSION, dtype=torch.int64)
            for i, t in enumerate(trajs):
                row, cols = slot(i, plens[i], plens[i] + rlens[i])
                tv[row, cols] = t.gen_version if t.token_versions is None else t.token_versions.to(torch.int64)
            out["token_versions"] = tv
        return out
