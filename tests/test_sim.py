"""Tests of benchmarks.sim: determinism, modeling rules, the real policies inside, benchmark plumbing."""

from __future__ import annotations

import json

import pytest

from benchmarks import admission as bench
from benchmarks.sim import POLICY_NAMES, SCENARIOS, Scenario, SourceParams, colocated_makespan, get_scenario, simulate
from knitdata.errors import ConfigError

SMALL = Scenario(
    "small",
    (SourceParams("fast", 32, 1.0, 0.3), SourceParams("slow", 32, 3.0, 1.0)),
    num_minibatches=4,
    group_size=4,
    slots=32,
    train_time=0.25,
    num_batches=3,
)


def test_scenarios_are_valid_and_skewed_is_fixed() -> None:
    sk = get_scenario("skewed")
    p = sk.params()
    assert (p["B"], p["group_size"], p["num_minibatches"], p["slots"], p["train_time"], p["num_batches"]) == (
        384,
        8,
        16,
        192,
        0.25,
        6,
    )
    assert [(s["mean"], s["sigma"], s["quota"]) for s in p["sources"]] == [
        (1.0, 0.3, 128),
        (2.0, 0.6, 128),
        (4.0, 1.0, 128),
    ]
    assert p["sync"] == "step" and p["partial"] is True
    assert set(SCENARIOS) >= {"balanced", "skewed", "codeagent", "oversampled"}
    json.dumps(p)
    with pytest.raises(ConfigError, match="unknown scenario"):
        get_scenario("nope")
    with pytest.raises(ConfigError):
        SMALL.with_(sync="sometimes")


def test_simulation_is_seeded_and_policies_share_durations() -> None:
    a = simulate(SMALL, "constraint_preserving", seed=3)
    b = simulate(SMALL, "constraint_preserving", seed=3)
    assert a.metrics == b.metrics and a.trajectories == b.trajectories
    tb = simulate(SMALL, "train_batch", seed=3)
    # same per-trajectory durations: the first batch's groups finish at the same times under every policy
    fin_a = sorted((t["group"], t["finish"]) for t in a.trajectories if t["group"].startswith("b0"))
    fin_b = sorted((t["group"], t["finish"]) for t in tb.trajectories if t["group"].startswith("b0"))
    assert fin_a == fin_b


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_records_and_staleness_definitions(policy: str) -> None:
    r = simulate(SMALL, policy, seed=1)
    spec = SMALL.spec()
    assert len(r.trajectories) == SMALL.num_batches * SMALL.batch_size
    assert len(r.minibatches) == SMALL.num_batches * SMALL.num_minibatches
    for t in r.trajectories:
        assert t["admit"] >= t["finish"]
        assert t["train_version"] >= t["gen_version"] >= 0
        assert t["version_mean"] >= t["gen_version"]
        assert t["train_version"] == r.minibatches[t["step"]]["train_version"]
        assert t["step"] % spec.num_minibatches == t["index"]
    # staleness counts the version before the mini-batch's own step: mini-batch j trains at version j
    assert [mb["train_version"] for mb in r.minibatches] == list(range(len(r.minibatches)))
    arch = [t["train_version"] - t["gen_version"] - t["index"] for t in r.trajectories]
    assert r.metrics["arch_staleness_mean"] == pytest.approx(sum(arch) / len(arch))
    assert r.metrics["quota_violations"] == 0


def test_train_batch_vs_minibatch_admission_back_of_envelope() -> None:
    """Rollout-bound with C = B: train-batch admission adds ~M steps of staleness, mini-batch admission ~1."""
    sc = SMALL.with_(slots=64, train_time=0.01)
    tb = simulate(sc, "train_batch", 0).metrics["arch_staleness_mean"]
    cp = simulate(sc, "constraint_preserving", 0).metrics["arch_staleness_mean"]
    M = sc.num_minibatches
    assert M - 1.5 <= tb <= M + 0.5
    assert cp <= 1.5 and cp < tb


