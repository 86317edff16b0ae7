"""Elastic resume (``knitdata.control.reshape``, ``knitdata.control.rankstates``): the re-planning of what is left
of a mini-batch after ``N`` ranks handed out prefixes of it, the merge of rank states and its refusals, and the
control plane's reshape (fresh and live). End-to-end cases on both engines: ``tests/test_conformance.py``
(scenario ``reshape``)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata import merge_rank_states
from knitdata.admission import AdmittedMiniBatch, BatchSpec
from knitdata.control import ControlPlane, fields_of
from knitdata.control.rankstates import MERGED_FORMAT
from knitdata.control.reshape import MAX_SEGMENTS, remainder_of, replan
from knitdata.errors import StateError
from knitdata.placement import ConsumerLayout
from knitdata.planner import Planner
from knitdata.record import TrajectoryMeta

BUDGET = 64


@st.composite
def minibatches(draw: Any) -> tuple[AdmittedMiniBatch, int, int, list[int], int]:
    """A mini-batch of whole groups, the old and new rank counts, each old rank's handed-out prefix, an offset."""
    n_groups = draw(st.integers(1, 14))
    metas = []
    seq = 0
    for g in range(n_groups):
        for k in range(draw(st.integers(1, 4))):
            tok = draw(st.integers(1, 90))
            metas.append(TrajectoryMeta(id=f"t{g}.{k}", source="s", group=f"g{g}", num_tokens=tok, nbytes=tok * 4,
                                        location="node0", seq=seq))
            seq += 1
    mb = AdmittedMiniBatch(train_batch=0, index=0, step=draw(st.integers(0, 5)), trajectories=tuple(metas))
    n, n2 = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    offset = draw(st.integers(0, 20))
    prefixes = draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    return mb, n, n2, prefixes, offset


def _planner(n: int) -> Planner:
    return Planner(ConsumerLayout.single_node(n), BUDGET)


@settings(max_examples=150, deadline=None)
@given(minibatches())
def test_replanned_remainder_completes_the_minibatch_balanced(case: Any) -> None:
    """Handed out + re-planned = the mini-batch, no overlap; every new rank runs the same number of micro-batches,
    each within the budget; the new ranks' token loads within the planner's bound (the mean plus one unit)."""
    mb, n, n2, prefixes, offset = case
    plan = _planner(n).plan(mb)
    k = plan.num_microbatches
    positions = [offset + min(p, k) for p in prefixes]
    rest, done = remainder_of(plan, offset, positions)
    handed = [m.id for r, row in enumerate(plan.microbatches) for i, pmb in enumerate(row) if offset + i < positions[r]
              for m in pmb.trajectories]
    assert sorted(m.id for m in done) == sorted(handed)
    new = replan(_planner(n2), mb, rest)
    again = [m.id for row in new.microbatches for pmb in row for m in pmb.trajectories]
    assert not set(again) & set(handed), "a handed-out trajectory was planned again"
    assert sorted(again + handed) == sorted(m.id for m in mb.trajectories), "lost or duplicated"
    assert len(again) == len(set(again))
    assert {len(row) for row in new.microbatches} == {new.num_microbatches}
    for row in new.microbatches:
        for pmb in row:
            toks = [m.num_tokens for m in pmb.trajectories]
            assert sum(toks) <= BUDGET or len(toks) == 1 or sum(toks) <= max(toks, default=0) * 2
            assert pmb.info.minibatch == mb.step
    if rest:  # LPT over units (the remainder's parts of groups): max load <= mean + the largest unit
        units: dict[str, int] = {}
        for m in rest:
            units[m.group] = units.get(m.group, 0) + m.num_tokens
        loads = [sum(m.num_tokens for pmb in row for m in pmb.trajectories) for row in new.microbatches]
        assert max(loads) <= sum(loads) / n2 + max(units.values())
    # pure: the same inputs, collected in another order, give the same plan
    again2 = replan(_planner(n2), mb, list(reversed(rest)))
    assert [[pmb.info.trajectory_ids for pmb in row] for row in again2.microbatches] == \
        [[pmb.info.trajectory_ids for pmb in row] for row in new.microbatches]


