"""Pipeline: exactly-once delivery to 1-8 consumer threads, validation, withdraw, versions, engines."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knitdata.admission import BatchSpec
from knitdata.errors import (
    ConfigError,
    EngineError,
    FieldTypeError,
    OptionalDependencyError,
    QuotaInfeasibleError,
    StoreFull,
    ValidationError,
)
from knitdata.pipeline import Pipeline, PipelineClosedError
from knitdata.placement import ConsumerLayout

sys.path.insert(0, os.path.dirname(__file__))
from _ondemand_helpers import make_traj, make_workload, run_consumers  # noqa: E402


def _layout(num_consumers: int, num_nodes: int) -> ConsumerLayout:
    return ConsumerLayout([f"n{r * num_nodes // num_consumers}" for r in range(num_consumers)])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    num_consumers=st.integers(1, 8),
    num_nodes=st.integers(1, 3),
    num_sources=st.integers(1, 3),
    group_size=st.sampled_from([1, 2, 4]),
    num_minibatches=st.integers(1, 3),
    groups=st.integers(1, 3),
    train_batches=st.integers(1, 2),
    token_budget=st.sampled_from([8, 20, 64]),
    fetch=st.sampled_from(["sample", "eager", "iter"]),
    placement=st.sampled_from(["consumer_aware", "index_mod"]),
    split=st.booleans(),
    producers=st.integers(1, 3),
)
def test_exactly_once_random_workloads(seed, num_consumers, num_nodes, num_sources, group_size, num_minibatches,
                                       groups, train_batches, token_budget, fetch, placement, split, producers):
    rng = random.Random(seed)
    w = make_workload(rng, num_sources=num_sources, group_size=group_size, num_minibatches=num_minibatches,
                      groups_per_minibatch_per_source=groups, train_batches=train_batches)
    plans = []
    pipe = Pipeline(w.spec, layout=_layout(num_consumers, min(num_nodes, num_consumers)), token_budget=token_budget,
                    placement=placement, allow_split_groups=split, on_plan=lambda a, p: plans.append((a, p)))

    def produce() -> None:
        chunks = [w.trajs[i::producers] for i in range(producers)]
        ts = [threading.Thread(target=lambda c=c: [pipe.put(t) for t in c]) for c in chunks]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    got = run_consumers(pipe, fetch=fetch, producer=produce)
    assert not got.errors, got.errors
    assert got.rows_ok
    all_ids = {t.id for t in w.trajs}
    admitted = [m.id for a, _ in plans for m in a.trajectories]
    assert Counter(admitted) == Counter(all_ids)  # the workload fills whole train batches
    delivered = [i for rank in got.by_rank.values() for key in rank for i in key[4]]
    assert Counter(delivered) == Counter(all_ids)  # exactly once
    for r in range(num_consumers):  # in its planned micro-batch, in plan order, same K everywhere
        expected = [(r, p.minibatch, i, p.num_microbatches, mb.trajectory_ids)
                    for _, p in plans for i, mb in enumerate(p.microbatches[r])]
        assert got.by_rank[r] == expected
    stats = json.loads(json.dumps(pipe.stats()))  # JSON-serializable
    assert stats["held_trajectories"] == 0
    assert all(u["used_bytes"] == 0 and u["releases"] == u["puts"] for u in stats["units"].values())


def test_consumers_block_until_admitted_then_end_on_close():
    spec = BatchSpec({"a": 4}, num_minibatches=2)
    pipe = Pipeline(spec, num_consumers=2, token_budget=64)
    out = []
    t = threading.Thread(target=lambda: out.extend(pipe.dataset(0, fetch="iter")))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not out  # nothing admitted yet: blocks
    for i in range(2):
        pipe.put(make_traj(i, "a", f"g{i}"))
    pipe.close()
    t.join(10)
    assert not t.is_alive()
    assert [mb.info.minibatch for mb in out] == [0]  # one mini-batch (2 of 4); the second never filled


def test_put_validation_names_trajectory_and_field_and_loses_nothing():
    spec = BatchSpec({"a": 2}, num_minibatches=1)
    pipe = Pipeline(spec, num_consumers=1)
    good = make_traj(0, "a", "g0")
    pipe.put(good)
    bad = make_traj(1, "a", "g1")
    bad.gen_version = -3
    with pytest.raises(ValidationError) as ei:
        pipe.put(bad)
    assert ei.value.trajectory_id == "t1" and ei.value.field == "gen_version"
    with pytest.raises(ValidationError) as ei:
        pipe.put(make_traj(2, "zzz", "g2"))
    assert ei.value.field == "source" and "zzz" in str(ei.value)
    with pytest.raises(ValidationError) as ei:
        pipe.put(make_traj(0, "a", "g9"))
    assert ei.value.field == "id"
    with pytest.raises(FieldTypeError):
        pipe.put({"id": "x"})  # type: ignore[arg-type]
    pipe.put(make_traj(3, "a", "g3"))
    pipe.close()
    got = [i for mb in pipe.dataset(0, fetch="sample") for i in mb.info.trajectory_ids]
    assert sorted(got) == ["t0", "t3"]
    with pytest.raises(PipelineClosedError):
        pipe.put(make_traj(4, "a", "g4"))


def test_withdraw_frees_storage_and_group_is_replaced():
    spec = BatchSpec({"a": 4}, num_minibatches=1, group_size=2)
    pipe = Pipeline(spec, num_consumers=1)
    pipe.put(make_traj(0, "a", "g0"))
    pipe.put(make_traj(1, "a", "g1"))
    used = sum(u.stats().used_bytes for u in pipe.units.values())
    out = pipe.withdraw("g0")
    assert [m.id for m in out] == ["t0"]
    assert sum(u.stats().used_bytes for u in pipe.units.values()) < used
    for i, g in [(2, "g1"), (3, "g2"), (4, "g2")]:
        pipe.put(make_traj(i, "a", g))
    pipe.close()
    ids = sorted(i for mb in pipe.dataset(0) for i in mb.info.trajectory_ids)
    assert ids == ["t1", "t2", "t3", "t4"]
    assert pipe.stats()["withdrawn"] == 1


def test_report_version_staleness_and_listeners():
    spec = BatchSpec({"a": 2}, num_minibatches=2)
    pipe = Pipeline(spec, num_consumers=1)
    seen = []
    pipe.add_version_listener(lambda v, t: seen.append(v))
    ds = pipe.dataset(0, fetch="sample")
    for i in range(2):
        pipe.put(make_traj(i, "a", f"g{i}", gen_version=0))
    it = iter(ds)
    next(it)
    pipe.report_version(3)
    next(it)
    assert seen == [3] and pipe.version == 3
    st_ = pipe.stats()["staleness"]
    assert st_["count"] == 2 and st_["max"] == 3 and st_["mean"] == 1.5
    pipe.report_version(1)  # a job restored from a checkpoint reports an older version: a rollback, accepted
    assert pipe.version == 1 and pipe.stats()["version_rollbacks"] == 1
    with pytest.raises(ValidationError, match="version"):
        pipe.report_version(-1)


@pytest.mark.parametrize("release", ["handout", "step", "commit"])
def test_store_full_put_timeout_zero_raises_and_nothing_is_accepted(release):
    spec = BatchSpec({"a": 4}, num_minibatches=2)
    nbytes = make_traj(0, "a", "g").nbytes
    pipe = Pipeline(spec, num_consumers=1, capacity_bytes=2 * nbytes, put_timeout=0, release=release)
    pipe.put(make_traj(0, "a", "g0"))
    pipe.put(make_traj(1, "a", "g1"))
    with pytest.raises(StoreFull):
        pipe.put(make_traj(2, "a", "g2"))
    ds = pipe.dataset(0, fetch="sample")
    it = iter(ds)
    assert next(it).info.trajectory_ids == ("t0", "t1")  # handed out: released at once with "handout"
    ds.flush()  # the hand-out record goes off the trainer's thread: wait for it here
    if release != "handout":
        with pytest.raises(StoreFull):  # held until committed: a restore could still ask for them
            pipe.put(make_traj(2, "a", "g2"))
        assert ds.commit(ds.state_dict(), wait=True) == 1
        assert ds.commit(wait=True) == 0  # idempotent
    pipe.put(make_traj(2, "a", "g2"))  # the rejected one, retried
    pipe.put(make_traj(3, "a", "g3"))
    pipe.close()
    assert next(it).info.trajectory_ids == ("t2", "t3")
    if release != "handout":
        with pytest.raises(StopIteration):  # the pass ends: "commit" waits for the caller; "step" too, as the
            next(it)                        # rank took a state (it may roll back to it)
        assert next(iter(pipe.units.values())).stats().used_bytes == 2 * nbytes
        ds.commit()
    ds.flush()
    unit = next(iter(pipe.units.values())).stats()
    assert unit.high_water_bytes <= 2 * nbytes and unit.used_bytes == 0
    assert unit.rejected_puts == (1 if release == "handout" else 2)


def test_store_full_producers_block_and_high_water_bound():
    """Many producer threads, a store holding ~3 trajectories: nobody loses data, memory stays bounded."""
    rng = random.Random(7)
    w = make_workload(rng, num_sources=2, group_size=1, num_minibatches=4, groups_per_minibatch_per_source=1,
                      train_batches=3)
    biggest = max(t.nbytes for t in w.trajs)
    cap = 3 * biggest - 1
    # a store smaller than two mini-batches needs release="handout": with "step" each consumer keeps its
    # previous mini-batch until the next one is admitted, which needs room for its puts
    pipe = Pipeline(w.spec, num_consumers=2, capacity_bytes=cap, put_timeout=20.0, token_budget=16, release="handout")

    def produce() -> None:
        ts = [threading.Thread(target=lambda c=c: [pipe.put(t) for t in c]) for c in (w.trajs[0::2], w.trajs[1::2])]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    got = run_consumers(pipe, fetch="iter", producer=produce, delay=0.002)
    assert not got.errors, got.errors
    delivered = Counter(i for r in got.by_rank.values() for k in r for i in k[4])
    assert delivered == Counter(t.id for t in w.trajs)
    s = next(iter(pipe.units.values())).stats()
    assert s.high_water_bytes <= cap + biggest
    assert s.high_water_bytes <= max(cap, biggest)  # the precise bound
    assert s.put_wait_s > 0  # producers did block on the full store


def test_quota_infeasible_reaches_consumers():
    spec = BatchSpec({"a": 2, "b": 2}, num_minibatches=1)
    pipe = Pipeline(spec, num_consumers=1)
    errors = []

    def consume():
        try:
            list(pipe.dataset(0))
        except QuotaInfeasibleError as e:
            errors.append(e)

    t = threading.Thread(target=consume)
    t.start()
    pipe.put(make_traj(0, "a", "g0"))
    with pytest.raises(QuotaInfeasibleError):
        pipe.set_in_flight({"a": 1, "b": 0})
    t.join(10)
    assert errors and not t.is_alive()


def test_engine_selection(monkeypatch):
    import sys

    spec = BatchSpec({"a": 2}, num_minibatches=1)
    monkeypatch.setitem(sys.modules, "ray", None)  # ray not installed
    monkeypatch.delitem(sys.modules, "knitdata.engines.ray.engine", raising=False)
    # as in a process where the Ray engine was never chosen: an earlier test of this worker may have imported it
    from knitdata.engines.base import ENGINES

    ENGINES.register_lazy("ray", "knitdata.engines.ray.engine:RayEngine")
    with pytest.raises(OptionalDependencyError, match="ray"):
        Pipeline(spec, engine="ray")
    monkeypatch.undo()
    with pytest.raises(ConfigError):
        Pipeline(spec, engine="nope")
    with pytest.raises(ConfigError, match="engine options"):
        Pipeline(spec, engine_options={"name": "x"})
    pipe = Pipeline(spec, layout=ConsumerLayout.uniform(2, 2), capacity_bytes=1000)
    assert sorted(pipe.units) == ["node0", "node1"] and pipe.engine == "embedded"
    with pytest.raises(ConfigError):
        Pipeline(spec, num_consumers=3, layout=ConsumerLayout.single_node(2))


def test_an_engine_registered_by_name_is_accepted():
    """Engines are a registry: a name registered by the user selects its class (here the embedded one again)."""
    from knitdata.engines.base import ENGINES

    ENGINES.register_lazy("in_process_again", "knitdata.engines.embedded.engine:EmbeddedEngine")
    assert ENGINES.names()[:2] == ("embedded", "ray") and "in_process_again" in ENGINES
    pipe = Pipeline(BatchSpec({"a": 2}, num_minibatches=1), engine="in_process_again", num_consumers=1)
    for i in range(2):
        pipe.put(make_traj(i, "a", f"g{i}"))
    pipe.close()
    assert sorted(t for mb in pipe.dataset(0) for t in mb.info.trajectory_ids) == sorted(
        make_traj(i, "a", f"g{i}").id for i in range(2))
    assert pipe.engine == "embedded"  # the kind of the class it selected


def test_locality_two_nodes_consumer_aware_vs_index_mod():
    spec = BatchSpec({"a": 16}, num_minibatches=1, group_size=4)

    def remote_fraction(placement: str) -> float:
        pipe = Pipeline(spec, layout=ConsumerLayout.uniform(2, 2), placement=placement, token_budget=1000)
        for i in range(16):
            pipe.put(make_traj(i, "a", f"g{i // 4}", response_len=5 + i % 3))
        pipe.close()
        outs = [list(pipe.dataset(r, fetch="iter")) for r in range(4)]
        assert sum(len(mb.info.trajectory_ids) for o in outs for mb in o) == 16
        m = [pipe.metrics(r) for r in range(4)]
        return sum(x.remote_bytes for x in m) / sum(x.bytes_fetched for x in m)

    assert remote_fraction("consumer_aware") == 0.0
    assert remote_fraction("index_mod") > 0.2


def test_payload_handed_without_copy():
    spec = BatchSpec({"a": 1}, num_minibatches=1)
    pipe = Pipeline(spec, num_consumers=1)
    seen = []
    t = make_traj(0, "a", "g0")
    pipe.put(t)
    pipe.close()
    ds = pipe.dataset(0, fetch="eager", collate=lambda trajs, info: (seen.extend(trajs), torch.zeros(0))[1])
    list(ds)
    assert seen[0] is t and seen[0].prompt_ids.data_ptr() == t.prompt_ids.data_ptr()


def test_exactly_once_with_spill(tmp_path):
    rng = random.Random(11)
    w = make_workload(rng, num_sources=2, group_size=2, num_minibatches=2, groups_per_minibatch_per_source=2,
                      train_batches=2)
    biggest = max(t.nbytes for t in w.trajs)
    pipe = Pipeline(w.spec, layout=ConsumerLayout.uniform(2, 2), capacity_bytes=2 * biggest, put_timeout=0,
                    spill_dir=tmp_path, spill_bytes=1 << 22, token_budget=20)
    got = run_consumers(pipe, fetch="iter", producer=lambda: [pipe.put(t) for t in w.trajs])
    assert not got.errors, got.errors
    assert got.rows_ok
    assert Counter(i for r in got.by_rank.values() for k in r for i in k[4]) == Counter(t.id for t in w.trajs)
    units = pipe.stats()["units"].values()
    assert sum(u["spill_puts"] for u in units) > 0 and all(u["spilled_items"] == 0 for u in units)
    assert all(u["high_water_bytes"] <= 2 * biggest for u in units)


def test_on_plan_error_loses_no_admitted_minibatch():
    """A failing on_plan hook must not drop the other mini-batches admitted in the same poll (the consumer
    would silently skip them and their payloads would never be released)."""
    calls = []

    def hook(mb, plan):
        calls.append(mb.step)
        if len(calls) == 1:
            raise RuntimeError("monitoring hook failed")

    spec = BatchSpec({"a": 4}, num_minibatches=2)
    pipe = Pipeline(spec, admission="train_batch", on_plan=hook)
    for i in range(3):
        pipe.put(make_traj(i, "a", f"g{i}"))
    with pytest.raises(RuntimeError, match="hook failed"):
        pipe.put(make_traj(3, "a", "g3"))  # admits mini-batches 0 and 1 in one poll
    pipe.close()
    steps = [mb.info.minibatch for mb in pipe.dataset(0, fetch="sample")]
    assert sorted(set(steps)) == [0, 1]
    assert pipe.stats()["held_trajectories"] == 0


def test_placement_load_returns_to_zero_with_spill(tmp_path):
    """Consumer-aware placement balances by bytes currently placed; spilled payloads must be un-counted when
    released too, or a unit that spilled looks full forever and placement drifts away from it."""
    rng = random.Random(5)
    w = make_workload(rng, num_sources=1, group_size=1, num_minibatches=1, groups_per_minibatch_per_source=4,
                      train_batches=2)
    biggest = max(t.nbytes for t in w.trajs)
    pipe = Pipeline(w.spec, layout=ConsumerLayout.uniform(2, 1), capacity_bytes=biggest, put_timeout=0,
                    spill_dir=tmp_path, spill_bytes=1 << 22)
    for t in w.trajs:
        pipe.put(t)
    pipe.close()
    for r in range(2):
        list(pipe.dataset(r, fetch="sample"))
    units = pipe.stats()["units"].values()
    assert sum(u["spill_puts"] for u in units) > 0
    # placement counts bytes placed so far (never released ones), so that plans depend on the puts alone
    assert sum(pipe.internals.control.state.placement.state_dict()["load"].values()) == sum(t.nbytes for t in w.trajs)


def test_bad_set_in_flight_is_rejected_without_stopping_the_pipeline():
    """A typo in set_in_flight (unknown source, non-int count) is a ValidationError for that call only: the
    pipeline keeps accepting puts and serving consumers (only an infeasible quota stops it)."""
    pipe = Pipeline(BatchSpec({"a": 2}, num_minibatches=1))
    with pytest.raises(ValidationError, match="unknown source"):
        pipe.set_in_flight({"nope": 1})
    with pytest.raises(ValidationError):
        pipe.set_in_flight({"a": "x"})
    with pytest.raises(ValidationError):
        pipe.set_in_flight({"a": None})
    pipe.put(make_traj(0, "a", "g0"))
    pipe.put(make_traj(1, "a", "g1"))
    pipe.close()
    assert [mb.info.minibatch for mb in pipe.dataset(0, fetch="sample")] == [0]


def test_late_member_of_a_withdrawn_group_is_refused():
    spec = BatchSpec({"a": 4}, num_minibatches=1, group_size=2)
    pipe = Pipeline(spec, num_consumers=1)
    pipe.put(make_traj(0, "a", "g0"))
    assert [m.id for m in pipe.withdraw("g0")] == ["t0"]
    with pytest.raises(ValidationError, match="withdrawn") as e:
        pipe.put(make_traj(1, "a", "g0"))  # rollout finished it after the filter dropped the group
    assert e.value.trajectory_id == "t1" and e.value.field == "group"
    for i, g in ((2, "g1"), (3, "g1"), (4, "g2"), (5, "g2")):
        pipe.put(make_traj(i, "a", g))
    pipe.close()
    got = [i for mb in pipe.dataset(0, fetch="sample") for i in mb.info.trajectory_ids]
    assert sorted(got) == ["t2", "t3", "t4", "t5"]
    assert pipe.stats()["held_trajectories"] == 0


def test_trajectories_must_carry_the_same_fields():
    spec = BatchSpec({"a": 4}, num_minibatches=1)
    pipe = Pipeline(spec, num_consumers=1)
    pipe.put(make_traj(0, "a", "g0"))
    odd = make_traj(1, "a", "g1")
    odd.scalars = {"reward": 1.0, "advantage": 0.5}
    with pytest.raises(ValidationError, match="same fields") as e:
        pipe.put(odd)
    assert e.value.trajectory_id == "t1" and e.value.field == "scalars.advantage"
    with pytest.raises(ValidationError) as e:
        pipe.put(make_traj(2, "a", "g2", extra_bytes=8))
    assert e.value.field == "tensors.pad"
    for i in (1, 2, 3):
        pipe.put(make_traj(i, "a", f"g{i}"))  # nothing accepted before was lost: the batch completes
    pipe.close()
    assert sum(len(mb.info.trajectory_ids) for mb in pipe.dataset(0)) == 4


def test_bad_constructor_arguments_raise_config_errors():
    spec = BatchSpec({"a": 2}, num_minibatches=1)
    with pytest.raises(ConfigError, match="ConsumerLayout"):
        Pipeline(spec, layout=["node0", "node0"])
    with pytest.raises(ConfigError, match="balance_tolerance"):
        Pipeline(spec, balance_tolerance="0.1")
    with pytest.raises(ConfigError, match="release"):
        Pipeline(spec, release="never")
    with pytest.raises(ConfigError, match="media_dedup"):
        Pipeline(spec, media_dedup="yes")  # type: ignore[arg-type]
    assert Pipeline(spec).internals.config["media_dedup"] is True
    assert not Pipeline(spec, media_dedup=False).internals.units["node0"].media_dedup  # type: ignore[attr-defined]


def test_consumer_restores_mid_step_in_the_same_pipeline_with_release_step():
    """A crash inside a step: the state saved at the last step boundary gets the whole step again."""
    spec = BatchSpec({"a": 8}, num_minibatches=2)
    pipe = Pipeline(spec, num_consumers=1, token_budget=10)  # 2 trajectories (10 tokens) per micro-batch
    for i in range(8):
        pipe.put(make_traj(i, "a", f"g{i}"))
    pipe.close()
    ds = pipe.dataset(0, fetch="iter")
    it = iter(ds)
    first = [next(it).info for _ in range(2)]  # mini-batch 0 done
    assert first[-1].is_last
    saved = json.loads(json.dumps(ds.state_dict()))  # checkpoint at the step boundary
    crashed = next(it).info  # mini-batch 1 started, then the process "dies"
    ds.close()
    ds2 = pipe.dataset(0, fetch="iter")
    ds2.load_state_dict(saved)
    again = [mb.info for mb in ds2]
    assert again[0].trajectory_ids == crashed.trajectory_ids  # re-delivered, not lost
    assert sorted(i for info in first + again for i in info.trajectory_ids) == [f"t{i}" for i in range(8)]
    assert pipe.stats()["held_trajectories"] == 4  # after the loaded state: held until a commit (rollback)
    ds2.commit()
    assert pipe.stats()["held_trajectories"] == 0


def test_concurrent_first_puts_with_different_fields_are_not_both_accepted():
    """The field schema is fixed by the first put that completes: a put that passed the schema check while
    no schema was set yet is checked again once stored, so two puts with different fields racing to be the
    first cannot both be accepted (a micro-batch holding both would not collate)."""
    spec = BatchSpec({"a": 4}, num_minibatches=1)
    pipe = Pipeline(spec, num_consumers=1)
    (unit,) = pipe.units.values()
    entered, go = threading.Event(), threading.Event()
    real_put = unit.put

    def slow_put(traj, *, timeout=None):
        if traj.id == "t0":
            entered.set()
            assert go.wait(5)
        return real_put(traj, timeout=timeout)

    unit.put = slow_put
    errors: list = []

    def first():
        try:
            pipe.put(make_traj(0, "a", "g0"))  # scalars {"reward"}
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(5)  # t0 passed the schema check (none yet) and is being stored
    odd = make_traj(1, "a", "g1")
    odd.scalars = {"advantage": 0.5}
    pipe.put(odd)  # completes first: its fields become the schema
    go.set()
    t.join(5)
    assert len(errors) == 1 and isinstance(errors[0], ValidationError) and errors[0].trajectory_id == "t0"
    st = pipe.stats()
    assert st["puts"] == 1 and st["held_trajectories"] == 1
    assert [u["num_items"] for u in st["units"].values()] == [1]  # the refused payload left storage
    pipe.close()


def test_put_many_matches_put_and_refuses_a_bad_batch_before_storing_anything():
    spec = BatchSpec({"a": 8, "b": 8}, num_minibatches=2, group_size=2)
    trajs = [make_traj(i, "ab"[(i // 2) % 2], f"g{i // 2}") for i in range(16)]
    one = Pipeline(spec, num_consumers=2, token_budget=64)
    for t in trajs:
        one.put(t)
    one.close()
    many = Pipeline(spec, num_consumers=2, token_budget=64)
    metas = many.put_many(trajs[:10]) + many.put_many(trajs[10:])
    many.close()
    assert [m.id for m in metas] == [t.id for t in trajs] and [m.seq for m in metas] == list(range(16))
    for r in range(2):
        assert [mb.info.trajectory_ids for mb in one.dataset(r)] == [mb.info.trajectory_ids for mb in many.dataset(r)]
    # a bad trajectory in a batch: nothing of the batch is stored, the error names it
    pipe = Pipeline(spec, num_consumers=1)
    bad = make_traj(99, "nope", "gx")
    with pytest.raises(ValidationError) as ei:
        pipe.put_many([trajs[0], bad])
    assert ei.value.trajectory_id == "t99" and ei.value.field == "source"
    assert pipe.stats()["held_trajectories"] == 0 and pipe.stats()["rejected"] >= 1
    # a withdrawn group's late member is refused at the reservation: nothing of the batch is stored
    pipe.withdraw("g1")
    with pytest.raises(ValidationError) as ei:
        pipe.put_many([trajs[0], trajs[1], trajs[2]])
    assert ei.value.trajectory_id == "t2" and ei.value.field == "group"
    assert pipe.stats()["held_trajectories"] == 0
    assert [m.id for m in pipe.put_many([trajs[0], trajs[1]])] == ["t0", "t1"]


def test_a_fields_dtype_is_fixed_by_the_first_put_and_refusals_are_counted_by_cause():
    """No silent promotion in the collate: a tensor field keeps the dtype of the first accepted put."""
    import torch

    spec = BatchSpec({"a": 4}, num_minibatches=1)
    pipe = Pipeline(spec, num_consumers=1)
    first = make_traj(0, "a", "g0")
    first.tensors = {"adv": torch.zeros(3, dtype=torch.float32)}
    pipe.put(first)
    other = make_traj(1, "a", "g1")
    other.tensors = {"adv": torch.zeros(3, dtype=torch.float64)}
    with pytest.raises(FieldTypeError) as ei:
        pipe.put(other)
    assert ei.value.trajectory_id == "t1" and ei.value.field == "tensors.adv" and "float32" in str(ei.value)
    with pytest.raises(ValidationError):
        pipe.put(make_traj(2, "nope", "g2"))
    st = pipe.stats()
    assert st["rejected"] == 2 and st["rejected_by_cause"] == {"tensors": 1, "source": 1}
    assert st["held_trajectories"] == 1


def test_the_signature_shows_every_default():
    import inspect

    import knitdata

    params = inspect.signature(Pipeline).parameters
    assert params["capacity_bytes"].default == 1 << 30 and params["release"].default == "step"
    assert params["put_timeout"].default == 60.0 and params["token_budget"].default == 8192
    assert inspect.signature(Pipeline.dataset).parameters["timeout"].default == 1800.0
    assert knitdata.PipelineClosedError is PipelineClosedError


def test_a_trajectory_longer_than_the_token_budget_is_refused_at_put():
    """203 tokens with a budget of 64: refused in the producer, naming the trajectory, the field and the budget;
    nothing of the put (or of a put_many holding it) is stored, and the rest of the stream is unaffected."""
    spec = BatchSpec({"a": 4}, num_minibatches=1, group_size=2)
    pipe = Pipeline(spec, num_consumers=1, token_budget=64)
    long = make_traj(9, "a", "g9", response_len=200, prompt_len=3)
    assert long.num_tokens == 203
    with pytest.raises(ValidationError, match=r"203 tokens \(prompt 3 \+ response 200\) exceed the pipeline's "
                                              r"token_budget of 64") as ei:
        pipe.put(long)
    assert ei.value.trajectory_id == "t9" and ei.value.field == "num_tokens"
    assert "'t9'" in str(ei.value) and "num_tokens" in str(ei.value)
    fits = [make_traj(i, "a", f"g{i // 2}", response_len=60, prompt_len=4) for i in range(4)]  # exactly 64 tokens
    with pytest.raises(ValidationError, match="token_budget of 64"):
        pipe.put_many([fits[0], long])
    st = pipe.stats()
    assert st["held_trajectories"] == 0 and st["rejected_by_cause"] == {"num_tokens": 2}
    for t in fits:
        pipe.put(t)
    pipe.close()
    got = [mb.info.trajectory_ids for mb in pipe.dataset(0, timeout=30)]
    assert sorted(i for ids in got for i in ids) == ["t0", "t1", "t2", "t3"] and all(len(ids) == 1 for ids in got)


def test_the_pipeline_options_are_declared_once():
    """``Pipeline``'s keywords after ``spec`` are the fields of ``PipelineOptions`` (names, order, annotations,
    defaults), which checks them, builds the engine and documents each (its ``Attributes``)."""
    import dataclasses
    import inspect

    from knitdata.engines.options import PipelineOptions

    fields = [(f.name, str(f.type), f.default) for f in dataclasses.fields(PipelineOptions)]
    params = [p for p in inspect.signature(Pipeline.__init__).parameters.values() if p.name not in ("self", "spec")]
    assert [(p.name, str(p.annotation), p.default) for p in params] == fields
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    doc = inspect.getdoc(PipelineOptions) or ""
    assert all(f"\n    {name}: " in doc for name, _t, _d in fields), [n for n, _t, _d in fields
                                                                      if f"\n    {n}: " not in doc]
    with pytest.raises(ConfigError, match="token_budget must be a positive int"):
        PipelineOptions(token_budget=0).build(BatchSpec({"a": 2}, num_minibatches=1))
    with pytest.raises(ConfigError, match="unknown engine 'nope'; choose one of"):
        Pipeline(BatchSpec({"a": 2}, num_minibatches=1), engine="nope")
    with pytest.raises(ConfigError, match="unknown placement 'nope'; choose one of"):
        Pipeline(BatchSpec({"a": 2}, num_minibatches=1), placement="nope")
    with pytest.raises(ConfigError, match="spec must be a knitdata.admission.BatchSpec"):
        Pipeline({"a": 2})  # type: ignore[arg-type]


def test_the_facade_exposes_the_engine_only_as_internals():
    """Tests, drills and benchmarks reach the control parts, units and ``kill_unit`` through ``pipe.internals``
    (the engine); the facade has no ``control``, ``planner`` or ``kill_unit``."""
    pipe = Pipeline(BatchSpec({"a": 2}, num_minibatches=1))
    assert not any(hasattr(pipe, name) for name in ("control", "planner", "kill_unit"))
    assert pipe.internals.control.reporting.stats()["closed"] is False
    assert pipe.internals.local_plane().state.planner is not None
    with pytest.raises(EngineError, match="kill_unit is a failure drill"):
        pipe.internals.kill_unit("node0")
    pipe.shutdown()
