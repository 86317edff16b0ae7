"""``python -m benchmarks control``: control-plane throughput, put latency, commit cost; ``--scale``: planning at cluster scale.

``--scale`` times :meth:`knitdata.planner.Planner.plan` alone (metadata only, no engine; a plan's rows carry
every micro-batch's :class:`~knitdata.planner.MicroBatchInfo`, and each timed call drops the previous plan): one
admitted mini-batch of ``--trajectories`` trajectories (GRPO groups of ``--group-size``, 256 to 16,384 tokens each,
about 12 bytes of payload per token) over ``--nodes`` x ``--ranks-per-node`` consumer ranks and, as a small
reference, over ``--ref-ranks`` ranks. Each group's payloads sit on one node (consumer-aware placement),
except every tenth group, split over two nodes. Reported per (ranks, trajectories): the median
``plan_ms`` over ``--repeats`` plans, the token balance (largest share over the mean share) and the
fraction of payload bytes that cross nodes, with the load average.

Without ``--scale``: for each engine (``--engines``), ``--producers`` producers (threads on the embedded engine,
spawned processes attached with :meth:`Pipeline.attach` on Ray) put 1 KiB and 1 MiB trajectories with ``put()``
and with ``put_many()`` while one consumer drains; reported per point: put-to-admission throughput
(trajectories admitted per second, from the first put to the last admission), p50/p99 latency per trajectory
of the put calls, and (Ray) the coordinator process's CPU time per trajectory from ``/proc`` (and the part of it
spent inside the control plane's admission calls, the rest being Ray's handling of calls) and how many puts
each admission call to the coordinator carried (concurrent puts on a unit share one call). Then a trainer
(one consumer, ``fetch="iter"``, 4 ms of compute per micro-batch) measures its time per optimizer step in data
calls: ``next()``, ``state_dict()`` and ``commit()``.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/control.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import random
import statistics
import threading
import time
from typing import TYPE_CHECKING, Any

from benchmarks.common.output import write_json

if TYPE_CHECKING:  # pragma: no cover
    from knitdata.admission import AdmittedMiniBatch

__all__ = ["add_arguments", "reference_ms", "run", "run_trace_overhead", "run_scale", "run_engines", "run_engine_point", "trainer_data_point", "make_admitted",
           "plan_quality", "SIZES"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks control``."""
    parser.add_argument("--scale", action="store_true", help="plan mini-batches at cluster scale (metadata only)")
    parser.add_argument("--trajectories", type=int, nargs="+", default=[8_000, 64_000],
                        help="trajectories per mini-batch (--scale)")
    parser.add_argument("--group-size", type=int, default=8, help="GRPO group size (--scale)")
    parser.add_argument("--nodes", type=int, default=1_000, help="nodes (--scale)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="consumer ranks per node (--scale)")
    parser.add_argument("--ref-ranks", type=int, default=80, help="ranks of the small reference layout (0: none)")
    parser.add_argument("--token-budget", type=int, default=65_536, help="tokens per micro-batch (--scale)")
    parser.add_argument("--repeats", type=int, default=9, help="plans timed per point; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", default="embedded,ray", help="engines to measure (comma-separated)")
    parser.add_argument("--producers", type=int, nargs="+", default=[1, 4, 16],
                        help="producer threads (embedded) or processes (ray)")
    parser.add_argument("--sizes", nargs="+", default=["1KiB", "1MiB"], choices=sorted(SIZES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32],
                        help="trajectories per call: 1 is put(), more is put_many()")
    parser.add_argument("--total-1k", type=int, default=2048, help="1 KiB trajectories per point")
    parser.add_argument("--total-1m", type=int, default=128, help="1 MiB trajectories per point")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="(unused: no plot for this benchmark)")
    parser.add_argument("--trace", action="store_true",
                        help="only compare tracing on vs off (knitdata.observe.trace) on the embedded engine's put path and "
                             "trainer loop, side by side in one run")


