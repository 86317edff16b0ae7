"""The ``knitdata`` command: ``knitdata demo`` and ``knitdata bench <name>``, from a checkout; ``knitdata status``
and ``knitdata trace``.

``knitdata status --address ADDR --name NAME [--watch]`` prints a running Ray pipeline's status table
(:mod:`knitdata.observe.monitor`); it is part of the installed library.

``knitdata trace PATH [--plot OUT.png] [--out MERGED.json]`` merges the part files of a run's trace
(:mod:`knitdata.observe.trace`) into ``PATH`` (or ``--out``) and can draw the run's timeline; it needs no checkout.

The demo and the benchmarks are not part of the installed library: they live in the repository's top-level
``benchmarks`` package (``python -m benchmarks <name>``). Run from a checkout (an editable install, or with the
repository root as the working directory), this command forwards to it; elsewhere it exits with status 2 and a
one-line message.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Sequence
from types import ModuleType

__all__ = ["main", "build_parser", "find_benchmarks", "status_main", "build_status_parser", "trace_main"]

_MISSING = ("the benchmarks and the demo are not part of the installed package: from a checkout of the repository, "
            "run `python -m benchmarks {name}`")


def _import_cli() -> ModuleType | None:
    try:
        mod = importlib.import_module("benchmarks.common.cli")
    except ModuleNotFoundError as e:
        if e.name and (e.name == "benchmarks" or e.name.startswith("benchmarks.")):
            return None
        raise
    return mod if hasattr(sys.modules["benchmarks"], "BENCHMARKS") else None


def find_benchmarks() -> ModuleType | None:
    """The ``benchmarks.common.cli`` module of the checkout this command runs from, or ``None``.

    ``benchmarks`` is looked up on ``sys.path`` (the working directory under ``python -m knitdata``), then beside
    the ``knitdata`` package this module belongs to (an editable install of a checkout); found there, the
    checkout's root is put first on ``sys.path`` and on ``PYTHONPATH`` (for the processes a benchmark starts).
    """
    found = _import_cli()
    if found is not None:
        return found
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "benchmarks", "__init__.py")):
        return None
    sys.modules.pop("benchmarks", None)
    sys.path.insert(0, root)
    # and in the processes a benchmark starts (subprocesses, Ray workers), which do not inherit sys.path
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    return _import_cli()


def build_parser() -> argparse.ArgumentParser:
    """The parser of the top level: ``knitdata demo [...]`` and ``knitdata bench <name> [...]``."""
    parser = argparse.ArgumentParser(
        prog="knitdata",
        description="knitdata: move RL trajectories from rollout to training (admission, on-demand access, "
        "multimodal encoding deduplication). The demo and the benchmarks run from a checkout of the repository "
        "(the same as `python -m benchmarks demo|<name>`).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("demo", help="run the end-to-end demo on the embedded engine (no servers)", add_help=False)
    sub.add_parser("bench", help="run a benchmark (prints a table, writes JSON and a plot)", add_help=False)
    sub.add_parser("status", help="print a status table of a running Ray pipeline (--address, --name, --watch)",
                   add_help=False)
    tr = sub.add_parser("trace", help="merge a run's trace parts into one Chrome/Perfetto trace; --plot draws its "
                        "timeline (admission, delivery and compute per rank)")
    tr.add_argument("path", help="the trace path given to Pipeline(trace=...) or KNITDATA_TRACE")
    tr.add_argument("--out", default=None, help="write the merged trace here (default: PATH)")
    tr.add_argument("--plot", default=None, metavar="PNG", help="draw the timeline into this PNG (needs matplotlib)")
    tr.add_argument("--no-merge", action="store_true", help="PATH is a merged trace already: only plot it")
    return parser


def trace_main(argv: Sequence[str]) -> int:
    """``knitdata trace PATH [--out OUT] [--plot PNG] [--no-merge]``: merge, then plot; returns the exit code."""
    from knitdata.errors import KnitdataError
    from knitdata.observe import trace

    args = build_parser().parse_args(["trace", *argv])
    try:
        target = args.path
        if not args.no_merge:
            summary = trace.merge(args.path, args.out)
            target = summary["path"]
            print(f"{target}: {summary['events']} events from {summary['processes']} processes "
                  f"({summary['parts']} parts) over {summary['span_us'] / 1e6:.3f} s")
        if args.plot:
            tl = trace.plot(target, args.plot)
            print(f"{args.plot}: {len(tl['ranks'])} ranks, {len(tl['admissions'])} admissions")
    except KnitdataError as e:
        print(f"knitdata trace: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``knitdata`` command.

    Args:
        argv: Arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The process exit code: the command's, or 2 (no command, or no ``benchmarks`` package to forward to).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["status"]:  # part of the library (knitdata.observe.monitor), not of the checkout's benchmarks
        return status_main(argv[1:])
    if argv[:1] == ["trace"]:
        return trace_main(argv[1:])
    if argv[:1] not in (["demo"], ["bench"]):
        build_parser().parse_args(argv)  # --help exits here; an unknown command errors
        build_parser().print_help()
        return 2
    cli = find_benchmarks()
    if cli is None:
        name = "demo" if argv[0] == "demo" else (argv[1] if len(argv) > 1 and not argv[1].startswith("-") else "<name>")
        print(_MISSING.format(name=name), file=sys.stderr)
        return 2
    if argv[0] == "demo":
        return int(cli.main(argv, prog="knitdata"))
    return int(cli.main(argv[1:], prog="knitdata bench", demo=False))


def build_status_parser() -> argparse.ArgumentParser:
    """The parser of ``knitdata status``."""
    p = argparse.ArgumentParser(prog="knitdata status", description="Print a compact status table of a running "
                                "Ray-engine pipeline (per source, per rank, store, journal).")
    p.add_argument("--address", default=None, help="the Ray cluster's address (knitdata.ray_address() of the "
                   "creating process, or 'auto'); default: the Ray this machine runs")
    p.add_argument("--name", default="knitdata", help="the pipeline's name (engine_options['name'] of its creator)")
    p.add_argument("--watch", action="store_true", help="refresh the table every --interval seconds until Ctrl-C "
                   "or the pipeline closes")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch (default 2)")
    p.add_argument("--once", action="store_true", help="print once and exit (the default without --watch)")
    p.add_argument("--count", type=int, default=None, help="with --watch: stop after this many refreshes")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line per refresh")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to attach and per call (default 30)")
    return p


def status_main(argv: Sequence[str] | None = None) -> int:
    """``knitdata status``: attach to a running Ray pipeline and print its status table (once, or ``--watch``).

    Returns:
        0; 1 when the pipeline cannot be reached (the error on stderr).
    """
    args = build_status_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.interval <= 0:
        print("knitdata status: --interval must be positive", file=sys.stderr)
        return 2
    from knitdata.errors import KnitdataError
    from knitdata.observe.monitor import status_rows, status_table
    from knitdata.pipeline import Pipeline

    try:
        pipe = Pipeline.attach(args.name, address=args.address, timeout_s=args.timeout)
    except KnitdataError as e:
        print(f"knitdata status: cannot attach to pipeline {args.name!r}: {e}", file=sys.stderr)
        return 1
    watch = args.watch and not args.once
    n = 0
    try:
        while True:
            stats = {"name": args.name, **pipe.stats()}
            if args.json:
                print(json.dumps(status_rows(stats)), flush=True)
            else:
                if watch and sys.stdout.isatty():
                    print("\x1b[2J\x1b[H", end="")
                print(status_table(stats) + ("\n" if watch else ""), flush=True)
            n += 1
            if not watch or stats.get("closed") or (args.count is not None and n >= args.count):
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    except KnitdataError as e:
        print(f"knitdata status: pipeline {args.name!r}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