def test_oversampled_fifo_breaks_quotas_cp_does_not() -> None:
    sc = get_scenario("oversampled").with_(num_batches=2)
    fifo = simulate(sc, "fifo", 0).metrics
    cp = simulate(sc, "constraint_preserving", 0)
    assert fifo["quota_violations"] > 0
    assert cp.metrics["quota_violations"] == 0 and cp.metrics["bound_violations"] == 0
    assert cp.metrics["trajectories_generated"] > sc.num_batches * sc.batch_size  # oversampled, some dropped


def test_restart_mode_and_batch_sync_run() -> None:
    r = simulate(SMALL.with_(partial=False, sync="batch"), "constraint_preserving", 0)
    assert all(t["version_mean"] == t["gen_version"] for t in r.trajectories)
    assert all(t["gen_version"] % SMALL.num_minibatches == 0 for t in r.trajectories)


def test_colocated_reference() -> None:
    assert colocated_makespan(SMALL, 0) > 0
    assert colocated_makespan(get_scenario("oversampled"), 0) is None


def test_bench_report_keys_and_plot(tmp_path) -> None:
    report, runs = bench.run_scenario(SMALL, seeds=[0, 1], progress=False)
    assert set(report) >= {"scenario", "params", "seeds", "policies"}
    assert set(report["policies"]) == {"train_batch", "fifo", "linear_target", "constraint_preserving"}
    for row in report["policies"].values():
        for k in (
            "arch_staleness_mean",
            "arch_staleness_p95",
            "raw_staleness_mean",
            "quota_violations",
            "bound_violations",
            "mean_admit_delay",
            "reduction_vs_train_batch",
            "arch_staleness_positive_mean",
            "reduction_positive_vs_train_batch",
            "share_negative",
        ):
            assert k in row
        assert 0.0 <= row["share_negative"] <= 1.0
        assert row["arch_staleness_positive_mean"] >= max(0.0, row["arch_staleness_mean"]) - 1e-12
    assert report["policies"]["train_batch"]["reduction_vs_train_batch"] == 0.0
    assert report["policies"]["train_batch"]["reduction_positive_vs_train_batch"] == 0.0
    json.dumps(report)
    assert "constraint_preserving" in bench.format_table(report)
    bench.plot(report, runs, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


def test_admission_cost_measurement_small() -> None:
    r = bench.admission_cost(1000, min_trajectories=2048)
    assert r["batch_size"] == 1024 and r["trajectories"] == 2048 and r["us_per_trajectory"] > 0


@pytest.mark.parametrize("on_stale", ["drop", "wait"])
def test_simulated_bound_keeps_eta_and_quotas(on_stale: str) -> None:
    """Issue 26.4 (simulated): with max_staleness the trainer never gets anything staler than eta, every train batch
    keeps its quotas (regeneration of what was dropped), and the report counts drops, waste and throughput."""
    r = simulate(SMALL, "constraint_preserving", seed=2, max_staleness=1, on_stale=on_stale)
    m = r.metrics
    assert all(t["train_version"] - t["gen_version"] <= 1 for t in r.trajectories)
    assert m["worst_staleness"] <= 1 and m["quota_violations"] == 0
    assert len(r.trajectories) == SMALL.num_batches * SMALL.batch_size
    assert 0 <= m["wasted_token_share"] < 1 and m["throughput"] > 0
    assert (m["dropped_groups"] > 0) == (m["wasted_token_share"] > 0)


def test_bench_bound_report(tmp_path) -> None:
    doc = bench.run_bound(SMALL, [0], etas=(1, 4))
    assert list(doc["regimes"]) == ["none", "bound_1_drop", "bound_1_wait", "bound_4_drop", "bound_4_wait"]
    for name, row in doc["regimes"].items():
        assert set(bench.BOUND_METRICS) <= set(row), name
        if name != "none":
            assert row["worst_staleness"] <= int(name.split("_")[1]) and row["quota_violations"] == 0
    assert doc["regimes"]["none"]["worst_staleness"] > 1  # the bound changed something
    json.dumps(doc)
    assert "bound_4_wait" in bench.format_bound(doc)
    pytest.importorskip("matplotlib")
    bench.plot_bound(doc, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 0
