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


_WRONG = '''
from knitdata import Pipeline
from knitdata.engines.base import Engine
from knitdata.engines.ray.control import RayControl


def calls(pipe: Pipeline, engine: Engine, ray_control: RayControl) -> None:
    pipe.internals.control.positions.comit(0, 1, 0)  # misspelt call
    engine.control.positions.commit(0, "1", 0)  # wrong argument type
    engine.control.commit(0, 1)  # not on a part
    ray_control.leasing.next_entry(0, 0, 1.0)  # misspelt on the Ray proxy
    ray_control.plumbing.info(1)  # plumbing, too many arguments
'''

_RIGHT = '''
from knitdata import Pipeline
from knitdata.engines.base import Engine
from knitdata.engines.ray.control import RayControl


def calls(pipe: Pipeline, engine: Engine, ray_control: RayControl) -> int:
    engine.control.leasing.next_entries(0, 0, 1.0, "tok", 0, 0)
    ray_control.plumbing.info()
    ray_control.reporting.report_transfer({"read": 0})
    return pipe.internals.control.positions.commit(0, 1, 0) + ray_control.positions.commit(0, 1, replica=0)
'''


def test_mypy_sees_the_control_surface(tmp_path: Path) -> None:
    """A control call is typed as the part it reaches, in process and on the Ray proxy: mypy rejects a misspelt
    call and wrong arguments, and accepts the right ones (only the snippets' own lines are judged)."""
    pytest.importorskip("mypy")
    wrong, right = tmp_path / "wrong_calls.py", tmp_path / "right_calls.py"
    wrong.write_text(_WRONG, encoding="utf-8")
    right.write_text(_RIGHT, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "setup.cfg"), str(wrong),
                           str(right)], cwd=ROOT, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    mine = [line for line in out.splitlines() if "_calls.py:" in line and ": error:" in line]
    assert not [line for line in mine if "right_calls.py" in line], out[-4000:]
    got = {int(line.split(":")[1]) for line in mine if "wrong_calls.py" in line}
    assert got == {8, 9, 10, 11, 12}, out[-4000:]
    assert '"Positions" has no attribute "comit"' in out and '"Leases" has no attribute "next_entry"' in out, out
