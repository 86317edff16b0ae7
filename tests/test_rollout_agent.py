"""Tests of knitdata.rollout.agent: multi-turn episodes concatenated, tool and observation tokens masked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.collate import TokenCollator
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
