"""Hugging Face ``transformers`` ``generate`` output to :class:`~knitdata.rollout.sample.RolloutGroup` s.

Generate with ``return_dict_in_generate=True, output_scores=True`` (and ``num_return_sequences=n`` for GRPO
groups); the behaviour log-probs are ``model.compute_transition_scores(out.sequences, out.scores,
normalize_logits=True)``: the log-probability of each sampled token under the distribution it was sampled
from (``out.scores`` are the logits after generate's processors: temperature, top-k, top-p...). This adapter
computes them when given the model, or takes them as ``transition_scores``; it only reads ``out.sequences``,
``out.scores`` and ``out.logits``, so it imports nothing from ``transformers``. The tests run a real ``generate``
on a tiny random-init model.

**Processed sampling is refused by default.** ``transformers`` samples with ``top_k=50`` unless told otherwise
(its global default), so the distribution sampled from is the model's softmax cut to its 50 most likely tokens,
not the full softmax a trainer computes from the same weights: the behaviour log-probs then differ from the
trainer's by up to a few tenths of a nat and the on-policy ratio is not 1. The adapter refuses an output whose
scores exclude tokens (top-k, top-p, min-p... truncation: ``-inf`` scores) or, when the raw logits came with it
(``output_logits=True``), rescale them (temperature, repetition penalty...), naming the request, the sample and
what to pass: ``top_k=0, top_p=1.0, temperature=1.0`` to ``generate``, or ``allow_processed=True`` when the trainer
applies the same processing to its logits (then the log-probs are those of the processed distribution).

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
    allow_processed: bool = False,
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
        allow_processed: Accept an output sampled from a distribution generate's logits processors changed
            (tokens excluded by top-k/top-p/min-p, or, seen only with ``output_logits=True``, logits rescaled by a
            temperature or a penalty): the log-probs are those of that processed distribution, and the trainer
            must apply the same processing for its log-probs to match. ``False``: refuse it.

    Returns:
        ``B`` groups of ``n`` samples, in prompt order.

    Raises:
        RolloutOutputError: Shapes that disagree (sequences, prompts, mask, scores, request ids), no scores, or
            (unless ``allow_processed``) a sample drawn from a processed distribution: the message names the
            request, the sample, the generated token and the processing seen.
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
    ends: list[tuple[int, str, str]] = []
    for g in gen:
        hits = [k for k, tok in enumerate(g.tolist()) if tok in eos]
        ends.append((hits[0] + 1, "completed", "stop") if hits else (t, "truncated", "length"))
    if not allow_processed:
        _refuse_processed(output, gen, [e[0] for e in ends], request_ids, n)
    groups = []
    for i, rid in enumerate(request_ids):
        prompt = prompt_ids[i].cpu()
        if attention_mask is not None:
            prompt = prompt[attention_mask[i].cpu().bool()]
        samples = []
        for j in range(n):
            row = i * n + j
            g = gen[row]
            end, status, reason = ends[row]
            samples.append(RolloutSample(
                str(rid), j, prompt_ids=prompt, response_ids=g[:end],
                logprobs=None if scores is None else scores[row, :end], status=status, finish_reason=reason,
                version=version,
            ))
        groups.append(RolloutGroup(str(rid), samples))
    return groups


#: Largest difference (nats) between a sampled token's log-prob under the processed scores and under the raw
#: logits that still counts as unprocessed (float32 rounding of two log-softmaxes).
_PROCESSED_TOL: float = 1e-4

_WHAT_TO_PASS = ("pass top_k=0, top_p=1.0, temperature=1.0 to generate (transformers samples with top_k=50 unless told "
                 "otherwise) so that the behaviour log-probs are the full softmax's a trainer computes, or "
                 "allow_processed=True if your trainer applies the same processing to its logits")


def _refuse_processed(output: Any, gen: torch.Tensor, ends: Sequence[int], request_ids: Sequence[str],
                      n: int) -> None:
    """Refuse an output whose tokens were drawn from scores generate's processors changed (see the module)."""
    scores = getattr(output, "scores", None)
    if scores is None:
        return
    logits = getattr(output, "logits", None)
    rows = gen.shape[0]
    end_t = torch.tensor(list(ends))
    for k, step in enumerate(scores):
        if k >= gen.shape[1]:
            break
        live = end_t > k  # rows whose response still runs at token k
        if not bool(live.any()):
            break
        step = step.detach().float().cpu()
        if step.dim() != 2 or step.shape[0] != rows:
            return  # the shape check of the scores reports it
        excluded = torch.isneginf(step).sum(-1)
        bad = (excluded > 0) & live
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise RolloutOutputError(
                f"generated token {k} was sampled from scores that exclude {int(excluded[row])} of {step.shape[1]} "
                "tokens (top-k/top-p/min-p truncation, or a processor such as min_new_tokens): its log-prob is that "
                "of the truncated distribution, not of the model's full softmax, so a trainer's log-prob of the "
                f"same token differs and the on-policy ratio is not 1; {_WHAT_TO_PASS}",
                request_id=str(request_ids[row // n]), sample=row % n, field="scores",
            )
        if logits is not None and k < len(logits):
            raw = logits[k].detach().float().cpu()
            tok = gen[:, k].long()[:, None]
            diff = (torch.log_softmax(step, -1).gather(-1, tok) - torch.log_softmax(raw, -1).gather(-1, tok))[:, 0]
            bad = (diff.abs() > _PROCESSED_TOL) & live
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise RolloutOutputError(
                    f"generated token {k}'s log-prob under the scores it was sampled from differs by "
                    f"{float(diff[row]):+.4f} nats from the raw logits' softmax (a temperature, or a repetition/"
                    f"presence penalty rescaled them); {_WHAT_TO_PASS}",
                    request_id=str(request_ids[row // n]), sample=row % n, field="scores",
                )
