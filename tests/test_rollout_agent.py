"""Tests of knitdata.rollout.agent: multi-turn episodes concatenated, tool and observation tokens masked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.consumer.collate import TokenCollator
from knitdata.errors import RolloutOutputError
from knitdata.rollout import MultiTurn, RolloutGroup, RolloutSample, from_openai


def _turn(prompt, ids, version, status="completed", lps=True) -> RolloutSample:
    return RolloutSample("t", 0, prompt_ids=prompt, response_ids=ids, logprobs=[-0.5] * len(ids) if lps else None,
                         status=status, finish_reason={"completed": "stop", "truncated": "length",
                                                       "aborted": "abort"}[status], version=version)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(3, 99), min_size=0, max_size=4),   # observation before the turn
                          st.lists(st.integers(3, 99), min_size=1, max_size=5),   # model tokens
                          st.integers(0, 2)),                                     # version bump
                min_size=1, max_size=5),
       st.booleans())
def test_turns_concatenate_with_model_tokens_trained_and_the_rest_masked(turns, explicit) -> None:
    ep = MultiTurn("ep", [1, 2])
    want_ids, want_mask, want_v, v = [], [], [], 3
    for k, (obs, model, bump) in enumerate(turns):
        v += bump
        if k == 0:  # an observation before the first model turn is part of the prompt
            ep.add_observation(obs)
        elif explicit:
            ep.add_observation(obs)
            want_ids += obs; want_mask += [0] * len(obs); want_v += [want_v[-1]] * len(obs)  # noqa: E702
        else:  # the engine's prompt for this turn holds the observation: it is taken as masked tokens
            want_ids += obs; want_mask += [0] * len(obs); want_v += [want_v[-1]] * len(obs)  # noqa: E702
        prompt = ep.context + ([] if explicit or k == 0 else obs)
        ep.add_model(_turn(prompt, model, v))
        want_ids += model; want_mask += [1] * len(model); want_v += [v] * len(model)  # noqa: E702
    s = ep.sample()
    assert s.prompt_ids.tolist() == [1, 2] + turns[0][0]
    assert s.response_ids.tolist() == want_ids and s.loss_mask.tolist() == want_mask
    assert s.token_versions.tolist() == want_v and s.logprobs.numel() == len(want_ids)
    assert s.logprobs[torch.tensor(want_mask) == 0].abs().sum() == 0
    t = s.to_trajectory("agent")
    assert t.gen_version == min(want_v) == turns[0][2] + 3
    # the collate trains on model tokens only
    mb = TokenCollator()([t])
    n = t.prompt_ids.numel()
    assert mb.loss_mask[0, n:n + len(want_ids)].tolist() == [float(x) for x in want_mask]


def test_agent_harness_records_from_an_openai_compatible_server() -> None:
    def chat(prompt, ids, reason="tool_calls"):
        return {"id": "c", "prompt_token_ids": prompt, "choices": [{
            "index": 0, "finish_reason": reason, "token_ids": ids, "message": {"role": "assistant"},
            "logprobs": {"content": [{"token": "x", "logprob": -0.5} for _ in ids]}}]}

    ep = MultiTurn("task-4", [1, 2, 3], index=1)
    ep.add_model(from_openai(chat([1, 2, 3], [40, 41]), version=7).samples[0])
    ep.add_model(from_openai(chat([1, 2, 3, 40, 41, 90, 91], [42, 2], "stop"), version=8).samples[0])
    s = ep.sample()
    assert (s.status, s.finish_reason, s.index, s.version) == ("completed", "stop", 1, 8)
    assert s.loss_mask.tolist() == [1, 1, 0, 0, 1, 1]
    g = RolloutGroup("task-4", [s])
    [t] = g.trajectories("tools")
    assert t.id == "task-4-1" and t.gen_version == 7 and t.token_versions.tolist() == [7, 7, 7, 7, 8, 8]


def test_episodes_that_do_not_extend_are_refused() -> None:
    ep = MultiTurn("ep", [1, 2])
    with pytest.raises(RolloutOutputError, match="no model turn"):
        ep.sample()
    ep.add_model(_turn([1, 2], [5, 6], 0))
    with pytest.raises(RolloutOutputError, match="re-tokenized") as ei:
        ep.add_model(_turn([1, 2, 5, 7, 8], [9], 1))  # the harness re-tokenized turn 0
    assert (ei.value.field, ei.value.request_id, ei.value.sample) == ("prompt_ids", "ep", 0)
    with pytest.raises(RolloutOutputError, match="aborted") as ei:
        ep.add_model(_turn([1, 2, 5, 6], [9], 1, status="aborted"))
    assert ei.value.field == "status"
    with pytest.raises(RolloutOutputError, match="no policy version"):
        ep.add_model(_turn([1, 2, 5, 6], [9], None))
    ep.add_model(_turn([1, 2, 5, 6], [9], 1, lps=False))
    assert ep.sample().logprobs is None  # a turn without log-probs: the episode has none


# ---------------------------------------------------------------- screenshots in observations
from knitdata import BatchSpec, MediaItem, Pipeline  # noqa: E402
from knitdata.errors import MediaRefError  # noqa: E402

IMG = 120  # the image placeholder; the engine expands each to 4 tokens


def _shot(seed: int) -> MediaItem:
    g = torch.Generator().manual_seed(seed)
    return MediaItem("image", tensor=torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g))


def _episode(index: int, shots: list[MediaItem], request_id: str = "task") -> MultiTurn:
    """An episode: the prompt shows shots[0]; before model turn k > 0 an observation shows shots[k]."""
    ep = MultiTurn(request_id, [1, IMG, IMG, IMG, IMG, 2], index=index, media=[shots[0]], placeholder_ids={"image": IMG})
    for k in range(len(shots)):
        if k:
            ep.add_observation([7, IMG, IMG, IMG, IMG, 8], media=[shots[k]])
        ep.add_model(RolloutSample(request_id, index, prompt_ids=_expand(ep.context) + [30 + k],  # + a template token
                                   response_ids=[40 + k, 50 + k], logprobs=[-0.5, -0.25], version=k))
    return ep


def _expand(ids: list[int]) -> list[int]:
    """The engine's view of a context: each collapsed placeholder expanded to 4 tokens."""
    out: list[int] = []
    for t in ids:
        out.extend([IMG] * 4 if t == IMG else [t])
    return out


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6))
def test_screenshots_follow_their_observations_in_the_sample_and_every_later_turn(seeds) -> None:
    shots = [_shot(x) for x in seeds]
    ep = _episode(0, shots)
    s = ep.sample()
    assert [m.digest for m in s.media] == [m.digest for m in shots]
    assert s.prompt_ids.tolist() == [1, IMG, 2, 30]  # the first turn's template token joins the prompt
    assert s.response_ids.tolist().count(IMG) == len(shots) - 1  # one collapsed placeholder per screenshot
    turns = ep.turn_samples()
    assert len(turns) == len(shots)
    for k, t in enumerate(turns):
        assert t.media == shots[: k + 1] and all(a is b for a, b in zip(t.media, shots))  # the same objects
        assert t.response_ids.tolist() == [40 + k, 50 + k] and t.version == k
        assert t.prompt_ids.tolist().count(IMG) == k + 1
        assert t.prompt_ids.tolist() == ep.context[: len(t.prompt_ids)]
        assert t.logprobs.tolist() == [-0.5, -0.25] and t.loss_mask.tolist() == [1, 1]
    ids = [t.id for t in ep.turn_trajectories("gui")]
    assert len(set(ids)) == len(shots) and ids[0] == "task-0-t0"
    # references: items already carried by an earlier turn, and digests the producer says are held
    refs = ep.turn_samples(refer_repeats=True)
    for k, t in enumerate(refs):
        carried = {m.digest for m in shots[:k]}
        assert [m.is_reference for m in t.media] == [m.digest in carried for m in shots[: k + 1]]
    assert all(m.is_reference for m in ep.sample(refer={m.digest for m in shots}).media)


