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
