"""Duplicated vs deduplicated multimodal encoding: encoder FLOPs and time, step time, speedup, peak RSS.

A mini-batch of ``m`` trajectories holds ``m / n`` prompt images, each shared by the ``n`` responses of its
group (GRPO group size ``n``), shuffled into micro-batches so copies span micro-batches. The naive step encodes
every copy in its micro-batch (forward and backward); :class:`~knitdata.media.encoder.SharedEncoding` encodes each
unique image once (``fold``, ``leaf``) or twice without keeping activations (``recompute``). A small vision
encoder (a few transformer layers over patches) and a small transformer backbone run on the CPU with one
torch thread. Measured side by side in one run (interleaved repetitions, medians):

* ``dup_step_s`` / ``dedup_step_s``: mini-batch step (forward + backward of all micro-batches);
* ``encoder_share`` f: share of the naive step spent in the encoder: the time of encoding every copy of
  every micro-batch, forward and backward, alone, over the naive step's time;
* ``amdahl_bound`` ``1 / ((1 - f) + f / n)``: the best speedup removing duplicate encoder work can give,
  if encoding ``U`` unique images cost exactly ``1 / n`` of encoding all ``n U`` copies;
* ``encoder_unique_step_s``: encoding the unique images once, forward and backward, alone (the encoder part
  of a dedup step); ``encoder_scaling`` = that over ``encoder_only / n`` (1.0: linear in the image count;
  above 1: fewer, smaller encoder calls use the core less well); ``measured_bound`` = naive step over
  ``naive - encoder_only + encoder_unique``: the best speedup given the encoder's measured cost on the unique
  images; ``overhead_s`` = dedup step minus that: SharedEncoding's own cost (leaf rows, ``G``, gathers, the
  separate or folded encoder backward); ``speedup_paired``: the median over repetitions of the naive over
  the dedup step time of the same repetition (the two run back to back, so slow drifts of a shared
  machine cancel out);
* encoder FLOPs (``torch.utils.flop_counter.FlopCounterMode``, step minus backbone-only step) and their ratio;
* ``recompute`` re-encodes in chunks of one micro-batch's worth of images (what naive holds at a time);
* ``peak_rss_mb``: peak resident memory of a fresh subprocess running that configuration, and
  ``step_rss_mb``: how much that peak grew while running the steps (activations, ``E``, ``G``).
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/encode.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import math
import random
import resource
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from benchmarks.common.cli import child_env
from benchmarks.common.models import TransformerBackbone, TransformerPatchEncoder
from benchmarks.common.output import pyplot, write_json

__all__ = [
    "EncodeConfig",
    "build_workload",
    "run_step",
    "count_flops",
    "measure_rss",
    "run_bench",
    "add_arguments",
    "run",
]

STEP_MODES: tuple[str, ...] = ("naive", "backbone_only", "encoder_only", "encoder_unique", "fold", "leaf", "recompute")
DEDUP_MODES: tuple[str, ...] = ("fold", "leaf", "recompute")


@dataclass
class EncodeConfig:
    """Workload of the encode benchmark.

    Attributes:
        group_sizes: GRPO group sizes ``n`` to measure.
        trajectories: Trajectories per mini-batch ``m`` (a multiple of every group size).
        microbatch: Trajectories per micro-batch.
        image: Image side in pixels.
        patch: Patch side in pixels.
        enc_dim: Encoder width.
        enc_layers: Encoder transformer layers.
        dim: Backbone width.
        layers: Backbone transformer layers.
        text_tokens: Text tokens per trajectory.
        repeats: Timed repetitions per configuration (median reported).
        warmup: Untimed repetitions first.
        rss: Measure peak RSS in a fresh subprocess per configuration.
        clock: ``"cpu"`` (process CPU time: robust when other jobs share the cores; one torch thread, so it
            is the compute time) or ``"wall"``. Both are reported.
        seed: Random seed.
    """

    group_sizes: tuple[int, ...] = (1, 4, 8, 16)
    trajectories: int = 16
    microbatch: int = 4
    image: int = 64
    patch: int = 8
    enc_dim: int = 128
    enc_layers: int = 4
    dim: int = 128
    layers: int = 2
    text_tokens: int = 64
    repeats: int = 5
    warmup: int = 1
    rss: bool = True
    clock: str = "cpu"
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick(cls) -> EncodeConfig:
        """A seconds-long configuration for tests."""
        return cls(group_sizes=(1, 4), trajectories=8, microbatch=4, image=16, patch=4, enc_dim=32, enc_layers=1,
                   dim=32, layers=1, text_tokens=8, repeats=2, warmup=0, rss=False)


@dataclass
class Workload:
    """Models and one mini-batch for group size ``n``."""

    encoder: TransformerPatchEncoder
    backbone: TransformerBackbone
    batch: Any  # MultimodalBatch
    ids: list[torch.Tensor]  # per micro-batch [b, T]
    scales: list[float]
    n: int
    chunk: int  # recompute: images per re-encode chunk (a micro-batch's worth, like naive)


def build_workload(cfg: EncodeConfig, n: int) -> Workload:
    """Build models and a shuffled mini-batch of ``cfg.trajectories`` trajectories, ``n`` per image.

    Args:
        cfg: The workload.
        n: Group size (responses per prompt image).
    """
    from knitdata.media.multimodal import MultimodalCollator
    from knitdata.media.process import patchify
    from knitdata.record import MediaItem, Trajectory

    if cfg.trajectories % n or cfg.trajectories % cfg.microbatch:
        raise ValueError(f"trajectories {cfg.trajectories} must be a multiple of group size {n} and micro-batch")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed + n)
    patch_dim = 3 * cfg.patch * cfg.patch
    encoder = TransformerPatchEncoder(patch_dim, cfg.enc_dim, cfg.enc_layers, cfg.dim)
    backbone = TransformerBackbone(cfg.dim, cfg.layers)
    trajs = []
    for g in range(cfg.trajectories // n):
        img = MediaItem(kind="image", tensor=torch.randint(0, 256, (3, cfg.image, cfg.image), dtype=torch.uint8))
        for r in range(n):
            trajs.append(Trajectory(id=f"g{g}r{r}", source="vision", group=f"g{g}", prompt_ids=torch.zeros(0, dtype=torch.long),
                                    response_ids=torch.randint(0, 256, (cfg.text_tokens,)), media=[img]))
    rng.shuffle(trajs)
    mbs = [trajs[i : i + cfg.microbatch] for i in range(0, len(trajs), cfg.microbatch)]
    batch = MultimodalCollator({"image": patchify(cfg.patch)}, key="provenance")(mbs)
    ids = [torch.stack([t.response_ids for t in mb]) for mb in mbs]
    scales = [len(mb) / len(trajs) for mb in mbs]
    return Workload(encoder, backbone, batch, ids, scales, n, cfg.microbatch)


def run_step(w: Workload, mode: str) -> None:
    """One mini-batch forward + backward in ``mode`` (``naive``, ``backbone_only`` or a dedup mode)."""
    from knitdata.media.encoder import SharedEncoding

    for p in (*w.encoder.parameters(), *w.backbone.parameters()):
        p.grad = None
    table = w.batch.tables["image"]
    if mode == "backbone_only":  # the encoder's rows are given: what the step costs without any encoder work
        dim = w.backbone.emb.embedding_dim
        for i, ids in enumerate(w.ids):
            occ = w.batch.for_microbatch(i)["image"]
            rows = torch.zeros(int(table.lengths[occ.index].sum()), dim, requires_grad=True)
            (w.backbone(ids, rows) * w.scales[i]).backward()
        return
    if mode == "encoder_unique":  # the encoder part of a dedup step: each unique image once, forward and backward
        out = w.encoder(table.values, table.offsets)
        out.backward(torch.full_like(out, 1e-3))
        return
    if mode == "encoder_only":  # the encoder part of the naive step: every copy, forward and backward
        for i in range(len(w.ids)):
            sub = table.gather(w.batch.for_microbatch(i)["image"].index)
            out = w.encoder(sub.values, sub.offsets)
            out.backward(torch.full_like(out, 1e-3))
        return
    enc = SharedEncoding(w.encoder, mode=mode, chunk_items=w.chunk if mode == "recompute" else None)
    with enc.minibatch(w.batch) as shared:
        for i, ids in enumerate(w.ids):
            shared.backward(w.backbone(ids, shared.rows(i)) * w.scales[i])


def count_flops(w: Workload, mode: str) -> int:
    """Total FLOPs of one step in ``mode`` (``FlopCounterMode``)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        run_step(w, mode)
    return int(fc.get_total_flops())


