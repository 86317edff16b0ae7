"""Duplicated vs deduplicated multimodal encoding (DESIGN.md §7): writes benchmarks/results/encode.{json,png}.

Usage: ``python benchmarks/encode.py [--quick] [--group-sizes 1,4,8,16] [--no-rss]``; the same as
``knitdata bench encode --json benchmarks/results/encode.json --plot benchmarks/results/encode.png``.
"""

from __future__ import annotations

import argparse
import os
import sys

from knitdata.bench import encode

__all__ = ["main"]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with results written next to this script."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = argparse.ArgumentParser(description=encode.__doc__.strip().splitlines()[0])
    encode.add_arguments(parser)
    args = parser.parse_args(argv)
    args.json = args.json or os.path.join(RESULTS, "encode.json")
    args.plot = args.plot or os.path.join(RESULTS, "encode.png")
    return encode.run(args)


if __name__ == "__main__":
    sys.exit(main())
