"""Learning benchmark: a small RL task trained *through* knitdata, where admission's staleness shows in the reward.

``python -m benchmarks learning [--full | --smoke] [--seeds N] [--json PATH] [--plot PATH]`` trains the same
policy on the same task with four regimes and reports the held-out reward per optimizer step (the analog of
the seed paper's Figure 9), its area under the curve (AUC), the final reward, the steps to reach 0.8 and
the architectural staleness each regime actually had.

Task. A prompt is 5 digits (0-9); the response is 5 digits generated autoregressively; the reward is the
fraction of positions equal to the sorted prompt. The policy is an MLP (:class:`SortPolicy`) that sees the
prompt (one-hot per position and its digit histogram), the digits generated so far (one-hot and histogram)
and the position; a held-out set of prompts is decoded greedily after every ``eval_every`` steps.

Learner. GRPO-style: ``g`` responses per prompt (a group), advantage = (reward - group mean) / group std,
computed by rollout when the group finishes; PPO-clipped surrogate (clip 0.2) with the behaviour log-probs
recorded at generation (so stale data is corrected by the importance ratio and clipped, as in practice);
Adam. One optimizer step per mini-batch (the trainer steps after the micro-batch with ``info.is_last``).

What runs for real. Every trajectory goes through an embedded :class:`~knitdata.pipeline.Pipeline`: rollout
puts it (with its ``gen_version``, behaviour log-probs, reward and advantage) as soon as its group
finishes; the pipeline's admission policy decides which mini-batch it joins and when, its planner and the
consumer's :class:`~knitdata.consumer.dataset.TrajectoryDataset` (``fetch="iter"``: a background prefetch thread
fetches and collates) deliver it; the trainer consumes that dataset, steps, and calls
:meth:`~knitdata.pipeline.Pipeline.report_version`; then the new weights are synced to rollout
(after every optimizer step). Staleness is read from what the trainer received
(``info.gen_versions`` against the trainer's version), not assumed.

What is simulated: time. A seeded virtual clock (an event loop, one thread) stands in for wall time, so that
this 2-core machine can run four regimes over several seeds in minutes, and every regime sees the same
durations. Rollout has ``slots`` concurrent group slots (the rollout workers); a group's generation time is
drawn log-normal per source from a :mod:`benchmarks.sim` scenario (default ``skewed``: math / code / agent
with mean 1 / 2 / 4 time units, log-sigma 0.3 / 0.6 / 1.0). A group that starts samples its ``g``
responses at once with the rollout weights of that instant (the version last synced) and is put into the
pipeline when its duration has elapsed; groups that start at the same instant are sampled in one batched
forward. Rollout works through train batches in order and dispatches train batch ``b + 1`` once batch ``b``
is fully admitted (the pipeline's ``on_plan`` hook reports each admitted mini-batch). The trainer takes
``train_time`` per mini-batch: it starts a step when it is idle and the pipeline has admitted a mini-batch it
has not trained, pulls that mini-batch from the dataset, and its new version reaches rollout when the step's
time has elapsed. Payloads, admission, planning and delivery order are the pipeline's; only the durations are
virtual. Threads: the event loop (rollout slots and the trainer take turns on it: the rollout workers are the
slots of the clock, not OS threads, which on 2 cores would only add scheduling noise and nondeterminism) and
the dataset's prefetch thread.

Presets: ``quick`` (default; B = 1,024 = 128 prompts x 8, M = 16, 320 steps, 3 seeds, every regime plus the
two-speed comparison: 12 minutes here, 566 s of them the twelve regimes, at a load average of 5 on 2 cores),
``--full`` (640 steps, 5 seeds, reward measured every step) and ``--smoke`` (tests).

Regimes (the only difference between the three disaggregated ones is the admission policy; the same task,
seeds, prompts, sampling noise and generation times for all four base regimes):

- ``train_batch``, ``linear_target``, ``constraint_preserving``: the pipeline's admission policy of that name.
- ``colocated``: the reference; rollout generates the whole train batch, then the trainer trains its ``M``
  mini-batches while rollout waits (train-batch admission, and batch ``b + 1`` is dispatched only after
  batch ``b``'s last optimizer step), so mini-batch ``k`` has staleness ``k`` and architectural staleness 0.
- ``bound_<eta>_<drop|wait>`` (eta in :data:`BOUND_ETAS`): constraint-preserving admission with
  ``Pipeline(..., max_staleness=eta, on_stale=...)`` on a continuous prompt stream (rollout keeps every slot busy
  with the next train batches' prompts, AReaL-style, instead of waiting for a batch to be admitted). ``drop``:
  each group :meth:`~knitdata.pipeline.Pipeline.dropped` lists is generated again first (same prompt and
  noise, new group id, a fresh seeded generation time); ``wait``: a prompt starts only when
  :meth:`~knitdata.pipeline.Pipeline.rollout_capacity` has room for its source (then ``acquire_rollout``), and
  finished groups are put as they finish (``LearningConfig.wait_in_order``: in each source's start order instead).
  Figures added: ``worst_staleness`` (largest trainer version - ``gen_version`` trained) and
  ``wasted_token_share`` (the *discarded* share: tokens of dropped groups / tokens generated, printed beside the
  AUC); for every regime the pipeline's staleness split (``staleness_generating_mean``,
  ``staleness_queued_mean``: of the staleness trained, versions that passed while a group was generated / while
  it waited in the pipeline). ``fifo_bound_<eta>_<mode>``: the same
  with a FIFO mini-batch stream (verl's arrangement: no quotas, and what the bound drops is discarded, not
  regenerated; the prompt stream goes on), used by the two-speed comparison
  (:func:`run_two_speed`, JSON key ``two_speed``): an easy fast source beside a hard slow one.

Figures: AUC = mean held-out reward over the evaluated steps (0 to ``steps``); final reward = mean over the
last 10% of the evaluated steps; steps to 0.8 = first evaluated step whose held-out reward is >= 0.8;
architectural staleness per trajectory = (trainer version - gen_version) - mini-batch index within its train
batch, reported as the mean of its positive part (the headline), the signed mean, p95 and the
share of negative values. ``gap_closed`` = (AUC(constraint_preserving) - AUC(train_batch)) /
(AUC(colocated) - AUC(train_batch)), per seed and its median.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/learning.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import hashlib
import heapq
import json
import math
import statistics
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.sim import SCENARIOS, Scenario, SourceParams, get_scenario
from knitdata.admission import AdmittedMiniBatch, BatchSpec
from knitdata.consumer.collate import MicroBatch, MicroBatchInfo, TokenCollator
from knitdata.errors import ConfigError, RolloutThrottled
from knitdata.pipeline import Pipeline
from knitdata.record import Trajectory
from knitdata.staleness import summarize

__all__ = [
    "REGIMES",
    "BASE_REGIMES",
    "BOUND_ETAS",
    "BOUND_REGIMES",
    "TWO_SPEED",
    "TWO_SPEED_REGIMES",
    "parse_regime",
    "LearningConfig",
    "PRESETS",
    "SortPolicy",
    "sort_reward",
    "group_advantages",
    "GroupWork",
    "batch_workload",
    "regenerated",
    "heldout_prompts",
    "fast_collate",
    "RegimeRun",
    "run_regime",
    "run_learning",
    "run_two_speed",
    "compare",
    "update_report",
    "format_table",
    "plot",
    "add_arguments",
    "run",
]

#: Staleness bounds ``eta`` of the ``bound_<eta>_<drop|wait>`` regimes.
BOUND_ETAS: tuple[int, ...] = (1, 2, 4, 8)
#: Constraint-preserving admission with ``max_staleness=eta`` and ``on_stale`` drop or wait (issue 26).
BOUND_REGIMES: tuple[str, ...] = tuple(f"bound_{e}_{m}" for e in BOUND_ETAS for m in ("drop", "wait"))
#: The regimes without a bound: colocated and the three admission policies.
BASE_REGIMES: tuple[str, ...] = ("colocated", "train_batch", "linear_target", "constraint_preserving")
#: Regimes in report order.
REGIMES: tuple[str, ...] = (*BASE_REGIMES, *BOUND_REGIMES)
#: The two-source scenario (a fast easy source beside a slow hard one): its regimes compare constraint-preserving
#: admission with the bound against a FIFO mini-batch stream with the same bound (verl's arrangement).
TWO_SPEED_REGIMES: tuple[str, ...] = ("bound_2_drop", "fifo_bound_2_drop")
#: The two-source scenario: ``easy`` prompts use digits 0-2 and take 0.5 time units, ``hard`` prompts use 0-9 and
#: take 3 (log-normal); equal quotas; the held-out set is the hard task's.
TWO_SPEED = Scenario("two_speed", (SourceParams("easy", 128, 0.5, 0.3), SourceParams("hard", 128, 3.0, 0.6)))
#: Largest prompt digit + 1 per source (10 where not named).
_SOURCE_VOCAB: dict[str, int] = {"easy": 3}

_VOCAB = 10
_THRESHOLD = 0.8


@dataclass(frozen=True)
class LearningConfig:
    """Every parameter of a run (reported with the figures).

    Attributes:
        scenario: A :mod:`benchmarks.sim` scenario whose sources give the generation-time distributions
            (one log-normal draw per group) and the quota proportions.
        prompts_per_batch: Prompts (groups) per train batch.
        group_size: ``g``, responses per prompt.
        num_minibatches: ``M``, optimizer steps per train batch.
        num_batches: Train batches (``steps = num_batches * M``).
        slots: Concurrent rollout group slots (``C``, in groups).
        train_time: Virtual time of one optimizer step.
        digits: Prompt / response length.
        hidden: Hidden width of the policy MLP.
        lr: Adam learning rate.
        clip: PPO clip epsilon.
        eval_prompts: Size of the held-out prompt set (decoded greedily).
        eval_every: Evaluate after every this many steps (and at step 0).
        seeds: Seeds (each runs every regime).
        wait_in_order: ``bound_<eta>_wait`` regimes: rollout puts each source's groups in the order it started them
            (a group that finishes before an older one of its source is held until that one is put); ``False``
            (default): as they finish, as a real engine does (admission keeps the slot of each started group, so
            a slow group overtaken by newer ones of its source does not expire).
    """

    scenario: str = "skewed"
    prompts_per_batch: int = 128
    group_size: int = 8
    num_minibatches: int = 16
    num_batches: int = 20
    slots: int = 64
    train_time: float = 0.25
    digits: int = 5
    hidden: int = 128
    lr: float = 3e-3
    clip: float = 0.2
    eval_prompts: int = 256
    eval_every: int = 2
    seeds: tuple[int, ...] = (0, 1, 2)
    wait_in_order: bool = False

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS and self.scenario != TWO_SPEED.name:
            raise ConfigError(f"unknown scenario {self.scenario!r}; choose one of "
                              f"{sorted([*SCENARIOS, TWO_SPEED.name])}")
        for name in ("prompts_per_batch", "group_size", "num_minibatches", "num_batches", "slots", "digits",
                     "hidden", "eval_prompts", "eval_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"LearningConfig.{name} must be a positive int, got {v!r}")
        if self.group_size < 2:
            raise ConfigError("LearningConfig.group_size must be >= 2 (group-relative advantages)")
        if self.prompts_per_batch % self.num_minibatches:
            raise ConfigError(
                f"prompts_per_batch ({self.prompts_per_batch}) must be a multiple of num_minibatches "
                f"({self.num_minibatches}): mini-batches hold whole groups"
            )
        if not self.seeds:
            raise ConfigError("LearningConfig.seeds must name at least one seed")
        if not isinstance(self.wait_in_order, bool):
            raise ConfigError(f"LearningConfig.wait_in_order must be a bool, got {self.wait_in_order!r}")
        if not (self.train_time >= 0 and self.lr > 0 and 0 < self.clip < 1):
            raise ConfigError("LearningConfig: need train_time >= 0, lr > 0 and 0 < clip < 1")
        self.spec()  # validates the quotas

    @property
    def steps(self) -> int:
        """Optimizer steps per run."""
        return self.num_batches * self.num_minibatches

    @property
    def batch_size(self) -> int:
        """``B`` in trajectories."""
        return self.prompts_per_batch * self.group_size

    def group_quotas(self) -> dict[str, int]:
        """Groups per train batch per source: the scenario's quota proportions, largest remainder."""
        sources = _scenario(self.scenario).sources
        total = sum(s.quota for s in sources)
        exact = [self.prompts_per_batch * s.quota / total for s in sources]
        q = [int(math.floor(x)) for x in exact]
        for i in sorted(range(len(q)), key=lambda i: (q[i] - exact[i], i))[: self.prompts_per_batch - sum(q)]:
            q[i] += 1
        return {s.name: n for s, n in zip(sources, q) if n > 0}

    def spec(self) -> BatchSpec:
        """The pipeline's batch spec (quotas in trajectories)."""
        return BatchSpec({s: n * self.group_size for s, n in self.group_quotas().items()}, self.num_minibatches,
                         self.group_size)

    def params(self) -> dict[str, Any]:
        """JSON-serializable parameters, with the derived sizes and source distributions."""
        d = asdict(self)
        d["seeds"] = list(self.seeds)
        d["B"] = self.batch_size
        d["m"] = self.batch_size // self.num_minibatches
        d["steps"] = self.steps
        d["quotas_groups"] = self.group_quotas()
        d["sources"] = [
            {"name": s.name, "mean": s.mean, "sigma": s.sigma, "vocab": _SOURCE_VOCAB.get(s.name, _VOCAB)}
            for s in _scenario(self.scenario).sources
        ]
        d["policy_parameters"] = sum(p.numel() for p in SortPolicy(self.digits, self.hidden).parameters())
        return d


