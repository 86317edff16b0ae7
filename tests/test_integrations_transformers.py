"""knitdata.integrations.transformers on tiny random-init Qwen2.5-VL and Qwen2-Audio models (nothing downloaded).

Every parameter's gradient with fold, leaf and recompute equals the model's own duplicated forward (each
trajectory with its own copy of its media through the model's normal forward), in float64: Qwen2-Audio to
float64 rounding, Qwen2.5-VL to ``GRAD_RTOL`` (its RMSNorm computes in float32 inside a float64 model).
"""

from __future__ import annotations

import json
import socket
import sys
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _hf_helpers import (  # noqa: E402
    AUDIO_ID,
    IMAGE_ID,
    dist_worker,
    grads,
    make_layout,
    max_rel_diff,
    random_media,
    run_native,
    run_shared,
    tiny_image_processor,
    tiny_qwen2_5_vl,
    tiny_qwen2_audio,
)

from knitdata.errors import ConfigError, MediaError  # noqa: E402
from knitdata.integrations.transformers import GRAD_RTOL, adapter_for, qwen2_5_vl, qwen2_audio  # noqa: E402
from knitdata.record import Trajectory  # noqa: E402

FAMILIES = ["qwen2_5_vl", "qwen2_audio"]
TOL = {"qwen2_5_vl": GRAD_RTOL, "qwen2_audio": 1e-10}


@pytest.fixture(scope="module")
def models():
    return {
        "qwen2_5_vl": tiny_qwen2_5_vl(),
        "qwen2_audio": tiny_qwen2_audio(),
    }


def _adapter(models, family):
    m = models[family]
    return qwen2_5_vl(m, tiny_image_processor()) if family == "qwen2_5_vl" else qwen2_audio(m)


def _compare(models, family, mode, mbs, scales, **kw):
    ad = _adapter(models, family)
    batch = ad.media_collator()(mbs)
    ad.model.zero_grad(set_to_none=True)
    run_native(ad, mbs, batch, scales)
    ref = grads(ad.model)
    ad.model.zero_grad(set_to_none=True)
    run_shared(ad, ad.shared_encoding(mode, **kw), mbs, batch, scales)
    got = grads(ad.model)
    ad.model.zero_grad(set_to_none=True)
    return batch, max_rel_diff(got, ref), ref


def _fixed_layout(family):
    """An item shared across micro-batches, a micro-batch without media, two items in one trajectory."""
    rng = np.random.default_rng(7)
    a, b, c = (random_media(family, rng) for _ in range(3))
    ph = IMAGE_ID if family == "qwen2_5_vl" else AUDIO_ID

    def t(i, group, media):
        return Trajectory(
            id=f"t{i}", source="s", group=group, prompt_ids=torch.tensor([1, 4] + [ph, 9] * len(media) + [5]),
            response_ids=torch.tensor([10 + i, 11, 12]), media=media,
        )

    return [
        [t(0, "a", [a]), t(1, "a", [a]), t(2, "b", [b, c])],
        [t(3, "x", []), t(4, "y", [])],  # no media
        [t(5, "b", [b, c]), t(6, "a", [a])],  # shared with micro-batch 0
    ]


