"""Planning at cluster scale, before and after: ``Planner.plan`` of a git revision beside the working tree's.

Usage: ``python benchmarks/planner_before_after.py [--before REV] [--repeats N] [--json PATH]``. The planner
of ``--before`` (default ``cd7c8a3``, the heap-based planner) is loaded from git into a private module (it
never enters the package); both plan the same admitted mini-batches of ``python -m benchmarks control --scale``
(groups of 8; 1,000 nodes x 8 ranks and 10 nodes x 8 ranks), alternating call by call, so load swings hit
both alike. Reported per point: median and best ``plan_ms`` of each, the ratio of medians, whether the
two plans are identical (every micro-batch's fields, K, local and remote bytes), and their token balance
and cross-node bytes fraction; with the load average before and after. Writes
``benchmarks/results/planner_before_after.json`` unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.control import make_admitted, plan_quality  # noqa: E402
from knitdata.placement import ConsumerLayout  # noqa: E402
from knitdata.planner import Planner  # noqa: E402

__all__ = ["main", "load_planner_at"]

ROOT = Path(__file__).resolve().parent.parent


def load_planner_at(rev: str) -> Any:
    """The ``knitdata/planner.py`` of git revision ``rev``, imported as a private module."""
    src = subprocess.run(["git", "show", f"{rev}:knitdata/planner.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    name = f"_planner_at_{rev.replace('/', '_').replace('~', '_').replace('^', '_')}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    exec(compile(src, f"{rev}:knitdata/planner.py", "exec"), module.__dict__)
    return module


def _rows(plan: Any) -> list[list[dict[str, Any]]]:
    return [[mb._asdict() if hasattr(mb, "_asdict") else dict(vars(mb)) for mb in row] for row in plan.microbatches]


def main(argv: list[str] | None = None) -> int:
    """Time both planners side by side and write the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="cd7c8a3", help="git revision of the planner to compare with")
    ap.add_argument("--trajectories", type=int, nargs="+", default=[8_000, 64_000])
    ap.add_argument("--layouts", nargs="+", default=["1000x8", "10x8"], help="NODESxRANKS_PER_NODE")
    ap.add_argument("--token-budget", type=int, default=65_536)
    ap.add_argument("--repeats", type=int, default=9, help="plans timed per planner and point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "planner_before_after.json"))
    a = ap.parse_args(argv)
    before = load_planner_at(a.before)
    load_start = os.getloadavg()
    t_start = time.time()
    points: dict[str, Any] = {}
    print(f"before: {a.before}, after: working tree; load average {load_start[0]:.2f} {load_start[1]:.2f} "
          f"{load_start[2]:.2f}", flush=True)
    for spec in a.layouts:
        nodes, per = (int(x) for x in spec.split("x"))
        layout = ConsumerLayout.uniform(nodes, per)
        ranks = layout.num_consumers
        planners = {"before": before.Planner(layout, a.token_budget), "after": Planner(layout, a.token_budget)}
        for n_traj in a.trajectories:
            admitted = make_admitted(n_traj, 8, list(layout.nodes), seed=a.seed)
            plans = {k: p.plan(admitted) for k, p in planners.items()}  # warm-up, and the plans compared
            identical = (_rows(plans["before"]) == _rows(plans["after"])
                         and (plans["before"].local_bytes, plans["before"].remote_bytes)
                         == (plans["after"].local_bytes, plans["after"].remote_bytes))
            times: dict[str, list[float]] = {k: [] for k in planners}
            for _ in range(a.repeats):
                for k, p in planners.items():
                    t0 = time.perf_counter()
                    p.plan(admitted)
                    times[k].append((time.perf_counter() - t0) * 1e3)
            point: dict[str, Any] = {"identical_plans": identical}
            for k in planners:
                point[k] = {"plan_ms": statistics.median(times[k]), "plan_ms_min": min(times[k]),
                            **plan_quality(plans[k])}
            point["speedup"] = point["before"]["plan_ms"] / point["after"]["plan_ms"]
            points.setdefault(str(ranks), {})[str(len(admitted.trajectories))] = point
            print(f"  {ranks} ranks, {len(admitted.trajectories)} trajectories: before "
                  f"{point['before']['plan_ms']:.1f} ms, after {point['after']['plan_ms']:.1f} ms", flush=True)
    load_end = os.getloadavg()
    print()
    print(f"{'ranks':>6} {'trajectories':>12} {'before_ms':>10} {'after_ms':>9} {'speedup':>8} "
          f"{'before_min':>10} {'after_min':>9} {'identical':>9} {'max/mean tok':>12} {'cross-node':>10}")
    for ranks_key, by_n in points.items():
        for n, p in by_n.items():
            b, f = p["before"], p["after"]
            print(f"{ranks_key:>6} {n:>12} {b['plan_ms']:>10.1f} {f['plan_ms']:>9.1f} {p['speedup']:>7.2f}x "
                  f"{b['plan_ms_min']:>10.1f} {f['plan_ms_min']:>9.1f} {str(p['identical_plans']):>9} "
                  f"{f['max_over_mean_tokens']:>12.3f} {f['cross_node_bytes_fraction']:>10.3f}")
    print(f"load average: start {' '.join(f'{x:.2f}' for x in load_start)}, "
          f"end {' '.join(f'{x:.2f}' for x in load_end)}")
    report = {"config": {k: v for k, v in vars(a).items() if k != "json"}, "points": points,
              "loadavg_start": list(load_start), "loadavg_end": list(load_end), "wall_s": time.time() - t_start}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 0 if all(p["identical_plans"] for by_n in points.values() for p in by_n.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
