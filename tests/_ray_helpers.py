"""Helpers of the Ray engine tests: a local multi-node Ray cluster in a subprocess, and scenario drivers.

Run as a script:

* ``python tests/_ray_helpers.py serve --nodes 3`` starts a ``ray.cluster_utils.Cluster`` (every node on
  127.0.0.1, dashboard off, its own object store), prints one JSON line ``{"address", "nodes",
  "startup_s"}`` and keeps it up until stdin closes (then shuts it down).
* ``python tests/_ray_helpers.py scenario NAME --address ADDR --args JSON`` attaches to that cluster, runs
  one scenario and prints its JSON result as the last line of stdout.

The pytest process never imports Ray: a Ray crash can only fail a subprocess, and every subprocess runs
under a hard timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ClusterProcess", "run_scenario", "run_json_subprocess", "ray_env", "SCENARIOS"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable


def ray_env() -> dict[str, str]:
    """The environment of the Ray subprocesses (this checkout on ``PYTHONPATH``, one OpenMP thread)."""
    env = dict(os.environ)
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_DEDUP_LOGS="0",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


class ClusterProcess:
    """A local multi-node Ray cluster owned by a subprocess (context manager).

    Args:
        nodes: Number of nodes (the head included).
        cpus: Logical CPUs per node (generous: actors reserve them, the machine has 2 cores).
        store_mb: Object store per node in MiB.
        timeout_s: How long start-up may take.
    """

    def __init__(self, nodes: int = 3, cpus: int = 8, store_mb: int = 128, timeout_s: float = 120.0) -> None:
        self.args = [PY, str(Path(__file__).resolve()), "serve", "--nodes", str(nodes), "--cpus", str(cpus),
                     "--store-mb", str(store_mb)]
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    def __enter__(self) -> ClusterProcess:
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=ray_env(), start_new_session=True)
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        deadline = time.monotonic() + self.timeout_s
        line = ""
        while time.monotonic() < deadline:
            if sel.select(timeout=1.0):
                line = self.proc.stdout.readline()  # type: ignore[union-attr]
                if line.startswith("{"):
                    break
                if not line and self.proc.poll() is not None:
                    break
            elif self.proc.poll() is not None:
                break
        if not line.startswith("{"):
            err = self._stop()
            raise RuntimeError(f"the Ray cluster did not start within {self.timeout_s} s:\n{err[-4000:]}")
        self.info = json.loads(line)
        if any(ip != "127.0.0.1" for ip in self.info["ips"]):
            self._stop()
            raise RuntimeError(f"refusing a cluster that is not on loopback: {self.info['ips']}")
        return self

    @property
    def address(self) -> str:
        """The cluster's GCS address."""
        return self.info["address"]

    def _stop(self) -> str:
        p = self.proc
        if p is None:
            return ""
        try:
            if p.stdin:
                p.stdin.close()
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        err = p.stderr.read() if p.stderr else ""
        self.proc = None
        return err

    def __exit__(self, *exc: object) -> None:
        self._stop()


def run_json_subprocess(cmd: list[str], label: str, timeout_s: float = 120.0) -> Any:
    """Run ``cmd`` (a Ray driver subprocess) under a hard time-out; return the last JSON line it printed."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ray_env(),
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"{label} timed out after {timeout_s} s:\n{err[-4000:]}") from None
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise AssertionError(f"{label} failed (rc {p.returncode}):\n{out[-2000:]}\n{err[-6000:]}")
    return json.loads(lines[-1])


def run_scenario(address: str, name: str, timeout_s: float = 120.0, **kwargs: Any) -> dict[str, Any]:
    """Run scenario ``name`` in a fresh driver subprocess attached to ``address``; return its JSON result."""
    cmd = [PY, str(Path(__file__).resolve()), "scenario", name, "--address", address, "--args", json.dumps(kwargs)]
    return run_json_subprocess(cmd, f"scenario {name!r}", timeout_s)


# ---------------------------------------------------------------------------------------------- serve
def _serve(nodes: int, cpus: int, store_mb: int) -> None:
    t0 = time.perf_counter()
    import ray
    from ray.cluster_utils import Cluster

    common = {"num_cpus": cpus, "object_store_memory": store_mb << 20, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={**common, "include_dashboard": False, "resources": {"kd_node0": 1}})
    try:
        for i in range(1, nodes):
            cluster.add_node(**common, resources={f"kd_node{i}": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False)
        alive = [n for n in ray.nodes() if n["Alive"]]
        order = sorted(alive, key=lambda n: next(int(k[7:]) for k in n["Resources"] if k.startswith("kd_node")))
        info = {"address": cluster.address, "nodes": [n["NodeID"] for n in order],
                "ips": [n["NodeManagerAddress"] for n in order], "startup_s": time.perf_counter() - t0}
        ray.shutdown()
        print(json.dumps(info), flush=True)
        sys.stdin.read()  # until the parent closes stdin
    finally:
        ray.shutdown()
        cluster.shutdown()


# ------------------------------------------------------------------------------------------ scenarios
SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {}


def scenario(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Register a scenario."""
    SCENARIOS[fn.__name__] = fn
    return fn


