"""From a rollout engine's output to :class:`~knitdata.record.Trajectory` groups, without hand glue.

One request with ``n`` samples is one group (GRPO's ``n`` responses to a prompt). Each adapter turns an engine's
own output into a :class:`RolloutGroup` of :class:`RolloutSample` s (token ids, behaviour log-probs, status,
policy version), checking every length, and :meth:`RolloutGroup.trajectories` makes the trajectories
``Pipeline.put`` takes:

* :func:`from_vllm`: vLLM ``RequestOutput`` (:mod:`knitdata.rollout.vllm`);
* :func:`from_sglang`: SGLang native ``/generate`` responses (:mod:`knitdata.rollout.sglang`);
* :func:`from_openai`: OpenAI-compatible completion and chat responses (:mod:`knitdata.rollout.openai`);
* :func:`from_hf_generate`: Hugging Face ``generate`` with scores (:mod:`knitdata.rollout.hf`);
* :class:`MultiTurn`: an agent episode's turns concatenated, tool and observation tokens masked, observations
  with their screenshots; one sample per episode or per model turn (:mod:`knitdata.rollout.agent`);
* :func:`attach_media`: a multimodal prompt's raw media as media items (:mod:`knitdata.rollout.multimodal`);
* :class:`SegmentBuffer` / :class:`PartialRollout`: a generation interrupted by a weight update and continued
  under a newer version, as one trajectory with per-token versions (:mod:`knitdata.rollout.partial`).

A malformed output raises :class:`~knitdata.errors.RolloutOutputError` naming the request, the sample and the
field. The vLLM, SGLang and OpenAI adapters follow those engines' documented formats and are tested against them
(stand-in objects and JSON dicts); the engines themselves do not run on a CPU-only machine and were not run.
"""

from __future__ import annotations

from knitdata.rollout.agent import MultiTurn
from knitdata.rollout.hf import from_hf_generate
from knitdata.rollout.multimodal import attach_media, media_item
from knitdata.rollout.openai import from_openai
from knitdata.rollout.partial import Continuation, PartialRollout, Segment, SegmentBuffer
from knitdata.rollout.sample import LOGPROBS_KEY, RolloutGroup, RolloutSample
from knitdata.rollout.sglang import from_sglang
from knitdata.rollout.status import FINISH_REASONS, STATUSES, finish_status
from knitdata.rollout.vllm import from_vllm

__all__ = [
    "RolloutSample",
    "RolloutGroup",
    "LOGPROBS_KEY",
    "STATUSES",
    "FINISH_REASONS",
    "finish_status",
    "from_vllm",
    "from_sglang",
    "from_openai",
    "from_hf_generate",
    "MultiTurn",
    "attach_media",
    "media_item",
    "PartialRollout",
    "Segment",
    "Continuation",
    "SegmentBuffer",
]
