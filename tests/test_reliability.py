"""Reliability: faults, bad input and sustained load, with nothing lost and nothing delivered twice (issue 9).

What each group proves:

* **Producer dies mid-put.** A failure injected at every step inside ``Pipeline.put`` (placement, the unit's
  store before and after it took the payload, the bookkeeping, admission's offer), and a producer *thread*
  killed by an asynchronous exception while it is blocked on a full store: nothing half-stored is ever
  admitted or delivered, nothing stays orphaned in a unit, the pipeline's counts agree with the units', the
  same trajectory can be put again, and every accepted trajectory is delivered exactly once.
* **Spill writer killed mid-write.** A producer *process* writing to a :class:`~knitdata.storage.spill.SpillStore`
  (the Ray units' write-through spill) is SIGKILLed in the middle of a write, deterministically (inside
  ``os.writev``) and at a random moment: recovery shows only whole samples, equal to what was put, including
  every put the child saw acknowledged.
* **Consumer dies and restarts from its saved JSON state.** Consumer threads whose dataset is discarded
  mid-iteration (prefetched micro-batches dropped) and rebuilt from the last saved state: every trajectory
  is committed exactly once. A crash *inside* a step (the micro-batch received, the step not finished, the
  state saved before it) re-delivers that micro-batch (the default ``release="step"`` keeps a rank's
  payloads until it starts its next mini-batch).
* **Real processes on the Ray engine** (a local loopback cluster in a subprocess): a consumer process
  SIGKILLed inside a step and restarted from its saved JSON state gets the interrupted micro-batch again and
  everything exactly once; a producer process SIGKILLed between the unit's put and admission leaves nothing
  orphaned (a restarted producer's retry of the same id replaces the dead reservation).
* **Fast producer.** A producer ten times faster than the consumers, with consumer restarts: the store's
  high-water stays within capacity plus one trajectory, RSS growth after warm-up within capacity plus 64 MiB,
  spill on disk within its ``max_bytes``, nothing lost or duplicated.
* **Malformed input (hypothesis).** Bad trajectories mixed with good ones: each bad one is rejected by
  ``put`` with an error naming its id; every good one (with real PNG media) is delivered exactly once.
  Corrupted, truncated or empty media bytes, unknown media kinds and audio without a sample rate are
  refused by ``put`` too (``check_media=True``), naming the trajectory and the item.
"""

from __future__ import annotations

import math
import os
import random
import sys
import threading
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import knitdata.producer as producer_mod
from benchmarks.soak import Ledger, SoakConfig, consume_with_restarts, run_soak
from knitdata.errors import FieldTypeError, MediaError, StoreFull, ValidationError
from knitdata.pipeline import Pipeline
from knitdata.record import MediaItem
from knitdata.storage.spill import SpillStore

sys.path.insert(0, os.path.dirname(__file__))
from _reliability_helpers import (  # noqa: E402
    ProducerKilled,
    assert_store_empty,
    drain,
    held_consistent,
    kill_thread,
    png_bytes,
    run_child,
    spec_for,
    traj,
    wait_until,
)

# ============================================================================ producer dies mid-put


def _wrap_for(victim: str, fn, *, after: bool = False):
    def wrapped(*a, **k):
        target = next((x for x in a if getattr(x, "id", None) == victim or
                       getattr(x, "id", None) is None and x == victim), None)
        if not after and target is not None:
            raise ProducerKilled(f"killed before {fn.__name__}")
        out = fn(*a, **k)
        if after and target is not None:
            raise ProducerKilled(f"killed after {fn.__name__}")
        return out

    return wrapped


def _inject(point: str, pipe: Pipeline, victim: str, monkeypatch) -> None:
    unit = next(iter(pipe.units.values()))
    if point == "placement":
        place_at = pipe.internals.control.state.placement.place_at  # where the plane accounts the unit the producer stored on
        monkeypatch.setattr(pipe.internals.control.state.placement, "place_at",
                            lambda meta, unit: (_ for _ in ()).throw(ProducerKilled("place_at"))
                            if meta.id == victim else place_at(meta, unit))
    elif point == "unit_before_store":
        monkeypatch.setattr(unit, "put", _wrap_for(victim, unit.put))
    elif point == "unit_after_store":
        monkeypatch.setattr(unit, "put", _wrap_for(victim, unit.put, after=True))
    elif point == "bookkeeping":
        real = producer_mod._loss_tokens
        monkeypatch.setattr(producer_mod, "_loss_tokens",
                            lambda t: (_ for _ in ()).throw(ProducerKilled("bookkeeping")) if t.id == victim else real(t))
    elif point == "offer":
        offer = pipe.internals.local_plane().state.policy.offer

        def bad_offer(metas):
            metas = list(metas)
            if any(m.id == victim for m in metas):
                raise ProducerKilled("offer")
            return offer(metas)

        monkeypatch.setattr(pipe.internals.local_plane().state.policy, "offer", bad_offer)
    else:  # pragma: no cover
        raise AssertionError(point)


