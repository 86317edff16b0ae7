"""Tests of the Ray engine (issue 6) on a local 3-node ``ray.cluster_utils.Cluster``.

The cluster runs in a subprocess shared by this module (started once: ~10-30 s on 2 cores), every scenario
in its own driver subprocess with a hard timeout (tests/_ray_helpers.py), so a Ray crash fails a test and
never takes pytest down. Every node is on 127.0.0.1 (checked), dashboards off.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ray_helpers import ClusterProcess, run_scenario  # noqa: E402

from knitdata.errors import OptionalDependencyError  # noqa: E402

ray = pytest.importorskip("ray")


# ------------------------------------------------------------------------------------ without a cluster
def test_import_without_ray_and_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in list(sys.modules):
        if mod == "ray" or mod.startswith("ray.") or (mod.startswith("knitdata.engines.ray.") and mod != "knitdata.engines.ray.metrics"):
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    import knitdata

    importlib.reload(knitdata)
    for name in ("knitdata.engines.ray.engine", "knitdata.engines.ray.unit"):
        with pytest.raises(OptionalDependencyError) as ei:
            importlib.import_module(name)
        assert ei.value.package == "ray" and ei.value.extra == "ray"
        assert "pip install 'knitdata[ray]'" in str(ei.value)
    importlib.import_module("knitdata.engines.ray.metrics")  # pure Python: no Ray needed
    from knitdata.admission import BatchSpec
    from knitdata.pipeline import Pipeline

    with pytest.raises(OptionalDependencyError):
        Pipeline(BatchSpec({"math": 2}, num_minibatches=1), engine="ray")


def test_transfer_meter_counts_and_merges() -> None:
    from knitdata.engines.ray.metrics import TransferMeter

    a, b = TransferMeter(), TransferMeter(max_steps=2)
    a.record_read(100, cross=True, mode="iter", placement="index_mod", step=0)
    a.record_read(50, cross=False, mode="iter", placement="index_mod", step=0)
    a.record_put(70, cross=True, placement="index_mod")
    b.record_read(10, cross=True, mode="eager", placement="consumer_aware", step=1)
    for s in range(3):
        b.record_read(1, cross=False, mode="eager", placement="consumer_aware", step=10 + s)
    assert len(b.to_dict()["steps"]) == 2  # bounded
    a.merge(json.loads(json.dumps(b.to_dict())))
    t = a.totals(placement="index_mod")
    assert t["read"] == {"reads": 2, "local_bytes": 50, "cross_bytes": 100, "cross_reads": 1}
    assert t["put"]["cross_bytes"] == 70
    assert a.totals(mode="eager")["read"]["cross_bytes"] == 10
    assert a.cross_bytes_per_step("index_mod", "iter") == {0: 100}


# ---------------------------------------------------------------------------------------- the cluster


def test_ray_engine_options_are_checked_before_any_ray_call() -> None:
    """Unknown Ray engine options and in-process-only features fail fast, naming what to do; no Ray is started."""
    from knitdata.admission import BatchSpec
    from knitdata.errors import ConfigError
    from knitdata.pipeline import Pipeline

    spec = BatchSpec({"math": 2}, num_minibatches=1)
    with pytest.raises(ConfigError, match="unknown Ray engine options"):
        Pipeline(spec, engine="ray", engine_options={"adress": "x"})
    with pytest.raises(ConfigError, match="on_plan"):
        Pipeline(spec, engine="ray", on_plan=lambda a, p: None)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def cluster() -> ClusterProcess:
    with ClusterProcess(nodes=3, cpus=2, store_mb=128, timeout_s=150) as c:
        assert c.info["ips"] == ["127.0.0.1"] * 3
        assert len(set(c.info["nodes"])) == 3
        yield c


def _flat(rows: list[list[str]]) -> list[str]:
    return [i for row in rows for i in row]


def test_a_control_call_without_ray_raises_instead_of_starting_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Ray shut down in this process a control call (a sender's heartbeat, a fire-and-forget call) raises a
    knitdata error naming the pipeline and the call, and reaches no actor: Ray's auto-init would start a new Ray
    from that thread, and Ray then ends the process."""
    ray = pytest.importorskip("ray")
    from knitdata.engines.ray.control import RayControl
    from knitdata.errors import EngineError

    sent: list[tuple] = []

    class _Method:
        def remote(self, *args: object) -> None:
            sent.append(args)

    class _Actor:
        call = call_waiting = _Method()

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    control = RayControl(_Actor(), "demo", timeout_s=1.0)
    with pytest.raises(EngineError, match=r"pipeline 'demo'.*ray\.shutdown\(\).*'report' was not sent"):
        control.leasing.report([], [], None, [])
    with pytest.raises(EngineError, match=r"'report_transfer' was not sent"):  # fire-and-forget
        control.reporting.report_transfer({})
    assert sent == []


