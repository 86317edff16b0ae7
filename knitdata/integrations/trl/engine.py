"""A generation engine for :class:`~knitdata.integrations.trl.worker.KnitdataRolloutWorker` on Hugging Face ``generate``.

TRL's ``AsyncGRPOTrainer`` generates on a vLLM server and streams its weights there through a
``weight_transfer`` object (``init_weight_transfer`` / ``pause`` / ``send_weights`` / ``resume`` / ``destroy``).
:class:`HFGenerationEngine` is both ends in one process: it implements that protocol by loading the streamed
weights into a local copy of the policy, and :meth:`HFGenerationEngine.generate` samples from that copy with
``generate`` and returns :class:`knitdata.rollout.RolloutGroup` objects (behaviour log-probs from
``compute_transition_scores``, so the trainer's first log-probs on fresh samples equal them). It stands in for a
vLLM server on a CPU machine or in tests; on GPUs, write the same two methods (``version`` and ``generate``)
over vLLM with :func:`knitdata.rollout.from_vllm`.

Example::

    import transformers
    cfg = transformers.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=0)
    engine = HFGenerationEngine(transformers.Qwen2ForCausalLM(cfg), pad_token_id=0)
    [group] = engine.generate([[1, 5, 6]], n=2, max_new_tokens=4, request_ids=["q0"])
    assert len(group.samples) == 2 and group.samples[0].version == 0  # no weight sync yet
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from knitdata.errors import ConfigError
from knitdata.rollout import RolloutGroup, from_hf_generate

__all__ = ["HFGenerationEngine"]


class HFGenerationEngine:
    """Hugging Face ``generate`` on a local policy copy, fed by TRL's weight syncs (its ``weight_transfer``).

    Args:
        model: The generation copy of the policy (a ``PreTrainedModel`` with the trainer's parameter names).
        pad_token_id: Left-padding id for batched prompts.
        eos_token_id: End-of-sequence id(s); default the model's generation config.
        temperature: Sampling temperature (keep it equal to ``AsyncGRPOConfig.temperature``: the trainer's
            log-probs use it).
        seed: Seed of the sampling generator: call ``k`` of :meth:`generate` draws from its own
            ``torch.Generator`` seeded from ``seed`` and ``k``, so an engine's samples repeat from its seed and
            call count alone, and the process-wide RNG (the trainer's dropout and sampling, the user's
            ``torch.manual_seed``) is never drawn from nor reseeded.

    Attributes:
        version: How many weight syncs this engine received: TRL's ``model_version`` of the weights it holds
            (the trainer counts one per sync, starting with the cold sync at train begin).
    """

    def __init__(self, model: Any, *, pad_token_id: int, eos_token_id: int | Sequence[int] | None = None,
                 temperature: float = 1.0, seed: int = 0) -> None:
        if not hasattr(model, "generate") or not hasattr(model, "state_dict"):
            raise ConfigError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        if not temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {temperature!r}")
        self.model = model.eval()
        self.pad_token_id = int(pad_token_id)
        self.eos_token_id = eos_token_id
        self.temperature = float(temperature)
        self.version = 0
        self._lock = threading.Lock()  # held by a generate call, or by the trainer between pause() and resume()
        self._paused = False
        self._seed = int(seed)
        self._calls = 0

    # ------------------------------------------------------------------ TRL's WeightTransferProtocol
    def init_weight_transfer(self) -> None:
        """Nothing to set up: the weights arrive in this process."""

    def pause(self) -> None:
        """Wait for a running ``generate`` call to end and hold new ones back until :meth:`resume`."""
        self._lock.acquire()
        self._paused = True

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the trainer's ``(name, tensor)`` stream into the generation copy; count one version.

        Raises:
            ConfigError: A name the generation copy does not have, or a shape that differs (the message names it).
        """
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in iterator:
                p = params.get(name)
                if p is None:
                    raise ConfigError(f"weight sync: parameter {name!r} is not in the generation model")
                if tuple(p.shape) != tuple(tensor.shape):
                    raise ConfigError(f"weight sync: parameter {name!r} has shape {tuple(tensor.shape)}, "
                                      f"the generation model's {tuple(p.shape)}")
                p.copy_(tensor.detach().to(device=p.device, dtype=p.dtype))
        self.version += 1

    def resume(self) -> None:
        """Let ``generate`` calls run again."""
        if self._paused:
            self._paused = False
            self._lock.release()

    def destroy(self) -> None:
        """Release a pause still held (the trainer ended)."""
        self.resume()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, max_new_tokens: int,
                 request_ids: Sequence[str]) -> list[RolloutGroup]:
        """Sample ``n`` responses of at most ``max_new_tokens`` to each prompt with the weights held now.

        Sampling is the Gumbel-max trick inside ``generate``'s greedy search: a logits processor adds Gumbel noise
        drawn from this call's own ``torch.Generator`` to the log-probs ``log_softmax(logits / temperature)`` and
        the argmax of the sum is a sample from that distribution. ``generate(do_sample=True)`` would draw from the
        process-wide RNG (``torch.multinomial`` without a generator), which the trainer uses at the same time from
        its own thread; ``torch.random.fork_rng`` around the call would not help, as it saves and restores that
        global state while the trainer thread draws from it (the trainer's draws in between would come from this
        engine's seed and be rolled back). The behaviour log-probs are the clean ``log_softmax(logits /
        temperature)`` of the chosen tokens, without the noise.

        Returns:
            One :class:`~knitdata.rollout.RolloutGroup` per prompt; each sample's ``version`` is :attr:`version`;
            a response cut at ``max_new_tokens`` is ``truncated``.
        """
        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        with self._lock:
            self._calls += 1
            sampler = _GumbelSampler(self._seed * 1_000_003 + self._calls, self.temperature)
            eos = {} if self.eos_token_id is None else {"eos_token_id": self.eos_token_id}
            with torch.no_grad():
                # greedy search returns one sequence per row: each prompt's n rows side by side, as
                # num_return_sequences would lay them out
                out = self.model.generate(ids.repeat_interleave(int(n), dim=0),
                                          attention_mask=mask.repeat_interleave(int(n), dim=0), do_sample=False,
                                          temperature=None, top_k=None, top_p=None, logits_processor=[sampler],
                                          max_new_tokens=int(max_new_tokens),
                                          return_dict_in_generate=True, output_scores=True,
                                          pad_token_id=self.pad_token_id, **eos)
                scores = self.model.compute_transition_scores(out.sequences, tuple(sampler.logprobs),
                                                              normalize_logits=False)
            version = self.version
        return from_hf_generate(out, prompt_ids=ids, attention_mask=mask, request_ids=list(request_ids),
                                num_return_sequences=int(n), transition_scores=scores, model=self.model,
                                eos_token_id=self.eos_token_id, version=version)


class _GumbelSampler:
    """A ``generate`` logits processor: records ``log_softmax(scores / temperature)`` and returns it plus Gumbel
    noise from its own ``torch.Generator`` (greedy search over the sum samples from the tempered distribution)."""

    def __init__(self, seed: int, temperature: float) -> None:
        self.seed, self.temperature = seed, temperature
        self.logprobs: list[torch.Tensor] = []
        self._generator: torch.Generator | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._generator is None:
            self._generator = torch.Generator(device=scores.device).manual_seed(self.seed)
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        self.logprobs.append(logp)
        u = torch.rand(logp.shape, generator=self._generator, device=logp.device, dtype=torch.float32)
        u.clamp_(min=torch.finfo(torch.float32).tiny)  # finite noise: a -inf log-prob stays -inf, never chosen
        return logp - torch.log(-torch.log(u))
