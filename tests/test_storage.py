"""Embedded storage unit: capacity, blocking puts, StoreFull, no copies, release, stats, thread safety."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.engines.embedded.unit import EmbeddedStorageUnit
from knitdata.errors import ConfigError, EngineError, StoreFull, TrajectoryLostError, ValidationError
from knitdata.storage.base import StorageUnit

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
    from knitdata.storage.spill import SpillStore

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
    from knitdata.storage.spill import SpillStore

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


# ------------------------------------------------------------------------------------ media stored once (issue 43)
def _media_group(n: int, *, refs: bool, side: int = 32, first: int = 0):
    """``n`` members of one group sharing an image: the first carries it, the others content copies or refs."""
    import torch

    from knitdata.record import MediaItem, Trajectory

    g = torch.Generator().manual_seed(first)
    img = MediaItem("image", tensor=torch.randint(0, 256, (3, side, side), generator=g, dtype=torch.uint8))
    out = []
    for k in range(n):
        item = img if k == 0 else (MediaItem.ref("image", img.digest) if refs else
                                   MediaItem("image", tensor=img.tensor.clone()))
        out.append(Trajectory(id=f"m{first + k}", source="s", group=f"g{first}", prompt_ids=torch.arange(4),
                              response_ids=torch.arange(4), media=[item]))
    return img, out


def test_media_stored_once_per_group_and_freed_with_the_last_member():
    img, group = _media_group(8, refs=True)
    _img2, copies = _media_group(8, refs=False, first=100)
    u = EmbeddedStorageUnit("n0", 1 << 20)
    own = group[0].nbytes - img.nbytes
    assert u.put(group[0]) == own + img.nbytes
    assert [u.put(t) for t in group[1:]] == [own] * 7  # a reference costs its own tensors only
    for t in copies:  # content copies of one image: held once too
        u.put(t)
    s = u.stats()
    assert s.used_bytes == 16 * own + 2 * img.nbytes and (s.media_items, s.media_refs) == (2, 16)
    assert s.media_bytes == 2 * img.nbytes and s.media_bytes_saved == 14 * img.nbytes
    got = u.get([t.id for t in group + copies])
    assert len({id(t.media[0]) for t in got[:8]}) == 1 and got[0].media[0] is img
    assert len({id(t.media[0]) for t in got[8:]}) == 1
    assert copies[3].media[0] is not got[11].media[0]  # the producer's object keeps its own item
    assert not any(m.reference for t in got for m in t.media)
    assert u.stats().bytes_fetched == 16 * own + 2 * img.nbytes  # each distinct item once per request
    assert u.media_check()["ok"]
    assert u.release([t.id for t in group[:7]]) == 7 * own  # the image stays: m7 refers to it
    assert u.media is not None and u.media.refs(img.digest) == 1 and u.media_check()["ok"]
    assert u.release([group[7].id]) == own + img.nbytes
    u.release([t.id for t in copies])
    s = u.stats()
    assert (s.used_bytes, s.media_items, s.media_refs, s.media_bytes) == (0, 0, 0, 0)


def test_media_dedup_off_keeps_per_trajectory_copies_and_refuses_references():
    from knitdata.errors import MediaRefError

    img, copies = _media_group(8, refs=False)
    u = EmbeddedStorageUnit("n0", 1 << 20, media_dedup=False)
    assert [u.put(t) for t in copies] == [t.nbytes for t in copies]
    s = u.stats()
    assert s.used_bytes == sum(t.nbytes for t in copies) and (s.media_items, s.media_refs) == (0, 0)
    _img, refs = _media_group(2, refs=True, first=50)
    with pytest.raises(MediaRefError, match="media_dedup=False") as ei:
        u.put(refs[1])
    assert ei.value.trajectory_id == "m51" and ei.value.digest == refs[1].media[0].digest
    assert not u.contains("m51") and u.media is None and not u.media_dedup


def test_unresolved_reference_refused_whole_put_admit_batch():
    from knitdata.errors import MediaRefError
    from knitdata.record import MediaItem

    img, group = _media_group(4, refs=True)
    u = EmbeddedStorageUnit("n0", 1 << 20)
    u.put(group[0])
    before = u.stats()
    group[2].media = [MediaItem.ref("image", "a" * 32)]
    calls = []
    with pytest.raises(MediaRefError) as ei:
        u.put_admit(group[1:], [[{}, 1, "x"]] * 3, lambda unit, items: calls.append(items))
    assert (ei.value.trajectory_id, ei.value.field, ei.value.digest) == ("m2", "media.0", "a" * 32)
    assert not calls and not u.contains("m1") and not u.contains("m3")  # nothing of the batch kept
    after = u.stats()
    assert (after.used_bytes, after.media_refs, after.media_items) == (before.used_bytes, 1, 1)
    assert u.contains("m0") and u.media_check()["ok"]  # what was accepted before stays


def test_reference_fits_where_a_copy_would_not():
    img, group = _media_group(3, refs=True)
    own = group[0].nbytes - img.nbytes
    u = EmbeddedStorageUnit("n0", group[0].nbytes + 2 * own)
    for t in group:
        u.put(t, timeout=0)
    _i, copies = _media_group(2, refs=False, first=7)
    with pytest.raises(StoreFull):
        u.put(copies[0], timeout=0)  # a new image does not fit
    assert u.stats().used_bytes == group[0].nbytes + 2 * own


def test_reference_resolved_from_another_unit_counted_on_both():
    img, group = _media_group(2, refs=True)
    a = EmbeddedStorageUnit("a", 1 << 20)
    b = EmbeddedStorageUnit("b", 1 << 20, resolve=a.media_item)
    a.put(group[0])
    own = group[1].nbytes
    assert b.put(group[1]) == own + img.nbytes  # copied in: counted on b too
    assert b.get([group[1].id])[0].media[0] is img  # in one process the copy is the same object
    assert b.stats().media_copied_in == 1 and b.stats().media_resolved == 1
    assert a.release([group[0].id]) == group[0].nbytes  # freed on a; b still holds its copy
    assert b.media is not None and b.media.holds(img.digest)
    assert b.release([group[1].id]) == own + img.nbytes and b.stats().used_bytes == 0


def test_spilled_trajectories_keep_their_media_in_memory(tmp_path):
    from knitdata.storage.spill import SpillStore

    img, group = _media_group(6, refs=True, side=16)
    own = group[1].nbytes
    spill = SpillStore(str(tmp_path / "sp"), max_bytes=1 << 20)
    u = EmbeddedStorageUnit("n0", group[0].nbytes + own, spill=spill)  # m0 and m1 in memory, the rest spilled
    for t in group:
        u.put(t, timeout=0)
    s = u.stats()
    assert (s.num_items, s.spilled_items, s.spilled_bytes) == (2, 4, 4 * own)
    assert s.used_bytes == group[0].nbytes + own and (s.media_items, s.media_refs) == (1, 6)
    assert u.media_check()["ok"]
    assert spill.get("m2").media[0].is_reference  # the spill record refers to the image, without its bytes
    got = u.get([t.id for t in group])
    assert all(t.media[0] is img for t in got)  # read back: the held item, one object
    assert u.release(["m0"]) == group[0].nbytes - img.nbytes  # the spilled ones still refer to it
    assert u.media is not None and u.media.refs(img.digest) == 5 and u.media_check()["ok"]
    u.release([t.id for t in group[1:]])
    s = u.stats()
    assert (s.used_bytes, s.media_items, s.media_refs, s.spilled_items) == (0, 0, 0, 0)


_POOL_SIDES = (2, 3, 4, 5)


@settings(max_examples=40, deadline=None)
@given(cap=st.integers(200, 1200),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 300), st.lists(st.tuples(st.integers(0, 3), st.booleans()),
                                                                             max_size=3)), max_size=40))
def test_media_capacity_and_counts_random_ops(cap, ops):
    """With media stored once: used = own bytes held + each distinct digest held once; high-water <= max(capacity,
    largest accounted put); StoreFull exactly when it does not fit; an unheld reference refused, nothing stored."""
    import torch

    from knitdata.errors import MediaRefError
    from knitdata.record import MediaItem

    pool = [MediaItem("image", tensor=torch.full((3, s, s), s, dtype=torch.uint8)) for s in _POOL_SIDES]
    u = EmbeddedStorageUnit("n0", cap)
    own: dict[str, int] = {}
    uses: dict[str, list[int]] = {}
    largest = 0
    for i, (is_put, size, media) in enumerate(ops):
        if is_put or not own:
            t = make_traj(i, "s", "g", extra_bytes=size)
            t.media = [MediaItem.ref("image", pool[k].digest) if ref else pool[k] for k, ref in media]
            held = {k for v in uses.values() for k in v}
            brought: set[int] = set()
            ok_ref = True
            for k, ref in media:
                ok_ref = ok_ref and (not ref or k in held or k in brought)
                brought.add(k)
            need = t.nbytes - sum(m.nbytes for m in t.media) + sum(pool[k].nbytes for k in brought - held)
            used = sum(own.values()) + sum(pool[k].nbytes for k in held)
            fits = used + need <= cap or used == 0
            try:
                assert u.put(t, timeout=0) == need
                assert ok_ref and fits
                own[t.id] = t.nbytes - sum(m.nbytes for m in t.media)
                uses[t.id] = [k for k, _r in media]
                largest = max(largest, need)
            except MediaRefError:
                assert not ok_ref
            except StoreFull:
                assert ok_ref and not fits
        else:
            victim = sorted(own)[size % len(own)]
            before = {k for v in uses.values() for k in v}
            gone_own = own.pop(victim)
            uses.pop(victim)
            after = {k for v in uses.values() for k in v}
            assert u.release([victim]) == gone_own + sum(pool[k].nbytes for k in before - after)
        held = {k for v in uses.values() for k in v}
        s = u.stats()
        assert s.used_bytes == sum(own.values()) + sum(pool[k].nbytes for k in held)
        assert s.media_items == len(held) and s.media_refs == sum(len(v) for v in uses.values())
        assert s.high_water_bytes <= max(cap, largest) and u.media_check()["ok"]


def test_units_resolving_from_each_other_concurrently_do_not_deadlock():
    """Each unit resolves references from the other while holding its own lock: the tables' locks are leaves."""
    import torch

    from knitdata.record import MediaItem, Trajectory

    a = EmbeddedStorageUnit("a", 1 << 24)
    b = EmbeddedStorageUnit("b", 1 << 24, resolve=a.media_item)
    a.resolve = b.media_item
    items = [MediaItem("image", tensor=torch.full((3, 4, 4), k, dtype=torch.uint8)) for k in range(8)]

    def traj(tid: str, media: list) -> Trajectory:
        return Trajectory(id=tid, source="s", group=tid, prompt_ids=torch.arange(2), response_ids=torch.arange(2),
                          media=media)

    a.put(traj("a-seed", items[:4]))
    b.put(traj("b-seed", items[4:]))
    errs: list[BaseException] = []

    def work(unit: EmbeddedStorageUnit, tag: str) -> None:
        try:
            for k in range(300):
                tid = f"{tag}{k}"
                unit.put(traj(tid, [MediaItem.ref("image", items[(k + j) % 8].digest) for j in range(3)]))
                if k % 2:
                    unit.release([tid])
        except BaseException as e:  # noqa: BLE001 - reported below
            errs.append(e)

    threads = [threading.Thread(target=work, args=(u, f"{u.unit_id}-{n}-"), daemon=True)
               for u in (a, b) for n in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "deadlock"
    assert not errs, errs
    assert a.media_check()["ok"] and b.media_check()["ok"]
    assert a.stats().media_refs == 4 + 2 * 150 * 3 and b.stats().media_copied_in >= 4  # (again after a free)
