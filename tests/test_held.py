"""The control plane's tables of held trajectories (knitdata.control.held): what a commit leaves to forget is
forgotten at the next read, and no reader sees it; the delivered-ids memory (RecentIds)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata import BatchSpec, Pipeline, Trajectory
from knitdata.control.held import HeldTrajectories, RecentIds
from knitdata.reclaim import Graveyard
from knitdata.record import TrajectoryMeta

_IDS = [f"t{i}" for i in range(12)]


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "pop", "later", "read", "load"]),
                              st.lists(st.sampled_from(_IDS), max_size=5, unique=True)), max_size=30),
       limit=st.integers(0, 6))
def test_the_tables_read_as_if_every_release_forgot_at_once(ops, limit):
    """Against a model that forgets at once: puts, releases now (``pop``), commits (``forget_later``, each id once,
    as a commit releases each entry once), reads and loads in any order; every read (of any table) sees exactly
    the model, ``forget_later`` returns the ids held in order, and what is forgotten goes to the graveyard (freed
    past its limit: with limit 0, nothing is ever queued)."""
    grave = Graveyard(limit=limit)
    held = HeldTrajectories(grave)
    model: dict[str, int] = {}
    queued: set[str] = set()  # ids given to forget_later and not put again (a put of them would be refused)
    for k, (op, ids) in enumerate(ops):
        if op == "put":
            for tid in ids:
                if tid not in model and tid not in queued:
                    held.live[tid] = TrajectoryMeta(tid, "s", "g", location="u0")
                    held.put_tokens[tid] = f"call-{k}"
                    held.loss[tid] = k
                    model[tid] = k
        elif op == "pop":
            popped = held.pop(ids)
            assert [m is not None for m in popped] == [tid in model for tid in ids]
            for tid in ids:
                model.pop(tid, None)
        elif op == "later":
            fresh = [tid for tid in ids if tid not in queued]
            got = held.forget_later(list(fresh))
            if limit == 0:
                assert got is None and held.queued == 0
                held.pop(fresh)
            else:
                assert got == [tid for tid in fresh if tid in model]
                queued.update(got)
                held.settle_over_limit()  # (the plane's commit does this after the units' release)
                assert held.queued <= limit
                if not held.queued:
                    queued.clear()
            for tid in fresh:
                model.pop(tid, None)
        elif op == "load":
            live = {tid: TrajectoryMeta(tid, "s", "g", location="u0") for tid in model}
            held.load(live, {tid: "loaded" for tid in model}, dict(model))
            queued.clear()
        else:
            read = (lambda: held.live, lambda: held.put_tokens, lambda: held.loss)[k % 3]()  # any table settles
            assert held.queued == 0
            assert sorted(read) == sorted(model)
            assert held.loss == model
            queued.clear()
    assert sorted(held.live) == sorted(held.put_tokens) == sorted(held.loss) == sorted(model)


def test_without_a_graveyard_that_keeps_a_commit_forgets_at_once():
    """The Ray engine's plane (no graveyard): ``forget_later`` declines, the caller forgets now."""
    held = HeldTrajectories()
    held.live["a"] = TrajectoryMeta("a", "s", "g")
    assert held.forget_later(["a"]) is None and "a" in held.live
    assert held.pop(["a"]) != [None] and held.live == {}


def _traj(i: int) -> Trajectory:
    return Trajectory(id=f"t{i}", source="a", group=f"g{i}", prompt_ids=torch.arange(4), response_ids=torch.arange(4),
                      tensors={"x": torch.zeros(64)})


def test_a_commit_is_forgotten_by_the_next_put_on_the_producers_thread():
    """End to end on the embedded engine: a pass's commits release the payloads and count them at once, and leave
    the plane's records to the next read of its tables; a producer's put reads them, on its own thread, and from
    then on the plane holds only what was put after. A snapshot taken before that put holds none of them either."""
    pipe = Pipeline(BatchSpec({"a": 4}, num_minibatches=2), num_consumers=1, token_budget=64, capacity_bytes=1 << 20)
    state = pipe.internals.local_plane().state
    settled_on: list[str] = []
    settle = HeldTrajectories.settle

    def spy(self: HeldTrajectories) -> None:
        if self.queued:
            settled_on.append(threading.current_thread().name)
        settle(self)

    for i in range(4):
        pipe.put(_traj(i))
    ds = pipe.dataset(0, fetch="eager", max_minibatches=2)
    HeldTrajectories.settle = spy  # type: ignore[method-assign]
    try:
        assert sum(mb.num_sequences for mb in ds) == 4
        ds.flush()  # the pass's last release reaches the plane
        assert settled_on == [] and state.counts["released"] == 4  # counted, nothing forgotten yet
        assert sum(u.stats().used_bytes for u in pipe.internals.units.values()) == 0
        producer = threading.Thread(target=pipe.put, args=(_traj(4),), name="a-producer")
        producer.start()
        producer.join()
        assert settled_on == ["a-producer"]
        assert pipe.stats_light()["released"] == 4
        with state.cond:
            assert sorted(state.live) == sorted(state.put_tokens) == sorted(state.loss) == ["t4"]
    finally:
        HeldTrajectories.settle = settle  # type: ignore[method-assign]
    pipe.close(warn=False)
    pipe.shutdown()


def test_a_snapshot_after_a_commit_holds_none_of_its_trajectories():
    pipe = Pipeline(BatchSpec({"a": 2}, num_minibatches=1), num_consumers=1, token_budget=64, capacity_bytes=1 << 20)
    for i in range(4):
        pipe.put(_traj(i))
    ds = pipe.dataset(0, fetch="iter", max_minibatches=1)
    assert sum(mb.num_sequences for mb in ds) == 2
    ds.flush()
    plane = pipe.internals.local_plane()
    with plane.state.cond:
        snap = plane.state.state_dict()
    assert sorted(m["id"] for m in snap["live"]) == sorted(snap["put_tokens"]) == sorted(snap["loss"]) == ["t2", "t3"]
    pipe.close(warn=False)
    pipe.shutdown()


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 12),
       batches=st.lists(st.lists(st.sampled_from([f"t{i}" for i in range(30)]), max_size=8), max_size=25),
       read_every=st.integers(1, 6))
def test_recent_ids_match_an_ordered_dict_bounded_to_its_limit(limit, batches, read_every):
    """RecentIds (the plane's memory of delivered ids) behaves as the OrderedDict it replaced: ids in first-added
    order, an id added again keeps its place, the oldest beyond the limit forgotten; and a copy made from its
    order (a snapshot's list) is the same memory. Batches are queued until the next read (or past the limit):
    read after every ``read_every`` batches, any read sees them all."""
    model: OrderedDict[str, None] = OrderedDict()
    mem = RecentIds(limit)
    for k, batch in enumerate(batches):
        for tid in batch:
            model[tid] = None
        while len(model) > limit:
            model.popitem(last=False)
        mem.add_many(list(batch))
        if (k + 1) % read_every:
            continue
        read = k // read_every % 3  # each kind of read folds the queued batches
        if read == 0:
            assert all((f"t{i}" in mem) == (f"t{i}" in model) for i in range(30))
        elif read == 1:
            assert len(mem) == len(model)
        assert list(mem) == list(model) and len(mem) == len(model)
    assert list(mem) == list(model)
    again = RecentIds(limit, list(mem))
    assert list(again) == list(mem)
