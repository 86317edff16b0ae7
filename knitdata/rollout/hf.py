"""Hugging Face ``transformers`` ``generate`` output to :class:`~knitdata.rollout.sample.RolloutGroup` s.

Generate with ``return_dict_in_generate=True, output_scores=True`` (and ``num_return_sequences=n`` for GRPO
groups); the behaviour log-probs are ``model.compute_transition_scores(out.sequences, out.scores,
normalize_logits=True)``: the log-probability of each sampled token under the distribution it was sampled
from (after temperature, top-k, top-p). This adapter computes them when given the model, or takes them as
``transition_scores``; it only reads ``out.sequences`` and ``out.scores``, so it imports nothing from
``transformers``. The tests run a real ``generate`` on a tiny random-init model.

Rows of ``out.sequences`` are ``[prompt (left-padded) | generated]``; HF repeats each prompt ``n`` times in a
row (request ``b`` owns rows ``b*n .. b*n+n-1``). A response ends at its first end-of-sequence token (kept,
status ``"completed"``, finish reason ``"stop"``); one without it used all ``max_new_tokens`` (``"truncated"``,
``"length"``). Left padding is removed from the prompt with ``attention_mask``.

Example:
    >>> from types import SimpleNamespace as NS
    >>> out = NS(sequences=torch.tensor([[0, 1, 5, 2, 0], [0, 1, 6, 7, 8]]), scores=None)
    >>> scores = torch.tensor([[-0.5, -0.25, 0.0], [-1.0, -1.0, -1.0]])
    >>> [g] = from_hf_generate(out, prompt_ids=torch.tensor([[0, 1]]), attention_mask=torch.tensor([[0, 1]]),
    ...                        num_return_sequences=2, transition_scores=scores, eos_token_id=2, version=0,
    ...                        request_ids=["q0"])
    >>> for s in g.samples:
    ...     print(tuple(s.prompt_ids.tolist()), tuple(s.response_ids.tolist()), s.status)
    (1,) (5, 2) completed
    (1,) (6, 7, 8) truncated
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from knitdata.errors import RolloutOutputError
from knitdata.rollout.sample import RolloutGroup, RolloutSample

__all__ = ["from_hf_generate"]


def _eos_set(eos_token_id: int | Sequence[int] | None, model: Any) -> set[int]:
    if eos_token_id is None and model is not None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        raise RolloutOutputError("no end-of-sequence token id: pass eos_token_id=", field="eos_token_id")
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


def from_hf_generate(
    output: Any,
    *,
    prompt_ids: torch.Tensor,
    request_ids: Sequence[str],
    version: int | None,
    attention_mask: torch.Tensor | None = None,
    num_return_sequences: int = 1,
    transition_scores: torch.Tensor | None = None,
    model: Any = None,
    eos_token_id: int | Sequence[int] | None = None,
    require_logprobs: bool = True,
) -> list[RolloutGroup]:
    """Turn one batched ``generate`` call into one group per prompt.

    Args:
        output: ``generate``'s ``GenerateDecoderOnlyOutput`` (``sequences``, ``scores``).
        prompt_ids: The ``input_ids`` given to ``generate``, ``[B, P]``.
        request_ids: One id per prompt (``B``), unique across your run: trajectory ids derive from them.
        version: Policy version of the model's weights.
        attention_mask: The attention mask given to ``generate`` (its zeros, left padding, are dropped from each
            prompt); ``None``: every prompt token is kept.
        num_return_sequences: ``n`` samples per prompt, as given to ``generate``.
        transition_scores: ``[B * n, T]`` log-probs of the generated tokens; default computed with
            ``model.compute_transition_scores(output.sequences, output.scores, normalize_logits=True)``.
        model: The model (for ``compute_transition_scores`` and its ``generation_config.eos_token_id``).
        eos_token_id: End-of-sequence id(s); default the model's generation config.
        require_logprobs: Refuse an output without scores.

    Returns:
        ``B`` groups of ``n`` samples, in prompt order.

    Raises:
        RolloutOutputError: Shapes that disagree (sequences, prompts, mask, scores, request ids), or no scores.
    """
    n = int(num_return_sequences)
    seqs = getattr(output, "sequences", None)
    if not isinstance(seqs, torch.Tensor) or seqs.dim() != 2:
        raise RolloutOutputError("expected output.sequences as a [B * n, P + T] tensor (return_dict_in_generate=True)",
                                 field="sequences")
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
        raise RolloutOutputError("expected the [B, P] input_ids given to generate", field="prompt_ids")
    b, p = prompt_ids.shape
    if len(request_ids) != b:
        raise RolloutOutputError(f"{len(request_ids)} request ids for {b} prompts", field="request_ids")
    if n < 1 or seqs.shape[0] != b * n or seqs.shape[1] < p:
        raise RolloutOutputError(
            f"sequences of shape {tuple(seqs.shape)} do not hold {b} prompts x {n} samples of {p} prompt tokens",
            field="sequences",
        )
    if attention_mask is not None and tuple(attention_mask.shape) != (b, p):
        raise RolloutOutputError(f"attention mask of shape {tuple(attention_mask.shape)} for prompts {(b, p)}",
                                 field="attention_mask")
    eos = _eos_set(eos_token_id, model)
    gen = seqs[:, p:].cpu()
    t = gen.shape[1]
    scores = transition_scores
    if scores is None and getattr(output, "scores", None) is not None and model is not None:
        with torch.no_grad():
            scores = model.compute_transition_scores(seqs, output.scores, normalize_logits=True)
    if scores is None and require_logprobs:
        raise RolloutOutputError("no scores: generate with output_scores=True and pass model= (or transition_scores=)",
                                 field="scores")
    if scores is not None:
        scores = scores.detach().cpu().float()
        if tuple(scores.shape) != (b * n, t):
            raise RolloutOutputError(f"scores of shape {tuple(scores.shape)} for {b * n} rows of {t} generated tokens",
                                     field="scores")
    groups = []
    for i, rid in enumerate(request_ids):
        prompt = prompt_ids[i].cpu()
        if attention_mask is not None:
            prompt = prompt[attention_mask[i].cpu().bool()]
        samples = []
        for j in range(n):
            row = i * n + j
            g = gen[row]
            hits = [k for k, tok in enumerate(g.tolist()) if tok in eos]
            end, status, reason = (hits[0] + 1, "completed", "stop") if hits else (t, "truncated", "length")
            samples.append(RolloutSample(
                str(rid), j, prompt_ids=prompt, response_ids=g[:end],
                logprobs=None if scores is None else scores[row, :end], status=status, finish_reason=reason,
                version=version,
            ))
        groups.append(RolloutGroup(str(rid), samples))
    return groups
