"""Tests of knitdata.rollout.hf: a real Hugging Face ``generate`` on a tiny random-init model, into trajectories."""

from __future__ import annotations

import pytest
import torch

from knitdata.errors import RolloutOutputError
from knitdata.rollout import from_hf_generate

transformers = pytest.importorskip("transformers")

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def model():
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _generate(model, n=3, max_new=6, seed=0):
    """top_k=20, temperature=0.9: a processed distribution (the adapter accepts it with allow_processed=True)."""
    prompts = torch.tensor([[PAD, PAD, 1, 5, 6], [1, 7, 8, 9, 10]])  # left-padded batch of 2
    mask = (prompts != PAD).long()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=mask, do_sample=True, top_k=20, temperature=0.9,
                             max_new_tokens=max_new, num_return_sequences=n, return_dict_in_generate=True,
                             output_scores=True, pad_token_id=PAD, eos_token_id=EOS)
    return prompts, mask, out


def _boost_eos(model, logit: float) -> None:
    with torch.no_grad():
        model.lm_head.weight[EOS] = 0.0
    model.lm_head.register_forward_hook(lambda mod, inp, out: out.index_add(-1, torch.tensor([EOS]),
                                                                             torch.full_like(out[..., :1], logit)))


def test_real_generate_becomes_groups_with_the_models_own_logprobs(model) -> None:
    prompts, mask, out = _generate(model)
    groups = from_hf_generate(out, prompt_ids=prompts, attention_mask=mask, num_return_sequences=3, model=model,
                              version=2, request_ids=["p0", "p1"], allow_processed=True)
    assert [g.request_id for g in groups] == ["p0", "p1"] and all(len(g) == 3 for g in groups)
    assert groups[0].samples[0].prompt_ids.tolist() == [1, 5, 6]  # left padding dropped
    scores = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    # the log-probs equal a fresh forward pass under the same sampling distribution (temperature, top-k)
    for g_i, g in enumerate(groups):
        for s in g.samples:
            row = g_i * 3 + s.index
            gen = out.sequences[row, prompts.shape[1]:]
            n = s.response_ids.numel()
            assert torch.equal(s.response_ids, gen[:n])
            assert torch.allclose(s.logprobs, scores[row, :n])
            if s.status == "completed":
                assert s.response_ids[-1] == EOS and EOS not in s.response_ids[:-1].tolist()
            else:
                assert s.status == "truncated" and n == 6 and EOS not in s.response_ids.tolist()
            full = torch.cat([s.prompt_ids, s.response_ids])[None]
            with torch.no_grad():
                logits = model(full).logits[0, len(s.prompt_ids) - 1:-1] / 0.9
            kth = logits.topk(20, -1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
            ref = torch.log_softmax(logits, -1).gather(-1, s.response_ids[:, None])[:, 0]
            assert torch.allclose(s.logprobs, ref, atol=1e-4)
    ts = [t for g in groups for t in g.trajectories("math")]
    assert len({t.id for t in ts}) == 6 and all(t.gen_version == 2 for t in ts)
    assert all(t.tensors["old_logprobs"].numel() == t.response_ids.numel() for t in ts)


def test_statuses_follow_the_end_of_sequence_token(model) -> None:
    import copy

    eager = copy.deepcopy(model)
    _boost_eos(eager, 50.0)  # every sample ends at once
    prompts, mask, out = _generate(eager, n=2)
    groups = from_hf_generate(out, prompt_ids=prompts, attention_mask=mask, num_return_sequences=2, model=eager,
                              version=0, request_ids=["a", "b"], allow_processed=True)
    assert {s.status for g in groups for s in g.samples} == {"completed"}
    assert all(s.response_ids.tolist() == [EOS] for g in groups for s in g.samples)
    never = copy.deepcopy(model)
    _boost_eos(never, -1e4)  # no sample ends
    prompts, mask, out = _generate(never, n=2, max_new=4)
    groups = from_hf_generate(out, prompt_ids=prompts, attention_mask=mask, num_return_sequences=2, model=never,
                              version=0, request_ids=["a", "b"], allow_processed=True)
    assert {(s.status, s.finish_reason, s.response_ids.numel()) for g in groups for s in g.samples} == {
        ("truncated", "length", 4)}


def test_shapes_that_disagree_are_refused(model) -> None:
    prompts, mask, out = _generate(model, n=2)
    kw = dict(prompt_ids=prompts, attention_mask=mask, num_return_sequences=2, model=model, version=0,
              request_ids=["a", "b"], allow_processed=True)

    def field(**over) -> str:
        with pytest.raises(RolloutOutputError) as ei:
            from_hf_generate(out, **{**kw, **over})
        return ei.value.field

    assert field(num_return_sequences=3) == "sequences"
    assert field(request_ids=["a"]) == "request_ids"
    assert field(attention_mask=mask[:, 1:]) == "attention_mask"
    assert field(transition_scores=torch.zeros(4, 2)) == "scores"
    assert field(model=None, eos_token_id=EOS) == "scores"
    assert field(model=None) == "eos_token_id"
    assert field(prompt_ids=prompts[0]) == "prompt_ids"
    groups = from_hf_generate(out, **{**kw, "model": None}, eos_token_id=EOS, require_logprobs=False)
    assert groups[0].samples[0].logprobs is None


def _fresh_logits(model, prompt_ids: torch.Tensor, response_ids: torch.Tensor) -> torch.Tensor:
    """The trainer's view: the raw next-token logits of a fresh forward pass at each response position."""
    full = torch.cat([prompt_ids, response_ids])[None]
    with torch.no_grad():
        return model(full).logits[0, len(prompt_ids) - 1:-1].float()


def _default_generate(model, seed: int = 0, **kw):
    """The docs' call: ``do_sample=True`` and transformers' defaults otherwise (``top_k=50``, ``top_p=1.0``)."""
    prompts = torch.tensor([[PAD, PAD, 1, 5, 6], [1, 7, 8, 9, 10]])
    mask = (prompts != PAD).long()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=mask, do_sample=True, max_new_tokens=8, num_return_sequences=4,
                             return_dict_in_generate=True, output_scores=True, pad_token_id=PAD, **kw)
    return prompts, mask, out


