"""Embedded storage unit: capacity, blocking puts, StoreFull, no copies, release, stats, thread safety."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.errors import ConfigError, EngineError, StoreFull, TrajectoryLostError, ValidationError
from knitdata.storage.base import StorageUnit
from knitdata.storage.embedded import EmbeddedStorageUnit

sys.path.insert(0, os.path.dirname(__file__))
from _ondemand_helpers import make_traj  # noqa: E402


def test_is_a_storage_unit_and_stats_to_dict():
    u = EmbeddedStorageUnit("n0", 1000)
    assert isinstance(u, StorageUnit) and u.node == "n0"
    d = u.stats().to_dict()
    assert d["capacity_bytes"] == 1000 and d["used_bytes"] == 0
    with pytest.raises(ConfigError):
        EmbeddedStorageUnit("n0", 0)


def test_put_get_no_copy_release_and_stats():
    u = EmbeddedStorageUnit("n0", 10_000)
    a, b = make_traj(0, "s", "g"), make_traj(1, "s", "g")
    assert u.put(a) == a.nbytes
    u.put(b)
    got = u.get(["t1", "t0"])
    assert got[0] is b and got[1] is a  # the same objects: no copy
    assert u.get_records(["t0"])[0][:4]  # codec record form for cross-process units
    s = u.stats()
    assert (s.used_bytes, s.num_items, s.puts, s.gets, s.get_requests) == (a.nbytes + b.nbytes, 2, 2, 3, 2)
    assert s.bytes_fetched == 2 * a.nbytes + b.nbytes
    assert u.release(["t0", "t0", "nope"]) == a.nbytes  # idempotent
    assert not u.contains("t0") and u.contains("t1")
    with pytest.raises(TrajectoryLostError) as ei:
        u.get(["t0"])
    assert ei.value.trajectory_ids == ["t0"]
    with pytest.raises(ValidationError):
        u.put(b)


def test_full_store_timeout_zero_raises_at_once():
    t0 = make_traj(0, "s", "g")
    u = EmbeddedStorageUnit("n0", t0.nbytes)
    u.put(t0)
    start = time.perf_counter()
    with pytest.raises(StoreFull, match="capacity_bytes"):
        u.put(make_traj(1, "s", "g"), timeout=0)
    assert time.perf_counter() - start < 0.5
    assert u.stats().rejected_puts == 1 and not u.contains("t1")


def test_full_store_blocks_until_release():
    t0 = make_traj(0, "s", "g")
    u = EmbeddedStorageUnit("n0", t0.nbytes)
    u.put(t0)
    done = threading.Event()
    th = threading.Thread(target=lambda: (u.put(make_traj(1, "s", "g"), timeout=10), done.set()))
    th.start()
    assert not done.wait(0.1)  # blocked
    u.release(["t0"])
    assert done.wait(5)
    assert u.contains("t1") and u.stats().put_wait_s > 0


def test_close_wakes_blocked_producers():
    t0 = make_traj(0, "s", "g")
    u = EmbeddedStorageUnit("n0", t0.nbytes)
    u.put(t0)
    errs = []
    th = threading.Thread(target=lambda: _catch(errs, lambda: u.put(make_traj(1, "s", "g"), timeout=30)))
    th.start()
    time.sleep(0.05)
    u.close()
    th.join(5)
    assert errs and isinstance(errs[0], EngineError)
    assert u.get(["t0"])[0] is t0  # held payloads stay readable


def _catch(errs, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        errs.append(e)


def test_oversized_trajectory_fits_only_an_empty_unit():
    big = make_traj(0, "s", "g", extra_bytes=500)
    small = make_traj(1, "s", "g")
    u = EmbeddedStorageUnit("n0", 200)
    u.put(big, timeout=0)  # empty unit: accepted although larger than the capacity
    with pytest.raises(StoreFull):
        u.put(small, timeout=0)
    u.release(["t0"])
    u.put(small, timeout=0)
    assert u.stats().high_water_bytes == big.nbytes <= 200 + big.nbytes


@settings(max_examples=40, deadline=None)
@given(cap=st.integers(50, 400), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 300)), max_size=40))
def test_capacity_invariants_random_ops(cap, ops):
    """used = sum held; high-water <= max(capacity, largest trajectory); StoreFull exactly when it does not fit."""
    u = EmbeddedStorageUnit("n0", cap)
    held: dict[str, int] = {}
    largest = 0
    for i, (is_put, size) in enumerate(ops):
        if is_put or not held:
            t = make_traj(i, "s", "g", extra_bytes=size)
            fits = sum(held.values()) + t.nbytes <= cap or not held
            try:
                u.put(t, timeout=0)
                assert fits
                held[t.id] = t.nbytes
                largest = max(largest, t.nbytes)
            except StoreFull:
                assert not fits
        else:
            victim = sorted(held)[size % len(held)]
            assert u.release([victim]) == held.pop(victim)
        s = u.stats()
        assert s.used_bytes == sum(held.values()) and s.num_items == len(held)
        assert s.high_water_bytes <= max(cap, largest)


def test_concurrent_producers_and_consumer_lose_nothing():
    size = make_traj(0, "s", "g").nbytes
    u = EmbeddedStorageUnit("n0", 4 * size)
    n = 200
    seen: list[str] = []

    def produce(start):
        for i in range(start, n, 4):
            u.put(make_traj(i, "s", "g"), timeout=10)

    def consume():
        while len(seen) < n:
            ids = [f"t{i}" for i in range(n) if f"t{i}" not in seen and u.contains(f"t{i}")]
            for t in u.get(ids):
                seen.append(t.id)
            u.release(ids)
            time.sleep(0.0005)

    ths = [threading.Thread(target=produce, args=(k,)) for k in range(4)] + [threading.Thread(target=consume)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    assert sorted(seen) == sorted(f"t{i}" for i in range(n))
    s = u.stats()
    assert s.high_water_bytes <= 4 * size and s.used_bytes == 0 and s.puts == s.releases == n


def test_spill_takes_what_does_not_fit_and_reads_it_back(tmp_path):
    from knitdata.spill import SpillStore

    one = make_traj(0, "s", "g", extra_bytes=64).nbytes
    u = EmbeddedStorageUnit("n0", 2 * one, spill=SpillStore(tmp_path / "n0", max_bytes=1 << 20))
    trajs = [make_traj(i, "s", "g", extra_bytes=64) for i in range(6)]
    for t in trajs:
        u.put(t, timeout=0)  # never blocks while the disk has room
    s = u.stats()
    assert (s.used_bytes, s.num_items, s.spilled_items, s.spill_puts) == (2 * one, 2, 4, 4)
    assert s.high_water_bytes <= 2 * one  # the memory bound is unchanged
    got = u.get([t.id for t in trajs])
    assert got[0] is trajs[0] and all(g.equals(t) for g, t in zip(got, trajs))
    assert u.stats().spill_gets == 4 and len(u) == 6
    assert u.release([t.id for t in trajs]) == 2 * one
    s = u.stats()
    assert (s.used_bytes, s.spilled_items, s.spilled_bytes, s.releases) == (0, 0, 0, 6)
    assert not any(p.suffix == ".tar" for p in (tmp_path / "n0").iterdir())  # released shards are deleted


def test_spill_full_falls_back_to_waiting(tmp_path):
    from knitdata.spill import SpillStore

    one = make_traj(0, "s", "g", extra_bytes=4000).nbytes
    probe = SpillStore(tmp_path / "probe", max_bytes=1 << 20)
    probe.put(make_traj(9, "s", "g", extra_bytes=4000))
    on_disk = probe.used_bytes  # tar headers included
    u = EmbeddedStorageUnit("n0", one, spill=SpillStore(tmp_path / "n0", max_bytes=on_disk + on_disk // 2))
    u.put(make_traj(0, "s", "g", extra_bytes=4000), timeout=0)
    u.put(make_traj(1, "s", "g", extra_bytes=4000), timeout=0)  # spilled
    with pytest.raises(StoreFull):
        u.put(make_traj(2, "s", "g", extra_bytes=4000), timeout=0)  # memory and disk full
    assert not u.contains("t2") and u.stats().rejected_puts == 1
