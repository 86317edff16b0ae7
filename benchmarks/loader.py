"""Loader benchmark script: ``python benchmarks/loader.py [--quick]``.

Thin wrapper around :mod:`knitdata.bench.loader` (also ``knitdata bench loader``); writes
``benchmarks/results/loader.json`` and ``benchmarks/results/loader.png`` unless ``--json`` / ``--plot`` say
otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import loader  # noqa: E402

__all__ = ["main"]

_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the benchmark, write JSON and a plot into benchmarks/results/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    loader.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.json is None:
        args.json = os.path.join(_RESULTS, "loader.json")
    if args.plot is None:
        try:
            import matplotlib  # noqa: F401

            args.plot = os.path.join(_RESULTS, "loader.png")
        except ImportError:
            pass
    return loader.run(args)


if __name__ == "__main__":
    sys.exit(main())
