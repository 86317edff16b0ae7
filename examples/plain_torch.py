"""knitdata in a plain PyTorch training loop (no Accelerate, no framework).

One process, embedded engine (the default): a rollout producer thread puts trajectories, ``--consumers N``
consumer threads each iterate their own :class:`~knitdata.consumer.dataset.TrajectoryDataset` through torchdata's
``StatefulDataLoader`` and train a model replica; every trajectory reaches exactly one consumer. Threads cannot
use DDP: :class:`~knitdata.replicas.ThreadGradientSync` starts the replicas equal and averages their gradients
at every optimizer step, so they stay bitwise equal (``replicas equal: True`` in the output)::

    python examples/plain_torch.py --consumers 2

Several processes (one per data-parallel rank, DDP over gloo on CPU)::

    torchrun --nproc-per-node 2 examples/plain_torch.py --engine ray      # once the Ray engine is available
    torchrun --nproc-per-node 2 examples/plain_torch.py --engine embedded # stand-in: see open_rank_source

The loop: a REINFORCE-style loss summed over loss tokens and scaled by ``world / info.global_loss_tokens``,
``model.no_sync()`` on micro-batches before ``info.is_last`` (DDP) or ``sync.all_reduce(model, rank)`` at
``info.is_last`` (threads), one optimizer step per mini-batch, the new policy version reported back to the
pipeline. ``--state-out DIR`` writes each rank's loader state as JSON
(``StatefulDataLoader.state_dict()``), ``--out PATH`` a JSON of what every consumer received.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch

from knitdata import Trajectory
from knitdata.admission import BatchSpec
from knitdata.replicas import ThreadGradientSync

__all__ = [
    "make_spec",
    "rollout",
    "open_local_pipeline",
    "ray_environment",
    "start_local_ray",
    "run_producer",
    "wait_for_address",
    "open_rank_source",
    "train_consumer",
    "main",
]

VOCAB = 32


def make_spec() -> BatchSpec:
    """Two sources, 8 trajectories each per train batch, groups of 2, 2 mini-batches per train batch."""
    return BatchSpec({"math": 8, "code": 8}, num_minibatches=2, group_size=2)


def rollout(spec: BatchSpec, train_batches: int, seed: int = 0):
    """Deterministic finished trajectories in put order (what a rollout worker would produce)."""
    for b in range(train_batches):
        for i in range(spec.quotas["math"] // spec.group_size):
            for s in spec.sources:
                group = f"b{b}-{s}-g{i}"
                g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{group}".encode()))
                prompt = torch.randint(1, VOCAB, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g)
                for j in range(spec.group_size):
                    resp = torch.randint(1, VOCAB, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g)
                    yield Trajectory(
                        id=f"{group}-r{j}",
                        source=s,
                        group=group,
                        prompt_ids=prompt.clone(),
                        response_ids=resp,
                        gen_version=b * spec.num_minibatches,
                        scalars={"reward": float((resp % 3 == 0).float().mean())},
                    )


def _start_producer(pipe: Any, spec: BatchSpec, train_batches: int, seed: int, errors: list) -> threading.Thread:
    def produce() -> None:
        try:
            for t in rollout(spec, train_batches, seed):
                pipe.put(t)
        except BaseException as e:
            if not pipe.closed:
                errors.append(e)
        finally:
            pipe.close()

    th = threading.Thread(target=produce, name="rollout-producer", daemon=True)
    th.start()
    return th


def open_local_pipeline(args: argparse.Namespace, consumers: int, errors: list) -> tuple[Any, threading.Thread]:
    """An embedded pipeline for ``consumers`` ranks, fed by a producer thread."""
    from knitdata.pipeline import Pipeline

    spec = make_spec()
    pipe = Pipeline(spec, num_consumers=consumers, token_budget=args.token_budget, capacity_bytes=64 << 20)
    return pipe, _start_producer(pipe, spec, args.train_batches, args.seed, errors)


def ray_environment() -> None:
    """Environment of every process of the Ray engine (set before importing Ray). Nothing for authentication:
    ``Pipeline.attach`` uses this user's Ray token for a Ray of this user on this machine (docs/engines/ray.md)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray then binds its node to 127.0.0.1 only


def start_local_ray() -> None:
    """Start a new Ray instance for this process, bound to 127.0.0.1, dashboard off.

    ``address="local"``: a plain ``ray.init()`` would attach to any cluster already running on this machine
    (found through ``/tmp/ray/ray_current_cluster``), e.g. someone else's.
    """
    import logging

    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every Ray address on loopback
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False  # the same switch, for an already imported Ray
    if not ray.is_initialized():
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4,
                 logging_level=logging.ERROR, log_to_driver=False)


