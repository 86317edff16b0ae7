"""Tests of knitdata.rollout.multimodal: raw media of an engine's prompt become media items, the engine's expanded
placeholders one per item, and the model's collate and shared encoding take the trajectories unchanged."""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
import torch

from knitdata.errors import RolloutOutputError
from knitdata.record import MediaItem
from knitdata.rollout import RolloutGroup, RolloutSample, attach_media, media_item

sys.path.insert(0, os.path.dirname(__file__))

IMAGE, AUDIO, VS, VE = 120, 124, 122, 123


def _sample(prompt, index=0) -> RolloutSample:
    return RolloutSample("mm", index, prompt_ids=prompt, response_ids=[5, 6], logprobs=[-1.0, -1.0], version=1)


def test_raw_media_of_every_form_become_items() -> None:
    from PIL import Image

    pil = Image.fromarray(np.full((6, 4, 3), 7, dtype=np.uint8))
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    items = [media_item(pil), media_item(np.zeros((4, 4, 3), dtype=np.uint8)), media_item(buf.getvalue()),
             media_item((np.zeros(1600, dtype=np.float32), 16000)),
             media_item({"array": np.zeros(800, dtype=np.float32), "sampling_rate": 8000})]
    assert [m.kind for m in items] == ["image", "image", "image", "audio", "audio"]
    assert items[0].tensor.shape == (3, 6, 4) and items[2].data is not None
    assert [m.sample_rate for m in items[3:]] == [16000, 8000]
    keep = MediaItem("image", data=buf.getvalue())
    assert media_item(keep) is keep
    with pytest.raises(RolloutOutputError, match="media item 2") as ei:
        attach_media(_sample([IMAGE]), [pil, pil, b"not an image"], placeholder_ids={"image": IMAGE})
    assert ei.value.field == "media" and ei.value.request_id == "mm"


def test_placeholder_runs_collapse_to_one_per_item_for_every_sample() -> None:
    img = np.zeros((8, 8, 3), dtype=np.uint8)
    prompt = [1, VS, *[IMAGE] * 4, VE, 9, VS, *[IMAGE] * 2, VE, AUDIO, AUDIO, AUDIO, 7]
    g = RolloutGroup("mm", [_sample(prompt, 0), _sample(prompt, 1)])
    out = attach_media(g, [img, img, (np.zeros(160, dtype=np.float32), 16000)],
                       placeholder_ids={"image": IMAGE, "audio": AUDIO})
    assert all(s.prompt_ids.tolist() == [1, VS, IMAGE, VE, 9, VS, IMAGE, VE, AUDIO, 7] for s in out.samples)
    assert out.samples[0].media[0] is out.samples[1].media[0]  # one item shared by the group
    ts = out.trajectories("vqa")
    assert [m.kind for m in ts[0].media] == ["image", "image", "audio"]
    single = attach_media(_sample([1, IMAGE, 2]), [img], placeholder_ids={"image": IMAGE})
    assert single.prompt_ids.tolist() == [1, IMAGE, 2]  # already one per item: unchanged
    with pytest.raises(RolloutOutputError, match=r"1 run\(s\) of the image placeholder 120 for 2 image") as ei:
        attach_media(_sample([1, IMAGE, IMAGE, 2]), [img, img], placeholder_ids={"image": IMAGE})
    assert (ei.value.field, ei.value.sample) == ("prompt_ids", 0)
    with pytest.raises(RolloutOutputError, match="names no audio placeholder"):
        attach_media(_sample([1, IMAGE]), [img, (np.zeros(16, dtype=np.float32), 16000)],
                     placeholder_ids={"image": IMAGE})
    with pytest.raises(RolloutOutputError, match="unknown media kind"):
        attach_media(_sample([1]), [], placeholder_ids={"hologram": 121})


def _engine_rows(adapter, family: str, raw) -> int:
    """How many placeholder tokens the engine's processor expands one item to (the model's encoder rows)."""
    if family == "qwen2_5_vl":  # grid patches / merge_size**2
        _, meta = adapter.preprocess(torch.from_numpy(raw).permute(2, 0, 1))
        return int(meta["image_grid_thw"].prod()) // 4
    samples, rate = raw  # valid mel frames L -> ((L - 1) // 2 + 1 - 2) // 2 + 1 rows
    _, meta = adapter.preprocess(torch.from_numpy(samples)[:, None], rate)
    length = int(meta["feature_length"])
    return ((length - 1) // 2 + 1 - 2) // 2 + 1


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_audio"])
def test_engine_expanded_prompt_goes_through_the_models_collate_unchanged(family) -> None:
    """An engine (vLLM) echoes the prompt with each item's placeholder expanded to its encoder rows; after
    attach_media the model's collate expands it again to exactly that many rows, with the processor's metadata
    (Qwen2.5-VL's image_grid_thw, Qwen2-Audio's valid feature length) computed from the raw media."""
    pytest.importorskip("transformers")
    from _hf_helpers import tiny_image_processor, tiny_qwen2_5_vl, tiny_qwen2_audio

    from knitdata import BatchSpec, Pipeline
    from knitdata.integrations.transformers import qwen2_5_vl, qwen2_audio

    rng = np.random.default_rng(0)
    if family == "qwen2_5_vl":
        adapter = qwen2_5_vl(tiny_qwen2_5_vl(dtype=torch.float32), tiny_image_processor())
        raw = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((32, 32), (16, 24))]
        ph, kind, meta_name = IMAGE, "image", "image_grid_thw"
    else:
        adapter = qwen2_audio(tiny_qwen2_audio(dtype=torch.float32))
        raw = [(rng.standard_normal(n * 160).astype(np.float32), 16000) for n in (30, 64)]
        ph, kind, meta_name = AUDIO, "audio", "feature_length"
    rows = [_engine_rows(adapter, family, r) for r in raw]
    assert rows[0] != rows[1] and min(rows) > 1
    engine_prompt = [1, VS, *[ph] * rows[0], VE, 9, VS, *[ph] * rows[1], VE, 8]
    group = RolloutGroup("req", [RolloutSample("req", i, prompt_ids=engine_prompt, response_ids=[40 + i, 2],
                                               logprobs=[-1.0, -1.0], version=0) for i in range(2)])
    trajs = attach_media(group, raw, placeholder_ids={kind: ph}).trajectories("mm")
    assert trajs[0].prompt_ids.tolist() == [1, VS, ph, VE, 9, VS, ph, VE, 8]
    pipe = Pipeline(BatchSpec({"mm": 2}, num_minibatches=1, group_size=2), num_consumers=1, token_budget=4096)
    for t in trajs:
        pipe.put(t)
    pipe.close()
    [mb] = list(pipe.dataset(0, media_collator=adapter.media_collator()))
    table = mb.media.tables[kind]
    assert table.num_items == 2 and meta_name in table.meta  # the group's two items, each processed once
    inputs = adapter.collate(mb)
    for j in range(2):
        n = int(inputs["attention_mask"][j].sum())
        assert inputs["input_ids"][j, :n - 2].tolist() == engine_prompt  # exactly the engine's expanded prompt


