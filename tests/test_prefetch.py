"""Tests of knitdata.consumer.prefetch: ordering, bounded depth, exact state, errors, shutdown, overlap, staging."""

from __future__ import annotations

import collections
import gc
import json
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.consumer.collate import MicroBatch, MicroBatchInfo, TokenCollator
from knitdata.consumer.prefetch import PinnedBufferPool, Prefetcher, PrefetchQueue, map_tensors
from knitdata.consumer.staging import staged_copy as _staged_copy
from knitdata.errors import ConfigError, StateError
from knitdata.record import Trajectory


class CountingSource:
    """A resumable iterator over ``f(i)``, i < n, that counts how far it was pulled."""

    def __init__(self, n: int, *, delay: float = 0.0, fail_at: int | None = None, f=lambda i: i * 10):
        self.n = n
        self.i = 0
        self.delay = delay
        self.fail_at = fail_at
        self.f = f

    def __iter__(self) -> CountingSource:
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        if self.delay:
            time.sleep(self.delay)
        if self.i == self.fail_at:
            self.fail_at = None
            raise ValueError(f"bad item {self.i}")
        v = self.f(self.i)
        self.i += 1
        return v

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = int(state["i"])


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "knitdata-prefetch" and t.is_alive()]


def _wait_until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    gc.collect()
    assert _wait_until(lambda: not _prefetch_threads()), "a prefetch thread outlived its test"


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_order_and_exhaustion(depth: int) -> None:
    pf = Prefetcher(CountingSource(23), depth=depth)
    assert list(pf) == [i * 10 for i in range(23)]
    assert pf.closed and pf.stats.items == 23 and pf.stats.produced == 23
    with pytest.raises(StopIteration):
        next(pf)
    assert pf.state_dict() == {}  # no state_fn
    json.dumps(pf.stats.to_dict())


@pytest.mark.parametrize("depth", [1, 3])
def test_bounded_depth(depth: int) -> None:
    src = CountingSource(40)
    with Prefetcher(src, state_fn=src.state_dict, depth=depth) as pf:
        consumed = 0
        # before anything is consumed, the producer fills the queue and holds one more item
        assert _wait_until(lambda: src.i == depth + 1)
        time.sleep(0.05)
        assert src.i == depth + 1
        for _ in range(20):
            next(pf)
            consumed += 1
            ahead = src.i - consumed
            assert 0 <= ahead <= depth + 1
        assert _wait_until(lambda: src.i == consumed + depth + 1)  # it refills, and no further
        time.sleep(0.05)
        assert src.i - consumed == depth + 1


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 30), stop=st.integers(0, 30), depth=st.integers(1, 4))
def test_state_resumes_exactly(n: int, stop: int, depth: int) -> None:
    stop = min(stop, n)
    src = CountingSource(n)
    pf = Prefetcher(src, state_fn=src.state_dict, depth=depth)
    assert pf.state_dict() == {"i": 0}
    got = [next(pf) for _ in range(stop)]
    time.sleep(0.01)  # let the producer run ahead: its lead must not leak into the state
    state = json.loads(json.dumps(pf.state_dict()))
    assert state == {"i": stop}
    pf.close()
    fresh = CountingSource(n)
    fresh.load_state_dict(state)
    rest = list(Prefetcher(fresh, state_fn=fresh.state_dict, depth=depth))
    assert got + rest == [i * 10 for i in range(n)]


def test_state_is_a_snapshot() -> None:
    class Mutating:
        def __init__(self) -> None:
            self.state = {"pos": [0]}
            self.k = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.k += 1
            self.state["pos"][0] = self.k  # mutated in place: a kept reference would be wrong
            return self.k

    src = Mutating()
    pf = Prefetcher(src, state_fn=lambda: src.state, depth=3)
    assert next(pf) == 1
    _wait_until(lambda: src.k >= 4)
    assert pf.state_dict() == {"pos": [1]}
    pf.state_dict()["pos"][0] = 99  # callers cannot corrupt it either
    assert pf.state_dict() == {"pos": [1]}
    pf.close()


def test_error_propagates_in_order() -> None:
    pf = Prefetcher(CountingSource(10, fail_at=4), depth=3)
    assert [next(pf) for _ in range(4)] == [0, 10, 20, 30]
    with pytest.raises(ValueError, match="bad item 4"):
        next(pf)
    with pytest.raises(StopIteration):
        next(pf)
    assert pf.closed


