"""Tiny random-init Hugging Face multimodal models (built from configs, nothing downloaded) and layouts."""

from __future__ import annotations

import copy
import json
import os
import random
import sys
import traceback

import numpy as np
import torch

from knitdata.media.process import audio_item, image_item
from knitdata.record import Trajectory

# token ids of the tiny vocabularies (128 tokens)
IMAGE_ID, VIDEO_ID, VSTART, VEND, AUDIO_ID = 120, 121, 122, 123, 124


def tiny_qwen2_5_vl(dtype=torch.float64, seed: int = 0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
            temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1], in_channels=3,
        ),
        text_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=1024, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        ),
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg).to(dtype)


def tiny_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # small images stay small: 64..1024 pixels per image (multiples of patch 4 x merge 2)
    return Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 64, "longest_edge": 1024}
    )


def tiny_qwen2_audio(dtype=torch.float64, seed: int = 0):
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    cfg = Qwen2AudioConfig(
        audio_config=dict(
            d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, num_mel_bins=16,
            max_source_positions=40,
        ),
        text_config=dict(
            model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        ),
        audio_token_id=AUDIO_ID,
    )
    torch.manual_seed(seed)
    return Qwen2AudioForConditionalGeneration(cfg).to(dtype)


ASTART, AEND = 125, 126  # the omni configs' audio start / end tokens


def tiny_qwen2_5_omni(dtype=torch.float64, seed: int = 0):
    """A tiny random-init Qwen2.5-Omni thinker (vision tower as Qwen2.5-VL's, audio tower with 16 mel bins)."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    cfg = Qwen2_5OmniThinkerConfig(
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
            temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1], in_channels=3,
        ),
        audio_config=dict(
            d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, num_mel_bins=16,
            max_source_positions=200, n_window=20, output_dim=32,
        ),
        text_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        ),
        image_token_index=IMAGE_ID, video_token_index=VIDEO_ID, audio_token_index=AUDIO_ID,
        vision_start_token_id=VSTART, vision_end_token_id=VEND, audio_start_token_id=ASTART, audio_end_token_id=AEND,
    )
    torch.manual_seed(seed)
    return Qwen2_5OmniThinkerForConditionalGeneration(cfg).to(dtype)


def tiny_qwen3_vl(dtype=torch.float64, seed: int = 0):
    """A tiny random-init Qwen3-VL with two deepstack layers."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(
        vision_config=dict(
            depth=3, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
            temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        ),
        text_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=128, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                             "mrope_interleaved": True},
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        ),
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(cfg).to(dtype)


def tiny_feature_extractor():
    """Whisper features with the tiny omni audio tower's 16 mel bins (clips up to 30 s)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=16)


def tiny_video(frames: int = 6, size: tuple[int, int] = (16, 24), seed: int = 0, fmt: str = "mp4") -> bytes:
    """A real container (mp4 with mpeg4, or webm with vp8) of random frames at 4 fps, made with PyAV."""
    from knitdata.media.video import encode_video

    rng = np.random.default_rng(seed)
    return encode_video(rng.integers(0, 256, (frames, size[0], size[1], 3), dtype=np.uint8), fps=4, fmt=fmt)


def random_media(family: str, rng: np.random.Generator):
    """One media item of the family's kind (images of a few sizes, clips of a few lengths)."""
    if family == "qwen2_5_vl":
        h, w = (int(x) * 8 for x in rng.integers(1, 4, size=2))
        return image_item(torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)))
    n = int(rng.integers(10, 81)) * 160  # 10..80 mel frames of 80
    return audio_item(rng.standard_normal(n).astype(np.float32), sample_rate=16000)


