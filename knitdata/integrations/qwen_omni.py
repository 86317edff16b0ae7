"""``transformers`` adapters of the omni and Qwen3 families: Qwen2.5-Omni (thinker: images, video and audio in
one prompt) and Qwen3-VL (images, with its deepstack features).

Built by :func:`knitdata.integrations.transformers.adapter_for` from ``model.config.model_type``.

**Qwen2.5-Omni.** The thinker (``Qwen2_5OmniThinkerForConditionalGeneration``) has two towers: the vision
encoder (``model.visual``, for images and video frames; the Qwen2.5-VL tower) and the audio encoder
(``model.audio_tower``). :meth:`Qwen2_5OmniAdapter.shared_encoding` wraps them as
``{"image": visual, "video": visual, "audio": audio_tower}`` in one
:class:`~knitdata.media.encoder.SharedEncoding`: each unique image, video and clip of a mini-batch is encoded once.
Per-item metadata in ``MediaTable.meta``: ``image_grid_thw``, ``video_grid_thw`` and
``video_second_per_grid`` (the temporal patch size over the sampled frame rate, as the model's processor
computes it) and an audio clip's ``feature_length`` (its valid mel frames; the table stores only those, as
the model's forward keeps them). The forward is the model's own: image and video rows go through its
``mm_encoder_outputs`` hook, audio rows are scattered at the audio placeholders into the text embeddings
(what the model does with its own audio features) and passed as ``inputs_embeds`` together with
``input_ids``, from which the model computes its 3-D (M-RoPE) position ids, with the audio lengths from
``feature_attention_mask`` and the video timing from ``video_second_per_grid``. Prompts carry
``<vision_start> image|video <vision_end>`` and ``<audio_start> audio <audio_end>`` around one placeholder
per item, as the model's processor writes them.

Under DDP, freeze ``model.audio_tower.audio_bos_eos_token`` (``requires_grad_(False)``): the thinker's
forward never uses it (its own duplicated path neither), and DDP with ``find_unused_parameters=False`` (what
shared encoding's ``fold`` wants with one wrapper) fails on a parameter without a gradient.

**Video frames** are decoded with PyAV (the ``video`` extra) and sampled by the collator's
:class:`~knitdata.media.video.VideoSampling`; they are resized and normalized with the model's own image
processor frame by frame (``temporal_patch_size=1``) and grouped into temporal patches in the layout of
``transformers``' ``Qwen2VLVideoProcessor`` (which needs ``torchvision``; the frames' resampling is then
PIL's bicubic instead of torchvision's).

**Qwen3-VL.** ``Qwen3VLForConditionalGeneration``'s vision tower returns, besides the merged rows, one
feature map per deepstack layer, which the language model adds to its first hidden states at the image
positions. :meth:`Qwen3VLAdapter.encoder_call` returns them all as one tuple, so
:class:`~knitdata.media.encoder.SharedEncoding` deduplicates them together and the deepstack mergers get exact
gradients too; the forward passes them through the model's ``mm_encoder_outputs`` hook
(``deepstack_features``).

Both towers treat items independently (per-item windows and ``cu_seqlens`` in the vision towers, per-clip
chunks in the audio tower), the exactness condition of shared encoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from knitdata.errors import ConfigError, MediaError, OptionalDependencyError
from knitdata.integrations.hf_adapter import HFMultimodalAdapter, device_of, unwrap_model
from knitdata.integrations.qwen import Qwen2_5_VLAdapter, default_image_processor
from knitdata.media.encoder import SharedEncoding
from knitdata.media.multimodal import MediaTable, MultimodalBatch, MultimodalCollator
from knitdata.media.video import VideoSampling

try:
    from transformers.modeling_outputs import BaseModelOutputWithPooling
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise OptionalDependencyError("transformers", "transformers", "knitdata.integrations.transformers") from e

__all__ = ["Qwen2_5OmniAdapter", "Qwen3VLAdapter", "qwen2_5_omni", "qwen3_vl", "video_patches"]


def video_patches(image_processor: Any, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Video frames -> ``(pixel_values_videos [patches, C*T*p*p], video_grid_thw [3])`` in Qwen2-VL's layout.

    Each frame is resized and normalized by ``image_processor`` (a ``Qwen2VLImageProcessor``) with a temporal
    patch size of 1; groups of ``image_processor.temporal_patch_size`` consecutive frames then make one
    temporal patch (the last frame repeated to fill the last group), rows ordered (time, merged row blocks),
    columns (channel, time, patch row, patch column), as ``Qwen2VLVideoProcessor`` lays them out.

    Args:
        image_processor: The model's image processor.
        frames: ``uint8 [T, C, H, W]``.

    Returns:
        The packed patches and the grid ``(t, h, w)`` in patches.
    """
    tp = int(image_processor.temporal_patch_size)
    t = frames.shape[0]
    if t % tp:
        frames = torch.cat([frames, frames[-1:].expand(tp - t % tp, *frames.shape[1:])], 0)
        t = frames.shape[0]
    out = image_processor(images=list(frames), temporal_patch_size=1, return_tensors="pt")
    grid = out["image_grid_thw"]
    if not bool((grid == grid[0]).all()):
        raise MediaError("video frames were resized to different sizes; frames of one video must share a size")
    gh, gw = int(grid[0, 1]), int(grid[0, 2])
    pix = out["pixel_values"]  # [t * gh * gw, C * p * p]
    p2 = pix.shape[1]
    c = int(frames.shape[1])
    pp = p2 // c
    pix = pix.reshape(t // tp, tp, gh * gw, c, pp).permute(0, 2, 3, 1, 4).reshape(t // tp * gh * gw, c * tp * pp)
    return pix.contiguous(), torch.tensor([t // tp, gh, gw], dtype=torch.long)


class Qwen2_5OmniAdapter(HFMultimodalAdapter):
    """Qwen2.5-Omni's thinker: images and video through ``model.visual``, audio through ``model.audio_tower``.

    Args:
        model: A ``Qwen2_5OmniThinkerForConditionalGeneration`` (possibly wrapped).
        image_processor: A ``Qwen2VLImageProcessor`` matching the vision config (default: built from it);
            video frames go through it too (see :func:`video_patches`).
        feature_extractor: A ``WhisperFeatureExtractor`` with the audio config's mel bins (default: built from
            it, 16 kHz, clips up to 30 s).
        video_sampling: How video frames are sampled (default 2 per second, a multiple of the temporal
            patch size, as the model's processor does).
    """

    family = "qwen2_5_omni"
    kind = "image"
    kinds: tuple[str, ...] = ("image", "video", "audio")

    def __init__(
        self,
        model: nn.Module,
        image_processor: Any | None = None,
        feature_extractor: Any | None = None,
        video_sampling: VideoSampling | None = None,
    ):
        inner = unwrap_model(model)
        cfg = inner.config
        vc, ac = cfg.vision_config, cfg.audio_config
        if image_processor is None:
            image_processor = default_image_processor(vc)
        if feature_extractor is None:
            from transformers import WhisperFeatureExtractor

            feature_extractor = WhisperFeatureExtractor(feature_size=ac.num_mel_bins)
        if getattr(feature_extractor, "feature_size", ac.num_mel_bins) != ac.num_mel_bins:
            raise ConfigError(
                f"feature extractor makes {feature_extractor.feature_size} mel bins, the audio config wants "
                f"{ac.num_mel_bins}"
            )
        super().__init__(model, image_processor)
        self.feature_extractor = feature_extractor
        self.video_sampling = video_sampling or VideoSampling(frame_factor=int(vc.temporal_patch_size))
        self.placeholders = {"image": cfg.image_token_id, "video": cfg.video_token_id, "audio": cfg.audio_token_id}
        self.merge = int(vc.spatial_merge_size) ** 2
        self.row_dim = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
        self.mel = int(ac.num_mel_bins)

    def _placeholder_id(self) -> int:
        return self.inner.config.image_token_id

    @property
    def encoder(self) -> nn.Module:
        """The vision tower (images and video); :attr:`encoders` has both towers."""
        return self.inner.model.visual

    @property
    def encoders(self) -> dict[str, nn.Module]:
        """Per media kind, the model's own tower."""
        m = self.inner.model
        return {"image": m.visual, "video": m.visual, "audio": m.audio_tower}

    # ------------------------------------------------------------------ processing
    def preprocess_image(self, pixels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``uint8 [C, H, W]`` -> ``(pixel_values, {"image_grid_thw": [3]})`` (the model's image processor)."""
        out = self.processor(images=[pixels], return_tensors="pt")
        return out["pixel_values"], {"image_grid_thw": out["image_grid_thw"][0].to(torch.long)}

    def preprocess_video(self, frames: torch.Tensor, fps: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sampled frames ``uint8 [T, C, H, W]`` at ``fps`` -> ``(pixel_values_videos, {"video_grid_thw": [3],
        "video_second_per_grid": []})``."""
        pix, grid = video_patches(self.processor, frames)
        spg = float(self.processor.temporal_patch_size) / float(fps)
        return pix, {"video_grid_thw": grid, "video_second_per_grid": torch.tensor(spg, dtype=torch.float64)}

    def preprocess_audio(self, samples: torch.Tensor, rate: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``float32 [frames, channels]`` -> ``(valid log-mel frames [L, mel], {"feature_length": L})``."""
        fe = self.feature_extractor
        if rate != fe.sampling_rate:
            raise MediaError(f"audio at {rate} Hz; the feature extractor wants {fe.sampling_rate} Hz (resample it)")
        mono = samples.mean(-1) if samples.dim() == 2 else samples
        out = fe(
            mono.numpy(), sampling_rate=rate, return_attention_mask=True, padding="max_length", return_tensors="pt"
        )
        n = int(out["attention_mask"][0].sum())
        feats = out["input_features"][0][:, :n]  # [mel, L]: the model keeps the valid frames only
        return feats.T.contiguous(), {"feature_length": torch.tensor(n, dtype=torch.long)}

    def media_collator(self, key: str = "provenance") -> MultimodalCollator:
        """A collator processing images, videos and clips with the model's processors (see the base class)."""
        return MultimodalCollator(
            {"image": self.preprocess_image, "video": self.preprocess_video, "audio": self.preprocess_audio},
            key=key,
            video_sampling=self.video_sampling,
        )

    # ------------------------------------------------------------------ encoding
    def encoder_call(self, encoder: nn.Module, table: MediaTable) -> torch.Tensor:
        if table.kind == "audio":
            lens = table.meta["feature_length"].to(table.values.device)
            feats = table.values.to(cast(torch.dtype, encoder.dtype)).T  # [mel, sum L]
            return encoder(feats, feature_lens=lens, aftercnn_lens=(lens - 1) // 2 + 1).last_hidden_state
        pix = table.values.to(cast(torch.dtype, encoder.dtype))
        return encoder(pix, grid_thw=table.meta[f"{table.kind}_grid_thw"]).pooler_output

    def out_rows(self, table: MediaTable) -> torch.Tensor:
        if table.kind == "audio":
            return _audio_out_lengths(table.meta["feature_length"])
        return table.meta[f"{table.kind}_grid_thw"].prod(-1) // self.merge

    def dummy_inputs(self) -> dict[str, MediaTable]:
        """Per kind, a one-item all-zero table for the zero-gradient dummy encode of a rank without that kind."""
        s = int(self.inner.config.vision_config.spatial_merge_size)
        grid = torch.tensor([[1, s, s]], dtype=torch.long)
        vdt = cast(torch.dtype, self.encoder.dtype)
        adt = cast(torch.dtype, self.inner.model.audio_tower.dtype)
        dev = device_of(self.encoder)
        return {
            "image": MediaTable.empty_like("image", (self.row_dim,), vdt, s * s, {"image_grid_thw": grid}).to(dev),
            "video": MediaTable.empty_like(
                "video", (self.row_dim,), vdt, s * s,
                {"video_grid_thw": grid, "video_second_per_grid": torch.ones(1, dtype=torch.float64)},
            ).to(dev),
            "audio": MediaTable.empty_like(
                "audio", (self.mel,), adt, 4, {"feature_length": torch.tensor([4])}
            ).to(device_of(self.inner.model.audio_tower)),
        }

    def dummy_input(self) -> MediaTable:
        return self.dummy_inputs()["image"]

    def shared_encoding(self, mode: str = "fold", **kwargs: Any) -> SharedEncoding:
        """A :class:`~knitdata.media.encoder.SharedEncoding` of both towers (``{"image", "video", "audio"}``).

        ``rows(i, kind)`` then gives one kind's rows; :meth:`rows` gathers all three for :meth:`forward`.
        """
        kwargs.setdefault("dummy_input", self.dummy_inputs())
        return SharedEncoding(self.encoders, mode=mode, call=self.encoder_call, out_rows=self.out_rows, **kwargs)

    def rows(self, shared: Any, i: int) -> dict[str, Any]:
        """Micro-batch ``i``'s rows of every kind the mini-batch holds: ``{kind: rows or None}``.

        Args:
            shared: The open ``SharedMiniBatch``.
            i: The micro-batch.
        """
        return {kind: shared.rows(i, kind) for kind in shared.batch.kinds}

    # ------------------------------------------------------------------ text and forward
    def _extra_inputs_all(self, input_ids, mask, tables, occs) -> dict[str, torch.Tensor]:
        extra: dict[str, torch.Tensor] = {}
        for kind in ("image", "video"):
            occ, table = occs.get(kind), tables.get(kind)
            if occ is not None and len(occ) and table is not None:
                idx = occ.index.cpu()
                extra[f"{kind}_grid_thw"] = table.meta[f"{kind}_grid_thw"].cpu()[idx]
                if kind == "video":
                    extra["video_second_per_grid"] = table.meta["video_second_per_grid"].cpu()[idx]
        occ, table = occs.get("audio"), tables.get("audio")
        if occ is not None and len(occ) and table is not None:
            lens = table.meta["feature_length"].cpu()[occ.index.cpu()]
            width = int(lens.max())
            extra["feature_attention_mask"] = (torch.arange(width)[None, :] < lens[:, None]).to(torch.long)
        return extra

    def forward(self, inputs: dict[str, torch.Tensor], rows: Any, **kwargs: Any) -> Any:
        """The model's own forward with the shared rows of every kind at their placeholders.

        Args:
            inputs: :meth:`collate`'s output (on the model's device).
            rows: ``{kind: rows or None}`` (:meth:`rows`), or one tensor for an image-only micro-batch.
            **kwargs: More model forward arguments.

        Raises:
            ConfigError: The rows of a kind do not fill its placeholders exactly.
        """
        if not isinstance(rows, Mapping):
            rows = {"image": rows}
        ids = inputs["input_ids"]
        for kind, pid in self.placeholders.items():
            n = int((ids == pid).sum())
            r = rows.get(kind)
            got = 0 if r is None else int(r.shape[0])
            if n != got:
                raise ConfigError(
                    f"micro-batch has {n} {kind} placeholder tokens but {got} encoder rows: collate the text with "
                    "this adapter's collate() and the same MultimodalBatch"
                )
        fwd: dict[str, Any] = dict(inputs)
        # the model concatenates `pooler_output` as a tuple of tensors (transformers annotates one tensor)
        mm = {
            k: BaseModelOutputWithPooling(pooler_output=(rows[k],))  # type: ignore[arg-type]
            for k in ("image", "video")
            if rows.get(k) is not None
        }
        if mm:
            fwd["mm_encoder_outputs"] = mm
        audio = rows.get("audio")
        if audio is not None:
            embeds = self.inner.get_input_embeddings()(ids)
            where = (ids == self.placeholders["audio"]).unsqueeze(-1)
            fwd["inputs_embeds"] = embeds.masked_scatter(where, audio.to(embeds.dtype))
        return self.model(**fwd, **kwargs)

    def forward_native(self, inputs: dict[str, torch.Tensor], batch: MultimodalBatch, i: int, **kwargs: Any) -> Any:
        """The model's own forward with every occurrence's copy of its media (images, videos, clips)."""
        occs = batch.for_microbatch(i)
        media: dict[str, Any] = {}
        for kind, name in (("image", "pixel_values"), ("video", "pixel_values_videos")):
            occ, table = occs.get(kind), batch.tables.get(kind)
            if occ is not None and len(occ) and table is not None:
                media[name] = table.gather(occ.index).values
        occ, table = occs.get("audio"), batch.tables.get("audio")
        if occ is not None and len(occ) and table is not None:
            sub = table.gather(occ.index)
            lens = sub.meta["feature_length"]
            width = int(lens.max())
            feats = torch.zeros((sub.num_items, self.mel, width), dtype=sub.values.dtype, device=sub.values.device)
            for u in range(sub.num_items):
                feats[u, :, : int(lens[u])] = sub.item(u).T
            media["input_features"] = feats
        return self.model(**inputs, **media, **kwargs)


class Qwen3VLAdapter(Qwen2_5_VLAdapter):
    """Qwen3-VL (``Qwen3VLForConditionalGeneration``): images through ``model.visual``, deepstack included.

    The tower's output for shared encoding is the tuple ``(merged rows, *deepstack feature maps)``, every
    leaf with one row per image placeholder; ``SharedMiniBatch.rows(i)`` gives that tuple and
    :meth:`forward` hands it to the model's ``mm_encoder_outputs`` hook.

    Args:
        model: The model.
        image_processor: A ``Qwen2VLImageProcessor`` matching the vision config (default: built from it, with
            Qwen3-VL's mean and std of 0.5).
    """

    family = "qwen3_vl"
    kind = "image"

    def __init__(self, model: nn.Module, image_processor: Any | None = None):
        if image_processor is None:
            image_processor = default_image_processor(
                unwrap_model(model).config.vision_config, image_mean=[0.5] * 3, image_std=[0.5] * 3
            )
        super().__init__(model, image_processor)

    def encoder_call(self, encoder: nn.Module, table: MediaTable) -> Any:
        pix = table.values.to(cast(torch.dtype, encoder.dtype))
        out = encoder(pix, grid_thw=table.meta["image_grid_thw"])
        return (out.pooler_output, *out.deepstack_features)

    def _forward_with_rows(self, inputs: dict[str, torch.Tensor], rows: Any, **kwargs: Any) -> Any:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        fwd: dict[str, Any] = dict(inputs)
        if rows is None:
            fwd.pop("image_grid_thw", None)
        else:
            merged, *deep = rows
            fwd["mm_encoder_outputs"] = {
                "image": BaseModelOutputWithDeepstackFeatures(  # tuples per image list, as get_image_features gives
                    pooler_output=(merged,), deepstack_features=[(d,) for d in deep]  # type: ignore[arg-type, misc]
                )
            }
        return self.model(**fwd, **kwargs)

    def forward(self, inputs: dict[str, torch.Tensor], rows: Any, **kwargs: Any) -> Any:
        """The model's own forward with the shared rows (the tuple of merged rows and deepstack features)."""
        merged = rows[0] if isinstance(rows, (tuple, list)) else rows
        n = int((inputs["input_ids"] == self.placeholder_id).sum())
        got = 0 if merged is None else int(merged.shape[0])
        if n != got:
            raise ConfigError(
                f"micro-batch has {n} image placeholder tokens but {got} encoder rows: collate the text with this "
                "adapter's collate() and the same MultimodalBatch"
            )
        return self._forward_with_rows(inputs, rows if got else None, **kwargs)


def _audio_out_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Qwen2.5-Omni's audio tower: valid mel frames -> rows after conv2 (stride 2) and the 2x average pool."""
    after_conv = (lengths - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def qwen2_5_omni(
    model: nn.Module,
    image_processor: Any | None = None,
    feature_extractor: Any | None = None,
    video_sampling: VideoSampling | None = None,
) -> Qwen2_5OmniAdapter:
    """The adapter of a Qwen2.5-Omni thinker (see :class:`Qwen2_5OmniAdapter`)."""
    return Qwen2_5OmniAdapter(model, image_processor, feature_extractor, video_sampling)


def qwen3_vl(model: nn.Module, image_processor: Any | None = None) -> Qwen3VLAdapter:
    """The adapter of a Qwen3-VL model (see :class:`Qwen3VLAdapter`)."""
    return Qwen3VLAdapter(model, image_processor)
