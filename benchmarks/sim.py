"""A seeded, event-driven simulator of a disaggregated RL loop, driving the real admission policies.

Model (the same for every policy, so that only admission differs; the docs' Concepts page, "Admission and
staleness", explains the terms):

- Rollout has ``C`` slots (one trajectory each). A group's ``g`` trajectories are queued together; each
  has its own duration, drawn log-normal per source (``mean`` is the distribution's mean, ``sigma`` the
  log-space sigma). A trajectory that starts runs with the version last synced to rollout.
- Batch mode (default): rollout works through train batches in order and queues batch ``b+1``'s groups
  (in a seeded random order) once batch ``b`` is fully admitted: a one-step pipeline. Continuous mode
  (``Scenario.continuous``): one shared prompt stream, sources drawn with probability proportional to
  ``quota / (1 - drop)``; when a group completes, a dynamic-sampling filter drops it with probability
  ``drop`` (the sim calls :meth:`~knitdata.admission.AdmissionPolicy.withdraw`). Rollout keeps its slots
  busy except that a prompt is skipped while its source's expected yield (ready + finished members of
  incomplete groups + in flight x (1 - drop)) already covers the current and the next train batch; this
  bounds the surplus, which carries over to the next train batch.
- The trainer takes admitted mini-batches in order; a mini-batch with ``n`` tokens takes
  ``train_time * n / E[tokens per mini-batch]`` (tokens of a trajectory are proportional to its duration).
  Its gradient is computed with the current trainer version (staleness is counted there), then the
  optimizer step increments the version, and weights sync to rollout after every step (``sync="step"``)
  or every ``M`` steps (``sync="batch"``). In-flight trajectories continue (partial rollout:
  ``gen_version`` is the oldest version among their tokens, ``version_mean`` the token-weighted mean,
  tokens generated uniformly over the duration) or restart from scratch (``partial=False``).
- The colocated reference runs on the same durations: rollout of batch ``b`` (all at version ``b*M``,
  same ``C`` slots, same order), then ``M`` training steps; its architectural staleness is 0 by definition
  and its makespan is reported beside each policy's.

Per trajectory the simulator records source, group, finish time, admit time, mini-batch index and step,
gen_version, version_mean and the train version. Memory: O(trajectories simulated).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from knitdata.admission import AdmittedMiniBatch, BatchSpec, make_policy
from knitdata.errors import ConfigError
from knitdata.record import TrajectoryMeta
from knitdata.staleness import StalenessTracker, VersionClock, staleness_reduction

__all__ = [
    "SourceParams",
    "Scenario",
    "SCENARIOS",
    "get_scenario",
    "SimResult",
    "simulate",
    "colocated_makespan",
    "POLICY_NAMES",
    "compare",
    "expected_minibatch_tokens",
]

#: Policy names in report order.
POLICY_NAMES: tuple[str, ...] = ("train_batch", "fifo", "linear_target", "constraint_preserving")

_TOKENS_PER_TIME = 256.0
_BLOCK = 256  # groups per seeded block of the continuous stream


@dataclass(frozen=True)
class SourceParams:
    """One source of prompts.

    Attributes:
        name: Source name.
        quota: Trajectories per train batch.
        mean: Mean rollout duration of one trajectory (time units).
        sigma: Log-space sigma of the log-normal duration.
        drop: Probability that the dynamic-sampling filter drops a finished group (continuous mode).
    """

    name: str
    quota: int
    mean: float
    sigma: float
    drop: float = 0.0


@dataclass(frozen=True)
class Scenario:
    """A simulated workload. Every field is reported with each figure.

    Attributes:
        name: Scenario name.
        sources: The sources.
        num_minibatches: ``M``.
        group_size: ``g``.
        slots: ``C``, concurrent rollout slots.
        train_time: Training time of a mini-batch of average token count.
        num_batches: Train batches to simulate.
        sync: ``"step"`` (weights sync after every optimizer step) or ``"batch"`` (every ``M`` steps).
        partial: In-flight trajectories continue across a weight sync (``False``: they restart).
        continuous: One shared oversampled prompt stream instead of batch-by-batch dispatch.
        bounds: Optional per-mini-batch ``(lo, hi)`` per source.
    """

    name: str
    sources: tuple[SourceParams, ...]
    num_minibatches: int = 16
    group_size: int = 8
    slots: int = 192
    train_time: float = 0.25
    num_batches: int = 6
    sync: str = "step"
    partial: bool = True
    continuous: bool = False
    bounds: Mapping[str, tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        if self.sync not in ("step", "batch"):
            raise ConfigError(f"Scenario.sync must be 'step' or 'batch', got {self.sync!r}")
        if self.slots < 1 or self.num_batches < 1 or self.train_time < 0:
            raise ConfigError("Scenario: slots and num_batches must be >= 1 and train_time >= 0")
        for s in self.sources:
            if s.mean <= 0 or s.sigma < 0 or not 0 <= s.drop < 1:
                raise ConfigError(f"Scenario source {s.name!r}: need mean > 0, sigma >= 0, 0 <= drop < 1")
        self.spec()  # validates quotas / M / g / bounds

    def spec(self) -> BatchSpec:
        """The batch spec of this scenario."""
        return BatchSpec({s.name: s.quota for s in self.sources}, self.num_minibatches, self.group_size, self.bounds)

    @property
    def batch_size(self) -> int:
        """``B``."""
        return sum(s.quota for s in self.sources)

    def with_(self, **kw: Any) -> Scenario:
        """A copy with some fields replaced."""
        return replace(self, **kw)

    def params(self) -> dict[str, Any]:
        """Every parameter, JSON-serializable."""
        d = asdict(self)
        d["sources"] = [asdict(s) for s in self.sources]
        d["bounds"] = None if self.bounds is None else {k: list(v) for k, v in self.bounds.items()}
        d["B"] = self.batch_size
        d["m"] = self.batch_size // self.num_minibatches
        d["S"] = len(self.sources)
        d["tokens_per_time_unit"] = _TOKENS_PER_TIME
        return d


def _three(means: Sequence[float], sigmas: Sequence[float], drops: Sequence[float] = (0, 0, 0)) -> tuple:
    return tuple(
        SourceParams(n, 128, float(mu), float(sg), float(dp))
        for n, mu, sg, dp in zip(("math", "code", "agent"), means, sigmas, drops, strict=True)
    )


#: Named scenarios.
SCENARIOS: dict[str, Scenario] = {
    # equal, moderately spread durations
    "balanced": Scenario("balanced", _three((2.0, 2.0, 2.0), (0.5, 0.5, 0.5))),
    # the fixed scenario: 3 sources, equal quotas, B=384, g=8, M=16, C=192
    "skewed": Scenario("skewed", _three((1.0, 2.0, 4.0), (0.3, 0.6, 1.0))),
    # a code-agent source with a very long tail next to a fast math source
    "codeagent": Scenario(
        "codeagent",
        (SourceParams("math", 256, 1.0, 0.5), SourceParams("codeagent", 128, 3.0, 1.5)),
    ),
    # continuous oversampled stream with a dynamic-sampling filter and a per-mini-batch band
    "oversampled": Scenario(
        "oversampled",
        _three((1.0, 2.0, 4.0), (0.3, 0.6, 1.0), (0.2, 0.3, 0.4)),
        continuous=True,
        bounds={"math": (0, 16), "code": (0, 16), "agent": (0, 16)},
    ),
}


def get_scenario(name: str) -> Scenario:
    """Look up a named scenario.

    Raises:
        ConfigError: Unknown name.
    """
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ConfigError(f"unknown scenario {name!r}; choose one of {sorted(SCENARIOS)}") from None


# ----------------------------------------------------------------------------------------------------------
# Seeded workload
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _Traj:
    idx: int
    tid: str
    source: int
    group: str
    batch: int
    duration: float
    tokens: int
    start: float = math.nan
    finish: float = math.nan
    gen_version: int = 0
    version_mean: float = 0.0
    epoch: int = 0
    admit: float = math.nan
    step: int = -1
    index: int = -1
    train_version: int = -1


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    return rng.lognormal(math.log(mean) - sigma * sigma / 2.0, sigma, n)


class _Workload:
    """Durations keyed by (batch, group) or stream position, so every policy sees the same ones."""

    def __init__(self, sc: Scenario, seed: int) -> None:
        self.sc = sc
        self.seed = seed
        self.g = sc.group_size
        self._blocks: dict[int, list[tuple[int, np.ndarray, bool]]] = {}
        w = np.array([s.quota / (1.0 - s.drop) for s in sc.sources])
        self._weights = w / w.sum()

    def batch_groups(self, b: int) -> list[tuple[int, np.ndarray]]:
        """Groups of train batch ``b`` in dispatch order: (source index, member durations)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1, b]))
        groups = []
        for i, s in enumerate(self.sc.sources):
            for _ in range(s.quota // self.g):
                groups.append((i, _lognormal(rng, s.mean, s.sigma, self.g)))
        order = rng.permutation(len(groups))
        return [groups[j] for j in order]

    def stream_group(self, pos: int) -> tuple[int, np.ndarray, bool]:
        """Group ``pos`` of the continuous stream: (source index, durations, dropped)."""
        blk, off = divmod(pos, _BLOCK)
        if blk not in self._blocks:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, 2, blk]))
            srcs = rng.choice(len(self.sc.sources), size=_BLOCK, p=self._weights)
            u = rng.random(_BLOCK)
            items = []
            for j in range(_BLOCK):
                s = self.sc.sources[int(srcs[j])]
                items.append((int(srcs[j]), _lognormal(rng, s.mean, s.sigma, self.g), bool(u[j] < s.drop)))
            self._blocks = {blk: items}  # keep one block: bounded memory
        return self._blocks[blk][off]


