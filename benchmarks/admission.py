"""Admission benchmark over every named scenario, the M sweep and the admission-cost scaling.

Writes benchmarks/results/admission_<scenario>.json/.png, admission_sweep_m.json/.png. Usage:
``python benchmarks/admission.py [--seeds N]`` (default 5). The logic lives in :mod:`knitdata.bench.admission`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from knitdata.bench import admission  # noqa: E402

__all__ = ["main"]

SCENARIOS = ("skewed", "balanced", "codeagent", "oversampled")


def main(argv: list[str] | None = None) -> int:
    """Run the admission benchmarks and write their results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    parser = argparse.ArgumentParser()
    admission.add_arguments(parser)
    rc = 0
    for name in SCENARIOS:
        args = parser.parse_args(
            [
                "--scenario",
                name,
                "--seeds",
                str(a.seeds),
                "--json",
                str(out / f"admission_{name}.json"),
                "--plot",
                str(out / f"admission_{name}.png"),
            ]
        )
        rc |= admission.run(args)
    args = parser.parse_args(
        [
            "--sweep-m",
            "--seeds",
            str(a.seeds),
            "--json",
            str(out / "admission_sweep_m.json"),
            "--plot",
            str(out / "admission_sweep_m.png"),
        ]
    )
    rc |= admission.run(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
