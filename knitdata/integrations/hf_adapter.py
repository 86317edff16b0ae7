"""The model-independent part of the ``transformers`` integration: :class:`HFMultimodalAdapter` (shared
encoding, media collate, the native duplicated path) and :func:`scale_mean_loss`.

See :mod:`knitdata.integrations.transformers` for the recipe; the supported families' adapters are in
:mod:`knitdata.integrations.qwen`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from knitdata.consumer.collate import MicroBatch, MicroBatchInfo
from knitdata.errors import ConfigError, MediaError, OptionalDependencyError, ValidationError
from knitdata.media.encoder import SharedEncoding
from knitdata.media.multimodal import MediaTable, MultimodalBatch, MultimodalCollator
from knitdata.record import MediaItem, Trajectory

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise OptionalDependencyError("transformers", "transformers", "knitdata.integrations.transformers") from e

__all__ = ["GRAD_RTOL", "HFMultimodalAdapter", "scale_mean_loss", "device_of", "unwrap_model"]

#: Relative gradient agreement with the native duplicated path in float64 (RMSNorm computes in float32).
GRAD_RTOL: float = 1e-5


def device_of(module: nn.Module) -> torch.device:
    """The device of the module's first parameter (the CPU for a module without parameters)."""
    p = next(module.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def unwrap_model(model: nn.Module) -> Any:
    """The model inside DDP/FSDP/accelerate wrappers (``.module``), for its submodules and config.

    Typed ``Any``: a ``transformers`` model whose ``config`` and submodules are specific to its family.
    """
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


class HFMultimodalAdapter:
    """Connect one ``transformers`` multimodal model to knitdata's shared encoding and collate.

    Args:
        model: The model (``...ForConditionalGeneration``), possibly wrapped in DDP/accelerate: its forward is
            called through the wrapper, its submodules are taken from the unwrapped model.
        processor: The model's media processor (image processor or feature extractor).

    Attributes:
        family: ``model.config.model_type``.
        kind: The media kind this family consumes (``"image"`` or ``"audio"``).
        placeholder_id: The token id each media item occupies in ``input_ids`` (expanded to its rows).
    """

    family: str = ""
    kind: str = ""

    def __init__(self, model: nn.Module, processor: Any):
        self.model = model
        self.inner = unwrap_model(model)
        self.processor = processor
        self.placeholder_id = int(self._placeholder_id())
        #: Per media kind, the placeholder token its items occupy (one kind for single-tower families).
        self.placeholders: dict[str, int] = {self.kind: self.placeholder_id}
        pad = getattr(self._text_config(), "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    # ------------------------------------------------------------------ family hooks
    def _placeholder_id(self) -> int:
        raise NotImplementedError

    def _text_config(self) -> Any:
        return getattr(self.inner.config, "text_config", self.inner.config)

    @property
    def encoder(self) -> nn.Module:
        """The model's own media tower (the module whose parameters SharedEncoding encodes with)."""
        raise NotImplementedError

    def preprocess(self, *args: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Process one item with the model's processor: ``(packed rows, per-item metadata)``."""
        raise NotImplementedError

    def encoder_call(self, encoder: nn.Module, table: MediaTable) -> torch.Tensor:
        """Encode a table of unique items: the rows the language model consumes, items concatenated."""
        raise NotImplementedError

    def out_rows(self, table: MediaTable) -> torch.Tensor:
        """Rows (placeholder tokens) of each item of ``table``, ``int64 [U]``."""
        raise NotImplementedError

    def dummy_input(self) -> MediaTable:
        """A one-item all-zero table (on the tower's device) for the zero-gradient dummy encode of a rank
        without media."""
        raise NotImplementedError

    def _native_media(self, table: MediaTable, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        raise NotImplementedError

    def _forward_with_rows(self, inputs: dict[str, torch.Tensor], rows: torch.Tensor | None, **kwargs: Any) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ knitdata glue
    def placeholder_rows(self, item: MediaItem) -> int:
        """How many placeholder tokens the collate expands ``item`` to: its rows under this model's processor.

        Pass it to :func:`knitdata.rollout.attach_media` (``expected_rows=adapter.placeholder_rows``) to refuse an
        engine prompt whose processor expanded the item to another number of tokens.

        Raises:
            MediaError: The item cannot be decoded or processed.
        """
        pm = self.media_collator().processor.process(item)
        meta = {k: torch.as_tensor(v)[None] for k, v in (pm.meta or {}).items()}
        rates = None if pm.sample_rate is None else torch.tensor([pm.sample_rate], dtype=torch.long)
        table = MediaTable(pm.kind, pm.tensor, torch.tensor([0, pm.tensor.shape[0]], dtype=torch.long), (item.digest,),
                           rates, meta)
        return int(self.out_rows(table)[0])

    def media_collator(self, key: str = "provenance") -> MultimodalCollator:
        """A :class:`~knitdata.media.multimodal.MultimodalCollator` processing with the model's processor.

        Args:
            key: ``"provenance"`` (GRPO groups share their media) or ``"digest"``.
        """
        return MultimodalCollator({self.kind: self.preprocess}, key=key)

    def shared_encoding(self, mode: str = "fold", **kwargs: Any) -> SharedEncoding:
        """A :class:`~knitdata.media.encoder.SharedEncoding` of the model's tower.

        Args:
            mode: ``"fold"``, ``"leaf"``, ``"recompute"`` or ``"naive"``.
            **kwargs: More :class:`~knitdata.media.encoder.SharedEncoding` arguments (``chunk_items``, ``dummy``...).
        """
        kwargs.setdefault("dummy_input", self.dummy_input())
        return SharedEncoding(
            self.encoder, mode=mode, kind=self.kind, call=self.encoder_call, out_rows=self.out_rows, **kwargs
        )

    def collate(
        self,
        micro_batch: MicroBatch | Sequence[Trajectory],
        batch: MultimodalBatch | None = None,
        i: int | None = None,
        *,
        pad_to_multiple_of: int = 1,
    ) -> dict[str, torch.Tensor]:
        """Text inputs of micro-batch ``i``: placeholders expanded per item, right-padded.

        Takes what the dataset yields: a :class:`~knitdata.consumer.collate.MicroBatch` of a dataset built with
        ``media_collator=adapter.media_collator()`` (``batch`` is then its ``media``, ``i`` its
        ``info.microbatch``; padded or packed token layout, any ``pad_id``). Or the micro-batch's
        trajectories, with ``batch`` and ``i``. Every prompt must hold one ``placeholder_id`` per media item of
        this kind, in media order; each becomes as many placeholders as the item has encoder rows.

        An empty micro-batch (a padding step of a rank, ``mb.is_empty``) gives a one-row dummy of two padding
        tokens (one label), so the rank still runs a forward and backward; :func:`scale_mean_loss` scales its
        loss to zero.

        Args:
            micro_batch: The dataset's micro-batch, or micro-batch ``i``'s trajectories in the order given to
                the media collator.
            batch: The mini-batch's :class:`~knitdata.media.multimodal.MultimodalBatch` (default: ``micro_batch.media``).
            i: The micro-batch (default: ``micro_batch.info.microbatch``).
            pad_to_multiple_of: Pad the sequence length up to a multiple of this.

        Returns:
            ``input_ids``, ``attention_mask``, ``labels`` (``int64 [B, T]``; ``-100`` outside the response
            and where ``loss_mask`` is 0), plus family inputs (Qwen2.5-VL: ``mm_token_type_ids``,
            ``image_grid_thw`` of the micro-batch's occurrences).

        Raises:
            MediaError: A prompt's placeholder count differs from its media items of this kind.
            ConfigError: A micro-batch without media (``media_collator`` not given to the dataset), without
                prompt and response lengths (a custom ``collate``), or trajectories without ``batch`` and ``i``.
        """
        sequences: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]]
        if isinstance(micro_batch, MicroBatch):
            sequences = list(_sequences(micro_batch))
            if batch is None:
                batch = micro_batch.media
            if i is None and micro_batch.info is not None:
                i = micro_batch.info.microbatch
            if sequences and not isinstance(batch, MultimodalBatch):
                raise ConfigError(
                    "the micro-batch carries no MultimodalBatch in .media: build the dataset with "
                    "media_collator=adapter.media_collator()"
                )
        else:
            sequences = [
                (t.id, t.prompt_ids.to(torch.long).cpu(), t.response_ids.to(torch.long).cpu(),
                 None if t.loss_mask is None else t.loss_mask.cpu())
                for t in micro_batch
            ]
        if not sequences:
            return self._dummy_inputs()
        if batch is None or i is None:
            raise ConfigError("collate(trajectories, batch, i): give the mini-batch's MultimodalBatch and the micro-batch")
        occs = batch.for_microbatch(i)
        counts: dict[str, dict[int, list[int]]] = {}
        for kind in self.placeholders:
            occ, table = occs.get(kind), batch.tables.get(kind)
            if occ is not None and len(occ) and table is not None:
                rows = self.out_rows(table).cpu()[occ.index.cpu()]
                for j, r in zip(occ.trajectory.tolist(), rows.tolist()):
                    counts.setdefault(kind, {}).setdefault(j, []).append(int(r))
        seqs, labs = [], []
        for j, (tid, prompt, resp, loss_mask) in enumerate(sequences):
            marks: list[tuple[int, int, int]] = []  # (position, rows, placeholder) over every kind
            for kind, pid in self.placeholders.items():
                where = (prompt == pid).nonzero().flatten().tolist()
                want = counts.get(kind, {}).get(j, [])
                if len(where) != len(want):
                    raise MediaError(
                        f"the prompt holds {len(where)} placeholder token(s) {pid} but the trajectory carries "
                        f"{len(want)} {kind} item(s): put one placeholder per item (it is expanded to the item's "
                        "encoder rows here)",
                        trajectory_id=tid,
                    )
                marks += [(pos, n, pid) for pos, n in zip(where, want)]
            parts, start = [], 0
            for pos, n, pid in sorted(marks):
                parts += [prompt[start:pos], torch.full((n,), pid, dtype=torch.long)]
                start = pos + 1
            parts.append(prompt[start:])
            p = torch.cat(parts)
            lab = resp.clone()
            if loss_mask is not None:
                lab[loss_mask == 0] = -100
            seqs.append(torch.cat([p, resp]))
            labs.append(torch.cat([torch.full_like(p, -100), lab]))
        input_ids, mask, labels = _right_pad(seqs, labs, self.pad_id, pad_to_multiple_of)
        out = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
        out.update(self._extra_inputs_all(input_ids, mask, batch.tables, occs))
        return out

    def _dummy_inputs(self) -> dict[str, torch.Tensor]:
        """Two padding tokens, the second one labelled (a finite loss, scaled to zero by scale_mean_loss)."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long)
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([[-100, self.pad_id]])}
        out.update(self._extra_inputs_all(ids, out["attention_mask"], {}, {}))
        return out

    def _extra_inputs_all(self, input_ids, mask, tables, occs) -> dict[str, torch.Tensor]:
        """Family inputs of a micro-batch given every kind's table and occurrences (one kind by default)."""
        return self._extra_inputs(input_ids, mask, tables.get(self.kind), occs.get(self.kind))

    def _extra_inputs(self, input_ids, mask, table, occ) -> dict[str, torch.Tensor]:
        return {}

    def rows(self, shared: Any, i: int) -> Any:
        """Micro-batch ``i``'s rows for :meth:`forward` from an open ``SharedMiniBatch`` (``shared.rows(i)``;
        a several-tower family gathers every kind's)."""
        return shared.rows(i)

    def forward(self, inputs: dict[str, torch.Tensor], rows: torch.Tensor | None, **kwargs: Any) -> Any:
        """The model's own forward with the shared rows at the placeholders.

        Args:
            inputs: :meth:`collate`'s output (on the model's device).
            rows: ``SharedMiniBatch.rows(i)``: the micro-batch's occurrences' rows, or ``None`` without media.
            **kwargs: More model forward arguments (``logits_to_keep``...).

        Returns:
            The model's output (``.loss`` with ``labels``, ``.logits``).

        Raises:
            ConfigError: The rows do not fill the placeholders exactly.
        """
        n = int((inputs["input_ids"] == self.placeholder_id).sum())
        got = 0 if rows is None else int(rows.shape[0])
        if n != got:
            raise ConfigError(
                f"micro-batch has {n} {self.kind} placeholder tokens but {got} encoder rows: collate the text "
                "with this adapter's collate() and the same MultimodalBatch"
            )
        return self._forward_with_rows(inputs, rows if got else None, **kwargs)

    def forward_native(self, inputs: dict[str, torch.Tensor], batch: MultimodalBatch, i: int, **kwargs: Any) -> Any:
        """The model's own forward with every occurrence's copy of its media (the duplicated path).

        Args:
            inputs: :meth:`collate`'s output for micro-batch ``i``.
            batch: The mini-batch's :class:`~knitdata.media.multimodal.MultimodalBatch` (on the model's device).
            i: The micro-batch.
            **kwargs: More model forward arguments.
        """
        occ = batch.for_microbatch(i).get(self.kind)
        table = batch.tables.get(self.kind)
        media: dict[str, Any] = {}
        if occ is not None and len(occ) and table is not None:
            media = self._native_media(table.gather(occ.index), inputs)
        fwd = {k: v for k, v in inputs.items() if k != "image_grid_thw" or media}
        return self.model(**fwd, **media, **kwargs)


def _sequences(mb: MicroBatch) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(id, prompt, response, response loss mask)`` of every sequence of a collated micro-batch, in row order."""
    n = mb.num_sequences
    if n == 0:
        return []
    if mb.prompt_lengths is None or mb.response_lengths is None:
        raise ConfigError(
            "the micro-batch carries no prompt_lengths/response_lengths: collate it with knitdata's TokenCollator "
            "(the dataset's default collate)"
        )
    ids = mb.info.trajectory_ids if mb.info is not None and len(mb.info.trajectory_ids) == n else None
    plens = mb.prompt_lengths.tolist()
    rlens = mb.response_lengths.tolist()
    tokens = mb.input_ids.cpu()
    weights = mb.loss_mask.cpu()
    out = []
    for j in range(n):
        p, r = int(plens[j]), int(rlens[j])
        if mb.cu_seqlens is not None:  # packed: one row, sequence j at cu_seqlens[j]
            start = int(mb.cu_seqlens[j])
            seq, w = tokens[0, start : start + p + r], weights[0, start : start + p + r]
        else:
            seq, w = tokens[j, : p + r], weights[j, : p + r]
        out.append((ids[j] if ids is not None else f"row {j}", seq[:p].to(torch.long), seq[p:].to(torch.long), w[p:]))
    return out


def scale_mean_loss(
    loss: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    micro_batch: MicroBatch | MicroBatchInfo,
    *,
    world_size: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The model's mean loss of one micro-batch, scaled to its share of the mini-batch's token mean.

    A ``transformers`` model returns ``out.loss`` averaged over the micro-batch's label tokens (those of
    ``labels[:, 1:]`` other than ``ignore_index``, after the causal shift). This multiplies it by
    ``n * world_size / info.global_loss_tokens``, ``n`` being that count: summed over the micro-batches of an
    optimizer step and averaged over the ranks (DDP, :class:`~knitdata.replicas.ThreadGradientSync`), the
    gradient is the one of the mean over every loss token of the mini-batch, whatever the split into ranks and
    micro-batches. A micro-batch that counts no token (an empty padding step: :meth:`HFMultimodalAdapter.collate`
    gives it a dummy input; or every response token masked, where the model's mean is NaN) gives a zero loss
    with zero gradients, still connected to the graph so that DDP's hooks fire.

    The model's labels do not count a sequence's first token (nothing predicts it), while
    ``global_loss_tokens`` counts every loss-mask token: keep prompts non-empty. A fractional ``loss_mask``
    counts as 0 or 1 in the model's loss.

    Args:
        loss: ``out.loss`` of the model's forward on ``inputs``.
        inputs: The forward's inputs (:meth:`HFMultimodalAdapter.collate`): its ``labels`` and
            ``attention_mask`` give ``n``.
        micro_batch: The dataset's micro-batch, or its :class:`~knitdata.consumer.collate.MicroBatchInfo`.
        world_size: Data-parallel ranks whose gradients are averaged (``torch.distributed``'s world size, or the
            number of consumer threads).
        ignore_index: The label of tokens outside the loss.

    Returns:
        A scalar tensor: backward it (or pass it to ``SharedMiniBatch.backward``).

    Raises:
        ValidationError: No micro-batch info, or a micro-batch with tokens in a mini-batch without loss tokens.
        ConfigError: ``world_size`` is not a positive int.
    """
    info = micro_batch.info if isinstance(micro_batch, MicroBatch) else micro_batch
    if not isinstance(info, MicroBatchInfo):
        raise ValidationError(
            "the micro-batch carries no MicroBatchInfo: pass a micro-batch of a knitdata dataset (or its .info)",
            field="info",
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    labels = inputs["labels"]
    counted = labels[..., 1:] != ignore_index
    mask = inputs.get("attention_mask")
    if mask is not None:
        counted = counted & (mask[..., 1:] != 0)
    n = 0 if info.is_empty else int(counted.sum())
    if n == 0:
        return loss.nan_to_num(0.0) * 0.0
    if info.global_loss_tokens <= 0:
        raise ValidationError(
            f"micro-batch {info.microbatch} of mini-batch {info.minibatch} has {n} label tokens but the mini-batch "
            "counts no loss tokens (global_loss_tokens=0)",
            field="global_loss_tokens",
        )
    return loss * (n * world_size / info.global_loss_tokens)


def _right_pad(seqs: Sequence[torch.Tensor], labs: Sequence[torch.Tensor], pad_id: int,
               multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad token rows and their labels to one width (a multiple of ``multiple``): ids, mask, labels."""
    width = max(s.numel() for s in seqs)
    width = -(-width // multiple) * multiple
    b = len(seqs)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    labels = torch.full((b, width), -100, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for j, (s, lab) in enumerate(zip(seqs, labs)):
        input_ids[j, : s.numel()] = s
        labels[j, : s.numel()] = lab
        mask[j, : s.numel()] = 1
    return input_ids, mask, labels
