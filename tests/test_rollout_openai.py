"""Tests of knitdata.rollout.openai against the OpenAI-compatible completion and chat formats with vLLM's token-id
extensions (``return_token_ids``, ``return_tokens_as_token_ids``); JSON dicts of that shape, no server runs here."""

from __future__ import annotations

import json

import pytest

from knitdata.errors import RolloutOutputError
from knitdata.rollout import from_openai


def _chat(token_ids=(7, 8, 2), *, as_ids=False, reason="stop", top_ids=True) -> dict:
    content = [{"token": f"token_id:{t}" if as_ids else f"w{t}", "logprob": -0.25 * (k + 1), "bytes": None,
                "top_logprobs": []} for k, t in enumerate(token_ids)]
    choice = {"index": 0, "message": {"role": "assistant", "content": "..."}, "finish_reason": reason,
              "logprobs": {"content": content}}
    if top_ids:
        choice["token_ids"] = list(token_ids)
    return json.loads(json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
                                  "prompt_token_ids": [1, 2, 3], "choices": [choice]}))


def _completion(n=2) -> dict:
    choices = [{"index": i, "text": "...", "finish_reason": ["stop", "length"][i % 2], "prompt_token_ids": [1, 2],
                "token_ids": [10 + i, 2], "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.125],
                                                      "top_logprobs": [None, None], "text_offset": [0, 1]}}
               for i in range(n)]
    return {"id": "cmpl-9", "object": "text_completion", "choices": choices}


def test_chat_and_completion_choices_become_groups() -> None:
    g = from_openai(_chat(), version=4)
    s = g.samples[0]
    assert g.request_id == "chatcmpl-1" and s.prompt_ids.tolist() == [1, 2, 3] and s.response_ids.tolist() == [7, 8, 2]
    assert s.logprobs.tolist() == [-0.25, -0.5, -0.75] and s.status == "completed" and s.version == 4
    g = from_openai(_completion(), version=1)
    assert [s.status for s in g.samples] == ["completed", "truncated"]
    ts = g.trajectories("chat")
    assert [t.id for t in ts] == ["cmpl-9-0", "cmpl-9-1"] and ts[1].response_ids.tolist() == [11, 2]
    assert from_openai(_chat(reason="tool_calls"), version=0).samples[0].status == "completed"


def test_token_ids_from_token_id_strings_and_an_explicit_prompt() -> None:
    s = from_openai(_chat(as_ids=True, top_ids=False), version=0, prompt_ids=[9, 9]).samples[0]
    assert s.response_ids.tolist() == [7, 8, 2] and s.prompt_ids.tolist() == [9, 9]
    with pytest.raises(RolloutOutputError, match="disagree") as ei:
        r = _chat(as_ids=True)
        r["choices"][0]["token_ids"] = [7, 8, 3]
        from_openai(r, version=0)
    assert ei.value.field == "token_ids"


def test_malformed_responses_are_refused_naming_request_and_field() -> None:
    def err(resp, **kw) -> RolloutOutputError:
        with pytest.raises(RolloutOutputError) as ei:
            from_openai(resp, **{"version": 0, **kw})
        return ei.value

    e = err(_chat(top_ids=False))  # text tokens only: no ids
    assert (e.field, e.request_id, e.sample) == ("token_ids", "chatcmpl-1", 0) and "return_token_ids" in str(e)
    r = _chat()
    r["choices"][0]["logprobs"]["content"].pop()
    assert err(r).field == "logprobs"
    r = _chat()
    r["choices"][0]["logprobs"] = None
    assert err(r).field == "logprobs"
    assert from_openai(r, version=0, require_logprobs=False).samples[0].logprobs is None
    r = _chat()
    r["choices"][0]["logprobs"]["content"][0]["logprob"] = None
    assert err(r).field == "logprobs"
    assert err(_chat(reason="content_filter")).field == "finish_reason"
    r = _chat()
    del r["prompt_token_ids"]
    assert err(r).field == "prompt_token_ids"
    r = _completion()
    r["choices"][0]["logprobs"]["token_logprobs"].pop()
    assert err(r).field == "logprobs.token_logprobs"
    assert err({"id": "x", "choices": []}).field == "choices"
    assert err({"choices": [{}]}).field == "id"
    assert err(["not", "a", "dict"]).field == "response"
