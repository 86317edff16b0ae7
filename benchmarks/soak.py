"""Soak benchmark script: ``python benchmarks/soak.py [--seconds N] [--engine embedded|ray|all]``.

Thin wrapper around :mod:`knitdata.bench.soak` (also ``knitdata bench soak``); writes
``benchmarks/results/soak.json`` and ``soak.png`` unless ``--json`` / ``--plot`` say otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import soak  # noqa: E402

__all__ = ["main"]

_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the soak, write JSON into benchmarks/results/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    soak.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.json is None:
        args.json = os.path.join(_RESULTS, "soak.json")
    if args.plot is None:
        try:
            import matplotlib  # noqa: F401

            args.plot = os.path.join(_RESULTS, "soak.png")
        except ImportError:
            pass
    return soak.run(args)


if __name__ == "__main__":
    sys.exit(main())