def test_screenshot_placeholders_must_match_their_media() -> None:
    ep = MultiTurn("task", [1, IMG, 2], index=3, media=[_shot(0)], placeholder_ids={"image": IMG})
    ep.add_model(RolloutSample("task", 3, prompt_ids=[1, IMG, IMG, 2], response_ids=[5], logprobs=[-1.0], version=0))
    with pytest.raises(RolloutOutputError, match="1 run.* for 0 image") as e:
        ep.add_observation([7, IMG, IMG, 8])
    assert (e.value.request_id, e.value.sample, e.value.field) == ("task", 3, "observation")
    with pytest.raises(RolloutOutputError, match="placeholder runs .* no observation declared") as e:
        ep.add_model(RolloutSample("task", 3, prompt_ids=[1, IMG, 2, 5, IMG, IMG], response_ids=[6], logprobs=[-1.0],
                                   version=0))
    assert e.value.field == "prompt_ids"
    with pytest.raises(RolloutOutputError, match="no image placeholder"):
        MultiTurn("task", [1, 2], media=[_shot(0)], placeholder_ids={"audio": 9})
    with pytest.raises(RolloutOutputError, match="0 run"):
        MultiTurn("task", [1, 2], media=[_shot(0)], placeholder_ids={"image": IMG})
    assert ep.sample().media and len(ep.media) == 1  # the refused calls added nothing


def test_agent_group_stores_each_screenshot_once_and_refuses_an_unheld_reference() -> None:
    """Per-turn trajectories of a group of 4 sibling episodes (same first screenshot, different later ones): the pipeline
    holds each distinct screenshot once; references (earlier turns', the group's first) resolve; an unheld one is
    refused naming the trajectory and the digest, and nothing of that put is stored."""
    first = _shot(100)
    eps = [_episode(i, [first, _shot(10 * i + 1), _shot(10 * i + 2)]) for i in range(4)]
    trajs = [t for i, ep in enumerate(eps)
             for t in ep.turn_trajectories("gui", refer={first.digest} if i else (), refer_repeats=True)]
    assert sum(m.is_reference for t in trajs for m in t.media) == 3 + 4 * 3  # sibling turn 0s + repeats
    pipe = Pipeline(BatchSpec({"gui": 12}, num_minibatches=1, group_size=12))
    try:
        pipe.put_many(trajs)
        st_ = pipe.internals.units["node0"].stats()
        assert st_.media_items == 1 + 4 * 2 and st_.media_refs == 4 * (1 + 2 + 3)
        assert st_.media_bytes == 9 * first.nbytes
        got = pipe.internals.units["node0"].get([t.id for t in trajs])
        objs = {id(m) for t in got for m in t.media}
        assert len(objs) == 9 and all(not m.is_reference for t in got for m in t.media)
        bad = MultiTurn("other", [1, IMG, 2], media=[MediaItem.ref("image", "f" * 32)], placeholder_ids={"image": IMG})
        bad.add_model(RolloutSample("other", 0, prompt_ids=[1, IMG, 2], response_ids=[5], logprobs=[-1.0], version=0))
        with pytest.raises(MediaRefError) as e:
            pipe.put(bad.turn_trajectories("gui")[0])
        assert e.value.trajectory_id == "other-0-t0" and e.value.digest == "f" * 32
        assert pipe.internals.units["node0"].stats().media_items == 9
    finally:
        pipe.shutdown()