def test_ray_shut_down_under_a_live_pipeline_ends_the_process_normally(cluster: ClusterProcess) -> None:
    """ray.shutdown() while a pipeline lives: the driver exits 0 (run_scenario checks it), its control calls raise."""
    r = run_scenario(cluster.address, "ray_shut_down_first", timeout_s=120)
    assert r["ray_up"] is False  # the heartbeats did not start a new Ray
    assert r["error"].startswith("pipeline 'shut-") and "Ray is not running in this process" in r["error"]
    assert "was not sent" in r["error"]  # (the flush of this process's reports that stats_light() sends first)


def test_units_zero_copy_backpressure_counters(cluster: ClusterProcess) -> None:
    r = run_scenario(cluster.address, "units_basic", timeout_s=150)
    assert r["node"] == r["nodes"][0]  # the driver runs on the head node
    assert r["equal"] == [True] * 8
    assert r["writable"] == [False] * 6  # read-only views of the object store: no copy on read
    read = r["meter"]["read"]["p/iter"]
    assert read["reads"] == 6 and read["cross_reads"] == 3  # u1's payloads live on the other node
    assert abs(read["cross_bytes"] - read["local_bytes"]) < 256  # equal-size records
    assert read["local_bytes"] > 3 * r["nbytes"][0]  # counted in record bytes (payload + header)
    assert r["full"] and 0.25 < r["waited"] < 5.0
    # spill-over: past its capacity a unit with a spill directory keeps the payload on disk, reloads on fetch
    assert r["spill_equal"] == [True, True]
    assert r["spill_stats"] == {"written_through": 2, "spilled_over": 1, "reloaded": 1}
    assert r["spill_used"] == r["nbytes"][2]  # only the in-memory payload counts against the capacity
    # Pipeline(engine="ray") in one process: units named by layout node, every trajectory delivered once
    assert r["inproc_unit_nodes"] == {"a": "a", "b": "b"}
    got = r["inproc"][0] + r["inproc"][1]
    assert sorted(got) == ["t0", "t1", "t2", "t3"]
    st = r["stats"]
    assert st["rejected_puts"] == 1 and st["puts"] == 2 and st["releases"] == 1
    assert st["high_water_bytes"] <= st["capacity_bytes"]


def test_exactly_once_across_nodes_and_placement_moves_fewer_bytes(cluster: ClusterProcess) -> None:
    r = run_scenario(cluster.address, "placement_nodes", timeout_s=300)
    all_ids = sorted(r["all_ids"])
    for p in ("consumer_aware", "index_mod"):
        res = r[p]["results"]
        got = [i for rank in res for i in _flat(rank["ids"])]
        assert sorted(got) == all_ids, p  # every trajectory once, over consumers on three nodes
        assert Counter(got).most_common(1)[0][1] == 1
        steps = [[tuple(x[:2]) for x in rank["infos"]] for rank in res]
        for s in steps:
            assert s == sorted(s)  # plan order
        # every rank steps through the same mini-batches with the same micro-batch count (no DDP hang)
        assert all([x[0] for x in rank["infos"]] == [x[0] for x in res[0]["infos"]] for rank in res)
        assert all([x[2] for x in rank["infos"]] == [x[2] for x in res[0]["infos"]] for rank in res)
        assert r[p]["committed"] == r[p]["planned"] and r[p]["held"] == 0
        assert all(u["used_bytes"] == 0 for u in r[p]["units"].values())  # committed -> released
        assert r["summary"]["placements"][p]["exactly_once"]
    s = r["summary"]["placements"]
    ca, im = s["consumer_aware"], s["index_mod"]
    assert im["read_cross_bytes"] > 0.5 * r["summary"]["payload_bytes"]  # ~2/3 with 3 nodes
    assert ca["read_cross_bytes"] <= 0.1 * im["read_cross_bytes"], (ca, im)  # >= 90% fewer bytes
    assert r["summary"]["cross_bytes_reduction"] >= 0.9
    # counted where read (from Ray) agrees with what the planner expected from the locations
    for row in (ca, im):
        assert abs(row["read_cross_bytes"] - row["planned_remote_bytes"]) <= 0.02 * r["summary"]["payload_bytes"]
    assert ca["put_cross_bytes"] > 0 and im["put_cross_bytes"] > 0  # put side counted separately


