"""``knitdata bench control``: control-plane throughput, put latency, commit cost; ``--scale``: planning at cluster scale.

``--scale`` times :meth:`knitdata.planner.Planner.plan` alone (metadata only, no engine): one admitted
mini-batch of ``--trajectories`` trajectories (GRPO groups of ``--group-size``, 256 to 16,384 tokens each,
about 12 bytes of payload per token) over ``--nodes`` x ``--ranks-per-node`` consumer ranks and, as a small
reference, over ``--ref-ranks`` ranks. Each group's payloads sit on one node (consumer-aware placement),
except every tenth group, split over two nodes. Reported per (ranks, trajectories): the median
``plan_ms`` over ``--repeats`` plans, the token balance (largest share over the mean share) and the
fraction of payload bytes that cross nodes, with the load average.

The engine part (put-to-admission throughput, put latency, trainer data time) is not in this build.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["add_arguments", "run", "run_scale", "make_admitted", "plan_quality"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``knitdata bench control``."""
    parser.add_argument("--scale", action="store_true", help="plan mini-batches at cluster scale (metadata only)")
    parser.add_argument("--trajectories", type=int, nargs="+", default=[8_000, 64_000],
                        help="trajectories per mini-batch (--scale)")
    parser.add_argument("--group-size", type=int, default=8, help="GRPO group size (--scale)")
    parser.add_argument("--nodes", type=int, default=1_000, help="nodes (--scale)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="consumer ranks per node (--scale)")
    parser.add_argument("--ref-ranks", type=int, default=80, help="ranks of the small reference layout (0: none)")
    parser.add_argument("--token-budget", type=int, default=65_536, help="tokens per micro-batch (--scale)")
    parser.add_argument("--repeats", type=int, default=5, help="plans timed per point; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="(unused: no plot for this benchmark)")


@dataclass(frozen=True)
class _Admitted:
    train_batch: int
    index: int
    step: int
    trajectories: tuple[Any, ...]


def make_admitted(n_traj: int, group_size: int, nodes: list[str], seed: int = 0) -> _Admitted:
    """One admitted mini-batch of :class:`~knitdata.record.TrajectoryMeta` (no payloads).

    Args:
        n_traj: Trajectories (a multiple of ``group_size`` is used).
        group_size: Members per group.
        nodes: Node names; a group's payloads sit on one of them (every tenth group on two).
        seed: Random seed.

    Returns:
        An admitted-mini-batch-like object (``train_batch``, ``index``, ``step``, ``trajectories``): whole
        groups in completion order, each trajectory's ``seq`` its arrival rank (groups interleave).
    """
    from knitdata.record import TrajectoryMeta

    rng = random.Random(seed)
    n_groups = max(1, n_traj // group_size)
    # arrival: a group's rollouts start together and finish after their own generation time, so the
    # members of concurrent groups interleave; seq is the arrival rank; admission emits whole groups in
    # the order they complete
    arrivals = []
    for g in range(n_groups):
        start = rng.uniform(0.0, n_groups / 100.0)
        arrivals.extend((start + rng.expovariate(1.0), g, k) for k in range(group_size))
    arrivals.sort()
    seq_of = {(g, k): s for s, (_t, g, k) in enumerate(arrivals)}
    done = {g: t for t, g, _k in arrivals}  # the last arrival of each group
    metas = []
    for g in sorted(range(n_groups), key=done.__getitem__):
        home = rng.randrange(len(nodes))
        other = rng.randrange(len(nodes))
        prompt = rng.randint(128, 2048)
        for k in range(group_size):
            tokens = min(16_384, prompt + int(rng.lognormvariate(7.0, 0.8)))
            node = nodes[other] if (g % 10 == 9 and k % 2) else nodes[home]
            metas.append(TrajectoryMeta(
                id=f"t{g * group_size + k}", source=("math", "code")[g % 2], group=f"g{g}", num_tokens=tokens,
                nbytes=12 * tokens, location=node, seq=seq_of[(g, k)],
            ))
    return _Admitted(train_batch=0, index=0, step=0, trajectories=tuple(metas))


def plan_quality(plan: Any) -> dict[str, float]:
    """Token balance (largest share / mean share) and cross-node bytes fraction of a plan."""
    shares = plan.share_tokens()
    mean = sum(shares) / len(shares)
    total_bytes = plan.local_bytes + plan.remote_bytes
    return {
        "max_over_mean_tokens": max(shares) / mean if mean else 0.0,
        "cross_node_bytes_fraction": plan.remote_bytes / total_bytes if total_bytes else 0.0,
    }


def run_scale(args: argparse.Namespace) -> dict[str, Any]:
    """Time planning at cluster scale; returns ``{"scale": {ranks: {trajectories: {...}}}, ...}``."""
    from knitdata.placement import ConsumerLayout
    from knitdata.planner import Planner

    layouts = [(args.nodes, args.ranks_per_node)]
    if args.ref_ranks:
        layouts.append((max(1, args.ref_ranks // args.ranks_per_node), args.ranks_per_node))
    out: dict[str, Any] = {}
    rows = []
    for n_nodes, per in layouts:
        layout = ConsumerLayout.uniform(n_nodes, per)
        planner = Planner(layout, args.token_budget, locality=True)
        ranks = layout.num_consumers
        for n_traj in args.trajectories:
            admitted = make_admitted(n_traj, args.group_size, list(layout.nodes), seed=args.seed)
            times = []
            plan = None
            for _ in range(max(1, args.repeats)):
                t0 = time.perf_counter()
                plan = planner.plan(admitted)
                times.append((time.perf_counter() - t0) * 1e3)
            q = plan_quality(plan)
            point = {
                "plan_ms": statistics.median(times),
                "plan_ms_min": min(times),
                "microbatches_per_rank": plan.num_microbatches,
                **q,
            }
            out.setdefault(str(ranks), {})[str(len(admitted.trajectories))] = point
            rows.append((ranks, len(admitted.trajectories), point))
            print(f"  planned {len(admitted.trajectories)} trajectories over {ranks} ranks: "
                  f"{point['plan_ms']:.1f} ms", flush=True)
    print()
    print(f"{'ranks':>6} {'trajectories':>12} {'plan_ms':>9} {'min_ms':>8} {'K':>3} {'max/mean tok':>12} {'cross-node':>10}")
    for ranks, n, p in rows:
        print(f"{ranks:>6} {n:>12} {p['plan_ms']:>9.1f} {p['plan_ms_min']:>8.1f} {p['microbatches_per_rank']:>3} "
              f"{p['max_over_mean_tokens']:>12.3f} {p['cross_node_bytes_fraction']:>10.3f}")
    return {"scale": out}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark: ``--scale`` plans at cluster scale; the engine part is not in this build."""
    if not args.scale:
        print("knitdata bench control: the engine part (put throughput, put latency, trainer data time) is not "
              "in this build; run with --scale for planning at cluster scale")
        return 0
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "config": {k: getattr(args, k) for k in ("trajectories", "group_size", "nodes", "ranks_per_node",
                                                 "ref_ranks", "token_budget", "repeats", "seed")},
    }
    report.update(run_scale(args))
    report["loadavg_start"] = list(load0)
    report["loadavg_end"] = list(os.getloadavg())
    report["wall_s"] = time.perf_counter() - t0
    print(f"load average: start {' '.join(f'{x:.2f}' for x in load0)}, "
          f"end {' '.join(f'{x:.2f}' for x in report['loadavg_end'])}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0
