"""Planner: locality first, token balance, whole groups, token budget, equal micro-batch counts."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.errors import ConfigError, ValidationError
from knitdata.placement import ConsumerLayout
from knitdata.planner import Planner
from knitdata.record import TrajectoryMeta


@dataclass(frozen=True)
class _Admitted:
    train_batch: int
    index: int
    step: int
    trajectories: tuple


def _metas(rng: random.Random, n: int, group_size: int, nodes: list[str], max_tokens: int = 30):
    out = []
    for i in range(n):
        g = i // group_size
        out.append(TrajectoryMeta(id=f"t{i}", source="s", group=f"g{g}", gen_version=i % 3,
                                  num_tokens=rng.randint(1, max_tokens), nbytes=rng.randint(10, 100),
                                  location=nodes[g % len(nodes)], seq=i))
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n_groups=st.integers(1, 12), group_size=st.integers(1, 4),
       consumers=st.integers(1, 8), nodes=st.integers(1, 3), budget=st.integers(5, 80), split=st.booleans())
def test_plan_invariants(seed, n_groups, group_size, consumers, nodes, budget, split):
    rng = random.Random(seed)
    layout = ConsumerLayout([f"n{r * min(nodes, consumers) // consumers}" for r in range(consumers)])
    metas = _metas(rng, n_groups * group_size, group_size, list(layout.nodes))
    planner = Planner(layout, budget, allow_split_groups=split)
    plan = planner.plan(_Admitted(0, 1, 5, tuple(metas)), {m.id: 2 for m in metas})
    assert plan.minibatch == 5 and plan.num_consumers == consumers
    k = plan.num_microbatches
    ids = []
    for r, row in enumerate(plan.microbatches):
        assert len(row) == k  # every consumer: the same number of micro-batches
        for i, mb in enumerate(row):
            assert (mb.consumer, mb.microbatch, mb.is_last) == (r, i, i == k - 1)
            assert mb.global_trajectories == len(metas) and mb.global_loss_tokens == 2 * len(metas)
            assert mb.global_tokens == sum(m.num_tokens for m in metas)
            assert mb.num_tokens <= budget or len(mb.trajectories) == 1  # budget (one oversized alone)
            ids.extend(mb.trajectory_ids)
        if not split:  # groups whole
            groups = {m.group for m in plan.share(r)}
            assert all(sum(1 for m in metas if m.group == g) == sum(1 for m in plan.share(r) if m.group == g)
                       for g in groups)
    assert Counter(ids) == Counter(m.id for m in metas)
    assert plan.local_bytes + plan.remote_bytes == sum(m.nbytes for m in metas)
    # deterministic: a pure function of its inputs
    assert planner.plan(_Admitted(0, 1, 5, tuple(metas))).to_dict()["ids"] == plan.to_dict()["ids"]


def test_locality_first_then_balance():
    layout = ConsumerLayout.uniform(2, 2)
    metas = [TrajectoryMeta(id=f"t{i}", source="s", group=f"g{i}", num_tokens=10, nbytes=10,
                            location="node0" if i < 4 else "node1", seq=i) for i in range(8)]
    plan = Planner(layout, 100).plan(_Admitted(0, 0, 0, tuple(metas)))
    assert plan.remote_bytes == 0 and plan.share_tokens() == [20, 20, 20, 20]
    # all data on node0: locality would overload ranks 0-1, so balance moves work to node1
    skew = [TrajectoryMeta(id=f"t{i}", source="s", group=f"g{i}", num_tokens=10, nbytes=10, location="node0", seq=i)
            for i in range(8)]
    plan = Planner(layout, 100, balance_tolerance=0.0).plan(_Admitted(0, 0, 0, tuple(skew)))
    assert plan.share_tokens() == [20, 20, 20, 20] and plan.remote_bytes == 40
    plan = Planner(layout, 100, balance_tolerance=1.0).plan(_Admitted(0, 0, 0, tuple(skew)))
    assert plan.remote_bytes == 0 and plan.share_tokens() == [40, 40, 0, 0]


def test_empty_microbatches_pad_short_shares():
    layout = ConsumerLayout.single_node(3)
    metas = [TrajectoryMeta(id=f"t{i}", source="s", group="g0", num_tokens=10, location="node0", seq=i)
             for i in range(4)]
    plan = Planner(layout, 10).plan(_Admitted(0, 0, 0, tuple(metas)))  # one group of 4: one consumer
    assert plan.num_microbatches == 4
    empties = [mb for row in plan.microbatches for mb in row if not mb.trajectories]
    assert len(empties) == 8
    info = plan.microbatches[1][3].to_info()
    assert info.is_last and info.trajectory_ids == () and info.global_trajectories == 4


def test_rebalances_into_k_bins_when_budget_allows():
    layout = ConsumerLayout(["node0", "node1"])
    metas = [TrajectoryMeta(id=f"t{i}", source="s", group=f"g{i}", num_tokens=t, location=loc, seq=i)
             for i, (t, loc) in enumerate([(50, "node0"), (50, "node0"), (50, "node0"), (10, "node1"), (10, "node1")])]
    plan = Planner(layout, 60, balance_tolerance=5.0).plan(_Admitted(0, 0, 0, tuple(metas)))
    assert plan.num_microbatches == 3 and plan.remote_bytes == 0
    # rank 1 fits in one micro-batch by budget, but spreads over the K steps instead of idling
    assert [len(mb.trajectories) for mb in plan.microbatches[1]] == [1, 1, 0]


def test_errors():
    layout = ConsumerLayout.single_node(1)
    with pytest.raises(ConfigError):
        Planner(layout, 0)
    m = TrajectoryMeta(id="t0", source="s", group="g")
    with pytest.raises(ValidationError):
        Planner(layout, 10).plan(_Admitted(0, 0, 0, (m, m)))
