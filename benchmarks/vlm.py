"""Shared encoding on real architectures: a model's own duplicated forward vs fold, leaf and recompute.

Random-init ``transformers`` models built from configs (nothing downloaded): Qwen2.5-VL (images),
Qwen2-Audio (audio clips), the Qwen2.5-Omni thinker (an image, a video and an audio clip in every prompt; the
video a real container decoded with PyAV) and Qwen3-VL (images, deepstack features included). One optimizer
step's mini-batch holds ``groups`` prompts, each with its media shared by the ``group_size`` responses of its
group (GRPO), shuffled into ``microbatches`` micro-batches of equal size. Per family and mode, measured side by side in one run (interleaved repetitions,
medians):

* ``native``: the model's own forward with every trajectory's copy of its media
  (:meth:`~knitdata.integrations.transformers.HFMultimodalAdapter.forward_native`), forward and backward
  of every micro-batch;
* ``fold`` / ``leaf`` / ``recompute``: :class:`~knitdata.media.encoder.SharedEncoding` through the adapter (unique
  items encoded once, rows placed at the placeholders, the model's own forward and loss);
* ``step_s``: the step's time (CPU: process CPU time with one torch thread, robust on shared cores; GPU:
  wall time between ``cuda.synchronize`` calls); ``speedup`` = native ``step_s`` / mode ``step_s``;
* ``peak_mem_bytes``: what the step itself adds at its peak, beyond the model, its inputs and the
  measurement. GPU: ``torch.cuda.max_memory_allocated`` during the step minus ``memory_allocated`` before
  it. CPU: the growth of the peak resident set (``VmHWM``) of a fresh subprocess while it runs two steps of
  that mode after building the model and batch. ``tracemalloc`` would be wrong for torch: it sees only
  allocations through Python's allocator, not the C++ allocator holding tensors; torch keeps no peak
  statistics of CPU tensor memory. The RSS growth also counts the gradient buffers (the same in every mode)
  and allocator slack, so compare modes with each other, not with tensor sizes;
* ``max_rel_grad_diff``: the largest per-parameter ``max |g - g_native| / max |g_native|`` after one step;
* ``video_decodes``: (omni) how many times each unique video's container was decoded while the mini-batch's
  media were collated (1 each: decoded once per unique video per mini-batch, whatever the group size).

Presets: the default CPU config (small models, one torch thread), ``--smoke`` (tiny, seconds, no memory
subprocesses; used by the tests) and ``--gpu`` (one CUDA device: a Qwen2.5-VL-3B-shaped model in bfloat16
at 448 and 896 px, groups of 8 sharing an image, 8 micro-batches of 2; sized to finish within 5 minutes on
one H200).
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/vlm.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import functools
import json
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from benchmarks.common.cli import child_env
from benchmarks.common.output import write_json

__all__ = ["VLMConfig", "Workload", "build_workload", "run_step", "run_bench", "add_arguments", "run"]

MODES: tuple[str, ...] = ("native", "fold", "leaf", "recompute")


@dataclass
class VLMConfig:
    """Workload of the vlm benchmark.

    Attributes:
        families: Model families to measure (``qwen2_5_vl``, ``qwen2_audio``, ``qwen2_5_omni``, ``qwen3_vl``).
        image_sizes: Square image sides in pixels (Qwen2.5-VL, Qwen3-VL), one workload each; the omni
            workload uses the first.
        text_tokens: Prompt plus response tokens per trajectory, per image size (or one for all).
        audio_seconds: Clip length (Qwen2-Audio, Qwen2.5-Omni).
        video_frames: Frames of the omni workload's video (sampled at 2 per second from a container of
            that many frames at 2 fps).
        video_size: Square frame side in pixels of that video.
        groups: Unique media items (prompts) per mini-batch.
        group_size: Trajectories sharing one item (GRPO ``n``).
        microbatches: Micro-batches per optimizer step.
        vision: Vision config overrides (Qwen2.5-VL, the omni thinker; Qwen3-VL takes its size keys).
        text: Language model config overrides (every family).
        audio: Audio config overrides (Qwen2-Audio, the omni thinker).
        dtype: ``"float32"`` or ``"bfloat16"``.
        device: ``"cpu"`` or ``"cuda"``.
        warmup: Untimed steps per mode.
        repeats: Timed steps per mode.
        mem: Measure peak memory (CPU: one subprocess per family, size and mode).
        seed: Seed of the parameters and the layout.
    """

    families: tuple[str, ...] = ("qwen2_5_vl", "qwen2_audio", "qwen2_5_omni", "qwen3_vl")
    image_sizes: tuple[int, ...] = (224,)
    text_tokens: tuple[int, ...] = (128,)
    audio_seconds: float = 4.0
    video_frames: int = 8
    video_size: int = 112
    groups: int = 2
    group_size: int = 8
    microbatches: int = 8
    vision: dict[str, Any] = field(
        default_factory=lambda: dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
                                     fullatt_block_indexes=[3])
    )
    text: dict[str, Any] = field(
        default_factory=lambda: dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=1024)
    )
    audio: dict[str, Any] = field(
        default_factory=lambda: dict(d_model=128, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=256,
                                     num_mel_bins=80, max_source_positions=200)
    )
    dtype: str = "float32"
    device: str = "cpu"
    warmup: int = 1
    repeats: int = 3
    mem: bool = True
    seed: int = 0

    @classmethod
    def smoke(cls) -> VLMConfig:
        """A tiny workload that runs in seconds (for tests)."""
        return cls(
            image_sizes=(64,), text_tokens=(24,), audio_seconds=0.5, video_frames=4, video_size=32, groups=2,
            group_size=2, microbatches=2,
            vision=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                        fullatt_block_indexes=[0]),
            text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256),
            audio=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, num_mel_bins=16,
                       max_source_positions=25),
            warmup=0, repeats=1, mem=False,
        )

    @classmethod
    def gpu(cls) -> VLMConfig:
        """Qwen2.5-VL-3B-shaped, bfloat16, one CUDA device; 448 px with 1,024 text tokens, 896 px with 512.

        The 3B model ties its input and output embeddings; this one does not (4.07B parameters instead of
        3.75B): the step is the same but for one more 151,936 x 2,048 gradient.
        """
        return cls(
            families=("qwen2_5_vl",), image_sizes=(448, 896), text_tokens=(1024, 512), groups=2, group_size=8,
            microbatches=8,
            vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                        window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
            text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                      num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                      rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
            dtype="bfloat16", device="cuda", warmup=1, repeats=3, mem=True,
        )


@dataclass
class Workload:
    """One family and size: model, adapter, micro-batches and their unique media batch."""

    family: str
    size: str
    model: Any
    adapter: Any
    micro_batches: list
    batch: Any
    inputs: list
    scales: list[float]
    video_decodes: list[int] = field(default_factory=list)


def _build_model(cfg: VLMConfig, family: str, text_tokens: int) -> Any:
    import transformers

    dtype = getattr(torch, cfg.dtype)
    text = dict(cfg.text)
    vocab = int(text.get("vocab_size", 1024))
    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    text.setdefault("max_position_embeddings", max(4096, 4 * text_tokens))
    make: Callable[[], transformers.PreTrainedModel]  # the family's model class on its config
    vision: dict[str, Any]
    if family == "qwen2_5_vl":
        half = int(text["hidden_size"]) // int(text["num_attention_heads"]) // 2
        text.setdefault("rope_scaling", {"type": "mrope", "mrope_section": [half // 4, half // 4, half - 2 * (half // 4)]})
        vision = dict(patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112, in_channels=3)
        vision.update(cfg.vision)
        conf = transformers.Qwen2_5_VLConfig(
            vision_config=vision, text_config={**text, **special}, image_token_id=vocab - 4, video_token_id=vocab - 3,
            vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1,
        )
        make = functools.partial(transformers.Qwen2_5_VLForConditionalGeneration, conf)
    elif family == "qwen2_5_omni":
        vision = dict(patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112, in_channels=3)
        vision.update(cfg.vision)
        audio = dict(cfg.audio)
        audio.setdefault("n_window", min(100, int(audio.get("max_source_positions", 1500))))
        audio["output_dim"] = int(text["hidden_size"])
        # the thinker config keeps vision_start/end_token_id (its get_rope_index reads them) without declaring them
        oconf = transformers.Qwen2_5OmniThinkerConfig(  # type: ignore[call-arg]
            vision_config=vision, audio_config=audio, text_config={**text, **special, **_mrope(text)},
            image_token_index=vocab - 4, video_token_index=vocab - 3, audio_token_index=vocab - 5,
            vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1, audio_start_token_id=vocab - 6,
            audio_end_token_id=vocab - 7,
        )
        make = functools.partial(transformers.Qwen2_5OmniThinkerForConditionalGeneration, oconf)
    elif family == "qwen3_vl":
        keys = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
        depth = int(cfg.vision.get("depth", 4))
        vision = dict(
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=2304,
            deepstack_visual_indexes=sorted({max(0, depth // 3), depth // 2}),
        )
        vision.update({k: v for k, v in cfg.vision.items() if k in keys})
        t3 = {**text, **special, **_mrope(text, interleaved=True)}
        t3["head_dim"] = int(text["hidden_size"]) // int(text["num_attention_heads"])
        qconf = transformers.Qwen3VLConfig(
            vision_config=vision, text_config=t3, image_token_id=vocab - 4, video_token_id=vocab - 3,
            vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1,
        )
        make = functools.partial(transformers.Qwen3VLForConditionalGeneration, qconf)
    else:
        aconf = transformers.Qwen2AudioConfig(
            audio_config=dict(cfg.audio), text_config={"model_type": "qwen2", **text, **special},
            audio_token_index=vocab - 4,
        )
        make = functools.partial(transformers.Qwen2AudioForConditionalGeneration, aconf)
    torch.manual_seed(cfg.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(cfg.device):  # initialize where it runs (a 3B model initializes in seconds on a GPU)
            model = make()
    finally:
        torch.set_default_dtype(old)
    return model.to(dtype).train()


def _mrope(text: dict[str, Any], interleaved: bool = False) -> dict[str, Any]:
    """``rope_parameters`` with an M-RoPE section split of the head (transformers 5 configs)."""
    if "rope_parameters" in text or "rope_scaling" in text:
        return {}
    half = int(text["hidden_size"]) // int(text["num_attention_heads"]) // 2
    section = [half // 4, half // 4, half - 2 * (half // 4)]
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section}
    if interleaved:
        params["mrope_interleaved"] = True
    return {"rope_parameters": params}


def _video_container(frames: int, size: int, seed: int) -> bytes:
    """A real MP4 (mpeg4) of ``frames`` random frames at 2 fps, made with PyAV."""
    import numpy as np

    from knitdata.media.video import encode_video

    rng = np.random.default_rng(seed)
    return encode_video(rng.integers(0, 256, (frames, size, size, 3), dtype=np.uint8), fps=2)


def build_workload(cfg: VLMConfig, family: str, index: int = 0) -> Workload:
    """Build the model, the trajectories and the collated batch of one family and size."""
    import numpy as np

    from knitdata.integrations.transformers import adapter_for
    from knitdata.media.process import audio_item, image_item
    from knitdata.media.video import video_item
    from knitdata.record import Trajectory

    tokens = cfg.text_tokens[min(index, len(cfg.text_tokens) - 1)]
    model = _build_model(cfg, family, tokens)
    adapter = adapter_for(model)
    rng = np.random.default_rng(cfg.seed + index)
    vocab = int(cfg.text.get("vocab_size", 1024))
    def image() -> Any:
        px = cfg.image_sizes[index]
        return image_item(torch.from_numpy(rng.integers(0, 256, (3, px, px), dtype=np.uint8)))

    def audio() -> Any:
        n = int(cfg.audio_seconds * 16000)
        return audio_item(rng.standard_normal(n).astype(np.float32) * 0.1, sample_rate=16000)

    media: list[list[Any]]
    if family in ("qwen2_5_vl", "qwen3_vl"):
        size = f"{cfg.image_sizes[index]}px"
        media = [[image()] for _ in range(cfg.groups)]
    elif family == "qwen2_5_omni":
        size = f"{cfg.image_sizes[index]}px+{cfg.video_frames}x{cfg.video_size}px+{cfg.audio_seconds:g}s"
        media = [[image(), video_item(_video_container(cfg.video_frames, cfg.video_size, cfg.seed + g)), audio()]
                 for g in range(cfg.groups)]
    else:
        size = f"{cfg.audio_seconds:g}s"
        media = [[audio()] for _ in range(cfg.groups)]
    trajs = []
    half = max(1, tokens // 2)
    for g, items in enumerate(media):
        prompt = rng.integers(3, vocab - 8, size=half).tolist()
        for j, item in enumerate(items):  # one placeholder per item (the omni thinker's in start/end tokens)
            pid = adapter.placeholders[item.kind]
            if family == "qwen2_5_omni":
                start, end = (vocab - 6, vocab - 7) if item.kind == "audio" else (vocab - 2, vocab - 1)
                prompt[1 + 3 * j: 4 + 3 * j] = [start, pid, end]
            else:
                prompt[1 + j] = pid
        for m in range(cfg.group_size):
            resp = rng.integers(3, vocab - 8, size=max(1, tokens - half)).tolist()
            trajs.append(Trajectory(id=f"g{g}m{m}", source="bench", group=f"g{g}", prompt_ids=torch.tensor(prompt),
                                    response_ids=torch.tensor(resp), media=list(items)))
    random.Random(cfg.seed).shuffle(trajs)
    k = cfg.microbatches
    mbs = [trajs[i::k] for i in range(k)]
    collator = adapter.media_collator()
    batch = collator(mbs).to(cfg.device)
    inputs = [{key: v.to(cfg.device) for key, v in adapter.collate(mb, batch, i).items()} for i, mb in enumerate(mbs)]
    decodes = sorted(collator.processor.decodes.values())
    return Workload(family, size, model, adapter, mbs, batch, inputs, [1.0 / k] * k, decodes)


def run_step(w: Workload, mode: str) -> None:
    """One optimizer step's forward and backward (no optimizer update): ``native`` or a SharedEncoding mode."""
    w.model.zero_grad(set_to_none=True)
    if mode == "native":
        for i, inp in enumerate(w.inputs):
            (w.adapter.forward_native(inp, w.batch, i).loss * w.scales[i]).backward()
        return
    shared = w.adapter.shared_encoding(mode, dummy=False)
    with shared.minibatch(w.batch) as sm:
        for i, inp in enumerate(w.inputs):
            sm.backward(w.adapter.forward(inp, w.adapter.rows(sm, i)).loss * w.scales[i])


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _grads(model: Any) -> dict[str, torch.Tensor]:
    """A copy of the gradients in their own dtype (a 3B model's bf16 gradients: 7.5 GiB on the device)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _peak_rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _gpu_peak(w: Workload, mode: str) -> int:
    _sync(w.model.device.type)
    w.model.zero_grad(set_to_none=True)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_step(w, mode)
    _sync("cuda")
    return int(torch.cuda.max_memory_allocated() - before)


def _cpu_peak(cfg: VLMConfig, family: str, index: int, mode: str, timeout_s: float = 600.0) -> int:
    payload = json.dumps({"cfg": asdict(cfg), "family": family, "index": index, "mode": mode})
    env = child_env(OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", f"from benchmarks.vlm import _child; _child({payload!r})"],
                         capture_output=True, text=True, timeout=timeout_s, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"memory child for {family} {mode} failed: {out.stderr[-2000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_mem_bytes"])


def _cfg_from(d: dict[str, Any]) -> VLMConfig:
    tuples = ("families", "image_sizes", "text_tokens")
    kwargs: dict[str, Any] = {k: tuple(v) if k in tuples else v for k, v in d.items()}
    return VLMConfig(**kwargs)


def _child(payload: str) -> None:
    torch.set_num_threads(1)
    d = json.loads(payload)
    cfg = _cfg_from(d["cfg"])
    w = build_workload(cfg, d["family"], d["index"])
    before = _peak_rss_kb()
    for _ in range(2):
        run_step(w, d["mode"])
    print(json.dumps({"peak_mem_bytes": (_peak_rss_kb() - before) * 1024}))


def run_bench(cfg: VLMConfig, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark; return the JSON-serializable report (``results`` list, config, load average)."""
    from tqdm import tqdm

    cuda = cfg.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    load_before = os.getloadavg()
    work = [(f, i) for f in cfg.families for i in (range(len(cfg.image_sizes)) if f in ("qwen2_5_vl", "qwen3_vl") else [0])]
    bar = tqdm(total=len(work) * len(MODES) * (cfg.warmup + cfg.repeats + 1), desc="bench vlm", disable=not progress,
               leave=False)
    results: list[dict[str, Any]] = []
    for family, index in work:
        w = build_workload(cfg, family, index)
        diffs: dict[str, float] = {}
        ref: dict[str, torch.Tensor] = {}
        for mode in MODES:  # one step each for the gradient check (also a warmup); only native's grads are kept
            run_step(w, mode)
            if mode == "native":
                ref = _grads(w.model)
            else:
                g = {n: p.grad for n, p in w.model.named_parameters() if p.grad is not None}
                diffs[mode] = max(
                    float((g[n].float() - ref[n].float()).abs().max()) / (float(ref[n].float().abs().max()) or 1.0)
                    for n in ref
                )
            bar.update(1)
        diffs["native"] = 0.0
        del ref
        w.model.zero_grad(set_to_none=True)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for rep in range(cfg.warmup + cfg.repeats):
            for mode in MODES if rep % 2 == 0 else reversed(MODES):
                _sync(cfg.device)
                t0, c0 = time.perf_counter(), time.process_time()
                run_step(w, mode)
                _sync(cfg.device)
                dt = time.perf_counter() - t0 if cuda else time.process_time() - c0
                if rep >= cfg.warmup:
                    times[mode].append(dt)
                bar.update(1)
        peaks: dict[str, int | None] = {m: None for m in MODES}
        if cfg.mem:
            for mode in MODES:
                peaks[mode] = _gpu_peak(w, mode) if cuda else _cpu_peak(cfg, family, index, mode)
        for mode in MODES:
            diff = diffs[mode]
            step = statistics.median(times[mode])
            results.append({
                "family": family,
                "size": w.size,
                "mode": mode,
                "step_s": step,
                "speedup": statistics.median(times["native"]) / step,
                "peak_mem_bytes": peaks[mode],
                "max_rel_grad_diff": diff,
                "unique_items": w.batch.num_unique,
                "occurrences": w.batch.num_occurrences,
                "encoder_rows_per_item": {
                    kind: float(w.adapter.out_rows(t).float().mean()) for kind, t in sorted(w.batch.tables.items())
                },
                "unique_items_by_kind": {kind: t.num_items for kind, t in sorted(w.batch.tables.items())},
                "video_decodes": list(w.video_decodes),
                "text_tokens": int(w.inputs[0]["attention_mask"].sum(-1).float().mean()),
                "step_s_all": times[mode],
            })
        del w
        if cuda:
            torch.cuda.empty_cache()
    bar.close()
    return {
        "benchmark": "vlm",
        "config": asdict(cfg),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "clock": "wall" if cuda else "process cpu",
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        "results": results,
    }


