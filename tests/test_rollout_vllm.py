"""Tests of knitdata.rollout.vllm against vLLM's documented ``RequestOutput`` / ``CompletionOutput`` format.

vLLM cannot be installed here: the outputs are stand-in objects with vLLM's attribute names (``vllm/outputs.py``,
``Logprob`` from ``vllm/logprobs.py``); no vLLM engine runs in these tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.errors import RolloutOutputError
from knitdata.rollout import from_vllm


@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: Any = None


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None
    extra: dict = field(default_factory=dict)


def _completion(index: int, ids: list[int], reason: str = "stop", top: int = 2) -> CompletionOutput:
    lps = [{t: Logprob(-0.1 * (k + 1), rank=1), **{t + 100 + j: Logprob(-5.0, rank=2 + j) for j in range(top)}}
           for k, t in enumerate(ids)]
    return CompletionOutput(index, "", ids, sum(-0.1 * (k + 1) for k in range(len(ids))), lps, reason)


def _request(outputs: list[CompletionOutput], rid: str = "req-3") -> RequestOutput:
    return RequestOutput(rid, "p", [1, 2, 3], None, outputs, True)


def test_request_with_n_samples_is_one_group_of_trajectories() -> None:
    out = _request([_completion(1, [7, 8], "length"), _completion(0, [4, 5, 2], "stop")])
    g = from_vllm(out, version=5)
    assert g.request_id == "req-3" and [s.index for s in g.samples] == [0, 1]
    assert [s.status for s in g.samples] == ["completed", "truncated"]
    assert g.samples[0].logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3])
    ts = g.trajectories("math", scalars=[{"reward": 1.0}, {"reward": 0.0}])
    assert [t.id for t in ts] == ["req-3-0", "req-3-1"] and {t.group for t in ts} == {"req-3"}
    assert all(t.gen_version == 5 and t.prompt_ids.tolist() == [1, 2, 3] for t in ts)
    assert ts[1].response_ids.tolist() == [7, 8]
    assert torch.equal(ts[1].tensors["old_logprobs"], torch.tensor([-0.1, -0.2]))


def test_aborted_output_is_a_sample_to_continue() -> None:
    g = from_vllm(_request([_completion(0, [4], "abort")]), version=1)
    assert g.samples[0].status == "aborted" and len(g.aborted) == 1


def test_malformed_outputs_are_refused_naming_request_and_field() -> None:
    def err(out, **kw) -> RolloutOutputError:
        with pytest.raises(RolloutOutputError) as ei:
            from_vllm(out, **{"version": 0, **kw})
        assert "request 'req-3'" in str(ei.value) or ei.value.field == "request_id"
        return ei.value

    c = _completion(0, [4, 5])
    c.logprobs = c.logprobs[:1]  # length mismatch
    assert err(_request([c])).field == "logprobs"
    c = _completion(0, [4, 5])
    c.logprobs[1] = {99: Logprob(-1.0)}  # the sampled token is missing from its position
    e = err(_request([c]))
    assert e.field == "logprobs" and "position 1" in str(e)
    c = _completion(0, [4, 5])
    c.logprobs = None  # missing logprobs (SamplingParams(logprobs=None))
    assert "SamplingParams(logprobs=0)" in str(err(_request([c])))
    assert from_vllm(_request([c]), version=0, require_logprobs=False).samples[0].logprobs is None
    c = _completion(0, [4, 5])
    c.finish_reason = "timeout"
    assert err(_request([c])).field == "finish_reason"
    c.finish_reason = None  # still running
    assert "has not finished" in str(err(_request([c])))
    c = _completion(0, [4, 5])
    c.cumulative_logprob = -3.0
    assert err(_request([c])).field == "cumulative_logprob"
    out = _request([_completion(0, [4])])
    out.prompt_token_ids = None
    assert err(out).field == "prompt_token_ids"
    assert err(_request([])).field == "outputs"
    assert err(_request([_completion(0, [4])], rid="")).field == "request_id"
    c = _completion(0, [4, 5])
    c.logprobs[0] = {4: Logprob(math.nan)}
    c.cumulative_logprob = None
    assert err(_request([c])).field == "logprobs"


def test_plain_float_logprobs_are_accepted() -> None:
    c = CompletionOutput(0, "", [4, 5], None, [{4: -0.5}, {5: -0.25}], "stop")
    assert from_vllm(_request([c]), version=0).samples[0].logprobs.tolist() == [-0.5, -0.25]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 500), min_size=1, max_size=12), st.sampled_from(["stop", "length",
                                                                                                   "abort"])),
                min_size=1, max_size=4),
       st.sampled_from([None, "drop_position", "wrong_token", "cumulative", "reason"]), st.data())
def test_random_outputs_round_trip_and_any_corruption_is_named(samples, corruption, data) -> None:
    outs = [_completion(i, ids, reason) for i, (ids, reason) in enumerate(samples)]
    if corruption is None:
        g = from_vllm(_request(outs), version=1)
        for s, (ids, reason) in zip(g.samples, samples):
            assert s.response_ids.tolist() == ids and s.logprobs.numel() == len(ids)
            assert s.status == {"stop": "completed", "length": "truncated", "abort": "aborted"}[reason]
        return
    bad = outs[data.draw(st.integers(0, len(outs) - 1))]
    if corruption == "drop_position":
        bad.logprobs = bad.logprobs[:-1]
    elif corruption == "wrong_token":
        k = data.draw(st.integers(0, len(bad.token_ids) - 1))
        bad.logprobs[k] = {bad.token_ids[k] + 1000: Logprob(-1.0)}
    elif corruption == "cumulative":
        bad.cumulative_logprob -= 1.0
    else:
        bad.finish_reason = "weird"
    with pytest.raises(RolloutOutputError) as ei:
        from_vllm(_request(outs), version=1)
    want = {"drop_position": "logprobs", "wrong_token": "logprobs", "cumulative": "cumulative_logprob",
            "reason": "finish_reason"}[corruption]
    assert (ei.value.field, ei.value.request_id, ei.value.sample) == (want, "req-3", bad.index)
