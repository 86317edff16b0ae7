"""knitdata.integrations.qwen_omni on tiny random-init Qwen2.5-Omni (thinker) and Qwen3-VL models.

Every parameter's gradient with fold, leaf and recompute equals the model's own duplicated forward (each
trajectory with its own copy of its media through the model's normal forward), in float64, with images,
real video containers (decoded with PyAV) and audio clips in one batch for Qwen2.5-Omni, and Qwen3-VL's
deepstack features included; items are shared across micro-batches.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("av")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _hf_helpers import (  # noqa: E402
    AEND,
    ASTART,
    AUDIO_ID,
    IMAGE_ID,
    VEND,
    VIDEO_ID,
    VSTART,
    grads,
    max_rel_diff,
    run_native,
    tiny_feature_extractor,
    tiny_image_processor,
    tiny_qwen2_5_omni,
    tiny_qwen3_vl,
    tiny_video,
)

from knitdata.errors import ConfigError, MediaError  # noqa: E402
from knitdata.integrations.transformers import adapter_for, qwen2_5_omni, qwen3_vl  # noqa: E402
from knitdata.media.process import audio_item, image_item  # noqa: E402
from knitdata.media.video import VideoSampling, video_item  # noqa: E402
from knitdata.record import Trajectory  # noqa: E402

MODES = ["fold", "leaf", "recompute"]


@pytest.fixture(scope="module")
def omni():
    return tiny_qwen2_5_omni()


@pytest.fixture(scope="module")
def q3():
    return tiny_qwen3_vl()


def _omni_adapter(model):
    return qwen2_5_omni(model, tiny_image_processor(), tiny_feature_extractor(), VideoSampling(fps=2.0))


def _media(kind: str, rng: np.random.Generator, seed: int):
    if kind == "image":
        h, w = (int(x) * 8 for x in rng.integers(1, 4, size=2))
        return image_item(torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)))
    if kind == "video":
        return video_item(tiny_video(frames=int(rng.integers(4, 9)), size=(16, 16), seed=seed))
    n = int(rng.integers(10, 60)) * 160
    return audio_item(rng.standard_normal(n).astype(np.float32), sample_rate=16000)


_WRAP = {"image": (VSTART, IMAGE_ID, VEND), "video": (VSTART, VIDEO_ID, VEND), "audio": (ASTART, AUDIO_ID, AEND)}


def omni_layout(seed: int, *, groups: int = 3, group_size: int = 3, k: int = 3, kinds=("image", "video", "audio")):
    """Groups sharing image + video + audio (in a random order per prompt), shuffled over k micro-batches."""
    rng = np.random.default_rng(seed)
    r = random.Random(seed)
    trajs = []
    for g in range(groups):
        ks = [kd for kd in kinds if r.random() < 0.85] if g else list(kinds)
        r.shuffle(ks)
        media = [_media(kd, rng, seed * 100 + g * 10 + i) for i, kd in enumerate(ks)]
        prompt = [1, 5 + g]
        for kd in ks:
            prompt += list(_WRAP[kd]) + [8]
        prompt += [7]
        for m in range(group_size):
            resp = [int(x) for x in rng.integers(3, 100, size=r.randint(1, 4))]
            trajs.append(Trajectory(id=f"g{g}m{m}", source="s", group=f"g{g}", prompt_ids=torch.tensor(prompt),
                                    response_ids=torch.tensor(resp), media=list(media)))
    r.shuffle(trajs)
    return [mb for mb in (trajs[i::k] for i in range(k)) if mb]


def run_shared_multi(ad, shared, mbs, batch, scales):
    with shared.minibatch(batch) as sm:
        for i, mb in enumerate(mbs):
            sm.backward(ad.forward(ad.collate(mb, batch, i), ad.rows(sm, i)).loss * scales[i])


def _compare(ad, mbs, mode, multi: bool, **kw):
    batch = ad.media_collator()(mbs)
    scales = [1.0 / (1 + i) for i in range(len(mbs))]
    ad.model.zero_grad(set_to_none=True)
    run_native(ad, mbs, batch, scales)
    ref = grads(ad.model)
    ad.model.zero_grad(set_to_none=True)
    shared = ad.shared_encoding(mode, **kw)
    if multi:
        run_shared_multi(ad, shared, mbs, batch, scales)
    else:
        with shared.minibatch(batch) as sm:
            for i, mb in enumerate(mbs):
                sm.backward(ad.forward(ad.collate(mb, batch, i), sm.rows(i)).loss * scales[i])
    got = grads(ad.model)
    ad.model.zero_grad(set_to_none=True)
    return batch, max_rel_diff(got, ref), ref


@pytest.mark.parametrize("mode", MODES)
def test_omni_image_video_audio_gradients_equal_native(omni, mode):
    ad = _omni_adapter(omni)
    mbs = omni_layout(1)
    batch, err, ref = _compare(ad, mbs, mode, True, chunk_items=2 if mode == "recompute" else None)
    assert set(batch.kinds) == {"image", "video", "audio"}
    # an item of each kind is shared across micro-batches
    for kind in batch.kinds:
        per_mb = [set(mm[kind].index.tolist()) for mm in batch.occurrences if kind in mm]
        assert any(a & b for x, a in enumerate(per_mb) for b in per_mb[x + 1:]), kind
    # every tower got a gradient, and every parameter matches the duplicated native path
    assert any(n.startswith("model.audio_tower.") for n in ref) and any(n.startswith("model.visual.") for n in ref)
    assert err <= 1e-6, err  # the vision RMSNorm computes in float32 inside the float64 model: about 1e-7


def test_omni_meta_and_collate(omni):
    ad = _omni_adapter(omni)
    mbs = omni_layout(2)
    batch = ad.media_collator()(mbs)
    v, a = batch.tables["video"], batch.tables["audio"]
    assert v.meta["video_grid_thw"].shape == (v.num_items, 3)
    assert torch.allclose(v.meta["video_second_per_grid"], torch.full((v.num_items,), 2 / 2.0, dtype=torch.float64))
    assert torch.equal(a.meta["feature_length"], a.lengths)  # only the valid mel frames are stored
    inputs = ad.collate(mbs[0], batch, 0)
    rows = {k: int(ad.out_rows(batch.tables[k])[batch.for_microbatch(0)[k].index].sum())
            for k in batch.for_microbatch(0)}
    for k, pid in ad.placeholders.items():
        assert int((inputs["input_ids"] == pid).sum()) == rows.get(k, 0)
    assert adapter_for(omni, tiny_image_processor()).family == "qwen2_5_omni"


def test_omni_placeholder_mismatch_named(omni):
    ad = _omni_adapter(omni)
    rng = np.random.default_rng(0)
    t = Trajectory(id="bad", source="s", group="g", prompt_ids=torch.tensor([1, VSTART, VIDEO_ID, VEND, 7]),
                   response_ids=torch.tensor([3, 4]), media=[_media("audio", rng, 0)])
    batch = ad.media_collator()([[t]])
    with pytest.raises(MediaError, match="'bad'.*0 video|'bad'.*1 audio|'bad'.*0 audio"):
        ad.collate([t], batch, 0)


@pytest.mark.parametrize("mode", MODES)
def test_qwen3_vl_gradients_with_deepstack_equal_native(q3, mode):
    ad = qwen3_vl(q3, tiny_image_processor())
    mbs = omni_layout(3, kinds=("image",), groups=3, group_size=3, k=3)
    batch, err, ref = _compare(ad, mbs, mode, False)
    per_mb = [set(mm["image"].index.tolist()) for mm in batch.occurrences if "image" in mm]
    assert any(a & b for x, a in enumerate(per_mb) for b in per_mb[x + 1:])  # an image shared across micro-batches
    assert any("deepstack_merger_list" in n for n in ref)  # the deepstack mergers are trained through E
    assert any(".visual.blocks.0." in n for n in ref)
    assert err <= 1e-6, err


def test_qwen3_vl_rows_are_merged_plus_deepstack(q3):
    ad = adapter_for(q3, tiny_image_processor())
    mbs = omni_layout(4, kinds=("image",), groups=2, group_size=2, k=2)
    batch = ad.media_collator()(mbs)
    with ad.shared_encoding("fold").minibatch(batch) as sm:
        for i, mb in enumerate(mbs):
            rows = sm.rows(i)
            inputs = ad.collate(mb, batch, i)
            if rows is not None:
                assert isinstance(rows, tuple) and len(rows) == 1 + len(q3.config.vision_config.deepstack_visual_indexes)
                assert all(r.shape == rows[0].shape for r in rows)
            sm.backward(ad.forward(inputs, rows).loss)
    with pytest.raises(ConfigError, match="placeholder"):
        ad.forward(ad.collate(mbs[0], batch, 0), None) if batch.for_microbatch(0) else (_ for _ in ()).throw(
            ConfigError("placeholder"))


def test_omni_dummy_encode_of_missing_kinds(omni):
    """A rank whose mini-batch holds only images still runs both towers (zero-gradient dummy encodes of video and
    audio), so that its collectives line up with ranks that hold them; the gradients are the native ones."""
    ad = _omni_adapter(omni)
    mbs = omni_layout(5, kinds=("image",), groups=2, group_size=2, k=2)
    batch = ad.media_collator()(mbs)
    assert batch.kinds == ("image",)
    ad.model.zero_grad(set_to_none=True)
    run_native(ad, mbs, batch, [1.0, 1.0])
    ref = grads(ad.model)
    ad.model.zero_grad(set_to_none=True)
    run_shared_multi(ad, ad.shared_encoding("fold", dummy=True), mbs, batch, [1.0, 1.0])
    got = grads(ad.model)
    audio = [n for n in got if n.startswith("model.audio_tower.")]
    assert audio and all(float(got[n].abs().max()) == 0.0 for n in audio)  # ran, with a zero gradient
    assert max_rel_diff({n: g for n, g in got.items() if n in ref}, ref) <= 1e-6
