"""Benchmark script: ``python benchmarks/learning.py [options]`` (the same as ``knitdata bench learning``).

Writes ``benchmarks/results/learning.json`` and ``benchmarks/results/learning.png`` unless ``--json`` / ``--plot``
say otherwise; ``--full`` runs the longer preset, ``--help`` lists the options.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import learning, script_main  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    sys.exit(script_main(learning, "learning", RESULTS))
