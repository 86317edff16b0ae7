"""Decode and process media items (images, audio, video) into encoder inputs, and key them for deduplication.

A trajectory's :class:`~knitdata.record.MediaItem` holds either encoded bytes (PNG, JPEG, WAV, FLAC...) or a
decoded tensor. :class:`MediaProcessor` turns one item into the tensor the encoder consumes:

* images are decoded with pillow (bytes, file paths, numpy arrays, tensors or ``PIL.Image``), converted to
  one colour mode (``"RGB"`` by default) and handed to the user's preprocessing callable as ``uint8 [C, H, W]``
  pixels (e.g. :func:`patchify`: resize and cut into ``[num_patches, C * p * p]`` float32 patches). An image
  item whose ``tensor`` is not ``uint8`` is taken as already processed encoder input and passed through.
* audio is decoded with soundfile (bytes or paths) into ``float32 [frames, channels]`` with its sample rate
  kept; the audio callable is called as ``fn(samples, sample_rate)``.
* videos (container bytes or paths: MP4, WebM, ... with the ``video`` extra, PyAV) are decoded and sampled
  once per :class:`VideoSampling` (a frame rate or a frame count, as the model's processor expects) into
  ``uint8 [T, C, H, W]`` frames; the video callable is called as ``fn(frames, fps)`` with the sampled rate.

Processed inputs are keyed either by provenance ``(group, media index)`` (exact and free for GRPO: the n
responses of one prompt carry the same media) or by a digest of the processed input (finds one image
shared across different prompts too). Bad media raise :class:`~knitdata.errors.MediaError` naming the
trajectory and the item.

Example:
    >>> proc = MediaProcessor({"image": patchify(4, size=(8, 8))})
    >>> item = image_item(torch.zeros(3, 16, 16, dtype=torch.uint8))
    >>> proc.process(item, trajectory_id="t0", index=0).tensor.shape
    torch.Size([4, 48])
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from knitdata.errors import MediaError
from knitdata.media.video import VideoSampling, check_frames, load_video, probe_video, video_key
from knitdata.record import MediaItem, tensor_digest

__all__ = [
    "ImageSource",
    "AudioSource",
    "OutAlloc",

    "ProcessedMedia",
    "MediaProcessor",
    "load_image",
    "load_audio",
    "image_item",
    "audio_item",
    "patchify",
    "provenance_key",
    "processed_digest",
    "check_media_item",
]

#: What :func:`load_image` accepts: encoded bytes, a file path, an array/tensor of pixels, or a ``PIL.Image``.
ImageSource = Any
#: What :func:`load_audio` accepts: encoded bytes or a file path.
AudioSource = Any
#: ``out(shape, dtype) -> Tensor``: memory a preprocessing callable may write its result into (see
#: :meth:`MediaProcessor.process`).
OutAlloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]

_PIL_MODES_CHANNELS = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4, "CMYK": 4, "YCbCr": 3}


@dataclass(frozen=True)
class ProcessedMedia:
    """One media item turned into encoder input.

    Attributes:
        kind: ``"image"``, ``"audio"`` or ``"video"``.
        tensor: The processed encoder input; its first dimension is the item's length (patches, frames) and
            its trailing dimensions must agree among items of one kind so they can be packed.
        sample_rate: Audio sample rate in Hz (``None`` for images and videos).
        meta: Per-item metadata from the model's processor (e.g. ``image_grid_thw`` ``int64 [3]``), or
            ``None``; a preprocessing callable returns it as ``(tensor, {name: tensor})``.
    """

    kind: str
    tensor: torch.Tensor
    sample_rate: int | None = None
    meta: Mapping[str, torch.Tensor] | None = None


def _where(trajectory_id: str | None, item: int | None) -> dict[str, Any]:
    return {"trajectory_id": trajectory_id, "item": item}


def _pixels_chw(t: torch.Tensor, *, trajectory_id: str | None = None, item: int | None = None) -> torch.Tensor:
    """Return uint8 pixels as ``[C, H, W]`` from ``[H, W]``, ``[H, W, C]`` or ``[C, H, W]``."""
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() != 3:
        raise MediaError(f"image pixels must be 2-D or 3-D, got shape {tuple(t.shape)}", **_where(trajectory_id, item))
    if t.shape[0] in (1, 2, 3, 4):
        return t
    if t.shape[-1] in (1, 2, 3, 4):
        return t.permute(2, 0, 1)
    raise MediaError(
        f"cannot tell the channel axis of image pixels with shape {tuple(t.shape)}; give [C, H, W] or [H, W, C] "
        "with 1-4 channels",
        **_where(trajectory_id, item),
    )


def _chw_to_pil(t: torch.Tensor):
    from PIL import Image

    arr = t.detach().cpu().permute(1, 2, 0).contiguous().numpy()
    return Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)


def _pil_to_chw(img) -> torch.Tensor:
    arr = np.array(img)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.dtype != np.uint8:
        arr = np.clip(arr, 0, 255).astype(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1).contiguous()


def load_image(
    source: ImageSource, *, mode: str | None = "RGB", trajectory_id: str | None = None, item: int | None = None
) -> torch.Tensor:
    """Decode an image into ``uint8 [C, H, W]`` pixels.

    Args:
        source: Encoded bytes (PNG, JPEG, WebP, ...), a file path, a ``uint8`` numpy array or tensor
            (``[H, W]``, ``[H, W, C]`` or ``[C, H, W]``), or a ``PIL.Image``.
        mode: Pillow colour mode to convert to (``"RGB"``, ``"L"``, ``"RGBA"``...), or ``None`` to keep it.
        trajectory_id: Named in errors.
        item: Index of the item within the trajectory's media, named in errors.

    Returns:
        The pixels, ``uint8 [C, H, W]``.

    Raises:
        MediaError: The bytes are truncated or not an image format pillow knows, the file is missing, or
            the array has an unusable shape or dtype.
    """
    from PIL import Image, UnidentifiedImageError

    where = _where(trajectory_id, item)
    if isinstance(source, Image.Image):
        img = source
    elif isinstance(source, (bytes, bytearray, memoryview, str, os.PathLike)):
        if isinstance(source, (str, os.PathLike)):
            if not os.path.isfile(source):
                raise MediaError(f"image file {os.fspath(source)!r} does not exist", **where)
            fp: Any = os.fspath(source)
        else:
            if len(source) == 0:
                raise MediaError("image bytes are empty", **where)
            fp = io.BytesIO(bytes(source))
        try:
            img = Image.open(fp)
            img.load()
        except UnidentifiedImageError as e:
            raise MediaError(
                "unknown or unsupported image format (pillow cannot identify it); store PNG/JPEG/WebP bytes or "
                "decoded uint8 pixels",
                **where,
            ) from e
        except (OSError, SyntaxError, ValueError) as e:
            raise MediaError(f"image cannot be decoded (truncated or corrupt?): {e}", **where) from e
    else:
        if isinstance(source, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(source))
        elif isinstance(source, torch.Tensor):
            t = source.detach().cpu()
        else:
            raise MediaError(
                f"cannot load an image from {type(source).__name__}; give bytes, a path, an array or a PIL image",
                **where,
            )
        if t.dtype != torch.uint8:
            raise MediaError(f"image pixels must be uint8, got {t.dtype}", **where)
        chw = _pixels_chw(t, **where)
        if chw.shape[1] == 0 or chw.shape[2] == 0:
            raise MediaError(f"image is empty (shape {tuple(chw.shape)})", **where)
        if mode is None or _PIL_MODES_CHANNELS.get(mode) == chw.shape[0] and mode in ("L", "RGB", "RGBA", "LA"):
            return chw.contiguous()
        img = _chw_to_pil(chw)
    try:
        if mode is not None and img.mode != mode:
            img = img.convert(mode)
        out = _pil_to_chw(img)
    except (OSError, ValueError) as e:
        raise MediaError(f"image cannot be converted to mode {mode!r}: {e}", **where) from e
    if out.shape[1] == 0 or out.shape[2] == 0:
        raise MediaError(f"image is empty (shape {tuple(out.shape)})", **where)
    return out


def load_audio(
    source: AudioSource, *, trajectory_id: str | None = None, item: int | None = None
) -> tuple[torch.Tensor, int]:
    """Decode an audio clip with soundfile.

    Args:
        source: Encoded bytes (WAV, FLAC, OGG, ...) or a file path.
        trajectory_id: Named in errors.
        item: Index of the item within the trajectory's media, named in errors.

    Returns:
        ``(samples, sample_rate)`` with samples ``float32 [frames, channels]`` and the file's own rate.

    Raises:
        MediaError: The clip is empty, truncated, missing or not a format libsndfile knows.
    """
    import soundfile as sf

    where = _where(trajectory_id, item)
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise MediaError(f"audio file {os.fspath(source)!r} does not exist", **where)
        fp: Any = os.fspath(source)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise MediaError("audio bytes are empty", **where)
        fp = io.BytesIO(bytes(source))
    else:
        raise MediaError(f"cannot load audio from {type(source).__name__}; give bytes or a path", **where)
    try:
        data, rate = sf.read(fp, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise MediaError(f"audio cannot be decoded (unknown format, truncated or corrupt?): {e}", **where) from e
    if data.shape[0] == 0:
        raise MediaError("audio clip is empty (0 frames)", **where)
    return torch.from_numpy(np.ascontiguousarray(data)), int(rate)


def check_media_item(item: MediaItem, *, trajectory_id: str | None = None, index: int | None = None) -> None:
    """Check that a media item can be decoded, before it is accepted (``Pipeline.put`` calls this).

    Encoded images, audio and video containers are decoded once (pillow, soundfile, PyAV: every frame of a
    video): truncated, corrupt, empty or unknown formats are refused here, by the producer, instead of failing a consumer's mini-batch later. Decoded
    audio needs a sample rate; decoded content must not be empty.

    Args:
        item: The media item.
        trajectory_id: Named in errors.
        index: Index of the item within the trajectory's media, named in errors.

    Raises:
        MediaError: The item cannot be used.
    """
    from knitdata.record import MEDIA_KINDS

    where = _where(trajectory_id, index)
    if not isinstance(item, MediaItem):
        raise MediaError(f"expected a MediaItem, got {type(item).__name__}", **where)
    if item.kind not in MEDIA_KINDS:
        raise MediaError(f"unknown media kind {item.kind!r}; expected one of {MEDIA_KINDS}", **where)
    if item.data is not None:
        if item.kind == "image":
            load_image(item.data, mode=None, trajectory_id=trajectory_id, item=index)
        elif item.kind == "video":
            probe_video(item.data, trajectory_id=trajectory_id, item=index)  # every frame, here and not in training
        else:
            load_audio(item.data, trajectory_id=trajectory_id, item=index)
        return
    t = item.tensor
    if t is None or t.numel() == 0:
        raise MediaError(f"{item.kind} content is empty", **where)
    if item.kind == "video" and t.dtype == torch.uint8:
        check_frames(t, trajectory_id=trajectory_id, item=index)
    if item.kind == "audio" and item.sample_rate is None:
        raise MediaError("decoded audio samples need a sample_rate (MediaItem(..., sample_rate=...))", **where)
    if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
        raise MediaError(f"{item.kind} content holds non-finite values", **where)


def image_item(source: ImageSource, *, keep_encoded: bool = True) -> MediaItem:
    """Build an image :class:`~knitdata.record.MediaItem` from bytes, a path, an array or a PIL image.

    Args:
        source: Encoded bytes or a file path (kept encoded, decoded at collate time when ``keep_encoded``),
            or pixels (``uint8`` numpy array/tensor, or ``PIL.Image``) stored as ``uint8 [C, H, W]``.
        keep_encoded: For bytes and paths, store the encoded bytes (small, decoded later) instead of pixels.

    Returns:
        The media item; a file is read once, its bytes are checked to decode.

    Raises:
        MediaError: The source cannot be decoded.
    """
    if isinstance(source, (str, os.PathLike)) and keep_encoded:
        load_image(source, mode=None)  # fail early on a bad file
        with open(source, "rb") as f:
            return MediaItem(kind="image", data=f.read())
    if isinstance(source, (bytes, bytearray, memoryview)) and keep_encoded:
        load_image(source, mode=None)
        return MediaItem(kind="image", data=bytes(source))
    return MediaItem(kind="image", tensor=load_image(source, mode=None))


def audio_item(source: AudioSource, *, sample_rate: int | None = None) -> MediaItem:
    """Build an audio :class:`~knitdata.record.MediaItem` from bytes, a path or samples.

    Args:
        source: Encoded bytes or a file path (stored encoded; the rate is read from the file), or samples
            (numpy array/tensor ``[frames]`` or ``[frames, channels]``), which need ``sample_rate``.
        sample_rate: Sample rate in Hz of raw samples.

    Returns:
        The media item.

    Raises:
        MediaError: The clip cannot be decoded, is empty, or raw samples come without a sample rate.
    """
    if isinstance(source, (str, os.PathLike)):
        _, rate = load_audio(source)
        with open(source, "rb") as f:
            return MediaItem(kind="audio", data=f.read(), sample_rate=rate)
    if isinstance(source, (bytes, bytearray, memoryview)):
        _, rate = load_audio(source)
        return MediaItem(kind="audio", data=bytes(source), sample_rate=rate)
    t = torch.from_numpy(np.ascontiguousarray(source)) if isinstance(source, np.ndarray) else source
    if not isinstance(t, torch.Tensor):
        raise MediaError(f"cannot build audio from {type(source).__name__}; give bytes, a path or samples")
    if sample_rate is None:
        raise MediaError("raw audio samples need sample_rate=")
    if t.numel() == 0:
        raise MediaError("audio clip is empty (0 frames)")
    return MediaItem(kind="audio", tensor=t.detach().cpu().to(torch.float32), sample_rate=int(sample_rate))


def patchify(
    patch_size: int,
    *,
    size: tuple[int, int] | None = None,
    mean: float | tuple[float, ...] = 0.0,
    std: float | tuple[float, ...] = 1.0,
    dtype: torch.dtype = torch.float32,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return an image preprocessing callable: scale to [0, 1], normalize, resize, cut into patches.

    Args:
        patch_size: Side ``p`` of the square patches.
        size: ``(H, W)`` to resize to (bilinear, multiples of ``p``); ``None`` keeps the image size cropped down
            to multiples of ``p``, so images of different sizes give different patch counts.
        mean: Per-channel (or one) mean subtracted after scaling to [0, 1].
        std: Per-channel (or one) standard deviation divided by.
        dtype: Output dtype.

    Returns:
        ``fn(pixels uint8 [C, H, W], *, out=None) -> [num_patches, C * p * p]``, row-major over the patch grid.
        With ``out`` (``out(shape, dtype) -> Tensor``, what :meth:`MediaProcessor.process` passes on to a
        callable whose ``accepts_out`` attribute is true) the patches are written straight into the memory it
        gives (the collator's media table), without an intermediate copy.
    """
    p = int(patch_size)
    if p <= 0:
        raise ValueError(f"patch_size must be positive, got {patch_size}")
    if size is not None and (size[0] % p or size[1] % p or size[0] <= 0 or size[1] <= 0):
        raise ValueError(f"size {size} must be positive multiples of patch_size {p}")

    def fn(pixels: torch.Tensor, *, out: OutAlloc | None = None) -> torch.Tensor:
        x = pixels.to(torch.float32) / 255.0
        c = x.shape[0]
        m = torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        s = torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        x = (x - m) / s
        if size is not None:
            if tuple(x.shape[1:]) != tuple(size):
                x = torch.nn.functional.interpolate(x[None], size=size, mode="bilinear", align_corners=False)[0]
        else:
            h, w = (x.shape[1] // p) * p, (x.shape[2] // p) * p
            if h == 0 or w == 0:
                raise ValueError(f"image {tuple(x.shape[1:])} is smaller than one {p}x{p} patch")
            x = x[:, :h, :w]
        h, w = x.shape[1] // p, x.shape[2] // p
        grid = x.reshape(c, h, p, w, p).permute(1, 3, 0, 2, 4)
        if out is not None:
            dest = out((h * w, c * p * p), dtype)
            dest.view(h, w, c, p, p).copy_(grid)  # one write, straight into the table
            return dest
        return grid.reshape(h * w, c * p * p).to(dtype).contiguous()

    fn.accepts_out = True  # type: ignore[attr-defined]
    return fn


def provenance_key(group: str, index: int) -> tuple[str, int]:
    """Return the provenance key of media item ``index`` of a trajectory in ``group``.

    In GRPO the n responses of a prompt share its media, so ``(group, index)`` identifies an item exactly,
    without hashing anything.
    """
    return (str(group), int(index))


def processed_digest(processed: ProcessedMedia) -> str:
    """Return the content digest of a processed item: kind, sample rate, dtype, shape and values.

    Two items get the same digest exactly when the encoder would consume the same input (metadata included).
    """
    d = f"{processed.kind}:{processed.sample_rate or 0}:{tensor_digest(processed.tensor)}"
    for name, m in sorted((processed.meta or {}).items()):
        d += f":{name}={tensor_digest(m)}"
    return d


class MediaProcessor:
    """Turn :class:`~knitdata.record.MediaItem` s into encoder inputs.

    Args:
        preprocess: Per kind, the model's preprocessing: ``{"image": fn(pixels uint8 [C, H, W]) -> Tensor,
            "audio": fn(samples float32 [frames, channels], sample_rate) -> Tensor}``. Without one, images
            become ``uint8 [C, H, W]`` pixels and audio ``float32 [frames, channels]`` samples. A callable
            may also return ``(tensor, {name: tensor})``: per-item metadata the encoder needs (e.g. Qwen2-VL's
            ``image_grid_thw``), carried in :attr:`ProcessedMedia.meta` and the media table.
        image_mode: Pillow mode every image is converted to before preprocessing (``None`` keeps it).
        video_sampling: How video frames are sampled (default :class:`VideoSampling` ``()``, 2 per second);
            the ``"video"`` callable is called as ``fn(frames uint8 [T, C, H, W], fps)``.

    Attributes:
        decodes: Per video (its content digest), how many times its container was decoded here (one per
            mini-batch the video is in, with a collator: what ``bench vlm`` reports).

    Raises:
        ValueError: ``preprocess`` names an unknown kind or holds a non-callable.
    """

    def __init__(
        self,
        preprocess: Mapping[str, Callable[..., torch.Tensor | tuple[torch.Tensor, Mapping[str, torch.Tensor]]]] | None = None,
        image_mode: str | None = "RGB",
        video_sampling: VideoSampling | None = None,
    ):
        self.preprocess = dict(preprocess or {})
        for k, fn in self.preprocess.items():
            if k not in ("image", "audio", "video"):
                raise ValueError(f"preprocess has unknown media kind {k!r}; use 'image', 'audio' or 'video'")
            if not callable(fn):
                raise ValueError(f"preprocess[{k!r}] must be callable, got {type(fn).__name__}")
        self.image_mode = image_mode
        self.video_sampling = video_sampling or VideoSampling()
        self.decodes: dict[str, int] = {}

    def raw_key(self, item: MediaItem) -> str:
        """The key of a raw item for this processor: items with one key give the same processed input (its kind,
        sample rate and content digest; a video's :func:`video_key`, which covers the sampling). Nothing is hashed:
        the digest was computed when the item was made."""
        if item.kind == "video" and item.data is not None:
            return video_key(item, self.video_sampling)
        return f"{item.kind}:{item.sample_rate or 0}:{item.digest}"

    def key_of(self, item: MediaItem, processed: ProcessedMedia) -> str:
        """The content key of an item, the same in every process: a video's :func:`video_key` (container bytes and
        sampling: no hashing of its frames), else :func:`processed_digest` (its processed input hashed). The
        collator's ``key="digest"`` finds equal inputs by comparing them instead
        (:class:`~knitdata.media.multimodal.EqualInputs`)."""
        if item.kind == "video" and item.data is not None:
            return video_key(item, self.video_sampling)
        return processed_digest(processed)

    def process(self, item: MediaItem, *, trajectory_id: str | None = None, index: int | None = None,
                out: OutAlloc | None = None) -> ProcessedMedia:
        """Decode and preprocess one item.

        Args:
            item: The media item.
            trajectory_id: Id of the trajectory holding it (named in errors).
            index: Its index in the trajectory's media (named in errors).
            out: Memory for the result (``out(shape, dtype) -> Tensor``), passed on as ``out=`` to a preprocessing
                callable whose ``accepts_out`` attribute is true (:func:`patchify`): it writes its result there
                (the collator's media table) instead of into fresh memory. Other callables ignore it.

        Returns:
            The processed item; its tensor has at least one dimension and at least one row.

        Raises:
            MediaError: The item cannot be decoded, or preprocessing fails or returns something unusable.
        """
        where = _where(trajectory_id, index)
        rate: int | None = None
        x: torch.Tensor | tuple[torch.Tensor, Mapping[str, torch.Tensor]]  # decoded, then preprocessed (checked below)
        if item.kind == "image":
            if item.tensor is not None and item.tensor.dtype != torch.uint8:
                x = item.tensor  # already processed encoder input
                fn = None
            else:
                x = load_image(item.data if item.data is not None else item.tensor, mode=self.image_mode, **where)
                fn = self.preprocess.get("image")
            args: tuple = (x,)
        elif item.kind == "video":
            if item.tensor is not None and item.tensor.dtype != torch.uint8:
                x, fn = item.tensor, None  # already processed encoder input
            elif item.data is not None:
                x, fps = load_video(item.data, self.video_sampling, **where)
                self.decodes[item.digest] = self.decodes.get(item.digest, 0) + 1
                fn = self.preprocess.get("video")
            else:
                assert item.tensor is not None
                check_frames(item.tensor, **where)
                x, fps = item.tensor, float(self.video_sampling.fps or 1.0)  # frames already sampled
                fn = self.preprocess.get("video")
            args = (x, fps) if fn is not None else (x,)
        else:
            if item.data is not None:
                x, rate = load_audio(item.data, **where)
            else:
                if item.sample_rate is None:
                    raise MediaError("audio samples without sample_rate", **where)
                x, rate = item.tensor.to(torch.float32), int(item.sample_rate)  # type: ignore[union-attr]
                if x.dim() == 1:
                    x = x[:, None]
                if x.numel() == 0:
                    raise MediaError("audio clip is empty (0 frames)", **where)
            if item.sample_rate is not None and item.sample_rate != rate:
                raise MediaError(f"item says sample_rate {item.sample_rate} but the clip has {rate}", **where)
            fn = self.preprocess.get("audio")
            args = (x, rate)
        if fn is not None:
            try:
                x = fn(*args, out=out) if out is not None and getattr(fn, "accepts_out", False) else fn(*args)
            except MediaError:
                raise
            except Exception as e:
                raise MediaError(f"{item.kind} preprocessing failed: {type(e).__name__}: {e}", **where) from e
        meta: dict[str, torch.Tensor] | None = None
        if isinstance(x, tuple):
            if len(x) != 2 or not isinstance(x[1], Mapping):
                raise MediaError(
                    f"{item.kind} preprocessing must return a tensor or (tensor, {{name: tensor}}), got a tuple of "
                    f"{len(x)}",
                    **where,
                )
            x, raw_meta = x
            meta = {}
            for name, v in raw_meta.items():
                if not isinstance(v, torch.Tensor):
                    raise MediaError(
                        f"{item.kind} preprocessing metadata {name!r} must be a tensor, got {type(v).__name__}", **where
                    )
                meta[str(name)] = v.detach().cpu().contiguous()
        if not isinstance(x, torch.Tensor):
            raise MediaError(f"{item.kind} preprocessing must return a tensor, got {type(x).__name__}", **where)
        if x.dim() == 0 or x.shape[0] == 0:
            raise MediaError(
                f"processed {item.kind} has no rows (shape {tuple(x.shape)}); the first dimension is the item length",
                **where,
            )
        return ProcessedMedia(kind=item.kind, tensor=x.detach().contiguous(), sample_rate=rate, meta=meta)

    __call__ = process