# ----------------------------------------------------------------------------------------------- merging
def _state(rank: int, n: int = 3, **kw: Any) -> dict[str, Any]:
    base = {"format": "knitdata.TrajectoryDataset", "version": 3, "pipeline": None, "rank": rank, "num_consumers": n,
            "worker": 0, "num_workers": 1, "next": 2 + rank, "minibatch": 1, "microbatch": 0, "end_minibatch": None,
            "epoch": 0, "handed_out": 2, "fingerprint": f"{rank:016x}", "fingerprint_length": 2 + rank,
            "layout": [["node0", n]]}
    return {**base, **kw}


def test_merge_is_pure_json_and_names_the_positions() -> None:
    states = [_state(r) for r in range(3)]
    before = copy.deepcopy(states)
    m = merge_rank_states(reversed(states))
    assert states == before
    assert json.loads(json.dumps(m)) == m
    assert m["format"] == MERGED_FORMAT and m["positions"] == [2, 3, 4] and m["num_consumers"] == 3
    assert m["fingerprints"] == [[2, f"{0:016x}"], [3, f"{1:016x}"], [4, f"{2:016x}"]]
    assert merge_rank_states([m, m]) == m  # a merged state passes through


def test_merge_of_dataloader_worker_states() -> None:
    """A StatefulDataLoader state per rank (one dataset state per worker): the rank's prefix is the round robin's."""
    def loader(rank: int, nexts: list[int]) -> dict[str, Any]:
        return {"_snapshot": {"_worker_snapshots": {
            f"worker_{w}": {"dataset_state": _state(rank, 2, worker=w, num_workers=2, next=x, fingerprint=None,
                                                    fingerprint_length=None)} for w, x in enumerate(nexts)}}}

    m = merge_rank_states([loader(0, [4, 5]), loader(1, [4, 3])])
    assert m["positions"] == [4, 3]
    with pytest.raises(StateError, match="rank 1: the states of its 2 DataLoader workers"):
        merge_rank_states([loader(0, [4, 5]), loader(1, [8, 3])])


def test_merge_of_replica_states() -> None:
    """Tensor/pipeline-parallel replicas of a rank share its stream: their states merge into the rank's position
    when they stand at the same one, and are refused, naming the rank and replicas, when they do not."""
    reps = [_state(r, replica=k, num_replicas=2) for r in range(3) for k in range(2)]
    assert merge_rank_states(reps)["positions"] == merge_rank_states([_state(r) for r in range(3)])["positions"]
    reps[3] = _state(1, replica=1, num_replicas=2, next=9)
    with pytest.raises(StateError, match=r"rank 1 \(worker 0\): its replicas 0 and 1 stand at different positions"):
        merge_rank_states(reps)


@pytest.mark.parametrize("states, match", [
    ([_state(0), _state(2)], r"ranks \[1\] are missing"),
    ([_state(0), _state(1), _state(1), _state(2)], "rank 1 .worker 0. is given twice"),
    ([_state(0), _state(1), _state(2, pipeline="other")], "rank 2 comes from pipeline 'other'.*different runs"),
    ([_state(0), _state(1), _state(2, num_consumers=4)], "rank 2 was saved with 4 ranks"),
    ([_state(0), _state(1, fingerprint=None, fingerprint_length=None), _state(2)],
     r"mixed fingerprints: ranks \[0, 2\] carry replay fingerprints and ranks \[1\] do not"),
    ([_state(0), _state(1), _state(2, layout=[["node0", 2], ["node1", 1]])], "ranks 0 and 2 were saved with different"),
    ([_state(0), _state(1), _state(2, layout_history={"root_whole": 0, "closed": [], "current": {}})],
     "different layout histories"),
    ([_state(0), {"format": MERGED_FORMAT}], "a merged state can only be given alone"),
    ([], "no knitdata dataset state"),
    ([_state(0), _state(1, version=9), _state(2)], "unsupported state version 9"),
])
def test_merge_refuses_bad_sets_naming_the_ranks(states: list[Any], match: str) -> None:
    with pytest.raises(StateError, match=match):
        merge_rank_states(states)