def test_two_gloo_ranks_in_separate_processes(cluster: ClusterProcess, tmp_path: Path) -> None:
    r = run_scenario(cluster.address, "gloo_ranks", timeout_s=240, outdir=str(tmp_path))
    assert r["codes"] == [0, 0]
    assert [x["rank"] for x in r["ranks"]] == [0, 1]  # taken from the process group
    got = _flat(r["ranks"][0]["ids"]) + _flat(r["ranks"][1]["ids"])
    assert sorted(got) == sorted(r["all_ids"]) and len(set(got)) == len(got)
    assert [x[0] for x in r["ranks"][0]["infos"]] == [x[0] for x in r["ranks"][1]["infos"]]
    assert r["committed"] == r["planned"] and r["held"] == 0
    # the producer task on node 2 put across nodes (both units are on nodes 0 and 1), counted on the put side
    assert len(r["remote_locations"]) == len(r["all_ids"]) // 2
    put = r["put_counters"]["consumer_aware"]  # this process's puts and the flushed ones of the producer task
    assert put["reads"] == len(r["all_ids"]) and put["cross_reads"] >= len(r["all_ids"]) // 2


def test_dataloader_workers_split_without_duplicates_and_resume(cluster: ClusterProcess) -> None:
    r = run_scenario(cluster.address, "workers_resume", timeout_s=300, num_workers=2, stop_after=5)
    before = [tuple(x[1]) for x in r["before"]]
    after = [tuple(x[1]) for x in r["after"]]
    lost = [tuple(x[1]) for x in r["lost_progress"]]
    seq = before + after
    assert seq == sorted(seq) and len(set(seq)) == len(seq)  # plan order, no duplicates across 2 workers
    assert lost == after[: len(lost)]  # consumed after the checkpoint: delivered again after resume
    got = [i for x in r["before"] + r["after"] for i in x[0]]
    assert sorted(got) == sorted(r["all_ids"]) and len(set(got)) == len(got)  # exactly once across resume
    assert r["committed"] == 5  # the checkpoint released the first 5 micro-batches
    # put-time checks on the Ray engine: field schema, withdrawn group, undecodable media, each naming the id
    assert r["refused"]["schema"] == ["ValidationError", "t9000", "scalars.extra_score"]
    assert r["refused"]["withdrawn"] == ["ValidationError", "t9001", "group"]
    assert r["refused"]["media"][:2] == ["MediaError", "t9002"]
    assert r["final_committed"] == r["planned"][0] and r["held"] == 0
    ws = [s for s in _states(r["state"])]
    assert sorted(s["worker"] for s in ws) == [0, 1] and all(s["num_workers"] == 2 for s in ws)
    # release="handout" without workers: everything delivered once, storage empty without any commit
    assert sorted(r["handout_ids"]) == [f"t{i}" for i in sorted(range(8), key=str)]
    assert r["handout_held"] == 0 and r["handout_used"] == [0]
    assert r["handout_state"]["next"] == r["handout_planned"][0] and r["handout_state"]["num_workers"] == 1


def _states(obj: object) -> list[dict]:
    out: list[dict] = []
    if isinstance(obj, dict):
        if obj.get("format") == "knitdata.TrajectoryDataset":
            return [obj]
        for v in obj.values():
            out += _states(v)
    elif isinstance(obj, list):
        for v in obj:
            out += _states(v)
    return out


