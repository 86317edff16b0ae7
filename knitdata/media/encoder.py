"""Encode each unique media item once per mini-batch, with the exact gradient of every micro-batch.

In GRPO every prompt image is shared by the n responses of its group, and a naive trainer encodes it once per
copy, forward and backward. With ``L = sum_k s_k L_k`` over the K micro-batches of a mini-batch and the encoder
output ``E`` of the unique items, the naive encoder gradient ``sum_k sum_copies J^T d(s_k L_k)/de`` equals
``J^T G`` with ``G = sum_k index_add(rows_k, d(s_k L_k)/d rows_k)``, because every copy of an item has the same
Jacobian ``J``. :class:`SharedEncoding` exploits this in one of four modes:

``fold`` (default)
    Encode the unique items once (with autograd). Micro-batches ``0..K-2`` get leaf rows
    ``E[idx].detach().requires_grad_()`` whose gradients are summed into ``G``; the last micro-batch indexes
    ``E`` directly and runs ``torch.autograd.backward([loss, E], [None, G])``: one backward reaches every
    encoder and backbone parameter, so DDP/FSDP hooks fire once. Holds the encoder's activations for the
    unique items (its autograd graph) across the mini-batch, plus ``E`` and ``G``.
``leaf``
    Like ``fold``, but every micro-batch (the last too) gets leaf rows and a separate ``E.backward(G)`` runs
    after the last micro-batch's backward. Same memory as ``fold``. Under DDP the encoder needs its own
    wrapper (``DDP(encoder)``; with one wrapper around the whole model its gradients are silently not
    all-reduced), and under FSDP2 its own ``fully_shard``.
``recompute``
    Encode under ``no_grad`` (holds only ``E`` and ``G``), then after the last micro-batch re-encode the items
    in chunks of ``chunk_items`` with autograd and backward each chunk with its slice of ``G``
    (GradCache-style): the encoder's activations of one chunk at a time, for memory-bound cases, at the cost
    of a second encoder forward (encoder FLOPs about ``3n/4`` fewer than naive instead of ``n``). Same wrapper
    requirement as ``leaf``. Like ``torch.utils.checkpoint``, the re-encode runs under the autocast state
    (CPU and device autocast, dtype, cache) and the current CUDA device captured at the first encode, so
    with the forward inside ``torch.autocast(..., dtype=torch.bfloat16)`` and the backward outside it (the
    PyTorch AMP recipe) the re-encode still computes in bfloat16, as the forward did.
``naive``
    The switch back to per-micro-batch encoding: ``rows(i)`` encodes every copy of micro-batch ``i``'s items
    (duplicates included) and ``backward`` is a plain backward. Useful for A/B checks and as a fallback.

Exactness. The dedup modes give the naive gradients (to rounding) when items are independent inside the
encoder: no train-mode BatchNorm (batch statistics mix items), no attention across items, no batch-dependent
routing (MoE capacity), and deterministic layers (dropout draws one mask per unique item instead of one per
copy; ``recompute`` would even draw different masks in forward and re-encode). Train-mode BatchNorm and
(for ``recompute``) active dropout are detected and rejected (``strict=False`` turns that into a warning);
the rest cannot be seen from the module tree: :func:`check_independence` tests an encoder empirically.

``E`` is never reused across optimizer steps: it lives inside one ``minibatch()`` context, which must cover
one optimizer step's micro-batches, and a change of any encoder parameter (an optimizer step) while it is
open raises :class:`~knitdata.errors.StateError`.

Distributed. A rank whose whole mini-batch has no media runs a zero-gradient dummy encode (``dummy_input``)
so the collectives of all ranks line up; ``dummy="auto"`` does that whenever ``torch.distributed`` runs with
more than one rank. Use :func:`grad_sync` around the backbone's micro-batches (DDP ``no_sync`` /
FSDP2 ``set_requires_gradient_sync``).

With one DDP wrapper around encoder and backbone, use ``find_unused_parameters=False`` (with ``True``, a
last micro-batch without media makes DDP mark the encoder unused before the folded backward reaches it); the
backbone must then use all its parameters in every micro-batch, as DDP always requires. Tested on CPU/gloo
with 2 ranks: DDP (one wrapper: ``fold``; two wrappers: every mode) and FSDP2 (``fold``, ``leaf``,
``recompute``), including a rank without media.

Memory: what each mode holds across micro-batches, beyond the backbone's own activations of the current
micro-batch (the peak is whichever is larger at any moment):

* ``naive``: nothing across micro-batches; during micro-batch ``i`` the encoder activations of all its
  copies (``n_i`` items, duplicates included), freed by its backward.
* ``fold`` / ``leaf``: from the encode to the last micro-batch's backward, the encoder's autograd graph of
  the ``U`` unique items (their activations), ``E`` (the rows, the encoder's output dtype) and ``G`` (fp32,
  the size of ``E``); each micro-batch additionally gathers its own rows (a copy of ``n_i`` items' rows).
  So the peak is about the naive one when a micro-batch's copies cost about as much as the unique items
  (``U`` close to ``n_i``), higher when the mini-batch has many more unique items than one micro-batch has
  copies, lower when one micro-batch holds many copies of few items.
* ``recompute``: ``E`` and ``G`` across the mini-batch, no encoder activations; at the end one chunk's
  (``chunk_items``) activations during its re-encode and backward, after the backbone's are freed. The
  lowest encoder memory, for one more encoder forward.

Reported for a Qwen2.5-VL-3B-shaped model with hand-written glue (one H200, bf16, groups of 8 sharing an image,
8 micro-batches of 2):
``fold`` peaked at about the model's own duplicated path (34 vs 35 GiB at 448 px, 49 vs 51 GiB at 896 px)
and ``recompute`` lower; ``python -m benchmarks vlm`` (``--gpu``) measures ``peak_mem_bytes`` per mode.

Example (DDP, one wrapper around encoder and backbone, ``find_unused_parameters=False``)::

    model = DDP(VisionLanguageModel())                     # model.module.encoder, model.module.backbone
    enc = SharedEncoding(model.module.encoder, dummy_input=MediaTable.empty_like("image", (588,), torch.bfloat16))
    with enc.minibatch(mm_batch) as shared:               # unique items encoded once
        for i, mb in enumerate(micro_batches):
            with grad_sync(model, enabled=i == len(micro_batches) - 1):
                loss = model(mb.input_ids, shared.rows(i), mm_batch.for_microbatch(i)) * scale[i]
                shared.backward(loss)                     # the last one folds the encoder backward in
    optimizer.step()

Example (FSDP2: ``fully_shard`` on encoder and backbone separately; insert the rows inside the backbone's
forward, since mixing plain tensors and DTensors outside it fails)::

    fully_shard(encoder); fully_shard(backbone)
    enc = SharedEncoding(encoder, dummy_input=dummy)
    with enc.minibatch(mm_batch) as shared:
        for i in range(K):
            with grad_sync(backbone, enabled=i == K - 1):   # backbone.set_requires_gradient_sync(i == K - 1)
                shared.backward(backbone(tokens[i], shared.rows(i)) * scale[i])
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch import nn

from knitdata.errors import ConfigError, StateError
from knitdata.media.multimodal import MediaTable, MultimodalBatch, segment_rows

__all__ = ["MODES", "SharedEncoding", "SharedMiniBatch", "grad_sync", "check_independence", "default_call"]

#: Encoding modes; ``fold`` is the default, ``naive`` re-encodes per micro-batch.
MODES: tuple[str, ...] = ("fold", "leaf", "recompute", "naive")

EncoderCall = Callable[[nn.Module, MediaTable], Any]


def default_call(encoder: nn.Module, table: MediaTable) -> Any:
    """Call ``encoder(table.values, table.offsets)`` (packed inputs and ``int64 [U + 1]`` offsets)."""
    return encoder(table.values, table.offsets)


@contextlib.contextmanager
def grad_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Turn gradient synchronization of a DDP or FSDP2 module on or off for a micro-batch.

    Wrap the forward *and* backward of micro-batch ``i`` in ``grad_sync(model, enabled=i == K - 1)``: DDP
    runs them under ``no_sync()`` unless enabled; an FSDP2 module (``fully_shard``) gets
    ``set_requires_gradient_sync(enabled)`` (reset to ``True`` on exit). A plain module is left alone.

    Args:
        module: A ``DistributedDataParallel`` module, a module passed to ``fully_shard``, or a plain module.
        enabled: Whether this micro-batch's backward reduces gradients.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        if enabled:
            yield
        else:
            with module.no_sync():
                yield
    elif hasattr(module, "set_requires_gradient_sync"):
        set_sync = cast("Callable[[bool], None]", module.set_requires_gradient_sync)  # FSDP2's method
        set_sync(enabled)
        try:
            yield
        finally:
            set_sync(True)
    else:
        yield


def _distributed_world() -> int:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size()


def _check_modules(encoder: nn.Module, mode: str, strict: bool) -> None:
    problems = []
    for name, m in encoder.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            problems.append(
                f"{name or type(m).__name__} is a BatchNorm in train mode: its batch statistics mix items, so "
                "encoding unique items differs from encoding every copy (put it in eval mode or use mode='naive')"
            )
        if mode == "recompute" and isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            problems.append(
                f"{name or type(m).__name__} is an active dropout: mode='recompute' would draw different masks in "
                "the forward and the re-encode (use mode='fold' or disable dropout)"
            )
    if problems:
        msg = "encoder items are not independent: " + "; ".join(problems)
        if strict:
            raise ConfigError(msg + " (strict=False accepts inexact gradients)")
        warnings.warn(msg, stacklevel=3)


def check_independence(
    encoder: nn.Module,
    table: MediaTable,
    *,
    call: EncoderCall = default_call,
    out_rows: Callable[[MediaTable], torch.Tensor] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> float:
    """Empirically check that an encoder treats items independently (the exactness condition).

    Encodes the whole table at once and every item alone (under ``no_grad``) and compares.

    Args:
        encoder: The encoder.
        table: A table of at least two items.
        call: How to call the encoder on a table.
        out_rows: Output rows per item (see :class:`SharedEncoding`), for encoders that change row counts.
        rtol: Relative tolerance.
        atol: Absolute tolerance.

    Returns:
        The largest absolute difference found.

    Raises:
        ConfigError: Outputs differ beyond the tolerance (items interact inside the encoder).
    """
    with torch.no_grad():
        whole = _Layout.of(call(encoder, table), table, out_rows)
        worst = 0.0
        for u in range(table.num_items):
            alone = _Layout.of(call(encoder, table.slice(u, u + 1)), table.slice(u, u + 1), out_rows)
            for li, (leaf, off) in enumerate(zip(whole.leaves, whole.offsets)):
                if leaf is None:
                    continue
                assert off is not None  # a tensor leaf always has offsets
                a = leaf[segment_rows(off, torch.tensor([u]))]
                b = alone.leaves[li]
                assert b is not None  # the same output structure for one item as for all
                diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
                worst = max(worst, diff)
                if not torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol):
                    raise ConfigError(
                        f"encoding item {u} alone differs from encoding it with the others (max |diff| {diff:.3g}): "
                        "items interact inside the encoder (BatchNorm, cross-item attention, routing), so "
                        "deduplicated gradients are not exact; use mode='naive'"
                    )
    return worst


@dataclass
class _Layout:
    """Flattened encoder output: tensor leaves (``None`` for non-tensors) with per-leaf row offsets."""

    leaves: list[torch.Tensor | None]
    offsets: list[torch.Tensor | None]
    spec: Any
    others: list[Any]

    @classmethod
    def of(cls, out: Any, table: MediaTable, out_rows: Callable[[MediaTable], torch.Tensor] | None) -> _Layout:
        flat, spec = pytree.tree_flatten(out)
        leaves: list[torch.Tensor | None] = []
        offs: list[torch.Tensor | None] = []
        u, total = table.num_items, int(table.offsets[-1])
        dev = table.offsets.device
        custom = None
        if out_rows is not None:
            ol = torch.as_tensor(out_rows(table), dtype=torch.long, device=dev)
            custom = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.cumsum(ol, 0)])
        for x in flat:
            if not isinstance(x, torch.Tensor):
                leaves.append(None)
                offs.append(None)
                continue
            n = x.shape[0] if x.dim() else -1
            if n == u:
                off = torch.arange(u + 1, device=dev)
            elif n == total:
                off = table.offsets
            elif custom is not None and n == int(custom[-1]):
                off = custom
            else:
                raise ConfigError(
                    f"encoder output leaf of shape {tuple(x.shape)} has neither one row per item ({u}) nor one "
                    f"per input row ({total}); pass out_lengths= (or out_rows=) giving each item's output rows"
                )
            leaves.append(x)
            offs.append(off.to(x.device))
        return cls(leaves, offs, spec, [x for x in flat if not isinstance(x, torch.Tensor)])

    def gather(self, items: torch.Tensor, how: str, trainable: bool = True) -> Any:
        """Rows of ``items``: ``how`` is ``"graph"`` (index E), ``"leaf"`` (detached leaf) or ``"plain"``."""
        flat: list[Any] = []
        it = iter(self.others)
        for leaf, off in zip(self.leaves, self.offsets):
            if leaf is None:
                flat.append(next(it))
                continue
            assert off is not None  # a tensor leaf always has offsets
            rows = leaf[segment_rows(off, items.to(off.device))]
            if how == "leaf":
                rows = rows.detach()
                if trainable and (rows.is_floating_point() or rows.is_complex()):
                    rows.requires_grad_(True)
            flat.append(rows)
        return pytree.tree_unflatten(flat, self.spec)

    def row_index(self, items: torch.Tensor) -> list[torch.Tensor | None]:
        return [None if off is None else segment_rows(off, items.to(off.device)) for off in self.offsets]


@dataclass
class _KindState:
    kind: str
    encoder: nn.Module
    table: MediaTable | None
    layout: _Layout | None = None  # E (with graph in fold/leaf, without in recompute)
    grads: list[torch.Tensor | None] = field(default_factory=list)  # G per leaf (fp32 or wider)
    dummy: bool = False
    trainable: bool = True  # some encoder parameter requires grad and grad mode was on at encode
    leaf_rows: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)  # i -> (items, rows)
    context: _EncodeContext | None = None  # autocast state and device of the first encode (recompute)


@dataclass
class _EncodeContext:
    """Autocast state and current device at encode time, restored for ``recompute``'s re-encode.

    Like ``torch.utils.checkpoint``: the re-encode runs after the last micro-batch's backward, which the
    PyTorch AMP recipe runs outside ``torch.autocast``; without this it would run in full precision.
    """

    device_type: str
    device: torch.device
    autocast: dict[str, tuple[bool, torch.dtype]]
    cache_enabled: bool

    @classmethod
    def capture(cls, device: torch.device) -> _EncodeContext:
        types = ["cpu"] if device.type == "cpu" else [device.type, "cpu"]
        state = {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types}
        return cls(device.type, device, state, torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def restore(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.device_type == "cuda" and self.device.index is not None:
                stack.enter_context(torch.cuda.device(self.device))
            for t, (enabled, dtype) in self.autocast.items():
                stack.enter_context(
                    torch.autocast(device_type=t, enabled=enabled, dtype=dtype, cache_enabled=self.cache_enabled)
                )
            yield


class SharedEncoding:
    """Wrap media encoder(s) so each unique item is encoded once per mini-batch with exact gradients.

    Args:
        encoder: The encoder (any ``nn.Module`` whose output is a tensor or a small pytree of tensors with one
            row per item or one row per input row), or a mapping ``{kind: encoder}`` for several media kinds.
        mode: ``"fold"`` (default), ``"leaf"``, ``"recompute"`` or ``"naive"`` (see the module docstring).
        kind: Media kind of a single encoder; ``None`` uses the batch's only kind (``"image"`` if it has none).
        call: ``fn(encoder, table) -> output``; default ``encoder(table.values, table.offsets)``.
        out_lengths: For encoders whose output rows per item differ from the input rows (e.g. a 2x2 patch
            merger): ``fn(input lengths int64 [U]) -> output lengths [U]``.
        out_rows: Like ``out_lengths`` but given the whole :class:`~knitdata.media.multimodal.MediaTable`, for output
            lengths that depend on per-item metadata (``table.meta``, e.g. an audio clip's valid frames):
            ``fn(table) -> output lengths int64 [U]``. Give at most one of the two.
        grad_dtype: Dtype of the gradient buffers ``G``; default float32, or the output dtype if wider.
        chunk_items: ``recompute``: items per re-encode chunk (``None``: all at once). Under FSDP the chunk
            count is agreed across ranks (an all-reduce) and padded with zero-gradient encodes.
        dummy_input: Per kind (or one) :class:`~knitdata.media.multimodal.MediaTable` encoded with a zero gradient
            on a rank whose mini-batch holds no item of that kind, e.g. ``MediaTable.empty_like(...)``.
        dummy: Whether to run that dummy encode: ``"auto"`` (when ``torch.distributed`` has > 1 rank),
            ``True`` or ``False``.
        strict: Reject (``True``) or only warn about (``False``) detected non-independence (BatchNorm in train
            mode; active dropout in ``recompute``).

    Raises:
        ValueError: Unknown mode.
    """

    def __init__(
        self,
        encoder: nn.Module | Mapping[str, nn.Module],
        mode: str = "fold",
        *,
        kind: str | None = None,
        call: EncoderCall = default_call,
        out_lengths: Callable[[torch.Tensor], torch.Tensor] | None = None,
        out_rows: Callable[[MediaTable], torch.Tensor] | None = None,
        grad_dtype: torch.dtype | None = None,
        chunk_items: int | None = None,
        dummy_input: MediaTable | Mapping[str, MediaTable] | None = None,
        dummy: bool | str = "auto",
        strict: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if chunk_items is not None and chunk_items <= 0:
            raise ValueError(f"chunk_items must be positive, got {chunk_items}")
        if dummy not in (True, False, "auto"):
            raise ValueError(f"dummy must be True, False or 'auto', got {dummy!r}")
        if out_lengths is not None and out_rows is not None:
            raise ValueError("give at most one of out_lengths= and out_rows=")
        self.encoders: dict[str | None, nn.Module] = {}
        if isinstance(encoder, Mapping):
            self.encoders.update(encoder)
        else:
            self.encoders[kind] = encoder
        self.mode = mode
        self.call = call
        self.out_lengths = out_lengths
        self.out_rows: Callable[[MediaTable], torch.Tensor] | None = out_rows
        if out_lengths is not None:
            self.out_rows = lambda table: out_lengths(table.lengths)
        self.grad_dtype = grad_dtype
        self.chunk_items = chunk_items
        self.dummy_input = dummy_input
        self.dummy = dummy
        self.strict = strict
        self._open = False

    def minibatch(self, batch: MultimodalBatch) -> SharedMiniBatch:
        """Open the encoding of one mini-batch (one optimizer step); use as a context manager.

        Args:
            batch: This consumer's :class:`~knitdata.media.multimodal.MultimodalBatch` (already on the device).

        Returns:
            A :class:`SharedMiniBatch`; entering it encodes (fold/leaf/recompute).
        """
        return SharedMiniBatch(self, batch)

    def _needs_dummy(self) -> bool:
        return self.dummy is True or (self.dummy == "auto" and _distributed_world() > 1)

    def _dummy_for(self, kind: str) -> MediaTable:
        d = self.dummy_input
        if isinstance(d, Mapping):
            d = d.get(kind)
        if d is None:
            raise ConfigError(
                f"this rank's mini-batch has no {kind} media, and without a dummy encode the collectives of the "
                f"ranks would not line up: pass dummy_input=MediaTable.empty_like({kind!r}, feature_shape, dtype)"
            )
        return d


class SharedMiniBatch:
    """The encoding of one mini-batch: hands out rows per micro-batch and runs the backward passes.

    Use ``rows(i)`` then ``backward(loss_i)`` for ``i = 0..K-1`` in order (K from the batch; a micro-batch
    without media still needs its ``backward``). Not reusable: ``E`` and ``G`` are freed on exit.
    """

    def __init__(self, owner: SharedEncoding, batch: MultimodalBatch):
        self.owner = owner
        self.batch = batch
        self.mode = owner.mode
        self.num_microbatches = batch.num_microbatches
        self._i = 0  # next micro-batch to backward
        self._state: dict[str, _KindState] = {}
        self._versions: list[tuple[torch.Tensor, int]] = []
        self._naive_out: dict[str, Any] = {}
        self._closed = True
        self._done = False

    # ------------------------------------------------------------------ context
    def __enter__(self) -> SharedMiniBatch:
        o = self.owner
        if o._open:
            raise StateError("a minibatch() of this SharedEncoding is already open; close it first")
        encoders: dict[str, nn.Module] = {k: e for k, e in o.encoders.items() if k is not None}
        if None in o.encoders:
            enc = o.encoders[None]
            kinds = self.batch.kinds
            if len(kinds) > 1:
                raise ConfigError(f"the batch holds {kinds} media: give SharedEncoding one encoder per kind (a mapping)")
            encoders[kinds[0] if kinds else "image"] = enc
        for kind in self.batch.kinds:
            if kind not in encoders:
                raise ConfigError(f"the batch holds {kind} media but SharedEncoding has no encoder for it")
        seen: set[int] = set()
        for enc in encoders.values():
            if id(enc) not in seen:
                seen.add(id(enc))
                _check_modules(enc, self.mode, o.strict)
                self._versions += [(p, p._version) for p in enc.parameters()]
        need_dummy = o._needs_dummy()
        for kind, enc in sorted(encoders.items()):
            table = self.batch.tables.get(kind)
            st = _KindState(kind, enc, table)
            if table is None and need_dummy:
                st.table, st.dummy = o._dummy_for(kind), True
            self._state[kind] = st
        o._open = True
        self._closed = False
        try:
            if self.mode != "naive":
                for st in self._state.values():
                    if st.table is not None:
                        self._encode(st)
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and 0 < self._i < self.num_microbatches:
                raise StateError(
                    f"the mini-batch closed after {self._i} of {self.num_microbatches} micro-batch backwards; call "
                    "backward() for every micro-batch (the encoder gradient is applied with the last)"
                )
        finally:
            self._close()

    def _close(self) -> None:
        self._state.clear()
        self._naive_out.clear()
        self._versions = []
        self._closed = True
        self.owner._open = False

    # ------------------------------------------------------------------ encoding
    def _encode(self, st: _KindState) -> None:
        o = self.owner
        assert st.table is not None
        st.trainable = torch.is_grad_enabled() and any(p.requires_grad for p in st.encoder.parameters())
        st.context = _EncodeContext.capture(st.table.values.device)
        if self.mode == "recompute":
            with torch.no_grad():
                out = o.call(st.encoder, st.table)
        else:
            out = o.call(st.encoder, st.table)
        st.layout = _Layout.of(out, st.table, o.out_rows)
        st.grads = []
        for leaf in st.layout.leaves:
            if leaf is None or not (leaf.is_floating_point() or leaf.is_complex()):
                st.grads.append(None)
                continue
            gd = o.grad_dtype or torch.promote_types(leaf.dtype, torch.float32)
            st.grads.append(torch.zeros(leaf.shape, dtype=gd, device=leaf.device))

    def _check_open(self, i: int | None = None) -> None:
        if self._closed:
            raise StateError("this mini-batch's encoding is closed: E is never reused; open a new minibatch()")
        if self._done:
            raise StateError(f"all {self.num_microbatches} micro-batches were already backwarded")
        for p, v in self._versions:
            if p._version != v:
                raise StateError(
                    "an encoder parameter changed while the mini-batch was open (an optimizer step?): E is stale; "
                    "open one minibatch() per optimizer step"
                )
        if i is not None and i != self._i:
            raise StateError(f"rows({i}) asked while micro-batch {self._i} is due: go through micro-batches in order")

    def _kind(self, kind: str | None) -> str:
        if kind is not None:
            return kind
        if len(self._state) != 1:
            raise ConfigError(f"several media kinds {sorted(self._state)}: pass kind=")
        return next(iter(self._state))

    def rows(self, i: int, kind: str | None = None) -> Any:
        """Encoder outputs for micro-batch ``i``'s media occurrences, in order (duplicates repeated).

        For per-row outputs the occurrences' rows are concatenated (split them with :meth:`lengths`).

        Args:
            i: The micro-batch, which must be the next one due (``0..K-1`` in order).
            kind: Media kind (needed only with several encoders).

        Returns:
            A tensor or pytree like the encoder's output, or ``None`` when micro-batch ``i`` has none of
            ``kind``. In ``naive`` mode on a distributed run, call it for every micro-batch (also those
            without media) before the backbone's forward: it runs the dummy encode there, in step with the
            encodes of the other ranks.

        Raises:
            StateError: Out of order, after close, or after an encoder parameter changed.
        """
        self._check_open(i)
        kind = self._kind(kind)
        occ = self.batch.for_microbatch(i).get(kind)
        if occ is None or len(occ) == 0:
            if self.mode == "naive":
                self._naive_dummy(kind, i)
            return None
        st = self._state[kind]
        if self.mode == "naive":
            if kind not in self._naive_out:
                sub = st.table.gather(occ.index)  # type: ignore[union-attr]
                with grad_sync(st.encoder, enabled=i == self.num_microbatches - 1):
                    lay = _Layout.of(self.owner.call(st.encoder, sub), sub, self.owner.out_rows)
                self._naive_out[kind] = lay.gather(torch.arange(sub.num_items), "plain")
            return self._naive_out[kind]
        if i in st.leaf_rows:
            return st.leaf_rows[i][1]
        assert st.layout is not None
        last = i == self.num_microbatches - 1
        how = "graph" if self.mode == "fold" and last else "leaf"
        r = st.layout.gather(occ.index, how, st.trainable)
        st.leaf_rows[i] = (occ.index, r)
        return r

    def lengths(self, i: int, kind: str | None = None) -> torch.Tensor:
        """Input rows (patches, frames) of each of micro-batch ``i``'s occurrences, ``int64 [n]``."""
        kind = self._kind(kind)
        occ = self.batch.for_microbatch(i).get(kind)
        table = self.batch.tables.get(kind)
        if occ is None or table is None:
            return torch.zeros(0, dtype=torch.long)
        return table.lengths[occ.index]

    def _accumulate(self, st: _KindState, items: torch.Tensor, rows: Any) -> None:
        """Sum the leaf rows' gradients into ``G`` (index_add: duplicates add up)."""
        assert st.layout is not None
        flat, _ = pytree.tree_flatten(rows)
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        idx = st.layout.row_index(items)
        k = 0
        for li, leaf in enumerate(st.layout.leaves):
            if leaf is None:
                continue
            x = tensors[k]
            k += 1
            g = st.grads[li]
            if g is None or x.grad is None:
                continue
            g.index_add_(0, idx[li], x.grad.to(g.dtype))  # type: ignore[arg-type]

    def backward(self, loss: torch.Tensor) -> None:
        """Backward micro-batch ``i``'s (already scaled) loss; the last one also applies the encoder gradient.

        Args:
            loss: ``s_i * L_i``, a scalar.

        Raises:
            StateError: Called more than K times, after close, or after an encoder parameter changed.
        """
        self._check_open()
        i = self._i
        last = i == self.num_microbatches - 1
        if self.mode == "naive":
            self._backward_naive(loss, i, last)
        else:
            if not last or self.mode != "fold":
                torch.autograd.backward(loss)
                for st in self._state.values():
                    if i in st.leaf_rows:
                        items, rows = st.leaf_rows.pop(i)
                        self._accumulate(st, items, rows)
            if last:
                self._final(loss if self.mode == "fold" else None)
        self._i += 1
        if last:
            self._done = True
            for st in self._state.values():
                st.layout = None
                st.grads = []
                st.leaf_rows.clear()

    def _naive_dummy(self, kind: str, i: int) -> None:
        """Naive mode, micro-batch without ``kind`` media on a distributed run: zero-gradient dummy encode."""
        st = self._state.get(kind)
        if st is None or kind in self._naive_out or not self.owner._needs_dummy():
            return
        dummy = st.table if st.dummy else self.owner._dummy_for(kind)
        with grad_sync(st.encoder, enabled=i == self.num_microbatches - 1):
            lay = _Layout.of(self.owner.call(st.encoder, dummy), dummy, self.owner.out_rows)  # type: ignore[arg-type]
        self._naive_out[kind] = [leaf for leaf in lay.leaves if leaf is not None and leaf.requires_grad]

    def _backward_naive(self, loss: torch.Tensor, i: int, last: bool) -> None:
        outs: list[torch.Tensor] = [loss]
        grads: list[torch.Tensor | None] = [None]
        for kind in self._state:
            occ = self.batch.for_microbatch(i).get(kind)
            if occ is None or len(occ) == 0:
                self._naive_dummy(kind, i)  # no-op if rows(i) already ran it
                for leaf in self._naive_out.get(kind, ()):
                    outs.append(leaf)
                    grads.append(torch.zeros_like(leaf))
        torch.autograd.backward(outs, grads)
        self._naive_out.clear()

    def _final(self, loss: torch.Tensor | None) -> None:
        """The encoder backward with ``G`` (folded into the last loss's backward in ``fold``)."""
        outs: list[torch.Tensor] = [] if loss is None else [loss]
        grads: list[torch.Tensor | None] = [] if loss is None else [None]
        if self.mode == "recompute":
            if loss is not None:
                torch.autograd.backward(outs, grads)
            self._recompute_backward()
            return
        for st in self._state.values():
            if st.layout is None:
                continue
            for leaf, g in zip(st.layout.leaves, st.grads):
                if leaf is not None and g is not None and leaf.requires_grad:
                    outs.append(leaf)
                    grads.append(g.to(leaf.dtype))
        if outs:
            torch.autograd.backward(outs, grads)

    def _recompute_backward(self) -> None:
        o = self.owner
        for st in self._state.values():
            if st.table is None or st.layout is None or not st.trainable:
                continue
            table = st.table
            u = table.num_items
            chunk = o.chunk_items or u
            n_chunks = math.ceil(u / chunk)
            if _distributed_world() > 1 and o.chunk_items is not None:
                t = torch.tensor([n_chunks], dtype=torch.long, device=table.offsets.device)
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
                n_total = int(t)
            else:
                n_total = n_chunks
            for c in range(n_total):
                pad = c >= n_chunks  # zero-gradient re-encode so every rank runs as many chunks
                a, b = (0, min(chunk, u)) if pad else (c * chunk, min(u, (c + 1) * chunk))
                sub = table.slice(a, b)
                assert st.context is not None
                with grad_sync(st.encoder, enabled=c == n_total - 1):
                    with st.context.restore():  # the autocast state and device of the first encode
                        lay = _Layout.of(o.call(st.encoder, sub), sub, o.out_rows)
                    outs: list[torch.Tensor] = []
                    grads: list[torch.Tensor] = []
                    for li, leaf in enumerate(lay.leaves):
                        g = st.grads[li]
                        full_off = st.layout.offsets[li]
                        if leaf is None or g is None or not leaf.requires_grad or full_off is None:
                            continue
                        gs = g[int(full_off[a]) : int(full_off[b])]
                        outs.append(leaf)
                        grads.append(torch.zeros_like(leaf) if (pad or st.dummy) else gs.to(leaf.dtype))
                    if outs:
                        torch.autograd.backward(outs, grads)