def make_traj(i: int, *, group: str | None = None, source: str = "math", tokens: int = 64, extra: int = 0) -> Any:
    """A small deterministic trajectory (``extra`` float32 elements of payload in a tensor field)."""
    import torch

    from knitdata.record import Trajectory

    g = torch.Generator().manual_seed(i)
    p = 8
    return Trajectory(
        id=f"t{i}", source=source, group=group if group is not None else f"g{i}", gen_version=i % 3,
        prompt_ids=torch.randint(0, 1000, (p,), generator=g), response_ids=torch.randint(0, 1000, (tokens - p,), generator=g),
        scalars={"reward": float(i)}, tensors={"blob": torch.rand(extra, generator=g)} if extra else {},
    )


def _nodes() -> list[str]:
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    return [n["NodeID"] for n in sorted(alive, key=lambda n: next(int(k[7:]) for k in n["Resources"]
                                                                     if k.startswith("kd_node")))]


@scenario
def units_basic(extra: int = 20_000) -> dict[str, Any]:
    """Units on two nodes read from the driver's node (zero-copy, counters), and backpressure."""
    import ray

    from knitdata.engines.ray.connect import current_node
    from knitdata.engines.ray.metrics import TransferMeter
    from knitdata.engines.ray.unit import RayStorageUnit, read_records
    from knitdata.errors import StoreFull

    nodes = _nodes()
    trajs = [make_traj(i, extra=extra) for i in range(6)]
    units = RayStorageUnit.create_many([("u0", nodes[0]), ("u1", nodes[1])], 1 << 24, prefix="basic")
    units["small"] = RayStorageUnit.create("small", nodes[1], trajs[0].nbytes + 10, prefix="basic")
    for i, t in enumerate(trajs):
        units[f"u{i % 2}"].put(t, timeout=5)
    meter = TransferMeter()
    recs = read_records([(t.id, units[f"u{i % 2}"]) for i, t in enumerate(trajs)], meter=meter, mode="iter",
                        placement="p")
    from knitdata.codec import decode_trajectory

    equal = [decode_trajectory(r, copy=False).equals(t) for r, t in zip(recs, trajs)]
    writable = [bool(r.flags.writeable) for r in recs]
    got = units["u0"].get(["t0", "t2"])  # StorageUnit API: zero-copy decode
    small = units["small"]
    small.put(trajs[0], timeout=0)
    t0 = time.perf_counter()
    try:
        small.put(trajs[1], timeout=0.3)
        full = False
    except StoreFull:
        full = True
    waited = time.perf_counter() - t0
    small.release(["t0"])
    small.put(trajs[1], timeout=1)
    # with a spill directory the same tiny unit takes both: the second stays on disk, reloaded on fetch
    import tempfile

    spilled = RayStorageUnit.create("spilled", nodes[1], trajs[0].nbytes + 10, prefix="basic",
                                    spill_dir=tempfile.mkdtemp(prefix="kd-spill-"))
    spilled.put(trajs[2], timeout=0)
    spilled.put(trajs[3], timeout=0)
    spill_equal = [g.equals(t) for g, t in zip(spilled.get(["t2", "t3"]), trajs[2:4])]
    spill_stats = ray.get(spilled.actor.spill_stats.remote())
    spill_used = spilled.stats().used_bytes
    # the in-process Pipeline with engine="ray": its control plane here, its payloads in Ray units on two nodes
    from knitdata.admission import BatchSpec
    from knitdata.pipeline import Pipeline
    from knitdata.placement import ConsumerLayout

    pipe = Pipeline(BatchSpec({"math": 4}, num_minibatches=2), layout=ConsumerLayout(["a", "b"]), engine="ray",
                    token_budget=1024, engine_options={"address": os.environ["KD_RAY_ADDRESS"], "name": "inproc",
                                                       "nodes": nodes[:2]})
    for t in trajs[:4]:
        pipe.put(t)
    pipe.close()
    inproc = [[i for mb in pipe.dataset(r, fetch="eager") for i in mb.info.trajectory_ids] for r in range(2)]
    unit_nodes = {u: unit.node for u, unit in pipe.units.items()}
    return {"equal": equal + [g.equals(t) for g, t in zip(got, [trajs[0], trajs[2]])], "writable": writable,
            "spill_equal": spill_equal, "spill_stats": spill_stats, "spill_used": spill_used,
            "inproc": inproc, "inproc_unit_nodes": unit_nodes,
            "meter": meter.to_dict(), "full": full, "waited": waited, "stats": small.stats().to_dict(),
            "node": current_node(), "nodes": nodes, "nbytes": [t.nbytes for t in trajs]}


