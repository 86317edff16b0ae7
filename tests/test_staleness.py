"""Tests of knitdata.staleness: version clock, staleness definitions, summaries."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.admission import AdmittedMiniBatch
from knitdata.errors import StateError, ValidationError
from knitdata.record import TrajectoryMeta
from knitdata.staleness import StalenessTracker, VersionClock, percentile, staleness_reduction, summarize

sys.path.insert(0, os.path.dirname(__file__))
from _state_harness import run_test_save_load_steps  # noqa: E402


def test_version_clock_sync_per_step_and_per_batch() -> None:
    c = VersionClock()
    assert c.step() and c.version == 1 and c.rollout_version == 1
    b = VersionClock(sync_every=4)
    synced = [b.step() for _ in range(8)]
    assert synced == [False, False, False, True] * 2 and b.rollout_version == 8
    b.step()
    assert b.rollout_version == 8
    b.sync()
    assert b.rollout_version == 9
    d = VersionClock()
    d.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert d.state_dict() == b.state_dict()
    with pytest.raises(ValidationError):
        VersionClock(sync_every=0)


def test_colocated_schedule_has_zero_architectural_staleness() -> None:
    M = 4
    tr = StalenessTracker()
    v = 0
    for b in range(3):
        gen = b * M  # colocated: the whole batch generated with the version at the start of the batch
        for k in range(M):
            tr.record(k, v, [gen] * 5)
            v += 1
    s = tr.summary()
    assert s["arch"]["mean"] == 0 and s["arch"]["p95"] == 0
    assert s["raw"]["mean"] == pytest.approx((M - 1) / 2)


def test_record_minibatch_counts_before_its_step() -> None:
    mb = AdmittedMiniBatch(
        1,
        2,
        6,
        tuple(TrajectoryMeta(id=str(i), source="a", group=str(i), gen_version=3, version_mean=3.5) for i in range(2)),
    )
    tr = StalenessTracker()
    tr.record_minibatch(mb, train_version=6)
    assert tr.raw == [3, 3] and tr.arch == [1, 1] and tr.version_mean_staleness == [2.5, 2.5]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=60))
def test_summary_matches_numpy(xs: list[float]) -> None:
    s = summarize(xs)
    assert s["mean"] == pytest.approx(float(np.mean(xs)), abs=1e-9)
    assert s["p50"] == pytest.approx(float(np.percentile(xs, 50)), abs=1e-9)
    assert s["p95"] == pytest.approx(float(np.percentile(xs, 95)), abs=1e-9)
    assert s["count"] == len(xs)
    assert s["positive_mean"] == pytest.approx(float(np.mean(np.maximum(xs, 0.0))), abs=1e-9)
    assert s["share_negative"] == pytest.approx(float(np.mean(np.asarray(xs) < 0)), abs=1e-12)


def test_summary_empty_and_reduction() -> None:
    assert math.isnan(summarize([])["mean"]) and math.isnan(percentile([], 50))
    assert staleness_reduction(1.0, 10.0) == pytest.approx(0.9)
    assert staleness_reduction(-1.0, 10.0) == pytest.approx(1.1)
    assert staleness_reduction(1.0, 0.0) is None and staleness_reduction(1.0, -2.0) is None


# ------------------------------------------------------------------------------------------- save/load


@settings(max_examples=30, deadline=None)
@given(sync_every=st.integers(1, 5), ops=st.lists(st.sampled_from(["step", "sync"]), min_size=1, max_size=20),
       data=st.data())
def test_version_clock_state_harness(sync_every, ops, data) -> None:
    """The shared save/load check (tests/_state_harness.py): a clock resumed between any two calls."""
    def call(op: str):
        def run(c: VersionClock):
            synced = c.step() if op == "step" else c.sync()
            return synced, c.version, c.rollout_version
        return run

    mids = data.draw(st.lists(st.integers(0, len(ops)), min_size=1, max_size=4, unique=True))
    ref = run_test_save_load_steps(lambda: VersionClock(version=3, sync_every=sync_every), [call(o) for o in ops], mids)
    assert ref[-1][1] == 3 + ops.count("step")


@settings(max_examples=30, deadline=None)
@given(batches=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9), st.lists(st.integers(0, 9), max_size=5)),
                        min_size=1, max_size=8), data=st.data())
def test_staleness_tracker_state_harness(batches, data) -> None:
    def record(index: int, version: int, gens: list[int]):
        def run(t: StalenessTracker):
            t.record(index, version, gens, [g + 0.5 for g in gens])
            return t.summary()
        return run

    mids = data.draw(st.lists(st.integers(0, len(batches)), min_size=1, max_size=4, unique=True))
    run_test_save_load_steps(StalenessTracker, [record(*b) for b in batches], mids)


@pytest.mark.parametrize("bad", [None, {}, {"version": 1, "rollout_version": 1, "sync_every": 0},
                                 {"version": "1", "rollout_version": 1, "sync_every": 1}])
def test_version_clock_refuses_bad_states(bad) -> None:
    with pytest.raises(StateError):
        VersionClock().load_state_dict(bad)
    with pytest.raises(StateError):
        StalenessTracker().load_state_dict(bad)


# --------------------------------------------------------------------------------------------- per token


def test_token_staleness_of_partial_rollouts() -> None:
    """Per token as well as per trajectory: a trajectory continued under newer weights has its oldest token's
    staleness as worst, the token-weighted mean as mean, and newest - oldest version as span."""
    import torch

    from knitdata.record import Trajectory
    from knitdata.staleness import TokenStaleness

    tv = torch.tensor([2, 2, 3, 3, 3, 5])
    t = Trajectory(id="p", source="s", group="g", prompt_ids=torch.arange(3), response_ids=torch.arange(6),
                   gen_version=2, token_versions=tv)
    m = t.meta()
    assert (m.gen_version, m.version_span, m.version_mean) == (2, 3, pytest.approx(3.0))
    assert TrajectoryMeta.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    plain = Trajectory(id="q", source="s", group="g", prompt_ids=torch.arange(3), response_ids=torch.arange(6),
                       gen_version=4).meta()
    assert plain.version_span == 0
    ts = TokenStaleness()
    assert ts.summary()["worst"] is None and math.isnan(ts.summary()["token_mean"])
    ts.record(6, [m, plain])
    s = ts.summary()
    assert s == {"count": 2, "token_mean": pytest.approx((3.0 + 2.0) / 2), "span_mean": 1.5, "span_max": 3,
                 "worst": 4, "partial_share": 0.5}
    tr = StalenessTracker()
    tr.record_minibatch(AdmittedMiniBatch(0, 1, 1, (m, plain)), 6)
    summ = tr.summary()
    assert summ["worst"] == 4 and summ["span"]["mean"] == 1.5 and summ["version_mean"]["mean"] == pytest.approx(2.5)
    d = StalenessTracker()
    d.load_state_dict(json.loads(json.dumps(tr.state_dict())))
    assert d.summary() == summ
    with pytest.raises(StateError):
        d.load_state_dict({**tr.state_dict(), "span": ["x"]})


def test_pipeline_reports_token_staleness_and_the_bound() -> None:
    """pipe.stats(): per-token staleness of what was handed out, and the bound's drops; acquire_rollout raises
    RolloutThrottled naming the capacity when the bound leaves no room."""
    import torch

    from knitdata import Pipeline, Trajectory
    from knitdata.admission import BatchSpec
    from knitdata.errors import ConfigError, RolloutThrottled

    def traj(i: int, src: str, v: int, tv: list[int] | None = None) -> Trajectory:
        return Trajectory(id=f"t{i}", source=src, group=f"g{i}", prompt_ids=torch.arange(2),
                          response_ids=torch.arange(4), gen_version=v,
                          token_versions=None if tv is None else torch.tensor(tv))

    spec = BatchSpec({"a": 2, "b": 2}, num_minibatches=2)
    with Pipeline(spec, max_staleness=0) as pipe:  # drop mode
        assert pipe.stats()["staleness_bound"]["on_stale"] == "drop"
        it = iter(pipe.dataset(0, timeout=10))
        pipe.put(traj(0, "a", 0))
        pipe.put(traj(1, "b", 0, [0, 0, 1, 1]))  # step 0 admits a, b (version 0)
        next(it)
        pipe.report_version(1)
        pipe.put(traj(2, "a", 0))  # 1 stale at step 1 > 0: dropped, listed for regeneration
        (d,) = pipe.dropped()
        assert (d["group"], d["source"], d["trajectories"]) == ("g2", "a", ["t2"]) and pipe.dropped() == []
        pipe.put(traj(3, "a", 1))
        pipe.put(traj(4, "b", 1))
        next(it)
        st_ = pipe.stats()
        assert st_["staleness_bound"]["dropped_groups"] == {"a": 1, "b": 0}
        ts = st_["token_staleness"]
        assert ts["count"] == 4 and ts["worst"] == 0 and ts["span_max"] == 1 and ts["partial_share"] == 0.25
        assert st_["held_trajectories"] <= 4  # the dropped payload is freed
    with Pipeline(spec, max_staleness=1, on_stale="wait") as pipe:
        pipe.acquire_rollout({"a": 2, "b": 2}, timeout=1)
        with pytest.raises(RolloutThrottled, match="capacity now"):
            pipe.acquire_rollout("a", 1, timeout=0.05)
        pipe.release_rollout({"a": 1})
        pipe.acquire_rollout("a", 1, timeout=0)
    with Pipeline(spec) as pipe, pytest.raises(ConfigError, match="max_staleness"):
        pipe.rollout_capacity()
    from knitdata.admission import make_policy

    with pytest.raises(ConfigError, match="by name"):
        Pipeline(spec, admission=make_policy("fifo", spec), max_staleness=2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 9), st.floats(0.0, 9.0), st.integers(0, 4)), max_size=6),
                max_size=6), st.integers(0, 12))
def test_token_staleness_batches_equal_one_at_a_time(batches: list, version: int) -> None:
    """TokenStaleness.record sums a batch in one pass: the summary equals recording its trajectories one by one
    (per-trajectory sums, the oldest token, the widest span), whatever the batching."""
    from knitdata.staleness import TokenStaleness

    metas = [[TrajectoryMeta(f"t{i}.{k}", "s", "g", gen_version=g, version_mean=g + f, version_span=s)
              for k, (g, f, s) in enumerate(b)] for i, b in enumerate(batches)]
    batched, single = TokenStaleness(), TokenStaleness()
    for b in metas:
        batched.record(version, b)
        for m in b:
            single.record(version, [m])
    a, z = batched.summary(), single.summary()
    assert (a["count"], a["span_max"], a["worst"]) == (z["count"], z["span_max"], z["worst"])
    for key in ("token_mean", "span_mean", "partial_share"):
        assert (math.isnan(a[key]) and math.isnan(z[key])) or a[key] == pytest.approx(z[key])
    every = [m for b in metas for m in b]
    if every:
        assert a["worst"] == version - min(m.gen_version for m in every)
        assert a["token_mean"] == pytest.approx(sum(version - m.version_mean for m in every) / len(every))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.tuples(st.integers(0, 20), st.floats(0, 5), st.integers(0, 4)), min_size=0, max_size=6),
                     min_size=1, max_size=6),
       version=st.integers(0, 30))
def test_token_staleness_by_sums_equals_by_metas(rows, version: int) -> None:
    """What the control plane records from the sums planned with each entry is what the metas give."""
    from knitdata.staleness import TokenStaleness

    by_metas, by_sums = TokenStaleness(), TokenStaleness()
    for r, row in enumerate(rows):
        metas = [TrajectoryMeta(f"t{r}-{k}", "s", "g", gen_version=g, version_mean=g + m, version_span=span)
                 for k, (g, m, span) in enumerate(row)]
        by_metas.record(version, metas)
        sums = TokenStaleness.sums(metas)
        assert (sums is None) == (not metas)
        if sums is not None:
            by_sums.record_sums(version, json.loads(json.dumps(sums)))  # as a queued entry may carry them
    a, b = by_metas.summary(), by_sums.summary()
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]) or (isinstance(a[k], float) and math.isclose(a[k], b[k], rel_tol=1e-12, abs_tol=1e-12)) \
            or (a[k] != a[k] and b[k] != b[k]), (k, a, b)


def test_a_handout_records_token_staleness_from_the_sums_planned_with_its_entry(monkeypatch) -> None:
    """One source: the control plane records a hand-out's token staleness from the sums it made when it planned the
    entry (no trajectory visited); the figures equal those of the trajectories, partial rollouts included."""
    import torch

    from knitdata import Pipeline, Trajectory
    from knitdata.admission import BatchSpec
    from knitdata.control.state import PlaneState
    from knitdata.staleness import TokenStaleness

    trajs = [Trajectory(id=f"t{i}", source="a", group=f"g{i}", prompt_ids=torch.arange(2),
                        response_ids=torch.arange(4), gen_version=i % 3,
                        token_versions=torch.tensor([i % 3] * 2 + [i % 3 + i % 2] * 2)) for i in range(12)]
    expected = TokenStaleness()
    expected.record(0, [t.meta() for t in trajs])

    def no_visit(self: PlaneState, ids: object) -> list:
        raise AssertionError("a hand-out of a planned entry visited its trajectories")

    with Pipeline(BatchSpec({"a": 6}, num_minibatches=3), token_budget=12) as pipe:
        for t in trajs:
            pipe.put(t)
        pipe.close()
        monkeypatch.setattr(PlaneState, "held_metas", no_visit)
        assert sum(mb.num_sequences for mb in pipe.dataset(0, fetch="iter")) == 12
        monkeypatch.undo()
        got = pipe.stats()["token_staleness"]
    want = expected.summary()
    assert got["count"] == 12 and got["partial_share"] == pytest.approx(want["partial_share"])
    assert got["token_mean"] == pytest.approx(want["token_mean"]) and got["span_max"] == want["span_max"]
    assert got["worst"] == want["worst"] and got["span_mean"] == pytest.approx(want["span_mean"])


# ---------------------------------------------------------------------------------------------------------------
# Staleness split into generating and queued (issue 45)
# ---------------------------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 3), st.integers(0, 25), st.floats(0, 100)),
                     min_size=0, max_size=12),
       chunk=st.integers(1, 5), version=st.integers(25, 40), now=st.floats(100, 200))
def test_split_sums_equal_per_trajectory_figures(rows, chunk: int, version: int, now: float) -> None:
    """PutLog.sums + StalenessSplit.record_sums, over any batching, give per trajectory: generating = put version
    (at least its newest token's version) - gen_version, queued = train version - that, seconds = now - put time;
    generating + queued = the staleness the pipeline reports."""
    from knitdata.staleness import PutLog, StalenessSplit

    log = PutLog()
    metas = []
    for q, (g, span, pv, t) in enumerate(rows):
        log.stamp(q, pv, t)
        metas.append(TrajectoryMeta(f"t{q}", "s", "g", gen_version=g, version_span=span, seq=q))
    split = StalenessSplit()
    for i in range(0, len(metas), chunk):
        split.record_sums(version, now, log.sums(metas[i:i + chunk]))
    got = split.summary()
    puts = [max(pv, g + span) for g, span, pv, _t in rows]
    gen = [p - g for p, (g, *_r) in zip(puts, rows)]
    queued = [version - p for p in puts]
    secs = [now - t for *_r, t in rows]
    assert got["count"] == len(rows)
    if not rows:
        assert math.isnan(got["generating_mean"]) and got["queued_max"] is None
        return
    assert got["generating_mean"] == pytest.approx(np.mean(gen)) and got["generating_max"] == max(gen)
    assert got["queued_mean"] == pytest.approx(np.mean(queued)) and got["queued_max"] == max(queued)
    assert got["queued_s_mean"] == pytest.approx(np.mean(secs)) and got["queued_s_max"] == pytest.approx(max(secs))
    assert min(gen) >= 0
    staleness = [version - g for g, *_r in rows]
    assert got["generating_mean"] + got["queued_mean"] == pytest.approx(np.mean(staleness))


def test_put_log_restarts_forgets_and_skips_unknown_puts() -> None:
    """A put log keeps stamps in seq order: out of order (a snapshot loaded) it starts again; forget_below drops the
    oldest; a meta whose seq has no stamp (-1, forgotten, or before a restart) is left out of the sums."""
    from knitdata.staleness import PutLog, StalenessSplit

    log = PutLog()
    for q in range(5):
        log.stamp(q, 10 + q, float(q))
    assert len(log) == 5
    log.forget_below(3)
    assert (log.base, len(log)) == (3, 2)
    metas = [TrajectoryMeta(f"t{q}", "s", "g", gen_version=9, seq=q) for q in (-1, 0, 2, 3, 4, 5)]
    assert log.sums(metas) == (2, 18, 27, 7.0, 13, 5, 3.0)  # seqs 3 and 4 only
    assert log.sums(metas[:3]) is None
    log.stamp(9, 30, 9.0)  # not the next seq: restarted from 9
    assert (log.base, len(log)) == (9, 1)
    log.restart(4)
    assert (log.base, len(log)) == (4, 0)
    split = StalenessSplit()
    split.record_sums(3, 1.0, None)
    assert split.summary()["count"] == 0 and split.means_since(split.totals()) is None


@pytest.mark.parametrize("sources", [("a",), ("a", "b")])
def test_pipeline_splits_staleness_into_generating_and_queued(sources: tuple[str, ...]) -> None:
    """pipe.stats()["staleness_split"]: a trajectory generated with version 1 and put at trainer version 3, trained
    at 4, spent 2 versions generating and 1 queued; the parts add up to the staleness the pipeline reports; seconds
    queued run from the put to the hand-out. One source (sums planned with the entries) and two (metas visited)."""
    import time

    import torch

    from knitdata import Pipeline, Trajectory
    from knitdata.admission import BatchSpec

    def wait_version(pipe: Pipeline, v: int) -> None:
        deadline = time.monotonic() + 10
        while pipe.stats()["version"] != v:
            assert time.monotonic() < deadline, "report_version never reached the plane"
            time.sleep(0.01)

    spec = BatchSpec({s: 2 for s in sources}, num_minibatches=1)
    n = 2 * len(sources)
    with Pipeline(spec) as pipe:
        it = iter(pipe.dataset(0, timeout=10))
        pipe.report_version(3)
        wait_version(pipe, 3)
        t_put = time.monotonic()
        for i in range(n):
            pipe.put(Trajectory(id=f"t{i}", source=sources[i % len(sources)], group=f"g{i}",
                                prompt_ids=torch.arange(2), response_ids=torch.arange(3), gen_version=1))
        time.sleep(0.05)
        pipe.report_version(4)
        wait_version(pipe, 4)
        mb = next(it)
        assert mb.num_sequences == n
        deadline = time.monotonic() + 10
        while pipe.stats()["staleness_split"]["count"] < n:  # hand-outs are reported in the background
            assert time.monotonic() < deadline
            time.sleep(0.01)
        st_ = pipe.stats()
        split = st_["staleness_split"]
        assert split["count"] == n
        assert (split["generating_mean"], split["generating_max"], split["queued_mean"], split["queued_max"]) == \
            (2.0, 2, 1.0, 1)
        assert split["generating_mean"] + split["queued_mean"] == st_["staleness"]["mean"] == 3
        assert 0.05 <= split["queued_s_mean"] <= split["queued_s_max"] <= time.monotonic() - t_put


def test_plane_forgets_put_stamps_of_released_trajectories(monkeypatch) -> None:
    """The control plane's put log keeps stamps only back to the oldest trajectory it holds (pruned when it
    doubles), so a long run's memory stays bounded; the split still covers every hand-out."""
    import torch

    import knitdata.control.state as state_mod
    from knitdata import Pipeline, Trajectory
    from knitdata.admission import BatchSpec

    monkeypatch.setattr(state_mod, "PUT_LOG_PRUNE", 8)
    with Pipeline(BatchSpec({"a": 2}, num_minibatches=1), release="handout") as pipe:
        plane = pipe.internals.control.state
        plane.put_log_prune_at = 8
        it = iter(pipe.dataset(0, timeout=10))
        longest = 0
        for i in range(60):
            pipe.put(Trajectory(id=f"t{i}", source="a", group=f"g{i}", prompt_ids=torch.arange(2),
                                response_ids=torch.arange(2), gen_version=0))
            if i % 2:
                next(it)
            longest = max(longest, len(plane.put_log))
        assert longest <= 16 and plane.put_log.base > 0
        pipe.close()
        assert sum(1 for _ in it) == 0
    assert pipe.stats()["staleness_split"]["count"] == 60
