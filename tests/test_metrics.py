"""knitdata.observe.metrics: the per-step series of ConsumerMetrics (wait and exposed data wait per optimizer step)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from knitdata.observe.metrics import ConsumerMetrics

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
