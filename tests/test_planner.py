"""Planner: locality first, token balance, whole groups, token budget, equal micro-batch counts."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.errors import ConfigError, ValidationError
from knitdata.placement import ConsumerLayout
from knitdata.planner import PlannedMicroBatch, Planner
from knitdata.record import TrajectoryMeta
from tests._planner_helpers import Admitted as _Admitted


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


# --------------------------------------------------------------------------------- reference planner
# The planner before its scale rewrite (linear least-loaded searches), kept verbatim as the reference the
# heap-based planner must reproduce exactly: same shares, same micro-batches, same bytes.


class _ReferencePlanner:
    def __init__(self, layout, token_budget, *, allow_split_groups=False, locality=True, balance_tolerance=0.1,
                 unit_nodes=None):
        self.layout = layout
        self.token_budget = token_budget
        self.allow_split_groups = allow_split_groups
        self.locality = locality
        self.balance_tolerance = float(balance_tolerance)
        self.unit_nodes = dict(unit_nodes) if unit_nodes is not None else None

    def _node(self, location):
        if location is None:
            return None
        if self.unit_nodes is None:
            return location
        return self.unit_nodes.get(location)

    def assign(self, metas):
        n = self.layout.num_consumers
        if self.allow_split_groups:
            units = [[m] for m in metas]
        else:
            by_group = {}
            for m in metas:
                by_group.setdefault(m.group, []).append(m)
            units = list(by_group.values())
        weights = [max(1, sum(m.num_tokens for m in u)) for u in units]
        total = sum(weights)
        cap = (1.0 + self.balance_tolerance) * total / n
        order = sorted(range(len(units)), key=lambda i: (-weights[i], units[i][0].seq, units[i][0].id))
        loads = [0] * n
        shares = [[] for _ in range(n)]
        all_ranks = range(n)
        for i in order:
            w = weights[i]
            best_all = min(all_ranks, key=lambda r: (loads[r], r))
            choice = best_all
            if self.locality:
                home = self._home(units[i])
                local = self.layout.ranks_on(home) if home is not None else ()
                if local:
                    best_local = min(local, key=lambda r: (loads[r], r))
                    choice = best_local
                    if loads[best_local] + w > cap and loads[best_all] < loads[best_local]:
                        choice = best_all
            loads[choice] += w
            shares[choice].extend(units[i])
        for s in shares:
            s.sort(key=lambda m: (m.seq, m.id))
        return shares

    def _home(self, unit):
        by_node = {}
        for m in unit:
            node = self._node(m.location)
            if node is not None:
                by_node[node] = by_node.get(node, 0) + max(1, m.nbytes)
        if not by_node:
            return None
        return max(by_node, key=lambda k: (by_node[k], -self.layout.nodes.index(k) if k in self.layout.nodes else 0))

    def _ffd(self, share):
        bins, sizes = [], []
        for m in sorted(share, key=lambda m: (-m.num_tokens, m.seq, m.id)):
            for b, s in enumerate(sizes):
                if s + m.num_tokens <= self.token_budget:
                    bins[b].append(m)
                    sizes[b] += m.num_tokens
                    break
            else:
                bins.append([m])
                sizes.append(m.num_tokens)
        return bins

    def _lpt(self, share, k):
        bins = [[] for _ in range(k)]
        sizes = [0] * k
        for m in sorted(share, key=lambda m: (-m.num_tokens, m.seq, m.id)):
            b = min(range(k), key=lambda j: (sizes[j], j))
            bins[b].append(m)
            sizes[b] += m.num_tokens
        return [b for b in bins if b]

    def _cut(self, share, k, ffd):
        bins = ffd
        if len(ffd) < k and len(share) > len(ffd):
            lpt = self._lpt(share, min(k, len(share)))
            biggest = max(m.num_tokens for m in share)
            if max(sum(m.num_tokens for m in b) for b in lpt) <= max(self.token_budget, biggest):
                bins = lpt
        for b in bins:
            b.sort(key=lambda m: (m.seq, m.id))
        bins.sort(key=lambda b: (b[0].seq, b[0].id))
        return bins + [[] for _ in range(k - len(bins))]

    def plan_rows(self, metas):
        """``(ids per micro-batch per rank, K, local bytes, remote bytes)``."""
        shares = self.assign(metas)
        ffds = [self._ffd(s) for s in shares]
        k = max(1, max(len(f) for f in ffds))
        local = remote = 0
        rows = []
        for rank, (share, ffd) in enumerate(zip(shares, ffds)):
            node = self.layout.node_of(rank)
            for m in share:
                if self._node(m.location) == node:
                    local += m.nbytes
                else:
                    remote += m.nbytes
            bins = self._cut(share, k, ffd) if share else [[] for _ in range(k)]
            rows.append([[m.id for m in b] for b in bins])
        return rows, k, local, remote


@st.composite
def _planning_cases(draw):
    node_names = draw(st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), min_size=1, max_size=12))
    layout = ConsumerLayout(node_names)  # ranks in any node order, uneven nodes
    n = draw(st.integers(0, 60))
    n_groups = draw(st.integers(1, 20))
    contiguous = draw(st.booleans())
    extra_nodes = ["z", "a", "b"]  # "z" holds no consumer
    units = {f"u{i}": draw(st.sampled_from(["a", "b", "c", "z"])) for i in range(3)}
    use_units = draw(st.booleans())
    locations = (list(units) + ["u9"] if use_units else list(dict.fromkeys(node_names)) + extra_nodes) + [None]
    seq_mode = draw(st.sampled_from(["increasing", "shuffled", "ties"]))
    seqs = list(range(n))
    if seq_mode == "shuffled":
        seqs = draw(st.permutations(seqs)) if n else seqs
    elif seq_mode == "ties":
        seqs = [draw(st.integers(-1, 3)) for _ in range(n)]
    metas = []
    for i in range(n):
        g = i * n_groups // max(n, 1) if contiguous else draw(st.integers(0, n_groups - 1))
        metas.append(TrajectoryMeta(
            id=draw(st.sampled_from([f"t{i}", f"x{i:03d}", f"{i}"])), source="s", group=f"g{g}",
            num_tokens=draw(st.integers(0, 120) | st.sampled_from([0, 1, 50, 100])),
            nbytes=draw(st.sampled_from([0, 1, 10, 20]) | st.integers(0, 500)),  # equal bytes: home ties
            location=draw(st.sampled_from(locations)), seq=seqs[i],
        ))
    kwargs = {
        "allow_split_groups": draw(st.booleans()),
        "locality": draw(st.booleans()),
        "balance_tolerance": draw(st.sampled_from([0.0, 0.1, 0.5, 2.0])),
        "unit_nodes": units if use_units else None,
    }
    budget = draw(st.integers(1, 400))
    return layout, budget, kwargs, metas


@settings(max_examples=150, deadline=None)
@given(_planning_cases(), st.integers(0, 3), st.booleans())
@pytest.mark.parametrize("vectorize_from", [Planner.vectorize_from, 1])  # Python lists, numpy passes
def test_plan_is_identical_to_the_reference_algorithm(vectorize_from, case, step, with_loss) -> None:
    layout, budget, kwargs, metas = case
    ref = _ReferencePlanner(layout, budget, **kwargs)
    new = Planner(layout, budget, **kwargs)
    new.vectorize_from = vectorize_from
    loss = {m.id: m.num_tokens // 2 for m in metas} if with_loss else None
    plan = new.plan(_Admitted(train_batch=1, index=step, step=10 + step, trajectories=tuple(metas)), loss)
    rows, k, local, remote = ref.plan_rows(metas)
    assert [[list(mb.trajectory_ids) for mb in row] for row in plan.microbatches] == rows
    assert (plan.num_microbatches, plan.local_bytes, plan.remote_bytes) == (k, local, remote)
    assert [[m.id for m in s] for s in new.assign(metas)] == [[m.id for m in s] for s in ref.assign(metas)]
    for rank, row in enumerate(plan.microbatches):
        for i, mb in enumerate(row):
            assert (mb.consumer, mb.microbatch, mb.num_microbatches, mb.minibatch, mb.minibatch_in_batch) == (
                rank, i, k, 10 + step, step)
            assert mb.global_tokens == sum(m.num_tokens for m in metas)
            assert mb.global_trajectories == len(metas)
            assert mb.global_loss_tokens == (sum(loss.values()) if loss else 0)
            assert type(mb) is PlannedMicroBatch and isinstance(mb.trajectories, tuple)
            assert mb == PlannedMicroBatch(**mb._asdict())  # built in bulk: the same record as the constructor's


@settings(max_examples=40, deadline=None)
@given(_planning_cases(), st.integers(20, 33), st.integers(20, 32))
@pytest.mark.parametrize("vectorize_from", [Planner.vectorize_from, 1])
def test_plan_matches_the_reference_with_large_values(vectorize_from, case, seq_bits, token_bits) -> None:
    """Sequence numbers and token counts near the planner's bound (2**40): the integer sort keys do not overflow."""
    layout, budget, kwargs, metas = case
    metas = [TrajectoryMeta(id=m.id, source=m.source, group=m.group, num_tokens=m.num_tokens << token_bits,
                            nbytes=m.nbytes << 20, location=m.location, seq=m.seq << seq_bits) for m in metas]
    budget <<= token_bits
    planner = Planner(layout, budget, **kwargs)
    planner.vectorize_from = vectorize_from
    plan = planner.plan(_Admitted(0, 0, 0, tuple(metas)))
    rows, k, local, remote = _ReferencePlanner(layout, budget, **kwargs).plan_rows(metas)
    assert [[list(mb.trajectory_ids) for mb in row] for row in plan.microbatches] == rows
    assert (plan.num_microbatches, plan.local_bytes, plan.remote_bytes) == (k, local, remote)


