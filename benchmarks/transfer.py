"""Transfer benchmark script: ``python benchmarks/transfer.py [--compute accel|cpu] [--smoke] [--workload omni]
[--omni-seed-size] [--gpu] [--steps N]``.

Thin wrapper around :mod:`knitdata.bench.transfer` (also ``knitdata bench transfer``): transferqueue (as verl
drives it, and at its best: async client prefetching or its streaming loader) vs knitdata ``sample`` / ``eager`` /
``iter`` (consumer processes, interleaved, then each alone) and ``iter`` on the embedded engine, with duplicated
and shared encoding. ``--compute accel`` (the default) replaces each consumer's compute by a wait of its
calibrated cost (the data path, with the host CPU free as on a GPU node); ``--compute cpu`` trains on the CPU.
Writes ``benchmarks/results/<stem>.json`` and ``.png`` unless ``--json`` / ``--plot`` say otherwise, where the stem
is ``transfer``, then ``_omni`` with ``--workload omni`` (``_omni_seed`` with ``--omni-seed-size``), ``_accel``
with ``--compute accel`` (``_gpu`` with ``--gpu`` instead), ``_smoke`` with ``--smoke``: ``transfer_accel.json``,
``transfer_omni_accel.json``, ``transfer_omni_seed_accel.json``, and ``transfer.json``, ``transfer_omni.json``
for the CPU-compute mode.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import transfer  # noqa: E402

__all__ = ["main", "stem_of"]

_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def stem_of(args: argparse.Namespace) -> str:
    """The result files' name without extension, from the benchmark's arguments."""
    seed = bool(getattr(args, "omni_seed_size", False))
    stem = "transfer" + ("_omni" if args.workload == "omni" or seed else "") + ("_seed" if seed else "")
    if args.gpu:
        stem += "_gpu"
    elif getattr(args, "compute", "accel") == "accel":
        stem += "_accel"
    return stem + ("_smoke" if args.smoke else "")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the benchmark, write JSON and a plot into benchmarks/results/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    transfer.add_arguments(parser)
    args = parser.parse_args(argv)
    stem = stem_of(args)
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
