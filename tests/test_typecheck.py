"""Type checking: mypy on the knitdata package and the benchmarks (settings in setup.cfg) passes, and the package ships ``py.typed``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_package_is_marked_typed() -> None:
    assert (ROOT / "knitdata" / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")


@pytest.mark.slow
def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", "knitdata", "benchmarks"], cwd=ROOT, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
