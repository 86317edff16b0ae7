"""``knitdata bench control``: a tiny ``--scale`` smoke run (figures are not asserted, only their shape)."""

from __future__ import annotations

import json

from benchmarks.control import make_admitted, plan_quality
from knitdata.cli import main
from knitdata.placement import ConsumerLayout
from knitdata.planner import Planner


def test_scale_smoke_writes_plan_ms_and_quality(tmp_path, capsys) -> None:
    out = tmp_path / "control_scale.json"
    rc = main([
        "bench", "control", "--scale", "--trajectories", "48", "96", "--nodes", "4", "--ranks-per-node", "2",
        "--ref-ranks", "4", "--repeats", "2", "--json", str(out),
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["scale"]) == {"8", "4"}
    for by_n in report["scale"].values():
        assert set(by_n) == {"48", "96"}
        for point in by_n.values():
            assert point["plan_ms"] > 0 and point["plan_ms_min"] <= point["plan_ms"]
            assert point["max_over_mean_tokens"] >= 1.0
            assert 0.0 <= point["cross_node_bytes_fraction"] <= 1.0
            assert point["microbatches_per_rank"] >= 1
    assert len(report["loadavg_start"]) == 3
    ref = report["machine_reference"]  # the machine's speed, timed between the plans
    assert 0 < ref["ms_min"] <= ref["ms_median"] <= ref["ms_max"] and ref["work"]
    text = capsys.readouterr().out
    assert "plan_ms" in text and "load average" in text and "machine speed" in text


def test_engine_part_smoke_on_the_embedded_engine(tmp_path, capsys) -> None:
    out = tmp_path / "control.json"
    rc = main(["bench", "control", "--engines", "embedded", "--producers", "1", "2", "--sizes", "1KiB",
               "--batches", "1", "8", "--total-1k", "64", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    for n in ("1", "2"):
        point = report["engines"]["embedded"]["producers"][n]["1KiB"]
        assert point["traj_per_s"] > 0 and 0 < point["p50_ms"] <= point["p99_ms"]
        assert point["put"]["admitted"] == 64 and point["put_many_8"]["admitted"] == 64 and not point["put"]["errors"]
    assert report["trainer_data_ms_per_step"]["embedded"] > 0
    assert report["coordinator_cpu_ms_per_traj"]["embedded"] is None  # in-process: no coordinator process
    assert "trainer data time per step" in capsys.readouterr().out


def test_workload_is_whole_groups_with_interleaved_arrivals() -> None:
    layout = ConsumerLayout.uniform(3, 2)
    adm = make_admitted(60, 4, list(layout.nodes), seed=1)
    metas = adm.trajectories
    assert len(metas) == 60 and len({m.id for m in metas}) == 60
    groups = [m.group for m in metas]
    runs = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
    assert len(runs) == len(set(groups)) == 15  # each group is one contiguous run
    assert sorted(m.seq for m in metas) == list(range(60))
    assert [m.seq for m in metas] != sorted(m.seq for m in metas)  # arrivals interleave across groups
    assert adm.group_sizes == (4,) * 15  # as admission hands them to the planner
    for g in set(groups):  # a group's members in arrival order, as admission lists them
        seqs = [m.seq for m in metas if m.group == g]
        assert seqs == sorted(seqs)
    plan = Planner(layout, 4096).plan(adm)
    q = plan_quality(plan)
    assert sum(plan.share_tokens()) == sum(m.num_tokens for m in metas)
    assert q["max_over_mean_tokens"] >= 1.0 and 0.0 <= q["cross_node_bytes_fraction"] <= 1.0
