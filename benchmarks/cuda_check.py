"""Check knitdata's CUDA prefetch path on a GPU machine: pinned H2D, side-stream overlap, the Prefetcher.

Run where a GPU is available (about 30-60 s on an H200)::

    python benchmarks/cuda_check.py --json benchmarks/results/cuda_check.json

Without CUDA it prints "CUDA not available, skipped" and exits 0 (writing ``{"skipped": true}`` to --json).

Measured, all in one run with CUDA events (medians of repeats):

1. ``h2d``: pageable vs pinned host-to-device bandwidth per size of a ragged set of micro-batches.
2. ``overlap``: copies of a ragged set of pinned micro-batches on a side stream against matmuls on the main
   stream: copy alone, compute alone, both launched together; also with pageable sources, which cannot
   overlap. ``hidden_fraction`` = (copy + compute - both) / min(copy, compute): 1 is perfect overlap.
3. ``prefetcher``: a training-like loop over a few hundred ragged micro-batches (compute on the main stream,
   one sync per step like ``loss.item()``), with no prefetch (synchronous ``.to``), with
   ``Prefetcher(device="cuda")`` and with a ``PinnedBufferPool``; each copied micro-batch is compared with
   its source on the device; the exposed wait per step (time in ``next()`` + H2D wait) is reported.
4. ``host_memory_stats``: the CUDA caching host allocator's counters before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

MiB = 1 << 20


def _sizes(n: int, lo: float, hi: float, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int((lo + (hi - lo) * float(torch.rand(1, generator=g))) * MiB) // 8 * 8 for _ in range(n)]


def _event_time(fn: Any, stream: torch.cuda.Stream | None = None, repeats: int = 10, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` measured with CUDA events on ``stream`` (default: current)."""
    stream = stream or torch.cuda.current_stream()
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            fn()
            end.record(stream)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_h2d(sizes: list[int], dev: torch.device, repeats: int) -> list[dict[str, float]]:
    """Pageable vs pinned H2D bandwidth for each size."""
    rows = []
    for nb in sorted(set(sizes)):
        pageable = torch.randint(0, 255, (nb,), dtype=torch.uint8)
        pinned = pageable.pin_memory()
        dst = torch.empty(nb, dtype=torch.uint8, device=dev)
        t_page = _event_time(lambda p=pageable, d=dst: d.copy_(p, non_blocking=True), repeats=repeats)
        t_pin = _event_time(lambda p=pinned, d=dst: d.copy_(p, non_blocking=True), repeats=repeats)
        assert torch.equal(dst.cpu(), pageable)
        rows.append({"bytes": nb, "pageable_GBps": nb / t_page / 1e9, "pinned_GBps": nb / t_pin / 1e9,
                     "pinned_over_pageable": t_page / t_pin})
    return rows


def measure_overlap(host: list[torch.Tensor], dev: torch.device, repeats: int) -> dict[str, Any]:
    """Side-stream copies of ``host`` tensors against main-stream matmuls sized to take about as long."""
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    dst = [torch.empty_like(h, device=dev) for h in host]
    pinned = [h.pin_memory() for h in host]

    def copy_all(src: list[torch.Tensor]) -> None:
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)

    t_copy = _event_time(lambda: copy_all(pinned), stream=side, repeats=repeats)
    n = 4096
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t_one = _event_time(lambda: a @ a, repeats=repeats)
    k = max(1, round(t_copy / t_one))  # compute about as long as the copies

    def compute() -> None:
        for _ in range(k):
            a @ a

    t_compute = _event_time(compute, repeats=repeats)

    def both(src: list[torch.Tensor]) -> float:
        times = []
        for i in range(2 + repeats):
            start, end, copied = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record(main)
            side.wait_event(start)
            with torch.cuda.stream(side):
                copy_all(src)
                copied.record(side)
            compute()
            main.wait_event(copied)
            end.record(main)
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    t_both = both(pinned)
    t_both_pageable = both(host)
    t_copy_pageable = _event_time(lambda: copy_all(host), stream=side, repeats=repeats)
    for d, h in zip(dst, host):
        assert torch.equal(d.cpu(), h)

    def hidden(tc: float, tb: float) -> float:
        return (tc + t_compute - tb) / min(tc, t_compute)

    return {
        "bytes": sum(h.numel() * h.element_size() for h in host),
        "matmuls": k,
        "copy_s": t_copy,
        "compute_s": t_compute,
        "both_s": t_both,
        "hidden_fraction": hidden(t_copy, t_both),
        "pageable_copy_s": t_copy_pageable,
        "pageable_both_s": t_both_pageable,
        "pageable_hidden_fraction": hidden(t_copy_pageable, t_both_pageable),
    }