def format_table(report: dict[str, Any]) -> str:
    """The results as a text table."""
    head = f"{'family':<12} {'size':>22} {'mode':<10} {'step s':>9} {'speedup':>8} {'peak mem':>10} {'grad diff':>10}"
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        mem = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.1f}M"
        lines.append(
            f"{r['family']:<12} {r['size']:>22} {r['mode']:<10} {r['step_s']:>9.4f} {r['speedup']:>8.2f} {mem:>10} "
            f"{r['max_rel_grad_diff']:>10.2e}"
        )
    la, lb = report["loadavg_before"], report["loadavg_after"]
    lines.append(f"load average before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}, after {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}; "
                 f"clock: {report['clock']}; device: {report['device']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m benchmarks vlm``."""
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--smoke", action="store_true", help="tiny models, seconds, no memory subprocesses (tests)")
    preset.add_argument("--gpu", action="store_true", help="Qwen2.5-VL-3B-shaped, bf16, 448 and 896 px on one GPU")
    parser.add_argument("--families", type=lambda s: tuple(s.split(",")), default=None,
                        help="comma-separated families (qwen2_5_vl,qwen2_audio,qwen2_5_omni,qwen3_vl)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per mode")
    parser.add_argument("--no-mem", action="store_true", help="skip the peak-memory measurement")


def run(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks vlm``; print the table and write JSON."""
    cfg = VLMConfig.smoke() if args.smoke else VLMConfig.gpu() if args.gpu else VLMConfig()
    if args.families:
        cfg.families = args.families
    if args.repeats:
        cfg.repeats = args.repeats
    if args.no_mem:
        cfg.mem = False
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("--gpu needs a CUDA device")
        return 2
    report = run_bench(cfg)
    print(format_table(report))
    if args.json:
        write_json(args.json, report, indent=2)
    return 0


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("vlm"))