def test_state_fn_errors() -> None:
    with pytest.raises(StateError):
        Prefetcher(CountingSource(3), state_fn=lambda: {"x": object()})
    calls = []

    def late_bad() -> dict:
        calls.append(1)
        return {"ok": 1} if len(calls) == 1 else {"bad": {1, 2}}

    pf = Prefetcher(CountingSource(3), state_fn=late_bad)
    with pytest.raises(StateError):
        next(pf)


def test_early_break_and_gc_stop_the_thread() -> None:
    src = CountingSource(10_000)
    for x in Prefetcher(src, depth=2):
        if x >= 30:
            break
    gc.collect()
    assert _wait_until(lambda: not _prefetch_threads())
    pulled = src.i
    time.sleep(0.05)
    assert src.i == pulled  # nothing pulls any more


def test_close_while_producer_blocked_and_idempotent() -> None:
    src = CountingSource(1000)
    pf = Prefetcher(src, depth=2)
    assert _wait_until(lambda: src.i == 3)  # producer now blocked on the full queue
    t0 = time.perf_counter()
    pf.close()
    pf.close()
    assert time.perf_counter() - t0 < 2.0
    assert not _prefetch_threads()
    with pytest.raises(StopIteration):
        next(pf)


def test_close_with_slow_source_returns() -> None:
    src = CountingSource(5, delay=0.2)
    pf = Prefetcher(src, depth=1)
    time.sleep(0.05)
    pf.close(timeout=1.0)  # the thread finishes its current next() and exits
    assert not _prefetch_threads()


def test_overlap_hides_producer_latency() -> None:
    """A producer and a consumer each taking ~t per item: with prefetch the consumer barely waits."""
    n, t = 16, 0.02
    src = CountingSource(n, delay=t)
    pf = Prefetcher(src, depth=2)
    for _ in pf:
        time.sleep(t)  # the consumer's "compute" (releases the GIL, like a CUDA kernel launch + sync)
    st = pf.stats
    assert st.items == n and len(st.recent_wait_s) == n
    assert st.produce_s >= n * t * 0.9  # the producer really spent ~n*t
    # only the first item (nothing to overlap with) is fully exposed; serial execution would wait n*t
    assert st.wait_s < 0.5 * n * t, st.to_dict()
    assert st.median_wait_s < 0.5 * t, st.to_dict()