def _make_batches(sizes: list[int]) -> list[Any]:
    """Ragged host micro-batches (knitdata MicroBatch) of roughly the given byte sizes."""
    from knitdata.consumer.collate import MicroBatchInfo, TokenCollator
    from knitdata.record import Trajectory

    coll = TokenCollator(mode="pack")
    g = torch.Generator().manual_seed(1)
    out = []
    for k, nb in enumerate(sizes):
        tokens = max(80, nb // 24)  # pack mode: ids 8 + positions 8 + loss 4 + logp 4 = 24 B/token
        trajs = []
        for i in range(4):
            r = max(1, tokens // 4 - 16)
            trajs.append(Trajectory(
                id=f"b{k}_{i}", source="s", group=f"g{k}",
                prompt_ids=torch.randint(0, 50_000, (16,), generator=g),
                response_ids=torch.randint(0, 50_000, (r,), generator=g),
                scalars={"reward": float(i)},
                tensors={"logp": -torch.rand(r, generator=g)},
            ))
        info = MicroBatchInfo(0, 0, k, 0, 0, 1, True, tokens, 4, 0, tuple(t.id for t in trajs), (0,) * 4)
        out.append(coll(trajs, info))
    return out


def measure_prefetcher(batches: list[Any], steps: int, dev: torch.device, depth: int) -> dict[str, Any]:
    """A training-like loop: per step get a micro-batch, check it, compute ~copy time, sync once."""
    from knitdata.consumer.prefetch import PinnedBufferPool, Prefetcher

    refs = [b.to(dev) for b in batches]  # device references for the equality check
    torch.cuda.synchronize()
    # calibrate compute per step to ~2x the host cost of pinning + copying the median micro-batch (what the
    # background thread does per item), so a good prefetcher can hide it completely
    median = sorted(batches, key=lambda b: b.nbytes)[len(batches) // 2]
    costs = []
    for _ in range(7):
        t0 = time.perf_counter()
        median.pin_memory().to(dev, non_blocking=True)
        torch.cuda.synchronize()
        costs.append(time.perf_counter() - t0)
    t_copy = statistics.median(costs[2:])
    n = 2048
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t_mm = _event_time(lambda: a @ a, repeats=5)
    k = max(1, round(2 * t_copy / t_mm))

    def source():
        for s in range(steps):
            yield batches[s % len(batches)]

    def check(s: int, mb: Any) -> bool:
        ref = refs[s % len(refs)]
        return (torch.equal(mb.input_ids, ref.input_ids) and torch.equal(mb.loss_mask, ref.loss_mask)
                and torch.equal(mb.position_ids, ref.position_ids) and torch.equal(mb.cu_seqlens, ref.cu_seqlens)
                and torch.equal(mb.tensors["logp"], ref.tensors["logp"])
                and torch.equal(mb.scalars["reward"], ref.scalars["reward"]) and mb.info == ref.info)

    def loop(kind: str) -> dict[str, Any]:
        pool = PinnedBufferPool(max_cached_bytes=64 * MiB) if kind == "prefetch_pool" else None
        if kind == "no_prefetch":
            it: Any = source()
        else:
            it = Prefetcher(source(), device=dev, depth=depth, pool=pool)
        waits, ok = [], 0
        t_start = time.perf_counter()
        for s in range(steps):
            t0 = time.perf_counter()
            mb = next(it)
            if kind == "no_prefetch":
                mb = mb.to(dev)  # pageable, synchronous: the baseline a plain loop gets
            waits.append(time.perf_counter() - t0)
            ok += bool(check(s, mb))
            for _ in range(k):
                a @ a
            torch.cuda.current_stream().synchronize()  # like loss.item() once per step
        wall = time.perf_counter() - t_start
        row: dict[str, Any] = {
            "steps": steps,
            "correct": ok,
            "wall_s": wall,
            "exposed_wait_median_s": statistics.median(waits[3:]),
            "exposed_wait_total_s": sum(waits),
        }
        if kind != "no_prefetch":
            row["stats"] = it.stats.to_dict()
            it.close()
        if pool is not None:
            row["pool"] = pool.stats()
        return row

    out: dict[str, Any] = {"matmuls_per_step": k, "pin_copy_s_median_batch": t_copy, "matmul_s": t_mm, "depth": depth}
    for kind in ("no_prefetch", "prefetch", "prefetch_pool"):
        out[kind] = loop(kind)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--steps", type=int, default=300, help="prefetcher loop steps")
    p.add_argument("--batches", type=int, default=8, help="distinct ragged micro-batches")
    p.add_argument("--min-mib", type=float, default=0.6)
    p.add_argument("--max-mib", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--depth", type=int, default=2)
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("CUDA not available, skipped")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"skipped": True, "reason": "CUDA not available", "torch": torch.__version__}, f, indent=1)
        return 0

    from knitdata.consumer.prefetch import host_memory_stats

    t_all = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device())
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host_memory_stats_before": host_memory_stats(),
    }
    sizes = _sizes(args.batches, args.min_mib, args.max_mib, seed=0)

    result["h2d"] = measure_h2d(sizes[:4] + [64 * MiB], dev, args.repeats)
    print(f"{'bytes':>10} {'pageable GB/s':>14} {'pinned GB/s':>12} {'ratio':>6}")
    for r in result["h2d"]:
        print(f"{r['bytes']:>10} {r['pageable_GBps']:>14.1f} {r['pinned_GBps']:>12.1f} {r['pinned_over_pageable']:>6.2f}")

    host = [torch.randint(0, 255, (nb,), dtype=torch.uint8) for nb in sizes[:4]]
    ov = result["overlap"] = measure_overlap(host, dev, args.repeats)
    print(f"\noverlap of {ov['bytes'] / MiB:.1f} MiB side-stream copies with {ov['matmuls']} matmuls:")
    print(f"  copy {ov['copy_s'] * 1e3:.3f} ms  compute {ov['compute_s'] * 1e3:.3f} ms  both {ov['both_s'] * 1e3:.3f} ms"
          f"  hidden {ov['hidden_fraction']:.2f}")
    print(f"  pageable: copy {ov['pageable_copy_s'] * 1e3:.3f} ms  both {ov['pageable_both_s'] * 1e3:.3f} ms"
          f"  hidden {ov['pageable_hidden_fraction']:.2f}")

    batches = _make_batches(sizes)
    pf = result["prefetcher"] = measure_prefetcher(batches, args.steps, dev, args.depth)
    print(f"\nprefetcher, {args.steps} steps over {len(batches)} ragged micro-batches "
          f"({min(b.nbytes for b in batches) / MiB:.2f}-{max(b.nbytes for b in batches) / MiB:.2f} MiB), "
          f"{pf['matmuls_per_step']} matmuls/step:")
    print(f"{'mode':>14} {'correct':>8} {'wall s':>8} {'wait med ms':>12} {'wait total s':>13}")
    for kind in ("no_prefetch", "prefetch", "prefetch_pool"):
        r = pf[kind]
        print(f"{kind:>14} {r['correct']:>8} {r['wall_s']:>8.3f} {r['exposed_wait_median_s'] * 1e3:>12.3f} "
              f"{r['exposed_wait_total_s']:>13.3f}")
    base = pf["no_prefetch"]["exposed_wait_median_s"]
    result["wait_ratio_prefetch_vs_none"] = pf["prefetch"]["exposed_wait_median_s"] / base if base else None
    result["all_correct"] = all(pf[k]["correct"] == args.steps for k in ("no_prefetch", "prefetch", "prefetch_pool"))
    result["host_memory_stats_after"] = host_memory_stats()
    result["pool"] = pf["prefetch_pool"].get("pool")
    result["elapsed_s"] = time.perf_counter() - t_all
    print("\npool:", json.dumps({k: v for k, v in (result["pool"] or {}).items() if k != "host_memory_stats"}))
    print("host_memory_stats after:", json.dumps(result["host_memory_stats_after"]))
    print(f"all correct: {result['all_correct']}   elapsed {result['elapsed_s']:.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if result["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
