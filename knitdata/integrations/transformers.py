"""Shared encoding and the multimodal collate on Hugging Face ``transformers`` vision-language and audio models.

An adapter ties one ``transformers`` model to knitdata's multimodal path without patching it:

1. **Processing**: :meth:`HFMultimodalAdapter.media_collator` processes each unique image or audio clip once
   with the model's own processor (``Qwen2VLImageProcessor``, ``WhisperFeatureExtractor``) and carries the
   per-item metadata the encoder needs in the media table (``table.meta``): Qwen2-VL's ``image_grid_thw``,
   an audio clip's valid feature length.
2. **Encoding**: :meth:`HFMultimodalAdapter.shared_encoding` wraps the model's own tower in
   :class:`~knitdata.encoder.SharedEncoding` (``fold``/``leaf``/``recompute``/``naive``), with the right call
   and output rows (Qwen2.5-VL: ``patches / merge_size**2`` rows after the 2x2 patch merger; Qwen2-Audio:
   ``((L - 1) // 2 + 1 - 2) // 2 + 1`` rows for ``L`` valid mel frames, after the projector).
3. **Text**: :meth:`HFMultimodalAdapter.collate` builds each micro-batch's ``input_ids`` (right-padded),
   ``attention_mask`` and ``labels`` from the trajectories: every prompt carries *one* placeholder token
   (the model's ``image_token_id``/``audio_token_id``) per media item, expanded here to the item's number of
   encoder rows, as the model's processor does; the labels are the response tokens (``-100`` elsewhere and
   where ``loss_mask`` is 0).
4. **Forward**: :meth:`HFMultimodalAdapter.forward` runs the model's own forward with the shared rows at
   the placeholders: its position ids (Qwen2.5-VL's M-RoPE from ``get_rope_index``), its attention, its
   loss. Qwen2.5-VL takes them through the forward's ``mm_encoder_outputs`` argument (the model's own hook
   for precomputed encoder outputs: it scatters them at the image placeholders and computes the 3-D
   position ids from ``input_ids``, ``image_grid_thw`` and ``mm_token_type_ids`` itself, so nothing about
   M-RoPE is re-implemented here). Qwen2-Audio has no such hook; its positions are plain 1-D, so the rows
   are scattered into the text embeddings (``masked_scatter`` at the audio placeholders, what the model
   does internally) and passed as ``inputs_embeds``. No module's ``forward`` is swapped: that would break
   under ``torch.compile`` and DDP/FSDP wrappers and would hide from the model which path it runs.
   :meth:`HFMultimodalAdapter.forward_native` runs the model's own path with every trajectory's copy of its
   media (the reference the tests compare gradients against, and the baseline of ``knitdata bench vlm``).

Supported families: ``qwen2_5_vl`` (Qwen2.5-VL, images) and ``qwen2_audio`` (Qwen2-Audio, audio clips),
through :func:`adapter_for` (dispatch on ``model.config.model_type``), :func:`qwen2_5_vl` or
:func:`qwen2_audio`. Both towers treat items independently (per-item ``cu_seqlens`` windows and full
attention in the Qwen2.5-VL vision tower; per-clip attention masks in the Qwen2-Audio encoder), the
exactness condition of :class:`~knitdata.encoder.SharedEncoding`. Tested in float64 on tiny random-init
configs against the duplicated native path: Qwen2.5-VL's RMSNorm computes in float32 even in a float64
model, so the gradients agree to about 1e-6 relative (``GRAD_RTOL``), not to float64 rounding.

**Loss.** The model's ``out.loss`` is the *mean* over the micro-batch's label tokens, but an optimizer step
wants the mean over the whole mini-batch (every micro-batch of every rank). :func:`scale_mean_loss` turns the
one into this micro-batch's share of the other (``loss * n * world / info.global_loss_tokens``, with ``n`` the
tokens the model's mean counted); summed over the micro-batches and averaged by DDP over the ranks, that is the
token mean of the mini-batch. For a loss you sum yourself, scale by ``world / info.global_loss_tokens`` instead.

Example: one process, a tiny random-init Qwen2.5-VL built from a config (nothing downloaded; for a real model,
``Qwen2_5_VLForConditionalGeneration.from_pretrained(path)`` and
``adapter_for(model, processor=AutoImageProcessor.from_pretrained(path))``), GRPO groups whose responses share
their prompt's image, two micro-batches per optimizer step:

```python
import numpy as np
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from knitdata import BatchSpec, Pipeline, Trajectory, image_item
from knitdata.integrations.transformers import adapter_for, scale_mean_loss

IMAGE, VSTART, VEND = 120, 122, 123                # the config's image, vision-start and vision-end tokens
config = Qwen2_5_VLConfig(
    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                       patch_size=4, temporal_patch_size=2, spatial_merge_size=2, window_size=16, in_channels=3),
    text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
    image_token_id=IMAGE, video_token_id=121, vision_start_token_id=VSTART, vision_end_token_id=VEND)
model = Qwen2_5_VLForConditionalGeneration(config)  # random weights
adapter = adapter_for(model)                        # its image processor built from the config

# rollout: 2 groups of 4 responses, each group's prompt with one image placeholder per image
spec = BatchSpec({"vqa": 8}, num_minibatches=2, group_size=4)
pipe = Pipeline(spec, num_consumers=1, token_budget=24)   # 2 trajectories (11 tokens each) per micro-batch
rng = np.random.default_rng(0)
for g in range(2):
    image = image_item(rng.integers(0, 256, (3, 32, 32), dtype=np.uint8))
    for r in range(4):
        pipe.put(Trajectory(id=f"g{g}-r{r}", source="vqa", group=f"g{g}", media=[image],
                            prompt_ids=torch.tensor([1, VSTART, IMAGE, VEND, 7, 8]),
                            response_ids=torch.randint(3, 100, (5,))))
pipe.close()

# training: unique images processed once per mini-batch (media collator) and encoded once (shared encoding)
world = 1                                           # data-parallel ranks (torch.distributed's world size)
shared = adapter.shared_encoding()                  # mode="fold"
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for mb in pipe.dataset(0, media_collator=adapter.media_collator()):
    i = mb.info.microbatch
    if i == 0:                                      # first micro-batch of the step: encode the unique images
        sm = shared.minibatch(mb.media).__enter__()
    inputs = adapter.collate(mb)                    # placeholders expanded, labels on the responses
    out = adapter.forward(inputs, sm.rows(i))       # the model's own forward, M-RoPE and loss
    sm.backward(scale_mean_loss(out.loss, inputs, mb, world_size=world))
    if mb.info.is_last:                             # the last backward also ran the encoder's
        sm.__exit__(None, None, None)
        opt.step(); opt.zero_grad()
```

Under DDP (one process per rank, ranks attached to a Ray-engine pipeline), wrap the model in
``DistributedDataParallel`` before building the adapter, run each micro-batch's forward and backward inside
``grad_sync(model, enabled=mb.info.is_last)`` (:func:`knitdata.encoder.grad_sync`), and pass the world size.
An empty micro-batch (``mb.is_empty``, a padding step) still gets a one-row dummy input from
:meth:`HFMultimodalAdapter.collate`, whose loss :func:`scale_mean_loss` scales to zero, so that the ranks'
all-reduces line up.

Recipe for LLaVA-style models (a CLIP/SigLIP tower plus a projector, ``LlavaForConditionalGeneration``): every
image gives a fixed number ``R`` of rows (patches, minus the CLS token with the ``"default"`` feature select
strategy), and the model's forward takes precomputed rows through the same ``mm_encoder_outputs`` hook
(``model``, its ``image_processor``, and ``micro_batches``, lists of trajectories whose prompts hold one
``image_token_id`` per image, are yours):

```python
from torch.nn.utils.rnn import pad_sequence
from transformers.modeling_outputs import BaseModelOutputWithPooling

vc = model.config.vision_config
C, H, W = 3, vc.image_size, vc.image_size          # the image processor's output size
R = (vc.image_size // vc.patch_size) ** 2          # rows per image
def preprocess(pixels):                            # one row per image: [1, C*H*W]
    return image_processor(images=[pixels], return_tensors="pt")["pixel_values"].reshape(1, -1)
def call(encoder, table):                          # encoder: the tower and projector
    pix = table.values.reshape(-1, C, H, W).to(model.dtype)
    return torch.cat(list(model.model.get_image_features(pixel_values=pix).pooler_output), 0)
encoder = nn.ModuleDict({"tower": model.model.vision_tower, "proj": model.model.multi_modal_projector})
shared = SharedEncoding(encoder, call=call, out_lengths=lambda n: n * R)
collate = MultimodalCollator({"image": preprocess}, key="provenance")
with shared.minibatch(collate(micro_batches)) as sm:
    for i, trajs in enumerate(micro_batches):
        # each image token expanded to R tokens (what LlavaProcessor does), then the response
        image = [t.prompt_ids == model.config.image_token_id for t in trajs]
        seqs = [torch.cat([t.prompt_ids.repeat_interleave(1 + (R - 1) * m), t.response_ids])
                for t, m in zip(trajs, image)]
        ids = pad_sequence(seqs, batch_first=True)
        mask = pad_sequence([torch.ones_like(x) for x in seqs], batch_first=True)
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                    mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=(sm.rows(i),))})
        sm.backward(out.loss)
```

Importing this module without ``transformers`` raises :class:`~knitdata.errors.OptionalDependencyError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from knitdata.collate import MicroBatch, MicroBatchInfo
from knitdata.encoder import SharedEncoding
from knitdata.errors import ConfigError, MediaError, OptionalDependencyError, ValidationError
from knitdata.multimodal import MediaTable, MultimodalBatch, MultimodalCollator
from knitdata.record import Trajectory

try:
    import transformers  # noqa: F401
    from transformers.modeling_outputs import BaseModelOutputWithPooling
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise OptionalDependencyError("transformers", "transformers", "knitdata.integrations.transformers") from e

__all__ = [
    "FAMILIES",
    "GRAD_RTOL",
    "HFMultimodalAdapter",
    "Qwen2_5_VLAdapter",
    "Qwen2AudioAdapter",
    "adapter_for",
    "qwen2_5_vl",
    "qwen2_audio",
    "scale_mean_loss",
]

#: Supported ``model.config.model_type`` values.
FAMILIES: tuple[str, ...] = ("qwen2_5_vl", "qwen2_audio")

#: Relative gradient agreement with the native duplicated path in float64 (RMSNorm computes in float32).
GRAD_RTOL: float = 1e-5


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def _unwrap(model: nn.Module) -> Any:
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
        self.inner = _unwrap(model)
        self.processor = processor
        self.placeholder_id = int(self._placeholder_id())
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
    def media_collator(self, key: str = "provenance") -> MultimodalCollator:
        """A :class:`~knitdata.multimodal.MultimodalCollator` processing with the model's processor.

        Args:
            key: ``"provenance"`` (GRPO groups share their media) or ``"digest"``.
        """
        return MultimodalCollator({self.kind: self.preprocess}, key=key)

    def shared_encoding(self, mode: str = "fold", **kwargs: Any) -> SharedEncoding:
        """A :class:`~knitdata.encoder.SharedEncoding` of the model's tower.

        Args:
            mode: ``"fold"``, ``"leaf"``, ``"recompute"`` or ``"naive"``.
            **kwargs: More :class:`~knitdata.encoder.SharedEncoding` arguments (``chunk_items``, ``dummy``...).
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

        Takes what the dataset yields: a :class:`~knitdata.collate.MicroBatch` of a dataset built with
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
            batch: The mini-batch's :class:`~knitdata.multimodal.MultimodalBatch` (default: ``micro_batch.media``).
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
        occ = batch.for_microbatch(i).get(self.kind)
        table = batch.tables.get(self.kind)
        counts: dict[int, list[int]] = {}
        if occ is not None and len(occ) and table is not None:
            rows = self.out_rows(table).cpu()[occ.index.cpu()]
            for j, r in zip(occ.trajectory.tolist(), rows.tolist()):
                counts.setdefault(j, []).append(int(r))
        seqs, labs = [], []
        for j, (tid, prompt, resp, loss_mask) in enumerate(sequences):
            where = (prompt == self.placeholder_id).nonzero().flatten().tolist()
            want = counts.get(j, [])
            if len(where) != len(want):
                raise MediaError(
                    f"the prompt holds {len(where)} placeholder token(s) {self.placeholder_id} but the trajectory "
                    f"carries {len(want)} {self.kind} item(s): put one placeholder per item (it is expanded to the "
                    "item's encoder rows here)",
                    trajectory_id=tid,
                )
            parts, start = [], 0
            for pos, n in zip(where, want):
                parts += [prompt[start:pos], torch.full((n,), self.placeholder_id, dtype=torch.long)]
                start = pos + 1
            parts.append(prompt[start:])
            p = torch.cat(parts)
            lab = resp.clone()
            if loss_mask is not None:
                lab[loss_mask == 0] = -100
            seqs.append(torch.cat([p, resp]))
            labs.append(torch.cat([torch.full_like(p, -100), lab]))
        width = max(s.numel() for s in seqs)
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        b = len(seqs)
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        labels = torch.full((b, width), -100, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for j, (s, lab) in enumerate(zip(seqs, labs)):
            input_ids[j, : s.numel()] = s
            labels[j, : s.numel()] = lab
            mask[j, : s.numel()] = 1
        out = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
        out.update(self._extra_inputs(input_ids, mask, table, occ))
        return out

    def _dummy_inputs(self) -> dict[str, torch.Tensor]:
        """Two padding tokens, the second one labelled (a finite loss, scaled to zero by scale_mean_loss)."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long)
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([[-100, self.pad_id]])}
        out.update(self._extra_inputs(ids, out["attention_mask"], None, None))
        return out

    def _extra_inputs(self, input_ids, mask, table, occ) -> dict[str, torch.Tensor]:
        return {}

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
            batch: The mini-batch's :class:`~knitdata.multimodal.MultimodalBatch` (on the model's device).
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


class Qwen2_5_VLAdapter(HFMultimodalAdapter):
    """Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): images through ``model.visual`` and its merger.

    Args:
        model: The model.
        image_processor: A ``Qwen2VLImageProcessor`` (or its PIL variant) whose ``patch_size``,
            ``temporal_patch_size`` and ``merge_size`` match the vision config; default: one built from the
            vision config (no download).
    """

    family = "qwen2_5_vl"
    kind = "image"

    def __init__(self, model: nn.Module, image_processor: Any | None = None):
        inner = _unwrap(model)
        vc = inner.config.vision_config
        if image_processor is None:
            image_processor = _default_image_processor(vc)
        for attr, want in (
            ("patch_size", vc.patch_size),
            ("temporal_patch_size", vc.temporal_patch_size),
            ("merge_size", vc.spatial_merge_size),
        ):
            have = getattr(image_processor, attr, want)
            if have != want:
                raise ConfigError(f"image processor {attr}={have} but the vision config has {want}")
        import inspect

        if "mm_encoder_outputs" not in inspect.signature(type(inner).forward).parameters:
            raise ConfigError(
                f"{type(inner).__name__}.forward takes no mm_encoder_outputs (transformers "
                f"{transformers.__version__}): install knitdata[transformers] (transformers>=5.24)"
            )
        super().__init__(model, image_processor)
        self.merge = int(vc.spatial_merge_size) ** 2
        self.row_dim = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2

    def _placeholder_id(self) -> int:
        return self.inner.config.image_token_id

    @property
    def encoder(self) -> nn.Module:
        return self.inner.model.visual

    def preprocess(self, pixels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``uint8 [C, H, W]`` pixels -> ``(pixel_values [patches, C*T*p*p], {"image_grid_thw": [3]})``."""
        out = self.processor(images=[pixels], return_tensors="pt")
        return out["pixel_values"], {"image_grid_thw": out["image_grid_thw"][0].to(torch.long)}

    def encoder_call(self, encoder: nn.Module, table: MediaTable) -> torch.Tensor:
        pix = table.values.to(cast(torch.dtype, encoder.dtype))  # a transformers module's `dtype` property
        return encoder(pix, grid_thw=table.meta["image_grid_thw"]).pooler_output

    def out_rows(self, table: MediaTable) -> torch.Tensor:
        return table.meta["image_grid_thw"].prod(-1) // self.merge

    def dummy_input(self) -> MediaTable:
        s = int(self.inner.config.vision_config.spatial_merge_size)
        grid = torch.tensor([[1, s, s]], dtype=torch.long)
        dtype = cast(torch.dtype, self.encoder.dtype)  # a transformers module's `dtype` property
        table = MediaTable.empty_like("image", (self.row_dim,), dtype, s * s, {"image_grid_thw": grid})
        return table.to(_device_of(self.encoder))

    def _extra_inputs(self, input_ids, mask, table, occ) -> dict[str, torch.Tensor]:
        extra = {"mm_token_type_ids": (input_ids == self.placeholder_id).to(torch.int32)}
        if occ is not None and len(occ) and table is not None:
            extra["image_grid_thw"] = table.meta["image_grid_thw"].cpu()[occ.index.cpu()]
        return extra

    def _native_media(self, table: MediaTable, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"pixel_values": table.values}

    def _forward_with_rows(self, inputs: dict[str, torch.Tensor], rows: torch.Tensor | None, **kwargs: Any) -> Any:
        fwd: dict[str, Any] = dict(inputs)
        if rows is None:
            fwd.pop("image_grid_thw", None)
        else:
            # the model's own hook for precomputed encoder outputs: it scatters them at the image placeholders
            # and computes the M-RoPE position ids from input_ids, image_grid_thw and mm_token_type_ids
            # (the model concatenates `pooler_output` as a tuple of tensors; transformers annotates one tensor)
            fwd["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=(rows,))}  # type: ignore[arg-type]
        return self.model(**fwd, **kwargs)


class Qwen2AudioAdapter(HFMultimodalAdapter):
    """Qwen2-Audio (``Qwen2AudioForConditionalGeneration``): clips through ``audio_tower`` and the projector.

    Each clip is stored as the feature extractor's padded log-mel frames ``[T, num_mel_bins]`` (``T`` =
    ``2 * max_source_positions``, the padding the model's own path sees) with its valid frame count in
    ``table.meta["feature_length"]``; its rows are the projector's outputs of the valid positions.

    Args:
        model: The model.
        feature_extractor: A ``WhisperFeatureExtractor`` producing ``T`` frames of ``num_mel_bins``; default:
            one built from the audio config (no download).
    """

    family = "qwen2_audio"
    kind = "audio"

    def __init__(self, model: nn.Module, feature_extractor: Any | None = None):
        inner = _unwrap(model)
        ac = inner.config.audio_config
        self.frames = int(ac.max_source_positions) * 2  # conv2 has stride 2
        if feature_extractor is None:
            from transformers import WhisperFeatureExtractor

            chunk = self.frames * 160 / 16000
            feature_extractor = WhisperFeatureExtractor(feature_size=ac.num_mel_bins, chunk_length=chunk)
            feature_extractor.nb_max_frames = self.frames
            feature_extractor.n_samples = self.frames * feature_extractor.hop_length
        if getattr(feature_extractor, "feature_size", ac.num_mel_bins) != ac.num_mel_bins:
            raise ConfigError(
                f"feature extractor makes {feature_extractor.feature_size} mel bins, the audio config wants "
                f"{ac.num_mel_bins}"
            )
        super().__init__(model, feature_extractor)
        self.mel = int(ac.num_mel_bins)
        self._stack = _AudioStack(inner.model.audio_tower, inner.model.multi_modal_projector)

    def _placeholder_id(self) -> int:
        return self.inner.config.audio_token_id

    @property
    def encoder(self) -> nn.Module:
        return self._stack

    def preprocess(self, samples: torch.Tensor, rate: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``float32 [frames, channels]`` samples -> ``([T, mel] padded features, {"feature_length": []})``."""
        fe = self.processor
        if rate != fe.sampling_rate:
            raise MediaError(f"audio at {rate} Hz; the feature extractor wants {fe.sampling_rate} Hz (resample it)")
        mono = samples.mean(-1) if samples.dim() == 2 else samples
        out = fe(
            mono.numpy(),
            sampling_rate=rate,
            return_attention_mask=True,
            padding="max_length",
            max_length=self.frames * fe.hop_length,
            return_tensors="pt",
        )
        feats = out["input_features"][0]  # [mel, T]
        if feats.shape[-1] != self.frames:
            raise MediaError(f"feature extractor returned {feats.shape[-1]} frames; the audio tower wants {self.frames}")
        return feats.T.contiguous(), {"feature_length": out["attention_mask"][0].sum().to(torch.long)}

    def encoder_call(self, encoder: nn.Module, table: MediaTable) -> torch.Tensor:
        u = table.num_items
        feats = table.values.reshape(u, self.frames, self.mel).transpose(1, 2)
        return encoder(feats, table.meta["feature_length"])

    def out_rows(self, table: MediaTable) -> torch.Tensor:
        return _audio_out_lengths(table.meta["feature_length"])

    def dummy_input(self) -> MediaTable:
        table = MediaTable.empty_like(
            "audio", (self.mel,), torch.float32, self.frames, {"feature_length": torch.tensor([self.frames])}
        )
        return table.to(_device_of(self.encoder))

    def _native_media(self, table: MediaTable, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        n = table.num_items
        feats = table.values.reshape(n, self.frames, self.mel).transpose(1, 2)
        fl = table.meta["feature_length"]
        fmask = (torch.arange(self.frames, device=fl.device)[None, :] < fl[:, None]).to(torch.long)
        return {"input_features": feats, "feature_attention_mask": fmask}

    def _forward_with_rows(self, inputs: dict[str, torch.Tensor], rows: torch.Tensor | None, **kwargs: Any) -> Any:
        ids = inputs["input_ids"]
        embeds = self.inner.get_input_embeddings()(ids)
        if rows is not None:
            mask = (ids == self.placeholder_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, rows.to(embeds.dtype))
        fwd = {k: v for k, v in inputs.items() if k != "input_ids"}
        return self.model(inputs_embeds=embeds, **fwd, **kwargs)


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
        micro_batch: The dataset's micro-batch, or its :class:`~knitdata.collate.MicroBatchInfo`.
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


def _audio_out_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Qwen2-Audio: valid mel frames -> rows after conv2 (stride 2) and the 2x average pool."""
    after_conv = (lengths - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


class _AudioStack(nn.Module):
    """Qwen2-Audio's audio tower plus its projector, masked per clip as the model's own forward does."""

    def __init__(self, tower: nn.Module, projector: nn.Module):
        super().__init__()
        self.tower = tower
        self.projector = projector

    def forward(self, feats: torch.Tensor, feature_length: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        u, _, frames = feats.shape
        conv_len = (feature_length - 1) // 2 + 1
        max_len = (frames - 2) // 2 + 1
        valid = torch.arange(max_len, device=feats.device)[None, :] < conv_len.to(feats.device)[:, None]
        linear = cast(nn.Linear, self.projector.linear)  # Qwen2AudioMultiModalProjector.linear
        dummy = torch.zeros((u, max_len, 1), dtype=linear.weight.dtype, device=feats.device)
        att = create_bidirectional_mask(config=self.tower.config, inputs_embeds=dummy, attention_mask=valid.long())
        hidden = self.tower(feats, attention_mask=att).last_hidden_state
        out = self.projector(hidden)
        keep = torch.arange(out.shape[1], device=out.device)[None, :] < _audio_out_lengths(feature_length).to(
            out.device
        )[:, None]
        return out[keep]


def _default_image_processor(vision_config: Any) -> Any:
    cls: Callable[..., Any]
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        cls = Qwen2VLImageProcessorPil
    except ImportError:  # older transformers
        from transformers import Qwen2VLImageProcessor

        cls = Qwen2VLImageProcessor
    return cls(
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        merge_size=vision_config.spatial_merge_size,
    )


_ADAPTERS: dict[str, Callable[..., HFMultimodalAdapter]] = {
    "qwen2_5_vl": Qwen2_5_VLAdapter,
    "qwen2_audio": Qwen2AudioAdapter,
}


def qwen2_5_vl(model: nn.Module, image_processor: Any | None = None) -> Qwen2_5_VLAdapter:
    """The adapter of a Qwen2.5-VL model (see :class:`Qwen2_5_VLAdapter`)."""
    return Qwen2_5_VLAdapter(model, image_processor)


def qwen2_audio(model: nn.Module, feature_extractor: Any | None = None) -> Qwen2AudioAdapter:
    """The adapter of a Qwen2-Audio model (see :class:`Qwen2AudioAdapter`)."""
    return Qwen2AudioAdapter(model, feature_extractor)


def adapter_for(model: nn.Module, processor: Any | None = None) -> HFMultimodalAdapter:
    """The adapter of a supported model, by ``model.config.model_type``.

    Args:
        model: A ``transformers`` model of a family in :data:`FAMILIES` (possibly wrapped).
        processor: Its image processor or feature extractor (default: built from the config).

    Raises:
        ConfigError: Unsupported family (see the module docstring for the LLaVA-style recipe).
    """
    family = getattr(_unwrap(model).config, "model_type", None)
    if family not in _ADAPTERS:
        raise ConfigError(
            f"no knitdata adapter for model_type {family!r}; supported: {FAMILIES} (see the recipe in "
            "knitdata.integrations.transformers for LLaVA-style towers)"
        )
    return _ADAPTERS[family](model, processor)