# ----------------------------------------------------------------------------------------------- the plane
SPEC = BatchSpec({"a": 4, "b": 4}, num_minibatches=2, group_size=2)


def _plane(n: int) -> ControlPlane:
    cfg = {"spec": SPEC.to_dict(), "layout": ConsumerLayout.single_node(n).to_dict(), "token_budget": 40}
    return ControlPlane(cfg, {"node0": "node0"}, lambda u, ids, wait: None)


def _fill(plane: ControlPlane, n: int = 32, order: list[int] | None = None) -> None:
    for i in order if order is not None else range(n):
        tid = f"t{i}"
        meta = {"id": tid, "source": "ab"[(i // 2) % 2], "group": f"g{i // 2}", "gen_version": 0,
                "num_tokens": 4 + (i * 7) % 30, "nbytes": 10, "fields": fields_of(["r"], {})}
        ans = plane.admission.admit_many("node0", [[meta, 0, f"tok{i}"]])
        assert ans.accepted[0] is not None, ans


def _drain(plane: ControlPlane, rank: int, start: int, upto: int | None = None) -> list[list[str]]:
    out = []
    j = start
    while upto is None or j < upto:
        ans = plane.leasing.next_entries(rank, j, 0.0)
        if not ans.entries:
            break
        for e in ans.entries:
            if upto is not None and e.j >= upto:
                break
            out.append([x[0] for x in e.items])
            j = e.j + 1
    return out


def _merged(n: int, positions: list[int], history: Any = None) -> dict[str, Any]:
    states = [{"format": "knitdata.TrajectoryDataset", "version": 3, "pipeline": None, "rank": r, "num_consumers": n,
               "worker": 0, "num_workers": 1, "next": p, "epoch": 0, "fingerprint": None,
               "fingerprint_length": None, "layout": [["node0", n]], "layout_history": history}
              for r, p in enumerate(positions)]
    return merge_rank_states(states)


@pytest.mark.parametrize("live", [False, True])
def test_plane_reshape_fresh_and_live_deliver_the_same(live: bool) -> None:
    """The live plane (queued entries re-planned at once) and a fresh plane (history installed before the refill)
    give the new ranks the same micro-batches, and with what the old ranks took, every trajectory once."""
    old = _plane(2)
    _fill(old)
    positions = [3, 1]
    taken = [i for r in range(2) for mb in _drain(old, r, 0, positions[r]) for i in mb]
    merged = _merged(2, positions)
    if live:
        plane = old
        plane.reshaping.reshape(merged, ConsumerLayout.single_node(3).to_dict())
    else:
        plane = _plane(3)
        plane.reshaping.reshape(merged)
        plane.reshaping.reshape(merged)  # every new rank loads it: a no-op after the first
        _fill(plane)
    rest = [_drain(plane, r, 0) for r in range(3)]
    ids = taken + [i for row in rest for mb in row for i in mb]
    assert sorted(ids) == sorted(f"t{i}" for i in range(32))
    assert len({len(row) for row in rest}) == 1  # the same number of micro-batches per new rank
    plane.positions.handed_many(2, [[0, 0, 0, 0, -1]])  # a new rank's hand-out: per-rank figures follow the new layout
    assert len(plane.reporting.stats()["staleness_by_rank"]) == 3
    if live:  # the same as a fresh pipeline would deliver
        fresh = _plane(3)
        fresh.reshaping.reshape(merged)
        _fill(fresh)
        assert [_drain(fresh, r, 0) for r in range(3)] == rest


def test_plane_reshape_refusals() -> None:
    plane = _plane(2)
    _fill(plane)
    plane.positions.commit(0, 4)
    with pytest.raises(StateError, match="rank 0: its state lies at micro-batch 2, before micro-batch 4"):
        plane.reshaping.reshape(_merged(2, [2, 0]))
    with pytest.raises(StateError, match="not of this pipeline's run and layout"):
        plane.reshaping.reshape(_merged(3, [4, 0, 0]))
    with pytest.raises(StateError, match="not a knitdata.MergedRankStates state"):
        plane.reshaping.reshape({"format": "x"})


def test_history_stays_bounded_over_many_reshapes() -> None:
    """Reshape after reshape, each after the remainders were consumed: the history keeps one closed segment."""
    history = None
    sizes = [2, 3, 1, 4, 2, 3, 2, 1]
    all_ids: list[str] = []
    positions: list[int] = []
    for k, n in enumerate(sizes):
        plane = _plane(n)
        if history is not None:
            plane.reshaping.reshape(history)
        _fill(plane, 64)
        got = plane.reshaping.layout_history(0)
        start = 0 if got["history"] is None else int(got["history"]["current"]["offset"])
        rem = got["remainder"]
        take = [start + (rem[1] if rem else 0) + 1 + (r + k) % 2 for r in range(n)]
        positions = take
        for r in range(n):
            all_ids += [i for mb in _drain(plane, r, start, take[r]) for i in mb]
        states = [{"format": "knitdata.TrajectoryDataset", "version": 3, "pipeline": None, "rank": r,
                   "num_consumers": n, "worker": 0, "num_workers": 1, "next": take[r], "epoch": 0,
                   "fingerprint": None, "fingerprint_length": None, "layout": [["node0", n]],
                   **({} if got["history"] is None else {"layout_history": got["history"],
                                                         "layout_remainder": plane.reshaping.layout_history(r)["remainder"]})}
                  for r in range(n)]
        history = merge_rank_states(states)
        closed = (history["history"] or {"closed": []})["closed"]
        assert len(closed) <= 1, closed
        assert len(json.dumps(history)) < 2000
    plane = _plane(2)
    plane.reshaping.reshape(history)
    _fill(plane, 64)
    all_ids += [i for r in range(2) for mb in _drain(plane, r, 0) for i in mb]
    assert len(positions) == sizes[-1]
    assert sorted(all_ids) == sorted(f"t{i}" for i in range(64))
    assert MAX_SEGMENTS >= 2


def test_a_refill_with_other_puts_is_refused_after_a_reshape() -> None:
    """The merged state carries each old rank's fingerprint: a new job refilled in another order stops with a
    StateError naming the rank, instead of delivering twice or skipping."""
    old = _plane(2)
    _fill(old)
    positions = [3, 2]
    for r in range(2):
        _drain(old, r, 0, positions[r])
    states = [{"format": "knitdata.TrajectoryDataset", "version": 3, "pipeline": None, "rank": r, "num_consumers": 2,
               "worker": 0, "num_workers": 1, "next": p, "epoch": 0, "fingerprint": old.state.fp(r, p),
               "fingerprint_length": p, "layout": [["node0", 2]]} for r, p in enumerate(positions)]
    merged = merge_rank_states(states)
    good = _plane(3)
    good.reshaping.reshape(merged)
    _fill(good)
    assert good.state.error is None
    bad = _plane(3)
    bad.reshaping.reshape(merged)
    order = [(15 - g) * 2 + k for g in range(16) for k in range(2)]  # the same groups, in reverse order
    _fill_tolerant(bad, order)
    assert isinstance(bad.state.error, StateError), bad.state.error
    assert "rank " in str(bad.state.error) and "same puts in the same order" in str(bad.state.error)


def _fill_tolerant(plane: ControlPlane, order: list[int]) -> None:
    for i in order:
        meta = {"id": f"t{i}", "source": "ab"[(i // 2) % 2], "group": f"g{i // 2}", "gen_version": 0,
                "num_tokens": 4 + (i * 7) % 30, "nbytes": 10, "fields": fields_of(["r"], {})}
        if plane.admission.admit_many("node0", [[meta, 0, f"tok{i}"]]).errors:
            return


def test_a_state_newer_than_the_live_pipeline_is_called_newer() -> None:
    """Issue 45.8: a state of this run taken further than this live pipeline has planned (it was refilled with
    fewer puts so far) is not "of another run": the message says it is newer and what to do."""
    plane = _plane(2)
    _fill(plane, 8)  # one train batch: a few micro-batches per rank
    far = plane.state.planned[0] + 3
    with pytest.raises(StateError) as ei:
        plane.reshaping.reshape(_merged(2, [far, 0]))
    text = str(ei.value)
    assert "another run" not in text, text
    assert f"rank 0: its state lies at micro-batch {far}" in text and "newer than this pipeline" in text, text
    assert "before the refill" in text, text


def test_merge_refuses_the_states_of_two_runs_naming_both() -> None:
    """Issue 45.8: rank 0's state from one run and rank 1's from another (the second with token_budget=48) are
    refused by the merge, naming both ranks and both values; the run's own states merge and carry the planning."""
    import torch

    from knitdata import Pipeline, Trajectory

    def run(budget: int) -> list[dict[str, Any]]:
        pipe = Pipeline(SPEC, num_consumers=2, token_budget=budget)
        for i in range(16):
            pipe.put(Trajectory(id=f"t{i}", source="ab"[(i // 2) % 2], group=f"g{i // 2}", gen_version=0,
                                prompt_ids=torch.arange(3), response_ids=torch.arange(2 + i % 5)))
        pipe.close()
        states = []
        for r in range(2):
            ds = pipe.dataset(r, fetch="sample")
            next(iter(ds))
            states.append(json.loads(json.dumps(ds.state_dict())))
            ds.close()
        return states

    one, two = run(24), run(48)
    with pytest.raises(StateError, match=r"rank 0 .*token_budget=24.* rank 1 .*token_budget=48.*different runs"):
        merge_rank_states([one[0], two[1]])
    merged = merge_rank_states(one)
    assert merged["planning"]["token_budget"] == 24


def _run_states(order: list[int], budget: int = 24) -> list[dict[str, Any]]:
    """Each rank's state after its first micro-batch, of a run fed ``order`` (trajectory numbers)."""
    import torch

    from knitdata import Pipeline, Trajectory

    pipe = Pipeline(SPEC, num_consumers=2, token_budget=budget)
    for i in order:
        pipe.put(Trajectory(id=f"t{i}", source="ab"[(i // 2) % 2], group=f"g{i // 2}", gen_version=0,
                            prompt_ids=torch.arange(3), response_ids=torch.arange(2 + i % 5)))
    pipe.close()
    states = []
    for r in range(2):
        ds = pipe.dataset(r, fetch="sample")
        next(iter(ds))
        states.append(json.loads(json.dumps(ds.state_dict())))
        ds.close()
    return states


def test_merge_refuses_two_runs_with_other_puts_naming_both() -> None:
    """Issue 45.8: two runs planned alike but fed other puts: every rank state carries the run's mark (its first
    micro-batch's fingerprint), so the merge refuses rank 0 of one with rank 1 of the other, naming both; the
    states of one run (or of two runs fed the same puts: one run for every purpose) merge."""
    forward = list(range(16))
    backward = [(7 - g) * 2 + k for g in range(8) for k in range(2)]
    one, two, again = _run_states(forward), _run_states(backward), _run_states(forward)
    assert one[0]["run"] and one[0]["run"] == one[1]["run"] != two[0]["run"]
    with pytest.raises(StateError, match=r"rank 0 .*run .* rank 1 .*run .*different runs"):
        merge_rank_states([one[0], two[1]])
    assert merge_rank_states([one[0], again[1]])["run"] == one[0]["run"]
    merged = merge_rank_states(one)
    live = _plane(2)  # a live plane of another run refuses the merged state too
    _fill(live, 16, backward)
    with pytest.raises(StateError, match="another run"):
        live.reshaping.reshape(merged)
