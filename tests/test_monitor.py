"""knitdata.observe.monitor: flat per-step metrics (dataset, pipeline) and the status table, in-process and as
``python -m knitdata status`` against a running Ray pipeline (a separate process, the way docs/observe.md says)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata import BatchSpec, Pipeline, Trajectory
from knitdata.observe.monitor import PREFIX, flat_metrics, status_rows, status_table

ROOT = Path(__file__).resolve().parent.parent


def _traj(i: int, source: str, group: str, gen_version: int = 0) -> Trajectory:
    return Trajectory(id=f"{source}-{i}", source=source, group=group, gen_version=gen_version,
                      prompt_ids=torch.arange(4), response_ids=torch.arange(3 + i % 4), scalars={"reward": 1.0})


def _run_two_sources(max_staleness: int | None = None) -> tuple[Pipeline, list[dict[str, Any]], int]:
    """Two sources, 2 train batches of 2 mini-batches, one rank; rank 0 logs ``step_metrics()`` at every
    ``is_last``. The second train batch is generated one version late (staleness 1..2)."""
    spec = BatchSpec({"math": 4, "code": 4}, num_minibatches=2, group_size=2)
    pipe = Pipeline(spec, num_consumers=1, capacity_bytes=1 << 20, token_budget=64, max_staleness=max_staleness)
    n = 0
    for tb in range(2):
        for src in ("math", "code"):
            for g in range(2):
                for _k in range(2):
                    pipe.put(_traj(n, src, f"{src}-{tb}-{g}", gen_version=max(0, 2 * tb - 1)))
                    n += 1
    pipe.close()
    logged = []
    ds = pipe.dataset(0, fetch="iter")
    for mb in ds:
        if mb.info.is_last:
            logged.append(ds.step_metrics())
            pipe.report_version(mb.info.minibatch + 1)
    return pipe, logged, n


def test_dataset_step_metrics_per_step_of_an_embedded_run() -> None:
    pipe, logged, n = _run_two_sources()
    assert len(logged) == 4  # one per optimizer step
    for m in logged:
        assert all(k.startswith(PREFIX) for k in m)
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in m.values())
        assert 0.0 <= m["knitdata/store/fill"] <= 1.0
        assert m["knitdata/data_wait_s"] >= 0.0 and m["knitdata/wait_s"] >= m["knitdata/data_wait_s"]
    last = logged[-1]
    assert last["knitdata/steps"] == 4
    assert last["knitdata/sources/math/puts"] == last["knitdata/sources/code/puts"] == n // 2
    assert last["knitdata/admitted_trajectories"] == n
    # every trajectory handed out counted once, per source as overall; version 3 trains generation 1 at most 2 stale
    assert last["knitdata/staleness/count"] == n
    assert last["knitdata/staleness/math/count"] + last["knitdata/staleness/code/count"] == n
    assert last["knitdata/rank_staleness/count"] == n
    assert last["knitdata/staleness/max"] == 2 == max(last[f"knitdata/staleness/{s}/max"] for s in ("math", "code"))
    assert last["knitdata/rank_staleness/max"] == 2
    assert logged[0]["knitdata/staleness/max"] == 0
    assert last["knitdata/admission_delay_s/count"] == n and last["knitdata/admission_delay_s/max"] >= 0
    # staleness split: generating + queued = staleness, per trajectory, so the means add up
    assert last["knitdata/staleness_split/count"] == n
    assert last["knitdata/staleness_generating/mean"] + last["knitdata/staleness_queued/mean"] == \
        pytest.approx(last["knitdata/staleness/mean"])
    assert last["knitdata/staleness_queued/max"] <= 2 and last["knitdata/staleness_queued_s/max"] >= 0
    assert last["knitdata/bytes_local"] + last["knitdata/bytes_remote"] > 0
    assert last["knitdata/data_wait_s_total"] >= sum(m["knitdata/data_wait_s"] for m in logged) - 1e-9
    # the store empties as steps commit (release="handout" by default): the last read holds at most the last step
    assert last["knitdata/store/used_bytes"] <= logged[0]["knitdata/store/used_bytes"] + 1


def test_pipeline_step_metrics_and_status_table_match_stats() -> None:
    pipe, _logged, n = _run_two_sources()
    m = pipe.step_metrics(0)
    assert m["knitdata/puts"] == n and m["knitdata/version"] == 4
    assert m["knitdata/steps"] == 4
    rows = status_rows({"name": None, **pipe.stats()})
    assert {r["source"]: (r["finished"], r["admitted"], r["quota"]) for r in rows["sources"]} == {
        "math": (n // 2, n // 2, 4), "code": (n // 2, n // 2, 4)}
    (r0,) = rows["ranks"]
    assert r0["position"] == r0["planned"] > 0 and r0["ahead"] == 0 and not r0["waiting"]  # closed: nothing to wait for
    assert r0["staleness_max"] == 2
    table = pipe.status_table()
    assert "closed" in table and "math" in table and "code" in table
    assert table.splitlines()[1].split() == ["source", "finished", "admitted", "ready", "quota"]
    assert "journal: none" in table  # the embedded engine keeps no journal
    split = rows["staleness_split"]
    assert split["count"] == n and split["generating_mean"] + split["queued_mean"] == pytest.approx(
        pipe.stats()["staleness"]["mean"])
    assert f"staleness split (mean/max, {n} trajectories): generating " in table
    with pytest.raises(Exception, match="rank must be"):
        pipe.step_metrics(3)


def test_step_metrics_report_what_the_staleness_bound_dropped() -> None:
    spec = BatchSpec({"math": 4}, num_minibatches=2, group_size=2)
    pipe = Pipeline(spec, num_consumers=1, capacity_bytes=1 << 20, token_budget=64, max_staleness=1)
    pipe.put_many([_traj(i, "math", f"g{i // 2}", gen_version=0) for i in range(4)])  # steps 0 and 1
    pipe.put_many([_traj(4 + i, "math", "late", gen_version=0) for i in range(2)])  # step 2: 2 behind, dropped
    m = pipe.step_metrics()
    assert m["knitdata/stale_dropped/dropped_groups"] == 1
    assert m["knitdata/stale_dropped/dropped_trajectories/math"] == 2
    pipe.close()


def test_data_wait_of_a_step_is_the_time_blocked_for_it() -> None:
    """A rank that waits for a producer sees that wait in ``knitdata/data_wait_s`` of the step."""
    spec = BatchSpec({"math": 2}, num_minibatches=1, group_size=2)
    pipe = Pipeline(spec, num_consumers=1, capacity_bytes=1 << 20, token_budget=64)
    ds = pipe.dataset(0, fetch="sample")

    def late() -> None:
        pipe.put_many([_traj(i, "math", "g") for i in range(2)])
        pipe.close()

    timer = threading.Timer(0.3, late)
    timer.start()
    got = []
    for mb in ds:
        if mb.info.is_last:
            got.append(ds.step_metrics())
    timer.join()
    assert len(got) == 1 and got[0]["knitdata/data_wait_s"] >= 0.2


finite_summary = st.fixed_dictionaries({"count": st.integers(0, 10), "mean": st.floats(allow_nan=True),
                                        "p95": st.floats(allow_nan=True), "max": st.floats(allow_nan=True)})


@settings(max_examples=60, deadline=None)
@given(stale=finite_summary, by_src=st.dictionaries(st.sampled_from(["a", "b/c", "d e"]), finite_summary),
       units=st.dictionaries(st.text(min_size=1, max_size=3),
                             st.fixed_dictionaries({"used_bytes": st.integers(0, 100),
                                                    "capacity_bytes": st.integers(0, 100)}), max_size=3),
       consumers=st.lists(st.one_of(st.none(), st.fixed_dictionaries({"last_step_data_wait_s": st.floats()})),
                          max_size=3), rank=st.one_of(st.none(), st.integers(0, 3)))
def test_flat_metrics_values_are_always_finite_numbers(stale: Any, by_src: Any, units: Any, consumers: Any,
                                                       rank: Any) -> None:
    stats = {"staleness": stale, "staleness_by_source": by_src, "units": units, "consumers": consumers,
             "staleness_split": {"count": stale["count"], "generating_mean": stale["mean"], "generating_max": None,
                                 "queued_mean": stale["p95"], "queued_max": 3, "queued_s_mean": stale["max"]}}
    m = flat_metrics(stats, rank=rank)
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in m.values())
    assert all(k.startswith("knitdata/") for k in m)
    if units:
        assert 0.0 <= m["knitdata/store/fill"] or not any(u["capacity_bytes"] for u in units.values())
    status_table({**stats, "positions": [0] * len(consumers)})  # renders whatever is there


# ---------------------------------------------------------------------------------------------- Ray: a separate process
#: A rank attached the documented way, logging ``ds.step_metrics()`` at each optimizer step (JSON list at the end).
RANK_SCRIPT = """
import json, sys
from knitdata import Pipeline

