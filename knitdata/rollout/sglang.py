"""SGLang's native ``/generate`` responses (or ``sglang.Engine.generate`` results) to a
:class:`~knitdata.rollout.sample.RolloutGroup`.

The format followed is SGLang's native API (its documentation "SGLang Native APIs" and "Sampling Parameters",
and ``tokenizer_manager.py`` where ``meta_info`` is built; SGLang cannot be installed on a CPU-only machine, so
the tests use JSON dicts of this shape, and no SGLang server was run). One response per sample (a request with
``sampling_params={"n": n}`` returns a list):

* ``output_ids``: the generated token ids;
* ``meta_info["output_token_logprobs"]`` (with ``return_logprob=True``): one ``[logprob, token_id, text]``
  triple per generated token (``text`` is ``None`` unless ``return_text_in_logprobs``);
* ``meta_info["finish_reason"]``: ``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": n}``,
  ``{"type": "abort", "message": ...}`` (a plain string is accepted too);
* ``meta_info["weight_version"]``: the server's ``--weight-version`` (a string, updated with the weights);
  taken as the policy version when it is an integer;
* ``meta_info["routed_experts"]`` (optional, ``--enable-return-routed-experts``): base64 of little-endian
  ``int32`` expert ids, ``(prompt + output - 1)`` rows of ``num_layers * topk``; kept as
  ``tensors["routed_experts"]`` (``int32 [rows, num_layers * topk]``).

SGLang does not echo the prompt's token ids: pass the ``input_ids`` you sent as ``prompt_ids``.

Example:
    >>> resp = {"text": "", "output_ids": [5, 2], "meta_info": {
    ...     "id": "abc", "finish_reason": {"type": "length", "length": 2}, "weight_version": "3",
    ...     "output_token_logprobs": [[-0.5, 5, None], [-0.25, 2, None]]}}
    >>> s = from_sglang(resp, prompt_ids=[1, 2]).samples[0]
    >>> s.status, s.version, s.logprobs.tolist()
    ('truncated', 3, [-0.5, -0.25])
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from knitdata.errors import RolloutOutputError
from knitdata.rollout.sample import RolloutGroup, RolloutSample, as_token_ids
from knitdata.rollout.status import finish_status

__all__ = ["from_sglang", "decode_routed_experts"]


def decode_routed_experts(
    value: Any, rows: int, *, request_id: str | None = None, sample: int | None = None
) -> torch.Tensor:
    """Decode SGLang's ``meta_info["routed_experts"]`` into ``int32 [rows, k]``.

    Args:
        value: Base64 of little-endian ``int32`` values, or a nested list ``[rows][k]`` (or ``[rows][layers][topk]``).
        rows: Expected rows: prompt plus output tokens minus one.
        request_id: Named in errors.
        sample: Named in errors.

    Raises:
        RolloutOutputError: Undecodable, or a size that is not ``rows`` times a whole number.
    """
    where: dict[str, Any] = {"request_id": request_id, "sample": sample, "field": "meta_info.routed_experts"}
    if isinstance(value, (str, bytes)):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RolloutOutputError(f"not base64: {e}", **where) from e
        if len(raw) % 4:
            raise RolloutOutputError(f"{len(raw)} bytes is not a whole number of int32 values", **where)
        flat = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int32))
    else:
        try:
            flat = torch.as_tensor(np.asarray(value, dtype=np.int64)).to(torch.int32).reshape(-1)
        except (TypeError, ValueError) as e:
            raise RolloutOutputError(f"expected base64 or a nested list of ints: {e}", **where) from e
    if rows <= 0 or flat.numel() % rows or flat.numel() == 0:
        raise RolloutOutputError(f"{flat.numel()} expert ids do not split into {rows} rows (prompt + output - 1)", **where)
    return flat.reshape(rows, -1).contiguous()


def _version(meta: Mapping[str, Any], version: int | None, where: dict[str, Any]) -> int | None:
    wv = meta.get("weight_version")
    parsed: int | None = None
    if wv is not None:
        try:
            parsed = int(str(wv))
        except ValueError:
            parsed = None
        if parsed is None and version is None:
            raise RolloutOutputError(
                f"weight version {wv!r} is not an integer; pass version= (or launch SGLang with --weight-version N)",
                field="meta_info.weight_version", **where,
            )
    if version is not None and parsed is not None and parsed != version:
        raise RolloutOutputError(f"the server reports weight version {parsed}, version= says {version}",
                                 field="meta_info.weight_version", **where)
    return version if version is not None else parsed


def from_sglang(
    response: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    prompt_ids: Any,
    version: int | None = None,
    request_id: str | None = None,
    require_logprobs: bool = True,
    extra_finish_reasons: Mapping[str, str] | None = None,
) -> RolloutGroup:
    """Turn SGLang ``/generate`` response(s) of one request into a group.

    Args:
        response: One response dict, or the list of a request with ``n`` samples.
        prompt_ids: The ``input_ids`` sent (SGLang does not echo them).
        version: Policy version; default ``meta_info["weight_version"]`` as an int. Both given must agree.
        request_id: The group's request id; default the first ``meta_info["id"]``.
        require_logprobs: Refuse responses without ``output_token_logprobs`` (``return_logprob=True``).
        extra_finish_reasons: More finish reasons and their statuses.

    Returns:
        One sample per response, in order.

    Raises:
        RolloutOutputError: A malformed response: no ``meta_info``, unknown or missing finish reason, token ids of the
            log-prob triples that differ from ``output_ids``, log-probs missing, a non-integer weight version without
            ``version=``, undecodable routed experts.
    """
    items = [response] if isinstance(response, Mapping) else list(response)
    if not items:
        raise RolloutOutputError("no responses", request_id=request_id, field="response")
    first_meta = items[0].get("meta_info") if isinstance(items[0], Mapping) else None
    rid = request_id or (str(first_meta.get("id")) if isinstance(first_meta, Mapping) and first_meta.get("id") else "")
    if not rid:
        raise RolloutOutputError("no request id: pass request_id= (or keep meta_info.id)", field="meta_info.id")
    prompt = as_token_ids(prompt_ids, request_id=rid, field="prompt_ids")
    samples = []
    for i, item in enumerate(items):
        where: dict[str, Any] = {"request_id": rid, "sample": i}
        if not isinstance(item, Mapping) or not isinstance(item.get("meta_info"), Mapping):
            raise RolloutOutputError("expected a dict with 'meta_info'", field="meta_info", **where)
        meta = item["meta_info"]
        fr = meta.get("finish_reason")
        reason = fr.get("type") if isinstance(fr, Mapping) else fr
        status = finish_status(reason, field="meta_info.finish_reason", extra=extra_finish_reasons, **where)
        triples = meta.get("output_token_logprobs")
        ids = item.get("output_ids")
        logprobs = None
        if triples is not None:
            if not isinstance(triples, Sequence) or any(not isinstance(t, Sequence) or len(t) < 2 for t in triples):
                raise RolloutOutputError("expected [logprob, token_id, text] triples", field="meta_info.output_token_logprobs",
                                         **where)
            lp_ids = [t[1] for t in triples]
            if ids is None:
                ids = lp_ids
            elif list(ids) != list(lp_ids):
                raise RolloutOutputError(
                    f"token ids of the {len(lp_ids)} log-prob triples differ from the {len(ids)} output_ids",
                    field="meta_info.output_token_logprobs", **where,
                )
            logprobs = [t[0] for t in triples]
        if ids is None:
            raise RolloutOutputError("no output_ids and no output_token_logprobs", field="output_ids", **where)
        if logprobs is None and require_logprobs and len(ids):
            raise RolloutOutputError("no per-token log-probs; request with return_logprob=True",
                                     field="meta_info.output_token_logprobs", **where)
        tensors = {}
        if meta.get("routed_experts") is not None:
            rows = int(prompt.numel()) + len(ids) - 1
            tensors["routed_experts"] = decode_routed_experts(meta["routed_experts"], rows, **where)
        samples.append(RolloutSample(rid, i, prompt_ids=prompt, response_ids=ids, logprobs=logprobs, status=status,
                                     finish_reason=str(reason), version=_version(meta, version, where), tensors=tensors))
    return RolloutGroup(rid, samples)
