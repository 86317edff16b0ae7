"""Tensor/pipeline-parallel replicas (issue 25.2): the replicas of a data-parallel rank receive the same
micro-batches, keep positions and leases of their own, and count as one consumer for release; the layout comes
from a DeviceMesh or process groups (gloo, 4 processes: dp 2 x tp 2)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _conformance as cf  # noqa: E402

import knitdata  # noqa: E402
from knitdata import Pipeline  # noqa: E402
from knitdata.control.plane import ControlPlane  # noqa: E402
from knitdata.errors import ConfigError, FencedError  # noqa: E402
from knitdata.parallel import ReplicaLayout, from_process_groups, replica_layout  # noqa: E402


def _filled(n_groups: int = 8, dp: int = 2, **kw: Any) -> Pipeline:
    pipe = cf.make_pipeline("embedded", cf.spec_for(n_groups), nodes=1, ranks_per_node=dp, **kw)
    for t in cf.workload(n_groups):
        pipe.put(t)
    pipe.close()
    return pipe


def _ref(n_groups: int = 8, dp: int = 2) -> list[list[Any]]:
    pipe = _filled(n_groups, dp)
    return [[cf._replica_row(mb) for mb in pipe.dataset(r)] for r in range(dp)]


def test_replicas_in_threads_get_byte_identical_streams_and_release_once_all_are_past():
    ref = _ref()
    pipe = _filled()
    streams: dict[tuple[int, int], list[Any]] = {}

    def consume(rank: int, replica: int) -> None:
        streams[(rank, replica)] = [cf._replica_row(mb)
                                    for mb in pipe.dataset(rank, replica=replica, num_replicas=2, timeout=60)]

    threads = [threading.Thread(target=consume, args=(r, k)) for r in range(2) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    for r in range(2):
        assert streams[(r, 0)] == streams[(r, 1)] == ref[r]
    st_ = pipe.stats_light()
    assert st_["held_trajectories"] == 0 and st_["released"] == 16 and st_["held_microbatches"] == [0, 0]


def test_release_waits_for_the_slowest_replica_and_each_resumes_on_its_own():
    ref = _ref()
    pipe = _filled()
    fast = pipe.dataset(0, replica=0, num_replicas=2)
    assert [cf._replica_row(mb) for mb in fast] == ref[0]
    pipe.stats_light()
    assert pipe.internals.control.state.committed[0] == 0 and pipe.internals.control.state.replicas.committed[0] == [len(ref[0]), 0]
    unit = next(iter(pipe.internals.control.state.unit_nodes))
    assert f"its replicas committed up to [{len(ref[0])}, 0]" in pipe.internals.control.reporting.holders(unit)  # what StoreFull says
    slow = pipe.dataset(0, replica=1, num_replicas=2)
    it = iter(slow)
    head = [cf._replica_row(next(it)) for _ in range(3)]
    state = json.loads(json.dumps(slow.state_dict()))
    assert state["replica"] == 1 and state["num_replicas"] == 2 and state["next"] == 3
    slow.commit(state, wait=True)
    assert pipe.internals.control.state.committed[0] == 3  # the smallest of the replicas' commits
    slow.close()
    again = pipe.dataset(0, replica=1, num_replicas=2)  # a restarted replica 1: loads its own state
    again.load_state_dict(state)
    assert head + [cf._replica_row(mb) for mb in again] == ref[0]
    assert pipe.stats_light()["committed"][0] == 3  # release="step": never past the state it loaded...
    again.commit(wait=True)  # ...until it commits a later one
    st_ = pipe.stats_light()
    assert st_["committed"][0] == len(ref[0]) and st_["held_microbatches"][0] == 0


def test_a_new_replica_dataset_without_state_continues_after_its_own_last_hand_out():
    ref = _ref()
    pipe = _filled()
    a = iter(pipe.dataset(0, replica=0, num_replicas=2))
    b = iter(pipe.dataset(0, replica=1, num_replicas=2))
    got_a = [cf._replica_row(next(a)) for _ in range(4)]
    got_b = [cf._replica_row(next(b)) for _ in range(1)]
    # a second iterator of replica 1 fences the first one and starts after replica 1's last hand-out; replica 0 goes on
    b2 = iter(pipe.dataset(0, replica=1, num_replicas=2))
    got_b += [cf._replica_row(mb) for mb in b2]
    with pytest.raises(FencedError, match="rank 0 replica 1"):
        next(b)
    got_a += [cf._replica_row(mb) for mb in a]
    assert got_a == got_b == ref[0]


@pytest.mark.parametrize("release", ["step", "handout", "commit"])
def test_every_release_mode_releases_once_every_replica_is_past(release):
    ref = _ref()
    pipe = _filled(release=release)
    a = pipe.dataset(0, replica=0, num_replicas=3)
    rows = [cf._replica_row(mb) for mb in a]
    assert rows == ref[0]
    a.commit(wait=True)
    assert pipe.stats_light()["held_microbatches"][0] == len(ref[0])  # replicas 1 and 2 have not taken them
    b = pipe.dataset(0, replica=1, num_replicas=3)
    c = pipe.dataset(0, replica=2, num_replicas=3)
    it_b, it_c = iter(b), iter(c)
    for _ in range(2):
        next(it_b)
    for _ in range(3):
        next(it_c)
    b.commit(wait=True)
    c.commit(wait=True)
    held = pipe.stats_light()["held_microbatches"][0]
    assert held == len(ref[0]) - 2, (release, held)  # replica 1 handed out (and committed) 2 micro-batches
    snap = json.loads(json.dumps(pipe.internals.control.state_dict()))  # loads back, positions and all
    assert ControlPlane.from_state_dict(snap, lambda u, ids, w: None).state.replicas.to_dict() == snap["replicas"]
    assert [cf._replica_row(mb) for mb in it_b] == ref[0][2:] and [cf._replica_row(mb) for mb in it_c] == ref[0][3:]
    b.commit(wait=True)
    c.commit(wait=True)
    assert pipe.stats_light()["held_microbatches"] == [0, len(_ref()[1])]  # rank 0 released, rank 1 not consumed


def test_inconsistent_or_bad_replica_arguments_are_refused():
    pipe = _filled()
    with pytest.raises(ConfigError, match="go together"):
        pipe.dataset(0, replica=1)
    with pytest.raises(ConfigError, match="go together"):
        pipe.dataset(0, replica=2, num_replicas=2)
    with pytest.raises(ConfigError, match="data-parallel rank"):
        pipe.dataset(replica=0, num_replicas=2)
    pipe.dataset(0, replica=0, num_replicas=2)
    with pytest.raises(ConfigError, match="num_replicas=4 disagrees with the 2 replicas"):
        pipe.dataset(1, replica=3, num_replicas=4)
    with pytest.raises(ConfigError, match="replica must be an int in 0..1"):
        pipe.internals.control.positions.seek(0, 1, 2)


def test_replica_positions_survive_a_control_plane_snapshot():
    pipe = _filled()
    ds = pipe.dataset(1, replica=1, num_replicas=2)
    it = iter(ds)
    next(it)
    ds.commit(wait=True)
    snap = json.loads(json.dumps(pipe.internals.control.state_dict()))
    assert snap["replicas"]["num"] == 2 and snap["replicas"]["committed"][1] == [0, 1]
    plane = ControlPlane.from_state_dict(snap, lambda unit, ids, wait: None)
    assert plane.state.replicas.to_dict() == snap["replicas"] and plane.positions.start_point(1, 1).next == 1
    bad = {**snap, "replicas": {**snap["replicas"], "committed": [[0, 0], [2, 2]]}}
    with pytest.raises(knitdata.StateError, match="replicas.committed"):
        ControlPlane.from_state_dict(bad, lambda unit, ids, wait: None)


def test_replica_calls_are_journaled_and_recovered(tmp_path):
    from knitdata.control.journal import Journal

    pipe = _filled()
    snap = json.loads(json.dumps(pipe.internals.control.state_dict()))
    units = snap["unit_nodes"]
    a = ControlPlane(snap["config"], units, lambda u, ids, w: None, journal=Journal(tmp_path / "j"))
    a.load_state_dict(snap)
    a.compact()  # the journal starts from this snapshot
    a.positions.register_replicas(3)
    a.positions.handed_many(0, [[0, 0, 0, 0], [1, 0, 1, 0]], 2)
    a.positions.commit(0, 2, 2)
    a.positions.commit(0, 1, 1)
    a.positions.seek(0, 1, 0)
    a.positions.handed_many(1, [[0, 0, 0, 0]], 1)
    b = ControlPlane(snap["config"], units, lambda u, ids, w: None)
    b.recover(str(tmp_path / "j"))
    assert b.state.replicas.to_dict() == a.state.replicas.to_dict()
    assert b.state.replicas.committed[0] == [1, 1, 2] and b.state.committed[0] == a.state.committed[0] == 1
    assert [b.positions.start_point(0, k).next for k in range(3)] == [1, 1, 2]
    with pytest.raises(ConfigError, match="disagrees"):
        b.positions.register_replicas(2)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_replicas=st.integers(2, 3), ops=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(
    ["take", "take", "save", "crash"])), max_size=14))
def test_replicas_that_take_save_and_crash_in_any_order_each_get_the_rank_stream_once(num_replicas, ops):
    """Each replica of rank 0 takes micro-batches, saves and commits states, and crashes (its trainer rolls back to
    its last saved state, or to the start) in any interleaving: after draining, every replica's stream since its
    last restore continues its saved prefix exactly, and equals the rank's stream; nothing released too early
    raises StateError, and once all are done and committed rank 0 holds nothing."""
    ref = _ref()[0]
    pipe = _filled()
    rows: list[list[Any]] = [[] for _ in range(num_replicas)]
    saved: list[tuple[dict[str, Any], int] | None] = [None] * num_replicas
    ds: list[Any] = [pipe.dataset(0, replica=k, num_replicas=num_replicas) for k in range(num_replicas)]
    its: list[Any] = [iter(d) for d in ds]
    for k, op in ops:
        k %= num_replicas
        if op == "take":
            mb = next(its[k], None)
            if mb is not None:
                rows[k].append(cf._replica_row(mb))
        elif op == "save":
            state = json.loads(json.dumps(ds[k].state_dict()))
            ds[k].commit(state)
            saved[k] = (state, len(rows[k]))
        else:  # crash: a new dataset loads the last saved state (none saved: it continues after its last hand-out)
            ds[k].close()
            ds[k] = pipe.dataset(0, replica=k, num_replicas=num_replicas)
            if saved[k] is not None:
                ds[k].load_state_dict(saved[k][0])
                rows[k] = rows[k][: saved[k][1]]
            its[k] = iter(ds[k])
    for k in range(num_replicas):
        rows[k] += [cf._replica_row(mb) for mb in its[k]]
        assert rows[k] == ref, k
        ds[k].commit(wait=True)
    assert pipe.stats_light()["held_microbatches"][0] == 0


# ------------------------------------------------------------------------------------------------ layouts
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dp=st.integers(1, 4), tp=st.integers(1, 4), pp=st.integers(1, 3))
def test_layout_from_a_mesh_like_object_covers_every_rank_once(dp, tp, pp):
    class Mesh:  # the DeviceMesh calls replica_layout uses, for a (pp, dp, tp) grid
        mesh_dim_names = ("pp", "dp", "tp")

        def __init__(self, coords):
            self.coords = coords
            self.mesh = type("T", (), {"shape": (pp, dp, tp)})()

        def get_coordinate(self):
            return self.coords

    seen = {}
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                lay = replica_layout(Mesh([p, d, t]))
                assert (lay.rank, lay.num_ranks, lay.num_replicas) == (d, dp, tp * pp)
                seen[(lay.rank, lay.replica)] = (p, d, t)
    assert len(seen) == dp * tp * pp  # every (rank, replica) once


def test_layout_errors():
    with pytest.raises(ConfigError, match="mesh_dim_names"):
        replica_layout(object())
    with pytest.raises(ConfigError, match="no data-parallel dimension"):
        replica_layout(type("M", (), {"mesh_dim_names": ("tp",)})())
    with pytest.raises(ConfigError, match="replica < num_replicas"):
        ReplicaLayout(rank=0, num_ranks=1, replica=2, num_replicas=2)
    with pytest.raises(ConfigError, match="initialized"):
        from_process_groups(None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One of 4 processes (dp 2 x tp 2): the layout from the mesh and from its groups; the replicas of each rank
    take that rank's micro-batches (each process fills the same pipeline: plans are deterministic) and all-gather
    their digests."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        lay = replica_layout(mesh)
        lay2 = from_process_groups(mesh.get_group("dp"), mesh.get_group("tp"))
        pipe = _filled()
        rows = [cf._replica_row(mb) for mb in pipe.dataset(**lay.dataset_kwargs())]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, [lay.rank, lay.replica, lay.num_replicas, rows])
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump({"layout": [lay.rank, lay.num_ranks, lay.replica, lay.num_replicas],
                       "groups": [lay2.rank, lay2.num_ranks, lay2.replica, lay2.num_replicas],
                       "gathered": gathered}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_gloo_dp2_tp2_layout_from_mesh_and_groups(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_gloo_worker, args=(4, _free_port(), str(tmp_path)), nprocs=4, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail("the 4 gloo processes did not finish within 180 s (hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    outs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    # global rank g = dp * 2 + tp (mesh order): dp rank and replica from either source
    assert [o["layout"] for o in outs] == [[g // 2, 2, g % 2, 2] for g in range(4)]
    assert [o["groups"] for o in outs] == [o["layout"] for o in outs]
    gathered = outs[0]["gathered"]
    by = {(g[0], g[1]): g[3] for g in gathered}
    ref = _ref()
    for r in range(2):
        assert by[(r, 0)] == by[(r, 1)] == [list(x) for x in json.loads(json.dumps(ref[r]))]
