"""Benchmarks behind ``knitdata bench <name>``: each prints a table, writes JSON and (optionally) a plot.

Each module exposes ``add_arguments(parser)`` and ``run(args) -> int``; :func:`script_main` turns one into
the thin scripts of ``benchmarks/``, which write into a results folder by default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from types import ModuleType

__all__ = ["script_main"]


def script_main(module: ModuleType, name: str, results_dir: str, argv: Sequence[str] | None = None) -> int:
    """Run benchmark ``module`` as a script: ``--json``/``--plot`` default to ``results_dir/<name>.json|png``.

    Args:
        module: A ``knitdata.bench`` module (``add_arguments``, ``run``).
        name: The file stem of its results.
        results_dir: Folder of the default result files (created if missing).
        argv: Arguments (default: the command line).

    Returns:
        The benchmark's exit code.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    doc = (module.__doc__ or name).strip().splitlines()[0]
    parser = argparse.ArgumentParser(description=doc)
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    os.makedirs(results_dir, exist_ok=True)
    if getattr(args, "json", None) is None:
        args.json = os.path.join(results_dir, f"{name}.json")
    if getattr(args, "plot", "") is None:
        try:
            import matplotlib  # noqa: F401

            args.plot = os.path.join(results_dir, f"{name}.png")
        except ImportError:
            pass
    return int(module.run(args) or 0)