@pytest.mark.parametrize("vectorize_from", [Planner.vectorize_from, 1])
@pytest.mark.parametrize("field, value", [("num_tokens", 7.5), ("seq", 1 << 70), ("nbytes", 1 << 45),
                                          ("num_tokens", -(1 << 41)), ("seq", -(1 << 63)), ("nbytes", 1 << 63)])
def test_values_outside_int64_planning_are_planned_exactly(field, value, vectorize_from) -> None:
    rng = random.Random(7)
    layout = ConsumerLayout.uniform(2, 2)
    metas = _metas(rng, 24, 3, list(layout.nodes))
    metas[5] = TrajectoryMeta(**{**metas[5].to_dict(), "media_digests": (), field: value})
    planner = Planner(layout, 40)
    planner.vectorize_from = vectorize_from
    plan = planner.plan(_Admitted(0, 0, 0, tuple(metas)))
    rows, k, local, remote = _ReferencePlanner(layout, 40).plan_rows(metas)
    assert [[list(mb.trajectory_ids) for mb in row] for row in plan.microbatches] == rows
    assert (plan.num_microbatches, plan.local_bytes, plan.remote_bytes) == (k, local, remote)


@pytest.mark.parametrize("order", ["arrival", "interleaved", "shuffled"])
def test_whole_unit_shares_match_the_reference(monkeypatch, order) -> None:
    """Groups whose members are in arrival order (as admission emits them) are cut into shares unit by unit,
    without the general sort of all trajectories, also when a rank's groups interleave in arrival (that rank's
    share alone is sorted); shuffled members take the general sort. Every way the plan is the reference's."""
    import knitdata.planner.core as planner_module

    calls = []
    general = planner_module.split_shares
    monkeypatch.setattr(planner_module, "split_shares", lambda *a: calls.append(1) or general(*a))
    rng = random.Random(3)
    layout = ConsumerLayout.uniform(4, 2)
    metas = []
    for g in range(60):  # groups of 4 in arrival order; interleaved: two groups arrive alternately
        base = (g // 2) * 8 + (g % 2) if order == "interleaved" else g * 4
        step = 2 if order == "interleaved" else 1
        seqs = [base + k * step for k in range(4)]
        if order == "shuffled":
            rng.shuffle(seqs)
        node = list(layout.nodes)[rng.randrange(4)]
        metas += [TrajectoryMeta(id=f"t{g}-{k}", source="s", group=f"g{g}", num_tokens=rng.randint(1, 50),
                                 nbytes=rng.randint(1, 99), location=node, seq=seqs[k]) for k in range(4)]
    planner = Planner(layout, 10_000, balance_tolerance=0.0)
    planner.vectorize_from = 1
    plan = planner.plan(_Admitted(0, 0, 0, tuple(metas)))
    rows, k, local, remote = _ReferencePlanner(layout, 10_000, balance_tolerance=0.0).plan_rows(metas)
    assert [[list(mb.trajectory_ids) for mb in row] for row in plan.microbatches] == rows
    assert (plan.num_microbatches, plan.local_bytes, plan.remote_bytes) == (k, local, remote)
    assert bool(calls) == (order == "shuffled")  # the general sort only for members out of arrival order
    assert all(type(mb.trajectories) is tuple for row in plan.microbatches for mb in row)


def _runs(metas) -> list[int]:
    sizes: list[int] = []
    for i, m in enumerate(metas):
        if i and m.group == metas[i - 1].group:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


@settings(max_examples=80, deadline=None)
@given(_planning_cases())
@pytest.mark.parametrize("vectorize_from", [Planner.vectorize_from, 1])
def test_group_sizes_hint_plans_the_same(vectorize_from, case) -> None:
    """Admission's ``group_sizes`` spare the planner the scan of group ids: the plan is the one without it."""
    layout, budget, kwargs, metas = case
    sizes = _runs(metas)
    if len(sizes) != len({m.group for m in metas}):  # a group in several runs: not whole groups in a row
        return
    planner = Planner(layout, budget, **kwargs)
    planner.vectorize_from = vectorize_from
    plain = planner.plan(_Admitted(0, 0, 0, tuple(metas)))
    hinted = planner.plan(_Admitted(0, 0, 0, tuple(metas), tuple(sizes)))
    assert hinted == plain


def test_wrong_group_sizes_are_refused_naming_the_group() -> None:
    layout = ConsumerLayout.uniform(2, 2)
    metas = tuple(_metas(random.Random(1), 24, 3, list(layout.nodes)))  # 8 groups of 3
    planner = Planner(layout, 40)
    for sizes, needle in [((3,) * 7, "do not describe"), ((3,) * 7 + (2, 1), "'g7'"), ((3,) * 8 + (0,), "do not"),
                          ((2, 4) + (3,) * 6, "'g0'"), ((3, 3, 6, 3, 3, 3, 3), "'g2'"), ((0, 3) + (3,) * 7, "do not")]:
        for vectorize_from in (Planner.vectorize_from, 1):  # Python lists, numpy passes: the same check
            planner.vectorize_from = vectorize_from
            with pytest.raises(ValidationError, match=needle) as info:
                planner.plan(_Admitted(0, 0, 0, metas, sizes))
            assert info.value.field == "group_sizes"


@pytest.mark.parametrize("vectorize_from", [Planner.vectorize_from, 1])
def test_a_duplicate_id_is_refused_and_equal_hashes_alone_are_not(monkeypatch, vectorize_from) -> None:
    """The duplicate-id check settles distinct ids by their hashes and compares the ids themselves otherwise:
    a real duplicate is named, and a hash collision between different ids is no error."""
    import knitdata.planner.core as planner_module

    layout = ConsumerLayout.uniform(2, 2)
    metas = _metas(random.Random(2), 12, 3, list(layout.nodes))
    planner = Planner(layout, 40)
    planner.vectorize_from = vectorize_from
    dup = [*metas[:-1], TrajectoryMeta(**{**metas[4].to_dict(), "media_digests": (), "group": metas[-1].group})]
    with pytest.raises(ValidationError, match="'t4'") as info:
        planner.plan(_Admitted(0, 0, 0, tuple(dup)))
    assert info.value.field == "id" and info.value.trajectory_id == "t4"
    real = planner_module.packed_columns

    def colliding(ms):
        tokens, nbytes, seqs, hashes = real(ms)
        return tokens, nbytes, seqs, None if hashes is None else hashes * 0  # every id hashes alike

    monkeypatch.setattr(planner_module, "packed_columns", colliding)
    expected = _ReferencePlanner(layout, 40).plan_rows(metas)[0]
    assert [[list(mb.trajectory_ids) for mb in row] for row in planner.plan(_Admitted(0, 0, 0, tuple(metas))).microbatches] == expected


@settings(max_examples=80, deadline=None)
@given(k=st.integers(1, 4), sizes=st.lists(st.integers(0, 3), min_size=0, max_size=24), loss=st.integers(0, 50),
       as_lists=st.booleans())
def test_planned_rows_are_the_checked_records(k, sizes, loss, as_lists) -> None:
    """The rows built in one pass are what the checked constructors build: each consumer's k micro-batches in
    order, every info equal to ``MicroBatchInfo(...)`` with its fields in their order, on lists or tuples."""
    from knitdata.planner.records import MicroBatchInfo, planned_rows

    sizes = sizes[: len(sizes) - len(sizes) % k]
    metas = iter(_metas(random.Random(len(sizes)), sum(sizes), 2, ["a", "b"]))
    bins = [[next(metas) for _ in range(s)] for s in sizes]
    bins = [b if as_lists else tuple(b) for b in bins]
    common = {"train_batch": 3, "minibatch": 7, "minibatch_in_batch": 1, "global_tokens": 99,
              "global_trajectories": sum(sizes), "global_loss_tokens": loss}
    rows = planned_rows(common, k, bins)
    assert len(rows) == len(sizes) // k and all(len(row) == k for row in rows)
    for rank, row in enumerate(rows):
        for i, mb in enumerate(row):
            metas_i = tuple(bins[rank * k + i])
            want = MicroBatchInfo(rank, 3, 7, 1, i, k, i == k - 1, 99, sum(sizes), loss,
                                  trajectory_ids=tuple(m.id for m in metas_i),
                                  gen_versions=tuple(m.gen_version for m in metas_i))
            assert type(mb) is PlannedMicroBatch and mb == PlannedMicroBatch(want, metas_i)
            assert list(mb.info.to_dict().items()) == list(want.to_dict().items())  # same keys, same order
            assert type(mb.trajectories) is tuple and type(mb.info.trajectory_ids) is tuple
            if not metas_i:
                assert mb.trajectories == () and mb.info.trajectory_ids == () and mb.info.gen_versions == ()
    # each info owns its fields (none shares a dict with another, or with the next plan's)
    assert len({id(mb.info.__dict__) for row in rows for mb in row}) == len(sizes)


def test_planned_rows_refuse_a_count_not_k_per_consumer() -> None:
    from knitdata.planner.records import planned_rows

    common = {"train_batch": 0, "minibatch": 0, "minibatch_in_batch": 0, "global_tokens": 0,
              "global_trajectories": 0, "global_loss_tokens": 0}
    with pytest.raises(ValidationError, match="5 micro-batches are not 2 per consumer") as info:
        planned_rows(common, 2, [()] * 5)
    assert info.value.field == "num_microbatches"
    with pytest.raises(ValidationError):
        planned_rows(common, 0, [])
