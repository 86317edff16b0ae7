"""Benchmark script: ``python benchmarks/soak.py [options]`` (the same as ``knitdata bench soak``).

Writes ``benchmarks/results/soak.json`` and ``benchmarks/results/soak.png`` unless ``--json`` / ``--plot`` say otherwise;
``--help`` lists the options.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import script_main, soak  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    sys.exit(script_main(soak, "soak", RESULTS))