class _CountingRoom:
    """The prefetcher's room lock (a binary semaphore), counting the consumer's signals."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.releases = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()
        self.releases += 1


@pytest.mark.parametrize("depth", [2, 3])
def test_a_pop_that_leaves_items_queued_wakes_no_thread(depth: int) -> None:
    """The consumer's pop signals the thread only when it empties the queue; otherwise the thread, parked on the
    full queue, finds the room at its own next check (a quarter of the consumer's time per item), so it still
    refills during the consumer's compute and the consumer does not wait."""
    n, compute = 30, 0.02
    src = CountingSource(n, delay=0.001, f=lambda i: i)
    pf = Prefetcher(src, depth=depth, inline_below_s=0.0)
    room = _CountingRoom()
    pf.queue.room = room  # the thread reads it at its next check (it starts parked on the full queue)
    assert _wait_until(lambda: src.i == depth + 1)
    got = []
    refills = []
    for x in pf:
        got.append(x)
        ahead = src.i - len(got)
        time.sleep(compute)  # the consumer's compute: the thread refills meanwhile, unwoken
        refills.append(src.i - len(got) - ahead)
    assert got == list(range(n))
    # a pop that left items queued did not signal (signalling every pop would be about n); on a quiet machine none
    # of the pops empties the queue, on a loaded one a late thread lets a few do it
    assert room.releases <= n // 3, room.releases
    # the room of a pop was refilled during the compute that followed it (but at the tail of the source)
    assert sum(r >= 1 for r in refills[: n - depth - 1]) >= (n - depth - 1) // 2, refills
    assert pf.stats.median_wait_s == 0.0, pf.stats.to_dict()


def test_a_pop_that_empties_the_queue_wakes_the_thread() -> None:
    """A consumer faster than the thread empties the queue at each pop: the pop signals the thread at once."""
    n = 12
    src = CountingSource(n, delay=0.01, f=lambda i: i)
    pf = Prefetcher(src, depth=2, inline_below_s=0.0)
    room = _CountingRoom()
    pf.queue.room = room
    assert _wait_until(lambda: src.i == 3)
    time.sleep(0.02)  # the thread parked on the full queue has checked for room since: it now waits on ours
    t0 = time.perf_counter()
    assert [next(pf), next(pf)] == [0, 1]  # the second pop empties the queue: the thread is woken for item 3
    assert _wait_until(lambda: src.i >= 4, timeout=1.0)
    assert room.releases >= 1
    assert time.perf_counter() - t0 < 1.0
    assert list(pf) == list(range(2, n))


def test_config_errors() -> None:
    with pytest.raises(ConfigError):
        Prefetcher(iter([]), depth=0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError):
            Prefetcher(iter([]), device="cuda")
        with pytest.warns(UserWarning, match="without CUDA"):
            pf = Prefetcher(iter([1]), pin_memory=True)
        assert not pf.pin_memory and list(pf) == [1]
    with pytest.raises(ConfigError):
        Prefetcher(iter([]), device="cpu", pool=PinnedBufferPool(pin=False))


def test_cpu_path_passes_microbatches_through() -> None:
    coll = TokenCollator(mode="pack")
    trajs = [Trajectory(id=f"t{i}", source="s", group="g", prompt_ids=torch.arange(i), response_ids=torch.arange(3))
             for i in range(6)]
    batches = [coll(trajs[i : i + 2]) for i in range(0, 6, 2)]
    out = list(Prefetcher(iter(batches), device="cpu"))
    assert [b is o for b, o in zip(batches, out)] == [True] * 3  # nothing copied or pinned on CPU


def test_pool_size_classes_reuse_and_bound() -> None:
    pool = PinnedBufferPool(max_cached_bytes=3 << 20, min_size=1 << 16, pin=False)
    assert pool.size_class(1) == 1 << 16 and pool.size_class(600 << 10) == 1 << 20
    assert pool.size_class(1 << 20) == 1 << 20 and pool.size_class((1 << 20) + 1) == 2 << 20
    a = pool.acquire(700 << 10)
    assert a.numel() == 1 << 20 and a.dtype == torch.uint8 and pool.misses == 1
    pool.release(a)
    b = pool.acquire(900 << 10)  # same class: reused
    assert b.data_ptr() == a.data_ptr() and pool.hits == 1
    c = pool.acquire(3 << 20)  # class 4 MiB > bound: dropped on release
    pool.release(b)
    pool.release(c)
    s = pool.stats()
    assert s["cached_bytes"] == 1 << 20 and s["in_use_bytes"] == 0 and s["dropped"] == 1
    assert s["high_water_bytes"] == (1 << 20) + (4 << 20)
    json.dumps(s)
    pool.clear()
    assert pool.stats()["cached_bytes"] == 0
    with pytest.raises(ConfigError):
        PinnedBufferPool(min_size=1000)


def test_staged_copy_packs_one_block() -> None:
    pool = PinnedBufferPool(pin=False, min_size=1 << 10)
    trajs = [Trajectory(id=f"t{i}", source="s", group="g", prompt_ids=torch.arange(i + 1),
                        response_ids=torch.arange(5) + i, scalars={"r": float(i)},
                        tensors={"logp": torch.randn(5), "flag": torch.ones(2, dtype=torch.bool)}) for i in range(3)]
    mb = TokenCollator()(trajs, None)
    tricky = {"mb": mb, "strided": torch.arange(12.0).reshape(3, 4).t(), "empty": torch.zeros(0, 3), "n": 3}
    moved, staging, block = _staged_copy(tricky, torch.device("cpu"), pool, non_blocking=False)
    assert staging is not None and block is not None
    for a, b in zip(map_tensors_list(tricky), map_tensors_list(moved)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if b.numel():
            assert b.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()  # views into one block
    assert isinstance(moved["mb"], MicroBatch) and moved["n"] == 3
    pool.release(staging)
    assert pool.stats()["in_use_bytes"] == 0


def map_tensors_list(obj) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_tensors(obj, lambda t: out.append(t) or t)
    return out


def test_map_tensors_structures() -> None:
    Pair = collections.namedtuple("Pair", "a b")

    @dataclass(frozen=True)
    class Box:
        x: torch.Tensor
        label: str

    class Opaque:
        pass

    op = Opaque()
    obj = {"p": Pair(torch.ones(1), [torch.zeros(2), "s"]), "box": Box(torch.ones(3), "k"), "op": op, "info": None}
    seen_opaque = []
    out = map_tensors(obj, lambda t: t + 1, lambda o: seen_opaque.append(o) or o)
    assert isinstance(out["p"], Pair) and torch.equal(out["p"].a, torch.full((1,), 2.0))
    assert torch.equal(out["p"].b[0], torch.ones(2)) and out["p"].b[1] == "s"
    assert isinstance(out["box"], Box) and out["box"].label == "k" and torch.equal(out["box"].x, torch.full((3,), 2.0))
    assert out["op"] is op and seen_opaque == [op]
    info = MicroBatchInfo(0, 0, 0, 0, 0, 1, True, 1, 2, 0, ("a", "b"), (3, 4))
    assert map_tensors(info, lambda t: t) is info  # unchanged dataclasses are not rebuilt


# ------------------------------------------------------------------------------------------------ CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ragged_batches(n: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(0)
    coll = TokenCollator(mode="pad")
    out = []
    for k in range(n):
        trajs = [Trajectory(id=f"t{k}_{i}", source="s", group="g",
                            prompt_ids=torch.randint(0, 100, (int(torch.randint(1, 50, (1,), generator=g)),), generator=g),
                            response_ids=torch.randint(0, 100, (int(torch.randint(1, 300, (1,), generator=g)),),
                                                       generator=g),
                            scalars={"r": float(i)})
                 for i in range(4)]
        out.append(coll(trajs, MicroBatchInfo(0, 0, k, 0, 0, 1, True, 1, 4, 0, tuple(t.id for t in trajs), (0,) * 4)))
    return out


@cuda
@pytest.mark.parametrize("use_pool", [False, True])
def test_cuda_prefetch_copies_on_side_stream(use_pool: bool) -> None:
    batches = _ragged_batches(12)
    pool = PinnedBufferPool(max_cached_bytes=64 << 20) if use_pool else None
    pf = Prefetcher(iter(batches), device="cuda", depth=2, pool=pool)
    w = torch.randn(512, 512, device="cuda")
    for host, dev in zip(batches, pf):
        assert dev.input_ids.is_cuda and dev.info == host.info
        _ = w @ w  # main-stream work queued around the use of the copy
        assert torch.equal(dev.input_ids.cpu(), host.input_ids)
        assert torch.equal(dev.loss_mask.cpu(), host.loss_mask)
        assert torch.equal(dev.scalars["r"].cpu(), host.scalars["r"])
    st = pf.stats
    assert st.items == 12 and st.bytes_copied >= sum(b.nbytes for b in batches)
    if use_pool:
        s = pool.stats()
        assert s["hits"] + s["misses"] == 12 and s["in_use_bytes"] == 0 and s["hits"] > 0


@cuda
def test_cuda_pin_only_when_no_device() -> None:
    batches = _ragged_batches(3)
    out = list(Prefetcher(iter(batches)))  # pin_memory=None -> pinned on CUDA machines
    assert all(t.is_pinned() for b in out for t in b.iter_tensors())


# ------------------------------------------------------------------------------------------------ CUDA path on CPU
class _FakeStream:
    def __init__(self, device=None):
        self.device = device
        self.waited: list = []

    def wait_event(self, event) -> None:
        assert event.recorded, "waited on an event never recorded"
        self.waited.append(event)


class _FakeEvent:
    def __init__(self, *a, **kw):
        self.recorded = False
        self.synced = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        self.synced = True


@pytest.mark.parametrize("use_pool", [False, True])
def test_cuda_code_path_with_fake_streams(monkeypatch: pytest.MonkeyPatch, use_pool: bool) -> None:
    """Runs every line of the CUDA path on CPU with stand-ins for streams and events (no CUDA semantics:
    the real thing is tested above and by benchmarks/cuda_check.py on a GPU)."""
    import contextlib

    import knitdata.consumer.prefetch as kp

    main_stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main_stream)
    real = kp.CudaTransfer  # the prefetcher's name of knitdata.consumer.staging.CudaTransfer
    monkeypatch.setattr(kp, "CudaTransfer", lambda dev, pin, pool, stats: real(torch.device("cpu"), False, pool, stats))
    pool = PinnedBufferPool(pin=False, min_size=1 << 10) if use_pool else None
    batches = _ragged_batches(5)
    src = iter(batches)
    pf = Prefetcher(src, device="cuda", pin_memory=False, pool=pool, depth=2)
    out = list(pf)
    assert len(out) == 5 and len(main_stream.waited) == 5 and all(e.synced for e in main_stream.waited)
    for a, b in zip(batches, out):
        assert b.info == a.info and (b is not a or not use_pool)  # the pool path copies into one block
        for x, y in zip(a.iter_tensors(), b.iter_tensors()):
            assert torch.equal(x, y) and x.dtype == y.dtype
    st = pf.stats
    assert st.bytes_copied >= sum(b.nbytes for b in batches) and st.items == 5
    if use_pool:
        s = pool.stats()
        assert s["in_use_bytes"] == 0 and s["hits"] + s["misses"] == 5


# ------------------------------------------------------------------------------------------------ hand-off
class GuardedSource(CountingSource):
    """A CountingSource that fails loudly if two threads are ever inside it at once, and records who ran it."""

    def __init__(self, n: int, *, work: float = 0.0, **kw):
        super().__init__(n, **kw)
        self.work = work
        self.inside = threading.Lock()
        self.threads: list[int] = []

    def __next__(self):
        if not self.inside.acquire(blocking=False):
            raise AssertionError("two threads inside the source at once")
        try:
            if self.work:
                time.sleep(self.work)
            v = super().__next__()
            self.threads.append(threading.get_ident())
            return v
        finally:
            self.inside.release()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 25), depth=st.integers(1, 4), fail_at=st.one_of(st.none(), st.integers(0, 25)),
       inline_below_s=st.sampled_from([0.0, 2e-4, 10.0]),
       pauses=st.lists(st.sampled_from([0.0, 0.0, 0.003, 0.008]), min_size=1, max_size=6),
       work=st.sampled_from([0.0, 0.001]), with_state=st.booleans())