# ------------------------------------------------------------------------------------ pipeline scenarios
def workload(n_groups: int = 24, group_size: int = 2, extra: int = 25_000) -> list[Any]:
    """``n_groups`` GRPO groups over two sources (deterministic)."""
    out = []
    for g in range(n_groups):
        for k in range(group_size):
            i = g * group_size + k
            out.append(make_traj(i, group=f"g{g}", source=("math", "code")[g % 2], tokens=48 + 16 * (i % 3),
                                 extra=extra))
    return out


def _spec(n: int, group_size: int = 2, m: int = 2) -> Any:
    from knitdata.admission import BatchSpec

    half = n // 4  # two train batches
    return BatchSpec({"math": half, "code": half}, num_minibatches=m, group_size=group_size)


def _consumer_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Consumer:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def consume(self, name: str, rank: int, fetch: str, fail_ok: bool = False, limit: int | None = None,
                    start: int | None = None) -> dict[str, Any]:
            from knitdata import Pipeline
            from knitdata.errors import TrajectoryLostError

            ds = Pipeline.attach(name).dataset(rank, fetch=fetch)
            if start is not None:
                ds.load_state_dict({**ds.state_dict(), "next": start})
            out: dict[str, Any] = {"ids": [], "infos": [], "error": None}
            t0 = time.perf_counter()
            try:
                for mb in ds:
                    out["ids"].append(list(mb.info.trajectory_ids))
                    out["infos"].append([mb.info.minibatch, mb.info.microbatch, mb.info.num_microbatches])
                    if mb.info.trajectory_ids and mb.input_ids.shape[0] != len(mb.info.trajectory_ids):
                        raise AssertionError("collated rows differ from the info's ids")
                    if limit is not None and len(out["ids"]) >= limit:
                        break
            except TrajectoryLostError as e:
                if not fail_ok:
                    raise
                out["error"] = str(e)
                out["lost"] = list(e.trajectory_ids)
            out["seconds"] = time.perf_counter() - t0
            out["next"] = ds.state_dict()["next"]
            out["committed"] = ds.commit(wait=True) if out["error"] is None else None
            return out

    return Consumer


