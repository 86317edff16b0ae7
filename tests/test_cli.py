"""Tests of the ``knitdata`` command line, which forwards ``demo`` and ``bench <name>`` to the checkout's
``benchmarks`` package (``python -m benchmarks``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from benchmarks import BENCHMARKS
from knitdata.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_command_prints_help_and_fails(capsys) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_has_help(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"knitdata bench {name}" in out
    assert "--json" in out


def test_bench_without_name_lists_benchmarks(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in BENCHMARKS:
        assert name in out


def test_console_script_module_entry_point() -> None:
    out = subprocess.run([sys.executable, "-m", "knitdata", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "knitdata" in out.stdout


def test_python_m_benchmarks_lists_every_benchmark_and_the_demo() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for name in [*BENCHMARKS, "demo"]:
        assert name in out.stdout


def test_python_m_benchmarks_without_name_fails_with_help() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "transfer" in out.stdout


def test_driver_runs_as_a_script_from_elsewhere(tmp_path) -> None:
    """``python benchmarks/<name>.py`` imports the checkout's ``benchmarks`` package whatever the working directory."""
    script = os.path.join(ROOT, "benchmarks", "journal.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "--json" in out.stdout


def test_without_a_checkout_bench_and_demo_exit_2_with_one_line(tmp_path) -> None:
    """An installed knitdata without the repository: ``knitdata bench``/``demo`` say to run ``python -m benchmarks``."""
    pkg = tmp_path / "site" / "knitdata"
    shutil.copytree(os.path.join(ROOT, "knitdata"), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path / "site")
    for argv, name in ((["bench", "transfer", "--smoke"], "transfer"), (["demo"], "demo")):
        out = subprocess.run([sys.executable, "-m", "knitdata", *argv], capture_output=True, text=True, timeout=120,
                             cwd=str(tmp_path), env=env)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and f"python -m benchmarks {name}" in lines[0]


def test_console_script_forwards_from_any_directory(tmp_path) -> None:
    """The installed ``knitdata`` command of an editable checkout finds the checkout's ``benchmarks`` from anywhere."""
    exe = os.path.join(os.path.dirname(sys.executable), "knitdata")
    if not os.path.exists(exe):
        pytest.skip("the knitdata console script is not installed beside this interpreter")
    out = subprocess.run([exe, "bench", "journal", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "knitdata bench journal" in out.stdout and "--json" in out.stdout
