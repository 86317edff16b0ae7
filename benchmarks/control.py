"""Benchmark script: ``python benchmarks/control.py [options]`` (the same as ``knitdata bench control``).

Writes ``benchmarks/results/control.json`` (``benchmarks/results/control_scale.json`` with ``--scale``) unless
``--json`` says otherwise; ``--help`` lists the options.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import control, script_main  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    sys.exit(script_main(control, "control_scale" if "--scale" in sys.argv[1:] else "control", RESULTS))