def test_default_generate_truncates_and_is_refused_unless_allowed(model) -> None:
    """Issue 45.5: under transformers' defaults generate samples from the top-50 of 64 tokens; behaviour log-probs
    of that distribution differ from the full softmax a trainer computes (the on-policy ratio is not 1). The adapter
    refuses such output by default, naming the request, sample and what to pass; with allow_processed=True its
    log-probs are exactly those of the top-50 distribution sampled from."""
    prompts, mask, out = _default_generate(model)
    kw = dict(prompt_ids=prompts, attention_mask=mask, num_return_sequences=4, model=model, version=0,
              request_ids=["q0", "q1"])
    with pytest.raises(RolloutOutputError, match=r"request 'q0': sample 0: .*14 of 64 tokens.*top_k=0") as ei:
        from_hf_generate(out, **kw)
    assert ei.value.field == "scores"
    groups = from_hf_generate(out, **kw, allow_processed=True)
    worst = 0.0
    for g in groups:
        for s in g.samples:
            logits = _fresh_logits(model, s.prompt_ids, s.response_ids)
            kth = logits.topk(50, -1).values[:, -1:]
            sampled_from = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
            assert torch.isfinite(sampled_from.gather(-1, s.response_ids[:, None])).all()  # all within the top 50
            assert torch.allclose(s.logprobs, sampled_from.gather(-1, s.response_ids[:, None])[:, 0], atol=1e-4)
            full = torch.log_softmax(logits, -1).gather(-1, s.response_ids[:, None])[:, 0]
            worst = max(worst, float((s.logprobs - full).abs().max()))
    assert worst > 0.01  # the truncation mattered: these are not the full softmax's log-probs


def test_untruncated_generate_gives_the_trainers_logprobs(model) -> None:
    """Issue 45.5: with top_k=0 (and top_p=1.0, temperature=1.0) the distribution sampled from is the full softmax:
    the behaviour log-probs equal a fresh forward's, so the on-policy ratio is 1."""
    prompts, mask, out = _default_generate(model, top_k=0, output_logits=True)
    groups = from_hf_generate(out, prompt_ids=prompts, attention_mask=mask, num_return_sequences=4, model=model,
                              version=0, request_ids=["q0", "q1"])
    for g in groups:
        for s in g.samples:
            logits = _fresh_logits(model, s.prompt_ids, s.response_ids)
            full = torch.log_softmax(logits, -1).gather(-1, s.response_ids[:, None])[:, 0]
            assert torch.allclose(s.logprobs, full, atol=1e-4)


def test_rescaled_sampling_is_refused_when_the_raw_logits_are_returned(model) -> None:
    """Issue 45.5: a temperature masks no token, so only the raw logits (output_logits=True) reveal it."""
    prompts, mask, out = _default_generate(model, top_k=0, temperature=0.7, output_logits=True)
    kw = dict(prompt_ids=prompts, attention_mask=mask, num_return_sequences=4, model=model, version=0,
              request_ids=["q0", "q1"])
    with pytest.raises(RolloutOutputError, match=r"request 'q0': sample 0: .*nats.*temperature"):
        from_hf_generate(out, **kw)
    groups = from_hf_generate(out, **kw, allow_processed=True)
    s = groups[1].samples[2]
    logits = _fresh_logits(model, s.prompt_ids, s.response_ids) / 0.7
    assert torch.allclose(s.logprobs, torch.log_softmax(logits, -1).gather(-1, s.response_ids[:, None])[:, 0],
                          atol=1e-4)
