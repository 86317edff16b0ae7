"""``python -m benchmarks placement``: bytes moved across nodes, consumer-aware placement against ``index % units``.

One run, one workload, both placements side by side on the Ray engine: a local
``ray.cluster_utils.Cluster`` with ``--nodes`` nodes (every one on 127.0.0.1, its own object store,
dashboard off), one consumer rank per node (a Ray actor pinned to the node, iterating its
:class:`~knitdata.consumer.dataset.TrajectoryDataset` of the Ray engine), the producer in this process. Cross-node bytes
are counted where they are read (Ray's object locations against the reader's node) and, separately,
where they are put (producer's node against the unit's node). Also reported: what the planner expected
(``planned_remote_bytes``), fetch throughput per consumer (payload bytes / seconds from its first to its
last micro-batch, fetch + decode + collate; consumers start once the producer has put everything), and
exactly-once delivery; and the fetch throughput of one process reading a unit on its own node (zero-copy)
against a unit on another node, with memcpy as the reference.

Memory: each node's object store is ``--store-mb``; the workload holds ``n_groups * group_size``
trajectories of about ``4 * extra`` bytes each.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/placement.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import statistics
import time
from typing import Any

from benchmarks.common.output import write_json

__all__ = ["add_arguments", "run", "make_workload", "compare_placements", "measure_fetch", "start_cluster",
           "node_order", "summarize", "plot"]

PLACEMENTS = ("consumer_aware", "index_mod")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks placement``."""
    parser.add_argument("--nodes", type=int, default=3, help="Ray nodes (one consumer rank and one unit each)")
    parser.add_argument("--groups", type=int, default=48, help="GRPO groups in the workload")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--extra", type=int, default=25_000, help="float32 payload elements per trajectory")
    parser.add_argument("--minibatches", type=int, default=2, help="mini-batches per train batch")
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--fetch", default="iter", choices=("sample", "eager", "iter"))
    parser.add_argument("--store-mb", type=int, default=128, help="object store per node (MiB)")
    parser.add_argument("--address", default=None, help="use a running cluster (loopback only) instead of starting one")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="write a bar chart here (needs matplotlib)")


def make_workload(n_groups: int, group_size: int = 2, extra: int = 25_000, seed: int = 0) -> list[Any]:
    """Deterministic trajectories: ``n_groups`` groups over two sources, 48-80 tokens, ``extra`` float32s each."""
    import torch

    from knitdata.record import Trajectory

    out = []
    for g in range(n_groups):
        for k in range(group_size):
            i = g * group_size + k
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
            n_tok = 48 + 16 * (i % 3)
            out.append(Trajectory(
                id=f"t{i}", source=("math", "code")[g % 2], group=f"g{g}", gen_version=0,
                prompt_ids=torch.randint(0, 1000, (8,), generator=gen),
                response_ids=torch.randint(0, 1000, (n_tok - 8,), generator=gen),
                scalars={"reward": float(i % 2)},
                tensors={"blob": torch.rand(extra, generator=gen)} if extra else {},
            ))
    return out


def start_cluster(nodes: int, store_mb: int = 128, cpus: int = 2) -> Any:
    """Start a local ``ray.cluster_utils.Cluster`` on 127.0.0.1 (dashboard off) and attach this process.

    Returns:
        ``(cluster, [Ray node ids in node order], start-up seconds)``; call ``cluster.shutdown()`` after
        ``ray.shutdown()``.
    """
    t0 = time.perf_counter()
    from knitdata.engines.ray.connect import connect

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    common: dict[str, Any] = {"num_cpus": cpus, "object_store_memory": store_mb << 20, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={**common, "include_dashboard": False, "resources": {"kd_node0": 1}})
    for i in range(1, nodes):
        cluster.add_node(**common, resources={f"kd_node{i}": 1})
    cluster.wait_for_nodes()
    connect(cluster.address)
    return cluster, node_order(), time.perf_counter() - t0


def node_order() -> list[str]:
    """Alive Ray node ids ordered by their ``kd_node<i>`` resource (or Ray's order when absent)."""
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]

    def key(n: dict[str, Any]) -> int:
        tags = [int(k[7:]) for k in n["Resources"] if k.startswith("kd_node") and k[7:].isdigit()]
        return tags[0] if tags else 1 << 30

    return [n["NodeID"] for n in sorted(alive, key=key)]