def _consumers(nodes: list[str]) -> list[Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cls = _consumer_class()
    cs = [cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes]
    got = ray.get([c.node.remote() for c in cs], timeout=120)
    if got != nodes:
        raise AssertionError(f"consumers landed on {got}, expected {nodes}")
    return cs


@scenario
def placement_nodes(n_groups: int = 48, extra: int = 25_000) -> dict[str, Any]:
    """Three nodes, one rank each (fetch iter / eager / sample), both placements on one workload."""
    from benchmarks.placement import compare_placements, make_workload, summarize

    trajs = make_workload(n_groups, 2, extra)
    runs = compare_placements(_nodes(), trajs, fetch=["iter", "eager", "sample"], token_budget=512)
    out = {"summary": summarize(runs, trajs), "all_ids": [t.id for t in trajs]}
    for p, run in runs.items():
        out[p] = {"results": run["results"], "committed": run["stats"]["committed"],
                  "planned": run["stats"]["planned"], "held": run["stats"]["held_trajectories"],
                  "units": run["stats"]["units"]}
    return out


@scenario
def ray_shut_down_first(n: int = 4) -> dict[str, Any]:
    """``ray.shutdown()`` while a pipeline still lives here (its producer's presence keeps the sender's heartbeat
    going): the heartbeats that follow raise a knitdata error on the sender's thread instead of starting a new Ray
    from it (which made Ray end the process, exit status 1), and a control call made then names the pipeline."""
    import ray

    from knitdata.admission import BatchSpec
    from knitdata.consumer.handoff import HEARTBEAT_S
    from knitdata.errors import EngineError
    from knitdata.pipeline import Pipeline

    pipe = Pipeline(BatchSpec({"math": n}, num_minibatches=2), engine="ray", token_budget=1024,
                    engine_options={"address": os.environ["KD_RAY_ADDRESS"], "name": f"shut-{os.getpid()}",
                                    "nodes": _nodes()[:1]})
    for i in range(n):
        pipe.put(make_traj(i, group=f"g{i}"))
    ray.shutdown()
    time.sleep(4 * HEARTBEAT_S)  # heartbeats while Ray is down
    try:
        pipe.stats_light()
        error = None
    except EngineError as e:
        error = str(e)
    return {"error": error, "ray_up": ray.is_initialized()}


def _gloo_rank(rank: int, world: int, port: int, name: str, address: str, outdir: str) -> None:
    import torch
    import torch.distributed as dist

    from knitdata import Pipeline

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ds = Pipeline.attach(name, address=address).dataset(fetch="iter")  # rank from the process group
        ids, infos = [], []
        for mb in ds:
            ids.append(list(mb.info.trajectory_ids))
            infos.append([mb.info.minibatch, mb.info.microbatch, mb.info.num_microbatches])
            t = torch.tensor([mb.info.minibatch], dtype=torch.int64)
            dist.all_reduce(t)  # every rank steps through the same mini-batches (no DDP hang)
            if int(t) != world * mb.info.minibatch:
                raise AssertionError(f"ranks disagree on the mini-batch: {int(t)}")
        ds.commit(wait=True)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": ds.rank, "ids": ids, "infos": infos}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@scenario
def gloo_ranks(outdir: str, n_groups: int = 16) -> dict[str, Any]:
    """Two torch.distributed (gloo) ranks in separate processes, ranks taken from the process group."""
    import torch.multiprocessing as mp

    from knitdata import Pipeline
    from knitdata.placement import ConsumerLayout

    nodes = _nodes()
    address = os.environ["KD_RAY_ADDRESS"]
    name = f"gloo-{os.getpid()}"
    pipe = Pipeline(_spec(2 * n_groups), layout=ConsumerLayout(["n0", "n1"]), engine="ray", token_budget=128,
                    capacity_bytes=64 << 20, engine_options={"nodes": nodes[:2], "name": name})
    trajs = workload(n_groups, extra=1000)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, 2, port, name, address, outdir)) for r in range(2)]
    for p in procs:
        p.start()
    # half the trajectories from this process, half from a producer task on another node (attaches by name)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def producer(lo: int, hi: int) -> list[str]:
        from knitdata import Pipeline

        client = Pipeline.attach(name)
        locs = [client.put(t).location for t in workload(n_groups, extra=1000)[lo:hi]]
        client.flush_meter()
        return locs

    half = len(trajs) // 2
    remote = producer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[2], soft=False)).remote(
        half, len(trajs))
    for t in trajs[:half]:
        pipe.put(t)
    remote_locations = ray.get(remote, timeout=150)
    pipe.close()
    for p in procs:
        p.join(timeout=150)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    ranks = []
    for r in range(2):
        path = os.path.join(outdir, f"rank{r}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else None)
    stats = pipe.stats()
    pipe.shutdown()
    return {"codes": codes, "ranks": ranks, "all_ids": [t.id for t in trajs], "committed": stats["committed"],
            "remote_locations": remote_locations, "put_counters": stats["transfer"]["put"],
            "planned": stats["planned"], "held": stats["held_trajectories"]}


def _take(it: Any, n: int) -> list[Any]:
    out = []
    for _ in range(n):
        mb = next(it)
        out.append([list(mb.info.trajectory_ids), [mb.info.minibatch, mb.info.microbatch]])
    return out


@scenario
def workers_resume(num_workers: int = 2, n_groups: int = 16, stop_after: int = 5, fetch: str = "iter") -> dict[str, Any]:
    """DataLoader worker processes split a rank's micro-batches; resume from a committed loader state."""
    from knitdata import Pipeline

    name = f"wr-{os.getpid()}"
    pipe = Pipeline(_spec(2 * n_groups), num_consumers=1, engine="ray", token_budget=80, capacity_bytes=64 << 20,  # 48-80 tokens each
                    engine_options={"nodes": _nodes()[:1], "name": name})
    trajs = workload(n_groups, extra=1000)
    for t in trajs:
        pipe.put(t)
    # bad puts through the Ray client are refused with the trajectory's id; nothing accepted is affected
    from knitdata.errors import KnitdataError
    from knitdata.record import MediaItem

    refused: dict[str, list[Any]] = {}
    odd = make_traj(9000, extra=1000)
    odd.scalars = {"reward": 1.0, "extra_score": 2.0}
    pipe.withdraw("g-withdrawn")
    late = make_traj(9001, group="g-withdrawn", extra=1000)
    broken = make_traj(9002, extra=1000)
    broken.media = [MediaItem("image", data=b"not an image")]
    for label, t in (("schema", odd), ("withdrawn", late), ("media", broken)):
        try:
            pipe.put(t)
        except KnitdataError as e:
            refused[label] = [type(e).__name__, getattr(e, "trajectory_id", None), getattr(e, "field", None)]
    pipe.close()
    ds = pipe.dataset(0, fetch=fetch)
    loader = ds.stateful_loader(num_workers=num_workers)
    it = iter(loader)
    before = _take(it, stop_after)
    state = loader.state_dict()
    json.dumps(state)  # JSON-serializable, as the dataset's own state
    committed = ds.commit(state, wait=True)
    lost_progress = _take(it, 2)  # consumed after the checkpoint: comes again after the "crash"
    del it, loader
    ds2 = pipe.dataset(0, fetch=fetch)
    loader2 = ds2.stateful_loader(num_workers=num_workers)
    loader2.load_state_dict(state)
    after = []
    for mb in loader2:
        after.append([list(mb.info.trajectory_ids), [mb.info.minibatch, mb.info.microbatch]])
    ds2.commit(loader2.state_dict(), wait=True)
    stats = pipe.stats()
    final = stats["committed"][0]
    pipe.shutdown()
    # release="handout", in this process (no workers): payloads leave storage as micro-batches are handed out
    pipe = Pipeline(_spec(8), num_consumers=1, engine="ray", token_budget=80, release="handout",
                    engine_options={"nodes": _nodes()[:1], "name": f"ho-{os.getpid()}"})
    for t in workload(4, extra=1000):
        pipe.put(t)
    pipe.close()
    ds3 = pipe.dataset(0, fetch="sample")
    handout_ids = [i for mb in ds3 for i in mb.info.trajectory_ids]
    handout_state = ds3.state_dict()
    time.sleep(0.2)  # releases are sent without waiting
    handout_stats = pipe.stats()
    pipe.shutdown()
    return {"refused": refused, "handout_ids": handout_ids, "handout_held": handout_stats["held_trajectories"],
            "handout_used": [u["used_bytes"] for u in handout_stats["units"].values()],
            "handout_state": handout_state, "handout_planned": handout_stats["planned"], "before": before, "lost_progress": lost_progress, "after": after, "all_ids": [t.id for t in trajs],
            "committed": committed, "final_committed": final, "planned": stats["planned"],
            "held": stats["held_trajectories"], "state": state}


@scenario
def pipeline_killed(spill_root: str, n_groups: int = 12) -> dict[str, Any]:
    """A storage unit dies mid-step: a clear error naming the lost ids; with spill, recovery from shards."""
    import ray

    from knitdata import Pipeline
    from knitdata.placement import ConsumerLayout

    nodes = _nodes()
    consumers = _consumers(nodes[1:3])
    out: dict[str, Any] = {}
    for spill in (False, True):
        name = f"pk-{os.getpid()}-{spill}"
        pipe = Pipeline(
            _spec(2 * n_groups), layout=ConsumerLayout(["n0", "n1"]), token_budget=128, capacity_bytes=64 << 20,
            engine="ray", spill_dir=os.path.join(spill_root, name) if spill else None,
            engine_options={"nodes": nodes[1:3], "name": name})
        trajs = workload(n_groups, extra=5000)
        metas = [pipe.put(t) for t in trajs]
        pipe.close()
        # rank 1 reads its first micro-batch, then its node's unit dies mid-step
        first = ray.get(consumers[1].consume.remote(name, 1, "iter", True, 1), timeout=120)
        pipe.internals.kill_unit("n1")
        time.sleep(0.5)
        results = ray.get([c.consume.remote(name, r, "iter", True, None, first["next"] if r == 1 else None)
                           for r, c in enumerate(consumers)], timeout=120)
        out["spill" if spill else "plain"] = {
            "first": first, "results": results, "on_n1": sorted(m.id for m in metas if m.location == "n1"),
            "all_ids": [t.id for t in trajs]}
        pipe.shutdown()
    return out


@scenario
def coordinator_killed(journal_root: str, n_groups: int = 24, kills: int = 2, compact_every: int = 10_000) -> dict[str, Any]:
    """The coordinator actor is killed (SIGKILL) repeatedly while a producer puts and two ranks consume:
    Ray restarts it, it replays its journal, callers retry; everything is delivered exactly once."""
    import threading

    import ray

    from knitdata import Pipeline
    from knitdata.engines.ray.connect import NAMESPACE
    from knitdata.engines.ray.engine import coordinator_name

    name = f"ck-{os.getpid()}"
    pipe = Pipeline(_spec(2 * n_groups), num_consumers=2, engine="ray", token_budget=128, capacity_bytes=64 << 20,
                    engine_options={"nodes": _nodes()[:1], "name": name, "journal_dir": journal_root,
                                    "journal_compact_every": compact_every})
    trajs = workload(n_groups, extra=1000)
    got: list[list[list[str]]] = [[], []]
    errors: list[str] = []

    def consume(rank: int) -> None:
        try:
            for mb in Pipeline.attach(name).dataset(rank, fetch="iter", timeout=120):
                got[rank].append(list(mb.info.trajectory_ids))
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"rank {rank}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    actor = ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
    every = max(1, len(trajs) // (kills + 1))
    killed = 0
    t0 = time.perf_counter()
    for i, t in enumerate(trajs):
        pipe.put(t)
        if i and i % every == 0 and killed < kills:
            ray.kill(actor, no_restart=False)  # SIGKILL; Ray restarts it
            killed += 1
    pipe.close()
    for t in threads:
        t.join(180)
    info = pipe.internals.control.plumbing.info()
    stats = pipe.stats()
    pipe.shutdown()
    return {"got": got, "all_ids": [t.id for t in trajs], "errors": errors, "killed": killed,
            "restarted": info["restarted"], "replayed": info["replayed"],
            "snapshot_loaded": info["snapshot_loaded"], "held": stats["held_trajectories"],
            "committed": stats["committed"], "planned": stats["planned"], "seconds": time.perf_counter() - t0,
            "journal_exists": os.path.exists(os.path.join(journal_root, f"{name}.journal")),
            "snapshot_exists": os.path.exists(os.path.join(journal_root, f"{name}.journal.snapshot"))}


@scenario
def whole_job_first(spill_root: str, pipeline: str, n_groups: int = 12, take: int = 5) -> dict[str, Any]:
    """The first run of a job: put everything, consume ``take`` micro-batches (a checkpoint and a commit after
    each), take two more without saving, then the whole job dies at once (every process and actor)."""
    from knitdata import Pipeline

    pipe = Pipeline(_spec(2 * n_groups), num_consumers=1, engine="ray", token_budget=128, capacity_bytes=64 << 20,
                    release="commit", spill_dir=spill_root, engine_options={"nodes": _nodes()[:1], "name": pipeline})
    trajs = workload(n_groups, extra=1000)
    pipe.put_many(trajs)
    pipe.close()
    ds = pipe.dataset(0, fetch="iter")
    it = iter(ds)
    saved, state = [], None
    for _ in range(take):
        saved.append(list(next(it).info.trajectory_ids))
        state = ds.state_dict()
        ds.commit(state, wait=True)
    unsaved = [list(next(it).info.trajectory_ids) for _ in range(2)]
    print(json.dumps({"saved": saved, "unsaved": unsaved, "state": state, "all_ids": [t.id for t in trajs]}),
          flush=True)
    os._exit(0)  # the whole job dies: the driver, and with it the coordinator and unit actors it owns


@scenario
def whole_job_resume(spill_root: str, pipeline: str, state: dict[str, Any], trace: str | None = None) -> dict[str, Any]:
    """The restarted job: the same pipeline name and spill directory with resume=True; the consumer loads its state
    (``trace``: traced, so the coordinator records its journal's replay)."""
    from knitdata import Pipeline

    pipe = Pipeline(_spec(24), num_consumers=1, engine="ray", token_budget=128, capacity_bytes=64 << 20,
                    release="commit", spill_dir=spill_root, trace=trace,
                    engine_options={"nodes": _nodes()[:1], "name": pipeline, "resume": True})
    ds = pipe.dataset(0, fetch="iter", timeout=120)
    ds.load_state_dict(state)
    rest = [list(mb.info.trajectory_ids) for mb in ds]
    ds.commit(wait=True)
    stats = pipe.stats()
    info = pipe.internals.control.plumbing.info()
    pipe.shutdown()
    return {"rest": rest, "held": stats["held_trajectories"], "replayed": info["replayed"]}


# ----------------------------------------------------------------------------------------------- main

@scenario
def one_round_trip(n_groups: int = 12) -> dict[str, Any]:
    """Puts on two nodes: how many calls each put makes, where the payloads land, every trajectory once."""
    from knitdata import Pipeline
    from knitdata.engines.ray.unit import RayStorageUnit
    from knitdata.placement import ConsumerAwarePlacement, ConsumerLayout

    nodes = _nodes()[:2]
    trajs = workload(n_groups, 2, extra=2_000)
    name = f"rt-{os.getpid()}"
    pipe = Pipeline(_spec(len(trajs)), layout=ConsumerLayout(["a", "b"]), engine="ray", token_budget=1024,
                    engine_options={"name": name, "nodes": {"a": nodes[0], "b": nodes[1]}})
    calls = {"control": 0, "unit": 0}
    import knitdata.engines.ray.control as ray_control

    real_get = ray_control.ray_get  # every control call that waits for its answer goes through it
    putter = threading.current_thread()

    def counted_get(refs: Any, timeout: float | None = None) -> Any:
        if threading.current_thread() is putter:  # the put's own calls, not the background sender's heartbeats
            calls["control"] += 1
        return real_get(refs, timeout=timeout)

    real_put_admit = RayStorageUnit.put_admit

    def put_admit(self: Any, *a: Any, **kw: Any) -> Any:
        calls["unit"] += 1
        return real_put_admit(self, *a, **kw)

    ray_control.ray_get = counted_get  # type: ignore[assignment]
    RayStorageUnit.put_admit = put_admit  # type: ignore[method-assign]
    first = pipe.put(trajs[0])  # the first put of a process also fetches the placement's view once
    after_first = dict(calls)
    half = len(trajs) // 2
    metas = [first] + [pipe.put(t) for t in trajs[1:half]]
    singles = {"control": calls["control"] - after_first["control"], "unit": calls["unit"] - after_first["unit"]}
    before = dict(calls)
    metas += pipe.put_many(trajs[half:])
    batch = {"control": calls["control"] - before["control"], "unit": calls["unit"] - before["unit"]}
    ray_control.ray_get = real_get  # type: ignore[assignment]
    RayStorageUnit.put_admit = real_put_admit  # type: ignore[method-assign]
    # the plane's own placement, fed the same puts in order, picks the same units
    ref = ConsumerAwarePlacement(list(pipe.units))
    from knitdata.record import TrajectoryMeta

    expected = [ref.place(TrajectoryMeta.from_dict({**t.meta().to_dict(), "seq": i})) for i, t in enumerate(trajs)]
    admit_cpu = pipe.internals.control.plumbing.admit_cpu()  # the coordinator's CPU inside the units' admission calls
    pipe.close()
    got = [pipe.dataset(r, fetch="iter") for r in range(2)]
    ids = sorted(i for ds in got for mb in ds for i in mb.info.trajectory_ids)
    out = {"after_first": after_first, "singles": singles, "singles_n": half - 1, "batch": batch,
           "locations": [m.location for m in metas], "expected": expected, "ids": ids,
           "all_ids": sorted(t.id for t in trajs), "admit_cpu": admit_cpu}
    pipe.shutdown()
    return out


def _traced_consumer_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class TracedRank:
        """A rank in its own process: attaches by name (and so traces), then consumes with some compute."""

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def attach(self, name: str, rank: int) -> None:
            from knitdata import Pipeline

            self.ds = Pipeline.attach(name).dataset(rank, fetch="iter")

        def consume(self, compute_s: float) -> int:
            n = 0
            for _mb in self.ds:
                n += 1
                time.sleep(compute_s)  # the step's compute
            return n

    return TracedRank


@scenario
def traced_run(trace: str, n_groups: int = 16, compute_s: float = 0.0, put_every_s: float = 0.0,
               minibatches: int = 2) -> dict[str, Any]:
    """A traced run on two nodes: this driver puts (one put per ``put_every_s``), one rank per node consumes in its
    own process (a Ray actor attached by name, which traces because the pipeline does); merged by shutdown()."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from knitdata import Pipeline
    from knitdata.placement import ConsumerLayout

    nodes = _nodes()[:2]
    t0 = time.monotonic()
    name = f"trace-{os.getpid()}"
    trajs = workload(n_groups, 2, extra=2_000)
    pipe = Pipeline(_spec(len(trajs), m=minibatches), layout=ConsumerLayout(["n0", "n1"]), engine="ray",
                    token_budget=1024, engine_options={"name": name, "nodes": nodes}, trace=trace)
    cls = _traced_consumer_class()
    ranks = [cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes]
    ray.get([r.attach.remote(name, i) for i, r in enumerate(ranks)], timeout=120)
    runs = [r.consume.remote(compute_s) for r in ranks]
    for t in trajs:
        pipe.put(t)
        time.sleep(put_every_s)
    pipe.close()
    counts = ray.get(runs, timeout=150)
    pipe.shutdown()
    seconds = time.monotonic() - t0
    from knitdata.observe import trace as tracing

    offsets = []
    for part in tracing.parts(trace):
        offsets += [e["args"]["offset_us"] for e in tracing.read_part(part) if e["name"] == "knitdata_clock"]
    return {"seconds": seconds, "microbatches": sum(counts), "offsets_us": offsets}


def main(argv: list[str]) -> int:
    """Entry point of the subprocesses."""
    import argparse

    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--nodes", type=int, default=3)
    s.add_argument("--cpus", type=int, default=8)
    s.add_argument("--store-mb", type=int, default=128)
    c = sub.add_parser("scenario")
    c.add_argument("name")
    c.add_argument("--address", required=True)
    c.add_argument("--args", default="{}")
    a = ap.parse_args(argv)
    if a.cmd == "serve":
        _serve(a.nodes, a.cpus, a.store_mb)
        return 0
    from knitdata.engines.ray.connect import connect

    os.environ["KD_RAY_ADDRESS"] = a.address
    connect(a.address)
    try:
        result = SCENARIOS[a.name](**json.loads(a.args))
    finally:
        import ray

        ray.shutdown()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