def _scenario(name: str) -> Scenario:
    return TWO_SPEED if name == TWO_SPEED.name else get_scenario(name)


def parse_regime(name: str) -> tuple[str, int | None, str]:
    """``(admission policy, max_staleness or None, on_stale)`` of a regime name.

    ``colocated`` and the policy names have no bound; ``bound_<eta>_<drop|wait>`` is constraint-preserving admission
    with that bound, ``fifo_bound_<eta>_<drop|wait>`` a FIFO mini-batch stream with it.

    Raises:
        ConfigError: Not a regime name.
    """
    if name in ("colocated", "train_batch", "linear_target", "constraint_preserving"):
        return ("train_batch" if name == "colocated" else name), None, "drop"
    parts = name.split("_")
    policy = "constraint_preserving"
    if parts[0] == "fifo":
        policy, parts = "fifo", parts[1:]
    if len(parts) == 3 and parts[0] == "bound" and parts[1].isdigit() and parts[2] in ("drop", "wait"):
        return policy, int(parts[1]), parts[2]
    raise ConfigError(f"unknown regime {name!r}; choose one of {REGIMES}, or [fifo_]bound_<eta>_<drop|wait>")


#: Named presets: ``quick`` (the default, about 12 minutes here), ``full`` and ``smoke`` (tests, seconds).
PRESETS: dict[str, LearningConfig] = {
    "quick": LearningConfig(),
    "full": LearningConfig(num_batches=40, eval_every=1, seeds=(0, 1, 2, 3, 4)),
    "smoke": LearningConfig(prompts_per_batch=8, group_size=4, num_minibatches=4, num_batches=3, slots=4,
                            hidden=16, eval_prompts=16, eval_every=1, seeds=(0,)),
}


