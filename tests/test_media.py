"""Media decoding and processing: images (pillow), audio (soundfile), preprocessing, keys, bad media."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from knitdata.errors import MediaError
from knitdata.media.process import (
    MediaProcessor,
    audio_item,
    image_item,
    load_audio,
    load_image,
    patchify,
    processed_digest,
    provenance_key,
)
from knitdata.record import MediaItem


def _png(arr: np.ndarray, fmt: str = "PNG") -> bytes:
    b = io.BytesIO()
    Image.fromarray(arr).save(b, fmt)
    return b.getvalue()


def _wav(samples: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    b = io.BytesIO()
    sf.write(b, samples, rate, format=fmt)
    return b.getvalue()


RGB = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)


def test_load_image_from_bytes_path_array_tensor_pil(tmp_path):
    png = _png(RGB)
    p = tmp_path / "x.png"
    p.write_bytes(png)
    expect = torch.from_numpy(RGB.copy()).permute(2, 0, 1)
    for src in (png, bytearray(png), str(p), p, RGB, torch.from_numpy(RGB.copy()), expect, Image.fromarray(RGB)):
        out = load_image(src)
        assert out.dtype == torch.uint8 and out.shape == (3, 5, 7)
        assert torch.equal(out, expect)


def test_mode_conversion():
    rgba = np.dstack([RGB, np.full((5, 7), 255, np.uint8)])
    assert load_image(_png(rgba)).shape == (3, 5, 7)  # RGBA -> RGB
    assert load_image(_png(rgba), mode=None).shape == (4, 5, 7)
    gray = load_image(_png(RGB), mode="L")
    assert gray.shape == (1, 5, 7)
    assert torch.equal(gray[0], torch.from_numpy(np.array(Image.fromarray(RGB).convert("L"))))
    assert load_image(np.zeros((4, 4), np.uint8)).shape == (3, 4, 4)  # L -> RGB
    jpeg = load_image(_png(RGB, "JPEG"))
    assert jpeg.shape == (3, 5, 7)


@pytest.mark.parametrize(
    "data, match",
    [
        (_png(RGB)[:40], "truncated|decoded"),
        (b"definitely not an image", "unknown"),
        (b"", "empty"),
    ],
)
def test_bad_images_name_trajectory_and_item(data, match):
    proc = MediaProcessor()
    item = MediaItem(kind="image", data=data) if data else MediaItem(kind="image", data=b"x")
    if not data:
        with pytest.raises(MediaError, match="empty") as ei:
            load_image(b"", trajectory_id="t9", item=3)
    else:
        with pytest.raises(MediaError, match=match) as ei:
            proc.process(item, trajectory_id="t9", index=3)
    assert ei.value.trajectory_id == "t9" and ei.value.item == 3
    assert "trajectory 't9'" in str(ei.value) and "media item 3" in str(ei.value)


def test_missing_file_and_bad_arrays(tmp_path):
    with pytest.raises(MediaError, match="does not exist"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(MediaError, match="uint8"):
        load_image(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(MediaError, match="channel axis"):
        load_image(np.zeros((9, 9, 9), np.uint8))
    with pytest.raises(MediaError, match="cannot load"):
        load_image(12)


def test_audio_bytes_path_rate_kept(tmp_path):
    stereo = (np.random.default_rng(0).standard_normal((800, 2)) * 0.1).astype(np.float32)
    for fmt in ("WAV", "FLAC"):
        data = _wav(stereo, 16000, fmt)
        x, rate = load_audio(data)
        assert rate == 16000 and x.shape == (800, 2) and x.dtype == torch.float32
        assert torch.allclose(x, torch.from_numpy(stereo), atol=1e-4)
    p = tmp_path / "a.wav"
    p.write_bytes(_wav(stereo[:, 0], 8000))
    x, rate = load_audio(p)
    assert rate == 8000 and x.shape == (800, 1)
    item = audio_item(p)
    assert item.sample_rate == 8000 and item.data == p.read_bytes()
    raw = audio_item(stereo[:, 0], sample_rate=22050)
    pm = MediaProcessor().process(raw)
    assert pm.sample_rate == 22050 and pm.tensor.shape == (800, 1)


def test_bad_audio():
    with pytest.raises(MediaError, match="empty") as ei:
        MediaProcessor().process(MediaItem(kind="audio", data=_wav(np.zeros(0, np.float32), 8000)), trajectory_id="a", index=0)
    assert ei.value.trajectory_id == "a" and ei.value.item == 0
    with pytest.raises(MediaError, match="decoded"):
        load_audio(b"RIFF....garbage")
    with pytest.raises(MediaError, match="empty"):
        load_audio(b"")
    with pytest.raises(MediaError, match="sample_rate"):
        audio_item(np.zeros(10, np.float32))
    with pytest.raises(MediaError, match="sample_rate 8000"):
        MediaProcessor().process(MediaItem(kind="audio", data=_wav(np.zeros(10, np.float32), 16000), sample_rate=8000))


def test_patchify_values_and_shapes():
    img = torch.arange(3 * 8 * 12, dtype=torch.float32).reshape(3, 8, 12).to(torch.uint8)
    fn = patchify(4)
    out = fn(img)
    assert out.shape == (2 * 3, 3 * 16)
    # patch (row 1, col 2) is pixels [:, 4:8, 8:12], flattened channel-major
    assert torch.allclose(out[1 * 3 + 2], (img[:, 4:8, 8:12].float() / 255).reshape(-1))
    assert patchify(4, size=(8, 8))(img).shape == (4, 48)
    assert patchify(4)(torch.zeros(3, 9, 7, dtype=torch.uint8)).shape == (2, 48)  # cropped to multiples
    normed = patchify(4, mean=0.5, std=0.5)(torch.full((3, 4, 4), 255, dtype=torch.uint8))
    assert torch.allclose(normed, torch.ones(1, 48))
    with pytest.raises(ValueError):
        patchify(4, size=(6, 8))


def test_processor_pipeline_and_errors():
    proc = MediaProcessor({"image": patchify(2), "audio": lambda x, sr: x[::2]})
    pm = proc.process(image_item(_png(RGB)))
    assert pm.kind == "image" and pm.tensor.shape == (2 * 3, 12) and pm.sample_rate is None
    already = MediaItem(kind="image", tensor=torch.randn(5, 12))
    assert torch.equal(proc.process(already).tensor, already.tensor)  # float tensors are processed inputs
    a = proc.process(audio_item(np.ones(10, np.float32), sample_rate=100))
    assert a.tensor.shape == (5, 1) and a.sample_rate == 100
    bad = MediaProcessor({"image": lambda x: 1 / 0})
    with pytest.raises(MediaError, match="ZeroDivisionError") as ei:
        bad.process(image_item(RGB), trajectory_id="q", index=1)
    assert ei.value.item == 1
    with pytest.raises(MediaError, match="no rows"):
        MediaProcessor({"image": lambda x: x[:0]}).process(image_item(RGB))
    with pytest.raises(MediaError, match="must return a tensor"):
        MediaProcessor({"image": lambda x: "x"}).process(image_item(RGB))
    with pytest.raises(ValueError, match="unknown media kind"):
        MediaProcessor({"text": lambda x: x})


def test_image_item_keeps_encoded_bytes(tmp_path):
    png = _png(RGB)
    p = tmp_path / "i.png"
    p.write_bytes(png)
    assert image_item(p).data == png and image_item(png).data == png
    assert image_item(RGB).tensor.shape == (3, 5, 7)
    with pytest.raises(MediaError):
        image_item(b"junk")


def test_keys():
    assert provenance_key("g1", 2) == ("g1", 2)
    proc = MediaProcessor({"image": patchify(1)})
    a = proc.process(image_item(_png(RGB)))
    b = proc.process(image_item(RGB))  # same pixels, other encoding -> same processed digest
    c = proc.process(image_item(RGB[::-1].copy()))
    assert processed_digest(a) == processed_digest(b) != processed_digest(c)


def test_check_media_item_refuses_what_a_consumer_could_not_decode() -> None:
    import io as _io

    from PIL import Image

    from knitdata.errors import MediaError
    from knitdata.media.process import check_media_item
    from knitdata.record import MediaItem as _Item

    buf = _io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format="PNG")
    png = buf.getvalue()
    check_media_item(_Item("image", data=png), trajectory_id="t", index=0)
    check_media_item(_Item("audio", tensor=torch.zeros(10), sample_rate=16000))
    for bad in (_Item("image", data=png[: len(png) // 2]), _Item("image", data=b"nope"),
                _Item("audio", tensor=torch.zeros(10)), _Item("image", tensor=torch.zeros(0, dtype=torch.uint8))):
        with pytest.raises(MediaError) as e:
            check_media_item(bad, trajectory_id="t9", index=3)
        assert e.value.trajectory_id == "t9" and e.value.item == 3


# --- video (PyAV) ---


def _video(**kw) -> bytes:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _hf_helpers import tiny_video

    return tiny_video(**kw)


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_video_container_decoded_and_sampled(fmt, tmp_path):
    pytest.importorskip("av")
    from knitdata.media.video import VideoSampling, load_video, video_item

    data = _video(frames=8, size=(16, 24), fmt=fmt)  # 8 frames at 4 fps: 2 s
    frames, fps = load_video(data, VideoSampling(fps=2.0))
    assert frames.dtype == torch.uint8 and tuple(frames.shape) == (4, 3, 16, 24) and fps == 2.0
    frames, fps = load_video(data, VideoSampling(fps=None, num_frames=6))
    assert frames.shape[0] == 6 and fps == pytest.approx(3.0)
    path = tmp_path / f"v.{fmt}"
    path.write_bytes(data)
    item = video_item(path)
    assert item.kind == "video" and item.data == data and item.digest == video_item(data).digest
    same, _ = load_video(path, VideoSampling(fps=2.0))
    assert torch.equal(same, load_video(data, VideoSampling(fps=2.0))[0])


def test_video_sampling_rules():
    from knitdata.media.video import VideoSampling

    s = VideoSampling(fps=2.0, min_frames=2, max_frames=8, frame_factor=2)
    assert s.count(100, 10.0) == 8 and s.count(3, 0.5) == 2 and s.count(30, 2.6) == 4
    assert s.indices(8, 4.0).tolist() == [0, 1, 2, 3, 4, 5, 6, 7][: s.count(8, 4.0)]
    assert VideoSampling(fps=None, num_frames=5, frame_factor=2).count(9, 1.0) == 4
    assert s.signature != VideoSampling(fps=1.0).signature
    with pytest.raises(ValueError):
        VideoSampling(fps=2.0, num_frames=4)
    with pytest.raises(ValueError):
        VideoSampling(fps=0.0)


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_bad_video_containers_refused_naming_trajectory_and_item(fmt):
    pytest.importorskip("av")
    from knitdata.media.process import check_media_item
    from knitdata.media.video import video_item

    data = _video(frames=8, fmt=fmt)
    for bad, what in ((data[: len(data) // 2], "truncated"), (b"\x00" * 64 + data[64:], "corrupt header"),
                      (b"not a video at all", "garbage")):
        item = MediaItem("video", data=bad)
        with pytest.raises(MediaError) as e:
            check_media_item(item, trajectory_id="t9", index=2)
        assert "'t9'" in str(e.value) and "item 2" in str(e.value), (what, str(e.value))
        with pytest.raises(MediaError):
            video_item(bad)
    with pytest.raises(MediaError, match="empty"):
        check_media_item(MediaItem("video", data=b""), trajectory_id="t9", index=0)


def test_video_refused_at_put_not_at_training():
    pytest.importorskip("av")
    from knitdata import BatchSpec, Pipeline, Trajectory

    data = _video(frames=8)
    pipe = Pipeline(BatchSpec({"s": 2}, num_minibatches=1, group_size=2), num_consumers=1)
    bad = MediaItem("video", data=data[: len(data) // 2])
    with pytest.raises(MediaError, match="'g0-r1'.*item 1|item 1.*'g0-r1'"):
        pipe.put(Trajectory(id="g0-r1", source="s", group="g0", prompt_ids=torch.tensor([1, 2]),
                            response_ids=torch.tensor([3]), media=[MediaItem("video", data=data), bad]))


def test_one_video_shared_by_a_group_is_decoded_once_per_minibatch():
    pytest.importorskip("av")
    from knitdata import MultimodalCollator, Trajectory
    from knitdata.media.video import VideoSampling, video_item

    a, b = video_item(_video(frames=8, seed=1)), video_item(_video(frames=8, seed=2))
    trajs = [Trajectory(id=f"g{g}r{r}", source="s", group=f"g{g}", prompt_ids=torch.tensor([1]),
                        response_ids=torch.tensor([2]), media=[v]) for g, v in enumerate((a, b, a)) for r in range(4)]
    mbs = [trajs[0:5], trajs[5:9], trajs[9:12]]
    for key in ("provenance", "digest"):
        col = MultimodalCollator({}, key=key, video_sampling=VideoSampling(fps=2.0))
        mm = col(mbs)
        assert mm.tables["video"].num_items == (3 if key == "provenance" else 2)
        assert sorted(col.processor.decodes.values()) == [1, 1]  # each distinct container decoded once
        assert mm.tables["video"].values.dtype == torch.uint8 and mm.num_occurrences == 12
    # the same bytes sampled another way are another item
    col1 = MultimodalCollator({}, key="digest", video_sampling=VideoSampling(fps=1.0))
    col2 = MultimodalCollator({}, key="digest", video_sampling=VideoSampling(fps=2.0))
    assert col1.processor.key_of(a, None) != col2.processor.key_of(a, None)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 400), duration=st.floats(0.05, 120.0), fps=st.floats(0.1, 30.0),
       num=st.integers(1, 64), factor=st.integers(1, 4), by_rate=st.booleans())
def test_video_sampling_properties(total, duration, fps, num, factor, by_rate):
    from knitdata.media.video import VideoSampling

    s = VideoSampling(fps=fps, frame_factor=factor) if by_rate else VideoSampling(fps=None, num_frames=num,
                                                                                  frame_factor=factor)
    idx = s.indices(total, duration)
    assert idx.numel() == s.count(total, duration) and idx.numel() % factor == 0 and idx.numel() >= factor
    assert int(idx.min()) >= 0 and int(idx.max()) < total and bool((idx[1:] >= idx[:-1]).all())
    if by_rate:
        assert idx.numel() <= max(s.max_frames, factor)


def test_video_frames_items_and_encode_errors():
    pytest.importorskip("av")
    from knitdata.media.process import check_media_item
    from knitdata.media.video import encode_video, load_video, video_item

    frames = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    item = video_item(frames)
    assert item.kind == "video" and torch.equal(item.tensor, frames)
    proc = MediaProcessor({"video": lambda x, fps: (x.float().flatten(1), {"fps": torch.tensor(fps)})})
    pm = proc.process(item)
    assert pm.tensor.shape == (4, 3 * 16 * 16) and float(pm.meta["fps"]) == 2.0
    with pytest.raises(MediaError, match="uint8"):
        video_item(frames.float())
    with pytest.raises(MediaError, match="uint8"):
        check_media_item(MediaItem("video", tensor=torch.zeros(4, 5, 16, 16, dtype=torch.uint8)),
                         trajectory_id="t", index=0)
    with pytest.raises(MediaError):
        encode_video(torch.zeros(2, 16, 16))
    data = encode_video(frames, fps=2, fmt="webm")
    out, fps = load_video(data)
    assert out.shape == (4, 3, 16, 16) and fps == 2.0