def test_handoff_order_exactly_once_and_errors(n, depth, fail_at, inline_below_s, pauses, work, with_state) -> None:
    """Whatever mix of inline pulls, thread pulls and hand-offs the consumer's pace causes: every item once,
    in order; the state is the one of the item handed out; an error surfaces in place with its own type.
    Without a ``state_fn`` the items are plain (an inline pull takes the short path)."""
    src = GuardedSource(n, work=work, fail_at=fail_at)
    pf = Prefetcher(src, state_fn=src.state_dict if with_state else None, depth=depth, inline_below_s=inline_below_s)
    got = []
    err = None
    try:
        for k, x in enumerate(pf):
            got.append(x)
            assert pf.state_dict() == ({"i": len(got)} if with_state else {})
            assert src.i - len(got) <= depth + 1  # bounded lead
            if pauses[k % len(pauses)]:
                time.sleep(pauses[k % len(pauses)])
    except ValueError as e:
        err = e
    fails = fail_at is not None and fail_at < n
    assert got == [i * 10 for i in range(fail_at if fails else n)]
    assert (err is not None) == fails and (err is None or str(err) == f"bad item {fail_at}")
    assert pf.closed and pf.stats.items == len(got)
    assert len(src.threads) == src.i == len(got)  # nothing pulled that was not handed out (the end was reached)
    if inline_below_s == 0.0:
        assert pf.stats.inline == 0 and threading.get_ident() not in src.threads
    with pytest.raises(StopIteration):
        next(pf)


