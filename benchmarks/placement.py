"""Benchmark script: ``python benchmarks/placement.py [options]`` (the same as ``knitdata bench placement``).

Writes ``benchmarks/results/placement.json`` and ``benchmarks/results/placement.png`` unless ``--json`` / ``--plot`` say otherwise;
``--help`` lists the options.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import placement, script_main  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    sys.exit(script_main(placement, "placement", RESULTS))
