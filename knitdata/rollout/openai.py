"""OpenAI-compatible completion and chat-completion responses (what agent harnesses record) to a
:class:`~knitdata.rollout.sample.RolloutGroup`.

Pass the response as JSON (a dict; from the ``openai`` client, ``response.model_dump()``). The format followed is
the OpenAI API's, with the token-id extensions of vLLM's OpenAI-compatible server
(``vllm/entrypoints/openai/protocol.py``; no server was run here, the tests use JSON dicts of this shape):

* completions (``"object": "text_completion"``): ``choices[i].logprobs`` is ``{"tokens": [...],
  "token_logprobs": [...], ...}``;
* chat completions (``"object": "chat.completion"``): ``choices[i].logprobs.content`` is a list of
  ``{"token": ..., "logprob": ..., ...}``;
* token ids: ``choices[i].token_ids`` (vLLM's ``return_token_ids: true``), else parsed from the log-prob tokens
  when the server writes them as ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids: true``); both given,
  they must agree;
* prompt token ids: ``prompt_ids=`` if given, else ``choices[i].prompt_token_ids`` (vLLM completions) or the
  response's ``prompt_token_ids`` (vLLM chat completions), with ``return_token_ids: true``;
* ``choices[i].finish_reason``: ``"stop"``, ``"length"``, ``"tool_calls"``, ``"function_call"`` (and vLLM's
  ``"abort"``).

A response without token ids cannot be used (re-tokenizing the text is not exact): ask the server for them.

Example:
    >>> resp = {"id": "chatcmpl-1", "object": "chat.completion", "prompt_token_ids": [1, 2], "choices": [
    ...     {"index": 0, "finish_reason": "stop", "token_ids": [7, 2], "message": {"role": "assistant"},
    ...      "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "</s>", "logprob": -0.125}]}}]}
    >>> s = from_openai(resp, version=2).samples[0]
    >>> s.response_ids.tolist(), s.logprobs.tolist()
    ([7, 2], [-0.5, -0.125])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from knitdata.errors import RolloutOutputError
from knitdata.rollout.sample import RolloutGroup, RolloutSample
from knitdata.rollout.status import finish_status

__all__ = ["from_openai", "TOKEN_ID_PREFIX"]

#: How vLLM's ``return_tokens_as_token_ids`` writes a token: ``"token_id:<id>"``.
TOKEN_ID_PREFIX: str = "token_id:"


def _token_entries(choice: Mapping[str, Any], where: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
    """``(tokens, logprobs)`` of a completion or chat choice, or ``None`` without log-probs."""
    lp = choice.get("logprobs")
    if lp is None:
        return None
    if not isinstance(lp, Mapping):
        raise RolloutOutputError(f"expected an object, got {type(lp).__name__}", field="logprobs", **where)
    if "content" in lp:  # chat completion
        content = lp["content"]
        if content is None:
            return None
        if not isinstance(content, list) or any(not isinstance(c, Mapping) for c in content):
            raise RolloutOutputError("expected a list of {token, logprob} objects", field="logprobs.content", **where)
        return [c.get("token") for c in content], [c.get("logprob") for c in content]
    tokens, values = lp.get("tokens"), lp.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        raise RolloutOutputError("expected 'tokens' and 'token_logprobs' lists", field="logprobs", **where)
    if len(tokens) != len(values):
        raise RolloutOutputError(f"{len(tokens)} tokens but {len(values)} token_logprobs", field="logprobs.token_logprobs",
                                 **where)
    return tokens, values


def _ids_from_tokens(tokens: list[Any]) -> list[int] | None:
    out = []
    for t in tokens:
        if not isinstance(t, str) or not t.startswith(TOKEN_ID_PREFIX):
            return None
        try:
            out.append(int(t[len(TOKEN_ID_PREFIX):]))
        except ValueError:
            return None
    return out


def from_openai(
    response: Mapping[str, Any],
    *,
    version: int | None,
    prompt_ids: Any = None,
    request_id: str | None = None,
    require_logprobs: bool = True,
    extra_finish_reasons: Mapping[str, str] | None = None,
) -> RolloutGroup:
    """Turn one OpenAI-compatible (chat) completion response into a group (one sample per choice).

    Args:
        response: The response as a dict.
        version: Policy version of the served weights.
        prompt_ids: The prompt's token ids; default the ones the server returned (``return_token_ids``).
        request_id: The group's request id; default the response's ``id``.
        require_logprobs: Refuse choices without log-probs (``logprobs: true`` / ``logprobs: 0``).
        extra_finish_reasons: More finish reasons and their statuses.

    Raises:
        RolloutOutputError: No choices, no token ids (neither ``token_ids`` nor ``token_id:<id>`` tokens), no
            prompt ids, token ids and log-prob tokens that disagree, log-probs of another length, an unknown finish
            reason.
    """
    if not isinstance(response, Mapping):
        raise RolloutOutputError(f"expected the response as a dict, got {type(response).__name__} (use .model_dump())",
                                 request_id=request_id, field="response")
    rid = request_id or str(response.get("id") or "")
    if not rid:
        raise RolloutOutputError("no request id: pass request_id= (or keep the response's id)", field="id")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise RolloutOutputError("no choices", request_id=rid, field="choices")
    samples = []
    for pos, choice in enumerate(choices):
        if not isinstance(choice, Mapping):
            raise RolloutOutputError(f"expected an object, got {type(choice).__name__}", request_id=rid, sample=pos,
                                     field="choices")
        idx = choice.get("index", pos)
        where: dict[str, Any] = {"request_id": rid, "sample": idx}
        status = finish_status(choice.get("finish_reason"), extra=extra_finish_reasons, **where)
        entries = _token_entries(choice, where)
        ids = choice.get("token_ids")
        from_tokens = _ids_from_tokens(entries[0]) if entries is not None else None
        if ids is None:
            ids = from_tokens
        elif from_tokens is not None and list(ids) != from_tokens:
            raise RolloutOutputError("token_ids disagree with the 'token_id:<id>' log-prob tokens", field="token_ids", **where)
        if ids is None:
            raise RolloutOutputError(
                "no token ids; request them with return_token_ids: true (or return_tokens_as_token_ids with logprobs)",
                field="token_ids", **where,
            )
        logprobs = None
        if entries is not None:
            logprobs = entries[1]
            if len(logprobs) != len(ids):
                raise RolloutOutputError(f"{len(logprobs)} log-probs for {len(ids)} token ids", field="logprobs", **where)
            if any(v is None for v in logprobs):
                raise RolloutOutputError("a log-prob is null", field="logprobs", **where)
        elif require_logprobs and len(ids):
            raise RolloutOutputError("no log-probs; request with logprobs", field="logprobs", **where)
        prompt = prompt_ids
        if prompt is None:
            prompt = choice.get("prompt_token_ids", response.get("prompt_token_ids"))
        if prompt is None:
            raise RolloutOutputError("no prompt token ids: pass prompt_ids= or request return_token_ids: true",
                                     field="prompt_token_ids", **where)
        samples.append(RolloutSample(rid, idx, prompt_ids=prompt, response_ids=ids, logprobs=logprobs, status=status,
                                     finish_reason=str(choice.get("finish_reason")), version=version))
    samples.sort(key=lambda s: s.index)
    return RolloutGroup(rid, samples)
