"""Planner conformance: the plans of a fixed set of seeded layouts are pinned, record for record.

``tests/data/planner_plans.json`` holds, for each case, every micro-batch's :class:`MicroBatchInfo` (the values
of its ``to_dict()``, whose keys are checked to be :data:`INFO_KEYS` in that order) and the ids of the trajectories of its plan row, with ``K`` and the local and
remote bytes, as planned by the code it was written with (see ``"written_by"`` in the file). Small cases are
stored whole; cases of thousands of trajectories (the numpy passes, cluster scale) are stored as the SHA-256 of
the same canonical JSON, with the row count and ``K`` beside it. Every case is planned both with numpy passes
and with Python lists (``vectorize_from``), and the records are checked to be the types the plane and the
datasets read (``PlannedMicroBatch`` rows of a ``MicroBatchInfo`` and a tuple of metas).

Rewrite the fixture (only for a deliberate change of the plans): ``python tests/test_planner_conformance.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from knitdata.placement import ConsumerLayout
from knitdata.planner import MicroBatchInfo, PlannedMicroBatch, Planner
from knitdata.record import TrajectoryMeta
from tests._planner_helpers import Admitted as _Admitted

FIXTURE = Path(__file__).resolve().parent / "data" / "planner_plans.json"
#: Cases with at least this many trajectories are pinned by digest (the fixture stays small).
WHOLE_BELOW = 400


def _case(seed: int) -> tuple[str, Planner, _Admitted, dict[str, int] | None]:
    """A seeded layout, planner options and admitted mini-batch (deterministic across runs and platforms)."""
    rng = random.Random(seed)
    big = seed >= 20  # thousands of trajectories: the numpy passes
    if big:  # (nodes, ranks per node, group size, trajectories, budget)
        n_nodes, per, group_size, n_traj, budget = BIG[seed - 20]
        layout = ConsumerLayout.uniform(n_nodes, per)
        n_groups = n_traj // group_size
    else:
        names = [rng.choice("abcde") for _ in range(rng.randint(1, 12))]
        layout = ConsumerLayout(names)  # uneven nodes, ranks in any node order
        group_size = rng.randint(1, 5)
        n_groups = rng.randint(0, 40)
        budget = rng.choice([1, 30, 120, 400, 10_000])
    nodes = list(layout.nodes)
    units = {f"u{i}": rng.choice([*nodes, "z"]) for i in range(4)} if rng.random() < 0.2 else None
    locations: list[str | None] = [*(units or nodes), "z", None] if not big else [*nodes, "z"]
    interleave = rng.random() < 0.7
    arrivals = []
    for g in range(n_groups):
        start = rng.uniform(0.0, n_groups / 50.0) if interleave else float(g)
        arrivals.extend((start + rng.expovariate(1.0), g, k) for k in range(group_size))
    arrivals.sort()
    seq_of = {(g, k): s for s, (_t, g, k) in enumerate(arrivals)}
    if rng.random() < 0.15:  # equal seqs (ties broken by id)
        seq_of = {key: s // 3 for key, s in seq_of.items()}
    done = {g: t for t, g, _k in arrivals}
    metas = []
    scattered = rng.random() < 0.2  # members of a group not in one run (the planner regroups them)
    for g in sorted(range(n_groups), key=done.__getitem__):
        home = rng.choice(locations)
        prompt = rng.randint(0, 2048 if big else 40)
        for k in sorted(range(group_size), key=lambda k: seq_of[(g, k)]):
            tokens = prompt + (int(rng.lognormvariate(7.0, 0.8)) if big else rng.randint(0, 80))
            loc = rng.choice(locations) if rng.random() < 0.15 else home
            metas.append(TrajectoryMeta(
                id=f"t{g}.{k}" if rng.random() < 0.9 else f"x{g:04d}{k}", source=("math", "code")[g % 2],
                group=f"g{g}", gen_version=rng.randint(0, 5), num_tokens=min(tokens, 16_384),
                nbytes=rng.choice([0, 1, 12 * tokens, rng.randint(0, 500)]), location=loc, seq=seq_of[(g, k)],
            ))
    if scattered and not big:
        rng.shuffle(metas)
    hint = (group_size,) * n_groups if (not scattered or big) and rng.random() < 0.5 else ()
    kwargs: dict[str, Any] = {
        "allow_split_groups": rng.random() < 0.2,
        "locality": rng.random() < 0.85,
        "balance_tolerance": rng.choice([0.0, 0.1, 0.5, 2.0]),
        "unit_nodes": units,
    }
    planner = Planner(layout, budget, **kwargs)
    step = rng.randint(0, 3)
    admitted = _Admitted(train_batch=rng.randint(0, 2), index=step, step=10 + step, trajectories=tuple(metas),
                         group_sizes=hint)
    loss = {m.id: m.num_tokens // 2 for m in metas if rng.random() < 0.9} if rng.random() < 0.5 else None
    name = f"seed{seed}:{len(layout.nodes)}nodes/{layout.num_consumers}ranks/{len(metas)}traj/budget{budget}"
    return name, planner, admitted, loss


#: The large cases (seeds 20 on): cluster scale as ``python -m benchmarks control --scale`` plans it, and others.
BIG = [(1000, 8, 8, 8000, 65_536), (10, 8, 8, 8000, 65_536), (1000, 8, 1, 8000, 2_000), (40, 4, 16, 4096, 8_192),
       (3, 5, 4, 2048, 2_000), (10, 8, 8, 4000, 4_096), (2, 3, 1, 3000, 65_536)]
SEEDS = [*range(20), *range(20, 20 + len(BIG))]
#: The keys of a micro-batch's info, in order (the fixture stores the values).
INFO_KEYS = ["consumer", "train_batch", "minibatch", "minibatch_in_batch", "microbatch", "num_microbatches", "is_last",
             "global_tokens", "global_trajectories", "global_loss_tokens", "trajectory_ids", "gen_versions"]


def _records(plan: Any) -> dict[str, Any]:
    """The plan as JSON-able records: every micro-batch's info (key order kept) and its rows' trajectory ids."""
    rows = []
    for row in plan.microbatches:
        out = []
        for mb in row:
            assert type(mb) is PlannedMicroBatch and type(mb.info) is MicroBatchInfo
            assert type(mb.trajectories) is tuple
            info = mb.info
            assert type(info.trajectory_ids) is tuple and type(info.gen_versions) is tuple
            assert info.trajectory_ids == tuple(m.id for m in mb.trajectories)
            assert info.gen_versions == tuple(m.gen_version for m in mb.trajectories)
            assert mb == PlannedMicroBatch(**mb._asdict())
            assert MicroBatchInfo.from_dict(info.to_dict()) == info  # a valid info (the checked constructor)
            d = info.to_dict()
            assert list(d) == INFO_KEYS
            out.append([*d.values(), [m.id for m in mb.trajectories]])
        rows.append(out)
    return {"num_microbatches": plan.num_microbatches, "local_bytes": plan.local_bytes,
            "remote_bytes": plan.remote_bytes, "train_batch": plan.train_batch, "minibatch": plan.minibatch,
            "minibatch_in_batch": plan.minibatch_in_batch, "rows": rows}


def _canonical(records: dict[str, Any]) -> str:
    return json.dumps(records, separators=(",", ":"))


def _pinned(seed: int, vectorize_from: int | None = None) -> tuple[str, dict[str, Any]]:
    name, planner, admitted, loss = _case(seed)
    if vectorize_from is not None:
        planner.vectorize_from = vectorize_from
    records = _records(planner.plan(admitted, loss))
    n = len(admitted.trajectories)
    if n < WHOLE_BELOW:
        return name, {"trajectories": n, "records": json.loads(_canonical(records))}
    return name, {"trajectories": n, "num_microbatches": records["num_microbatches"],
                  "rows": sum(map(len, records["rows"])), "local_bytes": records["local_bytes"],
                  "remote_bytes": records["remote_bytes"],
                  "sha256": hashlib.sha256(_canonical(records).encode()).hexdigest()}


@pytest.fixture(scope="module")
def fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("vectorize_from", [1, 1 << 30])  # numpy passes, Python lists (the default is one of them)
@pytest.mark.parametrize("seed", SEEDS)
def test_plans_are_those_pinned(fixture, seed, vectorize_from) -> None:
    name, got = _pinned(seed, vectorize_from)
    want = fixture["cases"][str(seed)]
    assert want["name"] == name, "the case generator changed: the pinned plans no longer describe these cases"
    assert {k: v for k, v in want.items() if k != "name"} == got


def test_the_fixture_covers_both_paths_and_several_microbatches(fixture) -> None:
    """The pinned cases are not trivial: both planner paths, K > 1, empty shares and mixed nodes all occur."""
    cases = fixture["cases"]
    assert set(cases) == {str(s) for s in SEEDS}
    sizes = [c["trajectories"] for c in cases.values()]
    assert min(sizes) < 50 and max(sizes) >= 8_000 and sum(s >= Planner.vectorize_from for s in sizes) >= 6
    ks = [c.get("num_microbatches") or c["records"]["num_microbatches"] for c in cases.values()]
    assert max(ks) > 3 and ks.count(1) >= 3
    small = [c["records"] for c in cases.values() if "records" in c]
    assert any(not mb[1] for r in small for row in r["rows"] for mb in row)  # padding micro-batches
    assert any(r["remote_bytes"] and r["local_bytes"] for r in small)


def _write() -> None:  # pragma: no cover - run by hand
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=FIXTURE.parent).stdout.strip()
    cases = {}
    for seed in SEEDS:
        name, pinned = _pinned(seed)
        cases[str(seed)] = {"name": name, **pinned}
    lines = [f" {json.dumps(seed)}: {json.dumps(case, separators=(',', ':'))}" for seed, case in cases.items()]
    FIXTURE.write_text(f'{{"written_by": "knitdata planner at {rev}", "cases": {{\n' + ",\n".join(lines) + "\n}}\n")
    print(f"wrote {FIXTURE} ({len(cases)} cases)")


if __name__ == "__main__":  # pragma: no cover
    if "--write" in sys.argv:
        _write()
