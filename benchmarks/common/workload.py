"""The transfer workload: groups of trajectories that share one image, or a video and an audio clip
(``omni``), and the vocabulary of the transfer benchmark (modes, encodings, compute modes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common.models import OMNI_VLM, VLMConfig, media_tokens
from knitdata.errors import ConfigError
from knitdata.record import MediaItem, Trajectory

__all__ = [
    "MODES",
    "TQ_BEST_VARIANTS",
    "WORKLOADS",
    "ENCODINGS",
    "SEED_SPEEDUP",
    "COMPUTE_MODES",
    "COMPUTE_MEASURES",
    "SEED_OMNI_FRAMES",
    "SEED_OMNI_PX",
    "TransferWorkload",
    "omni_workload",
    "group_id",
    "trajectory_id",
    "make_audio_flac",
    "make_group",
    "make_step_groups",
]


#: Delivery modes, in the order they run.
MODES: tuple[str, ...] = ("transferqueue", "transferqueue_best", "sample", "eager", "iter", "iter_embedded", "floor")
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
        video_container: Omni: the video is one MP4 container (mpeg4, 2 fps, made with PyAV) instead of its frames
            as image items; consumers decode it with PyAV (``knitdata.media.video``: once per unique video per
            mini-batch with shared encoding, once per copy with dup) and sample all its frames (an even count).
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
    video_container: bool = False
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
            if self.video_container and (self.video_frames % 2 or self.video_frames < 2):
                raise ConfigError(f"omni workload: a video container holds an even number of frames (sampled at 2 "
                                  f"fps, the temporal patch of 2), got {self.video_frames}")
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
        if self.workload == "omni":
            return ("video" if self.video_container else "image", "audio")
        return ("image",)

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


def group_id(step: int, g: int) -> str:
    return f"s{step:05d}g{g:03d}"


def trajectory_id(step: int, g: int, j: int) -> str:
    """The id of member ``j`` of group ``g`` of step ``step`` (what :func:`make_group` gives it)."""
    return f"{group_id(step, g)}t{j}"


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
    if w.video_container:
        from knitdata.media.video import encode_video

        items = [MediaItem("video", data=encode_video(frames, fps=2))]
    else:
        items = [MediaItem("image", tensor=frames[i]) for i in range(w.video_frames)]
    data = make_audio_flac(w, w.seed * 1_000_003 + step * 1009 + g)
    items.append(MediaItem("audio", data=data, sample_rate=w.audio_rate))
    return items


def make_group(w: TransferWorkload, step: int, g: int) -> list[Trajectory]:
    """The ``g``-th group of step ``step``: ``group_size`` trajectories sharing one set of media (deterministic).

    The members hold the very same media items (one object each: the image, or the video frames and the
    FLAC-encoded audio clip), as a rollout engine repeating a prompt does.
    """
    gid = group_id(step, g)
    gen = torch.Generator().manual_seed(w.seed * 1_000_003 + step * 1009 + g)
    media = _group_media(w, step, g, gen)
    prompt = torch.randint(0, w.vocab, (w.prompt_tokens,), dtype=torch.int64, generator=gen)
    out = []
    for j in range(w.group_size):
        resp = torch.randint(0, w.vocab, (w.response_tokens,), dtype=torch.int64, generator=gen)
        out.append(
            Trajectory(
                id=trajectory_id(step, g, j),
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
