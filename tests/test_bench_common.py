"""Tests of benchmarks/common: the command line recorded in results, strict JSON output, the script entry."""

from __future__ import annotations

import json
import math
import os

import pytest

from benchmarks.common import cli, output


def test_command_line_names_the_way_the_benchmark_was_started() -> None:
    main = os.path.join("repo", "benchmarks", "__main__.py")
    assert output.command_line([main, "transfer", "--smoke"]) == "python -m benchmarks transfer --smoke"
    assert output.command_line([os.path.join("knitdata", "__main__.py"), "bench", "soak"]) == "knitdata bench soak"
    assert output.command_line(["/venv/bin/knitdata", "bench", "loader"]) == "knitdata bench loader"
    assert output.command_line(["benchmarks/transfer.py", "--gpu"]) == "python benchmarks/transfer.py --gpu"


def test_strict_json_turns_nan_and_inf_into_null_and_tuples_into_lists() -> None:
    got = output.strict_json({"a": math.nan, 1: (1.0, math.inf), "b": [{"c": -math.inf}]})
    assert got == {"a": None, "1": [1.0, None], "b": [{"c": None}]}
    json.dumps(got, allow_nan=False)


def test_write_json_creates_the_folder_and_writes_strict_json(tmp_path, capsys) -> None:
    path = tmp_path / "deep" / "r.json"
    output.write_json(str(path), {"x": math.nan}, strict=True)
    assert json.loads(path.read_text()) == {"x": None}
    assert f"wrote {path}" in capsys.readouterr().out
    with pytest.raises(TypeError):  # not JSON at all
        output.write_json(str(path), {"x": object()}, strict=True)


def test_script_entry_defaults_results_into_the_results_folder(tmp_path, monkeypatch) -> None:
    """``python benchmarks/<name>.py`` writes ``<results>/<name>.json`` unless ``--json`` says otherwise."""
    seen = {}

    class Driver:
        __doc__ = "A driver."

        @staticmethod
        def add_arguments(parser) -> None:
            parser.add_argument("--json")
            parser.add_argument("--plot")

        @staticmethod
        def run(args) -> int:
            seen.update(vars(args))
            return 3

    assert cli.script_main(Driver, "thing", str(tmp_path / "results"), []) == 3  # type: ignore[arg-type]
    assert seen["json"] == str(tmp_path / "results" / "thing.json")
    assert (tmp_path / "results").is_dir()
    assert cli.script_main(Driver, "thing", str(tmp_path), ["--json", "x.json"]) == 3  # type: ignore[arg-type]
    assert seen["json"] == "x.json"
    assert cli.RESULTS.endswith(os.path.join("benchmarks", "results"))


def test_child_env_lets_a_child_import_benchmarks_from_any_directory(tmp_path) -> None:
    import subprocess
    import sys

    env = cli.child_env(OMP_NUM_THREADS="1")
    assert env["OMP_NUM_THREADS"] == "1"
    out = subprocess.run([sys.executable, "-c", "import benchmarks.common.cli as c; print(c.RESULTS)"], env=env,
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == cli.RESULTS


def test_transfer_script_default_result_names(monkeypatch) -> None:
    """``python benchmarks/transfer.py [flags]`` writes ``benchmarks/results/<stem>.json`` as before the move."""
    from benchmarks import transfer

    seen: dict[str, str] = {}
    monkeypatch.setattr(transfer, "run", lambda args: seen.update(json=args.json) or 0)
    cases = {
        (): "transfer_accel",
        ("--smoke",): "transfer_accel_smoke",
        ("--workload", "omni"): "transfer_omni_accel",
        ("--omni-seed-size",): "transfer_omni_seed_accel",
        ("--compute", "cpu"): "transfer",
        ("--compute", "cpu", "--workload", "omni"): "transfer_omni",
        ("--gpu",): "transfer_gpu",
    }
    for flags, stem in cases.items():
        assert transfer.main(list(flags)) == 0
        assert seen["json"] == os.path.join(cli.RESULTS, f"{stem}.json")
    assert transfer.main(["--json", "elsewhere.json"]) == 0 and seen["json"] == "elsewhere.json"


def test_admission_script_runs_every_scenario_then_the_sweep(tmp_path, monkeypatch) -> None:
    from benchmarks import admission

    runs: list[tuple[str | None, bool, int, str]] = []
    monkeypatch.setattr(admission, "run", lambda a: runs.append((None if a.sweep_m else a.scenario, a.sweep_m, a.seeds, a.json)) or 0)
    assert admission.main(["--seeds", "2", "--out", str(tmp_path)]) == 0
    names = [*admission.SCRIPT_SCENARIOS, "sweep_m"]
    assert [os.path.basename(r[3]) for r in runs] == [f"admission_{n}.json" for n in names]
    assert [r[0] for r in runs[:-1]] == list(admission.SCRIPT_SCENARIOS) and runs[-1][1] is True
    assert all(r[2] == 2 for r in runs)


def test_trace_ab_compares_off_on_and_off_again_and_counts_the_tracers_work() -> None:
    """compare() runs the measurement off, on and off again per round; the traced runs' events are the ones the
    measurement recorded, and the tracer's own CPU is reported beside the ratios."""
    import time

    from benchmarks.common.trace_ab import compare, format_line
    from knitdata.observe import trace as tracing

    seen: list[bool] = []

    def measure() -> None:
        tr = tracing.tracer
        seen.append(tr is not None)
        for i in range(25):
            if tr is not None:
                tr.span("work", "bench", tracing.now_us(), tracing.now_us(), {"i": i})
        time.sleep(0.002)

    doc = compare(measure, repeats=4, what="smoke")
    assert len(seen) == 3 * 5 and sum(seen) == 5  # one traced run per round, the warm-up round included
    assert len(doc["off_s"]) == len(doc["on_s"]) == len(doc["aa_s"]) == len(doc["ratio_per_repeat"]) == 4
    assert doc["recorded_per_traced_run"] == 25 and doc["events_per_traced_run"] == 25
    assert doc["write_cpu_ms_per_traced_run"] > 0 and 0 < doc["record_us_per_event"] < 1000
    lo, hi = doc["median_ratio_ci90"]
    assert lo <= doc["median_ratio"] <= hi and doc["met"] == (doc["median_ratio"] <= 1.03)
    assert tracing.tracer is None
    line = format_line(doc)
    assert "A/A" in line and "load average" in line