def _consumer_actor() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class PlacementConsumer:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def consume(self, name: str, rank: int, fetch: str) -> dict[str, Any]:
            from knitdata import Pipeline

            ds = Pipeline.attach(name).dataset(rank, fetch=fetch)
            ids: list[list[str]] = []
            infos: list[list[int]] = []
            t_first = None
            t0 = time.perf_counter()
            for mb in ds:
                if t_first is None:
                    t_first = time.perf_counter()
                info = mb.info
                assert info is not None  # the dataset's micro-batches carry their plan information
                ids.append(list(info.trajectory_ids))
                infos.append([info.minibatch, info.microbatch, info.num_microbatches])
            t1 = time.perf_counter()
            committed = ds.commit(wait=True)
            return {"ids": ids, "infos": infos, "seconds": t1 - (t_first or t0), "total_s": t1 - t0,
                    "committed": committed}

    return PlacementConsumer


def compare_placements(
    nodes: list[str],
    trajectories: list[Any],
    *,
    group_size: int = 2,
    num_minibatches: int = 2,
    token_budget: int = 512,
    fetch: str | list[str] = "iter",
    placements: tuple[str, ...] = PLACEMENTS,
    capacity_bytes: int = 256 << 20,
    name_prefix: str = "bench-placement",
) -> dict[str, Any]:
    """Run the same workload through each placement; one consumer rank per node.

    Args:
        nodes: Ray node ids; rank ``r`` and unit ``n{r}`` live on ``nodes[r]``.
        trajectories: The workload (ids unique, sources ``math``/``code``, whole groups of ``group_size``).
        group_size: Group size of the batch spec.
        num_minibatches: Mini-batches per train batch (the workload is one train batch).
        token_budget: Tokens per micro-batch.
        fetch: One fetch mode for every rank, or one per rank.
        placements: Placements to compare.
        capacity_bytes: Capacity of each unit.
        name_prefix: Pipeline name prefix.

    Returns:
        ``{placement: {"results": per-rank results, "stats": coordinator stats, "setup_s", "put_s"}}``.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from knitdata import Pipeline
    from knitdata.admission import BatchSpec
    from knitdata.placement import ConsumerLayout

    quotas: dict[str, int] = {}
    for t in trajectories:
        quotas[t.source] = quotas.get(t.source, 0) + 1
    spec = BatchSpec(quotas, num_minibatches=num_minibatches, group_size=group_size)
    layout = ConsumerLayout([f"n{i}" for i in range(len(nodes))])
    modes = [fetch] * len(nodes) if isinstance(fetch, str) else list(fetch)
    cls = _consumer_actor()
    consumers = [cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes]
    landed = ray.get([c.node.remote() for c in consumers], timeout=180)
    if landed != list(nodes):
        raise AssertionError(f"consumers landed on {landed}, expected {nodes}")
    out: dict[str, Any] = {}
    try:
        for placement in placements:
            name = f"{name_prefix}-{placement}-{os.getpid()}-{time.monotonic_ns()}"
            t0 = time.perf_counter()
            pipe = Pipeline(spec, layout=layout, engine="ray", placement=placement, token_budget=token_budget,
                            capacity_bytes=capacity_bytes, engine_options={"nodes": list(nodes), "name": name})
            setup = time.perf_counter() - t0
            try:
                t0 = time.perf_counter()
                locations = [pipe.put(t).location for t in trajectories]
                put_s = time.perf_counter() - t0
                pipe.close()
                # consumers start once everything is admitted: their time is fetch + decode + collate only
                futs = [c.consume.remote(name, r, modes[r]) for r, c in enumerate(consumers)]
                results = ray.get(futs, timeout=600)
                pipe.flush_meter()
                stats = pipe.stats()
            finally:
                pipe.shutdown()
            out[placement] = {"results": results, "stats": stats, "setup_s": setup, "put_s": put_s,
                              "locations": locations, "fetch": modes}
    finally:
        for c in consumers:
            ray.kill(c)
    return out


def measure_fetch(nodes: list[str], *, records: int = 24, record_bytes: int = 1 << 20, per_request: int = 4,
                  name_prefix: str = "bench-fetch") -> dict[str, Any]:
    """Fetch throughput from this process: a unit on this node (zero-copy) against one on another node.

    Each record is read once (a second read of a remote object would hit the copy Ray pulled here), in
    requests of ``per_request`` records, decoded zero-copy; ``memcpy_MBps`` copies the same bytes in memory
    as the physical reference.

    Returns:
        ``{"local_MBps", "cross_MBps", "memcpy_MBps", "records", "record_bytes"}`` (medians over requests).
    """
    import numpy as np
    import torch

    from knitdata.codec import decode_trajectory
    from knitdata.engines.ray.connect import current_node
    from knitdata.engines.ray.unit import RayStorageUnit, read_records
    from knitdata.record import Trajectory

    here = current_node()
    other = next(n for n in nodes if n != here)
    units = RayStorageUnit.create_many([("local", here), ("cross", other)], 4 * records * record_bytes,
                                       prefix=f"{name_prefix}-{os.getpid()}-{time.monotonic_ns()}")
    n_floats = record_bytes // 4
    out: dict[str, Any] = {"records": records, "record_bytes": record_bytes}
    try:
        for kind, unit in units.items():
            ids = []
            for i in range(records):
                t = Trajectory(id=f"{kind}{i}", source="s", group=f"{kind}{i}", prompt_ids=torch.arange(8),
                               response_ids=torch.arange(8), tensors={"blob": torch.full((n_floats,), float(i))})
                unit.put(t, timeout=30)
                ids.append(t.id)
            rates = []
            for k in range(0, records, per_request):
                t0 = time.perf_counter()
                recs = read_records([(i, unit) for i in ids[k : k + per_request]])
                trajs = [decode_trajectory(r, copy=False) for r in recs]
                dt = time.perf_counter() - t0
                rates.append(sum(len(r) for r in recs) / dt / 1e6)
                del trajs, recs
            out[f"{kind}_MBps"] = statistics.median(rates)
        buf = np.ones(per_request * record_bytes, dtype=np.uint8)
        rates = []
        for _ in range(5):
            t0 = time.perf_counter()
            buf.copy()
            rates.append(buf.nbytes / (time.perf_counter() - t0) / 1e6)
        out["memcpy_MBps"] = statistics.median(rates)
    finally:
        for u in units.values():
            u.kill()
    return out


def summarize(runs: dict[str, Any], trajectories: list[Any]) -> dict[str, Any]:
    """Counters per placement, the reduction, exactly-once checks and per-consumer throughput."""
    nbytes = {t.id: t.nbytes for t in trajectories}
    all_ids = sorted(nbytes)
    rows: dict[str, Any] = {}
    for placement, run in runs.items():
        read = {"local_bytes": 0, "cross_bytes": 0, "reads": 0}
        for row in run["stats"]["transfer"]["read"].values():
            for k in read:
                read[k] += row[k]
        put = {"local_bytes": 0, "cross_bytes": 0}
        for row in run["stats"]["transfer"]["put"].values():
            for k in put:
                put[k] += row[k]
        got = sorted(i for r in run["results"] for mb in r["ids"] for i in mb)
        thr = [sum(nbytes[i] for mb in r["ids"] for i in mb) / max(r["seconds"], 1e-9) / 1e6 for r in run["results"]]
        steps: dict[str, int] = {}
        for key, row in run["stats"]["transfer"]["steps"].items():
            step = key.rsplit("/", 1)[1]
            steps[step] = steps.get(step, 0) + row["cross_bytes"]
        rows[placement] = {
            "read_cross_bytes": read["cross_bytes"], "read_local_bytes": read["local_bytes"],
            "read_cross_fraction": read["cross_bytes"] / max(1, read["cross_bytes"] + read["local_bytes"]),
            "put_cross_bytes": put["cross_bytes"], "put_local_bytes": put["local_bytes"],
            "planned_remote_bytes": run["stats"]["planned_remote_bytes"],
            "planned_local_bytes": run["stats"]["planned_local_bytes"],
            "cross_bytes_per_step": steps,
            "exactly_once": got == all_ids,
            "throughput_MBps_per_consumer": thr, "throughput_MBps_median": statistics.median(thr),
            "setup_s": run["setup_s"], "put_s": run["put_s"], "fetch": run["fetch"],
        }
    out: dict[str, Any] = {"placements": rows, "trajectories": len(trajectories),
                           "payload_bytes": sum(nbytes.values())}
    if "consumer_aware" in rows and "index_mod" in rows:
        base = rows["index_mod"]["read_cross_bytes"]
        out["cross_bytes_reduction"] = 1.0 - rows["consumer_aware"]["read_cross_bytes"] / base if base else None
    return out


def plot(summary: dict[str, Any], path: str) -> None:
    """Bar chart of local / cross-node bytes read per placement."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        from knitdata.errors import OptionalDependencyError

        raise OptionalDependencyError("matplotlib", "plot", "--plot") from e
    rows = summary["placements"]
    names = list(rows)
    local = [rows[n]["read_local_bytes"] / 1e6 for n in names]
    cross = [rows[n]["read_cross_bytes"] / 1e6 for n in names]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(names, local, label="read on the node holding it")
    ax.bar(names, cross, bottom=local, label="read across nodes")
    ax.set_ylabel("MB read by consumers")
    red = summary.get("cross_bytes_reduction")
    ax.set_title("cross-node bytes" + (f": {100 * red:.1f}% fewer with consumer-aware" if red is not None else ""),
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m benchmarks placement``."""
    import ray

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    cluster = None
    if args.address:
        from knitdata.engines.ray.connect import connect

        connect(args.address)
        nodes, startup = node_order()[: args.nodes], 0.0
    else:
        cluster, nodes, startup = start_cluster(args.nodes, args.store_mb)
    try:
        trajs = make_workload(args.groups, args.group_size, args.extra)
        runs = compare_placements(nodes, trajs, group_size=args.group_size, num_minibatches=args.minibatches,
                                  token_budget=args.token_budget, fetch=args.fetch)
        fetch = measure_fetch(nodes) if len(nodes) > 1 else {}
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    summary = summarize(runs, trajs)
    summary.update(fetch_throughput=fetch, cluster_startup_s=startup, nodes=len(nodes), groups=args.groups, group_size=args.group_size,
                   extra=args.extra, minibatches=args.minibatches, token_budget=args.token_budget, fetch=args.fetch)
    print(f"{len(trajs)} trajectories, {summary['payload_bytes'] / 1e6:.1f} MB, {len(nodes)} nodes, fetch={args.fetch}, "
          f"cluster start-up {startup:.1f} s")
    print(f"{'placement':<16}{'read cross MB':>14}{'read local MB':>14}{'cross %':>9}{'put cross MB':>13}"
          f"{'MB/s/consumer':>15}{'exactly once':>13}")
    for name, r in summary["placements"].items():
        print(f"{name:<16}{r['read_cross_bytes'] / 1e6:>14.2f}{r['read_local_bytes'] / 1e6:>14.2f}"
              f"{100 * r['read_cross_fraction']:>8.1f}%{r['put_cross_bytes'] / 1e6:>13.2f}"
              f"{r['throughput_MBps_median']:>15.1f}{str(r['exactly_once']):>13}")
    if summary.get("cross_bytes_reduction") is not None:
        print(f"consumer-aware placement reads {100 * summary['cross_bytes_reduction']:.1f}% fewer bytes across nodes")
    if fetch:
        print(f"fetch from this process, {fetch['records']} x {fetch['record_bytes'] / 1e6:.1f} MB records: local unit "
              f"{fetch['local_MBps']:.0f} MB/s, unit on another node {fetch['cross_MBps']:.0f} MB/s "
              f"(memcpy {fetch['memcpy_MBps']:.0f} MB/s)")
    if args.json:
        write_json(args.json, summary, indent=1)
    if args.plot:
        plot(summary, args.plot)
    return 0 if all(r["exactly_once"] for r in summary["placements"].values()) else 1


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("placement"))