def test_unit_killed_mid_step_error_or_spill_recovery(cluster: ClusterProcess, tmp_path: Path) -> None:
    r = run_scenario(cluster.address, "pipeline_killed", timeout_s=240, spill_root=str(tmp_path))
    plain = r["plain"]
    on_n1 = set(plain["on_n1"])
    errors = [res for res in plain["results"] if res["error"]]
    assert errors, "a consumer reading the dead unit's payloads must fail"
    for res in errors:
        assert res["lost"] and set(res["lost"]) <= on_n1  # names exactly lost trajectories
        assert "could not serve" in res["error"] and "n1" in res["error"]
    delivered = _flat(plain["first"]["ids"]) + [i for res in plain["results"] for i in _flat(res["ids"])]
    # nothing of the dead unit is delivered after the kill, nothing is delivered twice
    assert not (set(_flat(plain["results"][1]["ids"])) & on_n1)
    assert len(delivered) == len(set(delivered))
    spill = r["spill"]
    assert all(res["error"] is None for res in spill["results"])
    got = _flat(spill["first"]["ids"]) + [i for res in spill["results"] for i in _flat(res["ids"])]
    assert sorted(got) == sorted(spill["all_ids"]) and len(set(got)) == len(got)  # recovered, exactly once


def test_coordinator_killed_repeatedly_recovers_from_its_journal_exactly_once(cluster: ClusterProcess,
                                                                            tmp_path: Path) -> None:
    # compacting every 10 records: the restarts recover from snapshots plus the journal's tail (the last restart's
    # tail may be empty, when the kill lands right after a compaction: 0 records replayed then; 10 when it lands
    # between the 10th record and its compaction)
    r = run_scenario(cluster.address, "coordinator_killed", timeout_s=300, journal_root=str(tmp_path),
                     compact_every=10)
    assert r["errors"] == [] and r["killed"] == 2
    assert r["restarted"] and r["snapshot_loaded"] and 0 <= r["replayed"] <= 10
    assert r["journal_exists"] and r["snapshot_exists"]
    got = _flat(r["got"][0]) + _flat(r["got"][1])
    assert Counter(got) == Counter(r["all_ids"])  # 0 lost, 0 duplicated
    assert r["held"] == 0 and r["committed"] == r["planned"]


def test_whole_job_killed_and_restarted_from_journal_and_spill_exactly_once(cluster: ClusterProcess,
                                                                            tmp_path: Path) -> None:
    spill = str(tmp_path / "spill")
    first = run_scenario(cluster.address, "whole_job_first", timeout_s=240, spill_root=spill, pipeline="wj")
    second = run_scenario(cluster.address, "whole_job_resume", timeout_s=240, spill_root=spill, pipeline="wj",
                          state=first["state"])
    assert second["replayed"] > 0
    # what was consumed after the last checkpoint comes again first; nothing saved comes twice; nothing is lost
    assert second["rest"][:2] == first["unsaved"]
    got = _flat(first["saved"]) + _flat(second["rest"])
    assert Counter(got) == Counter(first["all_ids"])
    assert second["held"] == 0


def test_a_put_is_one_round_trip_and_lands_where_placement_puts_it(cluster: ClusterProcess) -> None:
    r = run_scenario(cluster.address, "one_round_trip", timeout_s=150)
    # the first put of a process fetches the placement's view once; then each put is one call to its unit
    # (which stores and asks the coordinator to admit), and none to the coordinator
    assert r["after_first"] == {"control": 1, "unit": 1}
    assert r["singles"] == {"control": 0, "unit": r["singles_n"]}
    assert r["batch"]["control"] == 0 and 1 <= r["batch"]["unit"] <= 2  # one call per unit of the batch
    # one producer: its replica of the placement picks exactly the units the plane's placement would
    assert r["locations"] == r["expected"] and set(r["locations"]) == {"a", "b"}
    assert r["ids"] == r["all_ids"]  # every trajectory exactly once
    # the coordinator counted every admission call of the units and the trajectories they carried
    cpu = r["admit_cpu"]
    assert cpu["trajectories"] == len(r["all_ids"]) and 1 <= cpu["calls"] <= cpu["trajectories"] and cpu["cpu_s"] > 0
