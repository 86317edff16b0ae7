"""GRPO-style training of a tiny random-init Qwen2.5-VL fed by a knitdata pipeline, with shared image encoding.

Run on one process (CPU, seconds)::

    python examples/grpo_vlm.py --out /tmp/grpo_vlm.json

or on 2 CPU processes (each rank runs the same deterministic producer into its own embedded pipeline and
trains on its own share, as in ``examples/grpo_accelerate.py``'s embedded engine)::

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no --main_process_port 29512 examples/grpo_vlm.py --out /tmp/grpo_vlm.json

What it shows:

* the model is ``transformers``' own ``Qwen2_5_VLForConditionalGeneration`` built from a tiny config
  (random weights, nothing downloaded), the image processor its own ``Qwen2VLImageProcessor`` (PIL backend);
* a rollout producer puts GRPO groups into a :class:`~knitdata.pipeline.Pipeline`: every response of a
  group shares its prompt's image (``<|vision_start|><|image_pad|><|vision_end|>`` in the prompt, one
  placeholder per image);
* every rank's loader (:func:`knitdata.integrations.accelerate.prepare_loader`) hands out micro-batches whose
  ``media`` is the :class:`~knitdata.media.multimodal.MultimodalBatch` of the rank's share of the mini-batch:
  each unique image processed once by the model's processor (``adapter.media_collator()``), its
  ``image_grid_thw`` in the media table; ``adapter.collate(mb)`` turns each micro-batch into the model's inputs;
* :class:`~knitdata.media.encoder.SharedEncoding` (``fold``, through ``adapter.shared_encoding()``) encodes each
  unique image once per optimizer step with ``model.visual`` and hands each micro-batch its rows;
  ``adapter.collate`` expands each placeholder to the image's merged-patch count and ``adapter.forward``
  runs the model's own forward (its M-RoPE position ids) with those rows at the placeholders;
* a clipped policy-gradient loss on the response tokens, summed and scaled by ``loader.loss_scale(mb)``,
  accumulated over the plan's micro-batches (``loader.accumulate``: DDP synchronizes on the last one,
  where fold also runs the encoder's backward), one optimizer step per mini-batch;
* ``--check-grads``: on the first mini-batch, the gradients also equal the model's own duplicated forward
  (every trajectory's copy of its image through the model's normal forward), printed as
  ``max_rel_grad_diff`` (one process only);
* ``--family qwen2_5_omni``: the same loop on a tiny random-init Qwen2.5-Omni thinker, every prompt with an
  image, a video (a real MP4 container made with PyAV, decoded and sampled at 2 frames per second by the
  collator) and an audio clip, all shared by the group: both towers (vision for images and video, audio) encode
  each unique item once per optimizer step (needs the ``video`` extra)::

      accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
          --dynamo_backend no --main_process_port 29513 examples/grpo_vlm.py --family qwen2_5_omni
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from knitdata import Trajectory
from knitdata.admission import BatchSpec
from knitdata.media.process import image_item

VOCAB = 128
IMAGE_ID, VIDEO_ID, VSTART, VEND = 120, 121, 122, 123
AUDIO_ID, ASTART, AEND = 124, 125, 126
SOURCES = ("caption", "count")
FAMILIES = ("qwen2_5_vl", "qwen2_5_omni")


def tiny_model(seed: int = 0) -> Any:
    """A tiny random-init Qwen2.5-VL (2 vision blocks, patch 4, 2x2 merger; 1 text layer; M-RoPE)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2, window_size=16,
                           fullatt_block_indexes=[1], in_channels=3),
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg)


def tiny_omni_model(seed: int = 0) -> Any:
    """A tiny random-init Qwen2.5-Omni thinker: the vision tower above, a 1-layer audio tower (16 mel bins)."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    cfg = Qwen2_5OmniThinkerConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2, window_size=16,
                           fullatt_block_indexes=[1], in_channels=3),
        audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, num_mel_bins=16,
                          max_source_positions=200, n_window=20, output_dim=32),
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        image_token_index=IMAGE_ID, video_token_index=VIDEO_ID, audio_token_index=AUDIO_ID, vision_start_token_id=VSTART,
        vision_end_token_id=VEND, audio_start_token_id=ASTART, audio_end_token_id=AEND,
    )
    torch.manual_seed(seed)
    return Qwen2_5OmniThinkerForConditionalGeneration(cfg)


def video_mp4(rng: np.random.Generator, frames: int = 6, side: int = 16) -> bytes:
    """A real MP4 (mpeg4) of ``frames`` random frames at 4 fps, made with PyAV."""
    from knitdata.media.video import encode_video

    return encode_video(rng.integers(0, 256, (frames, side, side, 3), dtype=np.uint8), fps=4)


def image_processor() -> Any:
    """The model's own image processor, sized for the tiny model (64..1024 pixels per image)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 64, "longest_edge": 1024})


def make_spec(group_size: int = 4, groups_per_source: int = 1, num_minibatches: int = 2) -> BatchSpec:
    """``groups_per_source`` groups of every source per train batch, split into ``num_minibatches``."""
    return BatchSpec({s: group_size * groups_per_source for s in SOURCES}, num_minibatches=num_minibatches,
                     group_size=group_size)