# ----------------------------------------------------------------------------------------------------------
# The task and the policy
# ----------------------------------------------------------------------------------------------------------


class SortPolicy(nn.Module):
    """Autoregressive MLP policy for sorting ``digits`` digits.

    Input at position ``t``: the prompt (one-hot per position and its digit histogram), the response so far
    (one-hot per position, zeros from ``t`` on, and its histogram) and a one-hot of ``t``. Two hidden ReLU
    layers of width ``hidden``; output: logits over the 10 digits.

    Args:
        digits: Prompt and response length ``L``.
        hidden: Hidden width.
    """

    _eye: torch.Tensor  # buffers, registered in __init__
    _before: torch.Tensor

    def __init__(self, digits: int = 5, hidden: int = 128) -> None:
        super().__init__()
        self.digits = digits
        n_in = 2 * digits * _VOCAB + 2 * _VOCAB + digits
        self.net = nn.Sequential(
            nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, _VOCAB)
        )
        self.register_buffer("_eye", torch.eye(digits), persistent=False)
        self.register_buffer("_before", torch.tril(torch.ones(digits, digits), -1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, 10]`` for input features ``[N, n_in]``."""
        return self.net(x)

    def _prompt_features(self, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        oh = torch.nn.functional.one_hot(prompts, _VOCAB).to(torch.float32)  # [N, L, V]
        return oh.reshape(prompts.shape[0], -1), oh.sum(1)

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Generate responses for ``prompts`` (``int64 [N, L]``).

        Args:
            prompts: The prompts.
            uniforms: ``[N, L]`` uniforms in [0, 1) for inverse-CDF sampling (so a row's sample depends on
                its own noise only, whatever the batch), or ``None`` for greedy decoding.

        Returns:
            ``(responses int64 [N, L], log-probs float32 [N, L])`` of the chosen tokens.
        """
        n, L = prompts.shape
        po, ph = self._prompt_features(prompts)
        gen = torch.zeros(n, L * _VOCAB)
        gh = torch.zeros(n, _VOCAB)
        toks = torch.zeros(n, L, dtype=torch.int64)
        lps = torch.zeros(n, L)
        rows = torch.arange(n)
        for t in range(L):
            x = torch.cat([po, ph, gen, gh, self._eye[t].expand(n, L)], 1)
            lp = torch.log_softmax(self(x), -1)
            if uniforms is None:
                tok = lp.argmax(-1)
            else:
                c = lp.exp().cumsum(-1)
                tok = (c < uniforms[:, t : t + 1] * c[:, -1:]).sum(-1).clamp_max(_VOCAB - 1)
            toks[:, t] = tok
            lps[:, t] = lp.gather(1, tok[:, None])[:, 0]
            gen[rows, t * _VOCAB + tok] = 1.0
            gh[rows, tok] += 1.0
        return toks, lps

    def logprobs(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Teacher-forced log-probs ``[N, L]`` of ``responses`` (one batched forward over all positions)."""
        n, L = prompts.shape
        po, ph = self._prompt_features(prompts)
        ro = torch.nn.functional.one_hot(responses, _VOCAB).to(torch.float32)  # [N, L, V]
        prev = self._before[None, :, :, None] * ro[:, None, :, :]  # [N, t, s, V]: tokens s < t
        x = torch.cat(
            [
                po[:, None, :].expand(n, L, L * _VOCAB),
                ph[:, None, :].expand(n, L, _VOCAB),
                prev.reshape(n, L, L * _VOCAB),
                prev.sum(2),
                self._eye[None].expand(n, L, L),
            ],
            2,
        ).reshape(n * L, -1)
        lp = torch.log_softmax(self(x), -1).reshape(n, L, _VOCAB)
        return lp.gather(2, responses[:, :, None])[:, :, 0]


def sort_reward(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Fraction of positions where the response equals the sorted prompt (``float32 [N]``)."""
    return (responses == prompts.sort(1).values).to(torch.float32).mean(1)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO advantages of ``rewards [G, g]``: (reward - group mean) / (group std + 1e-6)."""
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, unbiased=False, keepdim=True)
    return (rewards - mean) / (std + 1e-6)


# ----------------------------------------------------------------------------------------------------------
# The seeded workload: identical in every regime
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupWork:
    """One group of a train batch: what rollout is asked to generate (the same in every regime).

    Attributes:
        batch: Train batch index.
        index: Position in the batch's dispatch order.
        group: Group id (``b<batch>g<index>``).
        source: Source name.
        prompt: ``int64 [L]`` prompt digits.
        duration: Generation time (virtual).
        uniforms: ``float32 [g, L]`` sampling noise of its members.
    """

    batch: int
    index: int
    group: str
    source: str
    prompt: torch.Tensor
    duration: float
    uniforms: torch.Tensor


def batch_workload(cfg: LearningConfig, seed: int, batch: int) -> list[GroupWork]:
    """The groups of train batch ``batch`` in dispatch order (a seeded permutation of the sources' quotas).

    Durations are log-normal per source with the scenario's mean and log-sigma; prompts and sampling noise
    are drawn from the same seeded stream, so every regime gets the same ones.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x1EA2, batch]))
    by_name = {s.name: s for s in _scenario(cfg.scenario).sources}
    names = [s for s, n in cfg.group_quotas().items() for _ in range(n)]
    order = rng.permutation(len(names))
    prompts = rng.integers(0, _VOCAB, (len(names), cfg.digits))
    for j, i in enumerate(order):  # a source with a smaller digit range (an easier task)
        vocab = _SOURCE_VOCAB.get(names[i], _VOCAB)
        if vocab != _VOCAB:
            prompts[j] %= vocab
    uniforms = rng.random((len(names), cfg.group_size, cfg.digits)).astype(np.float32)
    normals = rng.standard_normal(len(names))
    out = []
    for j, i in enumerate(order):
        src = by_name[names[i]]
        dur = math.exp(math.log(src.mean) - src.sigma * src.sigma / 2.0 + src.sigma * float(normals[j]))
        out.append(GroupWork(batch, j, f"b{batch}g{j}", src.name, torch.from_numpy(prompts[j]),
                             dur, torch.from_numpy(uniforms[j])))
    return out


