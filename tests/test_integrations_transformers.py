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
    """The module docstring's LLaVA-style recipe, run as written (a tiny CLIP + Llama LLaVA from
    ``tests/_docs_harness.py``), gives the gradients of the model's own forward with every image copy."""
    from _docs_harness import docstring_blocks, tiny_llava

    import knitdata.integrations.transformers as hf

    recipe = next(b.code for b in docstring_blocks(hf) if "LlavaProcessor" in b.code)
    ns = dict(vars(hf))
    ns.update(tiny_llava())
    model, processor, mbs = ns["model"], ns["image_processor"], ns["micro_batches"]
    exec(compile(recipe, "llava recipe", "exec"), ns)
    got = grads(model)
    model.zero_grad(set_to_none=True)
    R = ns["R"]
    for trajs in mbs:  # the reference: every trajectory with its own copy of its image, the model's own forward
        seqs = [torch.cat([t.prompt_ids.repeat_interleave(1 + (R - 1) * (t.prompt_ids == 31)), t.response_ids])
                for t in trajs]
        ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in seqs], batch_first=True)
        pix = torch.cat([processor(images=[t.media[0].tensor], return_tensors="pt")["pixel_values"] for t in trajs])
        model(input_ids=ids, attention_mask=mask, pixel_values=pix.to(model.dtype),
              labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    ref = grads(model)
    assert set(got) == set(ref)
    scale = max(float(v.abs().max()) for v in ref.values())  # k_proj.bias has a true gradient of 0: global scale
    assert max(float((got[n] - ref[n]).abs().max()) for n in ref) < 1e-10 * scale
    assert max(float(v.abs().max()) for n, v in got.items() if "vision_tower" in n) > 0


# ------------------------------------------------------------------------- collate from the dataset, loss scaling
def _put_all(trajs, *, num_consumers, token_budget, group_size):
    from knitdata import BatchSpec, Pipeline

    spec = BatchSpec({"s": len(trajs)}, num_minibatches=1, group_size=group_size)
    pipe = Pipeline(spec, num_consumers=num_consumers, token_budget=token_budget)
    for t in sorted(trajs, key=lambda t: t.group):
        pipe.put(t)
    pipe.close()
    return pipe


@pytest.mark.parametrize("mode", ["pad", "pack"])
@pytest.mark.parametrize("family", FAMILIES)
def test_collate_takes_the_datasets_micro_batches(models, family, mode):
    """``adapter.collate(mb)`` on what ``pipe.dataset(...)`` yields (padded or packed, any pad id, loss masks)
    equals the collate of the micro-batch's trajectories with its media batch."""
    from knitdata import TokenCollator

    ad = _adapter(models, family)
    trajs = make_layout(family, 11, groups=3, group_size=2, k=1)[0]
    by_id = {t.id: t for t in trajs}
    pipe = _put_all(trajs, num_consumers=2, token_budget=max(t.num_tokens for t in trajs) + 4, group_size=2)
    seen = 0
    for rank in range(2):
        for mb in pipe.dataset(rank, media_collator=ad.media_collator(),
                               collate=TokenCollator(pad_id=7, mode=mode, pad_to_multiple_of=3)):
            ts = [by_id[i] for i in mb.info.trajectory_ids]
            got = ad.collate(mb)
            if not ts:
                assert got["input_ids"].shape == (1, 2)  # the dummy row of an empty micro-batch
                continue
            want = ad.collate(ts, mb.media, mb.info.microbatch)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            seen += len(ts)
    assert seen == len(trajs)


def test_collate_errors_say_what_to_do(models):
    from knitdata import TokenCollator

    ad = _adapter(models, "qwen2_audio")
    trajs = make_layout("qwen2_audio", 2, groups=1, group_size=2, k=1)[0]
    pipe = _put_all(trajs, num_consumers=1, token_budget=64, group_size=2)
    mb = next(iter(pipe.dataset(0)))  # no media collator
    with pytest.raises(ConfigError, match="media_collator=adapter.media_collator"):
        ad.collate(mb)
    with pytest.raises(ConfigError, match="give the mini-batch's MultimodalBatch"):
        ad.collate(trajs)
    bare = TokenCollator()(trajs)
    bare.prompt_lengths = None
    with pytest.raises(ConfigError, match="TokenCollator"):
        ad.collate(bare, ad.media_collator()([trajs]), 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_scale_mean_loss_gives_the_minibatch_token_mean_across_ranks(models, family):
    """Two ranks (one with an empty micro-batch), several micro-batches each: the sum over micro-batches of
    ``scale_mean_loss(out.loss, ...)``, averaged over the ranks as DDP does, has the gradient of the model's mean
    loss over the whole mini-batch in one forward."""
    from knitdata.integrations.transformers import scale_mean_loss

    ad = _adapter(models, family)
    trajs = make_layout(family, 4, groups=3, group_size=1, k=1)[0]  # 3 single-trajectory groups over 2 ranks
    by_id = {t.id: t for t in trajs}
    budget = max(t.num_tokens for t in trajs)  # one trajectory per micro-batch
    pipe = _put_all(trajs, num_consumers=2, token_budget=budget, group_size=1)
    per_rank, empties = [], 0
    for rank in range(2):
        ad.model.zero_grad(set_to_none=True)
        shared = ad.shared_encoding("fold")
        for mb in pipe.dataset(rank, media_collator=ad.media_collator()):
            i = mb.info.microbatch
            if i == 0:
                sm = shared.minibatch(mb.media).__enter__()
            inputs = ad.collate(mb)
            out = ad.forward(inputs, sm.rows(i))
            loss = scale_mean_loss(out.loss, inputs, mb, world_size=2)
            if mb.is_empty:
                empties += 1
                assert float(loss.detach()) == 0.0 and loss.requires_grad
            sm.backward(loss)
            if mb.info.is_last:
                sm.__exit__(None, None, None)
        per_rank.append(grads(ad.model))
    assert empties == 1
    # a rank with no media has no encoder gradient here (one process: no dummy encode), DDP would reduce zeros
    names = set(per_rank[0]) | set(per_rank[1])
    got = {n: (per_rank[0].get(n, 0.0) + per_rank[1].get(n, 0.0)) / 2 for n in names}
    ad.model.zero_grad(set_to_none=True)
    batch = ad.media_collator()([trajs])
    ad.forward_native(ad.collate(trajs, batch, 0), batch, 0).loss.backward()  # HF's mean over all label tokens
    ref = grads(ad.model)
    ad.model.zero_grad(set_to_none=True)
    assert set(by_id) == {t.id for t in trajs}
    assert max_rel_diff(got, ref) < TOL[family]


def test_scale_mean_loss_edge_cases():
    from knitdata.consumer.collate import MicroBatchInfo
    from knitdata.errors import ValidationError
    from knitdata.integrations.transformers import scale_mean_loss

    info = MicroBatchInfo(consumer=0, train_batch=0, minibatch=0, minibatch_in_batch=0, microbatch=0,
                          num_microbatches=1, is_last=True, global_tokens=20, global_trajectories=2,
                          global_loss_tokens=8, trajectory_ids=("a",), gen_versions=(0,))
    labels = torch.tensor([[-100, -100, 5, 6, -100], [-100, 3, 4, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    x = torch.tensor(2.0, requires_grad=True)
    out = scale_mean_loss(x, {"labels": labels, "attention_mask": mask}, info, world_size=4)
    assert float(out.detach()) == pytest.approx(2.0 * 6 * 4 / 8)  # 6 label tokens after the shift
    nan = torch.tensor(float("nan"), requires_grad=True)  # every label masked: the model's mean is NaN
    zero = scale_mean_loss(nan, {"labels": torch.full((1, 3), -100)}, info, world_size=1)
    zero.backward()
    assert float(zero) == 0.0 and float(nan.grad) == 0.0
    with pytest.raises(ValidationError, match="no MicroBatchInfo"):
        scale_mean_loss(x, {"labels": labels}, None, world_size=1)
    with pytest.raises(ConfigError, match="world_size"):
        scale_mean_loss(x, {"labels": labels}, info, world_size=0)
    import dataclasses

    with pytest.raises(ValidationError, match="global_loss_tokens=0"):
        scale_mean_loss(x, {"labels": labels}, dataclasses.replace(info, global_loss_tokens=0), world_size=1)


def test_adapter_for_takes_the_processor_by_keyword(models):
    """The documented call: ``adapter_for(model, processor=...)`` (no ``image_processor`` keyword)."""
    ad = adapter_for(models["qwen2_5_vl"], processor=tiny_image_processor())
    assert ad.family == "qwen2_5_vl" and ad.processor.size["longest_edge"] == 1024
    import inspect

    assert list(inspect.signature(adapter_for).parameters) == ["model", "processor"]
