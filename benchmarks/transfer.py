"""Transfer benchmark: exposed transfer latency and step time, transferqueue vs knitdata sample/eager/iter.

One fixed multimodal RL workload (the seed's Figures 8 and 11a-c): groups of ``n = 8`` trajectories of 2,048
tokens that share one ``3x448x448`` uint8 image per group, 4 consumer processes, micro-batches of 4
trajectories, 4 micro-batches per step, one torch thread per process, warm-up steps excluded, start-up
excluded. ``--workload omni`` gives each group a short video (frames as image items; 4 frames at 224 px by
default on this 2-core machine; the seed's 16 at 448 px with ``--omni-seed-size``, which also defaults to 1 + 4
steps and each mode alone) and a 30 s 16 kHz audio clip stored as FLAC bytes and decoded with soundfile; the model
gets an audio encoder. It is delivered by

* ``transferqueue`` -- the real ``transferqueue`` package as verl drives it (controller + SimpleStorage units as
  Ray actors, started once per run on loopback only; one partition per consumer rank; the trainer calls
  ``get_meta``/``get_data`` synchronously per micro-batch),
* ``transferqueue_best`` -- transferqueue at its best, the better (lower exposed latency, per encoding) of
  (a) ``async``: its ``AsyncTransferQueueClient`` in a background thread fetching and processing two
  micro-batches ahead, and (b) ``loader``: its own ``StreamingDataset`` + ``StreamingDataLoader`` (worker
  processes, ``prefetch_factor``) as its documentation recommends; both sub-figures are kept,
* ``sample`` / ``eager`` / ``iter`` -- knitdata's fetch modes with consumers as separate processes: the Ray
  engine (:mod:`knitdata.engines.ray`); with ``shared`` encoding the rank's
  :class:`~knitdata.dataset.TrajectoryDataset` takes a ``media_collator``,
* ``iter_embedded`` -- ``iter`` on the embedded engine (consumers are threads of one process), a reference.

The process-mode sources are prepared first, then run interleaved step by step in the same 4 consumer
processes (step ``s`` of every source, then step ``s + 1``), so the drifting load of a shared machine hits
them alike. Since prefetching sources work ahead while the others' steps run, each process mode then runs
alone in the same processes as a control (``controls``); ``iter_embedded`` runs afterwards in the driver.

Every consumer trains a tiny vision-language model (a patch-MLP vision encoder, an audio encoder for omni, and an
MLP backbone) on each micro-batch (``--compute cpu``), or waits exactly what that training costs alone on this
machine (``--compute accel``, the default: each consumer's compute is a sleep of its cost calibrated before the run,
per micro-batch and encoding, so the host CPU is free during compute as on a GPU node, while fetch, decode, collate
and every data call stay real; see :data:`COMPUTE_MEASURES`), with the media encoded per copy (``dup``: what verl
and slime do) or once per mini-batch with :class:`~knitdata.encoder.SharedEncoding` (``shared``; on transferqueue
too, so the 2x2 table ``end_to_end`` separates transfer and encoding effects). Exposed latency: per step, the wall
time of every data call of the trainer -- ``next()`` for every system, plus knitdata's ``state_dict()`` and
``commit()`` after the optimizer step -- median over the measured steps, broken down by call: ``next()`` waiting for
data (``wait_ms``), ``next()``'s own work (``own_ms``), ``state_dict()`` and ``commit()``. The GPU projection
(``gpu_projection``, labelled ``projected`` with its assumptions) replaces this CPU's compute time with the FLOPs of
a 7B-class model at a stated rate and keeps the transfer times measured here; ``--gpu`` measures knitdata's modes on
CUDA instead.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/transfer.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import dataclasses
import functools
import json
import math
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from knitdata.errors import ConfigError, EngineError, KnitdataError
from knitdata.record import MediaItem, Trajectory

__all__ = [
    "main",
    "stem_of",
    "MODES",
    "COMPUTE_MODES",
    "COMPUTE_MEASURES",
    "TQ_BEST_VARIANTS",
    "WORKLOADS",
    "ENCODINGS",
    "omni_workload",
    "media_tokens",
    "make_audio_flac",
    "OMNI_VLM",
    "OMNI_SMOKE_VLM",
    "GpuPreset",
    "GPU_PRESET_VLM",
    "gpu_config",
    "require_cuda",
    "run_gpu_benchmark",
    "TransferWorkload",
    "VLMConfig",
    "TINY_VLM",
    "GPU_VLM",
    "SMOKE_VLM",
    "TinyVLM",
    "LoopbackError",
    "make_group",
    "make_step_groups",
    "count_step_flops",
    "ConsumerStepRecord",
    "ACCEPTANCE",
    "RATIO_MEANING",
    "calibrate_compute",
    "compute_summary",
    "summarize_mode",
    "run_transfer_benchmark",
    "format_table",
    "plot_result",
    "add_arguments",
    "run",
]

#: Delivery modes, in the order they run.
MODES: tuple[str, ...] = ("transferqueue", "transferqueue_best", "sample", "eager", "iter", "iter_embedded")
#: The ways ``transferqueue_best`` drives transferqueue; the better one (lower exposed latency) is reported.
TQ_BEST_VARIANTS: tuple[str, ...] = ("async", "loader")
#: Workloads: one image per group, or a short video (frames) and a 30 s audio clip per group (``omni``).
WORKLOADS: tuple[str, ...] = ("image", "omni")
#: Encodings: every copy of an image encoded (``dup``) or each unique image once per mini-batch (``shared``).
ENCODINGS: tuple[str, ...] = ("dup", "shared")
#: The seed's headline end-to-end speedup (transfer plus training over the baseline).
SEED_SPEEDUP = 5.8
#: How each consumer's training compute runs: ``accel`` (a sleep of its calibrated cost) or ``cpu`` (real, on the
#: CPU).
COMPUTE_MODES: tuple[str, ...] = ("accel", "cpu")
#: What a run measures in each compute mode (stated in the JSON as ``compute_measures``).
COMPUTE_MEASURES: dict[str, str] = {
    "accel": (
        "the data path, with the host CPU free during compute as on a GPU node: each consumer's training compute "
        "is replaced by a sleep of exactly what that compute costs alone on this machine (calibrated before the "
        "run with one torch thread, per micro-batch and encoding), while fetch, decode, collate and every data "
        "call of the trainer stay real; exposed latency is what the data system costs the trainer's thread when "
        "it does not compete with compute for the CPU, and step time is that compute plus what is not hidden"),
    "cpu": (
        "the data path and the training compute together on this machine's CPU: each consumer trains the tiny "
        "model with one torch thread beside the data path's own threads, Ray actors and transferqueue's servers, "
        "so with 4 consumer processes on 2 cores it mostly measures CPU contention (prefetching moves work onto "
        "the cores the compute needs; the same model's compute per step varies between modes of one run)"),
}
#: The seed's omni setting (``--omni-seed-size``): video frames and their side in px (the audio clip is 30 s at
#: 16 kHz by default).
SEED_OMNI_FRAMES, SEED_OMNI_PX = 16, 448
#: Default effective GPU rate for the projection (bf16, dense, per GPU).
DEFAULT_GPU_TFLOPS = 400.0


class LoopbackError(KnitdataError, RuntimeError):
    """A server of the benchmark listens on an address other than loopback; the benchmark refuses to run."""


# ---------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class TransferWorkload:
    """The fixed multimodal RL workload.

    Attributes:
        group_size: Trajectories per group (GRPO ``n``); they share one image.
        prompt_tokens: Prompt tokens per trajectory (the image's tokens replace the first of them).
        response_tokens: Response tokens per trajectory (the loss is on these).
        image_shape: ``(C, H, W)`` of the uint8 image of each group.
        num_consumers: Consumer processes (ranks).
        microbatch_size: Trajectories per micro-batch.
        microbatches_per_step: Micro-batches per consumer per step (one optimizer step).
        warmup_steps: Steps run before measuring.
        steps: Measured steps.
        vocab: Token id range.
        seed: Seed of the data and the model.
        workload: ``"image"`` (one ``image_shape`` image per group) or ``"omni"`` (per group a video of
            ``video_frames`` frames of ``3 x frame_px x frame_px`` uint8 pixels, each frame an image item, and an
            audio clip of ``audio_seconds`` at ``audio_rate`` Hz stored as FLAC bytes and decoded with soundfile).
        video_frames: Frames per video (omni).
        frame_px: Frame side in pixels (omni).
        audio_seconds: Audio clip length in seconds (omni).
        audio_rate: Audio sample rate in Hz (omni).
        audio_hop: Audio samples per encoder input row (omni; 800 = 50 ms at 16 kHz).
    """

    group_size: int = 8
    prompt_tokens: int = 512
    response_tokens: int = 1536
    image_shape: tuple[int, int, int] = (3, 448, 448)
    num_consumers: int = 4
    microbatch_size: int = 4
    microbatches_per_step: int = 4
    warmup_steps: int = 3
    steps: int = 10
    vocab: int = 512
    seed: int = 0
    workload: str = "image"
    video_frames: int = 4
    frame_px: int = 224
    audio_seconds: float = 30.0
    audio_rate: int = 16000
    audio_hop: int = 800

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ConfigError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.workload == "omni":
            for name in ("video_frames", "frame_px", "audio_rate", "audio_hop"):
                if int(getattr(self, name)) <= 0:
                    raise ConfigError(f"omni workload: {name} must be positive, got {getattr(self, name)}")
            if self.audio_rows <= 0:
                raise ConfigError(f"omni workload: {self.audio_seconds} s at {self.audio_rate} Hz is shorter than one "
                                  f"audio row of {self.audio_hop} samples")
        for name in ("group_size", "response_tokens", "num_consumers", "microbatch_size", "microbatches_per_step",
                     "steps", "vocab"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.prompt_tokens < 0:
            raise ConfigError("warmup_steps and prompt_tokens must be >= 0")
        if self.trajectories_per_step % self.group_size:
            raise ConfigError(
                f"a step holds {self.trajectories_per_step} trajectories, not a multiple of group_size "
                f"{self.group_size}: change microbatch_size, microbatches_per_step or num_consumers"
            )
        if self.per_consumer_step % self.group_size:
            raise ConfigError(
                f"each consumer's share of a step ({self.per_consumer_step}) must hold whole groups of "
                f"{self.group_size}"
            )

    @property
    def tokens(self) -> int:
        """Tokens per trajectory."""
        return self.prompt_tokens + self.response_tokens

    @property
    def per_consumer_step(self) -> int:
        """Trajectories per consumer per step."""
        return self.microbatch_size * self.microbatches_per_step

    @property
    def trajectories_per_step(self) -> int:
        """Trajectories per step over all consumers (the mini-batch)."""
        return self.per_consumer_step * self.num_consumers

    @property
    def groups_per_step(self) -> int:
        """Groups per step."""
        return self.trajectories_per_step // self.group_size

    @property
    def total_steps(self) -> int:
        """Warm-up plus measured steps."""
        return self.warmup_steps + self.steps

    @property
    def image_bytes(self) -> int:
        """Bytes of one image."""
        c, h, w = self.image_shape
        return c * h * w

    @property
    def media_kinds(self) -> tuple[str, ...]:
        """Media kinds of a trajectory (each has its own encoder)."""
        return ("image", "audio") if self.workload == "omni" else ("image",)

    @property
    def image_items(self) -> int:
        """Image items per trajectory (the image, or the video's frames)."""
        return self.video_frames if self.workload == "omni" else 1

    @property
    def item_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image item (an image or a video frame)."""
        return (3, self.frame_px, self.frame_px) if self.workload == "omni" else tuple(self.image_shape)  # type: ignore[return-value]

    @property
    def audio_samples(self) -> int:
        """Samples of one audio clip (omni)."""
        return int(round(self.audio_seconds * self.audio_rate))

    @property
    def audio_rows(self) -> int:
        """Audio encoder input rows of one clip (omni; the tail shorter than a row is dropped)."""
        return self.audio_samples // self.audio_hop if self.workload == "omni" else 0

    @property
    def media_bytes(self) -> int:
        """Upper bound of the media bytes of one trajectory (FLAC at most 16-bit PCM plus headers)."""
        c, h, w = self.item_shape
        audio = self.audio_samples * 2 + 65536 if self.workload == "omni" else 0
        return self.image_items * c * h * w + audio

    @property
    def trajectory_bytes(self) -> int:
        """Payload bytes of one trajectory with its own copy of the media (int64 tokens; audio bound)."""
        return self.tokens * 8 + self.media_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable fields plus the derived sizes."""
        d = dataclasses.asdict(self)
        d["image_shape"] = list(self.image_shape)
        d.update(tokens=self.tokens, trajectories_per_step=self.trajectories_per_step,
                 groups_per_step=self.groups_per_step, trajectory_bytes=self.trajectory_bytes,
                 media_kinds=list(self.media_kinds), image_items=self.image_items, item_shape=list(self.item_shape),
                 audio_rows=self.audio_rows)
        return d


def omni_workload(frames: int = 4, frame_px: int = 224, *, prompt_tokens: int | None = None,
                  cfg: VLMConfig | None = None, **kw: Any) -> TransferWorkload:
    """The omni workload: per group a ``frames``-frame video at ``frame_px`` px and a 30 s 16 kHz audio clip.

    The default (4 frames at 224 px) fits the 2-core CPU machine; ``frames=16, frame_px=448`` is the seed's
    setting. ``prompt_tokens`` defaults to the media tokens of ``cfg`` (default :data:`OMNI_VLM`) plus 64, at
    least 512.
    """
    w = TransferWorkload(workload="omni", video_frames=frames, frame_px=frame_px, **kw)
    if prompt_tokens is None:
        c = cfg or OMNI_VLM
        need = media_tokens(c, w) + 64
        prompt_tokens = max(512, need)
    return dataclasses.replace(w, prompt_tokens=prompt_tokens)


def _group_id(step: int, g: int) -> str:
    return f"s{step:05d}g{g:03d}"


def make_audio_flac(w: TransferWorkload, seed: int) -> bytes:
    """A deterministic mono clip of ``w.audio_seconds`` at ``w.audio_rate`` Hz (tones plus noise), as FLAC bytes
    written by soundfile."""
    import io

    import numpy as np
    import soundfile as sf

    rng = np.random.default_rng(seed)
    n = w.audio_samples
    t = np.arange(n, dtype=np.float32) / w.audio_rate
    f = rng.uniform(110.0, 880.0, size=3).astype(np.float32)
    x = sum(np.sin(2 * np.pi * fi * t) for fi in f) / 4 + rng.normal(0.0, 0.05, size=n).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, np.clip(x, -1.0, 1.0).astype(np.float32), w.audio_rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def _group_media(w: TransferWorkload, step: int, g: int, gen: torch.Generator) -> list[MediaItem]:
    """The media items every member of group ``g`` of ``step`` carries (one shared list of items)."""
    if w.workload == "image":
        return [MediaItem("image", tensor=torch.randint(0, 256, w.image_shape, dtype=torch.uint8, generator=gen))]
    frames = torch.randint(0, 256, (w.video_frames, *w.item_shape), dtype=torch.uint8, generator=gen)
    items = [MediaItem("image", tensor=frames[i]) for i in range(w.video_frames)]
    data = make_audio_flac(w, w.seed * 1_000_003 + step * 1009 + g)
    items.append(MediaItem("audio", data=data, sample_rate=w.audio_rate))
    return items


def make_group(w: TransferWorkload, step: int, g: int) -> list[Trajectory]:
    """The ``g``-th group of step ``step``: ``group_size`` trajectories sharing one set of media (deterministic).

    The members hold the very same media items (one object each: the image, or the video frames and the
    FLAC-encoded audio clip), as a rollout engine repeating a prompt does.
    """
    gid = _group_id(step, g)
    gen = torch.Generator().manual_seed(w.seed * 1_000_003 + step * 1009 + g)
    media = _group_media(w, step, g, gen)
    prompt = torch.randint(0, w.vocab, (w.prompt_tokens,), dtype=torch.int64, generator=gen)
    out = []
    for j in range(w.group_size):
        resp = torch.randint(0, w.vocab, (w.response_tokens,), dtype=torch.int64, generator=gen)
        out.append(
            Trajectory(
                id=f"{gid}t{j}",
                source="mm",
                group=gid,
                prompt_ids=prompt,
                response_ids=resp,
                gen_version=step,
                scalars={"advantage": float(j - w.group_size / 2) / w.group_size},
                media=list(media),
            )
        )
    return out


def make_step_groups(w: TransferWorkload, step: int) -> list[list[Trajectory]]:
    """All groups of one step."""
    return [make_group(w, step, g) for g in range(w.groups_per_step)]


# ---------------------------------------------------------------------------------------------- model
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

    Called as ``encoder(values, offsets)`` (the :class:`~knitdata.encoder.SharedEncoding` convention):
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
        out: dict[str, nn.Module] = {"image": self.encoder}
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
    from knitdata.media import patchify

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


def _preprocess(w: TransferWorkload, cfg: VLMConfig) -> dict[str, Callable[..., torch.Tensor]]:
    """Per media kind, the model's preprocessing (knitdata's MediaProcessor convention)."""
    out: dict[str, Callable[..., torch.Tensor]] = {"image": _patchify_fn(cfg, w)}
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


# ---------------------------------------------------------------------------------------------- consumer side
@dataclass
class _Item:
    """One delivered micro-batch, as the training loop sees it."""

    ids: tuple[str, ...]
    input_ids: torch.Tensor
    inputs: dict[str, torch.Tensor] | None  # dup: per kind, every trajectory's own encoder inputs (copies included)
    media: Any  # shared: the MultimodalBatch of the consumer's share of the mini-batch
    index: int
    num_microbatches: int
    is_last: bool
    nbytes: int
    moved: int = 0  # payload bytes this fetch moved out of storage, when the source knows it


@dataclass
class ConsumerStepRecord:
    """What one consumer measured in one step (JSON-serializable via ``dataclasses.asdict``).

    Attributes:
        step: Step index (warm-up steps first).
        exposed_s: Wall time inside ``next()`` summed over the step's micro-batches (no H2D wait on CPU).
        compute_s: Wall time of encoding, forward, backward and the optimizer step.
        step_s: Wall time from the step's start (all consumers released together) to its optimizer step.
        microbatches: Micro-batches of the step.
        bytes: Bytes of the tensors handed to the trainer (the media table once per step in ``shared``).
        moved: Payload bytes moved out of storage for the step, when the source reports it per item.
        ids: Trajectory ids delivered in the step.
        waits: Seconds inside ``next()`` per micro-batch.
        commit_s: Seconds of the step's other data calls after the optimizer step (knitdata: ``state_dict()``
            and ``commit()``); included in ``exposed_s``.
        data_wait_s: Seconds of the step's ``next()`` calls spent blocked waiting for a micro-batch to be ready
            (``None`` when the source does not say); the rest of ``next()`` is the data system's own work.
        state_dict_s: Seconds inside ``state_dict()`` after the optimizer step (part of ``commit_s``).
        commit_call_s: Seconds inside ``commit()`` after the optimizer step (part of ``commit_s``).
    """

    step: int
    exposed_s: float
    compute_s: float
    step_s: float
    microbatches: int
    bytes: int
    moved: int
    ids: list[str]
    waits: list[float]
    commit_s: float = 0.0
    data_wait_s: float | None = None
    state_dict_s: float = 0.0
    commit_call_s: float = 0.0


def _tq_patience() -> None:
    """Give transferqueue's client handshakes more patience than its default 3 tries a second apart: on a loaded
    2-core machine a fresh client (a streaming-loader worker) otherwise fails to reach the controller. Read by
    transferqueue when imported; inherited by spawned processes."""
    os.environ.setdefault("TQ_STORAGE_HANDSHAKE_MAX_RETRIES", "60")
    os.environ.setdefault("TQ_STORAGE_HANDSHAKE_TIMEOUT", "120")


def _pin_threads() -> None:
    _tq_patience()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["TQ_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


class _Trainer:
    """The tiny VLM of one consumer and its optimizer; ``dup`` or ``shared`` encoding."""

    def __init__(self, w: TransferWorkload, cfg: VLMConfig, encoding: str, device: str = "cpu"):
        if encoding not in ENCODINGS:
            raise ConfigError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        torch.manual_seed(w.seed)
        self.w = w
        self.device = torch.device(device)
        self.model = TinyVLM(cfg, w).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.encoding = encoding
        c, h, wd = w.item_shape
        n_patch = (h // cfg.patch) * (wd // cfg.patch)
        # per kind: (encoder input rows per item, items per trajectory)
        self.layout = {"image": (n_patch, w.image_items), "audio": (w.audio_rows, 1)}
        self.kinds = self.model.kinds
        self.shared = None
        if encoding == "shared":
            from knitdata.encoder import SharedEncoding

            merge = {"image": cfg.merge, "audio": cfg.audio_merge}
            out_rows = None
            if any(merge[k] != 1 for k in self.kinds):
                def out_rows(table: Any) -> torch.Tensor:
                    return table.lengths // merge[table.kind]
            encs = self.model.encoders()
            self.shared = SharedEncoding(encs if len(encs) > 1 else encs["image"], dummy=False, out_rows=out_rows)
        self._ctx: Any = None

    def microbatch(self, item: _Item) -> None:
        """Encode, forward and backward one micro-batch (loss scaled by 1/K)."""
        scale = 1.0 / item.num_microbatches
        if item.input_ids.numel() == 0:
            return
        dev = self.device
        ids = item.input_ids.to(dev, non_blocking=True)
        if self.encoding == "dup":
            assert item.inputs is not None
            b = ids.shape[0]
            encs = self.model.encoders()
            rows = []
            for kind in self.kinds:
                per_item, n = self.layout[kind]
                offsets = torch.arange(b * n + 1, dtype=torch.long) * per_item
                rows.append(encs[kind](item.inputs[kind].to(dev, non_blocking=True), offsets))
            (self.model.backbone_loss(ids, rows) * scale).backward()
            return
        assert self.shared is not None
        if item.index == 0 or self._ctx is None:
            media = item.media if dev.type == "cpu" else item.media.to(dev, non_blocking=True)
            self._ctx = self.shared.minibatch(media)
            self._ctx.__enter__()
        multi = len(self.kinds) > 1
        rows = [self._ctx.rows(item.index, k) if multi else self._ctx.rows(item.index) for k in self.kinds]
        self._ctx.backward(self.model.backbone_loss(ids, rows) * scale)
        if item.is_last:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def optimizer_step(self) -> None:
        """Step the optimizer and clear the gradients (on CUDA: and wait for the step's kernels)."""
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _AccelTrainer:
    """``--compute accel``: each micro-batch's compute and the optimizer step are a sleep of their calibrated cost
    (see :func:`calibrate_compute`); the host CPU is free meanwhile, as on a GPU node."""

    def __init__(self, encoding: str, calibration: Mapping[str, Any]):
        if encoding not in calibration:
            raise ConfigError(f"no compute calibration for encoding {encoding!r} (have {sorted(calibration)})")
        c = calibration[encoding]
        self.encoding = encoding
        self.microbatch_s = [float(x) for x in c["microbatch_s"]]
        self.optimizer_step_s = float(c["optimizer_step_s"])
        if not self.microbatch_s:
            raise ConfigError(f"compute calibration of encoding {encoding!r} has no micro-batch")

    def microbatch(self, item: _Item) -> None:
        """Wait what this micro-batch's encode, forward and backward cost alone (an empty one costs nothing)."""
        if item.input_ids.numel() == 0:
            return
        time.sleep(self.microbatch_s[min(item.index, len(self.microbatch_s) - 1)])

    def optimizer_step(self) -> None:
        """Wait what the optimizer step costs alone."""
        time.sleep(self.optimizer_step_s)


def _make_trainer(w: TransferWorkload, cfg: VLMConfig, encoding: str, compute: str = "cpu",
                  calibration: Mapping[str, Any] | None = None, device: str = "cpu") -> Any:
    """The consumer's trainer: the tiny VLM (``cpu``) or its calibrated wait (``accel``)."""
    if compute == "cpu":
        return _Trainer(w, cfg, encoding, device)
    if compute == "accel":
        if calibration is None:
            raise ConfigError("compute 'accel' needs a calibration (calibrate_compute)")
        return _AccelTrainer(encoding, calibration)
    raise ConfigError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")


def _calibration_items(w: TransferWorkload, cfg: VLMConfig, encoding: str) -> list[_Item]:
    """One consumer's micro-batches of step 0 (rank 0's share), collated as knitdata's dataset collates them."""
    groups = w.per_consumer_step // w.group_size
    trajs = [t for g in range(groups) for t in make_group(w, 0, g)]
    kw = _dataset_kwargs(w, cfg, encoding)
    k, b = w.microbatches_per_step, w.microbatch_size
    mbs = [trajs[i * b:(i + 1) * b] for i in range(k)]
    media = kw["media_collator"](mbs) if "media_collator" in kw else None
    items = []
    for i, mb in enumerate(mbs):
        m = kw["collate"](mb)
        inputs = {kd: m.tensors[f"{kd}_inputs"] for kd in w.media_kinds} if encoding == "dup" else None
        items.append(_Item(tuple(t.id for t in mb), m.input_ids, inputs, media, i, k, i == k - 1, 0))
    return items


def calibrate_compute(w: TransferWorkload, cfg: VLMConfig, encodings: Sequence[str] = ENCODINGS, *,
                      reps: int = 3, warmup: int = 1) -> dict[str, Any]:
    """Time one consumer's training compute alone in this process (one torch thread), for ``--compute accel``.

    Runs the tiny VLM of :class:`_Trainer` on one consumer's micro-batches of step 0 (collated as knitdata's
    dataset collates them; the collation is not timed): ``warmup`` untimed steps, then ``reps`` timed ones.
    Every micro-batch of the workload has the same shape (``microbatch_size`` trajectories of ``tokens`` tokens
    and their media), but with ``shared`` encoding micro-batch 0 also encodes the step's unique media and the
    last one runs the encoder's backward, so the cost is kept per micro-batch index: the median over the timed
    steps of every micro-batch doing the same work (``classes``: with ``dup`` all of them; with ``shared`` the
    first, the middle ones, the last).

    Args:
        w: The workload.
        cfg: The model the consumers would train.
        encodings: Encodings to calibrate (subset of :data:`ENCODINGS`).
        reps: Timed steps per encoding (medians are kept).
        warmup: Untimed steps first.

    Returns:
        Per encoding ``{"microbatch_s": [median per micro-batch index], "optimizer_step_s", "step_s" (their
        sum), "classes": [work class per index], "samples": {...}}``, plus ``reps``, ``warmup``,
        ``torch_threads``, ``shape``, ``model`` and the load average before and after (``loadavg_before`` /
        ``loadavg_after``).

    Raises:
        ConfigError: Unknown encoding, or ``reps < 1``.
    """
    bad = [e for e in encodings if e not in ENCODINGS]
    if bad or not encodings:
        raise ConfigError(f"encodings must be a non-empty subset of {ENCODINGS}, got {list(encodings)}")
    if reps < 1 or warmup < 0:
        raise ConfigError(f"calibration needs reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"reps": reps, "warmup": warmup, "torch_threads": 1,
                           "shape": {"microbatches": w.microbatches_per_step, "trajectories": w.microbatch_size,
                                     "tokens": w.tokens, "media_kinds": list(w.media_kinds),
                                     "image_items": w.image_items, "item_shape": list(w.item_shape),
                                     "audio_rows": w.audio_rows},
                           "model": cfg.name}
    try:
        out["loadavg_before"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        for enc in encodings:
            items = _calibration_items(w, cfg, enc)
            tr = _Trainer(w, cfg, enc)
            per: list[list[float]] = [[] for _ in items]
            opt: list[float] = []
            for r in range(warmup + reps):
                times = []
                for item in items:
                    t0 = time.perf_counter()
                    tr.microbatch(item)
                    times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                tr.optimizer_step()
                o = time.perf_counter() - t0
                if r >= warmup:
                    for i, x in enumerate(times):
                        per[i].append(x)
                    opt.append(o)
            classes = _work_classes(enc, len(items))
            pooled = {c: [x for i, v in enumerate(per) if classes[i] == c for x in v] for c in set(classes)}
            mb = [float(statistics.median(pooled[c])) for c in classes]
            o_s = float(statistics.median(opt))
            out[enc] = {"microbatch_s": mb, "optimizer_step_s": o_s, "step_s": sum(mb) + o_s, "classes": classes,
                        "samples": {"microbatch_s": per, "optimizer_step_s": opt}}
    finally:
        torch.set_num_threads(threads)
    try:
        out["loadavg_after"] = list(os.getloadavg())
    except OSError:
        pass
    return out


def _work_classes(encoding: str, k: int) -> list[str]:
    """Which micro-batches of a step do the same compute: all of them with ``dup``; with ``shared`` the first
    (it also encodes the unique media), the middle ones, the last (it also runs the encoder's backward)."""
    if encoding == "dup":
        return ["microbatch"] * k
    if k == 1:
        return ["only"]
    return ["first"] + ["middle"] * (k - 2) + ["last"]


@dataclass
class _Source:
    """One delivery source as the training loop drives it.

    ``next_item()`` returns the micro-batch, the seconds inside the system's ``next()`` and, when the source
    knows it, the part of them spent blocked waiting for the micro-batch to be ready (``None`` otherwise:
    ``wait_probe`` then gives the cumulative waiting seconds, read before and after each step).
    ``state_call()`` / ``commit_call(state)`` are the trainer's data calls after the optimizer step.
    """

    name: str
    trainer: Any
    next_item: Callable[[], tuple[_Item, float, float | None]]
    state_call: Callable[[], Any] | None = None
    commit_call: Callable[[Any], Any] | None = None
    wait_probe: Callable[[], float] | None = None


def _run_step(step: int, src: _Source) -> ConsumerStepRecord:
    """One optimizer step of one consumer: micro-batches until ``is_last``, then the optimizer step, then the
    data calls after it (``state_dict()`` and ``commit()``), each timed on the trainer's thread.

    Exposed latency: the seconds inside ``next()`` plus those of the calls after the optimizer step.
    """
    w0 = src.wait_probe() if src.wait_probe is not None else None
    trainer = src.trainer
    t0 = time.perf_counter()
    exposed = compute = 0.0
    ids: list[str] = []
    waits: list[float] = []
    nbytes = moved = n = 0
    reported = 0.0
    all_reported = True
    while True:
        item, next_s, wait_s = src.next_item()
        exposed += next_s
        waits.append(next_s)
        if wait_s is None:
            all_reported = False
        else:
            reported += wait_s
        t1 = time.perf_counter()
        trainer.microbatch(item)
        compute += time.perf_counter() - t1
        ids.extend(item.ids)
        nbytes += item.nbytes
        moved += item.moved
        n += 1
        if item.is_last:
            break
    t1 = time.perf_counter()
    trainer.optimizer_step()
    t2 = time.perf_counter()
    compute += t2 - t1
    state = src.state_call() if src.state_call is not None else None
    t3 = time.perf_counter()
    if src.commit_call is not None:
        src.commit_call(state)
    t4 = time.perf_counter()
    exposed += t4 - t2
    data_wait: float | None = None
    if all_reported:
        data_wait = reported
    elif w0 is not None and src.wait_probe is not None:
        data_wait = max(0.0, src.wait_probe() - w0)
    return ConsumerStepRecord(step, exposed, compute, t4 - t0, n, nbytes, moved, ids, waits, t4 - t2,
                              data_wait_s=data_wait, state_dict_s=t3 - t2, commit_call_s=t4 - t3)


def _consume(
    w: TransferWorkload,
    src: _Source,
    barrier_wait: Callable[[], object],
    on_step: Callable[[int], None] | None = None,
) -> list[ConsumerStepRecord]:
    """The training loop of one consumer over one source; consumers start each step together."""
    return _consume_interleaved(w, [dataclasses.replace(src, name="only")], barrier_wait, on_step)["only"]


def _consume_interleaved(
    w: TransferWorkload,
    sources: Sequence[_Source],
    barrier_wait: Callable[[], object],
    on_step: Callable[[int], None] | None = None,
) -> dict[str, list[ConsumerStepRecord]]:
    """Steps of every source in turn (step 0 of each, then step 1 of each, ...): a side-by-side comparison on
    a machine whose load drifts. All consumers start each step together (a barrier, like an all-reduce)."""
    out: dict[str, list[ConsumerStepRecord]] = {src.name: [] for src in sources}
    k = 0
    for step in range(w.total_steps):
        for src in sources:
            barrier_wait()
            out[src.name].append(_run_step(step, src))
            if on_step is not None:
                on_step(k)
            k += 1
    barrier_wait()
    return out


# ---------------------------------------------------------------------------------------------- knitdata sources
class _DupCollator:
    """TokenCollator plus every trajectory's own copy of its media, processed per copy (what verl/slime hand
    over): per kind a tensor ``{kind}_inputs`` of the concatenated encoder inputs."""

    def __init__(self, w: TransferWorkload, cfg: VLMConfig):
        from knitdata.collate import TokenCollator
        from knitdata.media import MediaProcessor

        self.tokens = TokenCollator()
        self.proc = MediaProcessor(_preprocess(w, cfg))
        self.kinds = w.media_kinds

    def __call__(self, trajs: Sequence[Trajectory], info: Any = None) -> Any:
        mb = self.tokens(trajs, info)
        if trajs:
            per: dict[str, list[torch.Tensor]] = {k: [] for k in self.kinds}
            for t in trajs:
                for i, item in enumerate(t.media):
                    per[item.kind].append(self.proc.process(item, trajectory_id=t.id, index=i).tensor)
            for k, v in per.items():
                mb.tensors[f"{k}_inputs"] = torch.cat(v)
        return mb


def _dataset_kwargs(w: TransferWorkload, cfg: VLMConfig, encoding: str) -> dict[str, Any]:
    if encoding == "dup":
        return {"collate": _DupCollator(w, cfg)}
    from knitdata.collate import TokenCollator
    from knitdata.multimodal import MultimodalCollator

    return {"collate": TokenCollator(), "media_collator": MultimodalCollator(_preprocess(w, cfg))}


def _knitdata_next(it: Iterator[Any], kinds: Sequence[str] = ("image",)
                   ) -> Callable[[], tuple[_Item, float, float | None]]:
    """Adapt a TrajectoryDataset iterator: time ``next()`` only, then read the micro-batch (the waiting part of
    ``next()`` comes from the dataset's metrics: :func:`_data_wait_probe`)."""

    def nxt() -> tuple[_Item, float, float | None]:
        t0 = time.perf_counter()
        mb = next(it)
        waited = time.perf_counter() - t0
        info = mb.info
        nbytes = sum(t.numel() * t.element_size() for t in mb.iter_tensors())
        if mb.media is not None and info.microbatch == 0:
            nbytes += int(getattr(mb.media, "nbytes", 0))
        inputs = {k: mb.tensors[f"{k}_inputs"] for k in kinds if f"{k}_inputs" in mb.tensors} or None
        item = _Item(tuple(info.trajectory_ids), mb.input_ids, inputs, mb.media,
                     info.microbatch, info.num_microbatches, info.is_last, nbytes)
        return item, waited, None

    return nxt


#: Where a run's "waiting for data" (``wait_ms``) comes from: the code stored per run as ``wait_source``.
_WAIT_SOURCES: dict[str, str] = {
    "data_wait_s_total": "knitdata's ConsumerMetrics data_wait_s_total: seconds next() spent blocked until the "
                         "micro-batch was ready",
    "wait_s_total": "knitdata's ConsumerMetrics wait_s_total (fallback for a library without data_wait_s_total): "
                    "the time inside the dataset's inner iterator -- the prefetch queue pop in iter, the fetch, "
                    "decode and collate in sample and eager",
    "unavailable": "not reported: counted as 0 (all of next() counted as own work)",
    "transferqueue": "all of next(): get_meta, get_data and the rows' processing run on the trainer's thread",
    "tq_async": "the time blocked on the prefetch thread's queue",
    "tq_loader": "the time inside the streaming loader's next()",
}


def _metrics_wait_key(d: Mapping[str, Any]) -> str:
    for k in ("data_wait_s_total", "wait_s_total"):
        if isinstance(d.get(k), (int, float)):
            return k
    return "unavailable"


def _data_wait_probe(ds: Any) -> Callable[[], float]:
    """Cumulative seconds the dataset's ``next()`` spent waiting for data (its ConsumerMetrics), read outside the
    timed calls; ``data_wait_s_total`` when the library reports it, else ``wait_s_total`` (see
    :data:`_WAIT_SOURCES`)."""

    def probe() -> float:
        d = ds.metrics.to_dict()
        k = _metrics_wait_key(d)
        return float(d[k]) if k in d else 0.0

    return probe


def _knitdata_source(name: str, trainer: Any, ds: Any, it: Iterator[Any], kinds: Sequence[str]) -> _Source:
    """A knitdata TrajectoryDataset as the trainer drives it: ``next()`` per micro-batch, then after each
    optimizer step ``state = ds.state_dict()`` and ``ds.commit(state)`` (both exposed)."""
    return _Source(name, trainer, _knitdata_next(it, kinds), ds.state_dict, ds.commit,
                   _data_wait_probe(ds) if getattr(ds, "metrics", None) is not None else None)


def _batch_spec(w: TransferWorkload) -> Any:
    from knitdata.admission import BatchSpec

    return BatchSpec({"mm": w.trajectories_per_step}, num_minibatches=1, group_size=w.group_size)


def _pipeline_kwargs(w: TransferWorkload) -> dict[str, Any]:
    total = w.total_steps * w.trajectories_per_step * (w.trajectory_bytes + 4096)
    return {
        "num_consumers": w.num_consumers,
        "token_budget": w.microbatch_size * w.tokens,
        "capacity_bytes": int(total * 1.25),
        "admission": "fifo",
    }


# ---------------------------------------------------------------------------------------------- transferqueue
_TQ_PARTITION = "knitdata_bench"


def _tq_fields(w: TransferWorkload) -> list[str]:
    """transferqueue row fields of the workload (every row holds its own copy of the media)."""
    if w.workload == "omni":
        return ["input_ids", "frames", "audio", "tidx"]
    return ["input_ids", "pixel_values", "tidx"]


def _tq_partition(rank: int) -> str:
    """The partition of consumer ``rank``: its share of every step, in training order."""
    return f"{_TQ_PARTITION}_r{rank}"


def _tq_id(w: TransferWorkload, idx: int) -> str:
    per_step = w.groups_per_step * w.group_size
    return f"{_group_id(idx // per_step, (idx // w.group_size) % w.groups_per_step)}t{idx % w.group_size}"


def _is_loopback(ip: str) -> bool:
    return ip == "::1" or ip == "localhost" or ip.startswith("127.")


class _TQServer:
    """The real transferqueue: Ray on loopback, controller + SimpleStorage units, the workload put once.

    Each consumer rank reads its own partition (its share of every step, in order); every source reads it
    under its own ``task_name``, so the rows are put once and each source consumes all of them.
    """

    def __init__(self, w: TransferWorkload, num_units: int = 2):
        self.w = w
        self.num_units = num_units
        self.conf: Any = None
        self.addresses: dict[str, str] = {}
        self.startup_s = 0.0
        self.put_s = 0.0

    def start(self, cluster: _RayCluster) -> None:
        """Start the controller and storage units on ``cluster`` (Ray on loopback) and check their addresses."""
        t0 = time.perf_counter()
        os.environ["TQ_NUM_THREADS"] = "1"
        import ray

        cluster.start()
        node_ips = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
        self.addresses["ray_nodes"] = ",".join(node_ips)
        if not all(_is_loopback(ip) for ip in node_ips):
            raise LoopbackError(f"Ray nodes on {node_ips}, not loopback; refusing to run transferqueue here")
        import transfer_queue as tq

        self.conf = tq.init({"controller": {"polling_mode": True},
                             "backend": {"SimpleStorage": {"num_data_storage_units": self.num_units}}})
        ctl = self.conf.controller.zmq_info
        self.addresses["controller"] = f"{ctl.ip}:{sorted(ctl.ports.values())}"
        for name, info in self.conf.backend.SimpleStorage.zmq_info.items():
            self.addresses[str(name)] = f"{info.ip}:{sorted(info.ports.values())}"
        ips = [ctl.ip] + [info.ip for info in self.conf.backend.SimpleStorage.zmq_info.values()]
        if not all(_is_loopback(ip) for ip in ips):
            raise LoopbackError(
                f"transferqueue listens on {sorted(set(ips))}, not loopback only; refusing to run. Set "
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray starts"
            )
        self.startup_s = time.perf_counter() - t0

    def put_all(self, progress: Any = None) -> set[str]:
        """Put every trajectory of the run as sample-level rows (each row holds its own media copy) into the
        partition of the rank that trains on it."""
        import numpy as np
        import transfer_queue as tq
        from tensordict import TensorDict

        client = tq.get_client()
        w = self.w
        t0 = time.perf_counter()
        ids: set[str] = set()
        idx = 0
        groups_per_rank = w.per_consumer_step // w.group_size
        for step in range(w.total_steps):
            for g, group in enumerate(make_step_groups(w, step)):
                n = len(group)
                fields: dict[str, torch.Tensor] = {
                    "input_ids": torch.stack([torch.cat([t.prompt_ids, t.response_ids]) for t in group]),
                    "tidx": torch.arange(idx, idx + n, dtype=torch.int64),
                }
                if w.workload == "omni":
                    frames = [m.tensor for m in group[0].media if m.kind == "image" and m.tensor is not None]
                    audio = next(m for m in group[0].media if m.kind == "audio")
                    assert audio.data is not None
                    fields["frames"] = torch.stack(frames).unsqueeze(0).expand(n, *([-1] * 4)).contiguous()
                    clip = torch.from_numpy(np.frombuffer(audio.data, dtype=np.uint8).copy())
                    fields["audio"] = clip.unsqueeze(0).expand(n, -1).contiguous()
                else:
                    img = group[0].media[0].tensor
                    assert img is not None
                    fields["pixel_values"] = img.unsqueeze(0).expand(n, *img.shape).contiguous()
                client.put(TensorDict(fields, batch_size=n), partition_id=_tq_partition(g // groups_per_rank))
                for t in group:
                    assert _tq_id(w, idx) == t.id
                    ids.add(t.id)
                    idx += 1
            if progress is not None:
                progress.update(1)
        self.put_s = time.perf_counter() - t0
        torch.set_num_threads(1)
        return ids

    def close(self) -> None:
        """Stop transferqueue's client, controller and storage units (Ray stays up for the next modes)."""
        if self.conf is not None:
            import transfer_queue as tq

            tq.close()
            self.conf = None


def _unbind(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.unbind()) if t.is_nested else list(t)


class _TQDecode:
    """Turn transferqueue micro-batches (TensorDicts) into what the trainer consumes (picklable: it also runs in
    the streaming loader's worker processes).

    ``dup``: per kind the encoder inputs of every row (each row's media processed, audio decoded from its FLAC
    bytes with soundfile); ``shared``: a step's micro-batches become trajectories whose media a
    :class:`~knitdata.multimodal.MultimodalCollator` (provenance keys) collates once per unique item.
    """

    def __init__(self, w: TransferWorkload, cfg: VLMConfig):
        self.w = w
        self.cfg = cfg
        self._proc: Any = None
        self._coll: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"w": self.w, "cfg": self.cfg, "_proc": None, "_coll": None}

    def _rows(self, td: Any) -> tuple[list[int], torch.Tensor, list[list[MediaItem]], int]:
        w = self.w
        tidx_t = td["tidx"]
        tidx = [int(x) for x in (torch.cat(_unbind(tidx_t)) if tidx_t.is_nested else tidx_t.reshape(-1))]
        ids_t = td["input_ids"]
        input_ids = torch.stack(_unbind(ids_t)) if ids_t.is_nested else ids_t
        moved = input_ids.numel() * 8 + len(tidx) * 8
        media: list[list[MediaItem]] = []
        if w.workload == "omni":
            frames, clips = _unbind(td["frames"]), _unbind(td["audio"])
            for i, f, c in zip(tidx, frames, clips):
                gid = _tq_id(w, i).rsplit("t", 1)[0]
                f = f.reshape(w.video_frames, *w.item_shape)
                items = [MediaItem("image", tensor=f[j], digest=f"{gid}/{j}") for j in range(w.video_frames)]
                items.append(MediaItem("audio", data=c.numpy().tobytes(), sample_rate=w.audio_rate,
                                       digest=f"{gid}/a"))
                media.append(items)
                moved += f.numel() + c.numel()
        else:
            for i, im in zip(tidx, _unbind(td["pixel_values"])):
                gid = _tq_id(w, i).rsplit("t", 1)[0]
                media.append([MediaItem("image", tensor=im.reshape(w.image_shape), digest=f"{gid}/0")])
                moved += im.numel()
        return tidx, input_ids, media, moved

    def dup(self, td: Any, index: int, k: int) -> _Item:
        """One micro-batch with every row's own media processed (``dup`` encoding)."""
        if self._proc is None:
            from knitdata.media import MediaProcessor

            self._proc = MediaProcessor(_preprocess(self.w, self.cfg))
        tidx, input_ids, media, moved = self._rows(td)
        per: dict[str, list[torch.Tensor]] = {kd: [] for kd in self.w.media_kinds}
        for i, items in zip(tidx, media):
            for j, item in enumerate(items):
                per[item.kind].append(self._proc.process(item, trajectory_id=_tq_id(self.w, i), index=j).tensor)
        inputs = {kd: torch.cat(v) for kd, v in per.items()}
        nbytes = input_ids.numel() * input_ids.element_size() + sum(v.numel() * v.element_size()
                                                                    for v in inputs.values())
        return _Item(tuple(_tq_id(self.w, i) for i in tidx), input_ids, inputs, None, index, k, index == k - 1,
                     nbytes, moved)

    def shared(self, tds: Sequence[Any]) -> list[_Item]:
        """A step's micro-batches with one :class:`~knitdata.multimodal.MultimodalBatch` (``shared``)."""
        if self._coll is None:
            from knitdata.multimodal import MultimodalCollator

            self._coll = MultimodalCollator(_preprocess(self.w, self.cfg), key="provenance")
        w = self.w
        p = w.prompt_tokens
        mbs: list[list[Trajectory]] = []
        rows = []
        for td in tds:
            tidx, input_ids, media, moved = self._rows(td)
            trajs = [Trajectory(id=_tq_id(w, i), source="mm", group=_tq_id(w, i).rsplit("t", 1)[0],
                                prompt_ids=ids[:p], response_ids=ids[p:], media=items)
                     for i, ids, items in zip(tidx, input_ids, media)]
            mbs.append(trajs)
            rows.append((tidx, input_ids, moved))
        batch = self._coll(mbs)
        k = len(tds)
        out = []
        for i, (tidx, input_ids, moved) in enumerate(rows):
            nbytes = input_ids.numel() * input_ids.element_size() + (int(batch.nbytes) if i == 0 else 0)
            out.append(_Item(tuple(_tq_id(w, t) for t in tidx), input_ids, None, batch, i, k, i == k - 1, nbytes,
                             moved))
        return out


class _TQSource:
    """transferqueue as verl drives it: one consumer's synchronous client, ``get_meta`` (polling) + ``get_data``
    per micro-batch in the trainer thread, rows processed there."""

    def __init__(self, conf: Any, rank: int, w: TransferWorkload, cfg: VLMConfig, task: str = "train",
                 poll_timeout_s: float = 60.0):
        os.environ["TQ_NUM_THREADS"] = "1"
        from transfer_queue.client import TransferQueueClient

        self.client = TransferQueueClient(client_id=f"knitdata_bench_{task}_{rank}_{os.getpid()}",
                                          controller_info=conf.controller.zmq_info)
        self.client.initialize_storage_manager(manager_type="SimpleStorage", config=conf.backend.SimpleStorage)
        self.w = w
        self.task = task
        self.partition = _tq_partition(rank)
        self.decode = _TQDecode(w, cfg)
        self.poll_timeout_s = poll_timeout_s
        self.i = 0
        self.last_wait = 0.0
        torch.set_num_threads(1)

    def get(self) -> Any:
        """One micro-batch's rows (polls until ``microbatch_size`` rows are ready)."""
        b = self.w.microbatch_size
        deadline = time.monotonic() + self.poll_timeout_s
        while True:
            meta = self.client.get_meta(data_fields=_tq_fields(self.w), batch_size=b, partition_id=self.partition,
                                        task_name=self.task)
            if len(meta) == b:
                break
            if time.monotonic() > deadline:
                raise EngineError(f"transferqueue delivered no micro-batch of {b} within {self.poll_timeout_s} s "
                                  f"(partition {self.partition}, task {self.task})")
            time.sleep(0.001)
        return self.client.get_data(meta)

    def fetch(self) -> _Item:
        """The next micro-batch, fetched and processed on the trainer's thread (``last_wait``: all of it)."""
        t0 = time.perf_counter()
        k = self.w.microbatches_per_step
        item = self.decode.dup(self.get(), self.i % k, k)
        self.i += 1
        self.last_wait = time.perf_counter() - t0
        return item

    def close(self) -> None:
        self.client.close()


class _TQAsyncSource:
    """transferqueue at its best, (a): its asyncio client (``AsyncTransferQueueClient``) in a background thread
    that fetches and processes micro-batches ahead of the trainer.

    ``dup``: up to ``ahead`` processed micro-batches wait in the queue (plus one being fetched); ``shared``: the
    unit is a step (its ``K`` micro-batches and their media batch, needed at micro-batch 0), one step ahead.
    The thread stops after the run's last micro-batch; errors reach the trainer at its next ``next()``.
    """

    def __init__(self, conf: Any, rank: int, w: TransferWorkload, cfg: VLMConfig, encoding: str, task: str,
                 ahead: int = 2, poll_timeout_s: float = 60.0):
        self.conf, self.rank, self.w, self.encoding, self.task = conf, rank, w, encoding, task
        self.decode = _TQDecode(w, cfg)
        self.poll_timeout_s = poll_timeout_s
        self.q: queue.Queue = queue.Queue(maxsize=ahead if encoding == "dup" else 1)
        self.buf: list[_Item] = []
        self.last_wait = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"tq-prefetch-{task}-{rank}", daemon=True)
        self.thread.start()

    def _put(self, x: Any) -> bool:
        while not self._stop.is_set():
            try:
                self.q.put(x, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        import asyncio

        torch.set_num_threads(1)
        try:
            asyncio.run(self._main())
        except BaseException as e:  # handed to the trainer
            self._put(e)

    async def _main(self) -> None:
        import asyncio

        from transfer_queue.client import AsyncTransferQueueClient

        w = self.w
        client = AsyncTransferQueueClient(f"knitdata_bench_{self.task}_{self.rank}_{os.getpid()}",
                                          self.conf.controller.zmq_info)
        client.initialize_storage_manager(manager_type="SimpleStorage", config=self.conf.backend.SimpleStorage)
        part, b, k = _tq_partition(self.rank), w.microbatch_size, w.microbatches_per_step
        try:
            pending: list[Any] = []
            for i in range(w.total_steps * k):
                deadline = time.monotonic() + self.poll_timeout_s
                while True:
                    meta = await client.async_get_meta(data_fields=_tq_fields(w), batch_size=b, partition_id=part,
                                                       task_name=self.task)
                    if len(meta) == b:
                        break
                    if time.monotonic() > deadline:
                        raise EngineError(f"transferqueue delivered no micro-batch of {b} within "
                                          f"{self.poll_timeout_s} s (partition {part}, task {self.task})")
                    await asyncio.sleep(0.001)
                td = await client.async_get_data(meta)
                if self.encoding == "dup":
                    if not self._put(self.decode.dup(td, i % k, k)):
                        return
                else:
                    pending.append(td)
                    if len(pending) == k:
                        bundle, pending = self.decode.shared(pending), []
                        if not self._put(bundle):
                            return
        finally:
            client.close()

    def fetch(self) -> _Item:
        """The next micro-batch; ``last_wait`` is the time blocked on the queue for it."""
        self.last_wait = 0.0
        if not self.buf:
            t0 = time.perf_counter()
            x = self.q.get(timeout=self.poll_timeout_s * 2)
            self.last_wait = time.perf_counter() - t0
            if isinstance(x, BaseException):
                raise x
            self.buf = [x] if isinstance(x, _Item) else list(x)
        return self.buf.pop(0)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)


def _tq_collate(decode: _TQDecode, encoding: str, k: int) -> Callable[[Any], Any]:
    return functools.partial(_tq_loader_collate, decode, encoding, k)


def _tq_loader_collate(decode: _TQDecode, encoding: str, k: int, data: Any) -> Any:
    """The streaming loader's ``collate_fn`` (runs in its workers): process rows like the other sources."""
    td, meta = data
    if encoding == "dup":
        return [decode.dup(td, 0, k)]
    # shared: the dataset yields the whole step (one batch of K micro-batches); split it here
    b = decode.w.microbatch_size
    n = td.batch_size[0]
    return decode.shared([td[i:i + b] for i in range(0, n, b)])


def _tq_whole_batch(td: Any, batch_meta: Any, micro_batch_size: int = 1) -> list[tuple[Any, Any]]:
    """``process_batch_fn`` of the streaming dataset in ``shared`` mode: yield the step's batch whole."""
    return [(td, batch_meta)]


class _TQLoaderSource:
    """transferqueue at its best, (b): its own ``StreamingDataset`` + ``StreamingDataLoader`` as its documentation
    recommends (``num_workers`` loader processes, each with its own client, ``prefetch_factor`` batches ahead);
    each worker fetches a step's share (``batch_size`` = the rank's trajectories per step) and processes it in
    its ``collate_fn``. Workers are started (spawn) when the source is built, before the measured steps."""

    def __init__(self, conf: Any, rank: int, w: TransferWorkload, cfg: VLMConfig, encoding: str, task: str,
                 num_workers: int = 1, prefetch_factor: int = 2):
        from transfer_queue.dataloader import StreamingDataLoader, StreamingDataset

        self.w = w
        k = w.microbatches_per_step
        ds = StreamingDataset(config=conf, batch_size=w.per_consumer_step, micro_batch_size=w.microbatch_size,
                              data_fields=_tq_fields(w), partition_id=_tq_partition(rank), task_name=task,
                              dp_rank=rank, process_batch_fn=None if encoding == "dup" else _tq_whole_batch)
        self.loader = StreamingDataLoader(ds, num_workers=num_workers,
                                          prefetch_factor=prefetch_factor if num_workers else None,
                                          collate_fn=_tq_collate(_TQDecode(w, cfg), encoding, k),
                                          multiprocessing_context="spawn" if num_workers else None,
                                          persistent_workers=False)
        self.it: Any = iter(self.loader)
        self.buf: list[_Item] = []
        self.i = 0
        self.last_wait = 0.0

    def fetch(self) -> _Item:
        """The next micro-batch; ``last_wait`` is the time inside the loader's ``next()`` for it."""
        self.last_wait = 0.0
        if not self.buf:
            t0 = time.perf_counter()
            self.buf = list(next(self.it))
            self.last_wait = time.perf_counter() - t0
        item = self.buf.pop(0)
        k = self.w.microbatches_per_step
        if item.media is None:  # dup: the workers see one micro-batch at a time; number it here
            item.index, item.is_last = self.i % k, self.i % k == k - 1
        self.i += 1
        return item

    def close(self) -> None:
        self.it = None  # the DataLoader iterator stops its workers when it is collected
        import gc

        gc.collect()


# ---------------------------------------------------------------------------------------------- worker processes
def _workload_from_dict(d: Mapping[str, Any]) -> TransferWorkload:
    fields = {f.name for f in dataclasses.fields(TransferWorkload)}
    kw = {k: v for k, v in d.items() if k in fields}
    kw["image_shape"] = tuple(kw["image_shape"])
    return TransferWorkload(**kw)


def _job_base(w: TransferWorkload, cfg: VLMConfig, encoding: str) -> dict[str, Any]:
    return {"workload": w.to_dict(), "model": cfg.to_dict(), "encoding": encoding}


def _run_worker_job(rank: int, job: Mapping[str, Any], barrier: Any, res_q: Any, barrier_timeout: float) -> dict:
    """Run every source of ``job`` interleaved step by step; one trainer per encoding."""
    w = _workload_from_dict(job["workload"])
    cfg = VLMConfig(**job["model"])
    trainers: dict[str, Any] = {}

    def wait() -> None:
        barrier.wait(barrier_timeout)

    def on_step(k: int) -> None:
        if rank == 0:
            res_q.put(("step", rank, k))

    extra: dict[str, dict[str, Any]] = {}
    closers: list[Callable[[], Any]] = []
    sources: list[_Source] = []
    try:
        for spec in job["sources"]:
            enc = spec["encoding"]
            if enc not in trainers:
                trainers[enc] = _make_trainer(w, cfg, enc, job.get("compute", "cpu"), job.get("calibration"))
            name = spec["name"]
            extra[name] = {}
            if spec["kind"] in ("transferqueue", "tq_async", "tq_loader"):
                if spec["kind"] == "transferqueue":
                    src: Any = _TQSource(spec["conf"], rank, w, cfg, task=spec["task"])
                elif spec["kind"] == "tq_async":
                    src = _TQAsyncSource(spec["conf"], rank, w, cfg, enc, spec["task"])
                else:
                    src = _TQLoaderSource(spec["conf"], rank, w, cfg, enc, spec["task"],
                                          num_workers=spec.get("num_workers", 1),
                                          prefetch_factor=spec.get("prefetch_factor", 2))
                closers.append(src.close)

                def nxt(src: Any = src) -> tuple[_Item, float, float | None]:
                    t0 = time.perf_counter()
                    item = src.fetch()
                    return item, time.perf_counter() - t0, src.last_wait

                # transferqueue's controller records consumption at get_meta: no per-step state call is needed
                sources.append(_Source(name, trainers[enc], nxt))
                extra[name]["wait_source"] = spec["kind"]
            elif spec["kind"] == "knitdata":
                ds = _attach_dataset(spec, rank, w, cfg)
                it = iter(ds)
                closers.append(getattr(it, "close", lambda: None))
                # every step: save the loader state and commit it (releases the step's payloads); both are
                # data calls of the trainer, counted as exposed latency
                sources.append(_knitdata_source(name, trainers[enc], ds, it, w.media_kinds))
                if getattr(ds, "metrics", None) is not None:
                    extra[name]["_metrics_of"] = ds.metrics
            else:  # pragma: no cover - programming error
                raise ConfigError(f"unknown source kind {spec['kind']!r}")
        recs = _consume_interleaved(w, sources, wait, on_step)
    finally:
        for close in closers:
            try:
                close()
            except Exception:
                pass
    for d in extra.values():
        m = d.pop("_metrics_of", None)
        if m is not None:
            d["metrics"] = m.to_dict()
            d["wait_source"] = _metrics_wait_key(d["metrics"])
    return {"records": {n: [dataclasses.asdict(r) for r in v] for n, v in recs.items()}, "extra": extra}


def _worker_main(rank: int, cmd_q: Any, res_q: Any, barrier: Any, barrier_timeout: float,
                 driver_pid: int | None = None) -> None:
    """Entry of one consumer process: runs jobs until it receives ``None`` (or its driver process is gone)."""
    import traceback

    _pin_threads()
    parent = os.getppid() if driver_pid is None else driver_pid
    _preimport()
    while True:
        try:
            job = cmd_q.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:  # the driver died (killed, timed out): no orphan stays behind
                return
            continue
        if job is None:
            return
        try:
            out = _run_worker_job(rank, job, barrier, res_q, barrier_timeout)
            res_q.put(("ok", rank, json.dumps(out)))
        except BaseException:  # report everything to the driver; never hang the others
            try:
                barrier.abort()
            except Exception:
                pass
            res_q.put(("error", rank, traceback.format_exc()))


def _preimport() -> None:
    """Import what the jobs need while the driver starts its servers (start-up, not measured)."""
    import importlib

    for mod in ("knitdata.collate", "knitdata.multimodal", "knitdata.encoder", "knitdata.dataset",
                "knitdata.prefetch", "transfer_queue", "knitdata.engines.ray"):
        try:
            importlib.import_module(mod)
        except Exception:  # optional extras; the job reports what it really lacks
            pass


class _WorkerPool:
    """``n`` consumer processes (spawned once per run) that run one job at a time, all ranks together."""

    def __init__(self, n: int, barrier_timeout: float = 300.0):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.n = n
        self.cmd = [ctx.Queue() for _ in range(n)]
        self.res = ctx.Queue()
        self.barrier = ctx.Barrier(n)
        env_before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TQ_NUM_THREADS")}
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["TQ_NUM_THREADS"] = "1"
        try:
            self.procs = [
                ctx.Process(target=_worker_main,
                            args=(r, self.cmd[r], self.res, self.barrier, barrier_timeout, os.getpid()),
                            name=f"knitdata-bench-consumer-{r}", daemon=False)
                for r in range(n)
            ]
            for p in self.procs:
                p.start()
        finally:
            for k, v in env_before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def run(self, job: Mapping[str, Any], timeout_s: float, progress: Any = None
            ) -> tuple[dict[str, list[list[ConsumerStepRecord]]], dict[str, list[dict]]]:
        """Run ``job`` on every rank; per source name, the records and extras of each rank."""
        for q in self.cmd:
            q.put(dict(job))
        done: dict[int, dict] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) + len(errors) < self.n:
            left = deadline - time.monotonic()
            try:
                kind, rank, payload = self.res.get(timeout=max(0.1, min(left, 5.0)))
            except queue.Empty:
                if time.monotonic() > deadline:
                    self.close(force=True)
                    raise EngineError(f"consumer processes did not finish within {timeout_s:.0f} s") from None
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    self.close(force=True)
                    raise EngineError(f"consumer processes died: {dead}") from None
                continue
            if kind == "step":
                if progress is not None:
                    progress.update(1)
            elif kind == "ok":
                done[rank] = json.loads(payload)
            else:
                errors[rank] = payload
        if errors:
            self.barrier.reset()
            primary = [r for r, e in errors.items() if "BrokenBarrierError" not in e.strip().splitlines()[-1]]
            first = min(primary or errors)
            raise EngineError(f"consumer {first} failed:\n{errors[first]}")
        names = list(done[0]["records"])
        recs = {n: [[ConsumerStepRecord(**d) for d in done[r]["records"][n]] for r in range(self.n)] for n in names}
        extras = {n: [done[r]["extra"].get(n, {}) for r in range(self.n)] for n in names}
        return recs, extras

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.cmd:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


# ---------------------------------------------------------------------------------------------- knitdata engines
def _fill_pipeline(pipe: Any, w: TransferWorkload) -> set[str]:
    ids: set[str] = set()
    for step in range(w.total_steps):
        for group in make_step_groups(w, step):
            for t in group:
                pipe.put(t)
                ids.add(t.id)
    pipe.close()
    return ids


def _run_embedded(w: TransferWorkload, cfg: VLMConfig, fetch: str, encoding: str, timeout_s: float,
                  progress: Any = None, device: str = "cpu", compute: str = "cpu",
                  calibration: Mapping[str, Any] | None = None
                  ) -> tuple[list[list[ConsumerStepRecord]], list[dict], set[str], dict]:
    """``fetch`` on the embedded engine: one process, consumers are threads (one torch thread each), training on
    ``device`` (``compute="accel"``: waiting the calibrated compute instead)."""
    from knitdata.pipeline import Pipeline

    pipe = Pipeline(_batch_spec(w), engine="embedded", **_pipeline_kwargs(w))
    t0 = time.perf_counter()
    expected = _fill_pipeline(pipe, w)
    fill_s = time.perf_counter() - t0
    n = w.num_consumers
    barrier = threading.Barrier(n)
    trainers = [_make_trainer(w, cfg, encoding, compute, calibration, device) for _ in range(n)]
    out: list[Any] = [None] * n
    errs: list[BaseException | None] = [None] * n

    def consumer(rank: int) -> None:
        ds = pipe.dataset(rank, fetch=fetch, **_dataset_kwargs(w, cfg, encoding))
        it = iter(ds)
        try:
            out[rank] = _consume(w, _knitdata_source("only", trainers[rank], ds, it, w.media_kinds),
                                 lambda: barrier.wait(timeout_s),
                                 (lambda s: progress.update(1)) if (rank == 0 and progress is not None) else None)
        except BaseException as e:
            errs[rank] = e
            barrier.abort()
        finally:
            getattr(it, "close", lambda: None)()

    threads = [threading.Thread(target=consumer, args=(r,), name=f"bench-consumer-{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        raise EngineError(f"embedded consumers did not finish within {timeout_s:.0f} s")
    for e in errs:
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise e
    extras: list[dict[str, Any]] = [{"metrics": pipe.metrics(r).to_dict()} for r in range(n)]
    for x in extras:
        x["wait_source"] = _metrics_wait_key(x["metrics"])
    return out, extras, expected, {"fill_s": fill_s}


#: How the process modes reach knitdata (stated in the JSON and the README).
_PROCESS_MODES_ENGINE = (
    "knitdata Pipeline(engine='ray') (coordinator actor: the control plane; one "
    "storage-unit actor; Ray object store on loopback) fed by the driver, and a TrajectoryDataset per rank in "
    "each of the 4 consumer processes"
)


def _attach_dataset(job: Mapping[str, Any], rank: int, w: TransferWorkload, cfg: VLMConfig) -> Any:
    """The :class:`~knitdata.dataset.TrajectoryDataset` of ``rank`` in a consumer process (Ray engine).

    Attaches to the driver's Ray cluster (loopback only) and to the pipeline's coordinator by name.
    """
    from knitdata.storage import ray_unit

    ray_unit.connect(job["ray_address"], loopback_only=True)
    from knitdata.pipeline import Pipeline

    kw = _dataset_kwargs(w, cfg, job["encoding"])
    return Pipeline.attach(job["pipeline"], address=job["ray_address"]).dataset(rank, fetch=job["fetch"], **kw)


def _parallel_put(put: Callable[[Trajectory], Any], trajs: Sequence[Trajectory], threads: int = 4) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="knitdata-bench-put") as ex:
        for f in [ex.submit(put, t) for t in trajs]:
            f.result()


class _RayCluster:
    """One local Ray per benchmark run, on loopback (address='local'): transferqueue's actors, then knitdata's."""

    def __init__(self, object_store_bytes: int = 4 << 30) -> None:
        self.object_store_bytes = int(object_store_bytes)
        self.address: str | None = None
        self.node: str | None = None
        self.startup_s = 0.0
        self._runs = 0
        self._pipes: dict[str, Any] = {}

    def start(self) -> None:
        """Start Ray (once; later calls return at once)."""
        if self.address is not None:
            return
        t0 = time.perf_counter()
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        from knitdata.storage import ray_unit

        if ray.is_initialized():
            raise EngineError("Ray is already initialized in this process; the transfer benchmark starts its own")
        for attempt in range(3):  # on an overloaded machine the raylet can miss Ray's fixed 30 s start-up wait
            try:
                ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                         logging_level="ERROR",  # type: ignore[arg-type]  # ray annotates int; takes names too
                         _node_ip_address=ray_unit.LOOPBACK, object_store_memory=self.object_store_bytes,
                         runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                                   "TQ_NUM_THREADS": "1"}})
                break
            except Exception as e:
                if "timed out during startup" not in str(e) or attempt == 2:
                    raise
                ray.shutdown()
                time.sleep(5)
        try:
            ray_unit.check_loopback()
        except EngineError as e:
            ray.shutdown()
            raise LoopbackError(str(e)) from e
        self.address = ray.get_runtime_context().gcs_address
        self.node = ray_unit.current_node()
        self.startup_s = time.perf_counter() - t0

    def prepare_engine(self, w: TransferWorkload) -> tuple[dict[str, Any], set[str], float]:
        """A fresh Ray-engine :class:`~knitdata.pipeline.Pipeline` holding the whole workload (closed)."""
        from knitdata.pipeline import Pipeline

        t0 = time.perf_counter()
        self._runs += 1
        name = f"knitdata_bench_{os.getpid()}_{self._runs}"
        kw = _pipeline_kwargs(w)
        pipe = Pipeline(_batch_spec(w), admission=kw["admission"], num_consumers=w.num_consumers, engine="ray",
                        capacity_bytes=kw["capacity_bytes"], token_budget=kw["token_budget"], release="commit",
                        engine_options={"name": name, "address": self.address})
        self._pipes[name] = pipe
        ids: set[str] = set()
        for step in range(w.total_steps):
            trajs = [t for group in make_step_groups(w, step) for t in group]
            _parallel_put(pipe.put, trajs)  # a step's puts overlap (start-up, not measured)
            ids.update(t.id for t in trajs)
        pipe.close()
        job = {"kind": "knitdata", "engine": "ray_engine", "ray_address": self.address, "pipeline": name}
        return job, ids, time.perf_counter() - t0

    def engine_bytes_fetched(self, name: str) -> int | None:
        """Bytes the storage units of pipeline ``name`` handed out (its stats), if known."""
        pipe = self._pipes.get(name)
        if pipe is None:
            return None
        try:
            units = pipe.stats().get("units", {})
            return int(sum((u or {}).get("bytes_fetched", 0) for u in units.values()))
        except Exception:  # stats are a report, not the measurement
            return None

    def finish_runs(self) -> None:
        """Stop every pipeline (coordinator and storage units) created for the runs."""
        for pipe in self._pipes.values():
            pipe.shutdown()
        self._pipes = {}

    def close(self) -> None:
        if self.address is None:
            return
        import ray

        try:
            self.finish_runs()
        finally:
            ray.shutdown()
            self.address = None


# ---------------------------------------------------------------------------------------------- summary
def _median(v: Sequence[float]) -> float:
    return float(statistics.median(v)) if v else float("nan")


def summarize_mode(records: Sequence[Sequence[ConsumerStepRecord]], w: TransferWorkload,
                   expected_ids: set[str] | None = None) -> dict[str, Any]:
    """Per-step medians over the measured steps, and exactly-once counts over every step.

    Exposed latency per step is the mean over consumers (``exposed_latency_max_s``: the slowest one); the
    step time is the slowest consumer's (the optimizer step of data-parallel training waits for it).
    ``breakdown_ms`` splits the exposed latency by call, each part the median over steps of its mean over
    consumers (so the parts need not add up to the median total): ``next_ms`` (every ``next()`` of the step),
    of it ``wait_ms`` (blocked until the micro-batch was ready) and ``own_ms`` (the rest: the data system's own
    work on the trainer's thread), then ``state_dict_ms`` and ``commit_ms`` after the optimizer step.
    """
    measured = range(w.warmup_steps, w.total_steps)

    def per_step(fn: Callable[[ConsumerStepRecord], float]) -> list[float]:
        return [statistics.fmean(fn(r[s]) for r in records) for s in measured]

    def wait_of(rec: ConsumerStepRecord) -> float:
        return min(sum(rec.waits), rec.data_wait_s) if rec.data_wait_s is not None else 0.0

    ex_mean = per_step(lambda rec: rec.exposed_s)
    ex_max = [max(r[s].exposed_s for r in records) for s in measured]
    step = [max(r[s].step_s for r in records) for s in measured]
    comp = per_step(lambda rec: rec.compute_s)
    commit = per_step(lambda rec: rec.commit_s)
    nxt = per_step(lambda rec: sum(rec.waits))
    wait = per_step(wait_of)
    own = per_step(lambda rec: sum(rec.waits) - wait_of(rec))
    state = per_step(lambda rec: rec.state_dict_s)
    commit_call = per_step(lambda rec: rec.commit_call_s)
    to_trainer = [sum(r[s].bytes for r in records) for s in measured]
    moved = [sum(r[s].moved for r in records) for s in measured]
    counts: dict[str, int] = {}
    for r in records:
        for rec in r:
            for i in rec.ids:
                counts[i] = counts.get(i, 0) + 1
    expected = set(counts) if expected_ids is None else expected_ids
    return {
        "exposed_latency_s": _median(ex_mean),
        "exposed_latency_max_s": _median(ex_max),
        "step_s": _median(step),
        "compute_s": _median(comp),
        "exposed_commit_s": _median(commit),
        "breakdown_ms": {"next_ms": _median(nxt) * 1e3, "wait_ms": _median(wait) * 1e3, "own_ms": _median(own) * 1e3,
                         "state_dict_ms": _median(state) * 1e3, "commit_ms": _median(commit_call) * 1e3},
        "data_wait_known": all(r[s].data_wait_s is not None for s in measured for r in records),
        "bytes_to_trainer_per_step": _median(to_trainer),
        "bytes_moved_per_step": _median(moved) if any(moved) else None,
        "delivered": sum(counts.values()),
        "expected": len(expected),
        "lost": len(expected - set(counts)),
        "duplicated": sum(c - 1 for c in counts.values() if c > 1),
        "unexpected": len(set(counts) - expected),
        "exactly_once": set(counts) == expected and all(c == 1 for c in counts.values()),
        "microbatches_per_step": sorted({rec.microbatches for r in records for rec in r}),
        "per_step": {"exposed_s": ex_mean, "step_s": step, "compute_s": comp, "next_s": nxt, "wait_s": wait,
                     "state_dict_s": state, "commit_s": commit_call},
        "exposed_by_microbatch_s": [
            _median([r[s].waits[i] for s in measured for r in records if i < len(r[s].waits)])
            for i in range(max(len(r[s].waits) for s in measured for r in records))
        ],
    }


def _bytes_moved_from_metrics(extras: Sequence[Mapping[str, Any]], w: TransferWorkload) -> float | None:
    tot = [e.get("metrics", {}).get("bytes_fetched") for e in extras]
    if not tot or any(t is None for t in tot):
        return None
    return float(sum(tot)) / w.total_steps


def _machine() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }
    try:
        info["loadavg_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    from importlib import metadata

    for dist in ("transferqueue", "ray"):  # not imported here: Ray reads its environment when imported
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    return info


def _count_flops(w: TransferWorkload, cfg: VLMConfig) -> dict[str, tuple[VLMConfig, dict[str, float]]]:
    """FLOP counts of the projection model and of the model the consumers train."""
    return {"model": (GPU_VLM, count_step_flops(GPU_VLM, w)), "tiny_model": (cfg, count_step_flops(cfg, w))}


def _gpu_projection(flops: Mapping[str, tuple[VLMConfig, Mapping[str, float]]], tflops: float,
                    base_ex: float | None, iter_dup_ex: float | None, iter_shared_ex: float | None) -> dict[str, Any]:
    rate = tflops * 1e12
    out: dict[str, Any] = {"rate_tflops": tflops, "precision": "bf16 dense, effective (stated, not measured)",
                           "seed_speedup": SEED_SPEEDUP}
    for label, (cfg, f) in flops.items():
        c_dup, c_sh = f["step_dup"] / rate, f["step_shared"] / rate
        d: dict[str, Any] = {"config": cfg.to_dict(), "params": f["params"], "flops_step_dup": f["step_dup"],
                             "flops_step_shared": f["step_shared"], "compute_s_dup": c_dup, "compute_s_shared": c_sh}
        if base_ex is not None and iter_shared_ex is not None:
            base = c_dup + base_ex
            ours = c_sh + iter_shared_ex
            d.update(step_s_transferqueue_dup=base, step_s_iter_shared=ours, speedup=base / ours,
                     break_even_transferqueue_latency_s_for_seed=max(0.0, SEED_SPEEDUP * ours - c_dup))
            if iter_dup_ex is not None:
                d["speedup_transfer"] = base / (c_dup + iter_dup_ex)
                d["speedup_encoding"] = (c_dup + iter_dup_ex) / (c_sh + iter_dup_ex)
        out[label] = d
    out["value"] = out["model"].get("speedup")
    out["projected"] = True
    out["assumptions"] = {
        "gpu_rate_tflops": tflops,
        "compute": "counted FLOPs (torch.utils.flop_counter.FlopCounterMode on the meta device, forward + "
                   "backward of one consumer's step) divided by the rate; no kernel launch, memory or "
                   "communication time",
        "transfer": "the exposed latency measured on this CPU, unchanged on a GPU; the baseline is "
                    "transferqueue at its best when it ran",
        "model": GPU_VLM.name,
        "not_measured": True,
    }
    out["assumption"] = (
        "compute = counted FLOPs (FlopCounterMode, forward+backward, one consumer's step) / rate; transfer = the "
        "exposed latency measured here on CPU, unchanged on a GPU (iter hides its fetch behind the GPU compute, "
        "which is longer per micro-batch than the fetch measured here)"
    )
    return out


# ---------------------------------------------------------------------------------------------- the benchmark
def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def run_transfer_benchmark(
    w: TransferWorkload | None = None,
    modes: Sequence[str] = MODES,
    *,
    shared_modes: Sequence[str] = ("transferqueue_best", "iter", "iter_embedded"),
    controls: Sequence[str] | None = None,
    control_encodings: Sequence[str] = ENCODINGS,
    tq_best_variants: Sequence[str] = TQ_BEST_VARIANTS,
    loader_workers: int = 1,
    cfg: VLMConfig = TINY_VLM,
    gpu_tflops: float = DEFAULT_GPU_TFLOPS,
    tq_units: int = 2,
    timeout_s: float = 900.0,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    compute: str = "accel",
    calibration_reps: int = 3,
    interleave: bool = True,
) -> dict[str, Any]:
    """Run every requested mode side by side on one workload and return the JSON-serializable result.

    With ``compute="accel"`` the consumers' compute is first calibrated alone in this process
    (:func:`calibrate_compute`, before any server or consumer process starts), then every consumer waits that
    long instead of computing; ``compute="cpu"`` trains the tiny model on the CPU (:data:`COMPUTE_MEASURES` says
    what each measures). The result holds, beside the per-run tables, a summary under the key named by
    ``compute`` (:func:`compute_summary`).

    Args:
        w: The workload (default: the fixed image one).
        modes: Subset of :data:`MODES` (run in that order).
        shared_modes: Modes also run with :class:`~knitdata.encoder.SharedEncoding`.
        controls: Process modes (``transferqueue``, ``transferqueue_best``, ``sample``, ``eager``, ``iter``) also
            run alone afterwards, each with the encodings it ran with (default: every process mode that ran).
        control_encodings: The encodings the controls run with (when the mode ran with them).
        tq_best_variants: How ``transferqueue_best`` drives transferqueue (subset of :data:`TQ_BEST_VARIANTS`);
            the variant with the lower exposed latency is reported per encoding.
        loader_workers: ``num_workers`` of transferqueue's streaming loader (variant ``loader``).
        cfg: The model the consumers train.
        gpu_tflops: Effective GPU rate for the projection.
        tq_units: transferqueue SimpleStorage units.
        timeout_s: Limit per run (consumers that do not finish raise :class:`~knitdata.errors.EngineError`).
        progress: Show tqdm bars.
        log: Where to print notes (default: stderr).
        compute: ``"accel"`` (compute as a calibrated wait) or ``"cpu"`` (compute on the CPU).
        calibration_reps: Timed steps per encoding of the calibration (``accel``).
        interleave: Run the process modes interleaved step by step before running each alone; ``False``: each
            alone only (what fits in memory at the seed's omni size).

    Raises:
        ConfigError: Unknown modes, variants or compute mode.
        LoopbackError: transferqueue or Ray listens on a non-loopback address.
        EngineError: Consumers failed or timed out.
    """
    from tqdm import tqdm

    w = w or TransferWorkload()
    if compute not in COMPUTE_MODES:
        raise ConfigError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")
    if "ray" not in sys.modules:
        # Keeps Ray (and transferqueue's servers) on 127.0.0.1 on this kind of machine.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    _tq_patience()
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"unknown modes {bad}; choose from {MODES}")
    bad = [v for v in tq_best_variants if v not in TQ_BEST_VARIANTS]
    if bad or not tq_best_variants:
        raise ConfigError(f"tq_best_variants must be a non-empty subset of {TQ_BEST_VARIANTS}, got {list(tq_best_variants)}")
    modes = [m for m in MODES if m in modes]
    process_modes = ("transferqueue", "transferqueue_best", "sample", "eager", "iter")
    controls = [m for m in (controls if controls is not None else process_modes) if m in modes]
    bad = [m for m in controls if m not in process_modes]
    if bad:
        raise ConfigError(f"controls must be process modes {process_modes}, got {bad}")
    if not interleave:  # every process mode runs alone, with every encoding it runs with
        controls = [m for m in process_modes if m in modes]
        control_encodings = ENCODINGS
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    machine = _machine()  # the load average before anything of the benchmark runs
    runs: list[tuple[str, str]] = [(m, "dup") for m in modes] + [(m, "shared") for m in modes if m in shared_modes]
    calibration: dict[str, Any] | None = None
    if compute == "accel":
        # Alone, before any server, consumer process or FLOP count starts: what the compute costs on this machine.
        encs = [e for e in ENCODINGS if any(r[1] == e for r in runs)]
        say(f"calibrating the compute ({', '.join(encs)}; {calibration_reps} timed steps each, one torch thread)")
        calibration = calibrate_compute(w, cfg, encs, reps=calibration_reps)
        say("calibrated compute per step: " + ", ".join(f"{e} {calibration[e]['step_s']:.3f} s" for e in encs))
    result: dict[str, Any] = {
        "benchmark": "transfer",
        "compute": compute,
        "compute_measures": COMPUTE_MEASURES[compute],
        "interleaved_run": interleave,
        "workload": w.to_dict(),
        "model": cfg.to_dict(),
        "machine": machine,
        "modes": {},
        "controls": {},
        "runs": [],
        "control_runs": [],
        "notes": [],
        "startup_s": {},
        "exposed_latency_counts": (
            "every data call the trainer makes per step: knitdata: next() per micro-batch, then state_dict() and "
            "commit() after the optimizer step; transferqueue: its get_meta + get_data (sync), or next() of its "
            "prefetching client or streaming loader (its controller records consumption at get_meta: no state "
            "call per step)"),
        "transferqueue_best_variants": {
            "async": "AsyncTransferQueueClient in a background thread of each consumer, fetching and processing "
                     "2 micro-batches ahead (shared encoding: one step ahead, the step's media batch built there)",
            "loader": f"transferqueue's StreamingDataset + StreamingDataLoader (num_workers={loader_workers}, "
                      "prefetch_factor=2, spawn), batch = the rank's share of a step, rows processed in its "
                      "collate_fn",
        },
    }
    if calibration is not None:
        result["calibration"] = calibration
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        result["notes"].append("ray is not installed: transferqueue, sample, eager and iter (consumer processes) "
                               "skipped; install the 'ray' and 'baseline' extras")
        say(result["notes"][-1])
        runs = [r for r in runs if r[0] == "iter_embedded"]
    pool: _WorkerPool | None = None

    def bar(label: str) -> Any:
        return tqdm(total=w.total_steps, desc=f"{label:<22}", disable=not progress, leave=False, file=sys.stderr)

    def record(mode: str, encoding: str, recs: Any, extras: Any, expected: set[str] | None, engine: str,
               control: bool = False, variant: str | None = None, **extra: Any) -> None:
        s = summarize_mode(recs, w, expected)
        s["run_wall_s"] = sum(max(r[i].step_s for r in recs) for i in range(w.total_steps))
        if s["bytes_moved_per_step"] is None:
            s["bytes_moved_per_step"] = _bytes_moved_from_metrics(extras, w)
        s.update(mode=mode, encoding=encoding, engine=engine, **extra)
        srcs = sorted({str(e.get("wait_source")) for e in extras if e.get("wait_source")})
        s["wait_source"] = ",".join(srcs) if srcs else "unavailable"
        if variant is not None:
            s["variant"] = variant
        result["control_runs" if control else "runs"].append(s)
        top = result["controls" if control else "modes"].setdefault(mode, {})
        if variant is not None:
            top = top.setdefault("variants", {}).setdefault(variant, {})
        if encoding == "dup":
            top.update(s)
        else:
            top["shared"] = s

    t_mark = time.perf_counter()

    def mark(label: str) -> None:
        nonlocal t_mark
        now = time.perf_counter()
        result["timeline_s"].append([label, round(now - t_mark, 3)])
        t_mark = now

    result["timeline_s"] = []
    cluster = _RayCluster(_object_store_bytes(w, interleave, sum(1 for m, _ in runs if m in ("sample", "eager", "iter"))))
    result["ray_object_store_bytes"] = cluster.object_store_bytes
    # FLOPs are counted (meta device) while servers start, never while a run is measured.
    from concurrent.futures import ThreadPoolExecutor

    flops_pool = ThreadPoolExecutor(1, thread_name_prefix="knitdata-bench-flops")
    flops_job = flops_pool.submit(_count_flops, w, cfg)

    def before_measuring() -> None:
        if not flops_job.done():
            flops_job.result()
            mark("flop counts (waited)")

    def tq_sources(mode: str, enc: str, prefix: str) -> list[dict[str, Any]]:
        assert server is not None
        if mode == "transferqueue":
            return [{"name": f"transferqueue/{enc}", "kind": "transferqueue", "conf": server.conf, "encoding": enc,
                     "task": f"{prefix}sync_{enc}", "mode": mode}]
        return [{"name": f"tq_{v}/{enc}", "kind": f"tq_{v}", "conf": server.conf, "encoding": enc,
                 "task": f"{prefix}{v}_{enc}", "mode": mode, "variant": v, "num_workers": loader_workers}
                for v in tq_best_variants]

    def run_sources(sources: list[dict[str, Any]], label: str, control: bool) -> None:
        assert pool is not None
        before_measuring()
        job = {"sources": sources, **_job_base(w, cfg, "dup"), "compute": compute, "calibration": calibration}
        say(f"{label}: " + ", ".join(x["name"] for x in sources))
        with tqdm(total=w.total_steps * len(sources), desc=label[:22], disable=not progress, leave=False,
                  file=sys.stderr) as pb:
            recs, extras = pool.run(job, timeout_s * len(sources), pb)
        for x in sources:
            name = x["name"]
            enc = x["encoding"]
            ex = extras[name]
            if x["kind"] == "knitdata":
                moved = cluster.engine_bytes_fetched(x["pipeline"])
                if moved is not None:
                    ex = [{"metrics": {"bytes_fetched": moved if r == 0 else 0}} for r in range(len(ex))]
                record(x["fetch"], enc, recs[name], ex, expected_of[x["fetch"]], "ray (consumer processes; "
                       "knitdata.engines.ray)", control=control, interleaved=not control, via="ray_engine",
                       prepare_s=x.get("prepare_s"))
            else:
                record(x["mode"], enc, recs[name], ex, expected_of["transferqueue"],
                       "transferqueue (Ray actors, ZMQ on loopback)", control=control, variant=x.get("variant"),
                       interleaved=not control)

    expected_of: dict[str, set[str]] = {}
    server: _TQServer | None = None
    try:
        need_pool = any(m in process_modes for m, _ in runs)
        if need_pool:
            t0 = time.perf_counter()
            pool = _WorkerPool(w.num_consumers)
            result["startup_s"]["consumer_processes_spawned"] = time.perf_counter() - t0
        # Sources of the process modes, all prepared first (start-up, not measured), then run interleaved step by
        # step in the same consumer processes: transferqueue (sync; best: async client and streaming loader), then
        # knitdata sample/eager/iter. Then each control alone.
        sources: list[dict[str, Any]] = []
        try:
            tq_runs = [r for r in runs if r[0] in ("transferqueue", "transferqueue_best")]
            if tq_runs:
                try:
                    import tensordict  # noqa: F401
                    import transfer_queue  # noqa: F401
                except ImportError as e:
                    result["notes"].append(f"transferqueue is not installed ({e}); its modes are skipped. "
                                           "Install the 'baseline' extra: pip install 'knitdata[baseline]'")
                    say(result["notes"][-1])
                    runs = [r for r in runs if r not in tq_runs]
                    tq_runs = []
                else:
                    server = _TQServer(w, tq_units)
                    server.start(cluster)
                    mark("ray + transferqueue start")
                    result["transferqueue"] = {"addresses": server.addresses, "storage_units": tq_units,
                                               "startup_s": server.startup_s,
                                               "partitions": "one per consumer rank (its share of every step, "
                                                             "in order); each source reads under its own task_name"}
                    say(f"transferqueue up in {server.startup_s:.1f} s on {server.addresses}")
                    expected_of["transferqueue"] = server.put_all()
                    mark("transferqueue put")
                    result["transferqueue"]["put_s"] = server.put_s
                    result["startup_s"]["transferqueue"] = server.startup_s + server.put_s
                    if interleave:
                        for mode, enc in tq_runs:
                            sources += tq_sources(mode, enc, "")
            ray_runs = [r for r in runs if r[0] in ("sample", "eager", "iter")] if interleave else []
            if ray_runs:
                result["process_modes_via"] = {"ray_engine": _PROCESS_MODES_ENGINE}
                cluster.start()
                for mode, enc in ray_runs:
                    job, expected, prep_s = cluster.prepare_engine(w)
                    sources.append({**job, "name": f"{mode}/{enc}", "fetch": mode, "encoding": enc,
                                    "prepare_s": prep_s})
                    expected_of[mode] = expected
                    mark(f"prepare {mode}/{enc} (ray_engine)")
            if sources:
                run_sources(sources, "interleaved", control=False)
                mark("run process modes (interleaved)")
            cluster.finish_runs()  # frees the object store before the controls
            # Controls: each process mode alone (same consumer processes, nothing interleaved); transferqueue's
            # first, then its servers stop (their memory back) before knitdata's pipelines fill.
            ctl = [r for r in runs if r[0] in controls and r[1] in control_encodings]
            ctl.sort(key=lambda r: r[0] not in ("transferqueue", "transferqueue_best"))
            if ctl:
                result["controls_note"] = (
                    ("each mode alone in the same consumer processes after the interleaved run" if interleave else
                     "each mode alone in the same consumer processes (no interleaved run)")
                    + " (a fresh knitdata pipeline; transferqueue re-read under new task names)")
            for mode, enc in ctl:
                if mode in ("transferqueue", "transferqueue_best"):
                    srcs = tq_sources(mode, enc, "ctl_")
                else:
                    if server is not None:
                        server.close()
                        server = None
                        mark("transferqueue stop")
                    job, expected, prep_s = cluster.prepare_engine(w)
                    srcs = [{**job, "name": f"{mode}/{enc}", "fetch": mode, "encoding": enc, "prepare_s": prep_s}]
                    expected_of[mode] = expected
                for src in srcs:  # the variants of transferqueue_best also run one at a time
                    run_sources([src], f"alone {src['name']}", control=True)
                    mark(f"control {src['name']}")
                cluster.finish_runs()
        finally:
            if server is not None:
                server.close()
            cluster.finish_runs()
        result["startup_s"]["ray"] = cluster.startup_s
        cluster.close()
        if pool is not None:
            pool.close()
            pool = None
        mark("ray shutdown")
        # iter on the embedded engine (always alone).
        for mode, enc in [r for r in runs if r[0] == "iter_embedded"]:
            before_measuring()
            with bar(f"{mode}/{enc}") as pb:
                e_recs, e_extras, expected, info = _run_embedded(w, cfg, "iter", enc, timeout_s, pb, compute=compute,
                                                                 calibration=calibration)
            record(mode, enc, e_recs, e_extras, expected, "embedded (consumer threads)", **info)
            mark(f"run {mode}/{enc}")
    finally:
        cluster.close()
        if pool is not None:
            pool.close()
        torch.set_num_threads(threads_before)

    _pick_tq_best(result["modes"])
    _pick_tq_best(result["controls"])
    _add_speedups(result, flops_job.result(), gpu_tflops)
    flops_pool.shutdown()
    try:
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    result[compute] = compute_summary(result)
    result["total_s"] = time.perf_counter() - t_start
    return result


def _object_store_bytes(w: TransferWorkload, interleave: bool, knitdata_runs: int) -> int:
    """Ray's object store for the run: 4 GiB, or what the knitdata pipelines held at once need (all of them when
    interleaved, one when each runs alone) plus a quarter, at most half of this machine's memory."""
    held = (knitdata_runs if interleave else 1) * w.total_steps * w.trajectories_per_step * w.trajectory_bytes
    want = max(4 << 30, int(held * 1.25))
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return want
    return int(min(want, max(4 << 30, phys // 2)))


def _pick_tq_best(modes: dict[str, Any]) -> None:
    """``transferqueue_best``: per encoding, the variant with the lower exposed latency (all variants kept)."""
    best = modes.get("transferqueue_best")
    if not best or "variants" not in best:
        return
    variants = best["variants"]
    for enc in ENCODINGS:
        cands = [(v, d if enc == "dup" else d.get("shared")) for v, d in variants.items()]
        cands = [(v, d) for v, d in cands if d and "exposed_latency_s" in d]
        if not cands:
            continue
        v, d = min(cands, key=lambda c: c[1]["exposed_latency_s"])
        chosen = {**d, "chosen_variant": v,
                  "variants_exposed_ms": {vv: dd["exposed_latency_s"] * 1e3 for vv, dd in cands},
                  "variants_step_s": {vv: dd["step_s"] for vv, dd in cands}}
        if enc == "dup":
            best.update(chosen)
        else:
            best["shared"] = chosen


def _cell(d: Mapping[str, Any] | None, source: str) -> dict[str, Any] | None:
    if not d or "step_s" not in d:
        return None
    return {"step_s": d["step_s"], "exposed_ms": d["exposed_latency_s"] * 1e3,
            "exposed_max_ms": d["exposed_latency_max_s"] * 1e3, "compute_s": d["compute_s"],
            "source": source + (f" ({d['chosen_variant']})" if d.get("chosen_variant") else ""),
            "exactly_once": d.get("exactly_once")}


def _two_by_two(m: Mapping[str, Any], it_name: str | None) -> dict[str, Any]:
    tq = m.get("transferqueue_best")
    it = m.get(it_name) if it_name else None
    cells = {
        "tq_dup": _cell(tq, "transferqueue_best"),
        "tq_shared": _cell((tq or {}).get("shared"), "transferqueue_best"),
        "iter_dup": _cell(it, str(it_name)),
        "iter_shared": _cell((it or {}).get("shared"), str(it_name)),
    }
    out: dict[str, Any] = {k: v for k, v in cells.items()}
    s = {k: (v or {}).get("step_s") for k, v in cells.items()}
    out["effects"] = {
        "transfer_dup": _ratio(s["tq_dup"], s["iter_dup"]),
        "transfer_shared": _ratio(s["tq_shared"], s["iter_shared"]),
        "encoding_tq": _ratio(s["tq_dup"], s["tq_shared"]),
        "encoding_iter": _ratio(s["iter_dup"], s["iter_shared"]),
        "both": _ratio(s["tq_dup"], s["iter_shared"]),
        "note": "ratios of step times: transfer_* = transferqueue_best / knitdata iter at one encoding; "
                "encoding_* = dup / shared on one system; both = transferqueue_best+dup / iter+shared",
    }
    return out


def _add_speedups(result: dict[str, Any], flops: Mapping[str, Any], gpu_tflops: float) -> None:
    m = result["modes"]
    tq = m.get("transferqueue")
    tqb = m.get("transferqueue_best")
    it_name = ("iter" if "iter" in m or "iter" in result.get("controls", {}) else
               ("iter_embedded" if "iter_embedded" in m else None))
    it = m.get(it_name) if it_name else None
    it_sh = (it or {}).get("shared")
    g = lambda d, k: None if d is None else d.get(k)  # noqa: E731
    for d in list(m.values()) + list(result.get("controls", {}).values()):
        for x in (d, d.get("shared")):
            if x and "exposed_latency_s" in x:
                x["exposed_ms"] = x["exposed_latency_s"] * 1e3
    result["iter_reference_mode"] = it_name
    result["latency_ratio_transferqueue_vs_iter"] = _ratio(g(tq, "exposed_latency_s"), g(it, "exposed_latency_s"))
    result["latency_ratio_transferqueue_best_vs_iter"] = _ratio(g(tqb, "exposed_latency_s"),
                                                                g(it, "exposed_latency_s"))
    c = result.get("controls", {})
    c_it = c.get(it_name) if it_name in ("iter",) else m.get("iter_embedded")
    result["latency_ratio_transferqueue_best_vs_iter_alone"] = _ratio(
        g(c.get("transferqueue_best"), "exposed_latency_s"), g(c_it, "exposed_latency_s"))
    frac = _ratio(g(it, "exposed_latency_s"), g(tq, "exposed_latency_s"))
    result["iter_latency_fraction_of_transferqueue"] = frac
    result["acceptance_iter_latency_le_1pct"] = None if frac is None else frac <= 0.01
    result["speedup_transfer"] = _ratio(g(tq, "step_s"), g(it, "step_s"))
    result["speedup_transfer_vs_best"] = _ratio(g(tqb, "step_s"), g(it, "step_s"))
    result["speedup_encoding"] = _ratio(g(it, "step_s"), g(it_sh, "step_s"))
    result["speedup_end_to_end_cpu"] = _ratio(g(tq, "step_s"), g(it_sh, "step_s"))
    result["speedup_end_to_end_cpu_vs_best"] = _ratio(g(tqb, "step_s"), g(it_sh, "step_s"))
    result["end_to_end"] = _two_by_two(m, it_name)
    if c:
        result["end_to_end_alone"] = _two_by_two({**c, "iter_embedded": m.get("iter_embedded")}, it_name)
    proj = _gpu_projection(flops, gpu_tflops, g(tqb, "exposed_latency_s") if tqb else g(tq, "exposed_latency_s"),
                           g(it, "exposed_latency_s"), g(it_sh, "exposed_latency_s"))
    proj["baseline"] = "transferqueue_best" if tqb else "transferqueue"
    result["speedup_end_to_end_projected_gpu"] = proj
    result["gpu_projection"] = proj
    result["exactly_once_all_runs"] = all(r["exactly_once"] for r in result["runs"] + result.get("control_runs", []))


# ---------------------------------------------------------------------------------------------- summary by call
#: The project's acceptance targets for the data path (``compute_summary(...)["acceptance"]``): name -> (ratio or
#: figure key, comparison, threshold, the workload it is judged on: ``image``, or ``omni_seed`` -- the omni workload
#: at the seed's size).
ACCEPTANCE: dict[str, tuple[str, str, float, str]] = {
    "iter_exposed_ms_le_0.15": ("iter_exposed_ms", "<=", 0.15, "image"),
    "exposed_transferqueue_best_over_iter_ge_5": ("exposed_transferqueue_best_over_iter", ">=", 5.0, "image"),
    "exposed_transferqueue_over_iter_ge_100": ("exposed_transferqueue_over_iter", ">=", 100.0, "image"),
    "step_iter_over_transferqueue_best_dup_le_1": ("step_iter_over_transferqueue_best_dup", "<=", 1.0, "image"),
    "step_iter_over_transferqueue_best_shared_le_1": ("step_iter_over_transferqueue_best_shared", "<=", 1.0,
                                                      "image"),
    "exposed_iter_embedded_over_iter_le_1": ("exposed_iter_embedded_over_iter", "<=", 1.0, "image"),
    "end_to_end_transferqueue_dup_over_iter_shared_ge_5.8": ("end_to_end_transferqueue_dup_over_iter_shared", ">=",
                                                             SEED_SPEEDUP, "omni_seed"),
    "end_to_end_transferqueue_best_dup_over_iter_shared_ge_1.5": (
        "end_to_end_transferqueue_best_dup_over_iter_shared", ">=", 1.5, "omni_seed"),
}

#: What each ratio of ``compute_summary(...)["ratios"]`` divides (dup encoding unless the name says shared).
RATIO_MEANING: dict[str, str] = {
    "exposed_transferqueue_best_over_iter": "exposed ms per step, transferqueue_best / knitdata iter (Ray), dup",
    "exposed_transferqueue_best_over_iter_shared": "the same with shared encoding",
    "exposed_transferqueue_over_iter": "exposed ms per step, transferqueue synchronous / knitdata iter (Ray), dup",
    "step_iter_over_transferqueue_best_dup": "step time, knitdata iter / transferqueue_best, both dup",
    "step_iter_over_transferqueue_best_shared": "step time, knitdata iter / transferqueue_best, both shared",
    "end_to_end_transferqueue_dup_over_iter_shared": "step time, transferqueue synchronous + dup / iter + shared "
                                                     "(transfer plus training)",
    "end_to_end_transferqueue_best_dup_over_iter_shared": "step time, transferqueue_best + dup / iter + shared",
    "end_to_end_transferqueue_best_shared_over_iter_shared": "step time, transferqueue_best + shared / iter + shared",
    "exposed_iter_embedded_over_iter": "exposed ms per step, iter on the embedded engine / iter on the Ray engine, "
                                       "dup",
}


def _summary_entry(d: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """One run's figures for the summary: exposed ms, step s, compute s, the breakdown by call."""
    if not d or "step_s" not in d:
        return None
    e: dict[str, Any] = {"exposed_ms": d["exposed_latency_s"] * 1e3, "exposed_max_ms": d["exposed_latency_max_s"] * 1e3,
                         "step_s": d["step_s"], "compute_s": d["compute_s"]}
    e.update(d.get("breakdown_ms") or {})
    e.update(exactly_once=d.get("exactly_once"), wait_source=d.get("wait_source"))
    if d.get("chosen_variant") or d.get("variant"):
        e["variant"] = d.get("chosen_variant") or d.get("variant")
    return e


def _summary_section(modes: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in MODES:
        e = _summary_entry(modes.get(m))
        if e is None:
            continue
        sh = _summary_entry((modes.get(m) or {}).get("shared"))
        if sh is not None:
            e["shared"] = sh
        out[m] = e
    return out


_BREAKDOWN_KEYS = ("wait_ms", "own_ms", "state_dict_ms", "commit_ms", "next_ms", "exposed_ms")


def _breakdown(section: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m, e in section.items():
        b = {k: e.get(k) for k in _BREAKDOWN_KEYS}
        if isinstance(e.get("shared"), dict):
            b["shared"] = {k: e["shared"].get(k) for k in _BREAKDOWN_KEYS}
        out[m] = b
    return out


def _end_to_end(section: Mapping[str, Any]) -> dict[str, Any]:
    """The 2x2 step times (transferqueue_best / iter x dup / shared), plus transferqueue synchronous + dup."""
    def cell(m: str, enc: str) -> dict[str, Any] | None:
        e = section.get(m)
        if enc == "shared":
            e = (e or {}).get("shared")
        if not e:
            return None
        c = {"step_s": e["step_s"], "exposed_ms": e["exposed_ms"], "compute_s": e["compute_s"], "source": m}
        if e.get("variant"):
            c["variant"] = e["variant"]
        return c

    return {"tq_dup": cell("transferqueue_best", "dup"), "tq_shared": cell("transferqueue_best", "shared"),
            "iter_dup": cell("iter", "dup"), "iter_shared": cell("iter", "shared"),
            "tq_sync_dup": cell("transferqueue", "dup"),
            "note": "tq_* = transferqueue_best (its better variant per encoding), iter_* = knitdata iter on the Ray "
                    "engine, tq_sync_dup = transferqueue driven synchronously with dup encoding"}


def _ratios(section: Mapping[str, Any]) -> dict[str, float | None]:
    def get(m: str, key: str, enc: str = "dup") -> float | None:
        e = section.get(m)
        if enc == "shared":
            e = (e or {}).get("shared")
        v = (e or {}).get(key)
        return float(v) if isinstance(v, (int, float)) else None

    ex, st = "exposed_ms", "step_s"
    return {
        "exposed_transferqueue_best_over_iter": _ratio(get("transferqueue_best", ex), get("iter", ex)),
        "exposed_transferqueue_best_over_iter_shared": _ratio(get("transferqueue_best", ex, "shared"),
                                                              get("iter", ex, "shared")),
        "exposed_transferqueue_over_iter": _ratio(get("transferqueue", ex), get("iter", ex)),
        "step_iter_over_transferqueue_best_dup": _ratio(get("iter", st), get("transferqueue_best", st)),
        "step_iter_over_transferqueue_best_shared": _ratio(get("iter", st, "shared"),
                                                           get("transferqueue_best", st, "shared")),
        "end_to_end_transferqueue_dup_over_iter_shared": _ratio(get("transferqueue", st), get("iter", st, "shared")),
        "end_to_end_transferqueue_best_dup_over_iter_shared": _ratio(get("transferqueue_best", st),
                                                                     get("iter", st, "shared")),
        "end_to_end_transferqueue_best_shared_over_iter_shared": _ratio(get("transferqueue_best", st, "shared"),
                                                                        get("iter", st, "shared")),
        "exposed_iter_embedded_over_iter": _ratio(get("iter_embedded", ex), get("iter", ex)),
    }


def _workload_kind(w: Mapping[str, Any]) -> str:
    if w.get("workload") != "omni":
        return "image"
    seed = (w.get("video_frames") == SEED_OMNI_FRAMES and w.get("frame_px") == SEED_OMNI_PX
            and float(w.get("audio_seconds", 0)) >= 30.0)
    return "omni_seed" if seed else "omni"


def compute_summary(result: Mapping[str, Any]) -> dict[str, Any]:
    """The summary of a run stored under ``result[result["compute"]]`` (``accel`` or ``cpu``).

    ``alone`` (each mode run alone: the controls, and ``iter_embedded``) and ``interleaved`` map each mode of
    :data:`MODES` to ``exposed_ms``, ``step_s``, ``compute_s``, the breakdown of the exposed time by call
    (``next_ms`` = ``wait_ms`` + ``own_ms``, then ``state_dict_ms`` and ``commit_ms``) and the same for
    ``shared`` encoding; ``breakdown`` repeats the by-call figures of ``alone`` (``breakdown_interleaved``: of
    ``interleaved``); ``end_to_end_alone`` / ``end_to_end_interleaved`` hold the 2x2 step times; ``ratios``
    (from the alone runs; ``ratios_interleaved``) and ``acceptance`` the targets of :data:`ACCEPTANCE`. Every
    figure is a median over the measured steps of the per-step mean over consumers (step time: the slowest
    consumer).
    """
    compute = str(result.get("compute", "cpu"))
    modes = dict(result.get("modes") or {})
    controls = dict(result.get("controls") or {})
    alone_src = {**controls}
    if "iter_embedded" in modes:
        alone_src["iter_embedded"] = modes["iter_embedded"]  # always alone: it runs after the process modes
    alone = _summary_section(alone_src)
    inter = _summary_section({k: v for k, v in modes.items() if k != "iter_embedded"})
    ratios = _ratios(alone)
    kind = _workload_kind(result.get("workload") or {})
    acc: dict[str, Any] = {}
    it = alone.get("iter") or {}
    for name, (key, op, thr, applies) in ACCEPTANCE.items():
        v = it.get("exposed_ms") if key == "iter_exposed_ms" else ratios.get(key)
        met = None if v is None else (v <= thr if op == "<=" else v >= thr)
        acc[name] = {"value": v, "op": op, "threshold": thr, "met": met, "judged_on": applies,
                     "applies": applies == kind}
    m = result.get("machine") or {}
    out: dict[str, Any] = {
        "measures": COMPUTE_MEASURES.get(compute, ""),
        "workload_kind": kind,
        "medians": "each figure: median over the measured steps of the per-step mean over consumers (step_s: the "
                   "slowest consumer); the parts of the breakdown are medians of their own, so they need not add "
                   "up to exposed_ms",
        "breakdown_calls": {
            "wait_ms": "next() blocked until the micro-batch was ready (knitdata: its ConsumerMetrics; "
                       "transferqueue: see wait_source per mode)",
            "own_ms": "the rest of next(): the data system's own work on the trainer's thread",
            "state_dict_ms": "state_dict() after the optimizer step (knitdata; transferqueue has none)",
            "commit_ms": "commit() after the optimizer step (knitdata; transferqueue has none)",
            "next_ms": "every next() of the step (wait_ms + own_ms)",
        },
        "wait_sources": {k: v for k, v in _WAIT_SOURCES.items()
                         if any(k in str(e.get("wait_source", "")).split(",") for sec in (alone, inter)
                                for x in sec.values() for e in (x, x.get("shared") or {}))},
        "alone": alone,
        "interleaved": inter,
        "breakdown": _breakdown(alone),
        "breakdown_interleaved": _breakdown(inter),
        "end_to_end_alone": _end_to_end(alone),
        "end_to_end_interleaved": _end_to_end(inter),
        "ratios": ratios,
        "ratios_interleaved": _ratios(inter),
        "ratio_meaning": RATIO_MEANING,
        "acceptance": acc,
        "loadavg": {"start": m.get("loadavg_at_start"), "end": m.get("loadavg_at_end")},
    }
    cal = result.get("calibration")
    if compute == "accel" and isinstance(cal, Mapping):
        out["calibration"] = {k: v for k, v in cal.items() if k not in ENCODINGS}
        for enc in ENCODINGS:
            if isinstance(cal.get(enc), Mapping):
                c = cal[enc]
                out["calibration"][enc] = {"microbatch_s": c["microbatch_s"], "optimizer_step_s": c["optimizer_step_s"],
                                           "step_s": c["step_s"]}
        out["loadavg"]["calibration"] = [cal.get("loadavg_before"), cal.get("loadavg_after")]
    return out


# ---------------------------------------------------------------------------------------------- report
def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _short_engine(r: Mapping[str, Any]) -> str:
    via = r.get("via")
    if via:
        return "ray_engine"
    return str(r["engine"]).split(" ")[0]


def _run_label(r: Mapping[str, Any]) -> str:
    if r.get("variant"):
        return f"tq_best.{r['variant']}"
    return str(r["mode"])


def _run_rows(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        f"{'mode':<19}{'encoding':<9}{'engine':<13}{'exposed ms':>11}{'wait ms':>9}{'own ms':>8}{'state ms':>9}"
        f"{'commit ms':>10}{'max ms':>9}{'step s':>8}"
        f"{'compute s':>10}{'moved MiB':>10}{'trainer MiB':>12}{'delivered':>10}{'lost':>5}{'dup':>5}",
    ]
    mib = 1 << 20
    for r in runs:
        b = r.get("breakdown_ms") or {}
        lines.append(
            f"{_run_label(r):<19}{r['encoding']:<9}{_short_engine(r):<13}"
            f"{_fmt(r['exposed_latency_s'] * 1e3, '.2f'):>11}{_fmt(b.get('wait_ms'), '.2f'):>9}"
            f"{_fmt(b.get('own_ms'), '.2f'):>8}{_fmt(b.get('state_dict_ms'), '.3f'):>9}"
            f"{_fmt(b.get('commit_ms'), '.3f'):>10}"
            f"{_fmt(r['exposed_latency_max_s'] * 1e3, '.2f'):>9}"
            f"{_fmt(r['step_s'], '.3f'):>8}{_fmt(r['compute_s'], '.3f'):>10}"
            f"{_fmt(None if r['bytes_moved_per_step'] is None else r['bytes_moved_per_step'] / mib, '.1f'):>10}"
            f"{_fmt(r['bytes_to_trainer_per_step'] / mib, '.1f'):>12}{r['delivered']:>10}{r['lost']:>5}"
            f"{r['duplicated']:>5}"
        )
    return lines


def _describe_media(w: Mapping[str, Any]) -> str:
    if w.get("workload") == "omni":
        return (f"a {w['video_frames']}-frame {w['frame_px']}x{w['frame_px']} uint8 video and a "
                f"{w['audio_seconds']:g} s {w['audio_rate']} Hz FLAC audio clip per group")
    return f"one {'x'.join(map(str, w['image_shape']))} uint8 image per group"


def format_table(result: Mapping[str, Any]) -> str:
    """The printed table and summary."""
    w = result["workload"]
    if result.get("gpu"):
        where = "knitdata modes on the embedded engine, training on CUDA"
    else:
        where = (("Process modes ran interleaved step by step in the same consumer processes, then each control "
                  "alone" if result.get("interleaved_run", True) else "Each process mode ran alone in the same "
                  "consumer processes") + "; iter_embedded (threads of one process) ran after them. Compute: "
                 f"{result.get('compute', 'cpu')} -- measures {COMPUTE_MEASURES.get(result.get('compute', 'cpu'), '')}")
    lines = [
        f"transfer benchmark ({w.get('workload', 'image')}): {w['groups_per_step']} groups x n={w['group_size']} "
        f"trajectories of {w['tokens']} tokens, {_describe_media(w)}; {w['num_consumers']} consumers x "
        f"{w['microbatches_per_step']} micro-batches of {w['microbatch_size']}; {w['warmup_steps']} warm-up + "
        f"{w['steps']} measured steps; medians per step. {where}. Exposed = every data call of the trainer per "
        "step: next() (waiting for data + own work), then knitdata's state_dict() and commit().",
        "",
    ]
    cal = result.get("calibration")
    if isinstance(cal, Mapping):
        lines += ["calibrated compute (alone, one torch thread, median of "
                  f"{cal.get('reps')} steps): " + "; ".join(
                      f"{e}: " + " + ".join(f"{x * 1e3:.1f}" for x in cal[e]["microbatch_s"])
                      + f" ms per micro-batch, {cal[e]['optimizer_step_s'] * 1e3:.1f} ms optimizer step"
                      for e in ENCODINGS if isinstance(cal.get(e), Mapping)), ""]
    lines += _run_rows(result["runs"])
    if result.get("control_runs"):
        lines += ["", "controls (each mode alone):"] + _run_rows(result["control_runs"])
    for key, title in (("end_to_end", "interleaved"), ("end_to_end_alone", "alone")):
        e = result.get(key)
        if not e or not any(e.get(c) for c in ("tq_dup", "tq_shared", "iter_dup", "iter_shared")):
            continue
        lines += ["", f"2x2 step time ({title}): transfer x encoding"]
        lines.append(f"{'':<22}{'dup':>22}{'shared':>22}")
        for sysname, a, b in (("transferqueue best", "tq_dup", "tq_shared"), ("knitdata iter", "iter_dup",
                                                                               "iter_shared")):
            def cell(c: Any) -> str:
                return "-" if not c else f"{c['step_s']:.3f} s ({c['exposed_ms']:.1f} ms)"
            lines.append(f"{sysname:<22}{cell(e.get(a)):>22}{cell(e.get(b)):>22}")
        ef = e.get("effects", {})
        lines.append(
            f"transfer effect {_fmt(ef.get('transfer_dup'), '.2f')}x (dup) / {_fmt(ef.get('transfer_shared'), '.2f')}x "
            f"(shared); encoding effect {_fmt(ef.get('encoding_tq'), '.2f')}x (transferqueue) / "
            f"{_fmt(ef.get('encoding_iter'), '.2f')}x (iter); both {_fmt(ef.get('both'), '.2f')}x")
    it = result.get("iter_reference_mode")
    if not result.get("gpu"):
        frac = result.get("iter_latency_fraction_of_transferqueue")
        lines += [
            "",
            f"exposed latency, transferqueue (sync) / {it}: {_fmt(result.get('latency_ratio_transferqueue_vs_iter'), '.1f')}x "
            f"({it} is {_fmt(None if frac is None else frac * 100, '.3f')}% of transferqueue; acceptance <= 1%: "
            f"{result.get('acceptance_iter_latency_le_1pct')})",
            f"exposed latency, transferqueue_best / {it}: "
            f"{_fmt(result.get('latency_ratio_transferqueue_best_vs_iter'), '.1f')}x interleaved, "
            f"{_fmt(result.get('latency_ratio_transferqueue_best_vs_iter_alone'), '.1f')}x alone",
            f"speedup, transfer alone (transferqueue sync vs {it}, dup):  {_fmt(result.get('speedup_transfer'), '.2f')}x; "
            f"vs transferqueue_best: {_fmt(result.get('speedup_transfer_vs_best'), '.2f')}x",
            f"speedup, encoding alone ({it}: dup vs SharedEncoding):           {_fmt(result.get('speedup_encoding'), '.2f')}x",
            f"speedup, both (transferqueue+dup vs {it}+SharedEncoding), CPU:   "
            f"{_fmt(result.get('speedup_end_to_end_cpu'), '.2f')}x (sync), "
            f"{_fmt(result.get('speedup_end_to_end_cpu_vs_best'), '.2f')}x (best)",
        ]
    summ = result.get(str(result.get("compute"))) if not result.get("gpu") else None
    if isinstance(summ, Mapping):
        lines += ["", f"ratios ({result.get('compute')} compute, each system alone):"]
        for k, v in summ.get("ratios", {}).items():
            lines.append(f"  {k}: {_fmt(v, '.2f')}")
        applies = [(k, a) for k, a in summ.get("acceptance", {}).items() if a.get("applies")]
        if applies:
            lines.append(f"acceptance targets judged on this workload ({summ.get('workload_kind')}):")
            for k, a in applies:
                lines.append(f"  {k}: {_fmt(a.get('value'), '.3f')} {a['op']} {a['threshold']:g}: "
                             f"{ {True: 'met', False: 'not met'}.get(a.get('met'), '-') }")
    p = result.get("speedup_end_to_end_projected_gpu") or {}
    pm = p.get("model", {})
    if pm.get("speedup") is not None:
        lines += [
            f"PROJECTED (not measured) on a GPU at {p['rate_tflops']:.0f} TFLOP/s ({GPU_VLM.name}, "
            f"{pm['params'] / 1e9:.1f}B params), baseline {p.get('baseline')}: "
            f"compute {pm['compute_s_dup']:.2f} s (dup) / {pm['compute_s_shared']:.2f} s (shared) per step; "
            f"end-to-end {pm['speedup']:.2f}x (transfer alone {_fmt(pm.get('speedup_transfer'), '.2f')}x, encoding "
            f"alone {_fmt(pm.get('speedup_encoding'), '.2f')}x) vs the seed's {SEED_SPEEDUP}x",
        ]
    lines.append(f"exactly-once in every run: {result.get('exactly_once_all_runs')}")
    m = result.get("machine", {})
    if m.get("loadavg_at_start"):
        la = ", ".join(f"{x:.2f}" for x in m["loadavg_at_start"])
        lb = ", ".join(f"{x:.2f}" for x in m.get("loadavg_at_end", []))
        lines.append(f"load average at start: {la}; at end: {lb or '-'} ({m.get('cpus')} CPUs)")
    for n in result.get("notes", []):
        lines.append(f"note: {n}")
    return "\n".join(lines)


def plot_result(result: Mapping[str, Any], path: str) -> None:
    """Exposed latency per mode (log scale) and step time split into exposed transfer and the rest."""
    from knitdata.errors import OptionalDependencyError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover
        raise OptionalDependencyError("matplotlib", "plot", "--plot") from e
    runs = list(result["runs"]) + [dict(r, encoding=r["encoding"] + "\nalone") for r in result.get("control_runs", [])]
    labels = [_run_label(r).replace("_embedded", "\n(embedded)").replace("tq_best.", "tq_best\n") + "\n"
              + r["encoding"] for r in runs]
    ex = [max(r["exposed_latency_s"], 1e-6) * 1e3 for r in runs]
    step = [r["step_s"] for r in runs]
    exs = [r["exposed_latency_max_s"] for r in runs]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(12, 0.75 * len(runs)), 9))
    w = result.get("workload", {})
    fig.suptitle(f"transfer benchmark, {w.get('workload', 'image')} workload: {_describe_media(w)}"
                 + (" (CUDA)" if result.get("gpu") else f" ({result.get('compute', 'cpu')} compute)"), fontsize=10)
    a1.bar(labels, ex, color="tab:red")
    a1.set_yscale("log")
    a1.set_ylabel("exposed latency per step (ms, log)")
    a1.set_title("exposed data calls per step: next(), plus knitdata's state_dict() + commit() (median)")
    a2.bar(labels, exs, color="tab:red", label="exposed transfer (slowest consumer)")
    a2.bar(labels, [max(0.0, s - e) for s, e in zip(step, exs)], bottom=exs, color="tab:blue",
           label="training compute and the rest")
    a2.set_ylabel("step time (s)")
    a2.set_title("transfer + training per step (median)")
    a2.legend(fontsize=8)
    for a in (a1, a2):
        a.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class GpuPreset:
    """The ``--gpu`` preset: knitdata's fetch modes on the embedded engine (no Ray), training on CUDA.

    Sized to finish within 5 minutes on one H200. Estimate (FLOPs counted by :func:`count_step_flops`, ``dup``,
    all 4 consumers): image, 6 runs x 13 steps x 9.3e13 FLOPs; omni (16 frames at 448 px), 6 runs x 7 steps x
    5.8e14 FLOPs; at an effective 100-200 TFLOP/s (TF32 matmuls) that is about 40-80 s (image) and 120-245 s
    (omni) of compute, plus filling the pipeline once per run. Not yet run on a GPU.

    Attributes:
        workload: The workload (the image workload's shapes by default).
        model: The model each consumer trains on the GPU.
        fetches: knitdata fetch modes, each on the embedded engine (recorded as ``<fetch>_embedded``).
        encodings: Encodings each fetch mode runs with.
        device: The torch device.
        budget_s: The wall-time budget the preset is sized for.
    """

    workload: TransferWorkload
    model: VLMConfig
    fetches: tuple[str, ...] = ("sample", "eager", "iter")
    encodings: tuple[str, ...] = ENCODINGS
    device: str = "cuda"
    budget_s: float = 300.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable fields."""
        return {"workload": self.workload.to_dict(), "model": self.model.to_dict(), "fetches": list(self.fetches),
                "encodings": list(self.encodings), "device": self.device, "budget_s": self.budget_s}


#: The model of the ``--gpu`` preset: a 0.16B-parameter VLM (attention in both towers, 2x2 patch merger).
GPU_PRESET_VLM = VLMConfig(name="0.16B-class VLM (GPU preset)", d_model=1024, layers=4, heads=16, mlp_ratio=4,
                           vocab=32768, patch=14, d_vision=768, vision_layers=6, vision_heads=12, vision_mlp_ratio=4,
                           merge=4)


def gpu_config(workload: str = "image", steps: int | None = None, warmup: int | None = None) -> GpuPreset:
    """The ``--gpu`` preset for ``workload`` (``"image"``: 3 + 10 steps; ``"omni"``: 16 frames at 448 px, 2 + 5 steps).

    Raises:
        ConfigError: Unknown workload, or non-positive steps.
    """
    if workload not in WORKLOADS:
        raise ConfigError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    omni = workload == "omni"
    kw: dict[str, Any] = {"steps": (5 if omni else 10) if steps is None else steps,
                          "warmup_steps": (2 if omni else 3) if warmup is None else warmup}
    if workload == "omni":
        w = omni_workload(16, 448, cfg=GPU_PRESET_VLM, **kw)
    else:
        w = TransferWorkload(**kw)
    return GpuPreset(workload=w, model=GPU_PRESET_VLM)


def require_cuda() -> None:
    """Raise unless torch sees a CUDA device.

    Raises:
        ConfigError: No CUDA device (CPU-only torch, or no GPU visible).
    """
    if not torch.cuda.is_available():
        raise ConfigError(
            f"--gpu trains on CUDA, but torch {torch.__version__} sees no CUDA device "
            f"(torch.cuda.is_available() is False; built with CUDA {torch.version.cuda}). Run it on a machine "
            "with a GPU and a CUDA build of torch, or drop --gpu for the CPU benchmark."
        )


def run_gpu_benchmark(preset: GpuPreset, *, timeout_s: float = 600.0, progress: bool = True,
                      log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """knitdata's fetch modes on the embedded engine, training on CUDA (measured, not projected).

    Raises:
        ConfigError: No CUDA device.
    """
    from tqdm import tqdm

    require_cuda()
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    w, cfg = preset.workload, preset.model
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "transfer", "gpu": True, "preset": preset.to_dict(), "workload": w.to_dict(),
        "model": cfg.to_dict(), "machine": {**_machine(), "gpu_name": torch.cuda.get_device_name()},
        "modes": {}, "controls": {}, "runs": [], "notes": ["measured on CUDA (not a projection); knitdata modes only, "
                                                         "embedded engine (consumer threads), no Ray"],
        "exposed_latency_counts": "next() per micro-batch plus state_dict() and commit() after the optimizer step",
    }
    for fetch in preset.fetches:
        for enc in preset.encodings:
            say(f"gpu: {fetch}_embedded/{enc}")
            with tqdm(total=w.total_steps, desc=f"{fetch}/{enc}", disable=not progress, leave=False,
                      file=sys.stderr) as pb:
                recs, extras, expected, info = _run_embedded(w, cfg, fetch, enc, timeout_s, pb, device=preset.device)
            s = summarize_mode(recs, w, expected)
            s.update(mode=f"{fetch}_embedded", encoding=enc, engine="embedded (consumer threads), CUDA", **info)
            result["runs"].append(s)
            top = result["modes"].setdefault(f"{fetch}_embedded", {})
            if enc == "dup":
                top.update(s)
            else:
                top["shared"] = s
    for d in result["modes"].values():
        for x in (d, d.get("shared")):
            if x:
                x["exposed_ms"] = x["exposed_latency_s"] * 1e3
    m = result["modes"]
    result["end_to_end"] = _two_by_two(m, "iter_embedded")
    result["exactly_once_all_runs"] = all(r["exactly_once"] for r in result["runs"])
    result["total_s"] = time.perf_counter() - t_start
    return result


# ---------------------------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``knitdata bench transfer``."""
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot")
    parser.add_argument("--workload", choices=WORKLOADS, default="image",
                        help="image: one 3x448x448 image per group; omni: a video (frames) and a 30 s 16 kHz "
                             "FLAC audio clip per group")
    parser.add_argument("--omni-frames", type=int, default=None,
                        help="omni: video frames (default 4; smoke 2; the seed's setting is 16)")
    parser.add_argument("--omni-px", type=int, default=None,
                        help="omni: frame side in px (default 224; smoke 112; the seed's setting is 448)")
    parser.add_argument("--omni-seed-size", action="store_true",
                        help=f"the omni workload at the seed's size: {SEED_OMNI_FRAMES} frames at {SEED_OMNI_PX} px and "
                             "30 s of 16 kHz audio per group (implies --workload omni; default 1 + 4 steps and "
                             "each mode alone, --no-interleave, so that one run's payloads fit in memory)")
    parser.add_argument("--compute", choices=COMPUTE_MODES, default="accel",
                        help="accel (default): each consumer's compute is a wait of its cost calibrated alone before "
                             "the run, so the host CPU is free as on a GPU node and the data path is what is "
                             "measured; cpu: the tiny model trains on the CPU beside the data path (on 2 cores this "
                             "mostly measures CPU contention)")
    parser.add_argument("--calibration-reps", type=int, default=None,
                        help="accel: timed steps per encoding when calibrating the compute (default 3; smoke 1)")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="run the process modes interleaved step by step before each alone (default: yes; "
                             "--omni-seed-size: no)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 10; smoke 1)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; smoke 1)")
    parser.add_argument("--smoke", action="store_true", help="a short run of every mode (CI; 2 consumers; < 240 s on 2 cores)")
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU preset: knitdata's modes on the embedded engine (no Ray) training on CUDA, "
                             "sized for < 5 min on one H200; fails clearly without CUDA")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run")
    parser.add_argument("--shared-modes", nargs="*", choices=MODES, default=None,
                        help="modes also run with SharedEncoding (default: transferqueue_best, iter, iter_embedded)")
    parser.add_argument("--controls", nargs="*", default=None,
                        choices=("transferqueue", "transferqueue_best", "sample", "eager", "iter"),
                        help="process modes also run alone (default: all that ran; smoke: iter, dup encoding)")
    parser.add_argument("--tq-best-variants", nargs="+", choices=TQ_BEST_VARIANTS, default=list(TQ_BEST_VARIANTS),
                        help="how transferqueue_best drives transferqueue (the better is reported)")
    parser.add_argument("--loader-workers", type=int, default=None,
                        help="num_workers of transferqueue's streaming loader (variant 'loader'; default 1; smoke 0: "
                             "the loader runs in the consumer process, no worker start-up)")
    parser.add_argument("--gpu-tflops", type=float, default=DEFAULT_GPU_TFLOPS,
                        help="effective GPU rate for the projection (TFLOP/s)")
    parser.add_argument("--tq-units", type=int, default=2, help="transferqueue SimpleStorage units")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run before giving up")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _workload_of(args: argparse.Namespace, steps: int, warmup: int) -> tuple[TransferWorkload, VLMConfig]:
    seed = getattr(args, "omni_seed_size", False)
    if args.workload == "omni" or seed:
        cfg = OMNI_SMOKE_VLM if args.smoke else OMNI_VLM
        frames = args.omni_frames if args.omni_frames is not None else (
            SEED_OMNI_FRAMES if seed else (2 if args.smoke else 4))
        px = args.omni_px if args.omni_px is not None else (SEED_OMNI_PX if seed else (112 if args.smoke else 224))
        return omni_workload(frames, px, cfg=cfg, steps=steps, warmup_steps=warmup), cfg
    if args.smoke:  # 2 consumer processes (ranks) instead of 4: half the processes to start, still several ranks
        return TransferWorkload(steps=steps, warmup_steps=warmup, num_consumers=2), SMOKE_VLM
    return TransferWorkload(steps=steps, warmup_steps=warmup), TINY_VLM


def run(args: argparse.Namespace) -> int:
    """Run ``knitdata bench transfer``; prints the table, writes JSON/plot. Returns 0, or 1 if a run was not
    exactly-once."""
    if getattr(args, "gpu", False):
        try:
            require_cuda()
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        preset = gpu_config(args.workload, args.steps, args.warmup)
        result = run_gpu_benchmark(preset, timeout_s=args.timeout or 600.0, progress=not args.no_progress)
    else:
        seed = bool(getattr(args, "omni_seed_size", False))
        if seed and args.workload != "omni":
            args.workload = "omni"
        compute = getattr(args, "compute", "accel")
        steps = args.steps if args.steps is not None else (1 if args.smoke else (4 if seed else 10))
        warmup = args.warmup if args.warmup is not None else (1 if args.smoke or seed else 3)
        shared = args.shared_modes if args.shared_modes is not None else ["transferqueue_best", "iter",
                                                                          "iter_embedded"]
        # smoke: the alone runs the ratios need (transferqueue sync and at its best, knitdata iter), dup only
        smoke_controls = ["transferqueue", "transferqueue_best", "iter"] if compute == "accel" else ["iter"]
        controls = args.controls if args.controls is not None else (smoke_controls if args.smoke else None)
        interleave = getattr(args, "interleave", None)
        interleave = (not seed) if interleave is None else bool(interleave)
        reps = getattr(args, "calibration_reps", None)
        reps = reps if reps is not None else (1 if args.smoke else 3)
        w, cfg = _workload_of(args, steps, warmup)
        timeout = args.timeout if args.timeout is not None else (150.0 if args.smoke else 900.0)
        workers = args.loader_workers if args.loader_workers is not None else (0 if args.smoke else 1)
        result = run_transfer_benchmark(w, args.modes, shared_modes=shared, controls=controls,
                                        control_encodings=("dup",) if args.smoke else ENCODINGS,
                                        tq_best_variants=args.tq_best_variants, loader_workers=workers,
                                        cfg=cfg, gpu_tflops=args.gpu_tflops, tq_units=args.tq_units,
                                        timeout_s=timeout, progress=not args.no_progress, compute=compute,
                                        calibration_reps=reps, interleave=interleave)
    prog = os.path.basename(sys.argv[0]) if sys.argv else ""
    result["command"] = (f"knitdata {' '.join(sys.argv[1:])}" if prog in ("__main__.py", "knitdata")
                         else f"python {' '.join(sys.argv)}")
    result["smoke"] = bool(args.smoke)
    print(format_table(result))
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(_clean(result), f, indent=1, allow_nan=False)
        print(f"wrote {args.json}")
    if args.plot:
        plot_result(result, args.plot)
        print(f"wrote {args.plot}")
    return 0 if result["exactly_once_all_runs"] else 1


def _clean(o: Any) -> Any:
    """``o`` with NaN/inf floats as ``None`` and tuples as lists (strict JSON)."""
    if isinstance(o, float):
        return None if (math.isnan(o) or math.isinf(o)) else o
    if isinstance(o, Mapping):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o



def stem_of(args: argparse.Namespace) -> str:
    """The result files' name without extension, from the benchmark's arguments (``python benchmarks/transfer.py``).

    ``transfer``, then ``_omni`` with ``--workload omni`` (``_omni_seed`` with ``--omni-seed-size``), ``_accel`` with
    ``--compute accel`` (``_gpu`` with ``--gpu`` instead), ``_smoke`` with ``--smoke``.
    """
    seed = bool(getattr(args, "omni_seed_size", False))
    stem = "transfer" + ("_omni" if args.workload == "omni" or seed else "") + ("_seed" if seed else "")
    if args.gpu:
        stem += "_gpu"
    elif getattr(args, "compute", "accel") == "accel":
        stem += "_accel"
    return stem + ("_smoke" if args.smoke else "")


def main(argv: Sequence[str] | None = None) -> int:
    """``python benchmarks/transfer.py``: run the benchmark, writing ``benchmarks/results/<stem>.json`` and
    ``.png`` (:func:`stem_of`) unless ``--json`` / ``--plot`` say otherwise.

    Args:
        argv: Arguments (default: the command line).

    Returns:
        The benchmark's exit code.
    """
    from benchmarks.common.cli import RESULTS

    parser = argparse.ArgumentParser(description="Transfer benchmark: transferqueue vs knitdata sample / eager / iter.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    stem = stem_of(args)
    if args.json is None:
        args.json = os.path.join(RESULTS, f"{stem}.json")
    if args.plot is None:
        try:
            import matplotlib  # noqa: F401

            args.plot = os.path.join(RESULTS, f"{stem}.png")
        except ImportError:
            pass
    return run(args)


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("transfer"))