def regenerated(cfg: LearningConfig, seed: int, w: GroupWork) -> GroupWork:
    """A dropped group generated again: the same prompt and sampling noise, a new group id (``<group>r``) and a new
    seeded draw of its generation time."""
    gid = f"{w.group}r"
    src = next(s for s in _scenario(cfg.scenario).sources if s.name == w.source)
    digest = int.from_bytes(hashlib.blake2b(gid.encode(), digest_size=8).digest(), "little")
    z = float(np.random.default_rng(np.random.SeedSequence([seed, 0x2E6E, digest])).standard_normal())
    dur = math.exp(math.log(src.mean) - src.sigma * src.sigma / 2.0 + src.sigma * z)
    return replace(w, group=gid, duration=dur)


def heldout_prompts(cfg: LearningConfig) -> torch.Tensor:
    """The fixed held-out prompts (the same for every seed and regime)."""
    rng = np.random.default_rng(np.random.SeedSequence([0x4E1D, cfg.digits]))
    return torch.from_numpy(rng.integers(0, _VOCAB, (cfg.eval_prompts, cfg.digits)))


def fast_collate(trajs: Sequence[Trajectory], info: MicroBatchInfo | None = None) -> MicroBatch:
    """Collate fixed-length trajectories by stacking (prompt and response of equal lengths across rows).

    ``input_ids = [prompt | response]``, ``loss_mask`` 1 on responses, ``scalars`` and the response-aligned
    ``tensors["behaviour_logp"]`` stacked; the empty micro-batch is :meth:`TokenCollator.empty`.
    """
    if not trajs:
        return TokenCollator().empty(info)
    p = torch.stack([t.prompt_ids for t in trajs])
    r = torch.stack([t.response_ids for t in trajs])
    n, lp, lr = p.shape[0], p.shape[1], r.shape[1]
    ids = torch.cat([p, r], 1)
    loss = torch.cat([torch.zeros(n, lp), torch.ones(n, lr)], 1)
    blp = torch.stack([t.tensors["behaviour_logp"] for t in trajs])
    return MicroBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(lp + lr).expand(n, lp + lr),
        loss_mask=loss,
        cu_seqlens=None,
        scalars={k: torch.tensor([t.scalars[k] for t in trajs], dtype=torch.float32) for k in ("reward", "advantage")},
        tensors={"behaviour_logp": torch.cat([torch.zeros(n, lp), blp], 1)},
        info=info,
        prompt_lengths=torch.full((n,), lp, dtype=torch.int64),
        response_lengths=torch.full((n,), lr, dtype=torch.int64),
    )


# ----------------------------------------------------------------------------------------------------------
# One regime, one seed
# ----------------------------------------------------------------------------------------------------------


@dataclass
class RegimeRun:
    """What one (regime, seed) run produced.

    Attributes:
        regime: Regime name.
        seed: Seed.
        eval_steps: Steps at which the held-out reward was measured.
        rewards: Held-out reward at those steps.
        raw_staleness: Per trained trajectory, trainer version - gen_version.
        arch_staleness: Per trained trajectory, raw staleness - mini-batch index within its train batch.
        put_ids: Trajectory ids put, in order.
        delivered_ids: Trajectory ids the trainer received, in order.
        reported_versions: Versions passed to ``report_version``.
        minibatch_versions: Per optimizer step, the trainer version its gradient was computed with.
        workload_digest: Digest of the (group, source, prompt, duration) set generated.
        pipeline_stats: ``pipe.stats()`` at the end (counts and the pipeline's own staleness summary).
        virtual_time: Virtual time at the end.
        wall_s: Wall seconds.
        generated_tokens: Tokens (prompt + response) of every trajectory rollout put.
        dropped_tokens: Of those, the tokens the staleness bound dropped (rollout work wasted).
        trained_by_source: Trajectories the trainer received, per source.
        started_groups: Group ids in the order rollout started them.
    """

    regime: str
    seed: int
    eval_steps: list[int]
    rewards: list[float]
    raw_staleness: list[int]
    arch_staleness: list[int]
    put_ids: list[str]
    delivered_ids: list[str]
    reported_versions: list[int]
    minibatch_versions: list[int]
    workload_digest: str
    pipeline_stats: dict[str, Any]
    virtual_time: float
    wall_s: float
    generated_tokens: int = 0
    dropped_tokens: int = 0
    trained_by_source: dict[str, int] = field(default_factory=dict)
    started_groups: list[str] = field(default_factory=list)