@pytest.mark.parametrize("mode", ["fold", "leaf", "recompute", "naive"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_the_models_own_duplicated_forward(models, family, mode):
    mbs = _fixed_layout(family)
    batch, err, ref = _compare(models, family, mode, mbs, [1.0, 0.5, 2.0], chunk_items=2 if mode == "recompute" else None)
    assert batch.tables[batch.kinds[0]].num_items == 3 and batch.num_occurrences == 7
    tower = "model.visual." if family == "qwen2_5_vl" else "model.audio_tower."
    assert max(float(v.abs().max()) for n, v in ref.items() if n.startswith(tower)) > 0
    assert err < TOL[family], err


@settings(max_examples=4, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    mode=st.sampled_from(["fold", "leaf", "recompute"]),
    seed=st.integers(0, 10_000),
    groups=st.integers(1, 3),
    group_size=st.integers(1, 3),
    k=st.integers(1, 3),
)
def test_gradients_equal_on_random_layouts(models, family, mode, seed, groups, group_size, k):
    mbs = make_layout(family, seed, groups=groups, group_size=group_size, k=k)
    scales = [1.0 / (1 + i) for i in range(len(mbs))]
    _, err, _ = _compare(models, family, mode, mbs, scales)
    assert err < TOL[family], err


def test_media_table_carries_the_processors_metadata(models):
    ad = _adapter(models, "qwen2_5_vl")
    mbs = _fixed_layout("qwen2_5_vl")
    batch = ad.media_collator()(mbs)
    table = batch.tables["image"]
    grid = table.meta["image_grid_thw"]
    assert grid.shape == (3, 3) and grid.dtype == torch.long
    assert torch.equal(table.lengths, grid.prod(-1))  # patches per image
    inputs = ad.collate(mbs[0], batch, 0)
    occ = batch.for_microbatch(0)["image"]
    assert torch.equal(inputs["image_grid_thw"], grid[occ.index])
    assert int((inputs["input_ids"] == IMAGE_ID).sum()) == int((grid[occ.index].prod(-1) // 4).sum())
    assert torch.equal(inputs["mm_token_type_ids"].bool(), inputs["input_ids"] == IMAGE_ID)
    # slicing and gathering keep the metadata aligned with the items
    assert torch.equal(table.gather([2, 0]).meta["image_grid_thw"], grid[[2, 0]])
    assert torch.equal(table.slice(1, 3).meta["image_grid_thw"], grid[1:3])
    audio = _adapter(models, "qwen2_audio")
    ab = audio.media_collator()(_fixed_layout("qwen2_audio"))
    fl = ab.tables["audio"].meta["feature_length"]
    assert fl.shape == (3,) and bool((fl > 0).all()) and bool((fl <= audio.frames).all())


def test_collate_labels_follow_the_response_and_loss_mask(models):
    ad = _adapter(models, "qwen2_audio")
    mbs = make_layout("qwen2_audio", 3, groups=2, group_size=2, k=1)
    batch = ad.media_collator()(mbs)
    inputs = ad.collate(mbs[0], batch, 0)
    for j, t in enumerate(mbs[0]):
        n = int(inputs["attention_mask"][j].sum())
        resp = t.response_ids.numel()
        assert torch.equal(inputs["input_ids"][j, n - resp : n], t.response_ids)
        want = t.response_ids.clone()
        want[t.loss_mask == 0] = -100
        assert torch.equal(inputs["labels"][j, n - resp : n], want)
        assert bool((inputs["labels"][j, : n - resp] == -100).all()) and bool((inputs["labels"][j, n:] == -100).all())


def test_placeholder_and_row_mismatches_are_named(models):
    ad = _adapter(models, "qwen2_5_vl")
    mbs = _fixed_layout("qwen2_5_vl")
    bad = Trajectory(id="bad", source="s", group="a", prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([3]),
                     media=mbs[0][0].media)
    batch = ad.media_collator()([[bad]])
    with pytest.raises(MediaError, match="bad.*placeholder"):
        ad.collate([bad], batch, 0)
    batch = ad.media_collator()(mbs)
    inputs = ad.collate(mbs[0], batch, 0)
    with pytest.raises(ConfigError, match="placeholder tokens"):
        ad.forward(inputs, None)
    class Bert(torch.nn.Module):
        config = types.SimpleNamespace(model_type="bert")

    with pytest.raises(ConfigError, match="no knitdata adapter for model_type 'bert'"):
        adapter_for(Bert())


def test_recompute_reencodes_in_bfloat16_under_autocast():
    model = tiny_qwen2_audio(dtype=torch.float32)
    ad = qwen2_audio(model)
    mbs = _fixed_layout("qwen2_audio")
    batch = ad.media_collator()(mbs)
    seen = []
    hook = model.model.audio_tower.layers[0].fc1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    shared = ad.shared_encoding("recompute")
    sm = shared.minibatch(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sm.__enter__()
    for i, mb in enumerate(mbs):
        inputs = ad.collate(mb, batch, i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ad.forward(inputs, sm.rows(i)).loss
        sm.backward(loss)
    sm.__exit__(None, None, None)
    hook.remove()
    assert len(seen) == 2 and all(d == torch.bfloat16 for d in seen), seen
    assert model.model.audio_tower.conv1.weight.grad is not None


TIMEOUT_S = 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_ddp_two_gloo_ranks_qwen2_5_vl(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(dist_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"distributed run did not finish within {TIMEOUT_S}s (hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in ("media", "nomedia"):
            assert name in res, (rank, res)
            r = res[name]
            assert "error" not in r, r.get("error")
            assert r["rel_err"] < GRAD_RTOL, (rank, name, r)
            assert r["same_on_ranks"], (rank, name, r)
            assert r["visual_grad_max"] > 0, (rank, name, r)


def test_llava_recipe_in_the_module_docstring():
    """The documented LLaVA-style recipe (CLIP tower + projector, the forward's mm_encoder_outputs hook)."""
    from torch import nn
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from knitdata.encoder import SharedEncoding
    from knitdata.multimodal import MediaOccurrences, MediaTable, MultimodalBatch

    torch.manual_seed(0)
    vc = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                          image_size=16, patch_size=4, projection_dim=16)
    cfg = LlavaConfig(vision_config=vc, image_token_id=120,
                      text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128, pad_token_id=0))
    model = LlavaForConditionalGeneration(cfg).double()
    C, H, W, R = 3, 16, 16, 16  # 4x4 patches, CLS dropped ("default" select strategy)

    def call(encoder, table):
        pix = table.values.reshape(-1, C, H, W).to(model.dtype)
        return torch.cat(list(model.model.get_image_features(pixel_values=pix).pooler_output), 0)

    encoder = nn.ModuleDict({"tower": model.model.vision_tower, "proj": model.model.multi_modal_projector})
    imgs = torch.randn(2, C * H * W, dtype=torch.float64)
    table = MediaTable("image", imgs, torch.tensor([0, 1, 2]), ("a", "b"))
    occ = [{"image": MediaOccurrences(torch.tensor([0, 1, 0]), torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0]))},
           {"image": MediaOccurrences(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))}]
    batch = MultimodalBatch({"image": table}, occ)
    mbs = [torch.tensor([[1, 5] + [120] * R + [7, 8, 9]] * n) for n in (3, 1)]
    for i, ids in enumerate(mbs):
        pix = imgs[occ[i]["image"].index].reshape(-1, C, H, W)
        model(input_ids=ids, pixel_values=pix, labels=ids).loss.backward()
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    shared = SharedEncoding(encoder, call=call, out_lengths=lambda n: n * R)
    with shared.minibatch(batch) as sm:
        for i, ids in enumerate(mbs):
            rows = BaseModelOutputWithPooling(pooler_output=(sm.rows(i),))
            sm.backward(model(input_ids=ids, labels=ids, mm_encoder_outputs={"image": rows}).loss)
    got = grads(model)
    assert set(got) == set(ref)
    scale = max(float(v.abs().max()) for v in ref.values())  # k_proj.bias has a true gradient of 0: global scale
    assert max(float((got[n] - ref[n]).abs().max()) for n in ref) < 1e-10 * scale
