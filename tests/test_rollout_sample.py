"""Tests of knitdata.rollout.sample: checks of a sample, trajectories of a sample and of a group."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.errors import RolloutOutputError
from knitdata.record import Trajectory
from knitdata.rollout import RolloutGroup, RolloutSample
from knitdata.rollout.sample import as_logprobs, as_token_ids, safe_id


def _sample(**kw) -> RolloutSample:
    base = dict(request_id="r1", index=0, prompt_ids=[1, 2], response_ids=[3, 4, 5], logprobs=[-0.1, -0.2, -0.3],
                status="completed", finish_reason="stop", version=2)
    base.update(kw)
    return RolloutSample(**base)


def test_sample_becomes_a_trajectory_with_logprobs_version_and_group() -> None:
    t = _sample().to_trajectory("math", scalars={"reward": 1.0})
    assert isinstance(t, Trajectory) and t.id == "r1-0" and t.group == "r1" and t.source == "math"
    assert t.gen_version == 2 and t.token_versions is None and t.scalars == {"reward": 1.0}
    assert t.tensors["old_logprobs"].dtype == torch.float32
    assert torch.allclose(t.tensors["old_logprobs"], torch.tensor([-0.1, -0.2, -0.3]))
    assert t.response_ids.dtype == torch.int64 and t.prompt_ids.tolist() == [1, 2]
    t2 = _sample(token_versions=[4, 2, 3], version=None).to_trajectory("math", logprobs_key="behaviour_logp")
    assert t2.gen_version == 2 and t2.token_versions.tolist() == [4, 2, 3] and "behaviour_logp" in t2.tensors


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(logprobs=[-0.1, -0.2]), "logprobs"),
        (dict(loss_mask=[1, 1]), "loss_mask"),
        (dict(token_versions=[1, 2]), "token_versions"),
        (dict(response_ids=[]), "response_ids"),
        (dict(response_ids=[1.5, 2, 3]), "response_ids"),
        (dict(prompt_ids=[True, 2]), "prompt_ids"),
        (dict(prompt_ids=[-1, 2]), "prompt_ids"),
        (dict(prompt_ids=None), "prompt_ids"),
        (dict(prompt_ids=[2**64]), "prompt_ids"),
        (dict(prompt_ids=3), "prompt_ids"),
        (dict(prompt_ids=[[1, 2]]), "prompt_ids"),
        (dict(prompt_ids=torch.tensor([1.0, 2.0])), "prompt_ids"),
        (dict(logprobs=[-0.1, float("nan"), -0.3]), "logprobs"),
        (dict(logprobs=[-0.1, 0.5, -0.3]), "logprobs"),
        (dict(logprobs=[-0.1, None, -0.3]), "logprobs"),
        (dict(status="done"), "status"),
        (dict(version=-1), "version"),
        (dict(version=True), "version"),
        (dict(index=-1), "index"),
        (dict(tensors={"x": [1]}), "tensors"),
    ],
)
def test_malformed_samples_are_refused_naming_request_sample_and_field(kw, field) -> None:
    with pytest.raises(RolloutOutputError) as ei:
        _sample(**kw)
    assert ei.value.field == field and ei.value.request_id == "r1"
    assert "request 'r1'" in str(ei.value) and f"field '{field}'" in str(ei.value)


def test_aborted_unversioned_or_logprob_free_samples_do_not_become_trajectories() -> None:
    with pytest.raises(RolloutOutputError, match="aborted.*SegmentBuffer") as ei:
        _sample(status="aborted", finish_reason="abort").to_trajectory("m")
    assert ei.value.field == "status"
    assert _sample(status="aborted", response_ids=[], logprobs=[]).response_ids.numel() == 0  # aborted may be empty
    with pytest.raises(RolloutOutputError, match="version=") as ei:
        _sample(version=None).to_trajectory("m")
    assert ei.value.field == "version"
    with pytest.raises(RolloutOutputError, match="logprobs") as ei:
        _sample(logprobs=None).to_trajectory("m")
    assert ei.value.field == "logprobs"
    assert "old_logprobs" not in _sample(logprobs=None).to_trajectory("m", require_logprobs=False).tensors
    with pytest.raises(RolloutOutputError, match="already hold"):
        _sample(tensors={"old_logprobs": torch.zeros(3)}).to_trajectory("m")


def test_group_checks_members_and_puts_whole_groups_only() -> None:
    g = RolloutGroup("r1", [_sample(index=0), _sample(index=1)])
    ts = g.trajectories("math", scalars=[{"reward": 0.0}, {"reward": 1.0}])
    assert [t.id for t in ts] == ["r1-0", "r1-1"] and {t.group for t in ts} == {"r1"}
    with pytest.raises(RolloutOutputError, match="2 scalar mappings|1 scalar mappings"):
        g.trajectories("math", scalars=[{}])
    with pytest.raises(RolloutOutputError, match="repeated"):
        RolloutGroup("r1", [_sample(), _sample()])
    with pytest.raises(RolloutOutputError, match="belongs to request"):
        RolloutGroup("r2", [_sample()])
    with pytest.raises(RolloutOutputError, match="at least one"):
        RolloutGroup("r1", [])
    ab = RolloutGroup("r1", [_sample(index=0), _sample(index=1, status="aborted", finish_reason="abort")])
    assert [s.index for s in ab.aborted] == [1]
    with pytest.raises(RolloutOutputError, match=r"samples \[1\] were aborted"):
        ab.trajectories("math")


def test_ids_are_made_safe_for_trajectories() -> None:
    s = _sample(request_id="cmpl-a/b.c")
    assert safe_id("x./\\y") == "x___y" and s.trajectory_id == "cmpl-a_b_c-0"
    assert s.to_trajectory("m").group == "cmpl-a_b_c"
    assert json.loads(json.dumps(s.to_dict()))["request_id"] == "cmpl-a/b.c"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=20), st.sampled_from(["list", "numpy", "tensor"]))
def test_token_ids_in_any_container_give_the_same_int64_tensor(ids, kind) -> None:
    raw = {"list": ids, "numpy": np.array(ids, dtype=np.int64), "tensor": torch.tensor(ids, dtype=torch.int64)}[kind]
    t = as_token_ids(raw)
    assert t.dtype == torch.int64 and t.tolist() == ids
    lp = as_logprobs([-float(i % 7) for i in ids])
    assert lp.dtype == torch.float32 and lp.numel() == len(ids)
