"""Whole-pipeline checkpoint and restore (knitdata.checkpoint, Pipeline.checkpoint / Pipeline.restore; issue 25 item 3).

Embedded engine: one process saves (``python tests/_checkpoint_script.py save DIR``) and exits; a new process
restores (``... restore DIR``), as a user runs them. Ray engine: a pipeline on 2 nodes restored on 1 node.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knitdata import BatchSpec, ConsumerLayout, Pipeline, Trajectory, merge_rank_states
from knitdata.checkpoint import config_fingerprint, read_manifest, remap_plane_state
from knitdata.errors import ConfigError, StateError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ckpt_helpers import HERE, run_ray_scenario, run_script  # noqa: E402

SCRIPT = HERE / "_checkpoint_script.py"


def _run(*args: str) -> dict:
    return run_script(SCRIPT, *args)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("ckpt")
    return d, _run("save", str(d))


def test_restore_in_a_new_process_is_exactly_once(saved: tuple[Path, dict]) -> None:
    d, out = saved
    info = out["info"]
    assert out["in_flight"] == ["p12", "p13", "p14"]
    assert info["in_flight"] == 3 and info["trajectories"] > 0 and info["pause_ms"] < 50
    res = _run("restore", str(d))
    job = json.loads((d / "job.json").read_text())
    # the producer is told exactly the prompts started and not finished, with what the checkpoint holds of them
    reissue = {r["prompt_id"]: r for r in res["report"]["reissue"]}
    assert sorted(reissue) == ["p12", "p13", "p14"]
    assert (reissue["p12"]["have"], reissue["p12"]["missing"]) == (["p12-0"], 1)
    assert (reissue["p13"]["have"], reissue["p13"]["missing"]) == ([], 2)
    assert (reissue["p14"]["have"], reissue["p14"]["missing"]) == (["p14-0", "p14-1"], 0)
    assert res["in_flight"] == []
    consumed = [t for r in ("0", "1") for t in job["before"][r] + res["after"][r]]
    produced = job["put"] + res["put"]
    assert len(consumed) == len(set(consumed)), "a trajectory was delivered twice"
    assert sorted(consumed) == sorted(produced), "lost: " + str(sorted(set(produced) - set(consumed)))
    assert len(produced) == 48


def _exactly_once(d: Path, res: dict) -> list[str]:
    """Every trajectory put (before the cut, reissued, after) consumed once, by the old ranks before their states
    or by the new ranks after the restore; returns what the new ranks consumed."""
    job = json.loads((d / "job.json").read_text())
    after = [t for r in sorted(res["after"]) for t in res["after"][r]]
    consumed = [t for r in sorted(job["before"]) for t in job["before"][r]] + after
    produced = job["put"] + res["put"]
    assert len(consumed) == len(set(consumed)), "delivered twice: " + str(sorted({t for t in consumed
                                                                                   if consumed.count(t) > 1}))
    assert sorted(consumed) == sorted(produced), "lost: " + str(sorted(set(produced) - set(consumed)))
    assert len(produced) == 48
    # the producer is told exactly the prompts started and not finished, with what the checkpoint holds of them
    reissue = {r["prompt_id"]: (r["have"], r["missing"]) for r in res["report"]["reissue"]}
    assert reissue == {"p12": (["p12-0"], 1), "p13": ([], 2), "p14": (["p14-0", "p14-1"], 0)}
    assert res["report"]["reissue_ids"] == ["p12", "p13"] and res["in_flight"] == []
    return after


@pytest.mark.parametrize("old, new", [(4, 2), (2, 3)])
def test_restore_onto_another_number_of_ranks_in_a_new_process(
        old: int, new: int, saved: tuple[Path, dict], tmp_path: Path) -> None:
    """Saved with ``old`` ranks by one process, restored onto ``new`` ranks by another, given the old ranks'
    states: the plane comes back in its saved layout, then the elastic resume continues it on the new ranks."""
    if old == 2:
        d = saved[0]
    else:  # 4 ranks, the odd ones saved one mini-batch later: mini-batch 2 was started by some ranks only
        d = tmp_path
        out = _run("save", str(d), str(old), "stagger")
        assert out["info"]["in_flight"] == 3
    res = _run("restore", str(d), str(new))
    rep = res["report"]
    assert rep["reshaped"]["from_ranks"] == old and rep["reshaped"]["to_ranks"] == new
    assert rep["merged_state"]["num_consumers"] == old and rep["reshaped"]["replanned"] > 0
    # every new rank ran to the end; a mini-batch is 2 groups of 2 and groups are not split, so with 3 ranks one
    # rank's micro-batches are empty
    assert sorted(res["after"]) == [str(r) for r in range(new)]
    assert sum(1 for v in res["after"].values() if v) == 2
    _exactly_once(d, res)


@pytest.mark.filterwarnings("ignore:knitdata. pipeline closed with")
def test_another_number_of_ranks_needs_the_rank_states(saved: tuple[Path, dict]) -> None:
    d, _out = saved
    job = json.loads((d / "job.json").read_text())
    with pytest.raises(ConfigError, match="rank_states=") as e:
        Pipeline.restore(d / "ckpt", layout=ConsumerLayout.single_node(3))
    assert "2 ranks" in str(e.value) and "merge_rank_states" in str(e.value)
    with pytest.raises(StateError, match=r"ranks \[1\] are missing"):  # a missing rank is refused, naming it
        Pipeline.restore(d / "ckpt", layout=ConsumerLayout.single_node(3), rank_states=[job["states"]["0"]])
    with pytest.raises(ConfigError, match="token_budget"):  # the rest of the fingerprint still counts
        Pipeline.restore(d / "ckpt", layout=ConsumerLayout.single_node(3), token_budget=128,
                         rank_states=list(job["states"].values()))
    # a merged state is accepted as well; the same number of ranks ignores the states (each loads its own)
    merged = merge_rank_states(list(job["states"].values()))
    pipe = Pipeline.restore(d / "ckpt", layout=ConsumerLayout.single_node(1), rank_states=merged)
    try:
        assert pipe.restore_report is not None and pipe.restore_report.merged_state == merged
        assert pipe.num_consumers == 1
    finally:
        pipe.shutdown()
    pipe = Pipeline.restore(d / "ckpt", rank_states=merged)
    assert pipe.restore_report is not None and pipe.restore_report.merged_state is None
    pipe.shutdown()


@pytest.mark.filterwarnings("ignore:knitdata. pipeline closed with")
def test_fingerprint_mismatch_is_refused_unless_allowed(saved: tuple[Path, dict]) -> None:
    d, _out = saved
    with pytest.raises(ConfigError, match="allow_config_change") as e:
        Pipeline.restore(d / "ckpt", token_budget=128)
    assert "token_budget" in str(e.value)
    pipe = Pipeline.restore(d / "ckpt", token_budget=128, allow_config_change=True)
    assert pipe.restore_report is not None and pipe.restore_report.config_changed
    pipe.shutdown()
    with pytest.raises(ConfigError, match="ranks"):
        Pipeline.restore(d / "ckpt", layout=ConsumerLayout.single_node(3))  # without the ranks' states
    with pytest.raises(StateError, match="no knitdata checkpoint"):
        Pipeline.restore(d / "nothing-here")


@pytest.mark.filterwarnings("ignore:knitdata. pipeline closed with")
def test_restore_onto_other_nodes_keeps_the_plans(saved: tuple[Path, dict]) -> None:
    """The same ranks on two nodes instead of one: every payload goes to a unit of the new layout, plans unchanged."""
    d, _out = saved
    m = read_manifest(d / "ckpt")
    layout = ConsumerLayout(["a", "b"])
    pipe = Pipeline.restore(d / "ckpt", layout=layout)
    try:
        assert pipe.restore_report is not None
        assert set(pipe.restore_report.unit_map.values()) <= {"a", "b"}
        state = pipe.internals.control.state_dict()
        old = [[[it[0] for it in e["items"]] for e in q] for q in m["plane"]["queues"]]
        new = [[[it[0] for it in e["items"]] for e in q] for q in state["queues"]]
        assert new == old and state["position"] == m["plane"]["position"]
        held = sum(len(u) for u in pipe.internals.units.values())
        assert held == m["payloads"]["count"]
        # what admission held (half a group) is admitted and read from its new unit once the group completes
        job = json.loads((d / "job.json").read_text())
        for r in pipe.restore_report.reissue:
            p = int(r["prompt_id"][1:])
            pipe.put_many([_traj(f"p{p}-x{k}", p) for k in range(r["missing"])])
        pipe.put_many([_traj(f"p15-{k}", 15) for k in range(2)])  # the train batch's last group
        pipe.close()
        got = []
        for r in range(2):
            ds = pipe.dataset(r, timeout=30)
            ds.load_state_dict(job["states"][str(r)])
            got += [t for mb in ds for t in mb.info.trajectory_ids]
        assert {"p12-0", "p12-x0", "p13-x0", "p13-x1", "p14-0", "p14-1"} <= set(got)
        assert len(got) == len(set(got))
    finally:
        pipe.shutdown()


@pytest.mark.filterwarnings("ignore:knitdata. pipeline closed with")
def test_restore_onto_other_nodes_and_ranks_reads_the_new_units(saved: tuple[Path, dict]) -> None:
    """2 ranks on one node -> 3 ranks on two other nodes: the re-planned micro-batches read the new units."""
    d, _out = saved
    job = json.loads((d / "job.json").read_text())
    pipe = Pipeline.restore(d / "ckpt", layout=ConsumerLayout(["a", "b", "a"]),
                            rank_states=[job["states"][r] for r in ("1", "0")])  # any order
    try:
        rep = pipe.restore_report
        assert rep is not None and rep.reshaped is not None and rep.merged_state is not None
        assert rep.reshaped["to_ranks"] == 3 and set(rep.unit_map.values()) <= {"a", "b"}
        put = list(job["put"])
        for r in rep.reissue:
            p = int(r["prompt_id"][1:])
            fresh = [_traj(f"p{p}-x{k}", p) for k in range(r["missing"])]
            pipe.put_many(fresh)
            put += [t.id for t in fresh]
        for p in range(15, 24):
            pipe.put_many([_traj(f"p{p}-{k}", p) for k in range(2)])
            put += [f"p{p}-{k}" for k in range(2)]
        pipe.close()
        got = [t for r in ("0", "1") for t in job["before"][r]]
        for r in range(3):
            ds = pipe.dataset(r, timeout=30)
            ds.load_state_dict(rep.merged_state)
            got += [t for mb in ds for t in mb.info.trajectory_ids]
        assert len(got) == len(set(got)) and sorted(got) == sorted(put)
    finally:
        pipe.shutdown()


@pytest.mark.filterwarnings("ignore:knitdata. pipeline closed with")
def test_checkpoint_of_a_reshaped_pipeline_restores_its_current_ranks(tmp_path: Path) -> None:
    """A live pipeline reshaped 2 -> 3 ranks, then checkpointed: the restore defaults to its 3 ranks (their own
    states), and onto 1 rank given the 3 states; both exactly once."""
    pipe = Pipeline(BatchSpec({"math": 4, "code": 4}, num_minibatches=2, group_size=2), num_consumers=2,
                    token_budget=64)
    put = []
    for p in range(16):
        pipe.put_many([_traj(f"p{p}-{k}", p) for k in range(2)])
        put += [f"p{p}-{k}" for k in range(2)]

    def one_step(ds: Any, got: list[str]) -> Any:
        for mb in ds:
            got += mb.info.trajectory_ids
            if mb.info.is_last:
                break
        return ds.state_dict()

    before: list[str] = []
    states = [one_step(pipe.dataset(r, timeout=30), before) for r in range(2)]
    merged = pipe.reshape(states, 3)
    mid = []
    for r in range(3):
        ds = pipe.dataset(r, timeout=30)
        ds.load_state_dict(merged)
        mid.append(ds)
    states3 = [one_step(ds, before) for ds in mid]
    pipe.checkpoint(tmp_path / "c")
    pipe.close()
    for kwargs, ranks in (({}, 3), ({"layout": ConsumerLayout.single_node(1), "rank_states": states3}, 1)):
        new = Pipeline.restore(tmp_path / "c", **kwargs)
        try:
            assert new.num_consumers == ranks and new.restore_report is not None
            new.close()
            got = list(before)
            for r in range(ranks):
                ds = new.dataset(r, timeout=30)
                ds.load_state_dict(states3[r] if ranks == 3 else new.restore_report.merged_state)
                got += [t for mb in ds for t in mb.info.trajectory_ids]
            assert len(got) == len(set(got)) and sorted(got) == sorted(put)
        finally:
            new.shutdown()


def _traj(tid: str, p: int) -> Trajectory:
    return Trajectory(id=tid, source="math" if p % 2 == 0 else "code", group=f"p{p}", prompt_ids=torch.arange(4),
                      response_ids=torch.arange(5), scalars={"reward": 1.0})


def _t(i: int) -> Trajectory:
    return Trajectory(id=f"t{i}", source="a", group=f"g{i}", prompt_ids=torch.arange(3),
                      response_ids=torch.arange(4), scalars={"reward": 0.0})


def test_releases_after_the_cut_wait_for_the_payloads(tmp_path: Path) -> None:
    """A release sent between the cut and the end of the write is deferred; the checkpoint holds every payload."""
    pipe = Pipeline(BatchSpec({"a": 2}, num_minibatches=1, group_size=1), num_consumers=1, token_budget=64)
    pipe.put_many([_t(i) for i in range(4)])
    plane = pipe.internals.control
    cut = plane.ledger.checkpoint_cut()
    assert {m["id"] for m in cut["plane"]["live"]} == {f"t{i}" for i in range(4)}
    plane.positions.commit(0, 1)  # the consumer moved past the first micro-batch after the cut
    unit = pipe.internals.units["node0"]
    assert len(unit) == 4  # held back
    with pytest.raises(StateError, match="in progress"):
        plane.ledger.checkpoint_cut()
    assert plane.ledger.checkpoint_done() >= 1
    assert len(unit) < 4
    info = pipe.checkpoint(tmp_path / "c")
    assert info.trajectories == len(unit)
    pipe.close()


def test_fingerprint_covers_what_decides_plans() -> None:
    base = {"spec": BatchSpec({"a": 2}, num_minibatches=1).to_dict(), "layout": ConsumerLayout(["n0", "n1"]).to_dict()}
    fp, parts = config_fingerprint(base)
    assert parts["num_consumers"] == 2
    assert config_fingerprint({**base, "layout": ConsumerLayout(["n0", "n0"]).to_dict()})[0] == fp  # topology only
    assert config_fingerprint({**base, "token_budget": 1})[0] != fp
    assert config_fingerprint({**base, "admission": "fifo"})[0] != fp


def test_remap_refuses_another_number_of_ranks(saved: tuple[Path, dict]) -> None:
    d, _out = saved
    m = read_manifest(d / "ckpt")
    cfg = {**m["plane"]["config"], "layout": ConsumerLayout.single_node(4).to_dict()}
    with pytest.raises(ConfigError, match="elastic resume"):
        remap_plane_state(m["plane"], config=cfg, unit_nodes={"node0": "node0"})


def test_checkpoint_while_consumers_run(tmp_path: Path) -> None:
    """Checkpoints taken while ranks consume and the producer puts: each is one consistent cut."""
    spec = BatchSpec({"a": 4}, num_minibatches=2, group_size=1)
    pipe = Pipeline(spec, num_consumers=2, token_budget=64, release="handout")
    stop = threading.Event()

    def produce() -> None:
        try:
            for i in range(400):
                pipe.put(_t(i))
        finally:
            pipe.close()

    seen: list[str] = []

    def consume(r: int) -> None:
        for mb in pipe.dataset(r, timeout=30):
            seen.extend(mb.info.trajectory_ids)

    threads = [threading.Thread(target=produce)] + [threading.Thread(target=consume, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    infos = []
    while threads[0].is_alive() and len(infos) < 5:
        infos.append(pipe.checkpoint(tmp_path / "c"))
    stop.set()
    for t in threads:
        t.join()
    assert sorted(seen) == sorted(f"t{i}" for i in range(400))
    m = read_manifest(tmp_path / "c")
    assert m["payloads"]["count"] == infos[-1].trajectories
    assert all(i.pause_ms < 100 for i in infos)
    assert not any(p.endswith(".tmp") for p in os.listdir(tmp_path))



@pytest.mark.slow
def test_ray_restore_from_two_nodes_onto_one(tmp_path: Path) -> None:
    """Ray: checkpoint with units on 2 nodes, remove the worker node, restore onto the head node alone."""
    out = run_ray_scenario("two_to_one", tmp_path)
    assert set(out["units_before"].values()) == {"n0", "n1"} and set(out["units_after"].values()) == {"n0"}
    assert out["report"]["unit_map"] == {"n0": "n0", "n1": "n0"}
    assert out["report"]["reissue_ids"] == ["p8", "p9"]
    consumed, put = out["consumed"], out["put"]
    assert len(consumed) == len(set(consumed)) and sorted(consumed) == sorted(put)
    assert out["info"]["pause_ms"] < 100


@pytest.mark.slow
def test_ray_restore_from_four_ranks_on_two_nodes_onto_two_ranks_on_one(tmp_path: Path) -> None:
    """Ray: 4 ranks on 2 nodes checkpointed, the worker node removed, restored onto 2 ranks on the head node."""
    out = run_ray_scenario("four_to_two", tmp_path)
    assert set(out["units_before"].values()) == {"n0", "n1"} and set(out["units_after"].values()) == {"n0"}
    rep = out["report"]
    assert rep["unit_map"] == {"n0": "n0", "n1": "n0"}
    assert rep["reshaped"]["from_ranks"] == 4 and rep["reshaped"]["to_ranks"] == 2
    assert rep["reissue_ids"] == ["p8", "p9"] and out["after_ranks"] == [0, 1]
    consumed, put = out["consumed"], out["put"]
    assert len(consumed) == len(set(consumed)), "delivered twice"
    assert sorted(consumed) == sorted(put), "lost: " + str(sorted(set(put) - set(consumed)))


@pytest.mark.filterwarnings("ignore:knitdata. pipeline closed with")
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=10))
def test_reissue_is_exactly_the_prompts_in_flight(plan: list[tuple[int, bool]]) -> None:
    """Prompt i: ``plan[i][0]`` of its 2 members put, reported finished if ``plan[i][1]`` and whole. The restore
    reissues exactly the prompts not finished, each with the members the checkpoint holds and the count missing."""
    spec = BatchSpec({"a": 64}, num_minibatches=1, group_size=2)  # nothing is admitted: every member is held
    pipe = Pipeline(spec, num_consumers=1, token_budget=64)
    finished = set()
    for i, (k, fin) in enumerate(plan):
        pipe.ledger.started(f"q{i}", group=f"g{i}")
        for m in range(k):
            pipe.put(Trajectory(id=f"q{i}-{m}", source="a", group=f"g{i}", prompt_ids=torch.arange(2),
                                response_ids=torch.arange(3), scalars={"reward": 0.0}))
        if fin and k == 2:
            pipe.ledger.finished(f"q{i}")
            finished.add(i)
    with tempfile.TemporaryDirectory() as d:
        info = pipe.checkpoint(os.path.join(d, "c"))
        assert info.in_flight == len(plan) - len(finished)
        new = Pipeline.restore(os.path.join(d, "c"))
    try:
        assert new.restore_report is not None
        got = {r["prompt_id"]: r for r in new.restore_report.reissue}
        assert sorted(got) == sorted(f"q{i}" for i in range(len(plan)) if i not in finished)
        for pid, r in got.items():
            i = int(pid[1:])
            assert r["group"] == f"g{i}" and r["have"] == [f"q{i}-{m}" for m in range(plan[i][0])]
            assert r["missing"] == 2 - plan[i][0]
        assert new.ledger.in_flight() == [f"q{i}" for i in range(len(plan)) if i not in finished]
        assert new.ledger.num_finished() == len(finished)
    finally:
        new.close()
        pipe.close()


@pytest.mark.filterwarnings("ignore:knitdata. pipeline closed with")
def test_rank_states_load_into_a_restore_with_another_token_budget(saved: tuple[Path, dict]) -> None:
    """Issue 45.8: the ranks' states record the planning they were saved under; a pipeline restored with another
    token_budget (allow_config_change) keeps the checkpoint's plans, so the states saved with it still load."""
    d, _out = saved
    budget = int(read_manifest(d / "ckpt")["plane"]["config"]["token_budget"])
    job = json.loads((d / "job.json").read_text())
    assert job["states"]["0"]["planning"]["token_budget"] == budget
    pipe = Pipeline.restore(d / "ckpt", token_budget=budget * 2, allow_config_change=True)
    try:
        for r in range(2):
            pipe.dataset(r, timeout=30).load_state_dict(job["states"][str(r)])
    finally:
        pipe.shutdown()


