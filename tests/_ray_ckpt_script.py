"""Ray scenarios of tests/test_checkpoint.py and tests/test_node_loss.py, each in its own driver process.

``python tests/_ray_ckpt_script.py NAME DIR`` starts a local 2-node ``ray.cluster_utils.Cluster`` (loopback, the
dashboard off), runs scenario ``NAME`` and prints its JSON result as the last line:

* ``two_to_one``: a pipeline with units on 2 nodes is checkpointed, the worker node is removed, and the
  checkpoint is restored onto the head node alone (same ranks); the ranks load their states.
* ``four_to_two``: the same with 4 ranks (2 per node; the odd ones save one mini-batch later) restored onto 2
  ranks on the head node, given the 4 ranks' states; the new ranks load the merged state.
* ``node_loss``: the worker node holding a unit is removed; with ``spill_dir`` its payloads come back from the
  spill shards; without, ``pipe.lost_groups()`` names the groups and consumers raise ``TrajectoryLostError``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch

from knitdata import BatchSpec, ConsumerLayout, Pipeline, Trajectory
from knitdata.errors import KnitdataError, TrajectoryLostError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ckpt_helpers import reissue_missing  # noqa: E402


def traj(tid: str, prompt: int) -> Trajectory:
    g = torch.Generator().manual_seed(prompt * 7 + len(tid))
    return Trajectory(id=tid, source="math" if prompt % 2 == 0 else "code", group=f"p{prompt}",
                      prompt_ids=torch.randint(0, 100, (4,), generator=g),
                      response_ids=torch.randint(0, 100, (6,), generator=g), scalars={"reward": 1.0},
                      tensors={"blob": torch.rand(3000, generator=g)})


SPEC = BatchSpec({"math": 4, "code": 4}, num_minibatches=2, group_size=2)


def cluster() -> tuple[Any, Any, list[str]]:
    """A 3-node loopback cluster; returns it, a node to remove and ``[this driver's node id, that node's id]``.

    Every node is on 127.0.0.1, so the driver attaches to any of them: the node removed is neither the head (the
    cluster's GCS) nor the driver's (the pipeline's creator, where its coordinator runs).
    """
    import ray
    from ray.cluster_utils import Cluster

    common = {"num_cpus": 8, "object_store_memory": 128 << 20, "node_ip_address": "127.0.0.1"}
    c = Cluster(initialize_head=True, connect=False,
                head_node_args={**common, "include_dashboard": False, "resources": {"kd_node0": 1}})
    workers = [c.add_node(**common, resources={f"kd_node{i}": 1}) for i in (1, 2)]
    c.wait_for_nodes()
    ray.init(address=c.address, _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False)
    here = ray.get_runtime_context().get_node_id()
    ids = {i: next(n["NodeID"] for n in ray.nodes() if n["Alive"] and f"kd_node{i}" in n["Resources"]) for i in (1, 2)}
    i = next(i for i in (1, 2) if ids[i] != here)
    return c, workers[i - 1], [here, ids[i]]


def coordinator_node(name: str) -> str:
    """The node id the coordinator of pipeline ``name`` runs on."""
    import ray

    from knitdata.engines.ray.engine import coordinator_name

    return str(ray.get(ray.get_actor(coordinator_name(name), namespace="knitdata").call.remote("info"))["node"])


def stop(c: Any) -> None:
    import ray

    ray.shutdown()
    c.shutdown()


def wait_dead(node_id: str, timeout_s: float = 60.0) -> float:
    import ray

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise RuntimeError(f"node {node_id} still alive after {timeout_s} s")


def put_prompts(pipe: Pipeline, prompts: range, out: list[str]) -> None:
    for p in prompts:
        pipe.ledger.started(f"p{p}")
        pipe.put_many([traj(f"p{p}-{k}", p) for k in range(2)])
        out += [f"p{p}-{k}" for k in range(2)]
        pipe.ledger.finished(f"p{p}")


def two_to_one(d: str) -> dict[str, Any]:
    return _onto_one_node(d, 2, 2, "ck2")


def four_to_two(d: str) -> dict[str, Any]:
    """4 ranks on 2 nodes (odd ranks save one mini-batch later) -> 2 ranks on the head node, given the 4 states."""
    return _onto_one_node(d, 4, 2, "ck4")


def _onto_one_node(d: str, old: int, new_ranks: int, name: str) -> dict[str, Any]:
    c, worker, nodes = cluster()
    pipe = Pipeline(SPEC, layout=ConsumerLayout([f"n{r % 2}" for r in range(old)]), engine="ray", token_budget=64,
                    engine_options={"address": c.address, "name": name, "nodes": nodes})
    put: list[str] = []
    put_prompts(pipe, range(8), put)
    pipe.ledger.started(["p8", "p9"])
    pipe.put(traj("p8-0", 8))
    put.append("p8-0")
    states: dict[int, Any] = {}
    before: dict[int, list[str]] = {}
    stagger = old != new_ranks

    def rank(r: int) -> None:
        ds = pipe.dataset(r, timeout=60)
        seen: list[str] = []
        for mb in ds:
            seen += mb.info.trajectory_ids
            if mb.info.is_last and mb.info.minibatch == (r % 2 if stagger else mb.info.minibatch):
                states[r] = ds.state_dict()
                before[r] = list(seen)
                break
        ds.close()

    ths = [threading.Thread(target=rank, args=(r,)) for r in range(old)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    units_before = {u: unit.node for u, unit in pipe.units.items()}
    info = pipe.checkpoint(os.path.join(d, "ckpt"))
    pipe.shutdown()
    c.remove_node(worker)
    wait_dead(nodes[1])
    new = Pipeline.restore(os.path.join(d, "ckpt"), layout=ConsumerLayout(["n0"] * new_ranks),
                           rank_states=[states[r] for r in range(old)],
                           engine_options={"address": c.address, "name": f"{name}b"})
    report = new.restore_report
    assert report is not None
    after: dict[int, list[str]] = {}

    def producer() -> None:
        try:
            reissue_missing(new, traj, put)
            put_prompts(new, range(10, 16), put)
        finally:
            new.close()

    def rank2(r: int) -> None:
        ds = new.dataset(r, timeout=60)
        ds.load_state_dict(report.merged_state if report.merged_state is not None else states[r])
        after[r] = [t for mb in ds for t in mb.info.trajectory_ids]

    ths = [threading.Thread(target=producer)] + [threading.Thread(target=rank2, args=(r,)) for r in range(new_ranks)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    units_after = {u: unit.node for u, unit in new.units.items()}
    new.shutdown()
    stop(c)
    consumed = [t for r in range(old) for t in before[r]] + [t for r in range(new_ranks) for t in after[r]]
    return {"info": info.to_dict(), "report": report.to_dict(), "consumed": consumed, "put": put,
            "units_before": units_before, "units_after": units_after,
            "after_ranks": sorted(after), "num_consumers_after": new_ranks}


def node_loss(d: str) -> dict[str, Any]:
    c, worker, nodes = cluster()
    out: dict[str, Any] = {}
    pipes: dict[str, Pipeline] = {}
    for mode in ("spill", "none"):
        spill = os.path.join(d, "spill") if mode == "spill" else None
        pipe = pipes[mode] = Pipeline(SPEC, layout=ConsumerLayout(["n0", "n1"]), engine="ray", token_budget=64,
                                      spill_dir=spill, engine_options={"address": c.address, "name": f"nl-{mode}",
                                                                       "nodes": nodes})
        put: list[str] = []
        put_prompts(pipe, range(8), put)  # 2 train batches, admitted
        pipe.put(traj("p8-0", 8))  # an incomplete group, not admitted
        put.append("p8-0")
        held = {u: pipe.internals.control.ledger.lost_on([u])["groups"] for u in pipe.units}  # what each unit holds
        out[mode] = {"put": put, "on_unit": {u: {g: v["trajectories"] for g, v in gs.items()} for u, gs in held.items()},
                     "unit_nodes": {u: unit.node for u, unit in pipe.units.items()},
                     "coordinator_node": coordinator_node(f"nl-{mode}"), "driver_node": nodes[0]}
    c.remove_node(worker)
    out["dead_after_s"] = wait_dead(nodes[1])
    for mode, pipe in pipes.items():
        t0 = time.monotonic()
        out[mode]["lost_groups"] = pipe.lost_groups()
        out[mode]["lost_groups_s"] = time.monotonic() - t0
        pipe.close()
        errors: list[Any] = []
        got: list[str] = []
        for r in range(2):
            t0 = time.monotonic()
            try:
                for mb in pipe.dataset(r, timeout=60):
                    got += mb.info.trajectory_ids
            except TrajectoryLostError as e:
                errors.append({"rank": r, "type": "TrajectoryLostError", "ids": list(e.trajectory_ids),
                               "s": time.monotonic() - t0})
            except KnitdataError as e:
                errors.append({"rank": r, "type": type(e).__name__, "s": time.monotonic() - t0})
        out[mode]["consumed"] = got
        out[mode]["errors"] = errors
        pipe.shutdown()
    stop(c)
    return out


if __name__ == "__main__":
    result = {"two_to_one": two_to_one, "four_to_two": four_to_two, "node_loss": node_loss}[sys.argv[1]](sys.argv[2])
    print(json.dumps(result), flush=True)
