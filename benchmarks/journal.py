"""Benchmark script: ``python benchmarks/journal.py [options]`` (the same as ``knitdata bench journal``).

Writes ``benchmarks/results/journal.json`` unless ``--json`` says otherwise; ``--help`` lists the options.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import journal, script_main  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    sys.exit(script_main(journal, "journal", RESULTS))