def test_inline_when_nothing_to_overlap_thread_when_compute() -> None:
    main = threading.get_ident()
    # no compute between items: after the first few, the consumer pulls items itself (no thread hand-off)
    src = GuardedSource(60)
    pf = Prefetcher(src, depth=2, inline_below_s=0.05)
    assert list(pf) == [i * 10 for i in range(60)]
    assert pf.stats.inline == src.threads.count(main) and pf.stats.inline >= 30
    # compute between items: once the consumer's pace is known, items are produced ahead on the thread
    src = GuardedSource(16, work=0.002)
    pf = Prefetcher(src, depth=2)
    for _ in pf:
        time.sleep(0.01)
    assert pf.stats.inline == src.threads.count(main) and pf.stats.inline <= 6
    assert src.threads[-8:].count(main) == 0
    # an idle consumer gets its queue refilled (depth items queued and one more pulled), also in inline mode
    src = GuardedSource(40)
    pf = Prefetcher(src, depth=3, inline_below_s=10.0)
    for _ in range(10):
        next(pf)
    assert _wait_until(lambda: src.i == 10 + 3 + 1)
    assert list(pf) == [i * 10 for i in range(10, 40)]


def test_stats_count_items_pulled_inline() -> None:
    """Items the consumer pulled itself count as handed out, produced and inline, each waited for as long as it
    took to make (folded into the stats when they are read, and every few hundred items)."""
    src = GuardedSource(700, work=0.0)
    pf = Prefetcher(src, depth=2, inline_below_s=10.0)  # every item is pulled inline
    t0 = time.perf_counter()
    assert sum(1 for _ in pf) == 700
    elapsed = time.perf_counter() - t0
    st = pf.stats
    main = threading.get_ident()
    # (the thread refills only while the consumer is away for 5 ms: a time slice lost on a busy machine)
    assert st.items == st.produced == 700 and st.inline == src.threads.count(main) >= 600
    assert len(st.recent_wait_s) == 700 and 0 < st.wait_s < elapsed
    assert st.max_wait_s == max(st.recent_wait_s) and st.mean_wait_s == pytest.approx(st.wait_s / 700)
    slow = GuardedSource(5, work=0.002)
    pf = Prefetcher(slow, depth=2, inline_below_s=10.0)
    assert list(pf) == [i * 10 for i in range(5)] and pf.stats.inline == slow.threads.count(main)
    assert pf.stats.wait_s >= 0.002 * pf.stats.inline


