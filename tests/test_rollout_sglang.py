"""Tests of knitdata.rollout.sglang against SGLang's documented native ``/generate`` response format.

SGLang cannot be installed here: the responses are JSON dicts of the documented shape (``output_ids``,
``meta_info`` with ``output_token_logprobs`` triples, ``finish_reason``, ``weight_version``, ``routed_experts``);
no SGLang server runs in these tests.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.errors import RolloutOutputError
from knitdata.rollout import from_sglang
from knitdata.rollout.sglang import decode_routed_experts


def _resp(ids, *, reason=None, version="3", rid="9f2c", routed=None, logprobs=True) -> dict:
    meta = {"id": rid, "finish_reason": reason or {"type": "stop", "matched": 2}, "prompt_tokens": 3,
            "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": version}
    if logprobs:
        meta["output_token_logprobs"] = [[-0.5 / (k + 1), t, None] for k, t in enumerate(ids)]
    if routed is not None:
        meta["routed_experts"] = routed
    return json.loads(json.dumps({"text": "...", "output_ids": list(ids), "meta_info": meta}))


def test_n_responses_are_one_group_with_the_servers_weight_version() -> None:
    resps = [_resp([5, 2]), _resp([6, 7], reason={"type": "length", "length": 2}),
             _resp([8], reason={"type": "abort", "message": "weight update"})]
    g = from_sglang(resps, prompt_ids=[1, 2, 3], request_id="q1")
    assert g.request_id == "q1" and [s.status for s in g.samples] == ["completed", "truncated", "aborted"]
    assert all(s.version == 3 for s in g.samples)
    assert g.samples[0].logprobs.tolist() == [-0.5, -0.25]
    assert from_sglang(resps[0], prompt_ids=[1, 2, 3]).request_id == "9f2c"  # meta_info.id
    t = from_sglang(resps[:2], prompt_ids=[1, 2, 3], request_id="q1").trajectories("code")
    assert [x.id for x in t] == ["q1-0", "q1-1"] and t[0].gen_version == 3
    assert from_sglang(_resp([5], reason="stop"), prompt_ids=[1]).samples[0].status == "completed"  # a plain string


def test_version_argument_and_weight_version_must_agree() -> None:
    assert from_sglang(_resp([5], version="default"), prompt_ids=[1], version=7).samples[0].version == 7
    assert from_sglang(_resp([5], version="7"), prompt_ids=[1], version=7).samples[0].version == 7
    with pytest.raises(RolloutOutputError, match="reports weight version 3, version= says 4") as ei:
        from_sglang(_resp([5]), prompt_ids=[1], version=4)
    assert ei.value.field == "meta_info.weight_version" and ei.value.request_id == "9f2c"
    with pytest.raises(RolloutOutputError, match="not an integer"):
        from_sglang(_resp([5], version="default"), prompt_ids=[1])


def test_routed_experts_are_decoded_per_token() -> None:
    prompt, ids, k = [1, 2, 3], [5, 6], 4  # rows: prompt + output - 1
    arr = np.arange(4 * k, dtype="<i4").reshape(4, k)
    g = from_sglang(_resp(ids, routed=base64.b64encode(arr.tobytes()).decode()), prompt_ids=prompt)
    re = g.samples[0].tensors["routed_experts"]
    assert re.dtype == torch.int32 and re.tolist() == arr.tolist()
    assert g.trajectories("m")[0].tensors["routed_experts"].shape == (4, k)
    assert decode_routed_experts(arr.tolist(), 4).tolist() == arr.tolist()
    with pytest.raises(RolloutOutputError, match="do not split into 5 rows") as ei:
        from_sglang(_resp(ids + [7], routed=base64.b64encode(arr[:, :3].tobytes()).decode()), prompt_ids=prompt)
    assert ei.value.field == "meta_info.routed_experts"
    with pytest.raises(RolloutOutputError, match="not base64"):
        from_sglang(_resp(ids, routed="***"), prompt_ids=prompt)


def test_malformed_responses_are_refused_naming_request_and_field() -> None:
    def err(resp, **kw) -> RolloutOutputError:
        with pytest.raises(RolloutOutputError) as ei:
            from_sglang(resp, **{"prompt_ids": [1, 2], **kw})
        return ei.value

    r = _resp([5, 6])
    r["meta_info"]["output_token_logprobs"] = r["meta_info"]["output_token_logprobs"][:1]
    e = err(r)
    assert e.field == "meta_info.output_token_logprobs" and e.request_id == "9f2c" and e.sample == 0
    r = _resp([5, 6])
    r["meta_info"]["output_token_logprobs"][1][1] = 99
    assert err(r).field == "meta_info.output_token_logprobs"
    e = err(_resp([5], logprobs=False))
    assert e.field == "meta_info.output_token_logprobs" and "return_logprob=True" in str(e)
    assert from_sglang(_resp([5], logprobs=False), prompt_ids=[1], require_logprobs=False).samples[0].logprobs is None
    assert err(_resp([5], reason={"type": "preempted"})).field == "meta_info.finish_reason"
    assert err(_resp([5], reason={"type": None})).field == "meta_info.finish_reason"
    r = _resp([5])
    del r["meta_info"]
    assert err(r, request_id="x").field == "meta_info"
    r = _resp([5], logprobs=False)
    del r["output_ids"]
    assert err(r).field == "output_ids"
    assert err(_resp([5], rid="")).field == "meta_info.id"
    assert err([]).field == "response"
    assert err(_resp([5]), prompt_ids=[1.5]).field == "prompt_ids"
    r = _resp([5])
    r["meta_info"]["output_token_logprobs"] = [[-0.5]]
    assert err(r).field == "meta_info.output_token_logprobs"


def test_output_ids_default_to_the_logprob_triples() -> None:
    r = _resp([5, 6])
    del r["output_ids"]
    assert from_sglang(r, prompt_ids=[1]).samples[0].response_ids.tolist() == [5, 6]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 500), min_size=1, max_size=10), min_size=1, max_size=4),
       st.sampled_from([None, "short", "id", "reason", "meta"]), st.data())
def test_random_responses_round_trip_and_any_corruption_is_named(outputs, corruption, data) -> None:
    resps = [_resp(ids) for ids in outputs]
    if corruption is None:
        g = from_sglang(resps, prompt_ids=[1, 2], request_id="q")
        assert [s.response_ids.tolist() for s in g.samples] == outputs
        assert all(s.logprobs.numel() == len(ids) and s.version == 3 for s, ids in zip(g.samples, outputs))
        return
    k = data.draw(st.integers(0, len(resps) - 1))
    meta = resps[k]["meta_info"]
    if corruption == "short":
        meta["output_token_logprobs"].pop()
    elif corruption == "id":
        meta["output_token_logprobs"][0][1] += 1000
    elif corruption == "reason":
        meta["finish_reason"] = {"type": "weird"}
    else:
        del resps[k]["meta_info"]
    with pytest.raises(RolloutOutputError) as ei:
        from_sglang(resps, prompt_ids=[1, 2], request_id="q")
    want = {"short": "meta_info.output_token_logprobs", "id": "meta_info.output_token_logprobs",
            "reason": "meta_info.finish_reason", "meta": "meta_info"}[corruption]
    assert (ei.value.field, ei.value.request_id, ei.value.sample) == (want, "q", k)