def test_an_expansion_other_than_the_trainers_is_refused() -> None:
    """Issue 45.6: the engine expanded image 1 to 63 tokens while the trainer's processor makes 60: collapsing and
    re-expanding to 60 would shift every later position. The error names the trajectory, the media index and both
    counts; expansions that agree pass."""
    img, other = np.zeros((8, 8, 3), dtype=np.uint8), np.ones((8, 8, 3), dtype=np.uint8)
    trainer_rows = {media_item(img).digest: 4, media_item(other).digest: 60}

    def rows(item: MediaItem) -> int:  # the trainer's processor: img -> 4 rows, other -> 60
        return trainer_rows[item.digest]

    prompt = [1, VS, *[IMAGE] * 4, VE, 9, VS, *[IMAGE] * 63, VE, 8]
    group = RolloutGroup("mm", [_sample(prompt, 0), _sample(prompt, 1)])
    with pytest.raises(RolloutOutputError, match=r"request 'mm': sample 0: .*trajectory 'mm-0'.*media item 1.*"
                                                 r"63 .*60") as ei:
        attach_media(group, [img, other], placeholder_ids={"image": IMAGE}, expected_rows=rows)
    assert ei.value.field == "prompt_ids" and ei.value.sample == 0
    ok = [1, VS, *[IMAGE] * 4, VE, 9, VS, *[IMAGE] * 60, VE, 8]
    out = attach_media(_sample(ok), [img, other], placeholder_ids={"image": IMAGE}, expected_rows=rows)
    assert out.prompt_ids.tolist() == [1, VS, IMAGE, VE, 9, VS, IMAGE, VE, 8]


def test_the_adapters_placeholder_rows_catch_a_mismatched_engine_expansion() -> None:
    """Issue 45.6 with a real model's processor (tiny Qwen2.5-VL): HFMultimodalAdapter.placeholder_rows is the
    number of tokens the trainer's collate expands an image to; an engine prompt with 3 more is refused."""
    pytest.importorskip("transformers")
    from _hf_helpers import tiny_image_processor, tiny_qwen2_5_vl

    from knitdata.integrations.transformers import qwen2_5_vl

    adapter = qwen2_5_vl(tiny_qwen2_5_vl(dtype=torch.float32), tiny_image_processor())
    raw = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    n = _engine_rows(adapter, "qwen2_5_vl", raw)
    assert adapter.placeholder_rows(media_item(raw)) == n > 1
    good = attach_media(_sample([1, VS, *[IMAGE] * n, VE]), [raw], placeholder_ids={"image": IMAGE},
                        expected_rows=adapter.placeholder_rows)
    assert good.prompt_ids.tolist() == [1, VS, IMAGE, VE]
    with pytest.raises(RolloutOutputError, match=rf"media item 0.*{n + 3} .*{n}"):
        attach_media(_sample([1, VS, *[IMAGE] * (n + 3), VE]), [raw], placeholder_ids={"image": IMAGE},
                     expected_rows=adapter.placeholder_rows)


def test_a_groups_media_put_once_with_references() -> None:
    """references=True: the first sample carries the pixels, the others refer to them; the pipeline holds one copy."""
    from knitdata import BatchSpec, Pipeline

    image = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)
    group = RolloutGroup("r", [RolloutSample("r", i, prompt_ids=[1, 9, 9, 2], response_ids=[5], logprobs=[-1.0],
                                             version=0) for i in range(4)])
    group = attach_media(group, [image], placeholder_ids={"image": 9}, references=True)
    first, *rest = group.samples
    assert not first.media[0].is_reference and all(s.media[0].is_reference for s in rest)
    assert {s.media[0].digest for s in group.samples} == {first.media[0].digest}
    assert all(s.prompt_ids.tolist() == [1, 9, 2] for s in group.samples)
    pipe = Pipeline(BatchSpec({"v": 4}, num_minibatches=1, group_size=4))
    try:
        trajs = group.trajectories("v")
        pipe.put_many(trajs)
        unit = pipe.internals.units["node0"]
        assert (unit.stats().media_items, unit.stats().media_refs) == (1, 4)
        got = unit.get([t.id for t in trajs])
        assert len({id(t.media[0]) for t in got}) == 1 and torch.equal(got[3].media[0].tensor, first.media[0].tensor)
    finally:
        pipe.shutdown()