def measure_rss(cfg: EncodeConfig, n: int, mode: str, timeout_s: float = 300.0) -> dict[str, float]:
    """Peak RSS of a fresh subprocess that builds the workload and runs two steps in ``mode``.

    Returns:
        ``{"peak_rss_mb": peak of the process, "step_rss_mb": growth of the peak during the steps}`` (MiB);
        the second isolates what the step itself holds (activations, E, G) from torch and the workload.
    """
    payload = json.dumps({"cfg": asdict(cfg), "n": n, "mode": mode})
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from benchmarks.encode import _child; _child(sys.argv[1])", payload],
        capture_output=True, text=True, timeout=timeout_s, env=child_env(OMP_NUM_THREADS="1"),
    )
    if out.returncode != 0:
        raise RuntimeError(f"RSS child for n={n} mode={mode} failed: {out.stderr[-2000:]}")
    return {k: float(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def _peak_rss_kb() -> int:
    """Peak resident set of this process in KiB: ``VmHWM`` (per address space, so not inherited from the parent
    across fork + exec as ``ru_maxrss`` is), or ``ru_maxrss`` where ``/proc`` is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _child(payload: str) -> None:
    torch.set_num_threads(1)
    d = json.loads(payload)
    cfg = EncodeConfig(**{**d["cfg"], "group_sizes": tuple(d["cfg"]["group_sizes"])})
    w = build_workload(cfg, d["n"])
    before = _peak_rss_kb()
    for _ in range(2):
        run_step(w, d["mode"])
    kb = _peak_rss_kb()
    print(json.dumps({"peak_rss_mb": kb / 1024.0, "step_rss_mb": (kb - before) / 1024.0}))


def run_bench(cfg: EncodeConfig, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark; return the JSON-serializable report (``results`` list and the config).

    Args:
        cfg: The workload.
        progress: Show a tqdm progress bar.
    """
    from tqdm import tqdm

    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    total = len(cfg.group_sizes) * (cfg.warmup + cfg.repeats) * len(STEP_MODES)
    bar = tqdm(total=total, desc="bench encode", disable=not progress, leave=False)
    for n in cfg.group_sizes:
        w = build_workload(cfg, n)
        times: dict[str, list[float]] = {m: [] for m in STEP_MODES}
        walls: dict[str, list[float]] = {m: [] for m in STEP_MODES}
        for rep in range(cfg.warmup + cfg.repeats):
            order = list(STEP_MODES) if rep % 2 == 0 else list(reversed(STEP_MODES))
            for mode in order:
                t0, c0 = time.perf_counter(), time.process_time()
                run_step(w, mode)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if rep >= cfg.warmup:
                    times[mode].append(cpu if cfg.clock == "cpu" else wall)
                    walls[mode].append(wall)
                bar.update(1)
        med = {m: statistics.median(v) for m, v in times.items()}
        med_wall = {m: statistics.median(v) for m, v in walls.items()}
        flops = {m: count_flops(w, m) for m in ("naive", "backbone_only", *DEDUP_MODES)}
        enc_flops = {m: flops[m] - flops["backbone_only"] for m in ("naive", *DEDUP_MODES)}
        f = max(0.0, min(1.0, med["encoder_only"] / med["naive"]))
        bound = 1.0 / ((1.0 - f) + f / n)
        rss = {m: measure_rss(cfg, n, m) for m in ("naive", *DEDUP_MODES)} if cfg.rss else {}
        floor = med["naive"] - med["encoder_only"] + med["encoder_unique"]
        for mode in DEDUP_MODES:
            speedup = med["naive"] / med[mode]
            results.append({
                "group_size": n,
                "mode": mode,
                "dup_step_s": med["naive"],
                "dedup_step_s": med[mode],
                "backbone_only_step_s": med["backbone_only"],
                "encoder_only_step_s": med["encoder_only"],
                "speedup": speedup,
                "encoder_share": f,
                "amdahl_bound": bound,
                "speedup_over_bound": speedup / bound,
                "speedup_paired": statistics.median(a / b for a, b in zip(times["naive"], times[mode])),
                "encoder_unique_step_s": med["encoder_unique"],
                "encoder_scaling": med["encoder_unique"] / (med["encoder_only"] / n),
                "measured_bound": med["naive"] / floor,
                "speedup_over_measured_bound": speedup * floor / med["naive"],
                "overhead_s": med[mode] - floor,
                "dup_encoder_flops": enc_flops["naive"],
                "dedup_encoder_flops": enc_flops[mode],
                "encoder_flop_ratio": enc_flops["naive"] / max(1, enc_flops[mode]),
                "dup_step_flops": flops["naive"],
                "dedup_step_flops": flops[mode],
                "unique_images": w.batch.num_unique,
                "image_occurrences": w.batch.num_occurrences,
                "dup_peak_rss_mb": rss["naive"]["peak_rss_mb"] if rss else None,
                "dedup_peak_rss_mb": rss[mode]["peak_rss_mb"] if rss else None,
                "dup_step_rss_mb": rss["naive"]["step_rss_mb"] if rss else None,
                "dedup_step_rss_mb": rss[mode]["step_rss_mb"] if rss else None,
                "clock": cfg.clock,
                "dup_step_wall_s": med_wall["naive"],
                "dedup_step_wall_s": med_wall[mode],
                "dup_step_s_all": times["naive"],
                "dedup_step_s_all": times[mode],
            })
    bar.close()
    cfg_d = asdict(cfg)
    cfg_d["group_sizes"] = list(cfg.group_sizes)
    return {
        "benchmark": "encode",
        "config": cfg_d,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "results": results,
    }


def format_table(report: dict[str, Any]) -> str:
    """The results as a text table."""
    head = f"{'n':>3} {'mode':<10} {'dup s':>8} {'dedup s':>8} {'speedup':>8} {'f':>5} {'bound':>6} {'sp/bnd':>6} " \
           f"{'encFLOP x':>9} {'RSS dup':>8} {'RSS ded':>8} {'+step dup':>9} {'+step ded':>9} " \
           f"{'enc scal':>8} {'m.bound':>7} {'sp/mbd':>6} {'ovh ms':>7}"
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        rss_d = "-" if r["dup_peak_rss_mb"] is None else f"{r['dup_peak_rss_mb']:.0f}M"
        rss_s = "-" if r["dedup_peak_rss_mb"] is None else f"{r['dedup_peak_rss_mb']:.0f}M"
        st_d = "-" if r.get("dup_step_rss_mb") is None else f"{r['dup_step_rss_mb']:.1f}M"
        st_s = "-" if r.get("dedup_step_rss_mb") is None else f"{r['dedup_step_rss_mb']:.1f}M"
        lines.append(
            f"{r['group_size']:>3} {r['mode']:<10} {r['dup_step_s']:>8.4f} {r['dedup_step_s']:>8.4f} "
            f"{r['speedup']:>8.2f} {r['encoder_share']:>5.2f} {r['amdahl_bound']:>6.2f} {r['speedup_over_bound']:>6.2f} "
            f"{r['encoder_flop_ratio']:>9.2f} {rss_d:>8} {rss_s:>8} {st_d:>9} {st_s:>9} "
            f"{r['encoder_scaling']:>8.2f} {r['measured_bound']:>7.2f} {r['speedup_over_measured_bound']:>6.2f} "
            f"{r['overhead_s'] * 1e3:>7.2f}"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Speedup per mode and the Amdahl bound against group size."""
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    res = report["results"]
    ns = sorted({r["group_size"] for r in res})
    bound = [next(r["amdahl_bound"] for r in res if r["group_size"] == n) for n in ns]
    ax[0].plot(ns, bound, "k--", label="Amdahl bound")
    for mode in DEDUP_MODES:
        ax[0].plot(ns, [next(r["speedup"] for r in res if r["group_size"] == n and r["mode"] == mode) for n in ns],
                   "o-", label=mode)
        ax[1].plot(ns, [next(r["encoder_flop_ratio"] for r in res if r["group_size"] == n and r["mode"] == mode)
                        for n in ns], "o-", label=mode)
    ax[1].plot(ns, ns, "k--", label="n")
    ax[0].set(xlabel="group size n", ylabel="step speedup vs duplicated", title="step time")
    ax[1].set(xlabel="group size n", ylabel="encoder FLOPs: duplicated / dedup", title="encoder FLOPs")
    for a in ax:
        a.set_xscale("log", base=2)
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m benchmarks encode``."""
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a plot (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="tiny workload (seconds; for tests)")
    parser.add_argument("--group-sizes", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                        help="comma-separated group sizes (default 1,4,8,16)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions per configuration")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="step-time clock: process CPU time (default; robust on shared cores) or wall time")


def run(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks encode``; print the table, write JSON and the plot."""
    cfg = EncodeConfig.quick() if args.quick else EncodeConfig()
    if args.group_sizes:
        cfg.group_sizes = args.group_sizes
        cfg.trajectories = max(cfg.trajectories, math.lcm(*args.group_sizes, cfg.microbatch))
    if args.repeats:
        cfg.repeats = args.repeats
    if args.no_rss:
        cfg.rss = False
    cfg.clock = args.clock
    report = run_bench(cfg)
    print(format_table(report))
    if args.json:
        write_json(args.json, report, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("encode"))