pipe = Pipeline.attach(sys.argv[1], address=sys.argv[2])
ds = pipe.dataset(0)
logged = [ds.step_metrics() for mb in ds if mb.info.is_last]
print(json.dumps(logged))
"""


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_knitdata_status_against_a_running_ray_pipeline() -> None:
    """``python -m knitdata status --address ADDR --name NAME`` in its own process, against a creator's pipeline
    that a producer process filled (tests/_ray_attach_roles.py: the processes of README's Ray section); before it,
    rank 0 attached in its own process iterates to the end logging ``ds.step_metrics()`` per step."""
    pytest.importorskip("ray")
    from tests.test_ray_attach import Proc, user_env

    name = "status-demo"
    creator = Proc("creator", name, stdin=True)
    try:
        address = creator.next("address", 180)["address"]
        prod = Proc("producer", name, address, "8")  # one train batch
        assert "done" in prod.next("done", 120), prod.seen
        prod.wait(60)
        env = user_env()
        rank0 = subprocess.run([sys.executable, "-c", RANK_SCRIPT, name, address], env=env, cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
        assert rank0.returncode == 0, rank0.stderr[-3000:]
        steps = json.loads(rank0.stdout.splitlines()[-1])
        assert len(steps) == 2  # one train batch of 2 mini-batches: rank 0 logged at each is_last
        assert [m["knitdata/steps"] for m in steps] == [1, 2]
        assert steps[-1]["knitdata/sources/math/admitted"] == 8 and steps[-1]["knitdata/staleness/math/count"] > 0
        assert steps[-1]["knitdata/store/capacity_bytes"] > 0 and 0 <= steps[-1]["knitdata/store/fill"] <= 1
        assert steps[-1]["knitdata/bytes_local"] + steps[-1]["knitdata/bytes_remote"] > 0

        def status(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "knitdata", "status", "--address", address, "--name", name,
                                   *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)

        once = status()
        assert once.returncode == 0, once.stderr[-3000:]
        lines = once.stdout.splitlines()
        assert lines[0].startswith(f"pipeline {name!r} (ray)") and "closed" in lines[0], once.stdout
        assert lines[1].split() == ["source", "finished", "admitted", "ready", "quota"]
        assert lines[2].split() == ["math", "8", "8", "0", "8"], once.stdout
        assert lines[3].split()[:3] == ["rank", "position", "ahead"]
        assert [ln.split()[0] for ln in lines[4:6]] == ["0", "1"]
        assert lines[-2].startswith("store: 2 units") or lines[-2].startswith("store: 1 units"), once.stdout
        assert lines[-1].startswith("journal:"), once.stdout

        watched = status("--json", "--watch", "--interval", "0.2", "--count", "3")
        assert watched.returncode == 0, watched.stderr[-3000:]
        rows = [json.loads(ln) for ln in watched.stdout.splitlines()]
        assert len(rows) == 1  # a closed pipeline: --watch prints once and exits
        assert rows[0]["sources"] == [{"source": "math", "finished": 8, "admitted": 8, "ready": 0, "quota": 8}]
        assert [r["rank"] for r in rows[0]["ranks"]] == [0, 1]
        r0, r1 = rows[0]["ranks"]
        assert r0["position"] == r0["planned"] > 0 and r0["ahead"] == 0  # rank 0 iterated to the end
        assert r1["position"] == 0 and r1["ahead"] == r1["planned"] > 0  # rank 1 never came

        missing = status("--name", "no-such-pipeline", "--timeout", "10")
        assert missing.returncode == 1 and "no-such-pipeline" in missing.stderr
    finally:
        if creator.p.poll() is None and creator.p.stdin:
            creator.p.stdin.close()
            try:
                creator.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        creator.kill()


def test_starvation_signal_in_metrics_and_the_status_table() -> None:
    """A staleness bound's per-source starvation (issue 45): ``starved/<source>`` 1/0, ``starved_sources``,
    ``drop_streak/<source>`` in the flat metrics, and a status line naming the starved source; a bound that does
    not report starvation gets no starvation figures (not a false 'none')."""
    bound = {"max_staleness": 2, "on_stale": "wait", "dropped_groups": {"math": 0, "agent": 5},
             "starved": {"math": False, "agent": True}, "drop_streak": {"math": 0, "agent": 4}}
    m = flat_metrics({"staleness_bound": bound})
    assert m["knitdata/starved/agent"] == 1 and m["knitdata/starved/math"] == 0
    assert m["knitdata/starved_sources"] == 1 and m["knitdata/drop_streak/agent"] == 4
    rows = status_rows({"staleness_bound": bound})
    assert rows["bound"]["starved"] == ["agent"] and rows["bound"]["dropped_groups"] == 5
    table = status_table({"staleness_bound": bound})
    assert "staleness bound: max_staleness 2 (wait), 5 groups dropped; starved: agent (4 dropped in a row)" in table
    calm = {**bound, "starved": {"math": False, "agent": False}, "drop_streak": {"math": 0, "agent": 0}}
    assert "; starved: none" in status_table({"staleness_bound": calm})
    old = {k: v for k, v in bound.items() if k not in ("starved", "drop_streak")}
    assert "starved" not in status_table({"staleness_bound": old})
    assert not any("starved" in k for k in flat_metrics({"staleness_bound": old}))


def test_a_starved_source_shows_in_step_metrics_and_the_status_table_of_a_pipeline() -> None:
    """End to end: a source whose groups keep arriving staler than the bound while its quota waits is starved in
    ``pipe.step_metrics()`` and named in ``pipe.status_table()``; a fresh group of it clears the signal."""
    spec = BatchSpec({"a": 2, "b": 2}, num_minibatches=2, group_size=1)
    with Pipeline(spec, num_consumers=1, max_staleness=0, version_offset=5) as pipe:
        pipe.put_many([_traj(0, "a", "a0", 5), _traj(1, "b", "b0", 5)])  # step 0
        pipe.put(_traj(2, "b", "b1", 6))
        with pytest.warns(RuntimeWarning, match="source 'a' is starved"):
            for i in range(2):
                pipe.put(_traj(3 + i, "a", f"a{i + 1}", 5))  # 1 stale at step 1 > 0: dropped while a's quota waits
        m = pipe.step_metrics()
        assert m["knitdata/starved/a"] == 1 and m["knitdata/starved/b"] == 0 and m["knitdata/starved_sources"] == 1
        assert m["knitdata/drop_streak/a"] == 2
        assert "starved: a (2 dropped in a row)" in pipe.status_table()
        pipe.put(_traj(9, "a", "a9", 6))
        assert pipe.step_metrics()["knitdata/starved/a"] == 0
        assert "; starved: none" in pipe.status_table()
        pipe.put(_traj(10, "b", "b2", 6))  # completes the train batch: nothing left unadmitted