def run_regime(cfg: LearningConfig, regime: str, seed: int) -> RegimeRun:
    """Train one seed under one regime through an embedded :class:`~knitdata.pipeline.Pipeline`.

    Raises:
        ConfigError: Unknown regime.
        RuntimeError: The loop stalled or the pipeline delivered something out of plan (a bug).
    """
    policy_name, eta, on_stale = parse_regime(regime)
    bound = eta is not None
    t_wall = time.perf_counter()
    M, g, L = cfg.num_minibatches, cfg.group_size, cfg.digits
    colocated = regime == "colocated"
    torch.manual_seed(seed)
    trainer = SortPolicy(L, cfg.hidden)
    rollout = SortPolicy(L, cfg.hidden)
    rollout.load_state_dict(trainer.state_dict())
    opt = torch.optim.Adam(trainer.parameters(), lr=cfg.lr)
    heldout = heldout_prompts(cfg)

    admitted: list[AdmittedMiniBatch] = []
    full_batches = [0]  # train batches whose last mini-batch the pipeline admitted

    def on_plan(mb: AdmittedMiniBatch, plan: Any) -> None:
        admitted.append(mb)
        if mb.index == M - 1:
            full_batches[0] += 1

    pipe = Pipeline(
        cfg.spec(),
        admission=policy_name,
        max_staleness=eta,
        on_stale=on_stale,
        num_consumers=1,
        token_budget=max(8192, cfg.batch_size * 2 * L),
        capacity_bytes=1 << 28,
        on_plan=on_plan,
    )
    ds = pipe.dataset(0, fetch="iter", collate=fast_collate)
    it = iter(ds)

    FINISH, TRAIN_DONE = 0, 1
    events: list[tuple[float, int, int, Any]] = []
    order = 0
    now = 0.0
    queue: deque[GroupWork] = deque()
    running = 0
    dispatched = 0  # train batches dispatched
    unfinished: list[dict[str, int]] = []
    version = 0
    started_steps = 0
    done_steps = 0
    busy = False
    out = RegimeRun(regime, seed, [], [], [], [], [], [], [], [], "", {}, 0.0, 0.0)
    works: dict[str, GroupWork] = {}  # bound regimes: the groups put, to regenerate a dropped one
    source_of: dict[str, str] = {}
    digest = hashlib.blake2b(digest_size=16)
    in_order = bound and on_stale == "wait" and cfg.wait_in_order
    started: dict[str, deque[str]] = {}  # in order: per source, the groups started and not put yet, in start order
    held: dict[str, Any] = {}  # in order: finished groups held until the older ones of their source are put

    def evaluate(step: int) -> None:
        with torch.no_grad():
            resp, _ = trainer.sample(heldout, None)
        out.eval_steps.append(step)
        out.rewards.append(float(sort_reward(heldout, resp).mean()))

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal order
        heapq.heappush(events, (t, order, kind, payload))
        order += 1

    def stream() -> list[GroupWork]:
        """Bound regimes: a continuous prompt stream (AReaL-style); ``wait`` starts only what the bound has room for."""
        nonlocal dispatched
        while len(queue) < cfg.prompts_per_batch:
            work = batch_workload(cfg, seed, dispatched)
            for w in work:
                digest.update(f"{w.group}|{w.source}|{w.prompt.tolist()}|{w.duration:.17g};".encode())
            queue.extend(work)
            dispatched += 1
        starting: list[GroupWork] = []
        if on_stale != "wait":
            while queue and running + len(starting) < cfg.slots:
                starting.append(queue.popleft())
            return starting
        cap = pipe.rollout_capacity(version)
        skipped: list[GroupWork] = []
        while queue and running + len(starting) < cfg.slots and any(cap.values()):
            w = queue.popleft()
            if cap[w.source] > 0:
                try:  # the sources' capacities can share room: each start is checked by the pipeline
                    pipe.acquire_rollout(w.source, 1, version=version, timeout=0)
                except RolloutThrottled:
                    cap[w.source] = 0
                    skipped.append(w)
                    continue
                cap[w.source] -= 1
                starting.append(w)
            else:
                skipped.append(w)
        queue.extendleft(reversed(skipped))
        return starting

    def dispatch() -> None:
        nonlocal dispatched, running
        while not bound and dispatched < cfg.num_batches and (
            (done_steps >= dispatched * M) if colocated else (full_batches[0] >= dispatched)
        ):
            work = batch_workload(cfg, seed, dispatched)
            counts = dict.fromkeys(cfg.group_quotas(), 0)
            for w in work:
                counts[w.source] += g
                digest.update(f"{w.group}|{w.source}|{w.prompt.tolist()}|{w.duration:.17g};".encode())
            unfinished.append(counts)
            queue.extend(work)
            dispatched += 1
        if bound:
            starting = stream()
            running += len(starting)
        else:
            starting = []
            while queue and running < cfg.slots:
                starting.append(queue.popleft())
                running += 1
        if not starting:
            return
        # the groups starting now sample with the weights rollout holds now: one batched forward
        prompts = torch.stack([w.prompt for w in starting]).repeat_interleave(g, 0)
        uniforms = torch.cat([w.uniforms for w in starting])
        resp, lps = rollout.sample(prompts, uniforms)
        rewards = sort_reward(prompts, resp).reshape(len(starting), g)
        adv = group_advantages(rewards)
        for i, w in enumerate(starting):
            out.started_groups.append(w.group)
            if in_order:
                started.setdefault(w.source, deque()).append(w.group)
            push(now + w.duration, FINISH, (w, version, resp[i * g : (i + 1) * g], lps[i * g : (i + 1) * g],
                                            rewards[i], adv[i]))

    def finish(payload: Any) -> None:
        """A group's generation ended: its slot is free; it is put now, or (in order) once the older groups of its
        source are."""
        nonlocal running
        running -= 1
        if not in_order:
            put_group(payload)
            return
        held[payload[0].group] = payload
        q = started[payload[0].source]
        while q and q[0] in held:
            put_group(held.pop(q.popleft()))

    def put_group(payload: Any) -> None:
        w, gen_version, resp, lps, rewards, adv = payload
        for i in range(g):
            tid = f"{w.group}m{i}"
            pipe.put(
                Trajectory(
                    id=tid,
                    source=w.source,
                    group=w.group,
                    prompt_ids=w.prompt,
                    response_ids=resp[i],
                    gen_version=gen_version,
                    scalars={"reward": float(rewards[i]), "advantage": float(adv[i])},
                    tensors={"behaviour_logp": lps[i]},
                )
            )
            out.put_ids.append(tid)
            source_of[tid] = w.source
        if bound:
            works[w.group] = w
            for d in pipe.dropped():  # regenerate each dropped group first: same prompt, a new generation
                old = works.pop(d["group"])
                if policy_name != "fifo":  # FIFO (verl's arrangement) discards it; the stream goes on
                    queue.appendleft(regenerated(cfg, seed, old))
            return
        left = unfinished[w.batch]
        left[w.source] -= g
        cur = full_batches[0]
        if cur < len(unfinished):
            pipe.set_in_flight(unfinished[cur])

    def maybe_train() -> None:
        nonlocal busy, started_steps
        if busy or started_steps >= len(admitted) or started_steps >= cfg.steps:
            return
        # the pipeline admitted mini-batch `started_steps`: pull its micro-batches from the dataset
        parts = []
        while True:
            mb = next(it)
            info = mb.info
            if info is None or info.minibatch != started_steps:
                raise RuntimeError(f"expected mini-batch {started_steps}, the dataset delivered {info}")
            parts.append(mb)
            if info.is_last:
                break
        opt.zero_grad(set_to_none=True)
        last = parts[-1].info
        assert last is not None  # checked as the parts were pulled
        total = last.global_trajectories * L
        for mb in parts:
            if mb.is_empty:
                continue
            info = mb.info
            assert info is not None  # checked as the parts were pulled
            k = info.minibatch_in_batch
            for gv in info.gen_versions:
                out.raw_staleness.append(version - gv)
                out.arch_staleness.append(version - gv - k)
            out.delivered_ids.extend(info.trajectory_ids)
            for tid in info.trajectory_ids:
                src = source_of.pop(tid)
                out.trained_by_source[src] = out.trained_by_source.get(src, 0) + 1
            p = mb.input_ids[:, :L]
            r = mb.input_ids[:, L:]
            lp = trainer.logprobs(p, r)
            ratio = (lp - mb.tensors["behaviour_logp"][:, L:]).exp()
            a = mb.scalars["advantage"][:, None]
            surrogate = torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * a)
            (-surrogate.sum() / total).backward()
        opt.step()
        out.minibatch_versions.append(version)
        started_steps += 1
        busy = True
        push(now + cfg.train_time, TRAIN_DONE, None)

    def train_done() -> None:
        nonlocal busy, version, done_steps
        busy = False
        done_steps += 1
        version += 1
        pipe.report_version(version)
        out.reported_versions.append(version)
        # the weights reach rollout once the pipeline has the report (pipe.version sends what this process queued
        # first), as a weight sync is slower than a report: groups then carry no version the pipeline has not seen
        if bound and pipe.version != version:
            raise RuntimeError(f"the pipeline has version {pipe.version} after report_version({version})")
        rollout.load_state_dict(trainer.state_dict())  # weight sync after every optimizer step
        if version % cfg.eval_every == 0 or version == cfg.steps:
            evaluate(version)

    try:
        evaluate(0)
        dispatch()
        while done_steps < cfg.steps:
            maybe_train()
            if not events:
                raise RuntimeError(
                    f"learning run {regime!r} seed {seed} stalled at t={now:.3f} after {done_steps} steps "
                    f"({len(admitted)} mini-batches admitted)"
                )
            now, _, kind, payload = heapq.heappop(events)
            if kind == FINISH:
                finish(payload)
            else:
                train_done()
            dispatch()
        out.pipeline_stats = pipe.stats()
        out.generated_tokens = len(out.put_ids) * 2 * L
        sb = out.pipeline_stats.get("staleness_bound") or {}
        out.dropped_tokens = int(sum((sb.get("dropped_tokens") or {}).values()))
    finally:
        ds.close()
        with warnings.catch_warnings():  # bound regimes: the stream's surplus at the end is never admitted
            warnings.simplefilter("ignore")
            pipe.close()
    out.workload_digest = digest.hexdigest()
    out.virtual_time = now
    out.wall_s = time.perf_counter() - t_wall
    return out