def expected_minibatch_tokens(sc: Scenario) -> float:
    """Expected tokens of a mini-batch under the scenario's quotas."""
    B = sc.batch_size
    mean_dur = sum(s.quota / B * s.mean for s in sc.sources)
    return B / sc.num_minibatches * mean_dur * _TOKENS_PER_TIME


def _tokens(duration: float) -> int:
    return max(1, int(round(duration * _TOKENS_PER_TIME)))


def colocated_makespan(sc: Scenario, seed: int) -> float | None:
    """Makespan of the colocated schedule on the same durations (batch mode only; ``None`` if continuous).

    Batch ``b``: its trajectories run on ``C`` slots in the same order (list scheduling), then ``M``
    optimizer steps whose times follow the same token-proportional rule.
    """
    if sc.continuous:
        return None
    wl = _Workload(sc, seed)
    unit = sc.train_time / expected_minibatch_tokens(sc)
    t = 0.0
    for b in range(sc.num_batches):
        slots = [t] * min(sc.slots, sc.batch_size)
        heapq.heapify(slots)
        end = t
        tokens = 0
        for _, durs in wl.batch_groups(b):
            for d in durs:
                s0 = heapq.heappop(slots)
                heapq.heappush(slots, s0 + float(d))
                end = max(end, s0 + float(d))
                tokens += _tokens(float(d))
        t = end + unit * tokens
    return t


