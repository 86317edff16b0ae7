"""knitdata.observe.metrics: the per-step series of ConsumerMetrics (wait and exposed data wait per optimizer step);
summarize."""

from __future__ import annotations

import math
import statistics
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.observe.metrics import ConsumerMetrics, summarize

waits = st.lists(st.tuples(st.floats(0, 5), st.floats(0, 1), st.booleans()), max_size=60)


@given(events=waits)
def test_per_step_series_sum_the_waits_of_each_step(events: list[tuple[float, float, bool]]) -> None:
    m = ConsumerMetrics(rank=0)
    steps: list[tuple[float, float]] = []
    cur = [0.0, 0.0]
    for seconds, share, is_last in events:
        m.record_wait(seconds, is_last=is_last, data_wait=seconds * share)
        cur[0] += seconds
        cur[1] += seconds * share
        if is_last:
            steps.append((cur[0], cur[1]))
            cur = [0.0, 0.0]
    assert m.steps == len(steps)
    assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(m.wait_per_step_s, [s[0] for s in steps]))
    assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(m.data_wait_per_step_s, [s[1] for s in steps]))
    d = m.to_dict()
    assert d["steps"] == len(steps)
    assert d["last_step_data_wait_s"] == (m.data_wait_per_step_s[-1] if steps else 0.0)
    assert d["last_step_wait_s"] >= d["last_step_data_wait_s"]
    m.reset()
    assert m.steps == 0 and m.data_wait_per_step_s == []


def _sorted_summary(values: list) -> dict:
    """The definition: order statistics of the sorted values."""
    v = sorted(values)
    n = len(v)
    if not n:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
    return {"count": n, "mean": statistics.fmean(v), "p50": v[(n - 1) // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2]),
            "p95": v[min(n - 1, int(round(0.95 * (n - 1))))], "max": v[-1]}


@settings(max_examples=100)
@given(values=st.one_of(st.lists(st.floats(-1e6, 1e6), max_size=400), st.lists(st.integers(-50, 50), max_size=400)))
def test_summarize_is_the_sorted_definition(values: list) -> None:
    """Long float series take the partition path, short ones and integers the sort: the same figures and types."""
    for given_as in (values, deque(values), iter(values)):
        got = summarize(given_as)
        want = _sorted_summary(values)
        assert got == want
        assert [type(got[k]) for k in want] == [type(want[k]) for k in want]
