"""Toy models of the benchmarks, in one place.

* The transfer benchmark's tiny vision-language model (:class:`TinyVLM`: a patch-MLP vision encoder, an audio
  encoder, an MLP backbone), its presets (CPU, smoke, omni, a 7B-class projection) and FLOP counting per step;
* the encode benchmark's transformer patch encoder and backbone (:class:`TransformerPatchEncoder`,
  :class:`TransformerBackbone`);
* the demo's per-patch MLP encoder and residual-MLP language model (:class:`MlpPatchEncoder`, :class:`MlpVLM`).

The learning benchmark's policy (``SortPolicy``) stays with its task in :mod:`benchmarks.learning`; the vlm
benchmark builds real ``transformers`` architectures from configs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from knitdata.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the workload module imports this one
    from benchmarks.common.workload import TransferWorkload

__all__ = [
    "TransformerPatchEncoder",
    "TransformerBackbone",
    "MlpPatchEncoder",
    "MlpVLM",
    "DEFAULT_GPU_TFLOPS",
    "VLMConfig",
    "TINY_VLM",
    "SMOKE_VLM",
    "OMNI_VLM",
    "OMNI_SMOKE_VLM",
    "GPU_VLM",
    "VisionEncoder",
    "media_tokens",
    "TinyVLM",
    "preprocess",
    "count_step_flops",
]


#: Default effective GPU rate for the projection (bf16, dense, per GPU).
DEFAULT_GPU_TFLOPS = 400.0


@dataclass(frozen=True)
class VLMConfig:
    """Shape of the vision-language model trained by every consumer (or counted for the GPU projection).

    Attributes:
        name: Label in the report.
        d_model: Backbone width.
        layers: Backbone blocks.
        heads: Backbone attention heads (0: MLP-only blocks).
        mlp_ratio: Backbone MLP hidden width over ``d_model``.
        vocab: Output vocabulary.
        patch: Vision patch side.
        d_vision: Vision encoder width.
        vision_layers: Vision encoder blocks.
        vision_heads: Vision attention heads within one image (0: MLP-only blocks).
        vision_mlp_ratio: Vision MLP hidden width over ``d_vision``.
        merge: Vision patches merged into one image token (``merge`` consecutive rows).
        audio_merge: Audio rows merged into one audio token (omni).
        audio_layers: Audio encoder blocks (omni; width ``d_vision``, MLP-only).
    """

    name: str
    d_model: int
    layers: int
    heads: int
    mlp_ratio: int
    vocab: int
    patch: int
    d_vision: int
    vision_layers: int
    vision_heads: int
    vision_mlp_ratio: int
    merge: int = 1
    audio_merge: int = 4
    audio_layers: int = 1

    def image_tokens(self, image_shape: Sequence[int]) -> int:
        """Image tokens one image becomes in the backbone."""
        _, h, w = image_shape
        return (h // self.patch) * (w // self.patch) // self.merge

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable fields."""
        return dataclasses.asdict(self)


#: What the consumers train on this CPU (one thread each).
TINY_VLM = VLMConfig(name="tiny (CPU)", d_model=64, layers=1, heads=0, mlp_ratio=4, vocab=256, patch=28,
                     d_vision=96, vision_layers=2, vision_heads=0, vision_mlp_ratio=4)
#: A smaller model for ``--smoke`` (the comparison must not rot; its numbers are not the result).
SMOKE_VLM = VLMConfig(name="smoke (CPU)", d_model=32, layers=1, heads=0, mlp_ratio=2, vocab=128, patch=28,
                      d_vision=32, vision_layers=1, vision_heads=0, vision_mlp_ratio=2)
#: The omni workload's model on this CPU: the tiny VLM with a 4-row patch merger (a frame of 224 px becomes 16
#: tokens) and an audio encoder (50 ms rows, 4 rows per token: a 30 s clip becomes 150 tokens).
OMNI_VLM = dataclasses.replace(TINY_VLM, name="tiny omni (CPU)", merge=4)
#: The omni model of ``--smoke``.
OMNI_SMOKE_VLM = dataclasses.replace(SMOKE_VLM, name="smoke omni (CPU)", merge=4)
#: A 7B-class VLM (Qwen2.5-VL-7B-like widths; MLP ratio 8 stands in for its SwiGLU) for the GPU projection.
GPU_VLM = VLMConfig(name="7B-class VLM (projection)", d_model=3584, layers=28, heads=28, mlp_ratio=8, vocab=152064,
                    patch=14, d_vision=1280, vision_layers=32, vision_heads=16, vision_mlp_ratio=4, merge=4)


