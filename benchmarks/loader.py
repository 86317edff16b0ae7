"""Benchmark script: ``python benchmarks/loader.py [options]`` (the same as ``knitdata bench loader``).

Writes ``benchmarks/results/loader.json`` and ``benchmarks/results/loader.png`` unless ``--json`` / ``--plot`` say otherwise;
``--help`` lists the options.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import loader, script_main  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    sys.exit(script_main(loader, "loader", RESULTS))
