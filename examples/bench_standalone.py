"""Benchmark a knitdata loader on its own: throughput, exposed latency and bytes/s per fetch mode.

For each fetch mode (``sample``, ``eager``, ``iter``) a fresh embedded pipeline is filled with the same
trajectories (prompt + response tokens, per-token old log-probs and a float "hidden" payload per trajectory),
closed, and one consumer iterates it twice:

* **drain**: no compute; micro-batches/s, trajectories/s and payload MB/s of the loader alone;
* **train-like**: a one-thread matmul per micro-batch (``--compute-ms``, calibrated; not a sleep); exposed
  latency = per optimizer step, the time spent inside ``next()`` (the consumer's metrics), median.

Modes are interleaved over ``--repeats`` rounds and medians reported, side by side in one run::

    python examples/bench_standalone.py [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from typing import Any

import torch

from knitdata import Trajectory
from knitdata.admission import BatchSpec

__all__ = ["make_trajectories", "calibrate_matmul", "run_mode", "run", "main"]

MODES = ("sample", "eager", "iter")
#: Rows of the table: (label, fetch mode, Python thread switch interval in s or None for the default 5 ms).
#: In ``iter`` mode the trainer waits for the GIL held by the prefetch thread (collate is Python code): with
#: the default switch interval that hand-off alone can cost milliseconds per micro-batch.
VARIANTS: tuple[tuple[str, str, float | None], ...] = (
    ("sample", "sample", None),
    ("eager", "eager", None),
    ("iter", "iter", None),
    ("iter/si0.5ms", "iter", 0.0005),
)


def make_trajectories(spec: BatchSpec, train_batches: int, response_len: int, hidden: int) -> list[Trajectory]:
    """Deterministic trajectories in put order."""
    out = []
    for b in range(train_batches):
        for i in range(spec.quotas[spec.sources[0]] // spec.group_size):
            for s in spec.sources:
                group = f"b{b}-{s}-g{i}"
                g = torch.Generator().manual_seed(zlib.crc32(group.encode()))
                prompt = torch.randint(0, 1000, (64,), generator=g)
                for j in range(spec.group_size):
                    n = int(torch.randint(response_len // 2, response_len + 1, (1,), generator=g))
                    out.append(
                        Trajectory(
                            id=f"{group}-r{j}", source=s, group=group, prompt_ids=prompt.clone(),
                            response_ids=torch.randint(0, 1000, (n,), generator=g), gen_version=b,
                            scalars={"reward": float(j % 2)},
                            tensors={"old_logprobs": torch.randn(n, generator=g),
                                     "hidden": torch.randn(1, hidden, generator=g)},
                        )
                    )
    return out


def calibrate_matmul(target_s: float) -> tuple[int, float]:
    """Size ``n`` of an ``n x n`` float32 matmul taking about ``target_s`` on one thread; returns (n, seconds)."""
    n = 64
    while True:
        a = torch.randn(n, n)
        t0 = time.perf_counter()
        for _ in range(3):
            a @ a
        dt = (time.perf_counter() - t0) / 3
        if dt >= target_s or n >= 4096:
            return n, dt
        n = int(n * min(2.0, max(1.1, (target_s / max(dt, 1e-6)) ** (1 / 3))))


def run_mode(mode: str, trajs: list[Trajectory], spec: BatchSpec, token_budget: int, compute_n: int | None) -> dict[str, Any]:
    """One pass of one consumer over a pre-filled pipeline in fetch ``mode``."""
    from knitdata.pipeline import Pipeline

    pipe = Pipeline(spec, num_consumers=1, token_budget=token_budget, capacity_bytes=1 << 30)
    for t in trajs:
        pipe.put(t)
    pipe.close()
    ds = pipe.dataset(0, fetch=mode)
    a = torch.randn(compute_n, compute_n) if compute_n else None
    t0 = time.perf_counter()
    n_mb = n_traj = 0
    for mb in ds:
        n_mb += 1
        n_traj += mb.num_sequences
        if a is not None:
            a @ a
    wall = time.perf_counter() - t0
    m = ds.metrics.to_dict()
    return {
        "wall_s": wall,
        "microbatches": n_mb,
        "trajectories": n_traj,
        "bytes": m["bytes_fetched"],
        "fetch_s": m["fetch_s_total"],
        "exposed_per_step_s": m["wait_per_step_s"]["p50"],
        "exposed_total_s": m["wait_s_total"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every mode ``args.repeats`` times (interleaved); medians per mode."""
    torch.set_num_threads(1)
    spec = BatchSpec({"math": 16, "code": 16}, num_minibatches=4, group_size=4)
    trajs = make_trajectories(spec, args.train_batches, args.response_len, args.hidden)
    n, compute_s = calibrate_matmul(args.compute_ms / 1000.0)
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {v[0]: {"drain": [], "train": []} for v in VARIANTS}
    default_si = sys.getswitchinterval()
    try:
        for _ in range(args.repeats):
            for label, mode, si in VARIANTS:
                sys.setswitchinterval(default_si if si is None else si)
                raw[label]["drain"].append(run_mode(mode, trajs, spec, args.token_budget, None))
                raw[label]["train"].append(run_mode(mode, trajs, spec, args.token_budget, n))
    finally:
        sys.setswitchinterval(default_si)
    med = statistics.median
    modes = {}
    for mode, _, _ in VARIANTS:
        d, t = raw[mode]["drain"], raw[mode]["train"]
        modes[mode] = {
            "microbatches_per_s": med(r["microbatches"] / r["wall_s"] for r in d),
            "trajectories_per_s": med(r["trajectories"] / r["wall_s"] for r in d),
            "drain_MBps": med(r["bytes"] / r["wall_s"] / 1e6 for r in d),
            "fetch_MBps": med(r["bytes"] / max(r["fetch_s"], 1e-9) / 1e6 for r in d),
            "exposed_latency_per_step_s": med(r["exposed_per_step_s"] for r in t),
            "exposed_total_s": med(r["exposed_total_s"] for r in t),
            "train_wall_s": med(r["wall_s"] for r in t),
            "microbatches": d[0]["microbatches"],
            "bytes": d[0]["bytes"],
        }
    return {
        "scenario": {"trajectories": len(trajs), "batch_spec": {"quotas": dict(spec.quotas), "M": spec.num_minibatches,
                     "group_size": spec.group_size}, "token_budget": args.token_budget, "response_len": args.response_len,
                     "hidden": args.hidden, "repeats": args.repeats, "compute_matmul_n": n,
                     "compute_s_per_microbatch": compute_s, "torch_threads": torch.get_num_threads(),
                     "default_switch_interval_s": default_si},
        "modes": modes,
    }