def run_producer(args: argparse.Namespace) -> int:
    """``--role producer``: the rollout process. Attaches to ``--ray-address`` (or starts a loopback Ray),
    creates the pipeline ``--pipeline-name``, prints ``{"address"}``, puts the rollout, closes the pipeline,
    and stays (its actors are owned by this process) until standard input closes."""
    ray_environment()
    import ray

    from knitdata import Pipeline

    if args.ray_address is None:
        start_local_ray()

    spec = make_spec()
    pipe = Pipeline(spec, num_consumers=args.world, engine="ray", token_budget=args.token_budget,
                    capacity_bytes=64 << 20, release="handout",
                    engine_options={"name": args.pipeline_name, "address": args.ray_address})
    print(json.dumps({"address": ray.get_runtime_context().gcs_address}), flush=True)
    for t in rollout(spec, args.train_batches, args.seed):
        pipe.put(t)
    pipe.close()
    sys.stdin.read()
    pipe.shutdown()
    return 0


def wait_for_address(proc: subprocess.Popen, timeout_s: float = 180.0) -> str:
    """The ``"address"`` of the first JSON line ``proc`` prints; kills it and raises after ``timeout_s``."""
    import queue

    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            proc.kill()
            raise RuntimeError(f"the rollout producer did not start within {timeout_s:.0f}s (exit code {proc.poll()})")
        if line.startswith("{") and "address" in line:
            return json.loads(line)["address"]


def open_rank_source(args: argparse.Namespace, rank: int, world: int, errors: list) -> tuple[Any, Any]:
    """The data source of one torchrun rank: ``(pipeline-like object with .dataset(rank), closer)``.

    ``ray``: rank 0 starts the rollout producer as its own process (attached to ``--ray-address`` when
    given, else hosting a loopback Ray itself) and broadcasts where it is; every rank attaches to the
    pipeline by name. ``embedded`` stand-in: every rank runs the same deterministic producer into its own
    pipeline (same admissions and plans everywhere) and reads only its own share.
    """
    if args.engine == "ray":
        import torch.distributed as dist

        ray_environment()
        from knitdata import Pipeline

        box: list[Any] = [None, f"plain-{os.getpid()}-{int(time.time())}"]
        producer = None
        if rank == 0:
            cmd = [sys.executable, os.path.abspath(__file__), "--role", "producer", "--world", str(world),
                   "--pipeline-name", box[1], "--train-batches", str(args.train_batches),
                   "--token-budget", str(args.token_budget), "--seed", str(args.seed)]
            if args.ray_address:
                cmd += ["--ray-address", args.ray_address]
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
            producer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            box[0] = wait_for_address(producer)
        dist.broadcast_object_list(box, src=0)
        client = Pipeline.attach(box[1], address=box[0])

        def close_ray() -> None:
            dist.barrier()  # every rank is done reading before the producer takes the pipeline down
            if producer is not None:
                producer.stdin.close()
                try:
                    producer.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    producer.kill()

        return client, close_ray
    pipe, th = open_local_pipeline(args, world, errors)

    def close() -> None:
        pipe.close()
        th.join(timeout=10)

    return pipe, close


