"""Video as a media kind: decode containers with PyAV and sample their frames as the model's processor does.

A video :class:`~knitdata.record.MediaItem` holds container bytes (MP4, WebM, MKV...; kept encoded, small) or
already sampled ``uint8 [T, C, H, W]`` frames. :func:`probe_video` decodes every frame once when the item is
built or put (a corrupt or truncated container is refused there, naming the trajectory and the item, never at
training time); :func:`load_video` decodes and samples it (:class:`VideoSampling`: a frame rate or a frame
count, a multiple of the model's temporal patch size) when the collator processes it, once per mini-batch.
A video's key (:func:`video_key`) is its content digest (the container bytes) plus the sampling.

PyAV is the optional ``video`` extra (``pip install 'knitdata[video]'``).

Example:
    >>> sampling = VideoSampling(fps=2.0)                 # Qwen-VL processors' default rate
    >>> sampling.count(total=120, duration=4.0)          # frames kept from a 4 s, 30 fps video
    8
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from knitdata.errors import MediaError
from knitdata.record import MediaItem

__all__ = [
    "VideoSource",
    "VideoSampling",
    "probe_video",
    "load_video",
    "video_item",
    "encode_video",
    "check_frames",
    "video_key",
]

#: What :func:`load_video` accepts: container bytes (MP4, WebM, MKV...) or a file path.
VideoSource = Any


def _where(trajectory_id: str | None, item: int | None) -> dict[str, Any]:
    return {"trajectory_id": trajectory_id, "item": item}


@dataclass(frozen=True)
class VideoSampling:
    """How frames are sampled from a decoded video, as the model's video processor does.

    Either a rate (``fps``: ``duration * fps`` frames, clamped to ``[min_frames, max_frames]``) or a fixed
    count (``num_frames``); the count is rounded down to a multiple of ``frame_factor`` (the model's temporal
    patch size, at least one multiple), and frames are taken at evenly spaced indices
    (``arange(0, total, total / count)``, the index rule of ``transformers``' video processors). A video with
    fewer frames than that repeats frames.

    Attributes:
        fps: Frames per second to sample (Qwen-VL processors: 2.0), or ``None`` with ``num_frames``.
        num_frames: A fixed frame count instead of a rate.
        min_frames: Fewest frames for a rate.
        max_frames: Most frames for a rate.
        frame_factor: The count is a multiple of this (the temporal patch size).
    """

    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 2
    max_frames: int = 768
    frame_factor: int = 2

    def __post_init__(self) -> None:
        if (self.fps is None) == (self.num_frames is None):
            raise ValueError("VideoSampling: give exactly one of fps= and num_frames=")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"VideoSampling: fps must be positive, got {self.fps}")
        if self.num_frames is not None and self.num_frames <= 0:
            raise ValueError(f"VideoSampling: num_frames must be positive, got {self.num_frames}")
        if self.frame_factor <= 0 or self.min_frames <= 0 or self.max_frames < self.min_frames:
            raise ValueError(f"VideoSampling: bad bounds {self}")

    @property
    def signature(self) -> str:
        """A short text naming the sampling (part of a video's key: same bytes, other sampling, other item)."""
        if self.num_frames is not None:
            return f"n{self.num_frames}/{self.frame_factor}"
        return f"fps{self.fps:g}[{self.min_frames},{self.max_frames}]/{self.frame_factor}"

    def count(self, total: int, duration: float) -> int:
        """Frames to sample from a video of ``total`` frames lasting ``duration`` seconds."""
        if self.num_frames is not None:
            n = self.num_frames
        else:
            assert self.fps is not None
            n = int(round(duration * self.fps))
            n = min(max(n, self.min_frames), self.max_frames)
        f = self.frame_factor
        return max(f, (n // f) * f)

    def indices(self, total: int, duration: float) -> torch.Tensor:
        """Indices (``int64``) of the frames to keep out of ``total`` decoded frames."""
        n = self.count(total, duration)
        return torch.arange(0, total, total / n)[:n].to(torch.long).clamp_(max=total - 1)

    def rate(self, n: int, duration: float) -> float:
        """The sampled frame rate: ``fps`` when given, else ``n / duration``."""
        if self.fps is not None:
            return float(self.fps)
        return float(n) / duration if duration > 0 else float(n)


def _av() -> Any:
    try:
        import av
    except ImportError as e:
        from knitdata.errors import OptionalDependencyError

        raise OptionalDependencyError("av", "video", "decoding video containers") from e
    return av


def probe_video(
    source: VideoSource, *, trajectory_id: str | None = None, item: int | None = None
) -> tuple[list[Any], float]:
    """Decode every frame of a container's first video stream (what ``Pipeline.put`` does to refuse bad ones).

    Args:
        source: Container bytes or a file path.
        trajectory_id: Named in errors.
        item: Index of the item within the trajectory's media, named in errors.

    Returns:
        ``(frames, duration)``: the PyAV ``VideoFrame`` s and the duration in seconds.

    Raises:
        MediaError: Empty, missing, unknown, corrupt or truncated (fewer frames than the container declares,
            or frames that stop short of its stated duration), or without a video stream.
        OptionalDependencyError: PyAV is not installed (``pip install 'knitdata[video]'``).
    """
    where = _where(trajectory_id, item)
    av = _av()
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise MediaError(f"video file {os.fspath(source)!r} does not exist", **where)
        fp: Any = os.fspath(source)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise MediaError("video bytes are empty", **where)
        fp = io.BytesIO(bytes(source))
    else:
        raise MediaError(f"cannot load a video from {type(source).__name__}; give container bytes or a path", **where)
    frames: list[Any] = []
    try:
        with av.open(fp, mode="r") as container:
            if not container.streams.video:
                raise MediaError("the container holds no video stream", **where)
            stream = container.streams.video[0]
            declared = int(stream.frames or 0)
            avg = float(stream.average_rate) if stream.average_rate else 0.0
            for frame in container.decode(stream):
                frames.append(frame)
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = float(container.duration) / 1_000_000
            else:
                duration = 0.0
    except MediaError:
        raise
    except (av.FFmpegError, ValueError, OSError, IndexError) as e:
        raise MediaError(f"video cannot be decoded (unknown container, truncated or corrupt?): {e}", **where) from e
    if not frames:
        raise MediaError("video holds no decodable frame (truncated or corrupt?)", **where)
    if declared and len(frames) < declared:
        raise MediaError(
            f"video declares {declared} frames but only {len(frames)} decode (truncated or corrupt?)", **where
        )
    last = frames[-1]
    if last.time is not None and duration > 0 and avg > 0:
        # a container without a frame count (WebM) that lost its tail still decodes its head: the frames must
        # cover the duration its header states, to within a frame and a half (or 5 % of it)
        covered = float(last.time) + 1.0 / avg
        if covered < duration - max(1.5 / avg, 0.05 * duration):
            raise MediaError(
                f"video frames cover {covered:.2f} s of the {duration:.2f} s its container states (truncated?)", **where
            )
    if duration <= 0:  # no duration in the container: the frame count at its average rate
        duration = len(frames) / avg if avg else float(len(frames))
    return frames, duration


def load_video(
    source: VideoSource,
    sampling: VideoSampling | None = None,
    *,
    trajectory_id: str | None = None,
    item: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Decode a video container with PyAV and sample its frames.

    Args:
        source: Container bytes (MP4, WebM, MKV, ...) or a file path.
        sampling: How frames are sampled (default :class:`VideoSampling` ``()``: 2 frames per second).
        trajectory_id: Named in errors.
        item: Index of the item within the trajectory's media, named in errors.

    Returns:
        ``(frames, fps)``: ``uint8 [T, 3, H, W]`` RGB frames and the sampled frame rate.

    Raises:
        MediaError: The container is empty, truncated, corrupt, has no video stream, or a file is missing.
        OptionalDependencyError: PyAV is not installed (``pip install 'knitdata[video]'``).
    """
    sampling = sampling or VideoSampling()
    where = _where(trajectory_id, item)
    frames, duration = probe_video(source, trajectory_id=trajectory_id, item=item)
    idx = sampling.indices(len(frames), duration)
    try:
        picked = [frames[int(i)].to_ndarray(format="rgb24") for i in idx.tolist()]
    except (ValueError, OSError) as e:
        raise MediaError(f"video frames cannot be converted to RGB: {e}", **where) from e
    out = torch.from_numpy(np.ascontiguousarray(np.stack(picked))).permute(0, 3, 1, 2).contiguous()
    return out, sampling.rate(int(idx.numel()), duration)


def video_item(source: VideoSource) -> MediaItem:
    """Build a video :class:`~knitdata.record.MediaItem` from container bytes, a path or frames.

    A container is decoded once here (every frame), so a corrupt or truncated one is refused at once, and
    kept encoded (small); it is decoded again, once per mini-batch, when the collator processes it.

    Args:
        source: Container bytes or a file path (stored encoded), or already sampled frames
            (``uint8 [T, C, H, W]`` numpy array or tensor).

    Returns:
        The media item.

    Raises:
        MediaError: The container cannot be decoded, or frames have an unusable shape or dtype.
    """
    if isinstance(source, (str, os.PathLike)):
        probe_video(source)
        with open(source, "rb") as f:
            return MediaItem(kind="video", data=f.read())
    if isinstance(source, (bytes, bytearray, memoryview)):
        probe_video(source)
        return MediaItem(kind="video", data=bytes(source))
    t = torch.from_numpy(np.ascontiguousarray(source)) if isinstance(source, np.ndarray) else source
    if not isinstance(t, torch.Tensor):
        raise MediaError(f"cannot build a video from {type(source).__name__}; give container bytes, a path or frames")
    check_frames(t)
    return MediaItem(kind="video", tensor=t.detach().cpu().contiguous())


def check_frames(t: torch.Tensor, *, trajectory_id: str | None = None, item: int | None = None) -> None:
    """Check decoded video frames: ``uint8 [T, C, H, W]`` with 1 or 3 channels and no empty dimension.

    Raises:
        MediaError: Another dtype or shape.
    """
    where = _where(trajectory_id, item)
    if t.dtype != torch.uint8 or t.dim() != 4 or t.shape[1] not in (1, 3) or 0 in t.shape:
        raise MediaError(
            f"video frames must be uint8 [T, C, H, W] with C 1 or 3, got {t.dtype} {tuple(t.shape)}", **where
        )


def video_key(item: MediaItem, sampling: VideoSampling) -> str:
    """The key of a video under a sampling: its content digest (the container bytes) and the sampling.

    The same container sampled the same way is one item (decoded and encoded once per mini-batch); sampled
    another way, another one.
    """
    return f"video:{item.digest}:{sampling.signature}"


def encode_video(frames: torch.Tensor | np.ndarray, fps: int = 2, *, fmt: str = "mp4", codec: str | None = None) -> bytes:
    """Encode frames into a container with PyAV (tests, benchmarks, synthetic rollouts).

    Args:
        frames: ``uint8 [T, 3, H, W]`` or ``[T, H, W, 3]`` RGB frames (even ``H`` and ``W`` for YUV 4:2:0).
        fps: Frames per second of the stream.
        fmt: Container format: ``"mp4"`` or ``"webm"`` (any muxer FFmpeg knows).
        codec: Video codec; default ``mpeg4`` for MP4 (in every PyAV wheel), ``libvpx`` (VP8) for WebM.

    Returns:
        The container bytes.
    """
    av = _av()
    t = torch.as_tensor(np.asarray(frames)) if isinstance(frames, np.ndarray) else frames.detach().cpu()
    if t.dim() == 4 and t.shape[1] == 3 and t.shape[-1] != 3:
        t = t.permute(0, 2, 3, 1)
    if t.dtype != torch.uint8 or t.dim() != 4 or t.shape[-1] != 3:
        raise MediaError(f"frames must be uint8 [T, 3, H, W] or [T, H, W, 3], got {t.dtype} {tuple(t.shape)}")
    arr = np.ascontiguousarray(t.numpy())
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(codec or {"webm": "libvpx"}.get(fmt, "mpeg4"), rate=fps)
        stream.height, stream.width = int(arr.shape[1]), int(arr.shape[2])
        stream.pix_fmt = "yuv420p"
        for frame in arr:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()