# ----------------------------------------------------------------------------------------------------------
# The event-driven simulation
# ----------------------------------------------------------------------------------------------------------


@dataclass
class SimResult:
    """What one simulation produced.

    Attributes:
        scenario: Scenario name.
        policy: Policy name.
        seed: Seed.
        trajectories: Per admitted trajectory (first ``num_batches`` train batches): dicts with source,
            group, finish, admit, step, index, gen_version, version_mean, train_version.
        minibatches: Per mini-batch: step, train_batch, index, admitted_at, train_start, train_version,
            counts per source.
        metrics: Summary figures (see :func:`simulate`).
    """

    scenario: str
    policy: str
    seed: int
    trajectories: list[dict[str, Any]] = field(default_factory=list)
    minibatches: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


class _VersionHistory:
    """Rollout version as a step function of time, with a prefix integral for token-weighted means."""

    def __init__(self) -> None:
        self.times = [0.0]
        self.versions = [0]
        self.integral = [0.0]  # integral of version from 0 to times[i]

    def sync(self, t: float, v: int) -> None:
        self.integral.append(self.integral[-1] + self.versions[-1] * (t - self.times[-1]))
        self.times.append(t)
        self.versions.append(v)

    def _int(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t) - 1
        return self.integral[i] + self.versions[i] * (t - self.times[i])

    def mean(self, t0: float, t1: float) -> float:
        if t1 <= t0:
            i = bisect.bisect_right(self.times, t0) - 1
            return float(self.versions[i])
        return (self._int(t1) - self._int(t0)) / (t1 - t0)


