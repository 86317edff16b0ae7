"""Admission benchmark: architectural staleness and quota violations per admission policy.

``python -m benchmarks admission [--scenario NAME] [--seed N] [--seeds N] [--sweep-m] [--scaling] [--json PATH]
[--plot PATH]`` simulates the scenario (:mod:`benchmarks.sim`) once per seed with each of the four policies
on identical durations, prints a table of medians over seeds, and writes JSON and a plot. ``--sweep-m``
repeats ``skewed`` for M = 4, 8, 16; the admission-cost scaling measurement (microseconds per trajectory
of ``ConstraintPreservingAdmission`` and ``FifoAdmission`` as B grows from ~10^3 to ~10^6) runs with
``--scaling`` (and always alongside ``--sweep-m``). ``--bound`` simulates constraint-preserving admission without
and with a staleness bound ``max_staleness`` in 1, 2, 4, 8 (``on_stale`` drop and wait): throughput, staleness,
wasted rollout work (:func:`run_bound`).

As a script, ``python benchmarks/admission.py [--seeds N] [--out DIR]`` (default 5 seeds) runs every named
scenario of :data:`SCRIPT_SCENARIOS`, then the M sweep, writing ``DIR/admission_<scenario>.json/.png`` and
``DIR/admission_sweep_m.json/.png`` (``--bound`` runs on its own) (default ``DIR``: ``benchmarks/results``).
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/admission.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.sim import POLICY_NAMES, SCENARIOS, Scenario, SimResult, get_scenario, simulate
from knitdata.admission import BatchSpec, make_policy
from knitdata.record import TrajectoryMeta
from knitdata.staleness import staleness_reduction

__all__ = [
    "SCRIPT_SCENARIOS",
    "main",
    "add_arguments",
    "run",
    "run_scenario",
    "sweep_m",
    "admission_cost",
    "scaling",
    "run_scaling",
    "format_table",
    "plot",
    "BOUND_ETAS",
    "BOUND_METRICS",
    "run_bound",
    "format_bound",
    "plot_bound",
    "METRICS",
]

#: Per-policy figures reported (medians over seeds).
METRICS: tuple[str, ...] = (
    "arch_staleness_positive_mean",
    "arch_staleness_mean",
    "share_negative",
    "arch_staleness_p50",
    "arch_staleness_p95",
    "raw_staleness_mean",
    "quota_violations",
    "bound_violations",
    "mean_admit_delay",
    "makespan",
)


def _median(xs: Sequence[float | None]) -> float | None:
    v = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(v) if v else None


def run_scenario(
    scenario: Scenario, seeds: Sequence[int], policies: Sequence[str] = POLICY_NAMES, progress: bool = True
) -> tuple[dict[str, Any], dict[int, dict[str, SimResult]]]:
    """Simulate every policy on every seed and summarize.

    Returns:
        ``(report, runs)``: ``report`` is the JSON document (scenario, params, seeds, policies with medians
        over seeds, plus per-seed figures); ``runs`` maps seed -> policy -> :class:`~benchmarks.sim.SimResult`.
    """
    runs: dict[int, dict[str, SimResult]] = {}
    jobs = [(s, p) for s in seeds for p in policies]
    bar = None
    if progress and len(seeds) > 1:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc=f"admission {scenario.name}", unit="run", leave=False)
    for s, p in jobs:
        runs.setdefault(s, {})[p] = simulate(scenario, p, s)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    out: dict[str, Any] = {}
    for p in policies:
        per_seed = []
        for s in seeds:
            m = dict(runs[s][p].metrics)
            base = runs[s]["train_batch"].metrics["arch_staleness_mean"] if "train_batch" in runs[s] else math.nan
            m["reduction_vs_train_batch"] = staleness_reduction(m["arch_staleness_mean"], base)
            base_pos = (runs[s]["train_batch"].metrics["arch_staleness_positive_mean"] if "train_batch" in runs[s]
                        else math.nan)
            m["reduction_positive_vs_train_batch"] = staleness_reduction(m["arch_staleness_positive_mean"], base_pos)
            per_seed.append(m)
        row: dict[str, Any] = {k: _median([m[k] for m in per_seed]) for k in METRICS}
        row["reduction_vs_train_batch"] = _median([m["reduction_vs_train_batch"] for m in per_seed])
        row["reduction_positive_vs_train_batch"] = _median([m["reduction_positive_vs_train_batch"] for m in per_seed])
        row["colocated_makespan"] = _median([m["colocated_makespan"] for m in per_seed])
        row["per_seed"] = {
            str(s): {k: m[k] for k in (*METRICS, "reduction_vs_train_batch", "reduction_positive_vs_train_batch")}
            for s, m in zip(seeds, per_seed)
        }
        row["minibatch_admit_times_seed0"] = per_seed[0]["minibatch_admit_times"]
        out[p] = row
    report = {"scenario": scenario.name, "params": scenario.params(), "seeds": list(seeds), "policies": out}
    return report, runs


#: Staleness bounds of ``--bound``.
BOUND_ETAS: tuple[int, ...] = (1, 2, 4, 8)
#: Figures of ``--bound`` per regime (medians over seeds).
BOUND_METRICS: tuple[str, ...] = ("throughput", "makespan", "raw_staleness_mean", "worst_staleness",
                                  "arch_staleness_mean", "wasted_token_share", "dropped_groups", "quota_violations")


def run_bound(scenario: Scenario, seeds: Sequence[int], etas: Sequence[int] = BOUND_ETAS,
              policy: str = "constraint_preserving") -> dict[str, Any]:
    """Throughput and staleness per staleness bound (issue 26.4): ``policy`` without a bound and with
    ``max_staleness`` = each of ``etas``, ``on_stale`` drop and wait, on the same seeded workloads.

    Returns:
        ``{"scenario", "params", "seeds", "policy", "etas", "regimes": {"none" | "bound_<eta>_<mode>": {metric:
        median over seeds, "per_seed": {...}}}}``; ``throughput`` is trained trajectories per time unit.
    """
    regimes: dict[str, Any] = {}
    for eta, mode in [(None, "drop"), *[(e, m) for e in etas for m in ("drop", "wait")]]:
        name = "none" if eta is None else f"bound_{eta}_{mode}"
        per_seed = {}
        for s in seeds:
            r = simulate(scenario, policy, s, max_staleness=eta, on_stale=mode)
            m = dict(r.metrics)
            if eta is None:
                raw = [t["train_version"] - t["gen_version"] for t in r.trajectories]
                m.update(worst_staleness=max(raw), wasted_token_share=0.0, dropped_groups=0,
                         throughput=len(r.trajectories) / m["makespan"])
            per_seed[str(s)] = {k: m[k] for k in BOUND_METRICS}
        row: dict[str, Any] = {k: _median([x[k] for x in per_seed.values()]) for k in BOUND_METRICS}
        row["per_seed"] = per_seed
        regimes[name] = row
    return {"scenario": scenario.name, "params": scenario.params(), "seeds": list(seeds), "policy": policy,
            "etas": list(etas), "regimes": regimes}


def format_bound(doc: dict[str, Any]) -> str:
    """The printed table of :func:`run_bound`."""
    lines = [f"staleness bound on {doc['scenario']} ({doc['policy']}; medians over seeds {doc['seeds']}):",
             f"{'regime':<16}{'throughput':>11}{'makespan':>10}{'raw':>7}{'worst':>7}{'arch':>7}{'wasted':>8}"
             f"{'dropped':>9}{'quota_viol':>11}"]
    for name, r in doc["regimes"].items():
        lines.append(f"{name:<16}{_fmt(r['throughput']):>11}{_fmt(r['makespan']):>10}{_fmt(r['raw_staleness_mean']):>7}"
                     f"{_fmt(r['worst_staleness']):>7}{_fmt(r['arch_staleness_mean']):>7}"
                     f"{_fmt(r['wasted_token_share']):>8}{_fmt(r['dropped_groups']):>9}{_fmt(r['quota_violations']):>11}")
    lines.append("(throughput: trained trajectories per time unit; raw: mean trainer version - gen_version; worst: its "
                 "max; wasted: share of generated tokens dropped by the bound)")
    return "\n".join(lines)


def plot_bound(doc: dict[str, Any], path: str) -> None:
    """Throughput and staleness per bound (:func:`run_bound`'s document) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = doc["etas"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.6))
    base = doc["regimes"]["none"]
    for mode, mk in (("drop", "o"), ("wait", "s")):
        rows = [doc["regimes"][f"bound_{e}_{mode}"] for e in etas]
        ax.plot(etas, [r["throughput"] for r in rows], marker=mk, label=mode)
        bx.plot(etas, [r["raw_staleness_mean"] for r in rows], marker=mk, label=f"{mode} mean")
        bx.plot(etas, [r["worst_staleness"] for r in rows], marker=mk, ls=":", label=f"{mode} worst")
    ax.axhline(base["throughput"], color="grey", ls="--", lw=0.8, label="no bound")
    bx.axhline(base["raw_staleness_mean"], color="grey", ls="--", lw=0.8, label="no bound (mean)")
    ax.set_xlabel("max_staleness (eta)")
    ax.set_ylabel("trained trajectories per time unit")
    bx.set_xlabel("max_staleness (eta)")
    bx.set_ylabel("staleness (versions)")
    for x in (ax, bx):
        x.set_xticks(etas)
        x.legend(fontsize=7)
    ax.set_title(f"{doc['scenario']}: throughput per bound", fontsize=9)
    bx.set_title("staleness trained", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_m(seeds: Sequence[int], ms: Sequence[int] = (4, 8, 16), progress: bool = True) -> dict[str, Any]:
    """Run ``skewed`` with M in ``ms`` (other parameters fixed) and return ``{"M": {str(M): report}}``."""
    base = get_scenario("skewed")
    return {"M": {str(M): run_scenario(base.with_(num_minibatches=M), seeds, progress=progress)[0] for M in ms}}


def admission_cost(
    batch_size: int,
    policy: str = "constraint_preserving",
    *,
    num_sources: int = 4,
    group_size: int = 8,
    num_minibatches: int | None = 16,
    minibatch_size: int | None = None,
    min_trajectories: int = 300_000,
    seed: int = 0,
) -> dict[str, float]:
    """Microseconds of admission work per trajectory for train batches of ``batch_size``.

    Groups of each train batch arrive in a seeded random source order; after every group the policy is
    offered its members and polled (as a producer would). Only ``offer`` + ``poll`` are timed; metadata
    is built, and admitted mini-batches are read and freed, outside the timer in chunks, so memory stays bounded by one chunk plus the ready window.
    Small batches run several train batches back to back, so at least ``min_trajectories`` are timed.

    Either ``num_minibatches`` is fixed (``m = B / M`` grows with ``B``) or, with ``minibatch_size`` set,
    the mini-batch size is fixed and ``M = B / m`` grows. ``B`` is rounded to the nearest valid size.
    """
    import numpy as np

    if minibatch_size is not None:
        unit = math.lcm(num_sources * group_size, minibatch_size)
        B = max(unit, round(batch_size / unit) * unit)
        M = B // minibatch_size
    else:
        M = int(num_minibatches or 16)
        unit = num_sources * group_size * M
        B = max(unit, round(batch_size / unit) * unit)
    spec = BatchSpec({f"s{i}": B // num_sources for i in range(num_sources)}, M, group_size)
    pol = make_policy(policy, spec)
    rng = np.random.default_rng(seed)
    n_batches = max(1, -(-min_trajectories // B))
    chunk_groups = 64  # small and equal at every B: metadata is built just before it is offered
    elapsed = 0.0
    total = 0
    admitted = 0
    for b in range(n_batches):
        order = rng.permutation(np.repeat(np.arange(num_sources), B // num_sources // group_size))
        for c0 in range(0, len(order), chunk_groups):
            chunk_len = len(order[c0 : c0 + chunk_groups])
            chunk = [
                [
                    TrajectoryMeta(id=f"{b}.{c0 + j}.{i}", source=f"s{src}", group=f"{b}.{c0 + j}", gen_version=b)
                    for i in range(group_size)
                ]
                for j, src in enumerate(order[c0 : c0 + chunk_groups].tolist())
            ]
            out: list = []
            t0 = time.thread_time()
            for grp in chunk:
                pol.offer(grp)
                out.extend(pol.poll())
            elapsed += time.thread_time() - t0
            # the consumer's side (reading and freeing the admitted metadata) is not admission work
            admitted += sum(len(mb.trajectories) for mb in out)
            del out, chunk
            total += chunk_len * group_size
    assert admitted == total, f"admitted {admitted} of {total}"
    return {
        "batch_size": B,
        "num_minibatches": M,
        "minibatch_size": B // M,
        "trajectories": total,
        "seconds": elapsed,
        "us_per_trajectory": elapsed / total * 1e6,
    }


def scaling(
    sizes: Sequence[int] = (1_000, 10_000, 100_000, 1_000_000),
    policies: Sequence[str] = ("constraint_preserving", "fifo"),
    repeats: int = 3,
    minibatch_size: int | None = None,
) -> dict[str, Any]:
    """:func:`admission_cost` per size and policy, plus the ratio largest / smallest per policy.

    Each (policy, size) is measured ``repeats`` times, interleaved across sizes, and the minimum is
    reported (the least-disturbed run on a shared machine; all repeats are kept in the result). Time is
    the thread's CPU time, so other processes on the machine inflate it less than wall time would.
    ``minibatch_size=None``: M = 16 fixed, so the ready window (m = B / 16) grows with B and so do cache
    misses; with ``minibatch_size`` set, m is fixed and M = B / m grows (the algorithmic cost alone).
    """
    out: dict[str, Any] = {}
    for p in policies:
        reps: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
        for _ in range(max(1, repeats)):
            for n in sizes:
                reps[n].append(admission_cost(n, p, minibatch_size=minibatch_size))
        rows: list[dict[str, Any]] = []
        for n in sizes:
            best = min(reps[n], key=lambda r: r["us_per_trajectory"])
            rows.append({**best, "repeats_us_per_trajectory": [r["us_per_trajectory"] for r in reps[n]]})
        out[p] = {
            "rows": rows,
            "ratio_largest_vs_smallest": rows[-1]["us_per_trajectory"] / rows[0]["us_per_trajectory"],
        }
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def format_table(report: dict[str, Any]) -> str:
    """A text table of one scenario report."""
    cols = (
        "arch_staleness_positive_mean",
        "reduction_positive_vs_train_batch",
        "arch_staleness_mean",
        "arch_staleness_p95",
        "share_negative",
        "raw_staleness_mean",
        "reduction_vs_train_batch",
        "quota_violations",
        "bound_violations",
        "mean_admit_delay",
        "makespan",
    )
    short = (
        "arch+_mean",
        "red.(+)",
        "arch_mean",
        "arch_p95",
        "share_neg",
        "raw_mean",
        "red.(signed)",
        "quota_viol",
        "bound_viol",
        "admit_delay",
        "makespan",
    )
    p = report["params"]
    head = (
        f"scenario={report['scenario']} seeds={report['seeds']} B={p['B']} M={p['num_minibatches']} m={p['m']} "
        f"g={p['group_size']} C={p['slots']} S={p['S']} train_time/mb={p['train_time']} sync={p['sync']} "
        f"partial={p['partial']} continuous={p['continuous']} batches={p['num_batches']}\n  sources: "
        + ", ".join(
            f"{s['name']}(q={s['quota']}, mean={s['mean']}, sigma={s['sigma']}, drop={s['drop']})" for s in p["sources"]
        )
        + (f"\n  bounds: {p['bounds']}" if p["bounds"] else "")
    )
    lines = [head, f"{'policy':<22}" + "".join(f"{c:>12}" for c in short)]
    for name, row in report["policies"].items():
        lines.append(f"{name:<22}" + "".join(f"{_fmt(row.get(c)):>12}" for c in cols))
    colo = next(iter(report["policies"].values())).get("colocated_makespan")
    lines.append(f"(medians over seeds; colocated makespan on the same durations: {_fmt(colo)})")
    return "\n".join(lines)


def plot(report: dict[str, Any], runs: dict[int, dict[str, SimResult]], path: str) -> None:
    """Cumulative admitted trajectories per source vs time (first seed, one panel per policy) and the
    architectural staleness per policy (mean and p95, medians over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = report["seeds"][0]
    pols = list(report["policies"])
    fig, axes = plt.subplots(1, len(pols) + 1, figsize=(4 * (len(pols) + 1), 3.6))
    for ax, p in zip(axes, pols):
        res = runs[seed][p]
        by_src: dict[str, list[float]] = {}
        for t in res.trajectories:
            by_src.setdefault(t["source"], []).append(t["admit"])
        for s, ts in sorted(by_src.items()):
            ts.sort()
            ax.step(ts, range(1, len(ts) + 1), where="post", label=s)
        ax.set_title(p, fontsize=9)
        ax.set_xlabel("time")
        ax.set_ylabel("cumulative admitted")
        ax.legend(fontsize=7)
    ax = axes[-1]
    xs = range(len(pols))
    means = [report["policies"][p]["arch_staleness_mean"] or 0.0 for p in pols]
    p95 = [report["policies"][p]["arch_staleness_p95"] or 0.0 for p in pols]
    ax.bar([x - 0.2 for x in xs], means, width=0.4, label="mean")
    ax.bar([x + 0.2 for x in xs], p95, width=0.4, label="p95")
    ax.set_xticks(list(xs), [p.replace("_", "\n") for p in pols], fontsize=7)
    ax.set_ylabel("architectural staleness (steps)")
    ax.legend(fontsize=7)
    fig.suptitle(
        f"admission: {report['scenario']} (seed {seed} curves; bars: medians over {len(report['seeds'])} seeds)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's options."""
    parser.add_argument("--scenario", default="skewed", choices=sorted(SCENARIOS), help="named scenario")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=int, default=1, help="number of seeds (medians reported)")
    parser.add_argument("--sweep-m", action="store_true", help="run skewed with M = 4, 8, 16 (and the scaling)")
    parser.add_argument("--scaling", action="store_true", help="measure admission cost per trajectory, B=1e3..1e6")
    parser.add_argument("--bound", action="store_true",
                        help="throughput and staleness per staleness bound eta in 1, 2, 4, 8 (drop and wait)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG plot")


def run_scaling() -> dict[str, Any]:
    """Both scaling modes: ``{"fixed_M": scaling(), "fixed_m": scaling(minibatch_size=1024)}``."""
    return {"fixed_M": scaling(), "fixed_m": scaling(minibatch_size=1024)}


def _print_scaling(sc: dict[str, Any]) -> None:
    print("admission cost (offer+poll after every group; S=4, g=8; thread CPU time, min of 3 repeats):")
    print(f"{'mode':<8}{'policy':<22}{'B':>10}{'M':>6}{'m':>8}{'trajectories':>14}{'us/traj':>10}")
    for mode, res in sc.items():
        for p, d in res.items():
            for r in d["rows"]:
                print(
                    f"{mode:<8}{p:<22}{r['batch_size']:>10}{r['num_minibatches']:>6}{r['minibatch_size']:>8}"
                    f"{r['trajectories']:>14}{r['us_per_trajectory']:>10.2f}"
                )
            print(f"{mode:<8}{p:<22} ratio us/traj largest/smallest B = {d['ratio_largest_vs_smallest']:.2f}")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit code."""
    seeds = list(range(args.seed, args.seed + max(1, args.seeds)))
    doc: dict[str, Any]
    if getattr(args, "bound", False):
        doc = run_bound(get_scenario(args.scenario), seeds)
        print(format_bound(doc))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"wrote {args.json}")
        if args.plot:
            plot_bound(doc, args.plot)
            print(f"wrote {args.plot}")
        return 0
    if args.sweep_m:
        doc = sweep_m(seeds)
        doc.update({"scenario": "skewed", "sweep": "num_minibatches", "seeds": seeds})
        print(f"sweep over M on skewed (medians over seeds {seeds}):")
        print(f"{'M':>4}{'policy':>24}{'arch_mean':>12}{'arch_p95':>10}{'reduction':>11}{'quota_viol':>11}{'1-1/M':>8}")
        for M, rep in doc["M"].items():
            for p, row in rep["policies"].items():
                print(
                    f"{M:>4}{p:>24}{_fmt(row['arch_staleness_mean']):>12}{_fmt(row['arch_staleness_p95']):>10}"
                    f"{_fmt(row['reduction_vs_train_batch']):>11}{_fmt(row['quota_violations']):>11}"
                    f"{1 - 1 / int(M):>8.3f}"
                )
        doc["scaling"] = run_scaling()
        _print_scaling(doc["scaling"])
        runs = None
    else:
        doc, runs = run_scenario(get_scenario(args.scenario), seeds)
        print(format_table(doc))
        if args.scaling:
            doc["scaling"] = run_scaling()
            _print_scaling(doc["scaling"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        if runs is None:
            _plot_sweep(doc, args.plot)
        else:
            plot(doc, runs, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _plot_sweep(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted(int(m) for m in doc["M"])
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for p in POLICY_NAMES:
        ax.plot(ms, [doc["M"][str(m)]["policies"][p]["arch_staleness_mean"] for m in ms], marker="o", label=p)
    ax.set_xlabel("M (mini-batches per train batch)")
    ax.set_ylabel("mean architectural staleness")
    ax.set_xticks(ms)
    ax.legend(fontsize=7)
    ax.set_title("skewed: staleness vs M")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



#: The scenarios ``python benchmarks/admission.py`` runs.
SCRIPT_SCENARIOS = ("skewed", "balanced", "codeagent", "oversampled")


def main(argv: Sequence[str] | None = None) -> int:
    """``python benchmarks/admission.py``: every scenario of :data:`SCRIPT_SCENARIOS`, then the M sweep.

    Args:
        argv: Arguments (default: the command line): ``--seeds N`` (default 5), ``--out DIR``.

    Returns:
        The exit code (non-zero when any run failed).
    """
    from benchmarks.common.cli import RESULTS

    ap = argparse.ArgumentParser(description="Admission benchmark over every named scenario and the M sweep.")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=RESULTS)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    jobs = [(["--scenario", name], f"admission_{name}") for name in SCRIPT_SCENARIOS] + [(["--sweep-m"], "admission_sweep_m")]
    rc = 0
    for flags, stem in jobs:
        out = os.path.join(a.out, stem)
        rc |= run(parser.parse_args([*flags, "--seeds", str(a.seeds), "--json", out + ".json", "--plot", out + ".png"]))
    return rc


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("admission"))
