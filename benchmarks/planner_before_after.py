"""Planning at cluster scale, before and after: ``Planner.plan`` of git revisions beside the working tree's.

Usage: ``python benchmarks/planner_before_after.py [--before REV ...] [--repeats N] [--json PATH]``. The planner
of each ``--before`` revision (``knitdata/planner.py``, or the ``knitdata/planner/`` package) is loaded from git
into a private package (it never enters ``knitdata``; it uses the working tree's ``knitdata`` for everything
else); all plan the same admitted mini-batches of ``python -m benchmarks control --scale`` (groups of 8; 1,000
nodes x 8 ranks and 10 nodes x 8 ranks), alternating call by call, so load swings hit all alike.

Timed per call: ``plan_ms``, the call to ``plan`` alone (the previous plan is dropped before the clock starts);
``plan_info_ms``, the call plus every micro-batch's :class:`~knitdata.planner.MicroBatchInfo` (``to_info()``),
what the control plane's queue reads of every row: revisions whose plan rows did not hold it build it there;
and ``free_ms``, dropping the plan and the infos. Reported per point and planner: the medians and best of each,
whether every planner's plan is identical to the working tree's (every micro-batch's info and trajectory ids,
K, local and remote bytes), token balance and cross-node bytes fraction, with the load average before and after.
Writes ``benchmarks/results/planner_before_after.json`` unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.control import make_admitted, plan_quality  # noqa: E402
from knitdata.placement import ConsumerLayout  # noqa: E402
from knitdata.planner import Planner  # noqa: E402

__all__ = ["main", "load_planner_at", "DEFAULT_BEFORE"]

ROOT = Path(__file__).resolve().parent.parent
#: The planners compared by default: before the micro-batch info moved into the plan rows (``a176f31``) and
#: after (``70b43ac``, the planner the second step of issue 42 started from).
DEFAULT_BEFORE = ("a176f31", "70b43ac")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def load_planner_at(rev: str, into: Path) -> Any:
    """The planner of git revision ``rev``, imported as a private package written under ``into``.

    Its own modules (``knitdata.planner`` and ``knitdata.planner.*``) are renamed to the private package; the
    rest of ``knitdata`` it imports is the working tree's.
    """
    name = f"_planner_at_{''.join(c if c.isalnum() else '_' for c in rev)}"
    files = _git("ls-tree", "--name-only", rev, "knitdata/planner/").split()
    if files:
        pkg = into / name
        pkg.mkdir(parents=True, exist_ok=True)
        for path in files:
            if path.endswith(".py"):
                src = _git("show", f"{rev}:{path}").replace("knitdata.planner", name)
                (pkg / Path(path).name).write_text(src)
    else:  # the single-module planner
        (into / f"{name}.py").write_text(_git("show", f"{rev}:knitdata/planner.py"))
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    return importlib.import_module(name)


def _records(plan: Any) -> tuple[Any, ...]:
    """What a plan decides: every micro-batch's info and trajectory ids, K, local and remote bytes."""
    rows = [[(mb.to_info().to_dict(), [m.id for m in mb.trajectories]) for mb in row] for row in plan.microbatches]
    return rows, plan.num_microbatches, plan.local_bytes, plan.remote_bytes


def _time_once(planner: Any, admitted: Any) -> tuple[float, float, float]:
    """``(plan_ms, plan_info_ms, free_ms)`` of one call (see the module docstring)."""
    t0 = time.perf_counter()
    plan = planner.plan(admitted)
    t1 = time.perf_counter()
    infos = [mb.to_info() for row in plan.microbatches for mb in row]
    t2 = time.perf_counter()
    del plan, infos
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3, (t3 - t2) * 1e3


