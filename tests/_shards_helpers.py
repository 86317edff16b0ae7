"""Shared helpers for tests/test_shards.py and tests/test_spill.py: trajectory builders and hypothesis strategies."""

from __future__ import annotations

import io
import math

import numpy as np
import soundfile as sf
import torch
from hypothesis import strategies as st
from PIL import Image

from knitdata.record import MediaItem, Trajectory

__all__ = ["png_bytes", "jpg_bytes", "wav_bytes", "flac_bytes", "make_traj", "trajectories"]


def png_bytes(w: int = 4, h: int = 3, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    b = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(b, "PNG")
    return b.getvalue()


def jpg_bytes(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    b = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(b, "JPEG")
    return b.getvalue()


def _audio(fmt: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    b = io.BytesIO()
    sf.write(b, (rng.standard_normal(160) * 0.1).astype(np.float32), 16000, format=fmt)
    return b.getvalue()


def wav_bytes(seed: int = 0) -> bytes:
    return _audio("WAV", seed)


def flac_bytes(seed: int = 0) -> bytes:
    return _audio("FLAC", seed)


def make_traj(i: int, *, tokens: int = 8, extra: int = 0, media: bool = True) -> Trajectory:
    """A trajectory using every field: masks, token versions, bf16/fp16 extras, encoded and decoded media."""
    g = torch.Generator().manual_seed(i)
    n = tokens
    tensors = {
        "logp": torch.randn(n, generator=g).to(torch.bfloat16),
        "values.v2/x": torch.randn(2, n, generator=g).half(),
    }
    if extra:
        tensors["big"] = torch.randn(extra, generator=g)
    items = []
    if media:
        items = [
            MediaItem("image", data=png_bytes(seed=i)),
            MediaItem("image", tensor=torch.randint(0, 255, (3, 4, 5), dtype=torch.uint8, generator=g)),
            MediaItem("audio", data=wav_bytes(seed=i), sample_rate=16000),
        ]
    return Trajectory(
        id=f"traj-{i:05d}",
        source=["math", "code"][i % 2],
        group=f"g{i // 2}",
        prompt_ids=torch.randint(0, 1000, (3 + i % 5,), generator=g),
        response_ids=torch.randint(0, 1000, (n,), generator=g, dtype=torch.int64).to(torch.int32),
        gen_version=1,
        loss_mask=torch.rand(n, generator=g) > 0.3,
        token_versions=torch.tensor([1] + [2] * (n - 1)),
        scalars={"reward": i / 3.0, "advantage": -0.125, "count": i},
        tensors=tensors,
        media=items,
    )


_FLOAT = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
_OTHER = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
_INT = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


@st.composite
def _tensor(draw: st.DrawFn, dtypes: list[torch.dtype], max_dims: int = 3, min_dims: int = 0) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(st.lists(st.integers(0, 4), min_size=min_dims, max_size=max_dims))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype).reshape(shape)
    if dtype == torch.bool:
        return (torch.rand(n, generator=g) > 0.5).reshape(shape)
    lo, hi = (0, 255) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype).reshape(shape)


_name = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
_key = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-:", min_size=1, max_size=120)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    """Random valid trajectories: all dtypes incl. bfloat16/bool/float16, odd names, every media kind."""
    n = draw(st.integers(1, 40))
    tid = draw(_key)
    gv = draw(st.integers(0, 5))
    resp_dtype = draw(st.sampled_from(_INT))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    response = torch.randint(0, 100, (n,), generator=g).to(resp_dtype)
    prompt = torch.randint(0, 100, (draw(st.integers(0, 20)),), generator=g).to(draw(st.sampled_from(_INT)))
    mask = None
    if draw(st.booleans()):
        mdt = draw(st.sampled_from([torch.bool, torch.float32, torch.bfloat16, torch.int8]))
        mask = (torch.rand(n, generator=g) > 0.5).to(mdt)
    tv = None
    if draw(st.booleans()):
        tv = torch.full((n,), gv, dtype=torch.int64) + (torch.arange(n) % 3)
    names = draw(st.lists(_name, max_size=3, unique=True))
    names = [k for k in names if k not in ("prompt_ids", "response_ids", "loss_mask", "token_versions")]
    tensors = {k: draw(_tensor(_FLOAT + _OTHER)) for k in names}
    media = []  # media tensors have >= 1 dim: record.tensor_digest cannot hash 0-d multi-byte tensors
    for kind in draw(st.lists(st.sampled_from(["png", "jpg", "wav", "flac", "img_t", "aud_t", "raw"]), max_size=3)):
        s = draw(st.integers(0, 1000))
        if kind == "png":
            media.append(MediaItem("image", data=png_bytes(seed=s)))
        elif kind == "jpg":
            media.append(MediaItem("image", data=jpg_bytes(seed=s)))
        elif kind == "wav":
            media.append(MediaItem("audio", data=wav_bytes(seed=s), sample_rate=16000))
        elif kind == "flac":
            media.append(MediaItem("audio", data=flac_bytes(seed=s), sample_rate=8000))
        elif kind == "img_t":
            media.append(
                MediaItem("image", tensor=draw(_tensor([torch.uint8, torch.float16, torch.bfloat16], min_dims=1)))
            )
        elif kind == "aud_t":
            media.append(MediaItem("audio", tensor=draw(_tensor([torch.float32], 2, min_dims=1)), sample_rate=22050))
        else:
            media.append(MediaItem("image", data=bytes(draw(st.binary(max_size=64)))))
    scalars = draw(
        st.dictionaries(
            _name, st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-10, 10)), max_size=3
        )
    )
    return Trajectory(
        id=tid,
        source=draw(_name),
        group=draw(_name),
        prompt_ids=prompt,
        response_ids=response,
        gen_version=gv,
        loss_mask=mask,
        token_versions=tv,
        scalars=scalars,
        tensors=tensors,
        media=media,
    )


def golden_trajectories() -> list[Trajectory]:
    """The trajectories of ``tests/data/shard-v1-000000.tar`` (written by the single-module ``shards.py`` of
    version 1 of the format): deterministic values for every dtype shards hold, encoded and decoded media."""
    out = []
    for i in range(3):
        n = 4 + i
        resp = torch.arange(n, dtype=torch.int64) + 100 * i
        out.append(
            Trajectory(
                id=f"g{i}",
                source="golden",
                group=f"grp{i // 2}",
                prompt_ids=torch.arange(3, dtype=torch.int32),
                response_ids=resp,
                gen_version=i,
                loss_mask=(torch.arange(n) % 2).to(torch.uint8),
                token_versions=torch.full((n,), i, dtype=torch.int64),
                scalars={"reward": 0.5 * i, "turns": i},
                tensors={
                    "logp": (torch.arange(n, dtype=torch.float32) / 8).to(torch.bfloat16),
                    "values.v2/x": torch.arange(2 * n, dtype=torch.float16).view(2, n),
                    "flags": torch.arange(n) % 3 == 0,
                    "f64": torch.linspace(0, 1, n, dtype=torch.float64),
                },
                media=[
                    MediaItem("image", data=b"\x89PNG\r\n\x1a\n" + bytes(range(i, i + 24))),
                    MediaItem("audio", tensor=torch.arange(6, dtype=torch.float32).view(2, 3) + i, sample_rate=16000),
                ],
            )
        )
    return out