# ------------------------------------------------------------------------------------ media stored once (issue 43)
def _media_pipe(**kw: Any) -> Pipeline:
    spec = BatchSpec({"math": 8, "code": 8}, num_minibatches=2, group_size=4)
    return Pipeline(spec, layout=ConsumerLayout(["node0", "node1"]), token_budget=96, **kw)


def _media_totals(pipe: Pipeline) -> dict[str, int]:
    from _media_checks import check_media_exact, held_totals, media_report

    rep = media_report(pipe)
    check_media_exact(rep)
    return held_totals(rep)


def _shard_media_encodings(path: Path) -> dict[str, int]:
    import tarfile

    counts: dict[str, int] = {}
    for shard in sorted(path.glob("payloads-*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".json"):
                    f = tar.extractfile(m)
                    assert f is not None
                    for item in json.loads(f.read())["media"]:
                        counts[item["encoding"]] = counts.get(item["encoding"], 0) + 1
    return counts


def test_checkpoint_keeps_media_bytes_and_counts_and_writes_each_item_once(tmp_path: Path) -> None:
    from _media_checks import MEDIA_PER_TRAJ, media_workload

    pipe = _media_pipe()
    for t in media_workload(8, 4):
        pipe.put(t)
    before = _media_totals(pipe)
    pipe.checkpoint(tmp_path / "c")
    pipe.shutdown()
    enc = _shard_media_encodings(tmp_path / "c")
    # 8 group images + 32 clips + 1 screenshot written once (the units hold 42: the screenshot on both), the rest refs
    assert enc == {"tensor": 8 + 32 + 1, "ref": 32 * MEDIA_PER_TRAJ - 41}, enc
    restored = Pipeline.restore(tmp_path / "c")
    assert _media_totals(restored) == before  # bytes held, media items and references as before the checkpoint
    got = restored.internals.units["node0"].get(["t0", "t1"])
    assert got[0].media[0] is got[1].media[0]
    restored.shutdown()


def test_checkpoint_written_before_media_references_still_loads(tmp_path: Path, monkeypatch: Any) -> None:
    """A checkpoint whose payloads carry their own copies (the format before issue 43) restores one copy per digest."""
    from _media_checks import media_workload

    import knitdata.checkpoint as ckpt

    pipe = _media_pipe()
    for t in media_workload(8, 4, refs=False):
        pipe.put(t)
    before = _media_totals(pipe)
    with monkeypatch.context() as m:
        m.setattr(ckpt, "_media_once", lambda trajs: trajs)  # the old writer: every payload its own copies
        pipe.checkpoint(tmp_path / "old")
    pipe.shutdown()
    assert "ref" not in _shard_media_encodings(tmp_path / "old")
    restored = Pipeline.restore(tmp_path / "old")
    assert _media_totals(restored) == before
    restored.shutdown()


def test_checkpoint_of_per_trajectory_copies_restores_per_trajectory_copies(tmp_path: Path) -> None:
    from _media_checks import media_workload

    pipe = _media_pipe(media_dedup=False)
    trajs = media_workload(8, 4, refs=False)
    for t in trajs:
        pipe.put(t)
    before = _media_totals(pipe)
    assert before["used_bytes"] == sum(t.nbytes for t in trajs) and before["media_items"] == 0
    pipe.checkpoint(tmp_path / "c")
    pipe.shutdown()
    restored = Pipeline.restore(tmp_path / "c")
    assert restored.internals.config["media_dedup"] is False and _media_totals(restored) == before
    restored.shutdown()
