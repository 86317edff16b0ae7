"""``python -m benchmarks journal``: the control plane's journal with and without compaction, side by side.

One workload, run with each setting (``--compact-every``, ``0`` = never): a
:class:`~knitdata.control.ControlPlane` with a :class:`~knitdata.control.journal.Journal` (metadata only, no
payloads, this process) receives ``--trajectories`` puts (one-round-trip puts of one trajectory: one ``admit_many`` call each; GRPO groups of ``--group-size``
over two sources), while ``--ranks`` consumers take and hand out every planned micro-batch (release ``step``)
and the trainer reports a new version every train batch: the calls a coordinator journals. The settings'
planes are driven call by call in turn, so the machine's load falls on all alike. Reported per setting: the
put rate while journaling (``fsync`` every second), the journal's size on disk (and the snapshot's) at the
end, the compactions made, their median time and their share of the put time, and the time to restart: open
the journal (a torn-tail check and a record count) and :meth:`~knitdata.control.ControlPlane.recover` a fresh
plane from it (median of ``--repeats``, interleaved too), with the records replayed; plus the load average.
Recovered planes are checked to equal the one that ran.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/journal.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import shutil
import statistics
import tempfile
import time
from typing import Any

from benchmarks.common.output import write_json

__all__ = ["add_arguments", "run", "run_settings", "plane_config"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks journal``."""
    parser.add_argument("--trajectories", type=int, default=100_000, help="puts in the workload")
    parser.add_argument("--compact-every", type=int, nargs="+", default=[0, 10_000],
                        help="journal records between compactions, one setting each (0: never)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4, help="consumer ranks (2 nodes)")
    parser.add_argument("--repeats", type=int, default=3, help="recoveries timed per setting; the median is reported")
    parser.add_argument("--dir", default=None, help="where the journals go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="(unused: no plot for this benchmark)")


def plane_config(group_size: int, ranks: int) -> dict[str, Any]:
    """The control plane's configuration: two sources of 64 trajectories per train batch, 2 mini-batches."""
    from knitdata.admission import BatchSpec
    from knitdata.placement import ConsumerLayout

    spec = BatchSpec({"math": 8 * group_size, "code": 8 * group_size}, num_minibatches=2, group_size=group_size)
    return {"spec": spec.to_dict(), "layout": ConsumerLayout.uniform(2, max(1, ranks // 2)).to_dict(),
            "token_budget": 4096, "release": "step"}


def _meta(i: int, group_size: int) -> dict[str, Any]:
    g = i // group_size
    return {"id": f"traj-{i:08d}", "source": ("math", "code")[g % 2], "group": f"group-{g:07d}", "gen_version": g // 16,
            "num_tokens": 256 + (i * 37) % 1024, "nbytes": 3072 + (i * 101) % 12288,
            "fields": {"scalars": ["reward"], "tensors": {"logprobs": "torch.float32"}}}


def _step(plane: Any, i: int, group_size: int, batch: int) -> None:
    """Put trajectory ``i`` (one :meth:`~knitdata.control.admit.Admission.admit_many` call: the one-round-trip put of
    one trajectory, on its group's unit); after each group, every rank takes what was planned; a new version per
    train batch."""
    unit = ("node0", "node1")[(i // group_size) % 2]
    plane.admission.admit_many(unit, [[_meta(i, group_size), 128, f"put-{i:08d}"]])
    if (i + 1) % group_size == 0:
        for rank in range(plane.state.layout.num_consumers):
            while True:
                entries = plane.leasing.next_entries(rank, plane.state.position[rank], 0.0).entries
                if not entries:
                    break
                for e in entries:
                    plane.positions.handed(rank, e.j, e.minibatch, e.microbatch)
    if (i + 1) % batch == 0:
        plane.positions.report_version(plane.state.version + 1)


def run_settings(directory: str, n: int, settings: list[int], group_size: int, ranks: int, repeats: int,
                 progress: Any = None) -> dict[str, dict[str, Any]]:
    """Run the workload once per compaction setting, interleaved call by call (the machine's load falls on
    every setting alike), then time restarts from each journal (interleaved too).

    Returns:
        Per setting: ``{"compact_every", "trajectories", "put_per_s", "journal_bytes", "snapshot_bytes",
        "journal_records", "compactions", "compact_ms_median", "compact_share", "restart_s", "restart_s_all",
        "open_s", "recover_s", "replayed", "equal"}`` (``compact_share``: the compactions' part of the put time).
    """
    from knitdata.control import ControlPlane
    from knitdata.control.journal import SNAPSHOT_SUFFIX, Journal

    cfg = plane_config(group_size, ranks)
    units = {"node0": "node0", "node1": "node1"}
    runs: list[dict[str, Any]] = []
    for every in settings:
        path = os.path.join(directory, f"every{every}.journal")
        for p in (path, path + SNAPSHOT_SUFFIX):
            if os.path.exists(p):
                os.remove(p)
        journal = Journal(path, compact_every=every)
        times: list[float] = []

        def timed(state: Any, inner: Any = journal.compact, times: list[float] = times) -> None:
            t = time.perf_counter()
            inner(state)
            times.append(time.perf_counter() - t)

        journal.compact = timed  # type: ignore[method-assign]
        plane = ControlPlane(cfg, units, lambda u, ids, wait: None, journal=journal)
        runs.append({"every": every, "path": path, "journal": journal, "plane": plane, "times": times, "put_s": 0.0})
    batch = sum(plane_config(group_size, ranks)["spec"]["quotas"].values())
    clock = time.perf_counter
    for i in range(n):
        for r in runs:
            t = clock()
            _step(r["plane"], i, group_size, batch)
            r["put_s"] += clock() - t
        if progress is not None and (i + 1) % 1000 == 0:
            progress.update(1000)
    for r in runs:
        r["journal"].close()
        r.update(want=r["plane"].state_dict(), restarts=[], opens=[], recovers=[], replayed=0, equal=True)
    for _ in range(max(1, repeats)):
        for r in runs:
            t = clock()
            j = Journal(r["path"], compact_every=r["every"])
            t1 = clock()
            fresh = ControlPlane(cfg, units, lambda u, ids, wait: None, journal=j)
            r["replayed"] = fresh.recover(r["path"])
            t2 = clock()
            j.close()
            r["opens"].append(t1 - t)
            r["recovers"].append(t2 - t1)
            r["restarts"].append(t2 - t)
            r["equal"] = r["equal"] and fresh.state_dict() == r["want"]
    out = {}
    for r in runs:
        path, times = r["path"], r["times"]
        snap = path + SNAPSHOT_SUFFIX
        out[str(r["every"])] = {
            "compact_every": r["every"], "trajectories": n, "put_per_s": n / r["put_s"],
            "journal_bytes": os.path.getsize(path),
            "snapshot_bytes": os.path.getsize(snap) if os.path.exists(snap) else 0,
            "journal_records": sum(1 for _ in Journal.read(path)), "compactions": len(times),
            "compact_ms_median": 1e3 * statistics.median(times) if times else 0.0,
            "compact_share": sum(times) / r["put_s"],
            "restart_s": statistics.median(r["restarts"]), "restart_s_all": r["restarts"],
            "open_s": statistics.median(r["opens"]), "recover_s": statistics.median(r["recovers"]),
            "replayed": r["replayed"], "equal": r["equal"],
        }
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks journal``; prints a table and writes ``--json``."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency of the benchmarks
        tqdm = None
    load0 = os.getloadavg()
    own = args.dir is None
    directory = tempfile.mkdtemp(prefix="knitdata-journal-") if own else args.dir
    os.makedirs(directory, exist_ok=True)
    try:
        bar = tqdm(total=args.trajectories, desc="puts (every setting)", unit="traj",
                   leave=False) if tqdm is not None else None
        try:
            results = run_settings(directory, args.trajectories, list(args.compact_every), args.group_size,
                                   args.ranks, args.repeats, bar)
        finally:
            if bar is not None:
                bar.close()
    finally:
        if own:
            shutil.rmtree(directory, ignore_errors=True)
    load1 = os.getloadavg()
    base = results.get("0")
    print(f"journal: {args.trajectories} trajectories (one admit_many call each), {args.ranks} ranks, groups of "
          f"{args.group_size}; restart = open + recover, median of {args.repeats}")
    head = (f"{'compact_every':>13} {'put/s':>8} {'journal MB':>11} {'snapshot MB':>12} {'records':>8} "
            f"{'compactions':>11} {'compact ms':>10} {'compact %':>9} {'restart s':>9} {'replayed':>9} {'equal':>5}")
    print(head)
    for every, r in results.items():
        print(f"{every:>13} {r['put_per_s']:>8.0f} {r['journal_bytes'] / 1e6:>11.2f} {r['snapshot_bytes'] / 1e6:>12.3f} "
              f"{r['journal_records']:>8} {r['compactions']:>11} {r['compact_ms_median']:>10.1f} "
              f"{100 * r['compact_share']:>9.2f} "
              f"{r['restart_s']:>9.3f} {r['replayed']:>9} {r['equal']!s:>5}")
    if base is not None:
        for every, r in results.items():
            if every != "0":
                print(f"compact_every={every} vs none: journal bytes x{r['journal_bytes'] / base['journal_bytes']:.4f}, "
                      f"restart x{r['restart_s'] / base['restart_s']:.4f}, put rate "
                      f"x{r['put_per_s'] / base['put_per_s']:.3f}")
    print(f"load average: start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, "
          f"end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    report = {"benchmark": "journal", "trajectories": args.trajectories, "group_size": args.group_size,
              "ranks": args.ranks, "repeats": args.repeats, "settings": results,
              "loadavg_start": list(load0), "loadavg_end": list(load1), "cpus": os.cpu_count()}
    if args.json:
        write_json(args.json, report, indent=1)
    return 0 if all(r["equal"] for r in results.values()) else 1


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("journal"))
