"""``python -m benchmarks trl --smoke`` end to end: the CLI runs, prints the table and writes the documented keys.

No timing is asserted (speed claims come from the benchmark itself): only the keys, that both variants ran on the
same data with the same gradients, that the shared variant encoded each image once, and the presets' parsing.
"""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("trl")

from benchmarks.trl import GPU_SHAPE, add_arguments, preset  # noqa: E402
from knitdata.cli import main  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_presets_parse():
    gpu = preset(_parse(["--gpu"]))
    assert gpu.device == "cuda" and gpu.dtype == "bfloat16" and gpu.shape == GPU_SHAPE
    assert gpu.resolutions == (448, 896) and gpu.groups == (4, 8, 16)
    cpu = preset(_parse(["--groups", "8", "--resolutions", "224,448", "--cycles", "3"]))
    assert cpu.device == "cpu" and cpu.groups == (8,) and cpu.resolutions == (224, 448) and cpu.cycles == 3
    with pytest.raises(SystemExit):
        _parse(["--gpu", "--smoke"])


def test_bench_trl_smoke_speed_writes_the_documented_keys(tmp_path, capsys):
    path, png = tmp_path / "trl.json", tmp_path / "trl.png"
    assert main(["bench", "trl", "--smoke", "--no-learning", "--json", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "load average" in out
    report = json.loads(path.read_text())
    (row,) = report["speed"]
    for key in ("group", "resolution", "rows_per_step", "vision_flop_share", "train_side_s", "generate_s", "speedup",
                "max_rel_grad_diff", "samples"):
        assert key in row, key
    assert set(row["train_side_s"]) == {"trl", "knitdata"} and row["speedup"] > 0
    assert row["max_rel_grad_diff"] < 1e-5  # float32: the same gradients as TRL alone
    stats = row["shared_encoding_stats"]
    assert stats["fallbacks"] == 0
    # no-grad passes: each image once per pass instead of once per completion
    assert stats["occurrences_nograd"] == row["group"] * stats["encoded_nograd"] > 0
    # one generation (2 prompts) spans two optimizer steps: each step encodes both images once and trains half the rows
    assert 2 * stats["occurrences_grad"] == row["group"] * stats["encoded_grad"] > 0
    assert report["config"]["model"]["vision_depth"] > 0 and "loadavg_before" in report
    assert png.stat().st_size > 0


@pytest.mark.slow
def test_bench_trl_smoke_learning_records_shares_and_staleness(tmp_path):
    path = tmp_path / "trl.json"
    assert main(["bench", "trl", "--smoke", "--no-speed", "--json", str(path)]) == 0
    learning = json.loads(path.read_text())["learning"]
    want = learning["target_share"]
    for name, run in learning["runs"].items():
        assert len(run["steps"]) == 2, name
        for step in run["steps"]:
            assert abs(sum(step["share"].values()) - 1) < 1e-9 and 0 <= step["reward"] <= 1
    for step in learning["runs"]["knitdata"]["steps"]:  # knitdata: every step holds exactly the quotas
        assert step["share"] == pytest.approx(want)
    assert learning["runs"]["knitdata"]["worst_staleness"] <= learning["config"]["max_staleness"]
