"""How a generation ended: an engine's finish reason mapped to one of three statuses.

* ``"completed"``: the model ended the response (an end-of-sequence or stop token, a stop string, a tool call);
* ``"truncated"``: the response hit its length limit (``max_tokens`` / ``max_new_tokens``);
* ``"aborted"``: the engine stopped the request before either (a weight update, a cancelled request); the
  tokens so far may be continued later (:class:`~knitdata.rollout.partial.PartialRollout`).

Finish reasons: vLLM's ``CompletionOutput.finish_reason`` (``"stop"``, ``"length"``, ``"abort"``), SGLang's
``meta_info["finish_reason"]["type"]`` (``"stop"``, ``"length"``, ``"abort"``), the OpenAI-compatible
``choices[i].finish_reason`` (``"stop"``, ``"length"``, ``"tool_calls"``, ``"function_call"``; vLLM's server also
``"abort"``). A reason not in :data:`FINISH_REASONS` is refused, not guessed: pass ``extra={...}`` to map your
engine's own.

Example:
    >>> finish_status("length", request_id="r0")
    'truncated'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from knitdata.errors import RolloutOutputError

__all__ = ["STATUSES", "FINISH_REASONS", "finish_status"]

#: The statuses a generation can end in.
STATUSES: tuple[str, ...] = ("completed", "truncated", "aborted")

#: Finish reasons of vLLM, SGLang and the OpenAI-compatible APIs, and the status each maps to.
FINISH_REASONS: Mapping[str, str] = {
    "stop": "completed",
    "eos": "completed",
    "tool_calls": "completed",
    "function_call": "completed",
    "length": "truncated",
    "abort": "aborted",
}


def finish_status(
    reason: object,
    *,
    request_id: str | None = None,
    sample: int | None = None,
    field: str = "finish_reason",
    extra: Mapping[str, str] | None = None,
) -> str:
    """Map an engine's finish reason to a status.

    Args:
        reason: The finish reason (a string; ``None`` means the request has not finished).
        request_id: Named in errors.
        sample: Index of the response within its request, named in errors.
        field: Name of the engine's field, named in errors.
        extra: More reasons and their statuses (e.g. ``{"content_filter": "completed"}``), checked first.

    Returns:
        ``"completed"``, ``"truncated"`` or ``"aborted"``.

    Raises:
        RolloutOutputError: ``reason`` is ``None`` (unfinished), not a string, or not a known reason; or ``extra``
            maps to an unknown status.
    """
    where: dict[str, Any] = {"request_id": request_id, "sample": sample, "field": field}
    if reason is None:
        raise RolloutOutputError("the generation has not finished (no finish reason); pass finished outputs", **where)
    if not isinstance(reason, str):
        raise RolloutOutputError(f"expected a string, got {type(reason).__name__}", **where)
    table = dict(FINISH_REASONS)
    for k, v in (extra or {}).items():
        if v not in STATUSES:
            raise RolloutOutputError(f"extra maps {k!r} to unknown status {v!r}; use one of {STATUSES}", **where)
        table[k] = v
    if reason not in table:
        raise RolloutOutputError(
            f"unknown finish reason {reason!r}; known: {sorted(table)} (map your engine's own with extra=)", **where
        )
    return table[reason]
