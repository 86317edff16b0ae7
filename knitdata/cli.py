"""The ``knitdata`` command: ``knitdata demo`` and ``knitdata bench <name>``.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
the command imports it only when asked, so optional extras stay optional.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser", "BENCHMARKS"]

#: Benchmark name -> (module, one-line help).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "admission": ("knitdata.bench.admission", "architectural staleness and quota violations per admission policy"),
    "transfer": ("knitdata.bench.transfer", "exposed transfer latency and step time: transferqueue, sample, eager, iter (--compute accel|cpu)"),
    "encode": ("knitdata.bench.encode", "duplicated vs deduplicated multimodal encoding"),
    "loader": ("knitdata.bench.loader", "loader overhead vs a plain torch DataLoader, and memcpy bandwidth"),
    "placement": ("knitdata.bench.placement", "cross-node bytes: consumer-aware placement vs index-mod-units (Ray)"),
    "soak": ("knitdata.bench.soak", "sustained load: throughput, memory high-water, lost/duplicated"),
    "learning": ("knitdata.bench.learning", "held-out reward per step of a small RL task trained through knitdata, per admission"),
    "vlm": ("knitdata.bench.vlm", "shared encoding on Qwen2.5-VL / Qwen2-Audio: model's own path vs fold/leaf/recompute"),
    "control": ("knitdata.bench.control", "control-plane throughput, put latency, commit cost; --scale: planning at cluster scale"),
    "journal": ("knitdata.bench.journal", "control-plane journal with and without compaction: bytes, restart time"),
}


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("knitdata"):
            return None
        raise


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """Build the argument parser.

    Only the module of the sub-command named in ``argv`` is imported (a benchmark's dependencies load
    only when it runs); the others are listed with their one-line help.

    Args:
        argv: The command line, used to pick which sub-command module to import.
    """
    parser = argparse.ArgumentParser(
        prog="knitdata",
        description="knitdata: move RL trajectories from rollout to training (admission, on-demand access, "
        "multimodal encoding deduplication).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = list(argv)
    demo = sub.add_parser("demo", help="run the end-to-end demo on the embedded engine (no servers)")
    if argv[:1] == ["demo"]:
        demo_mod = _load("knitdata.demo")
        if demo_mod is not None:
            demo_mod.add_arguments(demo)
            demo.set_defaults(_run=demo_mod.run)
    bench = sub.add_parser("bench", help="run a benchmark (prints a table, writes JSON and a plot)")
    bsub = bench.add_subparsers(dest="bench", metavar="NAME")
    for name, (module, help_) in BENCHMARKS.items():
        p = bsub.add_parser(name, help=help_, description=help_)
        if argv[:2] != ["bench", name]:
            continue
        mod = _load(module)
        if mod is None or not hasattr(mod, "add_arguments"):
            p.set_defaults(_run=lambda args, n=name: (print(f"benchmark {n!r} is not available in this build"), 2)[1])
            continue
        if mod.__doc__:
            p.description = mod.__doc__.strip()
            p.formatter_class = argparse.RawDescriptionHelpFormatter
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    def _bench_help(args: argparse.Namespace) -> int:
        bench.print_help()
        return 2

    bench.set_defaults(_run=_bench_help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``knitdata`` command.

    Args:
        argv: Arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The process exit code.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    return int(run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