class _Block(nn.Module):
    """Pre-norm residual block: optional self-attention (within a sequence) and an MLP."""

    def __init__(self, d: int, heads: int, ratio: int, causal: bool):
        super().__init__()
        self.heads = heads
        self.causal = causal
        if heads:
            self.norm_a = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
        self.norm_m = nn.LayerNorm(d)
        self.up = nn.Linear(d, ratio * d)
        self.down = nn.Linear(ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, d]
        if self.heads:
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm_a(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.norm_m(x))))


class VisionEncoder(nn.Module):
    """Patch rows in, one output row per ``merge`` patch rows out; no interaction across images.

    Called as ``encoder(values, offsets)`` (the :class:`~knitdata.media.encoder.SharedEncoding` convention):
    ``values`` ``[sum of patches, C * p * p]`` float, ``offsets`` ``int64 [U + 1]``; every image has the
    same patch count here. The omni workload's audio encoder is the same stack over 50 ms sample rows
    (``layers``/``merge`` given explicitly).
    """

    def __init__(self, cfg: VLMConfig, in_features: int, *, layers: int | None = None, merge: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.merge = cfg.merge if merge is None else merge
        n_layers = cfg.vision_layers if layers is None else layers
        self.embed = nn.Linear(in_features, cfg.d_vision)
        self.blocks = nn.ModuleList(
            _Block(cfg.d_vision, cfg.vision_heads, cfg.vision_mlp_ratio, causal=False) for _ in range(n_layers)
        )
        self.out = nn.Linear(cfg.d_vision * self.merge, cfg.d_model)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        n_items = 1 if offsets is None else int(offsets.numel()) - 1
        x = self.embed(values.to(self.embed.weight.dtype))
        x = x.view(n_items, -1, x.shape[-1])  # equal patch counts per image
        for blk in self.blocks:
            x = blk(x)
        x = x.reshape(-1, self.cfg.d_vision * self.merge)
        return self.out(x)


def media_tokens(cfg: VLMConfig, w: TransferWorkload) -> int:
    """Backbone positions the media of one trajectory fill (image or video frames, plus audio for omni)."""
    n = w.image_items * cfg.image_tokens(w.item_shape)
    if w.workload == "omni":
        n += w.audio_rows // cfg.audio_merge
    return n


class TinyVLM(nn.Module):
    """Vision (and, for omni, audio) encoder plus backbone; the media rows replace the first prompt positions of
    each sequence (image or frame rows first, then audio rows)."""

    def __init__(self, cfg: VLMConfig, w: TransferWorkload):
        super().__init__()
        self.cfg = cfg
        c, _, _ = w.item_shape
        self.kinds = w.media_kinds
        self.tokens_of = {"image": w.image_items * cfg.image_tokens(w.item_shape)}
        if w.workload == "omni":
            if w.audio_rows % cfg.audio_merge:
                raise ConfigError(f"{w.audio_rows} audio rows per clip are not a multiple of audio_merge "
                                  f"{cfg.audio_merge}: change audio_seconds or audio_hop")
            self.tokens_of["audio"] = w.audio_rows // cfg.audio_merge
        self.image_tokens = sum(self.tokens_of.values())  # every media position of a sequence
        if self.image_tokens > w.prompt_tokens:
            raise ConfigError(f"{self.image_tokens} media tokens do not fit in {w.prompt_tokens} prompt tokens")
        self.prompt_tokens = w.prompt_tokens
        self.encoder = VisionEncoder(cfg, c * cfg.patch * cfg.patch)
        self.audio_encoder = (VisionEncoder(cfg, w.audio_hop, layers=cfg.audio_layers, merge=cfg.audio_merge)
                              if w.workload == "omni" else None)
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg.d_model, cfg.heads, cfg.mlp_ratio, causal=True) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def encoders(self) -> dict[str, nn.Module]:
        """The encoder of each media kind."""
        out: dict[str, nn.Module] = {"video" if "video" in self.kinds else "image": self.encoder}
        if self.audio_encoder is not None:
            out["audio"] = self.audio_encoder
        return out

    def backbone_loss(self, input_ids: torch.Tensor, image_rows: torch.Tensor | Sequence[torch.Tensor]
                      ) -> torch.Tensor:
        """Mean next-token loss over the response positions.

        Args:
            input_ids: ``int64 [B, T]``.
            image_rows: ``[B * image_tokens, d_model]``: the encoder's rows for each sequence's media, in order;
                or one such tensor per media kind (in :attr:`kinds` order).
        """
        b = input_ids.shape[0]
        p = self.image_tokens
        x = self.embed(input_ids[:, p:] % self.cfg.vocab)
        parts = [image_rows] if isinstance(image_rows, torch.Tensor) else list(image_rows)
        x = torch.cat([r.reshape(b, -1, r.shape[-1]).to(x.dtype) for r in parts] + [x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        start = self.prompt_tokens - 1
        logits = self.head(self.norm(x[:, start:-1]))
        target = input_ids[:, start + 1:] % self.cfg.vocab
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _patchify_fn(cfg: VLMConfig, w: TransferWorkload) -> Callable[[torch.Tensor], torch.Tensor]:
    from knitdata.media.process import patchify

    return patchify(cfg.patch, size=(w.item_shape[1], w.item_shape[2]))


class _AudioRows:
    """Audio preprocessing of the omni workload: mono samples cut into rows of ``hop`` samples (a picklable
    callable ``fn(samples [frames, channels], sample_rate)``)."""

    def __init__(self, rows: int, hop: int, rate: int):
        self.rows, self.hop, self.rate = rows, hop, rate

    def __call__(self, samples: torch.Tensor, sample_rate: int) -> torch.Tensor:
        if sample_rate != self.rate:
            raise ConfigError(f"audio clip at {sample_rate} Hz; the workload's encoder expects {self.rate} Hz")
        x = samples[:, 0] if samples.dim() == 2 else samples
        n = self.rows * self.hop
        if x.numel() < n:
            raise ConfigError(f"audio clip of {x.numel()} samples is shorter than {self.rows} rows of {self.hop}")
        return x[:n].reshape(self.rows, self.hop).contiguous()


class _VideoPatches:
    """Video preprocessing of the omni workload with containers: the decoded frames' patches, frame after frame
    (a picklable callable ``fn(frames uint8 [T, C, H, W], fps)``)."""

    #: With ``out`` (the collator's table, see :meth:`knitdata.media.process.MediaProcessor.process`) the frames' patches
    #: are written there directly (frame 0 through one temporary), not patched, concatenated and copied again.
    accepts_out = True

    def __init__(self, patchify: Callable[..., torch.Tensor], frames: int):
        self.patchify, self.frames = patchify, frames

    def __call__(self, frames: torch.Tensor, fps: float, *,
                 out: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
        if frames.shape[0] != self.frames:
            raise ConfigError(f"video sampled to {frames.shape[0]} frames; the workload's encoder expects {self.frames}")
        if out is None or not getattr(self.patchify, "accepts_out", False):
            return torch.cat([self.patchify(f) for f in frames])
        first = self.patchify(frames[0])
        n = first.shape[0]
        dest = out((n * frames.shape[0], *first.shape[1:]), first.dtype)
        dest[:n].copy_(first)
        for i in range(1, frames.shape[0]):
            rows = dest[i * n : (i + 1) * n]
            got = self.patchify(frames[i], out=lambda shape, dtype, rows=rows: rows if tuple(shape) == tuple(rows.shape)
                                and dtype == rows.dtype else torch.empty(shape, dtype=dtype))
            if got.data_ptr() != rows.data_ptr():  # another patch count than frame 0's: not one packed row block
                return torch.cat([self.patchify(f) for f in frames])
        return dest


def preprocess(w: TransferWorkload, cfg: VLMConfig) -> dict[str, Callable[..., torch.Tensor]]:
    """Per media kind, the model's preprocessing (knitdata's MediaProcessor convention)."""
    out: dict[str, Callable[..., torch.Tensor]] = {"image": _patchify_fn(cfg, w)}
    if w.video_container:
        out["video"] = _VideoPatches(out.pop("image"), w.video_frames)
    if w.workload == "omni":
        out["audio"] = _AudioRows(w.audio_rows, w.audio_hop, w.audio_rate)
    return out


def count_step_flops(cfg: VLMConfig, w: TransferWorkload) -> dict[str, float]:
    """FLOPs (forward + backward) of one consumer's step, counted on the meta device.

    Returns:
        ``backbone_microbatch``, ``encoder_image``, ``step_dup`` (every copy encoded),
        ``step_shared`` (each of the consumer's unique images encoded once), ``unique_images_per_step``,
        ``params``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    need = media_tokens(cfg, w)
    if need > w.prompt_tokens:  # a bigger model's media need more positions: count it at its own length
        w = dataclasses.replace(w, prompt_tokens=need + 64)
    with torch.device("meta"):
        model = TinyVLM(cfg, w)
    params = sum(p.numel() for p in model.parameters())
    c, h, wd = w.item_shape
    n_patch = (h // cfg.patch) * (wd // cfg.patch)
    feat = c * cfg.patch * cfg.patch
    b = w.microbatch_size

    def measure(fn: Callable[[], torch.Tensor]) -> float:
        with FlopCounterMode(display=False) as fc:
            fn().backward()
        return float(fc.get_total_flops())

    def enc_one() -> torch.Tensor:
        vals = torch.zeros(n_patch, feat, device="meta")
        return model.encoder(vals, torch.tensor([0, n_patch])).float().sum()

    def backbone() -> torch.Tensor:
        ids = torch.zeros(b, w.tokens, dtype=torch.long, device="meta")
        rows = torch.zeros(b * model.image_tokens, cfg.d_model, device="meta", requires_grad=True)
        return model.backbone_loss(ids, rows)

    def audio_one() -> torch.Tensor:
        assert model.audio_encoder is not None
        vals = torch.zeros(w.audio_rows, w.audio_hop, device="meta")
        return model.audio_encoder(vals, torch.tensor([0, w.audio_rows])).float().sum()

    enc = measure(enc_one)
    enc_audio = measure(audio_one) if model.audio_encoder is not None else 0.0
    per_traj = w.image_items * enc + enc_audio
    bb = measure(backbone)
    k = w.microbatches_per_step
    unique = w.per_consumer_step // w.group_size
    return {
        "backbone_microbatch": bb,
        "encoder_image": enc,
        "encoder_audio": enc_audio,
        "encoder_trajectory": per_traj,
        "step_dup": k * (bb + b * per_traj),
        "step_shared": k * bb + unique * per_traj,
        "unique_images_per_step": float(unique),
        "params": float(params),
        "prompt_tokens_counted": float(w.prompt_tokens),
    }


# ------------------------------------------------------------------ the encode benchmark's models
class TransformerPatchEncoder(nn.Module):
    """Patch embedding and a few transformer layers over each image's patches (images independent).

    Takes packed patches ``[U * P, C * p * p]`` with offsets (all images have ``P`` patches) and returns one
    row per patch ``[U * P, enc_dim]``.
    """

    def __init__(self, patch_dim: int, dim: int, layers: int, out_dim: int):
        super().__init__()
        self.embed = nn.Linear(patch_dim, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.proj = nn.Linear(dim, out_dim)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        u = offsets.numel() - 1
        x = self.embed(values).reshape(u, -1, self.embed.out_features)
        return self.proj(self.blocks(x)).reshape(-1, self.proj.out_features)


class TransformerBackbone(nn.Module):
    """A small transformer over ``[image rows, text tokens]`` per trajectory with a token loss."""

    def __init__(self, dim: int, layers: int, vocab: int = 256):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        b = ids.shape[0]
        x = torch.cat([rows.reshape(b, -1, rows.shape[-1]), self.emb(ids)], 1)
        logits = self.head(self.blocks(x)[:, -ids.shape[1] :])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


# ------------------------------------------------------------------ the demo's models
class MlpPatchEncoder(nn.Module):
    """A per-patch MLP: items are independent inside it, so shared encoding is exact."""

    def __init__(self, patch_dim: int, dim: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(patch_dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Encode packed patch rows ``[N, patch_dim]`` (``offsets`` unused: rows are independent)."""
        return self.net(values)


class MlpVLM(nn.Module):
    """Token embedding plus the mean image feature of the sequence, residual MLP blocks, a vocabulary head."""

    def __init__(self, vocab: int, dim: int, layers: int = 2, hidden: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, image_feat: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` from token ids ``[B, T]`` and one image feature per sequence ``[B, dim]``."""
        h = self.embed(input_ids) + image_feat[:, None, :]
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)
