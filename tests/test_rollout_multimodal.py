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
        attach_media(_sample([1]), [], placeholder_ids={"video": 121})


def test_engine_expanded_prompt_goes_through_the_models_collate_unchanged() -> None:
    """An engine (vLLM) echoes the prompt with each image's placeholder expanded to its encoder rows; after
    attach_media the Qwen2.5-VL collate expands it again to exactly that many rows, with the processor's metadata."""
    pytest.importorskip("transformers")
    from _hf_helpers import tiny_image_processor, tiny_qwen2_5_vl

    from knitdata import BatchSpec, Pipeline
    from knitdata.integrations.transformers import qwen2_5_vl

    model = tiny_qwen2_5_vl(dtype=torch.float32)
    adapter = qwen2_5_vl(model, tiny_image_processor())
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((32, 32), (16, 24))]
    rows = []
    for p in pixels:  # what the engine's processor expands each image to: grid patches / merge**2
        _, meta = adapter.preprocess(torch.from_numpy(p).permute(2, 0, 1))
        rows.append(int(meta["image_grid_thw"].prod()) // 4)
    engine_prompt = [1, VS, *[IMAGE] * rows[0], VE, 9, VS, *[IMAGE] * rows[1], VE, 8]
    group = RolloutGroup("req", [RolloutSample("req", i, prompt_ids=engine_prompt, response_ids=[40 + i, 2],
                                               logprobs=[-1.0, -1.0], version=0) for i in range(2)])
    trajs = attach_media(group, pixels, placeholder_ids={"image": IMAGE}).trajectories("vqa")
    pipe = Pipeline(BatchSpec({"vqa": 2}, num_minibatches=1, group_size=2), num_consumers=1, token_budget=4096)
    for t in trajs:
        pipe.put(t)
    pipe.close()
    [mb] = list(pipe.dataset(0, media_collator=adapter.media_collator()))
    assert mb.media.tables["image"].num_items == 2  # the group's two images, each processed once
    inputs = adapter.collate(mb)
    for j in range(2):
        n = int(inputs["attention_mask"][j].sum())
        assert inputs["input_ids"][j, :n - 2].tolist() == engine_prompt  # exactly the engine's expanded prompt
    assert inputs["image_grid_thw"].shape[0] == 4  # 2 images x 2 trajectories
