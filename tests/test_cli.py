"""Tests of the ``knitdata`` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from knitdata.cli import BENCHMARKS, main


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
