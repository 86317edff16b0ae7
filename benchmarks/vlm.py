"""Benchmark script: ``python benchmarks/vlm.py [options]`` (the same as ``knitdata bench vlm``).

Writes ``benchmarks/results/vlm.json`` unless ``--json`` says otherwise;
``--help`` lists the options.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import script_main, vlm  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    sys.exit(script_main(vlm, "vlm", RESULTS))