def print_table(res: dict[str, Any]) -> None:
    sc = res["scenario"]
    print(f"{sc['trajectories']} trajectories, {res['modes']['iter']['microbatches']} micro-batches, "
          f"{res['modes']['iter']['bytes'] / 1e6:.2f} MB payload, compute {sc['compute_s_per_microbatch'] * 1e3:.2f} ms "
          f"per micro-batch, medians of {sc['repeats']} interleaved repeats")
    print(f"{'mode':<12} {'mb/s':>9} {'traj/s':>9} {'drain MB/s':>10} {'fetch MB/s':>10} {'exposed/step ms':>15} "
          f"{'vs eager':>8}")
    eager = res["modes"]["eager"]["exposed_latency_per_step_s"]
    for mode, m in res["modes"].items():
        ratio = m["exposed_latency_per_step_s"] / eager if eager > 0 else float("nan")
        print(f"{mode:<12} {m['microbatches_per_s']:>9.0f} {m['trajectories_per_s']:>9.0f} {m['drain_MBps']:>10.1f} "
              f"{m['fetch_MBps']:>10.1f} {m['exposed_latency_per_step_s'] * 1e3:>15.3f} {ratio:>8.2f}")


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(res["modes"])
    fig, ax = plt.subplots(1, 2, figsize=(8, 3))
    ax[0].bar(modes, [res["modes"][m]["drain_MBps"] for m in modes])
    ax[0].set_ylabel("drain MB/s")
    ax[1].bar(modes, [res["modes"][m]["exposed_latency_per_step_s"] * 1e3 for m in modes])
    ax[1].set_ylabel("exposed latency per step (ms)")
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-batches", type=int, default=2)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--hidden", type=int, default=4096, help="floats of per-trajectory payload besides tokens")
    p.add_argument("--token-budget", type=int, default=1024)
    p.add_argument("--compute-ms", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.plot:
        plot(res, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