# ----------------------------------------------------------------------------------------------------------
# Many runs, the summary
# ----------------------------------------------------------------------------------------------------------


def _steps_to(steps: Sequence[int], rewards: Sequence[float], threshold: float) -> int | None:
    for s, r in zip(steps, rewards):
        if r >= threshold:
            return int(s)
    return None


def _split_mean(r: RegimeRun, key: str) -> float:
    """A mean of the pipeline's staleness split (versions generating / queued; ``nan`` if the pipeline had none)."""
    v = (r.pipeline_stats.get("staleness_split") or {}).get(key)
    return float(v) if isinstance(v, (int, float)) else math.nan


def _run_figures(r: RegimeRun) -> dict[str, Any]:
    rw = r.rewards
    tail = max(1, len(rw) // 10)
    arch = r.arch_staleness
    pos = [max(0, a) for a in arch]
    return {
        "auc": float(np.mean(rw)),
        "final_reward": float(np.mean(rw[-tail:])),
        "steps_to_0_8": _steps_to(r.eval_steps, rw, _THRESHOLD),
        "arch_staleness_positive_mean": float(np.mean(pos)) if pos else math.nan,
        "arch_staleness_mean": float(np.mean(arch)) if arch else math.nan,
        "arch_staleness_p95": summarize(arch)["p95"],
        "arch_staleness_negative_share": float(np.mean([a < 0 for a in arch])) if arch else math.nan,
        "raw_staleness_mean": float(np.mean(r.raw_staleness)) if r.raw_staleness else math.nan,
        "worst_staleness": max(r.raw_staleness) if r.raw_staleness else None,
        "wasted_token_share": r.dropped_tokens / r.generated_tokens if r.generated_tokens else 0.0,
        "staleness_generating_mean": _split_mean(r, "generating_mean"),
        "staleness_queued_mean": _split_mean(r, "queued_mean"),
        "virtual_time": r.virtual_time,
        "wall_s": r.wall_s,
    }


def _median_steps(vals: Sequence[int | None]) -> float | None:
    """Median with 'never reached' counted as infinitely many steps; ``None`` if that median is unreached."""
    xs = sorted(math.inf if v is None else float(v) for v in vals)
    m = statistics.median(xs)
    return None if math.isinf(m) else float(m)


def run_learning(cfg: LearningConfig, regimes: Sequence[str] = REGIMES, progress: bool = True,
                 ) -> tuple[dict[str, Any], dict[str, list[RegimeRun]]]:
    """Run every regime on every seed of ``cfg`` and summarize.

    Returns:
        ``(report, runs)``: the JSON document and the raw runs per regime (seed order).
    """
    jobs = [(s, r) for s in cfg.seeds for r in regimes]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="learning", unit="run", leave=False)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs: dict[str, list[RegimeRun]] = {r: [] for r in regimes}
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    try:
        for s, r in jobs:
            runs[r].append(run_regime(cfg, r, s))
            if bar is not None:
                bar.set_postfix_str(f"seed {s} {r}")
                bar.update(1)
    finally:
        torch.set_num_threads(prev_threads)
        if bar is not None:
            bar.close()
    report: dict[str, Any] = {
        "params": cfg.params(),
        "threshold": _THRESHOLD,
        "load_average_start": list(load0),
        "load_average_end": list(os.getloadavg()),
        "wall_s": time.perf_counter() - t0,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "regimes": {},
    }
    for name, rs in runs.items():
        per_seed = [_run_figures(x) for x in rs]
        curves = np.array([x.rewards for x in rs])
        row: dict[str, Any] = {
            "auc": float(np.mean([f["auc"] for f in per_seed])),
            "auc_std": float(np.std([f["auc"] for f in per_seed])),
            "final_reward": float(np.mean([f["final_reward"] for f in per_seed])),
            "final_reward_std": float(np.std([f["final_reward"] for f in per_seed])),
            "steps_to_0_8": _median_steps([f["steps_to_0_8"] for f in per_seed]),
            "reached_0_8": sum(f["steps_to_0_8"] is not None for f in per_seed),
        }
        for k in ("arch_staleness_positive_mean", "arch_staleness_mean", "arch_staleness_p95",
                  "arch_staleness_negative_share", "raw_staleness_mean", "wasted_token_share",
                  "staleness_generating_mean", "staleness_queued_mean", "virtual_time"):
            row[k] = float(np.mean([f[k] for f in per_seed]))
        worst = [f["worst_staleness"] for f in per_seed if f["worst_staleness"] is not None]
        row["worst_staleness"] = max(worst) if worst else None
        row["auc_median"] = float(np.median([f["auc"] for f in per_seed]))
        row["eval_steps"] = rs[0].eval_steps
        row["reward_mean"] = curves.mean(0).tolist()
        row["reward_std"] = curves.std(0).tolist()
        row["reward_min"] = curves.min(0).tolist()
        row["reward_max"] = curves.max(0).tolist()
        row["per_seed"] = {str(x.seed): f for x, f in zip(rs, per_seed)}
        row["pipeline"] = {str(x.seed): {k: x.pipeline_stats.get(k) for k in
                                         ("puts", "admitted_minibatches", "admitted_trajectories", "version",
                                          "staleness", "token_staleness", "staleness_split", "staleness_bound")}
                           for x in rs}
        report["regimes"][name] = row
    compare(report)
    return report, runs


