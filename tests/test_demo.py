"""Tests of benchmarks.demo: the end-to-end run on the embedded engine, and the CLI around it."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.demo import DemoConfig, format_report, replay_staleness, run_demo
from knitdata.admission import BatchSpec
from knitdata.cli import main
from knitdata.record import TrajectoryMeta

SMALL = DemoConfig(
    train_batches=2,
    sources=(("math", 0.02, 0.3), ("code", 0.06, 0.8)),
    quota=8,
    group_size=4,
    num_minibatches=2,
    rollout_slots=8,
    image_size=32,
    patch=16,
)


def test_demo_runs_end_to_end_and_writes_report_and_timeline(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    torch.set_num_threads(1)
    rep = run_demo(SMALL, out_dir=tmp_path, plot=True, progress=False)
    assert rep.trajectories == 2 * 16  # every trajectory of every train batch, exactly once (checked inside)
    assert rep.minibatches == 2 * 2 and len(rep.losses) == 4
    assert rep.encoder["work_ratio"] == pytest.approx(4.0)  # each image is shared by a group of 4
    assert rep.encoder["unique"] * 4 == rep.encoder["occurrences"]
    tb = rep.staleness["replay_train_batch"]["arch"]["mean"]
    cp = rep.staleness["replay_constraint_preserving"]["arch"]["mean"]
    assert cp <= tb
    png = tmp_path / "demo_timeline.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "demo_report.json").read_text())
    assert saved["trajectories"] == rep.trajectories
    text = format_report(rep)
    assert "exactly once" in text and "reduction vs train-batch admission" in text


def test_replay_train_batch_waits_for_the_whole_batch() -> None:
    spec = BatchSpec({"a": 2, "b": 2}, num_minibatches=2, group_size=1)
    metas = [TrajectoryMeta(id=f"t{i}", source="ab"[i % 2], group=f"g{i}") for i in range(4)]
    arrivals = [(0.0, float(i + 1), m) for i, m in enumerate(metas)]
    tb = replay_staleness(arrivals, spec, "train_batch", train_s=0.5)
    cp = replay_staleness(arrivals, spec, "constraint_preserving", train_s=0.5)
    # train-batch admission releases both mini-batches at t=4; the second gets colocated staleness 1 -> arch 0
    assert tb["raw"]["mean"] == pytest.approx(0.5)
    assert cp["admit_delay"]["mean"] < tb["admit_delay"]["mean"]


def test_cli_demo_runs(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    rc = main(["demo", "--train-batches", "1", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    assert "delivered exactly once" in capsys.readouterr().out


def test_cli_help_lists_commands(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out and "bench" in out
