"""Placement benchmark: cross-node bytes, consumer-aware placement against ``index % units``, on Ray.

Starts a local 3-node ``ray.cluster_utils.Cluster`` (127.0.0.1 only, dashboard off), runs one workload
through both placements and writes benchmarks/results/placement.json and placement.png. Usage:
``python benchmarks/placement.py [--fetch iter]``. The logic lives in :mod:`knitdata.bench.placement`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import placement  # noqa: E402

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the placement benchmark and write its results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    placement.add_arguments(parser)
    out = Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    args = parser.parse_args(argv)
    if args.json is None:
        args.json = str(out / "placement.json")
    if args.plot is None:
        args.plot = str(out / "placement.png")
    return placement.run(args)


if __name__ == "__main__":
    sys.exit(main())