class TinyLM(torch.nn.Module):
    """Embedding + MLP + head: a causal LM small enough for a CPU example."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh())
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.emb(ids)))


def _loss_sum(model: torch.nn.Module, mb: Any) -> torch.Tensor:
    if mb.is_empty:  # keep DDP's collectives aligned: every rank runs forward/backward every micro-batch
        return model(torch.zeros(1, 1, dtype=torch.long)).sum() * 0.0
    logp = torch.log_softmax(model(mb.input_ids)[:, :-1], -1).gather(-1, mb.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    adv = (mb.scalars["reward"] - 0.33).unsqueeze(1)
    return (-adv * logp * mb.loss_mask[:, 1:]).sum()


def param_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters (bitwise: equal digests, equal replicas)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_consumer(
    pipe: Any, rank: int, world: int, model: torch.nn.Module, args: argparse.Namespace, report: bool = True,
    sync: ThreadGradientSync | None = None,
) -> dict[str, Any]:
    """The training loop of one consumer; returns what it received.

    ``sync``: the gradient all-reduce of consumer threads (one replica each, no DDP); ``None`` under DDP.
    """
    from torchdata.stateful_dataloader import StatefulDataLoader

    from knitdata.consumer.collate import TokenCollator

    collator = TokenCollator()
    payload: dict[tuple[int, int], int] = {}

    def collate(trajs: Any, info: Any = None) -> Any:  # also note each micro-batch's payload bytes
        payload[(info.minibatch, info.microbatch)] = sum(int(t.nbytes) for t in trajs)
        return collator(trajs, info)

    ds = pipe.dataset(rank, fetch=args.fetch, collate=collate)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=0)  # the dataset makes micro-batches itself
    if sync is not None:
        sync.broadcast(model, rank)  # every replica starts from rank 0's parameters
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    received: list[dict[str, Any]] = []
    steps = 0
    t0 = time.perf_counter()
    for mb in loader:
        info = mb.info
        ddp_sync = contextlib.nullcontext() if info.is_last or not hasattr(model, "no_sync") else model.no_sync()
        with ddp_sync:
            loss = _loss_sum(model, mb) * (world / max(1, info.global_loss_tokens))
            loss.backward()
        received.append({"minibatch": info.minibatch, "microbatch": info.microbatch, "is_last": info.is_last,
                         "ids": list(info.trajectory_ids), "tensor_bytes": mb.nbytes,
                         "payload_bytes": payload.pop((info.minibatch, info.microbatch))})
        if info.is_last:
            if sync is not None:
                sync.all_reduce(model, rank)  # the replicas' average gradient (what DDP gives ranks)
            opt.step()
            opt.zero_grad()
            steps += 1
            if report:
                pipe.report_version(info.minibatch + 1)
    state = loader.state_dict()
    if args.state_out:
        Path(args.state_out).mkdir(parents=True, exist_ok=True)
        Path(args.state_out, f"loader_rank{rank}.json").write_text(json.dumps(state))
    close = getattr(ds, "close", None)
    if close is not None:
        close()
    return {"rank": rank, "world": world, "pid": os.getpid(), "received": received, "steps": steps,
            "payload_bytes": sum(r["payload_bytes"] for r in received), "wall_s": time.perf_counter() - t0,
            "param_digest": param_digest(model)}


def _print_table(rows: list[dict[str, Any]], engine: str) -> None:
    print(f"engine={engine} consumers={len(rows)}")
    print(f"{'rank':>4} {'pid':>7} {'microbatches':>12} {'trajectories':>12} {'payload_bytes':>13} {'steps':>5} "
          f"{'wall_s':>6}")
    for d in rows:
        n = sum(len(r["ids"]) for r in d["received"])
        print(f"{d['rank']:>4} {d['pid']:>7} {len(d['received']):>12} {n:>12} {d['payload_bytes']:>13} {d['steps']:>5} "
              f"{d['wall_s']:>6.2f}")
    all_ids = [i for d in rows for r in d["received"] for i in r["ids"]]
    print(f"trajectories delivered: {len(all_ids)}, distinct: {len(set(all_ids))}")
    print(f"replicas equal: {len({d['param_digest'] for d in rows}) == 1}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("embedded", "ray"), default="embedded")
    p.add_argument("--consumers", type=int, default=2, help="consumer threads (single process only)")
    p.add_argument("--train-batches", type=int, default=3)
    p.add_argument("--fetch", choices=("sample", "eager", "iter"), default="iter")
    p.add_argument("--token-budget", type=int, default=96)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON of what every consumer received")
    p.add_argument("--state-out", default=None, help="directory for the per-rank loader states (JSON)")
    p.add_argument("--ray-address", default=None, help="Ray cluster for the producer to attach to (ray engine)")
    p.add_argument("--role", choices=("trainer", "producer"), default="trainer", help=argparse.SUPPRESS)
    p.add_argument("--pipeline-name", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11's StatefulDataLoader on recent torch
    if args.role == "producer":
        return run_producer(args)
    errors: list[BaseException] = []
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one consumer per process, DDP over gloo
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed)
        model = torch.nn.parallel.DistributedDataParallel(TinyLM())
        pipe, close = open_rank_source(args, rank, world, errors)
        mine = train_consumer(pipe, rank, world, model, args, report=(rank == 0))
        close()
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, mine)
        engine = f"{args.engine} (torchrun)"
    else:
        if args.engine != "embedded":
            raise SystemExit("a single process uses the embedded engine; run --engine ray under torchrun")
        pipe, th = open_local_pipeline(args, args.consumers, errors)
        rows = [None] * args.consumers
        failures: list[BaseException] = []
        sync = ThreadGradientSync(args.consumers)  # threads cannot use DDP: this averages their gradients

        def consume(r: int) -> None:
            try:
                torch.manual_seed(args.seed + r)  # different initial weights: sync.broadcast makes them equal
                rows[r] = train_consumer(pipe, r, args.consumers, TinyLM(), args, report=(r == 0), sync=sync)
            except BaseException as e:
                failures.append(e)
                sync.abort(f"consumer thread {r} failed: {e!r}")  # the other threads stop instead of waiting
                pipe.close()

        threads = [threading.Thread(target=consume, args=(r,), name=f"consumer-{r}") for r in range(args.consumers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        th.join(timeout=10)
        if failures:
            raise failures[0]
        rank, engine = 0, "embedded (threads)"
    if errors:
        raise RuntimeError("the rollout producer failed") from errors[0]
    if rank == 0:
        _print_table(rows, engine)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"engine": engine, "ranks": rows}, indent=1))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # DDP keeps the gloo process group alive after end_training() / destroy_process_group() (torch 2.x): its worker
    # threads live on into the interpreter's teardown, where one that drops the last reference to a finished
    # collective's tensors aborts the process now and then ("terminate called without an active exception",
    # SIGABRT) after everything was written. Everything is flushed and closed by now: skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