def make_admitted(n_traj: int, group_size: int, nodes: list[str], seed: int = 0) -> AdmittedMiniBatch:
    """One admitted mini-batch of :class:`~knitdata.record.TrajectoryMeta` (no payloads).

    Args:
        n_traj: Trajectories (a multiple of ``group_size`` is used).
        group_size: Members per group.
        nodes: Node names; a group's payloads sit on one of them (every tenth group on two).
        seed: Random seed.

    Returns:
        An :class:`~knitdata.admission.AdmittedMiniBatch` (mini-batch 0, with its ``group_sizes`` as admission
        gives them): whole groups in completion order, each group's members in arrival order (as admission lists them), each
        trajectory's ``seq`` its arrival rank (groups interleave).
    """
    from knitdata.admission import AdmittedMiniBatch
    from knitdata.record import TrajectoryMeta

    rng = random.Random(seed)
    n_groups = max(1, n_traj // group_size)
    # arrival: a group's rollouts start together and finish after their own generation time, so the
    # members of concurrent groups interleave; seq is the arrival rank; admission emits whole groups in
    # the order they complete
    arrivals: list[tuple[float, int, int]] = []
    for g in range(n_groups):
        start = rng.uniform(0.0, n_groups / 100.0)
        arrivals.extend((start + rng.expovariate(1.0), g, k) for k in range(group_size))
    arrivals.sort()
    seq_of = {(g, k): s for s, (_t, g, k) in enumerate(arrivals)}
    done = {g: t for t, g, _k in arrivals}  # the last arrival of each group
    metas = []
    for g in sorted(range(n_groups), key=done.__getitem__):
        home = rng.randrange(len(nodes))
        other = rng.randrange(len(nodes))
        prompt = rng.randint(128, 2048)
        for k in sorted(range(group_size), key=lambda k: seq_of[(g, k)]):  # members in arrival order
            tokens = min(16_384, prompt + int(rng.lognormvariate(7.0, 0.8)))
            node = nodes[other] if (g % 10 == 9 and k % 2) else nodes[home]
            metas.append(TrajectoryMeta(
                id=f"t{g * group_size + k}", source=("math", "code")[g % 2], group=f"g{g}", num_tokens=tokens,
                nbytes=12 * tokens, location=node, seq=seq_of[(g, k)],
            ))
    return AdmittedMiniBatch(0, 0, 0, tuple(metas), None, (group_size,) * n_groups)


def plan_quality(plan: Any) -> dict[str, float]:
    """Token balance (largest share / mean share) and cross-node bytes fraction of a plan."""
    shares = plan.share_tokens()
    mean = sum(shares) / len(shares)
    total_bytes = plan.local_bytes + plan.remote_bytes
    return {
        "max_over_mean_tokens": max(shares) / mean if mean else 0.0,
        "cross_node_bytes_fraction": plan.remote_bytes / total_bytes if total_bytes else 0.0,
    }


def run_scale(args: argparse.Namespace) -> dict[str, Any]:
    """Time planning at cluster scale; returns ``{"scale": {ranks: {trajectories: {...}}}, ...}``."""
    from knitdata.placement import ConsumerLayout
    from knitdata.planner import Planner

    layouts = [(args.nodes, args.ranks_per_node)]
    if args.ref_ranks:
        layouts.append((max(1, args.ref_ranks // args.ranks_per_node), args.ranks_per_node))
    out: dict[str, Any] = {}
    rows = []
    reference: list[float] = []  # the machine's speed, timed between the plans
    for n_nodes, per in layouts:
        layout = ConsumerLayout.uniform(n_nodes, per)
        planner = Planner(layout, args.token_budget, locality=True)
        ranks = layout.num_consumers
        for n_traj in args.trajectories:
            admitted = make_admitted(n_traj, args.group_size, list(layout.nodes), seed=args.seed)
            times = []
            plan = None
            for _ in range(max(1, args.repeats)):
                t0 = time.perf_counter()
                plan = planner.plan(admitted)
                times.append((time.perf_counter() - t0) * 1e3)
                reference.append(reference_ms())
            assert plan is not None  # at least one repeat
            q = plan_quality(plan)
            point = {
                "plan_ms": statistics.median(times),
                "plan_ms_min": min(times),
                "microbatches_per_rank": plan.num_microbatches,
                **q,
            }
            out.setdefault(str(ranks), {})[str(len(admitted.trajectories))] = point
            rows.append((ranks, len(admitted.trajectories), point))
            print(f"  planned {len(admitted.trajectories)} trajectories over {ranks} ranks: "
                  f"{point['plan_ms']:.1f} ms", flush=True)
    print()
    print(f"{'ranks':>6} {'trajectories':>12} {'plan_ms':>9} {'min_ms':>8} {'K':>3} {'max/mean tok':>12} {'cross-node':>10}")
    for ranks, n, p in rows:
        print(f"{ranks:>6} {n:>12} {p['plan_ms']:>9.1f} {p['plan_ms_min']:>8.1f} {p['microbatches_per_rank']:>3} "
              f"{p['max_over_mean_tokens']:>12.3f} {p['cross_node_bytes_fraction']:>10.3f}")
    ref = {"ms_median": statistics.median(reference), "ms_min": min(reference), "ms_max": max(reference),
           "work": REFERENCE_WORK}
    print(f"machine speed: {REFERENCE_WORK} took {ref['ms_median']:.1f} ms (median; {ref['ms_min']:.1f}-"
          f"{ref['ms_max']:.1f}) between the plans")
    return {"scale": out, "machine_reference": ref}


#: What :func:`reference_ms` times: a fixed pure-Python loop, to tell a slow phase of a shared host from a slow plan.
REFERENCE_WORK = "a Python loop of 300,000 integer additions"


def reference_ms() -> float:
    """Milliseconds of :data:`REFERENCE_WORK` (reported beside timings on shared, noisy machines)."""
    t0 = time.perf_counter()
    s = 0
    for i in range(300_000):
        s += i
    return (time.perf_counter() - t0) * 1e3


# ----------------------------------------------------------------------------------------------- engines
SIZES = {"1KiB": 1 << 10, "1MiB": 1 << 20}


def _traj(i: int, nbytes: int, producer: int) -> Any:
    import torch

    from knitdata.record import Trajectory

    return Trajectory(id=f"p{producer}-{i}", source="s", group=f"p{producer}-{i}", gen_version=0,
                      prompt_ids=torch.arange(8), response_ids=torch.arange(8),
                      tensors={"blob": torch.zeros(max(1, nbytes // 4), dtype=torch.float32)})


def _produce(pipe: Any, producer: int, count: int, nbytes: int, batch: int) -> list[float]:
    """Put ``count`` trajectories (``batch`` at a time); returns the latency of each call in seconds."""
    trajs = [_traj(i, nbytes, producer) for i in range(count)]
    lat = []
    for k in range(0, count, batch):
        chunk = trajs[k:k + batch]
        t0 = time.perf_counter()
        if batch == 1:
            pipe.put(chunk[0])
        else:
            pipe.put_many(chunk)
        lat.append(time.perf_counter() - t0)
    return lat


def _producer_process(producer: int, address: str, cmds: Any, out: Any, go: Any) -> None:
    """A producer process: attach to each pipeline it is told of, wait for "go", put, report latencies."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from knitdata.pipeline import Pipeline

    while True:
        cmd = cmds.get()
        if cmd is None:
            return
        name, count, nbytes, batch = cmd
        try:
            pipe = Pipeline.attach(name, address=address, check_media=False)
            trajs_ready = _traj(0, nbytes, producer)  # imports and allocators warm before the clock starts
            del trajs_ready
            out.put(("ready", producer, None))
            go.wait(600)
            out.put(("ok", producer, _produce(pipe, producer, count, nbytes, batch)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out.put(("error", producer, f"{type(e).__name__}: {e}"))


class _ProducerPool:
    """Producer processes (spawned once, reused by every point of a run)."""

    def __init__(self, n: int, address: str) -> None:
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.cmds = [self.ctx.Queue() for _ in range(n)]
        self.go = self.ctx.Event()  # shared through inheritance (an Event cannot travel through a queue)
        self.procs = [self.ctx.Process(target=_producer_process, args=(p, address, self.cmds[p], self.out, self.go),
                                       daemon=True) for p in range(n)]
        for proc in self.procs:
            proc.start()

    def run(self, name: str, n: int, count: int, nbytes: int, batch: int, on_go: Any) -> tuple[list[float], list[str]]:
        go = self.go
        go.clear()
        for p in range(n):
            self.cmds[p].put((name, count, nbytes, batch))
        errors: list[str] = []
        ready = 0
        while ready < n:
            kind, _p, payload = self.out.get(timeout=600)
            if kind == "ready":
                ready += 1
            else:
                errors.append(str(payload))
                n -= 1
        on_go()
        go.set()
        lat: list[float] = []
        for _ in range(n):
            kind, _p, payload = self.out.get(timeout=600)
            if kind == "ok":
                lat += payload
            else:
                errors.append(str(payload))
        return lat, errors

    def close(self) -> None:
        for q in self.cmds:
            q.put(None)
        for proc in self.procs:
            proc.join(30)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spec(total: int) -> Any:
    from knitdata.admission import BatchSpec

    m = 16
    return BatchSpec({"s": 4 * m}, num_minibatches=4, group_size=1)


def _drain(pipe: Any, stop: threading.Event) -> None:
    ds = pipe.dataset(0, fetch="iter", timeout=600)
    for _mb in ds:
        if stop.is_set():
            break


def run_engine_point(engine: str, producers: int, size: str, count: int, batch: int = 1,
                     address: str | None = None, pool: _ProducerPool | None = None) -> dict[str, Any]:
    """One measurement: ``producers`` producers (threads on the embedded engine, processes on Ray) each put
    ``count`` trajectories of ``size``; one consumer drains. Returns throughput and put latency."""
    from knitdata.pipeline import Pipeline

    nbytes = SIZES[size]
    total = producers * count
    opts = None
    if engine == "ray":
        opts = {"name": f"bench-control-{os.getpid()}-{time.monotonic_ns()}", "address": address}
    pipe = Pipeline(_spec(total), num_consumers=1, engine=engine, admission="fifo", token_budget=1 << 20,
                    capacity_bytes=min(1 << 30, max(64 << 20, 4 * 64 * nbytes)), put_timeout=120,
                    check_media=False, engine_options=opts)
    stop = threading.Event()
    drain = threading.Thread(target=_drain, args=(pipe, stop), daemon=True)
    drain.start()
    lat: list[float] = []
    errors: list[str] = []
    cpu0 = cpu1 = None
    pid = None
    if engine == "ray":
        from knitdata.engines.ray.control import RayControl

        control = pipe.internals.control
        assert isinstance(control, RayControl)
        plumbing = control.plumbing  # the coordinator's own calls (not the plane's)
        pid = plumbing.info().get("pid")
        box: dict[str, float] = {}

        def on_go() -> None:
            box["plane0"] = plumbing.admit_cpu()["cpu_s"]
            box["cpu0"] = _cpu_s(pid) if pid else float("nan")
            box["t0"] = time.perf_counter()

        assert pool is not None
        lat, errors = pool.run(str(pipe.name), producers, count, nbytes, batch, on_go)
        cpu0, t0 = box.get("cpu0"), box["t0"]
    else:
        res: list[list[float]] = [[] for _ in range(producers)]

        def run(p: int) -> None:
            try:
                res[p] = _produce(pipe, p, count, nbytes, batch)
            except BaseException as e:  # noqa: BLE001 - reported
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=run, args=(p,)) for p in range(producers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lat = [x for r in res for x in r]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until every put is admitted
        st = pipe.stats_light()
        if st["admitted_trajectories"] + sum(st["ready_not_admitted"].values()) >= total:
            break
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    plane_cpu = None
    if pid:
        cpu1 = _cpu_s(pid)
        plane_cpu = plumbing.admit_cpu()["cpu_s"] - box["plane0"]
    st = pipe.stats_light()
    group_commit = None
    if engine == "ray":
        import ray

        units: list[Any] = list(pipe.units.values())  # RayStorageUnit: the actor counts its group commits
        counts: list[dict[str, int]] = [ray.get(u.actor.admit_stats.remote(), timeout=60) for u in units]
        calls = sum(c["calls"] for c in counts)
        group_commit = {"coordinator_calls": calls, "puts": sum(c["puts"] for c in counts),
                        "puts_per_call": sum(c["puts"] for c in counts) / calls if calls else None}
    stop.set()
    pipe.shutdown() if engine == "ray" else pipe.close()
    lat_ms = sorted(x * 1000 / batch for x in lat)
    q = statistics.quantiles(lat_ms, n=100) if len(lat_ms) >= 2 else [lat_ms[0]] * 99 if lat_ms else [0.0] * 99
    return {
        "traj_per_s": total / elapsed if elapsed > 0 else 0.0,
        "p50_ms": statistics.median(lat_ms) if lat_ms else None,
        "p99_ms": q[98],
        "trajectories": total, "batch": batch, "seconds": elapsed, "errors": errors,
        "admitted": st["admitted_trajectories"],
        "coordinator_cpu_ms_per_traj": (cpu1 - cpu0) * 1000 / total if cpu0 is not None and cpu1 is not None else None,
        "coordinator_admit_cpu_ms_per_traj": plane_cpu * 1000 / total if plane_cpu is not None else None,
        "group_commit": group_commit,
    }


def trainer_data_point(engine: str, steps: int = 12, microbatches: int = 4, compute_s: float = 0.004,
                       address: str | None = None) -> dict[str, Any]:
    """The trainer's time per optimizer step in data calls: ``next()``, ``commit()`` and ``state_dict()``.

    The pipeline holds the whole run before the trainer starts (admission is not measured); each micro-batch
    gets ``compute_s`` of compute (a sleep: the prefetch thread runs meanwhile); after each step the trainer
    saves its state and commits it, as a checkpointing trainer would.
    """
    from knitdata.admission import BatchSpec
    from knitdata.pipeline import Pipeline

    m = microbatches
    opts = None
    if engine == "ray":
        opts = {"name": f"bench-trainer-{os.getpid()}-{time.monotonic_ns()}", "address": address}
    pipe = Pipeline(BatchSpec({"s": 4 * m}, num_minibatches=4, group_size=1), num_consumers=1, engine=engine,
                    token_budget=64, capacity_bytes=256 << 20, release="commit", check_media=False,
                    engine_options=opts)
    pipe.put_many([_traj(i, 4096, 0) for i in range(steps * m)])
    pipe.close()
    ds = pipe.dataset(0, fetch="iter")
    it = iter(ds)
    per_step: list[float] = []
    parts: dict[str, list[float]] = {"next_ms": [], "commit_ms": [], "state_ms": []}
    cur = 0.0
    while True:
        t0 = time.perf_counter()
        try:
            mb = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        parts["next_ms"].append((t1 - t0) * 1000)
        cur += t1 - t0
        time.sleep(compute_s)
        assert mb.info is not None  # the dataset's micro-batches carry their plan information
        if mb.info.is_last:
            t2 = time.perf_counter()
            state = ds.state_dict()
            t3 = time.perf_counter()
            ds.commit(state)
            t4 = time.perf_counter()
            parts["state_ms"].append((t3 - t2) * 1000)
            parts["commit_ms"].append((t4 - t3) * 1000)
            cur += t4 - t2
            per_step.append(cur * 1000)
            cur = 0.0
    pipe.shutdown() if engine == "ray" else pipe.close()
    warm = per_step[1:] or per_step  # the first step includes the iterator's start
    return {"ms_per_step": statistics.median(warm), "steps": len(per_step),
            "next_ms_median": statistics.median(parts["next_ms"]),
            "commit_ms_median": statistics.median(parts["commit_ms"]),
            "state_ms_median": statistics.median(parts["state_ms"])}


def run_engines(args: argparse.Namespace) -> dict[str, Any]:
    """Put throughput and latency per engine, producer count and size; the trainer's data time per step."""
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    address = None
    out: dict[str, Any] = {"engines": {}, "coordinator_cpu_ms_per_traj": {}, "trainer_data_ms_per_step": {},
                           "trainer_data": {}}
    rows = []
    for engine in engines:
        if engine == "ray":
            from knitdata.engines.ray.connect import connect

            connect(None)  # one local loopback Ray for the whole run
            from knitdata.engines.ray.engine import ray_address

            address = ray_address()
        pool = _ProducerPool(max(args.producers), str(address)) if engine == "ray" else None
        for n in args.producers:
            for size in args.sizes:
                total = args.total_1k if size == "1KiB" else args.total_1m
                count = max(1, total // n)
                for batch in args.batches:
                    point = run_engine_point(engine, n, size, count, batch=batch, address=address, pool=pool)
                    key = "put" if batch == 1 else f"put_many_{batch}"
                    out["engines"].setdefault(engine, {}).setdefault("producers", {}).setdefault(str(n), {}) \
                        .setdefault(size, {})[key] = point
                    if batch == args.batches[0]:
                        out["engines"][engine]["producers"][str(n)][size].update(
                            {k: point[k] for k in ("traj_per_s", "p50_ms", "p99_ms")})
                    rows.append((engine, n, size, key, point))
                    print(f"  {engine} producers={n} {size} {key}: {point['traj_per_s']:.0f} traj/s", flush=True)
        if pool is not None:
            pool.close()
        cpus = [p["coordinator_cpu_ms_per_traj"] for e, _n, _s, _k, p in rows
                if e == engine and p["coordinator_cpu_ms_per_traj"] is not None]
        out["coordinator_cpu_ms_per_traj"][engine] = statistics.median(cpus) if cpus else None
        td = trainer_data_point(engine, address=address)
        out["trainer_data"][engine] = td
        out["trainer_data_ms_per_step"][engine] = td["ms_per_step"]
    print()
    print(f"{'engine':<9} {'prod':>4} {'size':>5} {'call':>12} {'traj/s':>9} {'p50_ms':>8} {'p99_ms':>8} {'coord_cpu_ms':>12} "
          f"{'in_admit_ms':>11} {'puts/call':>9}")
    for engine, n, size, key, p in rows:
        cpu = p["coordinator_cpu_ms_per_traj"]
        adm = p.get("coordinator_admit_cpu_ms_per_traj")
        ppc = (p.get("group_commit") or {}).get("puts_per_call")
        print(f"{engine:<9} {n:>4} {size:>5} {key:>12} {p['traj_per_s']:>9.0f} {p['p50_ms']:>8.2f} {p['p99_ms']:>8.2f} "
              f"{'-' if cpu is None else f'{cpu:.3f}':>12} {'-' if adm is None else f'{adm:.3f}':>11} "
              f"{'-' if ppc is None else f'{ppc:.1f}':>9}")
    for engine, td in out["trainer_data"].items():
        print(f"trainer data time per step ({engine}): {td['ms_per_step']:.2f} ms (next {td['next_ms_median']:.2f}, "
              f"commit {td['commit_ms_median']:.3f}, state_dict {td['state_ms_median']:.3f} ms medians)")
    return out


def run_trace_overhead(repeats: int = 9) -> dict[str, Any]:
    """Tracing on vs off (:mod:`benchmarks.common.trace_ab`) on the embedded engine: 4 producer threads put 512
    trajectories of 1 KiB while one consumer drains (put to admission), then the trainer loop of
    :func:`trainer_data_point` (8 steps); the sum timed per run."""
    from benchmarks.common.trace_ab import compare

    def once() -> None:
        point = run_engine_point("embedded", 4, "1KiB", 128)
        assert not point["errors"], point["errors"]
        trainer_data_point("embedded", steps=8)

    return compare(once, repeats=repeats, what="control: embedded put path (4 producers x 128 x 1 KiB) + trainer loop")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark: the engines' control path, or with ``--scale`` planning at cluster scale."""
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    if getattr(args, "trace", False):
        from benchmarks.common.trace_ab import format_line

        ab = run_trace_overhead(repeats=args.repeats)
        print(format_line(ab))
        if args.json:
            write_json(args.json, {"trace_overhead": ab}, indent=2)
        return 0
    if args.scale:
        report: dict[str, Any] = {
            "config": {k: getattr(args, k) for k in ("trajectories", "group_size", "nodes", "ranks_per_node",
                                                     "ref_ranks", "token_budget", "repeats", "seed")},
        }
        report.update(run_scale(args))
    else:
        report = {"config": {k: getattr(args, k) for k in ("engines", "producers", "sizes", "batches", "total_1k",
                                                           "total_1m")}}
        report.update(run_engines(args))
    report["loadavg_start"] = list(load0)
    report["loadavg_end"] = list(os.getloadavg())
    report["wall_s"] = time.perf_counter() - t0
    print(f"load average: start {' '.join(f'{x:.2f}' for x in load0)}, "
          f"end {' '.join(f'{x:.2f}' for x in report['loadavg_end'])}")
    if args.json:
        write_json(args.json, report, indent=2)
    return 0


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("control"))