@pytest.mark.parametrize("point", [
    "placement",
    "unit_before_store",
    "unit_after_store",
    "bookkeeping",
    "offer",
])
@pytest.mark.parametrize("fetch", ["sample", "iter"])
def test_producer_killed_inside_put_leaves_nothing_visible(point, fetch):
    n = 8
    pipe = Pipeline(spec_for(n, num_minibatches=2), num_consumers=2, token_budget=16, put_timeout=5)
    victim = "t3"
    with pytest.MonkeyPatch.context() as mp:
        _inject(point, pipe, victim, mp)
        for i in range(n):
            if f"t{i}" == victim:
                with pytest.raises(ProducerKilled):
                    pipe.put(traj(i))
                # nothing of the victim is visible: not stored, not held, not admitted
                assert not any(u.contains(victim) for u in pipe.units.values())
                held_consistent(pipe)
                assert pipe.stats()["admitted_trajectories"] == 0
            else:
                pipe.put(traj(i))
    # the fault is gone (the producer restarted): the same trajectory can be put again
    pipe.put(traj(3))
    held_consistent(pipe)
    got = drain(pipe, fetch=fetch, timeout=15)
    assert got == Counter(f"t{i}" for i in range(n))  # every accepted one exactly once, the victim once
    assert_store_empty(pipe)
    st_ = pipe.stats()
    assert st_["puts"] == n and st_["admitted_trajectories"] == n and st_["held_trajectories"] == 0


def test_producer_thread_killed_while_blocked_on_full_store():
    """A real thread kill: an async exception lands in a producer waiting inside the unit for room."""
    big = max(traj(i, nbytes=4096).nbytes for i in range(4))
    pipe = Pipeline(spec_for(4, num_minibatches=4), num_consumers=1, capacity_bytes=2 * big,
                    token_budget=16, put_timeout=10)
    pipe.put(traj(0, nbytes=4096))
    pipe.put(traj(1, nbytes=4096))  # full
    died: list[BaseException] = []

    def producer():
        try:
            pipe.put(traj(2, nbytes=4096), timeout=None)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            died.append(e)

    th = threading.Thread(target=producer, daemon=True)
    th.start()
    unit = next(iter(pipe.units.values()))
    wait_until(lambda: len(unit._cond._waiters) > 0, what="the producer to wait inside the unit for room")
    kill_thread(th)
    it = iter(pipe.dataset(0, fetch="sample"))
    # consuming makes room (t0 is released once handed out, or at the latest once t1 is asked for): the
    # blocked producer wakes up and dies inside the unit's wait
    assert [next(it).info.trajectory_ids for _ in range(2)] == [("t0",), ("t1",)]
    th.join(10)
    assert not th.is_alive() and died and isinstance(died[0], ProducerKilled)
    assert not unit.contains("t2")
    held_consistent(pipe)
    assert pipe.stats()["rejected"] == 1
    pipe.put(traj(2, nbytes=4096))  # the restarted producer puts it again
    assert next(it).info.trajectory_ids == ("t2",)
    pipe.put(traj(3, nbytes=4096))
    pipe.close()
    assert [mb.info.trajectory_ids for mb in it] == [("t3",)]
    assert_store_empty(pipe)


# ============================================================================ spill writer SIGKILLed

