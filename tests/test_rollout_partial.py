"""Tests of knitdata.rollout.partial: segments of interrupted generations become one trajectory with per-token
versions; refusals; JSON state across a worker restart."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.errors import RolloutOutputError, StateError
from knitdata.rollout import PartialRollout, RolloutGroup, RolloutSample, SegmentBuffer, from_sglang


def _seg(rid, prompt, ids, lps, version, status, index=0) -> RolloutSample:
    reason = {"completed": "stop", "truncated": "length", "aborted": "abort"}[status]
    return RolloutSample(rid, index, prompt_ids=prompt, response_ids=ids, logprobs=lps, status=status,
                         finish_reason=reason, version=version)


@st.composite
def _generation(draw):
    prompt = draw(st.lists(st.integers(0, 99), min_size=0, max_size=5))
    n = draw(st.integers(1, 30))
    ids = draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
    lps = [-(i % 5) / 4 for i in range(n)]
    cuts = sorted(draw(st.sets(st.integers(0, n), max_size=6)) | {0, n})  # empty segments allowed
    bumps = draw(st.lists(st.integers(0, 3), min_size=len(cuts) - 1, max_size=len(cuts) - 1))
    final = draw(st.sampled_from(["completed", "truncated"]))
    return prompt, ids, lps, cuts, bumps, final


@settings(max_examples=80, deadline=None)
@given(_generation(), st.integers(0, 5))
def test_any_segment_split_gives_the_one_segment_trajectory(gen, v0) -> None:
    prompt, ids, lps, cuts, bumps, final = gen
    p = PartialRollout("r", 0, prompt)
    versions, v = [], v0
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        v += bumps[k]
        last = k == len(cuts) - 2
        p.add(_seg(f"r-cont{k}", prompt + ids[:a], ids[a:b], lps[a:b], v, final if last else "aborted"))
        versions += [v] * (b - a)
    t = p.trajectory("src")
    one = PartialRollout("r", 0, prompt)
    one.add(_seg("r", prompt, ids, lps, v0, final))
    ref = one.trajectory("src")
    assert t.response_ids.tolist() == ref.response_ids.tolist() == ids
    assert torch.equal(t.tensors["old_logprobs"], ref.tensors["old_logprobs"])
    assert t.token_versions.tolist() == versions and t.gen_version == min(versions) == versions[0]
    if sum(bumps) == bumps[0]:  # one version for every token: the very trajectory of one segment
        ref_v = PartialRollout("r", 0, prompt)
        ref_v.add(_seg("r", prompt, ids, lps, v0 + bumps[0], final))
        assert t.equals(ref_v.trajectory("src"))
    # the state survives JSON at any point, and a restored buffer goes on identically
    restored = PartialRollout.from_dict(json.loads(json.dumps(p.to_dict())))
    assert restored.trajectory("src").equals(t)


def test_segment_buffer_continues_aborted_samples_of_a_group_into_one_group() -> None:
    buf = SegmentBuffer()
    prompt = [1, 2, 3]
    first = RolloutGroup("q", [_seg("q", prompt, [10, 11], [-0.5, -0.5], 4, "completed", 0),
                               _seg("q", prompt, [20], [-1.0], 4, "aborted", 1),
                               _seg("q", prompt, [], [], 4, "aborted", 2)])  # aborted while queued
    assert buf.add_group(first) is None and len(buf) == 1
    pend = buf.pending()
    assert [(c.index, c.input_ids, c.generated) for c in pend] == [(1, [1, 2, 3, 20], 1), (2, [1, 2, 3], 0)]
    # the worker restarts: its state goes through JSON
    state = json.loads(json.dumps(buf.state_dict()))
    buf = SegmentBuffer()
    buf.load_state_dict(state)
    assert buf.add(_seg("new-1", [1, 2, 3, 20], [21, 2], [-0.25, -0.25], 5, "completed"), request_id="q", index=1) is None
    done = buf.add(_seg("new-2", [1, 2, 3], [30, 31, 32], [-0.1] * 3, 6, "truncated"), request_id="q", index=2)
    assert done is not None and len(buf) == 0 and buf.pending() == []
    ts = done.trajectories("math", scalars=[{"reward": 1.0}] * 3)
    assert [t.id for t in ts] == ["q-0", "q-1", "q-2"] and {t.group for t in ts} == {"q"}
    assert [t.token_versions.tolist() for t in ts] == [[4, 4], [4, 5, 5], [6, 6, 6]]
    assert [t.gen_version for t in ts] == [4, 4, 6]
    assert ts[1].response_ids.tolist() == [20, 21, 2]
    assert ts[1].tensors["old_logprobs"].tolist() == [-1.0, -0.25, -0.25]
    with pytest.raises(RolloutOutputError, match="no such request"):
        buf.add(_seg("x", [1], [2], [-1.0], 7, "completed"), request_id="q", index=0)


def test_sglang_abort_then_continuation_under_new_weights() -> None:
    def resp(ids, reason, version):
        return {"output_ids": ids, "meta_info": {"id": "s1", "finish_reason": reason, "weight_version": str(version),
                                                 "output_token_logprobs": [[-0.5, t, None] for t in ids]}}

    buf = SegmentBuffer()
    assert buf.add_group(from_sglang(resp([7, 8], {"type": "abort", "message": "update"}, 3), prompt_ids=[1])) is None
    [c] = buf.pending()
    seg = from_sglang(resp([9, 2], {"type": "stop", "matched": 2}, 4), prompt_ids=c.input_ids, request_id="s1-c")
    g = buf.add(seg.samples[0], request_id=c.request_id, index=c.index)
    t = g.trajectories("m")[0]
    assert t.token_versions.tolist() == [3, 3, 4, 4] and t.gen_version == 3 and t.id == "s1-0"


def test_the_last_segments_tensors_and_the_media_are_carried() -> None:
    import base64

    import numpy as np

    from knitdata.rollout import attach_media

    def resp(ids, reason, version, rows):
        routed = base64.b64encode(np.arange(rows * 2, dtype="<i4").tobytes()).decode()
        return {"output_ids": ids, "meta_info": {"id": "m", "finish_reason": {"type": reason},
                                                 "weight_version": str(version), "routed_experts": routed,
                                                 "output_token_logprobs": [[-0.5, t, None] for t in ids]}}

    img = np.zeros((4, 4, 3), dtype=np.uint8)
    first = attach_media(from_sglang(resp([7], "abort", 1, 2), prompt_ids=[1, 120]), [img], placeholder_ids={"image": 120})
    buf = SegmentBuffer()
    buf.add_group(first)
    state = json.loads(json.dumps(buf.state_dict()))
    [c] = buf.pending()
    done = buf.add(from_sglang(resp([8, 2], "stop", 2, 4), prompt_ids=c.input_ids).samples[0], request_id="m", index=0)
    t = done.trajectories("vqa")[0]
    assert t.tensors["routed_experts"].shape == (4, 2) and len(t.media) == 1  # prompt + output - 1 rows
    restored = SegmentBuffer()
    restored.load_state_dict(state)
    assert restored.partial("m", 0).tensors["routed_experts"].tolist() == first.samples[0].tensors["routed_experts"].tolist()
    assert restored.partial("m", 0).tensors["routed_experts"].dtype == torch.int32
    assert restored.partial("m", 0).media == []  # media are not part of the state: attach them to the finished group


def test_bad_segments_are_refused() -> None:
    p = PartialRollout("r", 0, [1, 2])
    p.add(_seg("r", [1, 2], [5], [-1.0], 3, "aborted"))
    with pytest.raises(RolloutOutputError, match="first difference at position 2") as ei:
        p.add(_seg("r", [1, 2, 6], [7], [-1.0], 4, "completed"))  # the continuation's prompt lost token 5
    assert ei.value.field == "prompt_ids" and ei.value.request_id == "r"
    with pytest.raises(RolloutOutputError, match="older") as ei:
        p.add(_seg("r", [1, 2, 5], [7], [-1.0], 2, "completed"))
    assert ei.value.field == "version"
    with pytest.raises(RolloutOutputError, match="some segments only") as ei:
        p.add(_seg("r", [1, 2, 5], [7], None, 4, "completed"))
    assert ei.value.field == "logprobs"
    with pytest.raises(RolloutOutputError, match="no policy version"):
        p.add(_seg("r", [1, 2, 5], [7], [-1.0], None, "completed"))
    with pytest.raises(RolloutOutputError, match="not finished"):
        p.sample()
    p.add(_seg("r", [1, 2, 5], [7], [-1.0], 4, "completed"))
    with pytest.raises(RolloutOutputError, match="cannot be continued") as ei:
        p.add(_seg("r", [1, 2, 5, 7], [8], [-1.0], 4, "completed"))
    assert ei.value.field == "status"
    buf = SegmentBuffer()
    g = RolloutGroup("q", [_seg("q", [1], [2], [-1.0], 0, "aborted")])
    buf.add_group(g)
    with pytest.raises(RolloutOutputError, match="already being continued"):
        buf.add_group(g)
    with pytest.raises(RolloutOutputError, match="has 1 samples"):
        buf.add(_seg("q", [1, 2], [3], [-1.0], 1, "completed"), index=3)
    with pytest.raises(RolloutOutputError, match="not 0..n-1"):
        SegmentBuffer().add_group(RolloutGroup("z", [_seg("z", [1], [2], [-1.0], 0, "completed", index=1)]))
    buf.discard("q")
    assert len(buf) == 0
    with pytest.raises(StateError):
        buf.load_state_dict({"format": "other"})
    with pytest.raises(StateError):
        buf.load_state_dict({"format": SegmentBuffer().state_dict()["format"], "requests": [[{"request_id": "q"}]]})


def test_the_documented_from_state_dict_restores_a_buffer() -> None:
    """Issue 45.8: the module documents ``from_state_dict``: SegmentBuffer.from_state_dict builds the restarted
    worker's buffer from the JSON state (as load_state_dict does into an empty one), and refuses another format."""
    import knitdata.rollout.partial as partial

    assert "from_state_dict" in (partial.__doc__ or "")
    buf = SegmentBuffer()
    buf.add_group(RolloutGroup("q", [_seg("q", [1, 2], [7], [-0.5], 3, "aborted", 0),
                                     _seg("q", [1, 2], [8, 2], [-0.5, -0.5], 3, "completed", 1)]))
    state = json.loads(json.dumps(buf.state_dict()))
    restored = SegmentBuffer.from_state_dict(state)
    assert isinstance(restored, SegmentBuffer) and restored.state_dict() == state
    assert [(c.request_id, c.index, c.input_ids) for c in restored.pending()] == [("q", 0, [1, 2, 7])]
    with pytest.raises(StateError, match="segment buffer"):
        SegmentBuffer.from_state_dict({"format": "other"})