def compare(report: dict[str, Any]) -> None:
    """Add (or replace) the comparisons of ``report``'s regimes: ``gap_closed`` (with colocated, train_batch and
    constraint_preserving; per seed from each row's ``per_seed`` AUCs) and ``bound_vs_colocated`` (with colocated)."""
    reg = report["regimes"]
    report.pop("gap_closed", None)
    report.pop("bound_vs_colocated", None)
    if {"colocated", "train_batch", "constraint_preserving"} <= set(reg):
        per: dict[str, float | None] = {}
        for seed, c in reg["colocated"]["per_seed"].items():
            t, p = reg["train_batch"]["per_seed"].get(seed), reg["constraint_preserving"]["per_seed"].get(seed)
            if t is None or p is None:
                continue
            a_c, a_t, a_p = c["auc"], t["auc"], p["auc"]
            per[seed] = (a_p - a_t) / (a_c - a_t) if a_c != a_t else None
        vals = [v for v in per.values() if v is not None]
        report["gap_closed"] = {
            "definition": "(AUC(constraint_preserving) - AUC(train_batch)) / (AUC(colocated) - AUC(train_batch))",
            "per_seed": per,
            "median": statistics.median(vals) if vals else None,
            "of_mean_auc": _ratio(reg),
        }
    if "colocated" in reg:
        co = reg["colocated"]["auc"]
        report["bound_vs_colocated"] = {
            "definition": "AUC(regime) / AUC(colocated) - 1 (mean AUCs over seeds)",
            **{n: reg[n]["auc"] / co - 1.0 for n in reg if n.startswith("bound_") and co}}


def _regime_params(p: dict[str, Any]) -> dict[str, Any]:
    """Parameters that every regime's figures depend on (``wait_in_order`` concerns the wait regimes only)."""
    return {k: v for k, v in p.items() if k != "wait_in_order"}


def update_report(old: dict[str, Any], new: dict[str, Any], note: str = "") -> dict[str, Any]:
    """``old`` with the regimes of ``new`` (a run of some regimes with the same parameters) in place of its own, the
    comparisons recomputed, and ``updated`` recording per regime replaced when and how it was re-run.

    Raises:
        ConfigError: ``new`` was run with other parameters than ``old``.
    """
    a, b = (_regime_params(x.get("params") or {}) for x in (old, new))
    if a != b:
        diff = sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
        raise ConfigError(f"cannot update a learning report run with other parameters (differ: {diff}); run every "
                          "regime instead")
    out = {**old, "params": new["params"], "regimes": {**old["regimes"], **new["regimes"]}}
    updated = dict(old.get("updated") or {})
    for name in new["regimes"]:
        updated[name] = {"wall_s": new["wall_s"], "load_average_start": new["load_average_start"],
                         "load_average_end": new["load_average_end"], "date_utc": new.get("date_utc"),
                         **({"note": note} if note else {})}
    out["updated"] = updated
    compare(out)
    return out


def run_two_speed(cfg: LearningConfig, progress: bool = True) -> dict[str, Any]:
    """The two-source comparison (issue 26.4): on :data:`TWO_SPEED` (a fast easy source beside a slow hard one),
    constraint-preserving admission with ``max_staleness=2`` (drop) against a FIFO mini-batch stream with the same
    bound (verl's arrangement), same seeds and workloads. The held-out reward is the hard (slow) source's task.

    Returns:
        ``{"params", "regimes": {name: summary}, "hard_share": {name: share of trained trajectories from the
        hard source, mean over seeds}, "auc_hard_median": {name: median over seeds}, "cp_minus_fifo_per_seed",
        "cp_beats_fifo"}``.
    """
    two = replace(cfg, scenario=TWO_SPEED.name)
    rep, runs = run_learning(two, TWO_SPEED_REGIMES, progress=progress)
    cp, fifo = TWO_SPEED_REGIMES
    per = {str(a.seed): float(np.mean(a.rewards)) - float(np.mean(b.rewards)) for a, b in zip(runs[cp], runs[fifo])}
    rep["hard_share"] = {n: float(np.mean([x.trained_by_source.get("hard", 0) / max(1, sum(x.trained_by_source.values()))
                                           for x in rs])) for n, rs in runs.items()}
    rep["auc_hard_median"] = {n: rep["regimes"][n]["auc_median"] for n in runs}
    rep["cp_minus_fifo_per_seed"] = per
    rep["cp_beats_fifo"] = rep["auc_hard_median"][cp] > rep["auc_hard_median"][fifo]
    return rep


def _ratio(regimes: dict[str, Any]) -> float | None:
    gap = regimes["colocated"]["auc"] - regimes["train_batch"]["auc"]
    return None if gap == 0 else (regimes["constraint_preserving"]["auc"] - regimes["train_batch"]["auc"]) / gap


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{nd}f}"
    return str(v)


def _pct(v: Any) -> str:
    return "-" if not isinstance(v, (int, float)) or math.isnan(v) else f"{100 * v:.1f}%"