def test_inline_below_s_validated() -> None:
    for bad in (-1.0, float("nan"), "0.1"):
        with pytest.raises(ConfigError, match="inline_below_s"):
            Prefetcher(iter([]), inline_below_s=bad)


def _pop_as_consumer(q: PrefetchQueue) -> tuple[bool, object]:
    """One fast pop (as the dataset iterator does it); ``(False, None)``: not allowed now."""
    entry = q.pop()
    return (False, None) if entry is None else (True, entry[2])


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), depth=st.integers(1, 4), plan=st.lists(st.booleans(), min_size=60, max_size=60),
       inline=st.sampled_from([0.0, 2e-4]))
def test_a_consumer_popping_the_queue_itself_gets_every_item_once_in_order(n: int, depth: int, plan: list[bool],
                                                                          inline: float) -> None:
    """Fast pops by the consumer mixed with next(): every item once, in order; both counted as handed out."""
    pf = Prefetcher(CountingSource(n), depth=depth, inline_below_s=inline)
    got: list[int] = []
    own = 0
    k = 0
    while True:
        if plan[k % len(plan)]:
            time.sleep(0.0005)  # away long enough for the thread to queue ahead
            ok, item = _pop_as_consumer(pf.queue)
            if ok:
                got.append(int(item))  # type: ignore[call-overload]
                own += 1
                k += 1
                continue
        k += 1
        try:
            got.append(next(pf))
        except StopIteration:
            break
    assert got == [i * 10 for i in range(n)]
    # the prefetcher's own next() starts with the same fast pop: its pops are counted there too
    assert pf.items_handed_out == n and own <= pf.queue.popped <= n
    assert pf.stats.items == n  # the consumer's own pops are counted, with a zero wait
    assert not pf.queue.fast  # ended: nothing more to pop by the protocol
    pf.close()


def test_a_pop_by_the_protocol_that_empties_the_queue_wakes_the_thread() -> None:
    src = CountingSource(100)
    with Prefetcher(src, depth=1, inline_below_s=0.0) as pf:
        assert _wait_until(lambda: src.i == 2 and pf.queue.parked == "room")  # one queued, one held for room
        ok, item = _pop_as_consumer(pf.queue)
        assert ok and item == 0
        # poked: it queues the item it held and makes the next without waiting for its room check
        assert _wait_until(lambda: src.i == 3, timeout=0.5)
        assert next(pf) == 10 and pf.items_handed_out == 2


def test_close_stops_pops_by_the_protocol() -> None:
    src = CountingSource(100)
    pf = Prefetcher(src, depth=3, inline_below_s=0.0)
    assert _wait_until(lambda: len(pf.queue.items) == 3)
    pf.close()
    assert not pf.queue.fast and not pf.queue.items
    assert _pop_as_consumer(pf.queue) == (False, None)