def make_layout(family: str, seed: int, *, groups: int, group_size: int, k: int, max_items: int = 2):
    """GRPO-like micro-batches: groups share their media; some trajectories carry none; shuffled over k."""
    rng = np.random.default_rng(seed)
    r = random.Random(seed)
    ph = IMAGE_ID if family == "qwen2_5_vl" else AUDIO_ID
    trajs = []
    for g in range(groups):
        media = [random_media(family, rng) for _ in range(r.randint(0, max_items))]
        prompt = [1, 5 + g]
        for _ in media:
            prompt += [VSTART, ph, VEND] if family == "qwen2_5_vl" else [ph]
        prompt += [7]
        for m in range(group_size):
            resp = [int(x) for x in rng.integers(3, 100, size=r.randint(1, 4))]
            mask = torch.tensor([r.random() < 0.8 or i == 0 for i in range(len(resp))])
            trajs.append(
                Trajectory(
                    id=f"g{g}m{m}", source="s", group=f"g{g}", prompt_ids=torch.tensor(prompt),
                    response_ids=torch.tensor(resp), loss_mask=mask, media=list(media),
                )
            )
    r.shuffle(trajs)
    mbs = [trajs[i::k] for i in range(k)]
    return [mb for mb in mbs if mb] or [trajs]


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_native(adapter, mbs, batch, scales):
    for i, mb in enumerate(mbs):
        out = adapter.forward_native(adapter.collate(mb, batch, i), batch, i)
        (out.loss * scales[i]).backward()


def run_shared(adapter, shared, mbs, batch, scales, sync=None):
    with shared.minibatch(batch) as sm:
        for i, mb in enumerate(mbs):
            inputs = adapter.collate(mb, batch, i)
            if sync is None:
                sm.backward(adapter.forward(inputs, sm.rows(i)).loss * scales[i])
            else:
                with sync(i):
                    sm.backward(adapter.forward(inputs, sm.rows(i)).loss * scales[i])


def max_rel_diff(got: dict, ref: dict) -> float:
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    return max(float((got[n] - ref[n]).abs().max()) / (float(ref[n].abs().max()) + 1e-30) for n in ref)


def dist_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """DDP (one wrapper, fold) on a tiny Qwen2.5-VL; scenario ``nomedia``: rank 1's mini-batch has no image."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from knitdata.integrations.transformers import qwen2_5_vl
    from knitdata.media.encoder import grad_sync

    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    for name, nomedia in (("media", False), ("nomedia", True)):
        try:
            model0 = tiny_qwen2_5_vl(seed=3)  # same parameters on every rank
            mbs = make_layout("qwen2_5_vl", 50 + rank, groups=2, group_size=2, k=2, max_items=0 if (nomedia and rank) else 2)
            ref_model = copy.deepcopy(model0)
            ref_ad = qwen2_5_vl(ref_model, tiny_image_processor())
            batch = ref_ad.media_collator()(mbs)
            scales = [1.0, 0.5]
            run_native(ref_ad, mbs, batch, scales)
            ref = grads(ref_model)
            names = sorted(n for n, _ in model0.named_parameters())
            for n in names:  # every parameter gets a gradient on some rank: zeros where a rank had none
                v = ref.setdefault(n, torch.zeros_like(dict(model0.named_parameters())[n]))
                dist.all_reduce(v)
                v /= world
            model = DDP(copy.deepcopy(model0), find_unused_parameters=False)
            ad = qwen2_5_vl(model, tiny_image_processor())
            shared = ad.shared_encoding("fold")
            last = len(mbs) - 1
            run_shared(ad, shared, mbs, batch, scales, sync=lambda i, m=model, k=last: grad_sync(m, i == k))
            got = {n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()) for n, p in model.module.named_parameters()}
            err = max_rel_diff(got, ref)
            flat = torch.cat([got[n].reshape(-1) for n in names])
            other = [torch.zeros_like(flat) for _ in range(world)]
            dist.all_gather(other, flat)
            same = all(bool(torch.equal(other[0], o)) for o in other)
            vis = max(float(v.abs().max()) for n, v in got.items() if n.startswith("model.visual."))
            results[name] = {"rel_err": err, "same_on_ranks": same, "visual_grad_max": vis}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            break  # collectives may be out of step: stop rather than hang
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    # the results are written: skip the interpreter's teardown, where a C++ thread left joinable at exit aborts the
    # process now and then ("terminate called without an active exception", SIGABRT) after all the work was done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
