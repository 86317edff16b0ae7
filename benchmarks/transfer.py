"""Transfer benchmark script: ``python benchmarks/transfer.py [--smoke] [--workload omni] [--gpu] [--steps N]``.

Thin wrapper around :mod:`knitdata.bench.transfer` (also ``knitdata bench transfer``): transferqueue (as verl
drives it, and at its best: async client prefetching or its streaming loader) vs knitdata ``sample`` / ``eager`` /
``iter`` (consumer processes, interleaved, then each alone) and ``iter`` on the embedded engine, with duplicated
and shared encoding. Writes ``benchmarks/results/transfer.json`` and ``.png`` unless ``--json`` / ``--plot`` say
otherwise (``transfer_omni.*`` with ``--workload omni``, ``transfer_gpu*`` with ``--gpu``, ``*_smoke`` with
``--smoke``).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import transfer  # noqa: E402

__all__ = ["main"]

_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the benchmark, write JSON and a plot into benchmarks/results/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    transfer.add_arguments(parser)
    args = parser.parse_args(argv)
    stem = "transfer" + ("_omni" if args.workload == "omni" else "") + ("_gpu" if args.gpu else "")
    stem += "_smoke" if args.smoke else ""
    if args.json is None:
        args.json = os.path.join(_RESULTS, f"{stem}.json")
    if args.plot is None:
        try:
            import matplotlib  # noqa: F401

            args.plot = os.path.join(_RESULTS, f"{stem}.png")
        except ImportError:
            pass
    return transfer.run(args)


if __name__ == "__main__":
    sys.exit(main())
