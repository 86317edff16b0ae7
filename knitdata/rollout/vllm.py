"""vLLM's offline outputs (``LLM.generate`` / ``AsyncLLM.generate``) to a :class:`~knitdata.rollout.sample.RolloutGroup`.

The format followed is vLLM's ``vllm.outputs`` (read from its documentation and source, ``vllm/outputs.py`` and
``vllm/sequence.py``/``vllm/logprobs.py``; vLLM cannot be installed on a CPU-only machine, so the tests use
stand-in objects with the same attribute names, and no vLLM engine was run):

* ``RequestOutput``: ``request_id``, ``prompt_token_ids``, ``outputs`` (one ``CompletionOutput`` per sample of
  ``SamplingParams(n=...)``), ``finished``;
* ``CompletionOutput``: ``index``, ``token_ids``, ``cumulative_logprob``, ``logprobs`` (with
  ``SamplingParams(logprobs=k)``, ``k >= 0``: one ``dict`` per generated position mapping token id to a
  ``Logprob`` with ``.logprob``, holding the sampled token and up to ``k`` alternatives), ``finish_reason``
  (``"stop"``, ``"length"``, ``"abort"``; ``None`` while unfinished).

vLLM does not report which weights generated a request: pass ``version=`` (the version your rollout worker
loaded). The sampled token's log-prob is read from each position's dict; ``cumulative_logprob`` (when reported)
must agree with their sum.

Example:
    >>> from types import SimpleNamespace as NS
    >>> lp = lambda x: NS(logprob=x, rank=1, decoded_token=None)
    >>> out = NS(request_id="7", prompt_token_ids=[1, 2], finished=True, outputs=[
    ...     NS(index=0, token_ids=[5, 2], cumulative_logprob=-0.75, finish_reason="stop",
    ...        logprobs=[{5: lp(-0.5)}, {2: lp(-0.25), 9: lp(-2.0)}])])
    >>> group = from_vllm(out, version=4)
    >>> group.samples[0].logprobs.tolist(), group.samples[0].status
    ([-0.5, -0.25], 'completed')
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from knitdata.errors import RolloutOutputError
from knitdata.rollout.sample import RolloutGroup, RolloutSample
from knitdata.rollout.status import finish_status

__all__ = ["from_vllm", "vllm_logprobs"]


def vllm_logprobs(token_ids: list[int], positions: Any, *, request_id: str, sample: int) -> list[float]:
    """The sampled tokens' log-probs from vLLM's per-position ``{token_id: Logprob}`` dicts.

    Args:
        token_ids: The generated token ids.
        positions: ``CompletionOutput.logprobs``: one mapping per generated token.
        request_id: Named in errors.
        sample: Named in errors.

    Raises:
        RolloutOutputError: Not one mapping per token, or a position's mapping lacks its sampled token.
    """
    where: dict[str, Any] = {"request_id": request_id, "sample": sample, "field": "logprobs"}
    try:
        n = len(positions)
    except TypeError:
        raise RolloutOutputError(f"expected one mapping per token, got {type(positions).__name__}", **where) from None
    if n != len(token_ids):
        raise RolloutOutputError(f"{n} positions for {len(token_ids)} generated tokens", **where)
    out = []
    for i, (tok, pos) in enumerate(zip(token_ids, positions)):
        if not isinstance(pos, Mapping) or tok not in pos:
            raise RolloutOutputError(f"position {i}: no log-prob for the sampled token {tok}", **where)
        v = pos[tok]
        v = getattr(v, "logprob", v)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RolloutOutputError(f"position {i}: expected a Logprob or a float, got {type(v).__name__}", **where)
        out.append(float(v))
    return out


def from_vllm(
    output: Any,
    *,
    version: int | None,
    require_logprobs: bool = True,
    extra_finish_reasons: Mapping[str, str] | None = None,
) -> RolloutGroup:
    """Turn one vLLM ``RequestOutput`` into a group of samples.

    Args:
        output: The finished ``RequestOutput`` (attributes ``request_id``, ``prompt_token_ids``, ``outputs``).
        version: Policy version of the weights that generated it (vLLM does not report one).
        require_logprobs: Refuse outputs without per-token log-probs (``SamplingParams(logprobs=0)`` or more).
        extra_finish_reasons: More finish reasons and their statuses (:func:`~knitdata.rollout.status.finish_status`).

    Returns:
        One sample per ``CompletionOutput``, in index order.

    Raises:
        RolloutOutputError: Missing prompt ids or outputs, an unfinished or unknown finish reason, log-probs
            missing or of another length, a cumulative log-prob that disagrees with the per-token ones.
    """
    rid = str(getattr(output, "request_id", "") or "")
    if not rid:
        raise RolloutOutputError("a RequestOutput needs a request_id", field="request_id")
    prompt = getattr(output, "prompt_token_ids", None)
    if prompt is None:
        raise RolloutOutputError("no prompt token ids", request_id=rid, field="prompt_token_ids")
    outs = getattr(output, "outputs", None)
    if not outs:
        raise RolloutOutputError("no outputs", request_id=rid, field="outputs")
    samples = []
    for pos, co in enumerate(outs):
        idx = getattr(co, "index", pos)
        where: dict[str, Any] = {"request_id": rid, "sample": idx}
        status = finish_status(getattr(co, "finish_reason", None), extra=extra_finish_reasons, **where)
        raw = getattr(co, "token_ids", None)
        ids = [] if raw is None else list(raw)
        positions = getattr(co, "logprobs", None)
        logprobs = None
        if positions is not None:
            logprobs = vllm_logprobs(ids, positions, **where)
            cum = getattr(co, "cumulative_logprob", None)
            if cum is not None and not math.isclose(sum(logprobs), float(cum), rel_tol=1e-4, abs_tol=1e-4 * max(1, len(ids))):
                raise RolloutOutputError(
                    f"cumulative log-prob {float(cum)} disagrees with the per-token sum {sum(logprobs)}",
                    field="cumulative_logprob", **where,
                )
        elif require_logprobs and ids:
            raise RolloutOutputError("no per-token log-probs; generate with SamplingParams(logprobs=0)",
                                     field="logprobs", **where)
        samples.append(RolloutSample(rid, idx, prompt_ids=prompt, response_ids=ids, logprobs=logprobs, status=status,
                                     finish_reason=str(co.finish_reason), version=version))
    samples.sort(key=lambda s: s.index)
    return RolloutGroup(rid, samples)
