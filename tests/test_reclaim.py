"""Deferred freeing (knitdata.reclaim): the trainer's thread forgets, a producer's put frees."""

from __future__ import annotations

import gc
import threading
import weakref

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata import BatchSpec, Pipeline, Trajectory
from knitdata.reclaim import Graveyard


class _Obj:
    """A weak-referenceable object."""


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(0, 7), max_size=20), limit=st.integers(1, 30))
def test_bury_keeps_until_free_or_past_the_limit(sizes: list[int], limit: int) -> None:
    g = Graveyard(limit=limit)
    refs: list[weakref.ref[_Obj]] = []
    kept = 0
    for n in sizes:
        objs = [_Obj() for _ in range(n)]
        refs += [weakref.ref(o) for o in objs]
        g.bury(objs)
        del objs
        kept += n
        if kept > limit:  # the bury that went past the limit freed everything on this thread
            kept = 0
        assert g.held == kept
        assert sum(r() is not None for r in refs) == kept
    assert g.free() == kept and g.held == 0
    assert all(r() is None for r in refs)
    assert g.freed == sum(sizes)


def test_bury_and_free_from_many_threads_lose_nothing() -> None:
    g = Graveyard(limit=10_000_000)
    refs: list[weakref.ref[_Obj]] = []
    lock = threading.Lock()
    freed: list[int] = []

    def burier() -> None:
        for _ in range(200):
            objs = [_Obj() for _ in range(5)]
            with lock:
                refs.extend(weakref.ref(o) for o in objs)
            g.bury(objs)

    def freer() -> None:
        for _ in range(200):
            freed.append(g.free())

    threads = [threading.Thread(target=burier) for _ in range(3)] + [threading.Thread(target=freer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    freed.append(g.free())
    assert sum(freed) == 3 * 200 * 5 == g.freed and g.held == 0
    assert all(r() is None for r in refs)


def _traj(i: int) -> Trajectory:
    return Trajectory(id=f"t{i}", source="a", group=f"g{i}", prompt_ids=torch.arange(4), response_ids=torch.arange(8),
                      tensors={"x": torch.zeros(8)})


def test_released_payloads_are_freed_by_the_next_put_on_the_producers_thread() -> None:
    """The trainer's thread releases each mini-batch (the store's accounting drops) but frees none of its payloads;
    the next put frees them, on the producer's thread, before it stores anything; ``stats()`` frees the rest."""
    pipe = Pipeline(BatchSpec({"a": 4}, num_minibatches=2), num_consumers=1, token_budget=64, capacity_bytes=1 << 20)
    freed_on: dict[str, str] = {}

    def put(i: int) -> None:
        t = _traj(i)
        weakref.finalize(t.tensors["x"], lambda tid=t.id: freed_on.__setitem__(tid, threading.current_thread().name))
        pipe.put(t)

    for i in range(4):
        put(i)
    ds = pipe.dataset(0, fetch="eager", max_minibatches=2)
    assert sum(mb.num_sequences for mb in ds) == 4
    ds.flush()  # the pass's last release reaches the plane
    assert pipe.stats_light()["released"] == 4 and not freed_on  # released on this thread, nothing freed here
    producer = threading.Thread(target=put, args=(4,), name="a-producer")
    producer.start()
    producer.join()
    assert freed_on == {f"t{i}": "a-producer" for i in range(4)}
    units = pipe.stats()["units"]
    assert sum(u["used_bytes"] for u in units.values()) == _traj(4).nbytes
    pipe.close(warn=False)  # t4 waits for its mini-batch's partner
    pipe.shutdown()


def test_stats_and_shutdown_free_what_releases_left() -> None:
    pipe = Pipeline(BatchSpec({"a": 2}, num_minibatches=1), num_consumers=1, token_budget=64, capacity_bytes=1 << 20)
    refs = []
    for i in range(2):
        t = _traj(i)
        refs.append(weakref.ref(t))
        pipe.put(t)
        del t
    assert sum(mb.num_sequences for mb in pipe.dataset(0, fetch="eager", max_minibatches=1)) == 2
    pipe.dataset(0).flush()
    gc.collect()
    assert all(r() is not None for r in refs)  # kept for the next put
    pipe.stats()
    assert all(r() is None for r in refs)
    pipe.shutdown()