def simulate(sc: Scenario, policy: str, seed: int = 0, max_staleness: int | None = None,
             on_stale: str = "drop") -> SimResult:
    """Run one seeded simulation of ``sc`` with the named admission policy.

    Args:
        sc: The scenario.
        policy: An admission policy name (:data:`POLICY_NAMES`).
        seed: Seed of the workload (durations, order, drops); identical across policies.
        max_staleness: A staleness bound ``eta`` for admission (``None``: none). The policy then runs in
            continuous mode (surplus carries over, no in-flight counts); rollout regenerates each dropped group
            (same source, a fresh seeded duration draw) at the front of its queue, and with ``on_stale="wait"`` a
            group starts only when :meth:`~knitdata.admission.AdmissionPolicy.reserve` gives it room (other queued
            groups may start before it).
        on_stale: ``"drop"`` or ``"wait"``.

    Returns:
        A :class:`SimResult` whose ``metrics`` hold ``arch_staleness_{mean,p50,p95}``,
        ``raw_staleness_mean``, ``version_mean_staleness_mean``, ``quota_violations``,
        ``bound_violations``, ``mean_admit_delay``, ``makespan``, ``colocated_makespan``,
        ``minibatch_admit_times``, and with a bound ``worst_staleness``, ``dropped_groups``,
        ``wasted_token_share`` (tokens dropped / tokens generated) and ``throughput`` (trained trajectories per
        time unit).
    """
    spec = sc.spec()
    bound = max_staleness is not None
    pol = make_policy(policy, spec, continuous=sc.continuous or bound, max_staleness=max_staleness,
                      on_stale=on_stale)
    regen_rng = np.random.default_rng(np.random.SeedSequence([seed, 0x2E6E]))
    reserved_groups: set[str] = set()
    M, g, C = sc.num_minibatches, sc.group_size, sc.slots
    names = [s.name for s in sc.sources]
    wl = _Workload(sc, seed)
    unit = sc.train_time / expected_minibatch_tokens(sc)
    clock = VersionClock(0, 1 if sc.sync == "step" else M)
    hist = _VersionHistory()
    tracker = StalenessTracker()

    trajs: list[_Traj] = []
    by_id: dict[str, _Traj] = {}
    queue: deque[_Traj] = deque()
    running: dict[int, _Traj] = {}
    events: list[tuple[float, int, int, int, int]] = []  # (time, order, kind, idx, epoch)
    order = 0
    FINISH, TRAIN = 0, 1
    group_left: dict[str, int] = {}
    group_drop: dict[str, bool] = {}
    inflight = [0] * len(names)  # queued or running trajectories per source
    partial = [0] * len(names)  # finished members of incomplete groups per source
    unfinished = [dict.fromkeys(names, 0) for _ in range(sc.num_batches)] if not sc.continuous else []
    dispatched_batches = 0
    stream_pos = 0
    total_steps = sc.num_batches * M
    trainer_q: deque[AdmittedMiniBatch] = deque()
    trainer_busy = False
    trained = 0
    mb_records: list[dict[str, Any]] = []
    now = 0.0

    def add_group(src: int, durs: np.ndarray, batch: int, gid: str, drop: bool = False) -> None:
        group_left[gid] = g
        group_drop[gid] = drop
        inflight[src] += len(durs)
        for j, d in enumerate(durs):
            t = _Traj(len(trajs), f"{gid}/{j}", src, gid, batch, float(d), _tokens(float(d)))
            trajs.append(t)
            by_id[t.tid] = t
            queue.append(t)
            if not sc.continuous:
                unfinished[batch][names[src]] += 1

    def start(t: _Traj) -> None:
        nonlocal order
        t.start = now
        t.gen_version = clock.rollout_version
        running[t.idx] = t
        heapq.heappush(events, (now + t.duration, order, FINISH, t.idx, t.epoch))
        order += 1

    def dispatch() -> None:
        nonlocal dispatched_batches, stream_pos
        if sc.continuous:
            ready = pol.ready_counts()
            adm = pol.admitted_counts()
            have = {i: ready[n] + partial[i] + inflight[i] * (1.0 - sc.sources[i].drop) for i, n in enumerate(names)}
            need = {i: 2 * s.quota - adm[s.name] for i, s in enumerate(sc.sources)}
            while len(running) + len(queue) < C and pol.train_batch < sc.num_batches:
                if all(have[i] >= need[i] for i in have):
                    break  # every source covers this batch and the next: wait (bounded surplus)
                src, durs, drop = wl.stream_group(stream_pos)
                stream_pos += 1
                if have[src] >= need[src]:
                    continue  # this source is saturated: skip the prompt
                add_group(src, durs, -1, f"s{stream_pos - 1}", drop)
                have[src] += g * (1.0 - sc.sources[src].drop)
        else:
            while dispatched_batches <= pol.train_batch and dispatched_batches < sc.num_batches:
                for j, (src, durs) in enumerate(wl.batch_groups(dispatched_batches)):
                    add_group(src, durs, dispatched_batches, f"b{dispatched_batches}g{j}")
                dispatched_batches += 1
        if bound and on_stale == "wait":
            skipped: list[_Traj] = []
            while queue and len(running) < C:
                t = queue.popleft()
                if t.group not in reserved_groups:
                    if not pol.reserve({names[t.source]: 1}, clock.rollout_version):
                        skipped.append(t)
                        continue
                    reserved_groups.add(t.group)
                start(t)
            queue.extendleft(reversed(skipped))
            return
        while queue and len(running) < C:
            start(queue.popleft())

    def regenerate() -> None:
        for d in pol.take_dropped():
            src = names.index(d["source"])
            sp = sc.sources[src]
            durs = _lognormal(regen_rng, sp.mean, sp.sigma, g)
            batch = min(pol.train_batch, sc.num_batches - 1) if not sc.continuous else -1
            gid = f"{d['group']}r"
            add_group(src, durs, batch, gid)
            for _ in range(g):  # to the front: regenerated work first
                queue.appendleft(queue.pop())
        pol.pop_released()

    def train_next() -> None:
        nonlocal trainer_busy, order
        if trainer_busy or not trainer_q:
            return
        mb = trainer_q.popleft()
        v = clock.version
        tracker.record_minibatch(mb, v)
        tokens = 0
        for m in mb.trajectories:
            t = by_id[m.id]
            t.train_version = v
            tokens += t.tokens
        mb_records[mb.step]["train_start"] = now
        mb_records[mb.step]["train_version"] = v
        trainer_busy = True
        heapq.heappush(events, (now + unit * tokens, order, TRAIN, mb.step, 0))
        order += 1

    dispatch()
    while trained < total_steps:
        if not events:
            raise RuntimeError(
                f"simulation of {sc.name!r} with policy {policy!r} stalled at t={now:.3f} after {trained} "
                f"steps: admission holds {pol.ready_counts()} ready, train batch {pol.train_batch} "
                f"index {pol.minibatch_index}, admitted {pol.admitted_counts()}"
            )
        now, _, kind, idx, epoch = heapq.heappop(events)
        if kind == FINISH:
            t = trajs[idx]
            if epoch != t.epoch:
                continue  # restarted
            del running[idx]
            t.finish = now
            t.version_mean = max(float(t.gen_version), hist.mean(t.start, now)) if sc.partial else float(t.gen_version)
            if not sc.continuous:
                unfinished[t.batch][names[t.source]] -= 1
            pol.offer(
                [
                    TrajectoryMeta(
                        id=t.tid,
                        source=names[t.source],
                        group=t.group,
                        gen_version=t.gen_version,
                        version_mean=t.version_mean,
                        num_tokens=t.tokens,
                        seq=t.idx,
                    )
                ]
            )
            inflight[t.source] -= 1
            partial[t.source] += 1
            group_left[t.group] -= 1
            if group_left[t.group] == 0:
                del group_left[t.group]
                partial[t.source] -= g
                if group_drop.pop(t.group):
                    pol.withdraw(t.group)
        else:
            trainer_busy = False
            trained += 1
            if clock.step():
                hist.sync(now, clock.rollout_version)
                if not sc.partial:
                    for r in list(running.values()):
                        r.epoch += 1
                        start(r)
        if not sc.continuous and not bound and pol.train_batch < sc.num_batches:
            pol.set_in_flight(unfinished[pol.train_batch])
        for mb in pol.poll(now):
            if mb.train_batch < sc.num_batches:
                for m in mb.trajectories:
                    t = by_id[m.id]
                    t.admit, t.step, t.index = now, mb.step, mb.index
                mb_records.append(
                    {
                        "step": mb.step,
                        "train_batch": mb.train_batch,
                        "index": mb.index,
                        "admitted_at": now,
                        "counts": mb.counts(),
                    }
                )
                trainer_q.append(mb)
        if bound:
            regenerate()
        dispatch()
        train_next()

    admitted = [t for t in trajs if t.step >= 0]
    out = SimResult(sc.name, policy, seed)
    out.trajectories = [
        {
            "source": names[t.source],
            "group": t.group,
            "finish": t.finish,
            "admit": t.admit,
            "step": t.step,
            "index": t.index,
            "gen_version": t.gen_version,
            "version_mean": t.version_mean,
            "train_version": t.train_version,
        }
        for t in admitted
    ]
    out.minibatches = mb_records
    # violations
    quota_v = 0
    per_batch: list[dict[str, int]] = [dict.fromkeys(names, 0) for _ in range(sc.num_batches)]
    for rec in mb_records:
        for s, n in rec["counts"].items():
            per_batch[rec["train_batch"]][s] += n
    for pb in per_batch:
        quota_v += sum(1 for s in sc.sources if pb[s.name] != s.quota)
    bound_v = 0
    for rec in mb_records:
        for s in names:
            lo, hi = (0, spec.minibatch_size) if spec.bounds is None or s not in spec.bounds else spec.bounds[s]
            if not lo <= rec["counts"].get(s, 0) <= hi:
                bound_v += 1
    summ = tracker.summary()
    out.metrics = {
        "arch_staleness_mean": summ["arch"]["mean"],
        "arch_staleness_positive_mean": summ["arch"]["positive_mean"],
        "share_negative": summ["arch"]["share_negative"],
        "arch_staleness_p50": summ["arch"]["p50"],
        "arch_staleness_p95": summ["arch"]["p95"],
        "raw_staleness_mean": summ["raw"]["mean"],
        "version_mean_staleness_mean": summ["version_mean"]["mean"],
        "quota_violations": quota_v,
        "bound_violations": bound_v,
        "mean_admit_delay": float(np.mean([t.admit - t.finish for t in admitted])),
        "makespan": now,
        "colocated_makespan": colocated_makespan(sc, seed),
        "minibatch_admit_times": [r["admitted_at"] for r in mb_records],
        "trajectories_generated": len(trajs),
    }
    if bound:
        bs = pol.bound_stats()
        assert bs is not None  # the policy was built with the bound
        raw = [t.train_version - t.gen_version for t in admitted if t.train_version >= 0]
        out.metrics.update({
            "max_staleness": max_staleness, "on_stale": on_stale,
            "worst_staleness": max(raw) if raw else None,
            "dropped_groups": int(sum(bs["dropped_groups"].values())),
            "wasted_token_share": sum(bs["dropped_tokens"].values()) / max(1, sum(t.tokens for t in trajs)),
            "throughput": total_steps * spec.minibatch_size / now if now > 0 else None,
        })
    return out


def compare(results: Mapping[str, SimResult]) -> dict[str, float | None]:
    """Reduction of mean architectural staleness against ``train_batch`` for each policy of one run."""
    base = results["train_batch"].metrics["arch_staleness_mean"]
    return {p: staleness_reduction(r.metrics["arch_staleness_mean"], base) for p, r in results.items()}
