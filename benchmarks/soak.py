"""Soak benchmark: a fast producer against slow, crashing consumers; nothing may be lost or duplicated.

``python -m benchmarks soak --seconds N [--json PATH] [--engine embedded|ray]`` runs a producer that puts
trajectories ``--speed-ratio`` times faster than the consumers (threads) can train on them, for ``N``
seconds, into a :class:`~knitdata.pipeline.Pipeline` with a small store capacity, so producers block on a
full store most of the time. Every consumer checkpoints its dataset's JSON state after each finished step and
"crashes" every ``--restart-every`` micro-batches: its dataset is discarded mid-iteration (prefetched
micro-batches are dropped) and a freshly built dataset resumes from the saved state.

Accounting (a :class:`Ledger`): a trajectory is *accepted* once ``put`` returned, *committed* once a consumer
finished the step of its micro-batch and saved a state past it. A micro-batch received after the last saved
state of a consumer that then crashed is *rolled back* (the trainer would restore its model from the same
checkpoint); receiving it again after the restore is a *re-delivery*, not a duplicate. At the end:

* ``lost`` = accepted trajectories never committed (must be 0);
* ``duplicated`` = commits beyond the first of a trajectory (must be 0);
* ``store_high_water_bytes`` against ``capacity_bytes`` (bound: capacity plus one trajectory, per unit);
* ``rss_growth_bytes``: the process's resident memory high-water after warm-up minus its value at warm-up
  (bound: capacity plus 64 MiB);
* ``throughput_per_s``: committed trajectories per second of wall time.

Payloads are checked on delivery (each trajectory's bytes are a function of its index), so a corrupted or
misrouted payload counts as an error. Nothing here asserts timings: the numbers are measured and reported.

``--engine ray --processes`` (:func:`run_soak_processes`, ``"mode": "cross_process"`` in the results) runs the
cross-process Ray engine: the driver creates the pipeline by name on a new local Ray (loopback), ``--producers``
producer processes and one process per consumer rank (``spawn``) attach with ``Pipeline.attach(name,
address=...)``. A consumer's crash is real: at the crash point the process SIGKILLs itself, and the driver
spawns a new process that restores the rank's dataset from the JSON state the dead one saved to disk (write and
rename, then ``commit``). Every worker appends its puts, commits and roll-backs to its own JSON-lines file
(flushed per line, so a SIGKILL loses nothing written); the driver replays them into the same :class:`Ledger`.
With ``--kill-coordinator S`` the coordinator actor is SIGKILLed S seconds after it last came back (it
journals; Ray restarts it; ``coordinator_recovery_s`` is the time from a kill to its first answer). There,
``rss_growth_bytes`` is the growth of the summed proportional set size (PSS) of the driver and the worker
processes after warm-up (a process being replaced counts with its last value; Ray's processes and object
store are not counted; the store is ``store_high_water_bytes``), and ``rss_growth_driver_bytes`` the driver's.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/soak.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
from typing import Any

import torch

from benchmarks.common.soak_core import (
    CRASH_POINTS,
    RSS_SLACK_BYTES,
    Ledger,
    RssSampler,
    SoakConfig,
    check_soak_payload,
    consume_with_restarts,
    make_soak_traj,
    run_soak,
)
from benchmarks.common.soak_processes import run_soak_processes
from benchmarks.common.soak_reshape import run_soak_reshape
from knitdata.errors import ConfigError, EngineError, OptionalDependencyError

__all__ = [
    "format_table",
    "plot_timeline",
    "add_arguments",
    "summarize_runs",
    "run",
    "SoakConfig",
    "Ledger",
    "RssSampler",
    "make_soak_traj",
    "consume_with_restarts",
    "check_soak_payload",
    "run_soak",
    "run_soak_processes",
    "run_soak_reshape",
    "run_reshape",
    "CRASH_POINTS",
    "RSS_SLACK_BYTES",
]


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table of soak results, one column per engine."""
    rows = [
        ("seconds", lambda r: f"{r['seconds']:.1f}"),
        ("trajectories delivered", lambda r: str(r["trajectories"])),
        ("throughput (traj/s)", lambda r: f"{r['throughput_per_s']:.1f}"),
        ("lost", lambda r: str(r["lost"])),
        ("duplicated", lambda r: str(r["duplicated"])),
        ("corrupt payloads", lambda r: str(r["corrupt"])),
        ("consumer restarts", lambda r: str(r["restarts"])),
        ("re-delivered after restore", lambda r: str(r["redelivered_after_restore"])),
        ("store capacity", lambda r: _mib(r["capacity_bytes"])),
        ("store high-water", lambda r: _mib(r["store_high_water_bytes"])),
        ("  bound (cap + 1 traj)", lambda r: _mib(r["store_bound_bytes"])),
        ("RSS growth after warm-up", lambda r: _mib(r["rss_growth_bytes"])),
        ("  bound (cap + 64 MiB)", lambda r: _mib(r["rss_bound_bytes"])),
        ("producer blocked (s)", lambda r: f"{r['store_put_wait_s']:.1f}"),
        ("coordinator kills", lambda r: str(r.get("coordinator_restarts", 0))),
        ("errors", lambda r: str(len(r["errors"]))),
        ("ok", lambda r: "yes" if r["ok"] else "NO"),
    ]
    header = ["metric"] + [r.get("label", r["engine"]) for r in results]
    body = [[name] + [fmt(r) for r in results] for name, fmt in rows]
    widths = [max(len(str(x[i])) for x in [header] + body) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(header, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


def plot_timeline(results: list[dict[str, Any]], path: str) -> None:
    """Plot store use and RSS over time, one line per engine (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise OptionalDependencyError("matplotlib", "plot", "the soak plot (--plot)") from e
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        tl = r["timeline"]
        if not tl:
            continue
        t = [p[0] for p in tl]
        name = r.get("label", r["engine"])
        mem = "PSS growth (driver + workers)" if r.get("mode") == "cross_process" else "RSS growth"
        ax1.plot(t, [p[1] / 2**20 for p in tl], label=f"{name} store used")
        ax1.axhline(r["store_bound_bytes"] / 2**20, linestyle="--", linewidth=1, label=f"{name} bound")
        base = r["rss_baseline_bytes"] or tl[0][2]
        ax2.plot(t, [(p[2] - base) / 2**20 for p in tl], label=f"{name} {mem}")
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("MiB")
    ax1.set_title("store bytes held (capacity + 1 trajectory bound)")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("MiB since warm-up")
    ax2.set_title("memory growth after warm-up")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Command-line options of ``python -m benchmarks soak``."""
    d = SoakConfig()
    parser.add_argument("--seconds", type=float, default=d.seconds, help="how long the producer runs")
    parser.add_argument("--engine", choices=("embedded", "ray", "all"), default="embedded",
                        help="engine to soak; 'all' runs embedded and, when installed and available, ray")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="write a plot of store use and RSS over time here (matplotlib)")
    parser.add_argument("--consumers", type=int, default=d.num_consumers)
    parser.add_argument("--traj-kib", type=int, default=d.traj_bytes // 1024, help="payload KiB per trajectory")
    parser.add_argument("--capacity-mib", type=float, default=None,
                        help=f"store capacity per unit (default {d.capacity_trajectories} trajectories)")
    parser.add_argument("--consume-ms", type=float, default=d.consume_s * 1000,
                        help="consumer time per trajectory (ms)")
    parser.add_argument("--speed-ratio", type=float, default=d.speed_ratio,
                        help="producer rate over the consumers' total rate")
    parser.add_argument("--restart-every", type=int, default=d.restart_every,
                        help="each consumer crashes and restores from its saved state every N micro-batches (0: never)")
    parser.add_argument("--crash-point", choices=CRASH_POINTS, default=d.crash_point)
    parser.add_argument("--fetch", choices=("sample", "eager", "iter"), default=d.fetch)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    parser.add_argument("--kill-coordinator", type=float, nargs="?", const=3.0, default=None, metavar="SECONDS",
                        help="Ray engine: SIGKILL the coordinator every SECONDS (default 3) while the soak runs; it "
                        "journals, Ray restarts it and it replays the journal (reports coordinator_restarts); "
                        "with --processes the next kill comes SECONDS after the coordinator answered again")
    parser.add_argument("--processes", action="store_true",
                        help="Ray engine: producers and consumers in their own processes (Pipeline.attach); a consumer "
                        "restart SIGKILLs its process, and a new one restores from the JSON state saved on disk")
    parser.add_argument("--producers", type=int, default=1, help="producer processes (with --processes)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="most consumer process restarts per rank (with --processes; default: no limit)")
    parser.add_argument("--max-kills", type=int, default=None,
                        help="most coordinator kills (with --processes and --kill-coordinator; default: no limit)")
    parser.add_argument("--reshape", action="store_true",
                        help="whole-pipeline checkpoints: SIGKILL the whole job (embedded engine, one process) at random "
                        "points, restore it from its last pipe.checkpoint (every other round onto one node, then two; "
                        "every round onto another number of ranks: --consumers, twice as many, one more), reissue the prompts in flight; reports lost, duplicated and reissued prompts "
                        "(results: soak_reshape.json)")
    parser.add_argument("--rounds", type=int, default=4, help="with --reshape: jobs killed before the last one")
    parser.add_argument("--prompts", type=int, default=240, help="with --reshape: prompts (groups of 2) of the run")
    parser.add_argument("--kill-within", type=float, default=2.5,
                        help="with --reshape: each killed job dies at a random point within this many seconds after "
                        "its first checkpoint")
    parser.add_argument("--dir", default=None, help="with --reshape: working directory (default: a temporary one)")
    parser.add_argument("--control", action="store_true",
                        help="with --processes: first run the same cross-process soak without faults (no consumer "
                        "restarts, no coordinator kills), reported side by side")


def _config(args: argparse.Namespace, engine: str) -> SoakConfig:
    return SoakConfig(
        seconds=args.seconds,
        engine=engine,
        num_consumers=args.consumers,
        traj_bytes=args.traj_kib * 1024,
        capacity_bytes=None if args.capacity_mib is None else int(args.capacity_mib * 2**20),
        consume_s=args.consume_ms / 1000,
        speed_ratio=args.speed_ratio,
        restart_every=args.restart_every,
        crash_point=args.crash_point,
        fetch=args.fetch,
        seed=args.seed,
    )


def summarize_runs(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON payload of one command: the run itself, or ``{"runs": [...]}`` with top-level keys summing up.

    The summary keys: ``lost``, ``duplicated``, ``unexpected``, ``coordinator_restarts`` (sums),
    ``store_high_water_bytes``, ``rss_growth_bytes``, ``capacity_bytes`` (maxima), ``throughput_per_s`` (the
    minimum), ``mode`` when every run has the same, and for cross-process runs ``producer_processes``,
    ``consumer_processes`` (maxima) and ``consumer_process_restarts`` (sum).
    """
    if len(results) == 1:
        return dict(results[0])
    payload: dict[str, Any] = {"runs": results}
    payload.update({
        "lost": sum(r["lost"] for r in results),
        "duplicated": sum(r["duplicated"] for r in results),
        "unexpected": sum(r["unexpected"] for r in results),
        "coordinator_restarts": sum(r.get("coordinator_restarts", 0) for r in results),
        "store_high_water_bytes": max(r["store_high_water_bytes"] for r in results),
        "rss_growth_bytes": max(r["rss_growth_bytes"] for r in results),
        "capacity_bytes": max(r["capacity_bytes"] for r in results),
        "throughput_per_s": min(r["throughput_per_s"] for r in results),
    })
    modes = {r.get("mode") for r in results}
    if len(modes) == 1:
        payload["mode"] = next(iter(modes))
    xp = [r for r in results if r.get("mode") == "cross_process"]
    if xp:
        payload.update({
            "producer_processes": max(r["producer_processes"] for r in xp),
            "consumer_processes": max(r["consumer_processes"] for r in xp),
            "consumer_process_restarts": sum(r["consumer_process_restarts"] for r in xp),
        })
    return payload


def run_reshape(args: argparse.Namespace) -> int:
    """``--reshape``: kill and restore whole jobs (:func:`run_soak_reshape`); print, write JSON; exit 1 unless ok."""
    import tempfile

    work = args.dir or tempfile.mkdtemp(prefix="knitdata-soak-reshape-")
    r = run_soak_reshape(work, rounds=args.rounds, prompts=args.prompts, ranks=args.consumers, seed=args.seed,
                         kill_after_s=(0.0, args.kill_within))
    r["loadavg"] = list(os.getloadavg())
    print(f"soak --reshape: {r['jobs']} jobs ({r['kills']} killed with SIGKILL, {r['restores_other_topology']} "
          f"restored onto other nodes, {r['restores_other_ranks']} onto another number of ranks), {r['prompts']} prompts x {r['group_size']}: lost {r['lost']}, duplicated "
          f"{r['duplicated']}, reissued {r['reissued']} prompts (mismatches {len(r['reissue_mismatch'])}), "
          f"{r['rolled_back_microbatches']} micro-batches rolled back, checkpoint pause max "
          f"{r['checkpoint_pause_ms_max'] or 0:.2f} ms, {'ok' if r['ok'] else 'NOT OK'}")
    for err in r["errors"][:5]:
        print(f"error: {err}")
    if args.json:
        path = args.json
        if os.path.basename(path) == "soak.json":  # the default of `python benchmarks/soak.py`: keep soak.json
            path = os.path.join(os.path.dirname(path), "soak_reshape.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(r, f, indent=2)
        print(f"wrote {path}")
    return 0 if r["ok"] else 1


def run(args: argparse.Namespace) -> int:
    """Run the soak(s), print a table, write JSON; exit 1 if anything was lost, duplicated or unbounded."""
    torch.set_num_threads(1)
    if getattr(args, "reshape", False):
        return run_reshape(args)
    engines = ["embedded", "ray"] if args.engine == "all" else [args.engine]
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    processes = getattr(args, "processes", False)
    if processes and args.engine != "ray":
        raise ConfigError(f"--processes runs the Ray engine across processes: use --engine ray, not {args.engine!r}")
    for engine in engines:
        try:
            if processes and getattr(args, "control", False):
                quiet = _config(args, engine)
                quiet.restart_every = 0
                results.append(run_soak_processes(quiet, num_producers=args.producers, progress=not args.no_progress,
                                                  label="ray (processes, no faults)"))
            if processes:
                results.append(run_soak_processes(
                    _config(args, engine), num_producers=args.producers, progress=not args.no_progress,
                    kill_coordinator_every_s=args.kill_coordinator, max_coordinator_kills=args.max_kills,
                    max_consumer_restarts=args.max_restarts))
                continue
            results.append(run_soak(_config(args, engine), progress=not args.no_progress,
                                    kill_coordinator_every_s=args.kill_coordinator if engine == "ray" else None))
        except (EngineError, OptionalDependencyError) as e:
            if args.engine != "all":
                raise
            skipped[engine] = str(e)
    print(format_table(results))
    for r in results:
        if r.get("mode") == "cross_process":
            rec, back = r["coordinator_recovery_median_s"], r["consumer_restore_median_s"]
            print(f"{r['label']}: {r['producer_processes']} producer and {r['consumer_processes']} consumer processes "
                  f"({r['consumer_process_restarts']} consumer process restarts, SIGKILL to the new process's first "
                  f"micro-batch median {'-' if back is None else f'{back:.2f} s'}), start-up {r['startup_s']:.1f} s, "
                  f"coordinator recovery median {'-' if rec is None else f'{rec:.2f} s'}; memory growth = "
                  f"{r['rss_measure']}; driver alone {_mib(r['rss_growth_driver_bytes'])}; "
                  f"load average {', '.join(f'{x:.2f}' for x in r['loadavg'])}")
    for engine, why in skipped.items():
        print(f"{engine}: skipped ({why})")
    for r in results:
        for err in r["errors"][:5]:
            print(f"{r.get('label', r['engine'])} error: {err}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        payload = summarize_runs(results)
        payload["skipped"] = skipped
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")
    if getattr(args, "plot", None) and results:
        plot_timeline(results, args.plot)
        print(f"wrote {args.plot}")
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("soak"))
