"""``transformers`` adapters of the supported families: Qwen2.5-VL (images) and Qwen2-Audio (audio).

Built by :func:`knitdata.integrations.transformers.adapter_for` from ``model.config.model_type``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from knitdata.errors import ConfigError, MediaError, OptionalDependencyError
from knitdata.integrations.hf_adapter import HFMultimodalAdapter, device_of, unwrap_model
from knitdata.media.multimodal import MediaTable

try:
    import transformers
    from transformers.modeling_outputs import BaseModelOutputWithPooling
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise OptionalDependencyError("transformers", "transformers", "knitdata.integrations.transformers") from e

__all__ = ["ADAPTERS", "Qwen2_5_VLAdapter", "Qwen2AudioAdapter", "default_image_processor", "qwen2_5_vl", "qwen2_audio"]


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
        inner = unwrap_model(model)
        vc = inner.config.vision_config
        if image_processor is None:
            image_processor = default_image_processor(vc)
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
        return table.to(device_of(self.encoder))

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
        inner = unwrap_model(model)
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
        return table.to(device_of(self.encoder))

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


def default_image_processor(vision_config: Any, **kwargs: Any) -> Any:
    """A ``Qwen2VLImageProcessor`` (the PIL variant where available) matching a Qwen vision config.

    Args:
        vision_config: The model's vision config (``patch_size``, ``temporal_patch_size``,
            ``spatial_merge_size``).
        **kwargs: More processor arguments (``size``, ``image_mean``, ``image_std``...).
    """
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
        **kwargs,
    )


#: ``model.config.model_type`` -> adapter class.
ADAPTERS: dict[str, Callable[..., HFMultimodalAdapter]] = {
    "qwen2_5_vl": Qwen2_5_VLAdapter,
    "qwen2_audio": Qwen2AudioAdapter,
}


def qwen2_5_vl(model: nn.Module, image_processor: Any | None = None) -> Qwen2_5_VLAdapter:
    """The adapter of a Qwen2.5-VL model (see :class:`Qwen2_5_VLAdapter`)."""
    return Qwen2_5_VLAdapter(model, image_processor)


def qwen2_audio(model: nn.Module, feature_extractor: Any | None = None) -> Qwen2AudioAdapter:
    """The adapter of a Qwen2-Audio model (see :class:`Qwen2AudioAdapter`)."""
    return Qwen2AudioAdapter(model, feature_extractor)
