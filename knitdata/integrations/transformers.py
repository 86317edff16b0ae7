"""Shared encoding and the multimodal collate on Hugging Face ``transformers`` vision-language and audio models.

An adapter ties one ``transformers`` model to knitdata's multimodal path without patching it:

1. **Processing**: :meth:`HFMultimodalAdapter.media_collator` processes each unique image or audio clip once
   with the model's own processor (``Qwen2VLImageProcessor``, ``WhisperFeatureExtractor``) and carries the
   per-item metadata the encoder needs in the media table (``table.meta``): Qwen2-VL's ``image_grid_thw``,
   an audio clip's valid feature length.
2. **Encoding**: :meth:`HFMultimodalAdapter.shared_encoding` wraps the model's own tower in
   :class:`~knitdata.media.encoder.SharedEncoding` (``fold``/``leaf``/``recompute``/``naive``), with the right call
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
   media (the reference the tests compare gradients against, and the baseline of ``python -m benchmarks vlm``).

Supported families: ``qwen2_5_vl`` (Qwen2.5-VL, images), ``qwen2_audio`` (Qwen2-Audio, audio clips),
``qwen2_5_omni`` (the Qwen2.5-Omni thinker: images, video and audio in one prompt) and ``qwen3_vl`` (Qwen3-VL,
images with deepstack features; see :mod:`knitdata.integrations.qwen_omni`), through :func:`adapter_for`
(dispatch on ``model.config.model_type``), :func:`qwen2_5_vl`, :func:`qwen2_audio`, :func:`qwen2_5_omni` or
:func:`qwen3_vl`. Their towers treat items independently (per-item ``cu_seqlens`` windows and full
attention in the Qwen2.5-VL vision tower; per-clip attention masks in the Qwen2-Audio encoder), the
exactness condition of :class:`~knitdata.media.encoder.SharedEncoding`. Tested in float64 on tiny random-init
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
``grad_sync(model, enabled=mb.info.is_last)`` (:func:`knitdata.media.encoder.grad_sync`), and pass the world size.
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

from collections.abc import Callable
from typing import Any

import torch  # noqa: F401 - with nn, SharedEncoding and MultimodalCollator: the names the recipe above uses
from torch import nn

from knitdata.errors import ConfigError
from knitdata.integrations.hf_adapter import GRAD_RTOL, HFMultimodalAdapter, scale_mean_loss, unwrap_model
from knitdata.integrations.qwen import ADAPTERS, Qwen2_5_VLAdapter, Qwen2AudioAdapter, qwen2_5_vl, qwen2_audio
from knitdata.integrations.qwen_omni import Qwen2_5OmniAdapter, Qwen3VLAdapter, qwen2_5_omni, qwen3_vl
from knitdata.media.encoder import SharedEncoding  # noqa: F401
from knitdata.media.multimodal import MultimodalCollator  # noqa: F401
from knitdata.registry import Registry

__all__ = [
    "FAMILIES",
    "GRAD_RTOL",
    "HFMultimodalAdapter",
    "MODEL_ADAPTERS",
    "Qwen2_5_VLAdapter",
    "Qwen2AudioAdapter",
    "Qwen2_5OmniAdapter",
    "Qwen3VLAdapter",
    "adapter_for",
    "qwen2_5_vl",
    "qwen2_audio",
    "qwen2_5_omni",
    "qwen3_vl",
    "scale_mean_loss",
]

#: Supported families (Qwen2.5-Omni: its thinker, ``model_type`` ``"qwen2_5_omni_thinker"``).
FAMILIES: tuple[str, ...] = ("qwen2_5_vl", "qwen2_audio", "qwen2_5_omni", "qwen3_vl")

#: The adapter classes by ``model.config.model_type`` (:func:`adapter_for`): the families of :data:`FAMILIES`, then any
#: registered since (``MODEL_ADAPTERS.register(model_type, MyAdapter)``: an :class:`HFMultimodalAdapter` subclass
#: built as ``MyAdapter(model, processor)``, e.g. for a LLaVA-style model following the recipe above).
MODEL_ADAPTERS: Registry[Callable[..., HFMultimodalAdapter]] = Registry("model adapter", accepts=callable)
_BUILT_IN = {**ADAPTERS, "qwen2_5_omni_thinker": Qwen2_5OmniAdapter, "qwen3_vl": Qwen3VLAdapter}
for _model_type, _adapter in _BUILT_IN.items():
    MODEL_ADAPTERS.register(_model_type, _adapter)


def adapter_for(model: nn.Module, processor: Any | None = None) -> HFMultimodalAdapter:
    """The adapter of a supported model, by ``model.config.model_type``.

    Args:
        model: A ``transformers`` model of a family in :data:`FAMILIES` or registered in :data:`MODEL_ADAPTERS`
            (possibly wrapped).
        processor: Its image processor or feature extractor (default: built from the config).

    Raises:
        ConfigError: Unsupported family (see the module docstring for the LLaVA-style recipe).
    """
    family = getattr(unwrap_model(model).config, "model_type", None)
    if family == "qwen2_5_omni":
        raise ConfigError(
            "a whole Qwen2.5-Omni model (thinker, talker, token2wav): RL trains its thinker, pass model.thinker"
        )
    if family not in MODEL_ADAPTERS:
        raise ConfigError(
            f"no knitdata adapter for model_type {family!r}; supported: {MODEL_ADAPTERS.names()} (see the recipe in "
            "knitdata.integrations.transformers for LLaVA-style towers, and MODEL_ADAPTERS.register)"
        )
    return MODEL_ADAPTERS.get(str(family))(model, processor)
