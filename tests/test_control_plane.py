"""The control plane's one-round-trip put (``admit_many``) and its control surface.

The pipeline stores a payload on the unit its replica of the placement picks, then the unit asks the plane to
admit it. These tests pin down that this path is deterministic, that a batch is refused whole, and that a
retried call is answered as the first one; and that the surface (plane, coordinator, client, journal) is one.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.admission import BatchSpec
from knitdata.control import ControlPlane, fields_of
from knitdata.control.journal import Journal
from knitdata.control.records import PlacementView
from knitdata.errors import ConfigError
from knitdata.placement import ConsumerLayout, make_placement
from knitdata.record import Trajectory, TrajectoryMeta

UNITS = {"node0": "node0", "node1": "node1", "node2": "node2"}


def _config(placement: str = "consumer_aware") -> dict[str, Any]:
    spec = BatchSpec({"a": 8, "b": 8}, num_minibatches=2, group_size=2)
    return {"spec": spec.to_dict(), "layout": ConsumerLayout.uniform(3, 1).to_dict(), "token_budget": 64,
            "placement": placement}


def _traj(i: int, *, source: str | None = None, group: str | None = None, extra: int = 0,
          scalars: dict[str, float] | None = None) -> Trajectory:
    import torch

    return Trajectory(id=f"t{i}", source=source or "ab"[(i // 2) % 2], group=group or f"g{i // 2}", gen_version=0,
                      prompt_ids=torch.arange(4), response_ids=torch.arange(4 + (i * 7) % 11 + extra),
                      scalars={"r": 1.0} if scalars is None else scalars)


def _meta(t: Trajectory) -> dict[str, Any]:
    return {**t.meta().to_dict(), "fields": fields_of(t.scalars, {})}


def _plane(released: list | None = None, **kw: Any) -> ControlPlane:
    sink = released if released is not None else []
    return ControlPlane(_config(**kw), UNITS, lambda u, ids, wait: sink.append((u, list(ids))))


class Producer:
    """What the pipeline does: a replica of the placement picks the unit, then one admit_many per unit."""

    def __init__(self, plane: ControlPlane, name: str = "consumer_aware") -> None:
        self.plane = plane
        self.replica = make_placement(name, list(UNITS))
        view = plane.admission.placement_view()
        self.replica.follow(view.placement)
        self.seq = view.seq
        self.calls = 0

    def put_many(self, trajs: list[Trajectory]) -> dict[str, Any]:
        by_unit: dict[str, list[list[Any]]] = {}
        for i, t in enumerate(trajs):
            m = TrajectoryMeta.from_dict({**t.meta().to_dict(), "seq": self.seq + i})
            by_unit.setdefault(self.replica.place(m), []).append([_meta(t), 8, f"tok-{t.id}"])
        out: dict[str, Any] = {"accepted": [], "errors": []}
        for unit, items in by_unit.items():
            ans = self.plane.admission.admit_many(unit, items)
            self.calls += 1
            self.replica.follow(ans.placement)
            self.seq = ans.seq
            out["accepted"] += ans.accepted
            out["errors"] += ans.errors
        return out


def _decisions(p: ControlPlane) -> dict[str, Any]:
    return {"planned": list(p.state.planned), "seq": p.state.seq,
            "entries": [[(q[j].minibatch, q[j].microbatch, q[j].items) for j in sorted(q)] for q in p.state.queues],
            "live": {k: (m.location, m.seq) for k, m in p.state.live.items()}, "pending": sorted(p.state.pending),
            "placement": p.state.placement.state_dict(), "counts": dict(p.state.counts)}


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=2, max_size=32), batch=st.integers(2, 8))
def test_batches_are_deterministic_keep_groups_whole_and_admit_everything(sizes, batch):
    """A batch is admitted unit by unit (one call each), so its arrival order is unit by unit; the same
    batches give the same decisions, and everything is admitted once, each group on one unit."""
    trajs = [_traj(i, extra=s) for i, s in enumerate(sizes)]
    runs = []
    for _ in range(2):
        plane = _plane()
        prod = Producer(plane)
        for k in range(0, len(trajs), batch):
            assert not prod.put_many(trajs[k:k + batch])["errors"]
        assert prod.calls <= len(trajs)
        runs.append(_decisions(plane))
    assert runs[0] == runs[1]
    live = runs[0]["live"]
    assert sorted(live) == sorted(t.id for t in trajs)
    assert sorted(seq for _u, seq in live.values()) == list(range(len(trajs)))
    units_of: dict[str, set[str]] = {}
    for t in trajs:
        units_of.setdefault(t.group, set()).add(live[t.id][0])
    assert all(len(u) == 1 for u in units_of.values())


def test_one_bad_trajectory_refuses_its_whole_batch_and_is_counted():
    plane = _plane()
    prod = Producer(plane)
    prod.put_many([_traj(0), _traj(1)])
    # an unknown source, a duplicate id (held, and twice in one batch), a withdrawn group, other fields
    plane.admission.withdraw("gw")
    cases = [
        ([_traj(2), _traj(3, source="nope")], "t3", "source"),
        ([_traj(4), _traj(0)], "t0", "id"),
        ([_traj(5), _traj(5)], "t5", "id"),
        ([_traj(6), _traj(7, group="gw")], "t7", "group"),
        ([_traj(8), _traj(9, scalars={"other": 1.0})], "t9", "scalars.r"),
    ]
    for batch, bad, field in cases:
        before = _decisions(plane)
        ans = plane.admission.admit_many("node0", [[_meta(t), 8, f"x-{t.id}-{k}"] for k, t in enumerate(batch)])
        assert ans.accepted == [None, None]  # the unit drops both payloads
        assert [e.trajectory_id for e in ans.errors] == [bad] and ans.errors[0].field == field
        after = _decisions(plane)
        assert after["live"] == before["live"] and after["seq"] == before["seq"]
    st_ = plane.reporting.stats()
    assert st_["rejected_by_cause"]["batch"] == len(cases)
    assert st_["rejected"] == 2 * len(cases)


def test_a_retried_call_is_answered_as_the_first_one(tmp_path):
    plane = ControlPlane(_config(), UNITS, lambda u, ids, wait: None, journal=Journal(tmp_path / "j", fsync_every_s=0))
    items = [[_meta(_traj(i)), 8, f"tok{i}"] for i in range(2)]
    first = plane.admission.admit_many("node1", items)
    again = plane.admission.admit_many("node1", items)  # the coordinator restarted before its answer arrived
    assert again.accepted == first.accepted and not again.errors
    assert plane.reporting.stats()["puts"] == 2
    # the same ids under new tokens are a new put: duplicates
    other = plane.admission.admit_many("node1", [[it[0], 8, "new"] for it in items])
    assert [e.field for e in other.errors] == ["id", "id"]
    # a restarted coordinator replays the journal into the same decisions
    fresh = ControlPlane(_config(), UNITS, lambda u, ids, wait: None)
    fresh.recover(str(tmp_path / "j"))
    assert _decisions(fresh)["live"] == _decisions(plane)["live"]
    assert fresh.admission.admit_many("node1", items).accepted == first.accepted


def test_admit_many_refuses_an_unknown_unit_and_reports_the_view():
    plane = _plane()
    with pytest.raises(ConfigError, match="unknown storage unit 'nowhere'"):
        plane.admission.admit_many("nowhere", [[_meta(_traj(0)), 8, "t"]])
    ans = plane.admission.admit_many("node2", [[_meta(_traj(0)), 8, "t"]])
    got = ans.accepted[0]
    assert isinstance(got, TrajectoryMeta) and got.location == "node2" and got.seq == 0 and ans.seq == 1
    assert ans.placement["load"]["node2"] == _traj(0).nbytes
    assert plane.admission.placement_view() == PlacementView(ans.placement, 1)


def test_a_truncated_view_still_names_the_least_loaded_unit():
    units = [f"u{i}" for i in range(10)]
    plane_side = make_placement("consumer_aware", units)
    replica = make_placement("consumer_aware", units)
    for i in range(40):
        m = TrajectoryMeta.from_dict({**_traj(i, extra=i % 5).meta().to_dict(), "seq": i})
        replica.follow(plane_side.view(limit=3))
        unit = replica.place(m)
        assert unit == min(units, key=lambda u: (plane_side.state_dict()["load"][u], units.index(u))) \
            or m.group in dict(plane_side.state_dict()["groups"])
        plane_side.place_at(m, unit)


def test_admit_batches_decides_each_batch_on_its_own_as_separate_calls_would():
    batches = [[[_meta(_traj(2 * k + i)), 8, f"b{k}-{i}"] for i in range(2)] for k in range(4)]
    batches[1][1][0] = {**batches[1][1][0], "source": "nope"}  # one bad batch among concurrent puts
    a, b = _plane(), _plane()
    one_by_one = [a.admission.admit_many("node0", x) for x in batches]
    together = b.admission.admit_batches("node0", batches)
    assert together == one_by_one
    assert [x.accepted == [None, None] for x in together] == [False, True, False, False]
    assert _decisions(a) == _decisions(b)


def test_producer_retry_of_a_delivered_and_released_group_is_not_delivered_twice():
    """Minimal reproduction (embedded engine; the Ray engine's coordinator runs the same ControlPlane).

    A producer puts group g0; both puts land, but the producer dies before it sees them return (lost acks). The
    group is delivered, the consumer commits a state past it and its payloads are released. The restarted
    producer cannot tell whether its puts landed, so it puts g0 again (what the engine supports for a death before
    admission: the retry replaces the dead reservation). Exactly once means the retry is refused with an error
    naming the trajectory (as it is while the first copy is still held), and nothing is delivered twice.
    """
    from benchmarks.soak import make_soak_traj
    from knitdata.admission import BatchSpec
    from knitdata.errors import KnitdataError
    from knitdata.pipeline import Pipeline

    pipe = Pipeline(BatchSpec({"s0": 2}, num_minibatches=1, group_size=2), num_consumers=1, token_budget=64)
    for i in range(2):
        pipe.put(make_soak_traj(i, "s0", "g0", traj_bytes=256))  # landed; the producer dies before put() returns
    ds = pipe.dataset(0, fetch="sample", timeout=5)
    it = iter(ds)
    assert list(next(it).info.trajectory_ids) == ["t0", "t1"]
    ds.commit(wait=True)  # the checkpoint past g0: its payloads are released
    assert pipe.stats()["held_trajectories"] == 0
    refused = []
    for i in range(2):  # the restarted producer retries the group it never saw acknowledged
        try:
            pipe.put(make_soak_traj(i, "s0", "g0", traj_bytes=256))
        except KnitdataError as e:
            refused.append(getattr(e, "trajectory_id", None))
    pipe.close()
    again = [tid for mb in it for tid in mb.info.trajectory_ids]
    assert again == [], f"delivered a second time: {again}"
    assert refused == ["t0", "t1"]  # the retry learns that its first puts had landed


# ---------------------------------------------------------------------------------------------- the control surface
def test_every_control_call_is_a_method_of_the_part_the_plane_holds():
    from knitdata.control import FIRE_AND_FORGET, JOURNALED_OPS, SURFACE
    from knitdata.control.plane import PARTS

    plane = _plane()
    assert JOURNALED_OPS <= set(SURFACE) and FIRE_AND_FORGET <= set(SURFACE)
    assert {"admit_many", "close", "commit", "handed", "seek", "verify", "withdraw"} <= JOURNALED_OPS
    assert not {"reserve", "reserve_many", "offer", "offer_many", "unreserve"} & set(SURFACE)
    # the calls no caller used are gone from the surface
    assert not {"unlease", "start_position"} & set(SURFACE)
    for name, call in SURFACE.items():
        part = getattr(plane, call.part)
        assert isinstance(part, PARTS[call.part]) and callable(getattr(part, name)), name
        assert not hasattr(plane, name), name  # reached on its part only: no flat forwarder on the plane
    # the plane's own methods are not control calls, and the shared state is its own attribute
    assert not {"recover", "compact", "state_dict", "load_state_dict"} & set(SURFACE)
    assert plane.state.release_mode == "step" and not hasattr(plane, "planned")


def test_journaled_calls_are_recorded_once_at_the_outermost_call(tmp_path):
    path = tmp_path / "j"
    plane = ControlPlane(_config(), UNITS, lambda u, ids, wait: None, journal=Journal(path, fsync_every_s=0))
    batches = [[[_meta(_traj(2 * k + i)), 8, f"b{k}-{i}"] for i in range(2)] for k in range(4)]
    plane.admission.admit_batches("node0", batches)  # calls admit_many inside: recorded as one admit_batches
    e = next(r for r in range(3) if plane.state.planned[r])
    got = plane.leasing.next_entries(e, 0, 0.0).entries
    recs = [[x.j, x.minibatch, x.microbatch, 0] for x in got]
    plane.leasing.report([[e, 0, "tok", recs, False]], [[e, 1]], 4)  # not journaled itself: what it applies is
    plane.reporting.stats()  # not journaled
    assert [op for op, _a in Journal.read(path)] == ["admit_batches", "handed_many", "commit", "report_version"]
    fresh = ControlPlane(_config(), UNITS, lambda u, ids, wait: None)
    fresh.recover(str(path))
    assert fresh.state_dict() == plane.state_dict()


def test_only_reports_are_fire_and_forget():
    """A remote coordinator runs calls on several threads, so a fired call may land after a later waited one: only
    calls whose effect a caller never reads back at once (the consumers' reports, folded later) may be fired.
    ``note_rejected`` was fired until a ``stats()`` read right after a refused put missed it on Ray."""
    import knitdata.control  # noqa: F401 - registers the parts
    from knitdata.control.surface import CONTROL_CALLS

    fired = sorted(name for name, c in CONTROL_CALLS.items() if c.fire_and_forget and not name.endswith("_for_test"))
    assert fired == ["handed", "report_consumer", "report_transfer"]
    assert not CONTROL_CALLS["note_rejected"].fire_and_forget


def test_a_control_call_is_declared_in_one_place_and_only_once():
    from knitdata.control.surface import CONTROL_CALLS, Part, control_call, control_part
    from knitdata.errors import ConfigError

    @control_part("extra")
    class Extra(Part):
        @control_call(journaled=True, fire_and_forget=True)
        def poke_for_test(self, n: int) -> None:
            """A test call."""

        @control_call(waits="patience")
        def wait_for_test(self, patience: float = 2.5) -> None:
            """Another."""

    try:
        poke, wait = CONTROL_CALLS["poke_for_test"], CONTROL_CALLS["wait_for_test"]
        assert (poke.part, poke.journaled, poke.fire_and_forget, poke.waits) == ("extra", True, True, None)
        assert (wait.wait_index, wait.wait_of(()), wait.wait_of((7,))) == (0, 2.5, 7.0)
        assert Extra.__name__ == "Extra"
        with pytest.raises(ConfigError, match="'poke_for_test' is declared twice"):
            control_part("other")(type("Again", (Part,), {"poke_for_test": control_call()(lambda self: None)}))
        with pytest.raises(ConfigError, match="waits='nope' names no parameter"):
            control_part("other")(type("Bad", (Part,), {"bad_for_test": control_call(waits="nope")(lambda self: None)}))
    finally:
        for n in ("poke_for_test", "wait_for_test", "bad_for_test"):
            CONTROL_CALLS.pop(n, None)


def test_the_ray_client_holds_proxies_of_the_parts_types_and_the_coordinator_takes_every_call(monkeypatch):
    pytest.importorskip("ray")
    from knitdata.control import SURFACE
    from knitdata.control.plane import PARTS
    from knitdata.control.positions import Positions
    from knitdata.control.surface import CONTROL_CALLS
    from knitdata.engines.ray.control import Coordinator, Plumbing, RayControl
    from knitdata.errors import ConfigError

    # the coordinator's two entry points; the waiting one runs in the "wait" concurrency group
    assert getattr(Coordinator.call_waiting, "__ray_concurrency_group__", None) == "wait"
    assert getattr(Coordinator.call, "__ray_concurrency_group__", None) is None
    plumbing = {n for n, c in CONTROL_CALLS.items() if c.part == "plumbing"}
    assert {"info", "unit_handles", "recover", "recoverable", "kill_unit", "flush_trace", "shutdown", "clock",
            "admit_cpu"} == plumbing and not plumbing & set(SURFACE)

    sent: list = []  # the calls whose answer the client waited for: (method, call, args, time bound)
    submitted: list = []  # every call submitted to the actor

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *a):
            submitted.append((self.name, a))
            return (self.name, a)  # the "object ref" of the call

    class Actor:  # what a Ray actor handle looks like to the client: method.remote(*args)
        call, call_waiting = Method("call"), Method("call_waiting")

    def ray_get(ref, timeout=None):  # the client's bounded wait for an answer
        method, (name, *args) = ref
        sent.append((method, name, tuple(args), round(timeout)))
        return "answer"

    import knitdata.engines.ray.control as ray_control

    monkeypatch.setattr(ray_control, "ray_get", ray_get)
    monkeypatch.setattr(ray_control.ray, "is_initialized", lambda: True)  # a client in a process that runs Ray
    c = RayControl(Actor(), "p", 1.0)
    for part, cls in PARTS.items():
        assert isinstance(getattr(c, part), cls), part
    assert isinstance(c.plumbing, Plumbing)
    assert c.leasing.lease(0, 1, "tok", wait_s=5.0) == "answer"
    assert c.leasing.next_entries(1, 7, 2.0) == "answer"
    assert c.reporting.stats() == "answer"
    assert c.positions.handed(0, 1, 0, 0) is None  # fire and forget: sent, not awaited
    assert c.positions.commit(0, upto=3, replica=1) == "answer"
    assert c.plumbing.info() == "answer"
    assert sent == [("call_waiting", "lease", (0, 1, "tok", 5.0, "", 0), 6), ("call_waiting", "next_entries",
                                                                             (1, 7, 2.0), 3),
                    ("call", "stats", (), 1), ("call", "commit", (0, 3, 1), 1), ("call", "info", (), 1)]
    assert ("call", ("handed", 0, 1, 0, 0)) in submitted  # fire and forget: submitted, never waited for
    assert [s[1][0] for s in submitted] == ["lease", "next_entries", "stats", "handed", "commit", "info"]
    assert isinstance(c.positions, Positions) and type(c.positions).__name__ == "PositionsProxy"
    with pytest.raises(ConfigError, match="check_replica is not a control call"):
        c.positions.check_replica(0, 0)  # a part's own helper works on state in another process
    with pytest.raises(AttributeError):
        c.positions.comit  # noqa: B018 - misspelt (and rejected by mypy: tests/test_typecheck.py)


def test_stats_report_sources_admission_delay_and_the_journal(tmp_path):
    """What knitdata.observe.monitor reads: per source quota/put/admitted/ready, put-to-admission delay, the journal."""
    from knitdata.observe.monitor import status_table

    assert _plane().reporting.stats()["journal"] is None
    plane = ControlPlane(_config(), UNITS, lambda u, ids, wait: None, journal=Journal(tmp_path / "j", fsync_every_s=0))
    plane.admission.admit_many("node1", [[_meta(_traj(i)), 8, f"tok{i}"] for i in range(10)])  # groups alternate a, b
    st_ = plane.reporting.stats()
    assert st_["sources"] == {"a": {"quota": 8, "puts": 6, "admitted": 4, "ready": 2},
                              "b": {"quota": 8, "puts": 4, "admitted": 4, "ready": 0}}
    assert st_["admission_delay_s"]["count"] == 8 and st_["admission_delay_s"]["max"] >= 0
    j = st_["journal"]
    assert j["records"] >= 1 and j["segment"] == 0 and j["bytes"] == (tmp_path / "j").stat().st_size > 0
    assert f"journal: {j['records']} records in segment 0" in status_table(st_)


# ---------------------------------------------------------------------------------------------- release bookkeeping


def test_released_ids_are_remembered_newest_last_and_fingerprints_pruned_oldest_first(monkeypatch):
    """Handing out and committing a stream releases each trajectory once from its unit; the plane remembers the
    newest DELIVERED_MEMORY released ids in release order (a retry of an older one is no longer recognized) and
    keeps the prefix fingerprints of the last FP_KEEP micro-batches below the committed position only."""
    from knitdata.control import state as plane_state

    monkeypatch.setattr(plane_state, "DELIVERED_MEMORY", 5)
    monkeypatch.setattr(plane_state, "FP_KEEP", 2)
    released: list = []
    p = _plane(released)
    prod = Producer(p)
    trajs = [_traj(i) for i in range(32)]
    assert not prod.put_many(trajs)["errors"]
    p.admission.close()
    order: list[str] = []
    ends = []
    for rank in range(3):
        j = 0
        while True:
            ans = p.leasing.next_entries(rank, j, 1.0)
            if not ans.entries:
                break
            for e in ans.entries:
                p.positions.handed(rank, e.j, e.minibatch, e.microbatch)
                order += [it[0] for it in e.items]
                j = e.j + 1
        p.positions.commit(rank, j)
        ends.append(j)
    ids = [i for _u, batch in released for i in batch]
    assert sorted(ids) == sorted(order) == sorted(t.id for t in trajs)  # each released once
    assert list(p.state.delivered) == ids[-5:]  # the newest five, oldest first
    for rank, j in enumerate(ends):
        fps = p.state.replay.fps[rank]
        assert list(fps) == sorted(fps) and min(fps) >= j - 2  # nothing far below the committed position
    assert not p.state.live


def _stream_entries(p: ControlPlane) -> list[list[dict[str, Any]]]:
    """Every planned entry of each rank, in order (the stream is closed)."""
    out = []
    for rank in range(3):
        entries, j = [], 0
        while True:
            ans = p.leasing.next_entries(rank, j, 1.0)
            if not ans.entries:
                break
            entries += ans.entries
            j = entries[-1].j + 1
        out.append(entries)
    return out


def _handout_view(p: ControlPlane, released: list) -> dict[str, Any]:
    s = p.state
    by_unit: dict[str, list[str]] = {}
    for u, ids in released:
        by_unit.setdefault(u, []).extend(ids)
    return {"released": by_unit, "delivered": list(s.delivered), "committed": list(s.committed),
            "position": list(s.position), "live": sorted(s.live), "staleness": list(s.observed.staleness),
            "by_rank": [list(d) for d in s.observed.staleness_by_rank],
            "by_source": {k: list(d) for k, d in s.observed.staleness_by_source.items()},
            "tokens": s.observed.token_staleness.summary(), "counts": dict(s.counts)}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=64, max_size=64), st.lists(st.booleans(), min_size=64, max_size=64),
       st.integers(0, 2))
def test_hand_outs_reported_in_any_batches_leave_the_plane_as_one_at_a_time(cuts, bumps, gen_mod):
    """A report applies a batch of hand-outs (``handed_many``): the staleness of consecutive ones is recorded
    together and the entries an automatic commit releases go to their units together. Whatever the batching and
    wherever the trainer's version changes, the plane ends as with each hand-out applied on its own (``handed``):
    the same payloads released per unit in the same order, the same ids remembered, positions, staleness per
    trajectory, rank, source and token."""
    import torch

    trajs = [Trajectory(id=f"t{i}", source="ab"[(i // 2) % 2], group=f"g{i // 2}", gen_version=i % (gen_mod + 1),
                        prompt_ids=torch.arange(4), response_ids=torch.arange(4 + (i * 7) % 11), scalars={"r": 1.0})
             for i in range(48)]
    planes, sinks = [], []
    for _ in range(2):
        sink: list = []
        p = _plane(sink)
        assert not Producer(p).put_many(trajs)["errors"]
        p.admission.close()
        planes.append(p)
        sinks.append(sink)
    one, batched = planes
    entries = _stream_entries(one)
    assert entries == _stream_entries(batched)
    k = 0
    version = 0
    for rank, rows in enumerate(entries):
        chunk: list[list[int]] = []
        for e in rows:
            if bumps[k % len(bumps)]:
                version += 1
                one.positions.report_version(version)
            one.positions.handed(rank, e.j, e.minibatch, e.microbatch)
            chunk.append([e.j, e.minibatch, e.microbatch, e.j, version])
            if cuts[k % len(cuts)]:
                batched.positions.handed_many(rank, chunk)
                chunk = []
            k += 1
        if chunk:
            batched.positions.handed_many(rank, chunk)
        if rows:
            one.positions.commit(rank, rows[-1].j + 1)
            batched.positions.commit(rank, rows[-1].j + 1)
    a, b = _handout_view(one, sinks[0]), _handout_view(batched, sinks[1])
    assert a == b
    assert sorted(i for ids in a["released"].values() for i in ids) == sorted(t.id for t in trajs)


# ------------------------------------------------------------------------------------ the delivered-ids memory
@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=6), reset_at=st.integers(0, 6))
def test_observations_keep_one_slot_per_rank_across_resizes(sizes, reset_at):
    """:class:`~knitdata.control.observed.Observations` (the reporting part's state): a resize keeps the slots of
    the ranks that stay (a reset empties them), and only ``staleness`` is in its snapshot slice."""
    from knitdata.control.observed import Observations

    obs = Observations(["a", "b"], 3)
    obs.staleness.extend([1, 2])
    for k, n in enumerate(sizes):
        before = [list(d) for d in obs.staleness_by_rank]
        for r, d in enumerate(obs.staleness_by_rank):
            d.append(r)
        obs.consumer_stats = [{"r": r} for r in range(len(obs.consumer_stats))]
        obs.resize(n, reset=k == reset_at)
        assert len(obs.staleness_by_rank) == len(obs.consumer_stats) == n
        keep = min(n, len(before))
        if k == reset_at:
            assert all(not d for d in obs.staleness_by_rank) and obs.consumer_stats == [None] * n
        else:
            assert [list(d) for d in obs.staleness_by_rank[:keep]] == [b + [r] for r, b in enumerate(before[:keep])]
            assert obs.consumer_stats[:keep] == [{"r": r} for r in range(keep)]
            assert obs.consumer_stats[keep:] == [None] * (n - keep)
    assert obs.state_dict() == {"staleness": [1, 2]}
    other = Observations(["a"], 1)
    other.load_state_dict({"staleness": [5]})
    assert list(other.staleness) == [5] and other.staleness.maxlen == obs.staleness.maxlen


def test_a_lease_book_gives_each_taker_a_new_epoch():
    """The leases part's state: each take of a (rank, worker, replica) lease is a new epoch; holders default to
    the token's first 8 characters."""
    from knitdata.control.state import LeaseBook

    book = LeaseBook(None)
    a = book.take((0, 0, 0), "token-aaaa-1", "", 1.0)
    b = book.take((0, 0, 0), "token-bbbb-2", "me", 2.0)
    c = book.take((1, 0, 0), "token-cccc-3", "", 3.0)
    assert (a.epoch, b.epoch, c.epoch) == (1, 2, 1) and a.holder == "token-aa" and b.holder == "me"
    assert book.leases == {(0, 0, 0): b, (1, 0, 0): c} and book.producer_timeout_s is None


def test_acquire_rollout_for_a_version_out_of_the_bound_raises_at_once() -> None:
    # new-user audit: acquire_rollout(version=0) with the trainer at version 3 and max_staleness=1 can never get room
    # (the window only shrinks), yet it waited the whole timeout (10 s) and said "the trainer must advance first"
    import time

    import torch

    from knitdata import Pipeline
    from knitdata.errors import RolloutThrottled

    pipe = Pipeline(BatchSpec({"math": 2}, num_minibatches=1, group_size=1), max_staleness=1, on_stale="wait",
                    num_consumers=1, token_budget=64)
    try:
        pipe.report_version(0)
        it = iter(pipe.dataset(0, timeout=10))
        for step in range(3):
            pipe.acquire_rollout("math", 2, timeout=5)
            for k in range(2):
                pipe.put(Trajectory(id=f"s{step}-{k}", source="math", group=f"s{step}-{k}",
                                    prompt_ids=torch.arange(2), response_ids=torch.arange(3), gen_version=step))
            next(it)
            pipe.report_version(step + 1)
        assert pipe.rollout_capacity(0) == {"math": 0}
        t0 = time.monotonic()
        with pytest.raises(RolloutThrottled) as exc:  # at once: retry with newer weights
            pipe.acquire_rollout("math", 1, version=0, timeout=10)
        assert time.monotonic() - t0 < 2
        msg = str(exc.value)
        assert all(w in msg for w in ("'math'", "version 0", "version 3", "max_staleness 1")), msg
        assert "must advance" not in msg
        pipe.acquire_rollout("math", 1, version=3, timeout=5)  # a current version still gets room
    finally:
        pipe.close()