def _reward(source: str, response: torch.Tensor) -> float:
    if source == "caption":
        return float((response < VOCAB // 4).float().mean())
    return float((response % 2 == 0).float().mean())


def rollout_group(seed: int, batch: int, source: str, index: int, group_size: int, gen_version: int,
                  family: str = "qwen2_5_vl") -> list[Trajectory]:
    """One GRPO group: one prompt image (omni: an image, a video and an audio clip) shared by ``group_size``
    responses; group-relative advantages."""
    group = f"b{batch}-{source}-g{index}"
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{group}".encode()))
    rng = np.random.default_rng(zlib.crc32(group.encode()))
    h, w = (int(x) * 8 for x in rng.integers(2, 5, size=2))
    media = [image_item(torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)))]
    marks = [VSTART, IMAGE_ID, VEND]
    if family == "qwen2_5_omni":
        from knitdata.media.process import audio_item
        from knitdata.media.video import video_item

        media += [video_item(video_mp4(rng, frames=int(rng.integers(4, 9)))),
                  audio_item(rng.standard_normal(int(rng.integers(20, 60)) * 160).astype(np.float32), sample_rate=16000)]
        marks += [VSTART, VIDEO_ID, VEND, ASTART, AUDIO_ID, AEND]
    text = torch.randint(3, 100, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
    prompt = torch.tensor([1, *marks, *text])
    responses = [torch.randint(3, 100, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
                 for _ in range(group_size)]
    rewards = torch.tensor([_reward(source, r) for r in responses])
    adv = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
    return [
        Trajectory(id=f"{group}-r{j}", source=source, group=group, prompt_ids=prompt.clone(), response_ids=r,
                   gen_version=gen_version, scalars={"reward": float(rewards[j]), "advantage": float(adv[j])},
                   media=list(media))
        for j, r in enumerate(responses)
    ]


def rollout_stream(spec: BatchSpec, train_batches: int, seed: int = 0, family: str = "qwen2_5_vl"):
    per_source = {s: spec.quotas[s] // spec.group_size for s in spec.sources}
    for b in range(train_batches):
        for i in range(max(per_source.values())):
            for s in spec.sources:
                if i < per_source[s]:
                    yield from rollout_group(seed, b, s, i, spec.group_size, b * spec.num_minibatches, family)


def policy_loss(out: Any, inputs: dict[str, torch.Tensor], advantage: torch.Tensor,
                clip: float = 0.2) -> tuple[torch.Tensor, int]:
    """Clipped policy-gradient loss summed over response tokens (behavior policy: uniform sampling).

    ``advantage``: one per row (``mb.scalars["advantage"]``, in the micro-batch's row order).
    """
    logits = out.logits[:, :-1].float()
    target = inputs["labels"][:, 1:]
    mask = target != -100
    logp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    old = -float(np.log(VOCAB))
    adv = advantage.to(logits.device, torch.float32).unsqueeze(1)
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    return (per_token * mask).sum(), int(mask.sum())


def open_pipeline(args: argparse.Namespace, world: int) -> tuple[Any, threading.Thread]:
    """An embedded pipeline fed by a deterministic producer thread (the same on every rank)."""
    from knitdata.pipeline import Pipeline

    spec = make_spec(args.group_size, args.groups_per_source, args.num_minibatches)
    pipe = Pipeline(spec, num_consumers=world, token_budget=args.token_budget, capacity_bytes=64 << 20)

    def produce() -> None:
        try:
            for traj in rollout_stream(spec, args.train_batches, args.seed, args.family):
                pipe.put(traj)
        finally:
            pipe.close()

    thread = threading.Thread(target=produce, name="rollout-producer", daemon=True)
    thread.start()
    return pipe, thread


def duplicated_grads(model: Any, adapter: Any, steps: list[tuple[Any, dict, torch.Tensor, float, int]]
                     ) -> dict[str, torch.Tensor]:
    """The same micro-batches through the model's own forward, every trajectory with its own image copy."""
    saved = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for media, inputs, advantage, scale, i in steps:
        out = adapter.forward_native(inputs, media, i)
        loss_sum, _ = policy_loss(out, inputs, advantage)
        (loss_sum * scale).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        p.grad = saved[n]
    return ref


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-batches", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-source", type=int, default=2)
    p.add_argument("--num-minibatches", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=32, help="most tokens per micro-batch (planner; counts one token per image placeholder)")
    p.add_argument("--mode", choices=("fold", "leaf", "recompute", "naive"), default="fold")
    p.add_argument("--family", choices=FAMILIES, default="qwen2_5_vl",
                   help="qwen2_5_omni: image, video and audio per prompt through a Qwen2.5-Omni thinker")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-grads", action="store_true", help="compare the first step with the duplicated path")
    p.add_argument("--out", default=None, help="JSON summary (rank 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from accelerate.utils import gather_object, set_seed

    from knitdata.integrations.accelerate import prepare_loader
    from knitdata.integrations.transformers import qwen2_5_omni, qwen2_5_vl

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(args.seed)
    omni = args.family == "qwen2_5_omni"
    model = tiny_omni_model(args.seed) if omni else tiny_model(args.seed)  # the same parameters on every rank
    if omni:  # the thinker's forward never uses this table (the model's own path neither): DDP wants it frozen
        model.model.audio_tower.audio_bos_eos_token.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt = accelerator.prepare(model, opt)
    if omni:  # both towers: model.visual (images, video frames) and model.audio_tower
        from transformers import WhisperFeatureExtractor

        from knitdata.media.video import VideoSampling

        adapter: Any = qwen2_5_omni(model, image_processor(), WhisperFeatureExtractor(feature_size=16),
                                    VideoSampling(fps=2.0))
    else:
        adapter = qwen2_5_vl(model, image_processor())  # calls the DDP wrapper's forward, encodes with model.visual
    shared = adapter.shared_encoding(args.mode)

    pipe, producer = open_pipeline(args, world)
    loader = prepare_loader(accelerator, pipe, fetch="eager", media_collator=adapter.media_collator())
    losses: list[float] = []
    rewards: list[float] = []
    unique = occurrences = 0
    check: dict[str, Any] = {}
    record: list[tuple] = []
    sm = None
    step_loss = 0.0
    t0 = time.perf_counter()
    for mb in loader:
        info = mb.info
        media = mb.media
        if sm is None:  # first micro-batch of this rank's share of the mini-batch: encode the unique images
            sm = shared.minibatch(media).__enter__()
            unique += media.num_unique
            occurrences += media.num_occurrences
        with loader.accumulate(model, mb):
            # the model's inputs from the dataset's micro-batch: each image placeholder expanded to the image's
            # merged-patch count, labels on the responses; an empty slot gets a one-row dummy (a DDP forward
            # still runs on it, so that the ranks' gradient all-reduces line up)
            inputs = {k: v.to(accelerator.device) for k, v in adapter.collate(mb).items()}
            out = adapter.forward(inputs, adapter.rows(sm, info.microbatch))  # omni: every kind's rows
            if mb.is_empty:
                loss_sum = out.loss * 0.0
            else:
                loss_sum, _ = policy_loss(out, inputs, mb.scalars["advantage"])
                rewards += mb.scalars["reward"].tolist()
            scale = loader.loss_scale(mb)
            sm.backward(loss_sum * scale)  # the last micro-batch also runs the encoder's (folded) backward
            if args.check_grads and info.minibatch == 0 and not mb.is_empty:
                record.append((media, inputs, mb.scalars["advantage"], scale, info.microbatch))
            if info.is_last and args.check_grads and info.minibatch == 0 and world == 1:
                ref = duplicated_grads(accelerator.unwrap_model(model), adapter, record)
                got = {n: p.grad for n, p in accelerator.unwrap_model(model).named_parameters() if p.grad is not None}
                check["max_rel_grad_diff"] = max(
                    float((got[n] - ref[n]).abs().max()) / (float(ref[n].abs().max()) or 1.0) for n in ref
                )
            opt.step()  # a no-op unless info.is_last
            opt.zero_grad()
        step_loss += float(loss_sum.detach()) * scale
        if os.environ.get("GRPO_VLM_VERBOSE"):
            print(f"[rank {rank}] mini-batch {info.minibatch} micro-batch {info.microbatch}/{info.num_microbatches} "
                  f"trajectories={mb.num_sequences} last={info.is_last}", file=sys.stderr, flush=True)
        if info.is_last:
            sm.__exit__(None, None, None)
            sm = None
            pipe.report_version(info.minibatch + 1)
            losses.append(step_loss)
            step_loss = 0.0
    loader.close()
    pipe.close()
    producer.join(timeout=10)
    mine = {"rank": rank, "world": world, "steps": len(losses), "losses": losses, "unique_images": unique,
            "image_occurrences": occurrences, "mean_reward": sum(rewards) / max(1, len(rewards)),
            "wall_s": time.perf_counter() - t0, **check}
    everyone = gather_object([mine]) if world > 1 else [mine]
    if accelerator.is_main_process:
        everyone = sorted(everyone, key=lambda d: d["rank"])
        for d in everyone:
            extra = f" max_rel_grad_diff={d['max_rel_grad_diff']:.2e}" if "max_rel_grad_diff" in d else ""
            print(f"rank {d['rank']}: steps={d['steps']} unique_images={d['unique_images']} "
                  f"image_occurrences={d['image_occurrences']} loss first/last={d['losses'][0]:.4f}/"
                  f"{d['losses'][-1]:.4f}{extra}")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"world": world, "mode": args.mode, "family": args.family, "ranks": everyone}, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    # DDP keeps the gloo process group alive after end_training() / destroy_process_group() (torch 2.x): its worker
    # threads live on into the interpreter's teardown, where one that drops the last reference to a finished
    # collective's tensors aborts the process now and then ("terminate called without an active exception",
    # SIGABRT) after everything was written. Everything is flushed and closed by now: skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