def main(argv: list[str] | None = None) -> int:
    """Time the planners side by side and write the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", nargs="+", default=list(DEFAULT_BEFORE),
                    help="git revisions of the planners to compare with")
    ap.add_argument("--trajectories", type=int, nargs="+", default=[8_000, 64_000])
    ap.add_argument("--layouts", nargs="+", default=["1000x8", "10x8"], help="NODESxRANKS_PER_NODE")
    ap.add_argument("--token-budget", type=int, default=65_536)
    ap.add_argument("--repeats", type=int, default=9, help="plans timed per planner and point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "planner_before_after.json"))
    a = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="planner_before_")
    modules = {rev: load_planner_at(rev, Path(tmp.name)) for rev in a.before}
    head = _git("rev-parse", "--short", "HEAD").strip()
    dirty = bool(_git("status", "--porcelain", "--", "knitdata/planner").strip())
    load_start = os.getloadavg()
    t_start = time.time()
    points: dict[str, Any] = {}
    labels = [*a.before, "now"]
    print(f"planners: {', '.join(a.before)} and the working tree (HEAD {head}{', modified' if dirty else ''}); "
          f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}", flush=True)
    for spec in a.layouts:
        nodes, per = (int(x) for x in spec.split("x"))
        layout = ConsumerLayout.uniform(nodes, per)
        ranks = layout.num_consumers
        planners = {rev: m.Planner(layout, a.token_budget) for rev, m in modules.items()}
        planners["now"] = Planner(layout, a.token_budget)
        for n_traj in a.trajectories:
            admitted = make_admitted(n_traj, 8, list(layout.nodes), seed=a.seed)
            plans = {k: p.plan(admitted) for k, p in planners.items()}  # warm-up, and the plans compared
            now = _records(plans["now"])
            identical = {k: _records(plans[k]) == now for k in a.before}
            quality = {k: plan_quality(plans[k]) for k in planners}
            del plans
            times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in planners}
            for _ in range(a.repeats):
                for k, p in planners.items():
                    gc.collect()  # no planner's garbage left to the next one's collector
                    times[k].append(_time_once(p, admitted))
            point: dict[str, Any] = {"identical_plans": all(identical.values()), "identical": identical}
            for k in planners:
                cols = list(zip(*times[k]))
                point[k] = {"plan_ms": statistics.median(cols[0]), "plan_ms_min": min(cols[0]),
                            "plan_info_ms": statistics.median(cols[1]), "plan_info_ms_min": min(cols[1]),
                            "free_ms": statistics.median(cols[2]), **quality[k]}
            points.setdefault(str(ranks), {})[str(len(admitted.trajectories))] = point
            print(f"  {ranks} ranks, {len(admitted.trajectories)} trajectories: " + ", ".join(
                f"{k} {point[k]['plan_ms']:.1f} ms ({point[k]['plan_info_ms']:.1f} with infos)" for k in labels),
                flush=True)
    load_end = os.getloadavg()
    print()
    print(f"{'ranks':>6} {'trajectories':>12} " + " ".join(f"{k + ' ms':>14} {'+info':>7} {'free':>5}" for k in labels)
          + f" {'identical':>9}")
    for ranks_key, by_n in points.items():
        for n, p in by_n.items():
            print(f"{ranks_key:>6} {n:>12} " + " ".join(
                f"{p[k]['plan_ms']:>14.1f} {p[k]['plan_info_ms']:>7.1f} {p[k]['free_ms']:>5.1f}" for k in labels)
                + f" {str(p['identical_plans']):>9}")
    print(f"load average: start {' '.join(f'{x:.2f}' for x in load_start)}, "
          f"end {' '.join(f'{x:.2f}' for x in load_end)}")
    report = {"config": {**{k: v for k, v in vars(a).items() if k != "json"}, "now": head + ("+" if dirty else "")},
              "points": points, "loadavg_start": list(load_start), "loadavg_end": list(load_end),
              "wall_s": time.time() - t_start}
    tmp.cleanup()
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 0 if all(p["identical_plans"] for by_n in points.values() for p in by_n.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
