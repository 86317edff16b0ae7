"""An independent randomized model of the staleness bound (issue 45), written from scratch: it shares no code with
:mod:`knitdata.admission.bound`. A trainer trains admitted mini-batches one per version; producers start groups at
versions up to ``lag`` behind the trainer (in wait mode only what ``reserve`` grants), deliver them in one of three
orders, and regenerate what the bound drops. The model computes every trained trajectory's staleness itself
(trainer version at its step minus its ``gen_version``) and reports bound violations, quota and per-mini-batch bound
violations, drops in wait mode and deadlocks (no progress although fresh producers at the trainer's version tried)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from knitdata.admission import BatchSpec, make_policy
from knitdata.errors import ConfigError
from knitdata.record import TrajectoryMeta

POLICY_NAMES = ("train_batch", "fifo", "linear_target", "constraint_preserving")
ORDERS = ("global", "per_source", "shuffled")


@dataclass
class Case:
    """One randomized case."""

    spec: BatchSpec
    policy: str
    mode: str
    order: str
    eta: Any  # int or {source: int}
    offset: int
    lag: int
    seed: int


@dataclass
class Outcome:
    """What the model saw."""

    steps: int = 0
    violations: list[str] = field(default_factory=list)  # admitted staler than the bound
    quota_errors: list[str] = field(default_factory=list)
    drops: int = 0
    deadlock: str | None = None


def draw_case(rng: random.Random, policy: str | None = None, mode: str | None = None, order: str | None = None,
              bounds: bool | None = None) -> Case:
    """A random valid case (policy, mode, order and whether per-mini-batch bounds are used may be fixed)."""
    while True:
        S, M, g = rng.randint(1, 3), rng.randint(1, 4), rng.choice([1, 1, 2])
        q = [rng.randint(0, 4) for _ in range(S)]
        if sum(q) == 0:
            q[0] = 1
        while sum(q) % M:
            q[rng.randrange(S)] += 1
        quotas = {f"s{i}": n * g for i, n in enumerate(q)}
        mm = sum(q) // M
        spec_bounds = None
        if bounds if bounds is not None else rng.random() < 0.5:
            spec_bounds = {}
            for s, n in quotas.items():
                per = n // g / M
                lo = rng.randint(0, int(per)) * g
                hi = min(mm, -(-n // g // M) + rng.randint(0, 1)) * g
                spec_bounds[s] = (lo, max(lo, hi))
        try:
            spec = BatchSpec(quotas, num_minibatches=M, group_size=g, bounds=spec_bounds)
        except ConfigError:
            continue
        name = policy or rng.choice(POLICY_NAMES)
        e = rng.randint(0, 3)
        eta: Any = e if rng.random() < 0.6 else {s: rng.randint(0, 3) for s in quotas}
        if name == "train_batch":  # it needs eta >= M - 1
            eta = max(e, M - 1) if isinstance(eta, int) else {s: max(v, M - 1) for s, v in eta.items()}
        least = eta if isinstance(eta, int) else min(eta.values())
        return Case(spec, name, mode or rng.choice(["drop", "wait"]), order or rng.choice(ORDERS), eta,
                    rng.randint(0, 5), rng.randint(0, least), rng.randrange(1 << 30))


def run_case(c: Case, batches: int = 3, rounds: int = 60) -> Outcome:
    """Run one case: ``rounds`` random rounds, then well-behaved producers until ``batches`` train batches."""
    rng = random.Random(c.seed)
    spec, g, M = c.spec, c.spec.group_size, c.spec.num_minibatches
    Q = {s: q // g for s, q in spec.quotas.items()}
    etas = c.eta if isinstance(c.eta, dict) else dict.fromkeys(Q, c.eta)
    quota_policy = c.policy != "fifo"
    p = make_policy(c.policy, spec, max_staleness=c.eta, on_stale=c.mode, version_offset=c.offset, continuous=True)
    out = Outcome()
    flying: list[list[Any]] = []  # [source, version, members left, start index]
    started = [0]
    admitted: list[Any] = []
    trained = [0]  # steps the trainer finished; its version is offset + trained
    per_batch: dict[int, dict[str, int]] = {}
    target = batches * M

    def version() -> int:
        return c.offset + trained[0]

    def start(s: str, v: int) -> bool:
        if c.mode == "wait" and not p.reserve({s: 1}, v):
            return False
        i = started[0]
        started[0] += 1
        flying.append([s, v, [TrajectoryMeta(id=f"{s}-{i}-{k}", source=s, group=f"{s}-{i}", num_tokens=1,
                                             gen_version=v) for k in range(g)], i])
        return True

    def pick(order: str) -> int:
        if order == "global":
            return min(range(len(flying)), key=lambda j: flying[j][3])
        if order == "per_source":
            s = rng.choice(sorted({f[0] for f in flying}))
            return min((j for j in range(len(flying)) if flying[j][0] == s), key=lambda j: flying[j][3])
        return rng.randrange(len(flying))

    def collect() -> None:
        for mb in p.poll():
            admitted.append(mb)
            row = per_batch.setdefault(mb.train_batch, dict.fromkeys(Q, 0))
            got: dict[str, int] = {}
            for t in mb.trajectories:
                got[t.source] = got.get(t.source, 0) + 1
                stale = c.offset + mb.step - t.gen_version  # the trainer's version at this step, independently
                if stale > etas[t.source]:
                    out.violations.append(f"{t.id} {stale} stale at step {mb.step} > {etas[t.source]}")
            if len(mb.trajectories) != spec.minibatch_size:
                out.quota_errors.append(f"step {mb.step} has {len(mb.trajectories)} trajectories")
            for s, n in got.items():
                row[s] += n
                if quota_policy and spec.bounds and s in spec.bounds:
                    lo, hi = spec.group_bounds(s)
                    if not lo * g <= n <= hi * g:
                        out.quota_errors.append(f"step {mb.step}: {n} of {s} outside its bounds")
            if quota_policy and mb.index == M - 1 and row != dict(spec.quotas):
                out.quota_errors.append(f"train batch {mb.train_batch} holds {row}, quotas {dict(spec.quotas)}")
        for d in p.take_dropped():
            out.drops += 1
            regen.append(d["source"])
        p.pop_released()

    regen: list[str] = []

    def deliver(j: int, whole: bool) -> None:
        f = flying[j]
        k = len(f[2]) if whole else rng.randint(1, len(f[2]))
        p.offer(f[2][:k])
        f[2] = f[2][k:]
        if not f[2]:
            flying.pop(j)
        collect()

    def train(upto: int) -> None:
        while trained[0] < min(upto, len(admitted)):
            trained[0] += 1

    for _ in range(rounds):  # random producers, lagging by up to `lag`, delivering in `order`
        r = rng.random()
        if r < 0.45:
            s = rng.choice([s for s in Q if Q[s]] or list(Q))
            if c.mode == "wait" and not Q[s]:
                continue
            start(s, max(0, version() - rng.randint(0, c.lag)))
        elif r < 0.8 and flying:
            deliver(pick(c.order), rng.random() < 0.7)
        else:
            train(trained[0] + rng.randint(0, 2))
        while regen and start(regen[0], version()):
            regen.pop(0)
    # then producers that keep lagging by `lag` (train_batch: only if its window still spans a train batch), deliver
    # everything, and the trainer trains what is admitted: a bound-respecting continuation always exists, so
    # admission must progress
    least = min(etas.values())
    lag = c.lag if c.policy != "train_batch" or least - c.lag >= M - 1 else 0
    idle = 0
    while len(admitted) < target:
        before = (len(admitted), started[0])
        while flying:
            deliver(pick(c.order), True)
        train(len(admitted))
        while regen and start(regen[0], version()):
            regen.pop(0)
        for s in Q:
            if Q[s]:
                for _ in range(Q[s] + 2):
                    if not start(s, max(0, version() - lag)):
                        break
        while flying:
            deliver(pick(c.order), True)
        train(len(admitted))
        if (len(admitted), started[0]) == before:
            idle += 1
            if idle >= 3:
                cap = p.rollout_capacity(max(0, version() - lag)) if c.mode == "wait" else None
                out.deadlock = (f"stuck at step {len(admitted)} (trainer version {version()}, producers {lag} "
                                f"behind): ready {p.ready_counts()}, admitted {p.admitted_counts()}, capacity {cap}")
                break
        else:
            idle = 0
        if started[0] > 200 * target + 500:
            out.deadlock = f"no progress after {started[0]} groups"
            break
    out.steps = len(admitted)
    return out
