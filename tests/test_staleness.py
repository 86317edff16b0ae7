"""Tests of knitdata.staleness: version clock, staleness definitions, summaries."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.admission import AdmittedMiniBatch
from knitdata.errors import ValidationError
from knitdata.record import TrajectoryMeta
from knitdata.staleness import StalenessTracker, VersionClock, percentile, staleness_reduction, summarize


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