_CHILD_SPILL = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from _reliability_helpers import traj
from knitdata.storage.spill import SpillStore
d, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = SpillStore(d, max_bytes=1 << 30, shard_maxsize={shard_maxsize})
i = 0
while True:
    if mode == "torn" and i == n:
        real = os.writev
        def torn(fd, bufs):
            bufs = list(bufs)
            real(fd, bufs[: len(bufs) // 2])      # half of the sample reaches the file...
            os.kill(os.getpid(), signal.SIGKILL)  # ...and the process dies inside the write
        os.writev = torn
    store.put(traj(i, nbytes=(i * 7919) % 60000 + 1000))
    print(f"acked t{{i}}", flush=True)
    i += 1
"""


def _spawn_spill_writer(d: str, mode: str, n: int, kill_after: int | None, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    acked: list[str] = []
    target = kill_after if kill_after is not None else -1

    def on_line(line: str, proc) -> None:
        if line.startswith("acked "):
            acked.append(line.split()[1])
            if len(acked) == target:
                # a random moment during the following puts
                threading.Timer(rng.uniform(0.0, 0.02), lambda: proc.kill()).start()

    code = _CHILD_SPILL.format(tests=os.path.dirname(__file__), shard_maxsize=200_000)
    rc, _ = run_child(code, args=[d, mode, str(n)], on_line=on_line, timeout=60)
    assert rc == -9
    return acked


def _check_recovered(d: str, acked: list[str]) -> set[str]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the torn tail is reported as a warning
        store = SpillStore.open(d, verify=True)
    try:
        ids = set(store.ids())
        assert set(acked) <= ids, f"acknowledged puts lost: {sorted(set(acked) - ids)[:5]}"
        nxt = {f"t{len(acked)}"}
        assert ids <= set(acked) | nxt, f"unexpected samples {sorted(ids - set(acked) - nxt)[:5]}"
        for tid in ids:
            i = int(tid[1:])
            assert store.get(tid).equals(traj(i, nbytes=(i * 7919) % 60000 + 1000)), tid
        assert store.used_bytes <= store.max_bytes
        return ids
    finally:
        store.close()


def test_spill_writer_sigkilled_inside_a_write_recovers_only_whole_samples(tmp_path):
    acked = _spawn_spill_writer(str(tmp_path), "torn", 12, None)
    assert acked == [f"t{i}" for i in range(12)]
    ids = _check_recovered(str(tmp_path), acked)
    assert "t12" not in ids  # the torn sample is not visible
    # the store is usable again after recovery: new puts and reads
    store = SpillStore.open(str(tmp_path))
    store.put(traj(100))
    assert store.get("t100").equals(traj(100)) and len(store) == 13
    store.close()


@pytest.mark.parametrize("seed", [1])
def test_spill_writer_sigkilled_at_a_random_moment(tmp_path, seed):
    acked = _spawn_spill_writer(str(tmp_path), "run", 0, kill_after=10 + seed * 7, seed=seed)
    _check_recovered(str(tmp_path), acked)


# ============================================================================ consumer crash and restore


def _finite_run(num_consumers: int, restart_every: list[int], crash_point: str, fetch: str, *,
                n_batches: int = 4, seed: int = 0) -> tuple[Ledger, Pipeline]:
    from knitdata.admission import BatchSpec

    rng = random.Random(seed)
    spec = BatchSpec({"a": 8, "b": 4}, num_minibatches=2, group_size=2)
    pipe = Pipeline(spec, num_consumers=num_consumers, token_budget=12, put_timeout=30)
    ledger = Ledger()
    idx = 0
    trajs = []
    for b in range(n_batches):
        batch = []
        for s, q in (("a", 8), ("b", 4)):
            for g in range(q // 2):
                for _ in range(2):
                    batch.append(traj(idx, s, f"b{b}{s}{g}"))
                    idx += 1
        rng.shuffle(batch)
        trajs += batch

    def produce():
        for t in trajs:
            pipe.put(t)
            ledger.accept(t.id)
        pipe.close()

    errors: list[BaseException] = []

    def guard(fn, *a):
        try:
            fn(*a)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            pipe.close()

    threads = [threading.Thread(target=guard, args=(produce,), daemon=True)]
    for r in range(num_consumers):
        cfg = SoakConfig(restart_every=restart_every[r % len(restart_every)], crash_point=crash_point, fetch=fetch,
                         consume_s=0.0005)
        threads.append(threading.Thread(target=guard, args=(consume_with_restarts, pipe, r, cfg, ledger), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a consumer or the producer hung"
    if errors:
        raise errors[0]
    return ledger, pipe


@pytest.mark.parametrize("fetch", ["sample", "eager", "iter"])
@pytest.mark.parametrize("num_consumers,restart_every", [(1, [1]), (2, [2, 3]), (3, [1, 4, 5])])
def test_consumer_discarded_between_steps_restores_exactly_once(fetch, num_consumers, restart_every):
    ledger, pipe = _finite_run(num_consumers, restart_every, "between_steps", fetch)
    assert ledger.restarts > 0
    assert ledger.lost == 0 and ledger.duplicated == 0 and ledger.unexpected == 0
    assert len(ledger.accepted) == 48
    assert_store_empty(pipe)


@pytest.mark.parametrize("fetch", ["sample", "iter"])
def test_consumer_dies_mid_step_restores_from_saved_state_without_loss(fetch):
    ledger, pipe = _finite_run(2, [3, 4], "mid_step", fetch)
    assert ledger.restarts > 0 and ledger.rolled_back > 0
    assert ledger.lost == 0 and ledger.duplicated == 0
    assert ledger.redelivered == ledger.rolled_back  # re-deliveries after a restore are not duplicates
    assert_store_empty(pipe)


def test_restart_without_saved_state_resumes_from_committed_position():
    """A consumer that lost its state file entirely: a fresh dataset continues from the pipeline's record."""
    pipe = Pipeline(spec_for(6, num_minibatches=3), num_consumers=1, token_budget=9)  # one trajectory (5-9 tokens) each
    for i in range(6):
        pipe.put(traj(i))
    pipe.close()
    ds = pipe.dataset(0, fetch="iter", prefetch_depth=3)
    it = iter(ds)
    first = [next(it).info.trajectory_ids for _ in range(2)]
    del it, ds  # crash: prefetched micro-batches are dropped with the iterator
    rest = [mb.info.trajectory_ids for mb in pipe.dataset(0, fetch="iter")]
    ids = Counter(i for ids in first + rest for i in ids)
    assert set(ids) == {f"t{i}" for i in range(6)}  # nothing lost
    # received twice at most: the micro-batch being trained on at the crash (not yet committed)
    assert {i for i, c in ids.items() if c > 1} <= set(first[-1]) and max(ids.values()) <= 2
    assert_store_empty(pipe)


# ============================================================================ fast producer, bounded memory


def test_fast_producer_keeps_store_and_rss_bounded_and_loses_nothing():
    ticks = []
    cfg = SoakConfig(seconds=3.0, num_consumers=2, traj_bytes=256 * 1024, capacity_trajectories=12,
                     consume_s=0.002, speed_ratio=10.0, restart_every=15, warmup_s=0.8, fetch="iter")
    r = run_soak(cfg, progress=False, on_tick=ticks.append)
    assert not r["errors"], r["errors"]
    assert r["lost"] == 0 and r["duplicated"] == 0 and r["unexpected"] == 0 and r["corrupt"] == 0
    assert r["restarts"] > 0
    assert r["store_high_water_bytes"] <= r["capacity_bytes"] + r["largest_trajectory_bytes"]
    assert all(t["used"] <= r["capacity_bytes"] + r["largest_trajectory_bytes"] for t in ticks)
    assert r["rss_growth_bytes"] <= r["capacity_bytes"] + 64 * 2**20
    # the producer really was faster: it spent time blocked on the full store, and many times the
    # capacity passed through the store (so a leak would have shown in the bounds above)
    assert r["store_put_wait_s"] > 0
    assert r["put"] * r["largest_trajectory_bytes"] > 10 * r["capacity_bytes"]


def test_fast_producer_spill_stays_within_its_disk_bound(tmp_path):
    """A spill store fed ten times faster than it is drained: disk use never passes max_bytes, nothing lost."""
    sample = 20_000
    max_bytes = 10 * (sample + 2048)
    store = SpillStore(tmp_path, max_bytes=max_bytes, shard_maxsize=3 * sample)
    n = 120
    popped: list[str] = []
    queue: list[str] = []
    cond = threading.Condition()
    peaks = {"used": 0, "disk": 0, "full": 0}
    done = threading.Event()

    def disk() -> int:
        return sum(os.path.getsize(os.path.join(tmp_path, f)) for f in os.listdir(tmp_path) if f.endswith(".tar"))

    def producer():
        for i in range(n):
            t = traj(i, nbytes=sample)
            while True:
                try:
                    with cond:
                        store.put(t)
                        queue.append(t.id)
                        peaks["used"] = max(peaks["used"], store.used_bytes)
                        peaks["disk"] = max(peaks["disk"], disk())
                        cond.notify_all()
                    break
                except StoreFull:
                    peaks["full"] += 1
                    with cond:
                        cond.wait(0.05)
        done.set()

    def consumer():
        while True:
            with cond:
                while not queue and not done.is_set():
                    cond.wait(0.05)
                if not queue and done.is_set():
                    return
                tid = queue.pop(0)
            with cond:
                t = store.pop(tid)
                cond.notify_all()
            assert t.equals(traj(int(tid[1:]), nbytes=sample))
            popped.append(tid)
            threading.Event().wait(0.002)  # the slow trainer

    ths = [threading.Thread(target=producer, daemon=True), threading.Thread(target=consumer, daemon=True)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
        assert not t.is_alive()
    assert popped == [f"t{i}" for i in range(n)]
    assert peaks["full"] > 0  # the bound was hit: the producer had to wait
    assert peaks["used"] <= max_bytes and peaks["disk"] <= max_bytes
    assert len(store) == 0
    store.close()


# ============================================================================ malformed input (hypothesis)

_PNG = png_bytes(1)


def _bad(kind: str, i: int):
    """A trajectory made bad *after* construction (what a buggy producer hands to put)."""
    t = traj(i, image=_PNG)
    if kind == "float_prompt":
        t.prompt_ids = t.prompt_ids.float()
    elif kind == "2d_response":
        t.response_ids = t.response_ids[None, :]
    elif kind == "empty_response":
        t.response_ids = torch.empty(0, dtype=torch.int64)
    elif kind == "mask_length":
        t.loss_mask = torch.ones(t.response_ids.numel() + 2)
    elif kind == "nan_mask":
        t.loss_mask = torch.full((t.response_ids.numel(),), math.nan)
    elif kind == "nan_reward":
        t.scalars = {"reward": math.nan}
    elif kind == "inf_reward":
        t.scalars = {"reward": -math.inf}
    elif kind == "bool_reward":
        t.scalars = {"reward": True}
    elif kind == "str_reward":
        t.scalars = {"reward": "1.0"}
    elif kind == "token_versions_length":
        t.token_versions = torch.zeros(t.response_ids.numel() + 1, dtype=torch.int64)
    elif kind == "negative_version":
        t.gen_version = -1
    elif kind == "nan_tensor":
        t.tensors = {"logp": torch.tensor([0.0, math.inf])}
    elif kind == "list_tensor":
        t.tensors = {"logp": [0.0, 1.0]}
    elif kind == "media_not_item":
        t.media = [_PNG]
    elif kind == "unknown_source":
        t.source = "nope"
    elif kind == "complex_mask":
        t.loss_mask = torch.ones(t.response_ids.numel(), dtype=torch.complex64)
    else:  # pragma: no cover
        raise AssertionError(kind)
    return t


_BAD_KINDS = ["float_prompt", "2d_response", "empty_response", "mask_length", "nan_mask", "nan_reward", "inf_reward",
              "bool_reward", "str_reward", "token_versions_length", "negative_version", "nan_tensor", "list_tensor",
              "media_not_item", "unknown_source", "complex_mask"]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    good=st.integers(1, 4).map(lambda k: 2 * k),
    bad=st.lists(st.sampled_from(_BAD_KINDS), min_size=1, max_size=8),
    seed=st.integers(0, 1000),
    fetch=st.sampled_from(["sample", "eager", "iter"]),
    consumers=st.integers(1, 2),
)
def test_malformed_trajectories_rejected_by_id_good_ones_delivered_once(good, bad, seed, fetch, consumers):
    from knitdata.media.multimodal import MultimodalCollator

    rng = random.Random(seed)
    items = [("good", i) for i in range(good)] + [(k, 1000 + j) for j, k in enumerate(bad)]
    rng.shuffle(items)
    pipe = Pipeline(spec_for(good, num_minibatches=2), num_consumers=consumers, token_budget=16, put_timeout=5)
    for kind, i in items:
        if kind == "good":
            pipe.put(traj(i, image=png_bytes(i)))
            continue
        t = _bad(kind, i)
        with pytest.raises((ValidationError, FieldTypeError)) as ei:
            pipe.put(t)
        assert ei.value.trajectory_id == t.id and repr(t.id) in str(ei.value), (kind, str(ei.value))
        assert not any(u.contains(t.id) for u in pipe.units.values())
    got = drain(pipe, fetch=fetch, media_collator=MultimodalCollator(), timeout=20)
    assert got == Counter(f"t{i}" for i in range(good))
    assert_store_empty(pipe)


def _bad_media(kind: str, i: int):
    t = traj(i, image=_PNG)
    if kind == "corrupted_png":
        data = bytearray(_PNG)
        data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)
        t.media = [MediaItem("image", data=bytes(data))]
    elif kind == "truncated_png":
        t.media = [MediaItem("image", data=_PNG[: len(_PNG) // 3])]
    elif kind == "not_an_image":
        t.media = [MediaItem("image", data=b"this is not an image at all")]
    elif kind == "empty_bytes":
        t.media = [MediaItem("image", data=b"")]
    elif kind == "unknown_kind":
        item = MediaItem("image", data=_PNG)
        object.__setattr__(item, "kind", "hologram")  # a producer bypassing MediaItem's own check
        t.media = [item]
    elif kind == "audio_without_rate":
        t.media = [MediaItem("audio", tensor=torch.zeros(100))]
    return t


@pytest.mark.parametrize("kind", ["corrupted_png", "truncated_png", "not_an_image", "empty_bytes", "unknown_kind",
                                  "audio_without_rate"])
def test_malformed_media_rejected_at_put_by_id(kind):
    pipe = Pipeline(spec_for(2), num_consumers=1, token_budget=64)
    pipe.put(traj(0, image=_PNG))
    bad = _bad_media(kind, 1000)
    with pytest.raises((MediaError, ValidationError, FieldTypeError)) as ei:
        pipe.put(bad)
    assert ei.value.trajectory_id == bad.id
    pipe.put(traj(1, image=_PNG))
    from knitdata.media.multimodal import MultimodalCollator

    assert drain(pipe, media_collator=MultimodalCollator()) == Counter({"t0": 1, "t1": 1})


@pytest.mark.parametrize("kind", ["corrupted_png", "truncated_png", "not_an_image", "empty_bytes",
                                  "audio_without_rate"])
def test_media_processor_names_the_trajectory_of_bad_media(kind):
    """What a put-time check would call today: the error names the trajectory and the item."""
    from knitdata.media.process import MediaProcessor

    bad = _bad_media(kind, 1000)
    with pytest.raises(MediaError) as ei:
        MediaProcessor().process(bad.media[0], trajectory_id=bad.id, index=0)
    assert ei.value.trajectory_id == bad.id and ei.value.item == 0 and "'t1000'" in str(ei.value)


# ============================================================================ real processes on the Ray engine

_RAY_CHILD = """
import json, os, signal, sys, time
sys.path.insert(0, {tests!r})
from _reliability_helpers import spec_for, traj
from knitdata import Pipeline

addr, name, cmd = sys.argv[1], sys.argv[2], sys.argv[3]
rest = sys.argv[4:]
if cmd == "produce":  # [create] start stop victim close
    create, start, stop, victim, close = rest[0] == "1", int(rest[1]), int(rest[2]), int(rest[3]), rest[4] == "1"
    if create:
        client = Pipeline(spec_for(8, num_minibatches=2), num_consumers=1, token_budget=16, engine="ray",
                          put_timeout=30, engine_options={{"name": name, "address": addr, "detached": True}})
    else:
        client = Pipeline.attach(name, address=addr)
    import ray
    from knitdata.errors import ValidationError

    real_get = ray.get
    in_victim = [False]

    def get(*a, **kw):
        if in_victim[0]:  # the put's request is on its way to the storage unit: die before the answer
            os.kill(os.getpid(), signal.SIGKILL)
        return real_get(*a, **kw)

    ray.get = get
    for i in range(start, stop):
        in_victim[0] = i == victim
        try:
            client.put(traj(i))
        except ValidationError as e:  # a restarted producer: the put its predecessor died in was accepted
            if e.field != "id" or i != start:
                raise
            print(f"already accepted t{{i}}", flush=True)
        print(f"acked t{{i}}", flush=True)
    if close:
        client.close()
elif cmd == "consume":  # state_path step_s
    state_path, step_s = rest[0], float(rest[1])
    ds = Pipeline.attach(name, address=addr).dataset(0, fetch="iter")
    if os.path.exists(state_path):
        with open(state_path) as f:
            ds.load_state_dict(json.load(f))
    for mb in ds:
        print("received " + ",".join(mb.info.trajectory_ids), flush=True)
        time.sleep(step_s)  # the training step (the parent kills the process in here)
        state = ds.state_dict()
        with open(state_path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(state_path + ".tmp", state_path)  # the checkpoint, atomically
        ds.commit(state)
        print("committed " + ",".join(mb.info.trajectory_ids), flush=True)
    st = Pipeline.attach(name, address=addr).stats()
    print("stats " + json.dumps({{"held": st.get("held_trajectories"),
                                  "units": {{u: v.get("used_bytes") for u, v in st.get("units", {{}}).items()}}}}),
          flush=True)
"""


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray")
    from _ray_helpers import ClusterProcess

    with ClusterProcess(nodes=1, cpus=4, store_mb=128, timeout_s=150) as c:
        assert c.info["ips"] == ["127.0.0.1"]
        yield c


def _ray_child(cluster, name: str, *args: str, on_line=None, timeout: float = 120.0) -> tuple[int, list[str]]:
    env_keys = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    old = {k: os.environ.get(k) for k in env_keys}
    os.environ.update(env_keys)
    try:
        code = _RAY_CHILD.format(tests=os.path.dirname(__file__))
        return run_child(code, args=[cluster.address, name, *args], on_line=on_line, timeout=timeout)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.ray
@pytest.mark.slow
def test_ray_consumer_process_sigkilled_mid_step_restores_exactly_once(ray_cluster, tmp_path):
    name = "rel_consumer"
    rc, lines = _ray_child(ray_cluster, name, "produce", "1", "0", "16", "-1", "1")
    assert rc == 0 and len([x for x in lines if x.startswith("acked")]) == 16
    state = str(tmp_path / "state.json")
    seen = {"committed": 0}

    def kill_mid_step(line, proc):
        if line.startswith("committed"):
            seen["committed"] += 1
        elif line.startswith("received") and seen["committed"] >= 3:
            proc.kill()  # SIGKILL while it trains on a micro-batch it received after its last checkpoint

    rc1, first = _ray_child(ray_cluster, name, "consume", state, "0.5", on_line=kill_mid_step)
    assert rc1 == -9
    rc2, second = _ray_child(ray_cluster, name, "consume", state, "0")
    assert rc2 == 0
    committed = Counter(i for ln in first + second if ln.startswith("committed ") for i in ln.split()[1].split(","))
    assert committed == Counter(f"t{i}" for i in range(16))  # nothing lost, nothing twice
    last = max(i for i, ln in enumerate(first) if ln.startswith("committed"))
    in_flight = [ln.split()[1].split(",") for ln in first[last + 1 :] if ln.startswith("received")]
    if in_flight:  # killed inside its step: that micro-batch comes again first after the restore
        assert [ln.split()[1] for ln in second if ln.startswith("received")][0].split(",") == in_flight[0]
    stats = next(ln for ln in second if ln.startswith("stats "))
    import json

    st_ = json.loads(stats[6:])
    assert st_["held"] == 0 and all(v == 0 for v in st_["units"].values()), st_


@pytest.mark.ray
@pytest.mark.slow
def test_ray_producer_process_sigkilled_mid_put_leaves_nothing_orphaned(ray_cluster, tmp_path):
    """A put is one request to the storage unit, which stores and admits: a producer SIGKILLed while that
    request is in flight leaves either nothing or an accepted trajectory (its restart then gets a duplicate-id
    error for it), never an orphaned payload; consumers get every trajectory exactly once."""
    name = "rel_producer"
    rc, lines = _ray_child(ray_cluster, name, "produce", "1", "0", "8", "5", "0")
    assert rc == -9 and lines[-1] == "acked t4"  # killed inside put(t5)
    rc, lines = _ray_child(ray_cluster, name, "produce", "0", "5", "8", "-1", "1")  # the restarted producer
    assert rc == 0, lines
    rc, out = _ray_child(ray_cluster, name, "consume", str(tmp_path / "s.json"), "0")
    committed = Counter(i for ln in out if ln.startswith("committed ") for i in ln.split()[1].split(","))
    assert committed == Counter(f"t{i}" for i in range(8))
    import json

    st_ = json.loads(next(ln for ln in out if ln.startswith("stats "))[6:])
    assert st_["held"] == 0 and all(v == 0 for v in st_["units"].values()), st_