def format_table(report: dict[str, Any]) -> str:
    """The printed table of a report."""
    p = report["params"]
    la = report["load_average_start"]
    lines = [
        f"learning: sort {p['digits']} digits, policy MLP {p['policy_parameters']} params (hidden {p['hidden']}), "
        f"Adam lr={p['lr']}, PPO clip {p['clip']}, GRPO g={p['group_size']}",
        f"  B={p['B']} ({p['prompts_per_batch']} prompts x {p['group_size']}), M={p['num_minibatches']}, m={p['m']}, "
        f"steps={p['steps']}, rollout slots C={p['slots']} groups, train_time/step={p['train_time']}, "
        f"scenario={p['scenario']} "
        + ", ".join(f"{s['name']}(q={p['quotas_groups'].get(s['name'], 0)} groups, mean={s['mean']}, "
                    f"sigma={s['sigma']})" for s in p["sources"]),
        f"  seeds={p['seeds']}, held-out {p['eval_prompts']} prompts every {p['eval_every']} steps; "
        f"load average at start {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}; wall {report['wall_s']:.0f} s",
        f"{'regime':<22}{'AUC':>8}{'+-':>7}{'discarded':>10}{'final':>8}{'+-':>7}{'steps->0.8':>12}{'reached':>9}"
        f"{'arch+':>8}{'arch':>8}{'arch_p95':>9}{'neg':>6}{'raw':>7}{'worst':>7}{'gen':>6}{'queued':>7}",
    ]
    n = len(p["seeds"])
    for name, r in report["regimes"].items():
        lines.append(
            f"{name:<22}{_fmt(r['auc']):>8}{_fmt(r['auc_std']):>7}{_pct(r.get('wasted_token_share')):>10}"
            f"{_fmt(r['final_reward']):>8}"
            f"{_fmt(r['final_reward_std']):>7}{_fmt(r['steps_to_0_8'], 0):>12}{r['reached_0_8']:>6}/{n:<2}"
            f"{_fmt(r['arch_staleness_positive_mean'], 2):>8}{_fmt(r['arch_staleness_mean'], 2):>8}"
            f"{_fmt(r['arch_staleness_p95'], 1):>9}{_fmt(r['arch_staleness_negative_share'], 2):>6}"
            f"{_fmt(r['raw_staleness_mean'], 2):>7}{_fmt(r.get('worst_staleness')):>7}"
            f"{_fmt(r.get('staleness_generating_mean'), 2):>6}{_fmt(r.get('staleness_queued_mean'), 2):>7}"
        )
    gc = report.get("gap_closed")
    if gc:
        per = ", ".join(f"{s}: {_fmt(v, 2)}" for s, v in gc["per_seed"].items())
        lines.append(
            f"AUC gap train_batch -> colocated closed by constraint_preserving: median over seeds "
            f"{_fmt(gc['median'], 2)} (per seed {per}; of the mean AUCs {_fmt(gc['of_mean_auc'], 2)})"
        )
    bvc = report.get("bound_vs_colocated")
    if bvc:
        lines.append("AUC against colocated: " + ", ".join(f"{k} {v * 100:+.1f}%" for k, v in bvc.items()
                                                          if k != "definition"))
    two = report.get("two_speed")
    if two:
        cp, fifo = TWO_SPEED_REGIMES
        med, share = two["auc_hard_median"], two["hard_share"]
        lines.append(f"two_speed (easy fast source beside a hard slow one, held-out = hard task): median AUC "
                     f"{cp} {_fmt(med[cp])} vs {fifo} {_fmt(med[fifo])}; hard source's share of trained "
                     f"trajectories {_fmt(share[cp], 2)} vs {_fmt(share[fifo], 2)}; constraint-preserving beats FIFO: "
                     f"{two['cp_beats_fifo']}")
    upd = report.get("updated")
    if upd:
        lines.append("re-run on newer code: " + ", ".join(f"{k} ({v.get('date_utc') or '?'})" for k, v in upd.items()))
    lines.append("(AUC, final: mean +- std over seeds; discarded: share of the generated tokens the staleness bound "
                 "dropped (JSON wasted_token_share); steps->0.8: median over seeds, '-' if the median seed never "
                 "reached it; arch+: mean positive part of architectural staleness, arch: signed mean, neg: share "
                 "< 0, raw: trainer version - gen_version; worst: largest staleness trained; gen / queued: of the "
                 "raw staleness, the versions that passed while a group was generated / while it waited in the "
                 "pipeline, pipe.stats()['staleness_split'])")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Held-out reward vs optimizer step per regime (mean over seeds, min-max band): the analog of Figure 9."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = report["params"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1.3]})
    names = list(report["regimes"])
    cmap = plt.get_cmap("tab20")
    colors = [cmap(i) for i in range(20)]
    for i, name in enumerate(names):
        r = report["regimes"][name]
        xs = r["eval_steps"]
        share = r.get("wasted_token_share")
        waste = f", {100 * share:.1f}% discarded" if name.startswith("bound_") and share is not None else ""
        ax.plot(xs, r["reward_mean"], label=f"{name} (AUC {r['auc']:.3f}{waste})", lw=1.4, color=colors[i % 20])
        ax.fill_between(xs, r["reward_min"], r["reward_max"], alpha=0.12, color=colors[i % 20])
    ax.axhline(_THRESHOLD, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out reward (greedy)")
    ax.set_title(f"sort {p['digits']} digits through knitdata: B={p['B']}, M={p['num_minibatches']}, "
                 f"{len(p['seeds'])} seeds (mean, min-max)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    xs = range(len(names))
    bx.bar(xs, [report["regimes"][n]["arch_staleness_positive_mean"] for n in names], color="C2")
    bx.set_xticks(list(xs), names, fontsize=7, rotation=90)
    bx.set_ylabel("architectural staleness, mean of max(0, a)")
    bx.set_title("measured staleness (steps)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's options."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--full", action="store_true", help="the longer preset (40 train batches, 5 seeds)")
    g.add_argument("--smoke", action="store_true", help="a tiny preset for tests (seconds)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (from 0); default per preset")
    parser.add_argument("--batches", type=int, default=None, help="train batches (steps = batches x M)")
    parser.add_argument("--regimes", default=",".join(REGIMES), help="comma-separated regimes to run")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG plot")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    parser.add_argument("--update", default=None, metavar="PATH",
                        help="a report of the same parameters: replace its regimes by the ones run now, keep the "
                             "others (and its two-speed part unless run again), recompute the comparisons")
    parser.add_argument("--no-two-speed", action="store_true",
                        help="skip the two-source comparison (constraint-preserving vs FIFO under the same bound)")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit code."""
    cfg = PRESETS["full" if args.full else "smoke" if args.smoke else "quick"]
    if args.seeds is not None:
        cfg = replace(cfg, seeds=tuple(range(max(1, args.seeds))))
    if args.batches is not None:
        cfg = replace(cfg, num_batches=args.batches)
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    for r in regimes:
        parse_regime(r)
    old = None
    if args.update:
        with open(args.update) as f:
            old = json.load(f)
    report, _ = run_learning(cfg, regimes, progress=not args.no_progress)
    if old is not None:
        report = update_report(old, report)
    if not args.no_two_speed:
        report["two_speed"] = run_two_speed(cfg, progress=not args.no_progress)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("learning"))
