"""Tests of knitdata.rollout.status: finish reasons to statuses; unknown ones refused."""

from __future__ import annotations

import pytest

from knitdata.errors import RolloutOutputError, ValidationError
from knitdata.rollout import FINISH_REASONS, STATUSES, finish_status


def test_finish_reasons_map_to_three_statuses_and_unknown_ones_are_refused() -> None:
    assert finish_status("stop") == "completed" and finish_status("tool_calls") == "completed"
    assert finish_status("length") == "truncated" and finish_status("abort") == "aborted"
    assert set(FINISH_REASONS.values()) == set(STATUSES)
    with pytest.raises(RolloutOutputError, match=r"request 'q': sample 1: field 'finish_reason': unknown finish reason"):
        finish_status("content_filter", request_id="q", sample=1)
    assert finish_status("content_filter", extra={"content_filter": "completed"}) == "completed"
    with pytest.raises(RolloutOutputError, match="has not finished"):
        finish_status(None, request_id="q")
    with pytest.raises(RolloutOutputError, match="unknown status"):
        finish_status("x", extra={"x": "done"})
    e = pytest.raises(RolloutOutputError, finish_status, 3, request_id="q", sample=0).value
    assert isinstance(e, ValidationError) and isinstance(e, ValueError)
    assert (e.request_id, e.sample, e.field, e.trajectory_id) == ("q", 0, "finish_reason", None)
