"""A minimal GRPO-style training loop on Hugging Face Accelerate, fed by knitdata on every rank.

Run on 2 CPU processes (no GPU needed; ``--multi_gpu``, because ``--cpu --num_processes 2`` starts one)::

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no --main_process_port 29511 examples/grpo_accelerate.py --out /tmp/grpo.json

or ``torchrun --nproc-per-node 2 examples/grpo_accelerate.py`` or plain ``python examples/grpo_accelerate.py``
(one rank). What it shows:

* a rollout producer puts finished GRPO groups (``group_size`` responses per prompt, group-relative
  advantages computed when the group is complete) into a knitdata :class:`~knitdata.pipeline.Pipeline`;
* each rank iterates its own micro-batches through :func:`knitdata.integrations.accelerate.prepare_loader`
  (never through ``accelerator.prepare``, which would re-shard the stream);
* a clipped policy-gradient loss summed over loss tokens and scaled by ``loader.loss_scale(mb)``
  (``world / MicroBatchInfo.global_loss_tokens``), gradients accumulated over the plan's micro-batches and
  synchronized, with one optimizer step, on ``info.is_last`` (``loader.accumulate``);
* the new policy version reported back to the pipeline after every optimizer step;
* ``--stop-after N`` stops after N optimizer steps with ``accelerator.save_state`` (which writes one
  knitdata loader state per rank), ``--resume-from DIR`` continues exactly there with ``load_state``
  (from the still-running pipeline with ``--ray-address``/``--pipeline-name``, or from a fresh pipeline fed
  the same deterministic rollout);
* ``--out PATH``: rank 0 writes a JSON of what every rank received (trajectory ids per micro-batch,
  payload bytes, micro-batch indices, and the micro-batches the plan assigned to it).

The data source is one function, :func:`open_source`. Engine ``ray`` (the default when Ray is installed):
the rollout producer is its own process (``--role producer``) hosting the pipeline on a loopback Ray
cluster, and every rank attaches to it by name; rank 0 starts it unless ``--ray-address`` points to a
running one. Engine ``embedded`` (without Ray): every rank runs the same deterministic producer thread into
its own in-process pipeline, so every rank computes the same admissions and plans and consumes only its
own share (the other ranks' payloads are generated and held but never read: a stand-in, not for scale).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from knitdata import Trajectory
from knitdata.admission import BatchSpec

__all__ = [
    "VOCAB",
    "make_spec",
    "rollout_group",
    "rollout_stream",
    "TinyPolicy",
    "Source",
    "RecordingCollate",
    "ray_environment",
    "start_local_ray",
    "run_producer",
    "wait_for_address",
    "open_source",
    "grpo_loss",
    "main",
]

VOCAB = 64
SOURCES = ("code", "math")


# ---------------------------------------------------------------------------------------------- rollout
def make_spec(group_size: int = 4, groups_per_source: int = 2, num_minibatches: int = 2) -> BatchSpec:
    """The batch spec of this example: ``groups_per_source`` groups of every source per train batch."""
    q = group_size * groups_per_source
    return BatchSpec({s: q for s in SOURCES}, num_minibatches=num_minibatches, group_size=group_size)


def _reward(source: str, response: torch.Tensor) -> float:
    # math: emit low token ids; code: emit even token ids (two "tasks" the tiny policy can learn)
    if source == "math":
        return float((response < VOCAB // 4).float().mean())
    return float((response % 2 == 0).float().mean())


def rollout_group(seed: int, train_batch: int, source: str, index: int, group_size: int, gen_version: int) -> list[Trajectory]:
    """One finished GRPO group: ``group_size`` responses to one prompt, with group-relative advantages.

    Deterministic in its arguments (the resume check replays the same rollouts). The "behavior policy" is
    uniform sampling, so ``old_logprobs`` is ``log(1/VOCAB)`` per response token.
    """
    group = f"b{train_batch}-{source}-g{index}"
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{group}".encode()))
    prompt = torch.randint(1, VOCAB, (int(torch.randint(4, 13, (1,), generator=g)),), generator=g)
    responses = [
        torch.randint(1, VOCAB, (int(torch.randint(6, 25, (1,), generator=g)),), generator=g) for _ in range(group_size)
    ]
    rewards = torch.tensor([_reward(source, r) for r in responses])
    adv = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
    return [
        Trajectory(
            id=f"{group}-r{j}",
            source=source,
            group=group,
            prompt_ids=prompt.clone(),
            response_ids=r,
            gen_version=gen_version,
            scalars={"reward": float(rewards[j]), "advantage": float(adv[j])},
            tensors={"old_logprobs": torch.full((r.numel(),), -float(torch.log(torch.tensor(float(VOCAB)))))},
        )
        for j, r in enumerate(responses)
    ]


def rollout_stream(spec: BatchSpec, train_batches: int, seed: int = 0):
    """Every trajectory the producer puts, in put order (train batches in order, sources interleaved).

    ``gen_version`` is the version a one-step-pipelined rollout would use: ``b * M`` for train batch ``b``
    (deterministic, so admission decisions are the same in every run).
    """
    per_source = {s: spec.quotas[s] // spec.group_size for s in spec.sources}
    for b in range(train_batches):
        for i in range(max(per_source.values())):
            for s in spec.sources:
                if i < per_source[s]:
                    yield from rollout_group(seed, b, s, i, spec.group_size, b * spec.num_minibatches)


# ---------------------------------------------------------------------------------------------- data source
class RecordingCollate:
    """The default token collate, also noting the payload bytes (``Trajectory.nbytes``) of each micro-batch."""

    def __init__(self) -> None:
        from knitdata.consumer.collate import TokenCollator

        self.inner = TokenCollator()
        self.payload: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def __call__(self, trajs: Any, info: Any = None) -> Any:
        mb = self.inner(trajs, info)
        if info is not None:
            with self._lock:
                self.payload[(info.minibatch, info.microbatch)] = sum(int(t.nbytes) for t in trajs)
        return mb

    def pop(self, info: Any) -> int:
        """Payload bytes of the micro-batch ``info`` describes (forgotten afterwards: memory stays bounded)."""
        with self._lock:
            return self.payload.pop((info.minibatch, info.microbatch))


@dataclass
class Source:
    """What the training loop needs from the data side: a pipeline-like ``source`` for ``prepare_loader``
    (``.dataset(rank, **kw)`` and ``.num_consumers``), a way to report policy versions, the plan of this
    rank when it is known locally (embedded engine), and a closer."""

    source: Any
    engine: str
    report_version: Any
    close: Any
    planned: list[dict[str, Any]] = field(default_factory=list)
    producer_error: list[BaseException] = field(default_factory=list)


def ray_environment() -> None:
    """Environment every process of the Ray engine needs (set before Ray is imported).

    Nothing for authentication: Ray 2.60 turns token authentication on for a local cluster started by
    ``ray.init()``, and ``Pipeline.attach`` then uses this user's token for it (docs/engines/ray.md).
    """
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
    """``--role producer``: the rollout process of the Ray engine.

    Starts a local Ray bound to 127.0.0.1 (dashboard off), creates the named pipeline(s) (coordinator and
    storage-unit actors), prints ``{"address", "names"}`` as one JSON line, puts the whole rollout into
    every pipeline, closes them, and keeps the cluster up until its standard input closes.
    """
    ray_environment()
    import ray

    from knitdata import Pipeline

    if args.ray_address is None:
        start_local_ray()

    spec = make_spec(args.group_size, args.groups_per_source, args.num_minibatches)
    names = [n for n in args.pipeline_name.split(",") if n]
    pipes = [
        Pipeline(spec, num_consumers=args.world, engine="ray", token_budget=args.token_budget, capacity_bytes=64 << 20,
                 engine_options={"name": n, "address": args.ray_address})
        for n in names
    ]
    print(json.dumps({"address": ray.get_runtime_context().gcs_address, "names": names}), flush=True)
    n = 0
    for traj in rollout_stream(spec, args.train_batches, args.seed):
        for p in pipes:
            p.put(traj)
        n += 1
    for p in pipes:
        p.close()
    print(json.dumps({"put": n}), flush=True)
    sys.stdin.read()  # the cluster lives in this process: stay until the trainer is done
    for p in pipes:
        p.shutdown()
    ray.shutdown()
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


def _spawn_producer(args: argparse.Namespace, world: int, name: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "producer", "--pipeline-name", name, "--world",
           str(world), "--train-batches", str(args.train_batches), "--group-size", str(args.group_size),
           "--groups-per-source", str(args.groups_per_source), "--num-minibatches", str(args.num_minibatches),
           "--token-budget", str(args.token_budget), "--seed", str(args.seed)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    return proc, wait_for_address(proc)


def open_source(args: argparse.Namespace, rank: int, world: int) -> Source:
    """Open this rank's data source. The only function that knows which engine feeds the loop.

    * ``ray``: the rollout producer is its own process (``--role producer``), hosting the pipeline on a
      loopback Ray cluster; every rank attaches to it by name with :meth:`Pipeline.attach`. With
      ``--ray-address`` the producer is already running (started by you or a test); otherwise rank 0
      starts it and tells the other ranks its address.
    * ``embedded``: every rank runs the same deterministic producer thread into its own in-process
      pipeline, computes the same admissions and plans, and reads only its own share (a stand-in for
      machines without Ray: the other ranks' payloads are generated and held but never read).
    """
    if args.engine == "ray":
        ray_environment()
        from knitdata import Pipeline

        producer = None
        address, name = args.ray_address, args.pipeline_name
        if address is None:
            # its own fresh cluster: the default name is free, and a resumed run (which starts another
            # producer fed the same rollout) finds the name its saved state refers to
            if rank == 0:
                producer, address = _spawn_producer(args, world, name)
            if world > 1:
                from accelerate.utils import broadcast_object_list

                box = [address, name]
                broadcast_object_list(box, from_process=0)
                address, name = box
        client = Pipeline.attach(name, address=address)

        def close_ray() -> None:
            if producer is not None:
                producer.stdin.close()
                try:
                    producer.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    producer.kill()

        # one rank reports versions (they are the same on every rank)
        report = client.report_version if rank == 0 else (lambda v: None)
        return Source(source=client, engine="ray", report_version=report, close=close_ray)

    from knitdata.pipeline import Pipeline

    spec = make_spec(args.group_size, args.groups_per_source, args.num_minibatches)
    src = Source(source=None, engine="embedded", report_version=None, close=None)

    def on_plan(admitted: Any, plan: Any) -> None:
        for pmb in plan.microbatches[rank]:
            src.planned.append(
                {"minibatch": pmb.minibatch, "microbatch": pmb.microbatch, "ids": list(pmb.trajectory_ids),
                 "nbytes": pmb.nbytes}
            )

    pipe = Pipeline(spec, num_consumers=world, token_budget=args.token_budget, capacity_bytes=64 << 20, on_plan=on_plan)

    def produce() -> None:
        try:
            for traj in rollout_stream(spec, args.train_batches, args.seed):
                pipe.put(traj)
        except BaseException as e:  # the loop stopped early (pipeline closed) or a real failure
            if not pipe.closed:
                src.producer_error.append(e)
        finally:
            pipe.close()

    thread = threading.Thread(target=produce, name="rollout-producer", daemon=True)
    thread.start()

    def close() -> None:
        pipe.close()
        thread.join(timeout=10)

    src.source = pipe
    src.report_version = pipe.report_version
    src.close = close
    return src


# ---------------------------------------------------------------------------------------------- model and loss
class TinyPolicy(torch.nn.Module):
    """An embedding, one GRU layer and an output head: a causal language model small enough for CPU tests."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.rnn = torch.nn.GRU(dim, dim, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(input_ids))
        return self.head(h)


def grpo_loss(model: torch.nn.Module, mb: Any, clip: float = 0.2) -> tuple[torch.Tensor, float]:
    """Sum over loss tokens of the clipped policy-gradient loss; also the micro-batch's loss token count.

    An empty micro-batch (a rank with no trajectories in this slot) still runs a forward so that DDP's
    gradient all-reduce of the last micro-batch lines up on every rank; its loss is zero.
    """
    if mb.is_empty:
        dummy = torch.zeros(1, 1, dtype=torch.long, device=mb.input_ids.device)
        return model(dummy).sum() * 0.0, 0.0
    logits = model(mb.input_ids)[:, :-1].float()
    target = mb.input_ids[:, 1:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    mask = mb.loss_mask[:, 1:]
    old = mb.tensors["old_logprobs"][:, 1:]
    adv = mb.scalars["advantage"].unsqueeze(1)
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    return (per_token * mask).sum(), float(mask.sum())


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("embedded", "ray"), default=None,
                   help="default: ray when installed, else embedded")
    p.add_argument("--role", choices=("trainer", "producer"), default="trainer", help=argparse.SUPPRESS)
    p.add_argument("--ray-address", default=None, help="attach to a running producer's Ray cluster (ray engine)")
    p.add_argument("--pipeline-name", default="grpo", help="name of the Ray pipeline (with --ray-address)")
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--train-batches", type=int, default=3, help="train batches the producer delivers")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many optimizer steps (save_state)")
    p.add_argument("--resume-from", default=None, help="checkpoint directory written by --stop-after")
    p.add_argument("--ckpt-dir", default=None, help="where --stop-after saves (default: next to --out, or ./ckpt)")
    p.add_argument("--out", default=None, help="JSON of what every rank received (written by rank 0)")
    p.add_argument("--fetch", choices=("sample", "eager", "iter"), default="iter")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-source", type=int, default=2)
    p.add_argument("--num-minibatches", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=64, help="most tokens per micro-batch")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-with", default=None, help="an Accelerate tracker (tensorboard, wandb, ...): knitdata's "
                   "per-step metrics go to it through accelerator.log")
    p.add_argument("--log-dir", default="runs", help="the trackers' project directory (with --log-with)")
    args = p.parse_args(argv)
    if args.engine is None:
        import importlib.util

        args.engine = "ray" if importlib.util.find_spec("ray") is not None else "embedded"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.role == "producer":
        return run_producer(args)
    from accelerate import Accelerator
    from accelerate.utils import gather_object, set_seed

    from knitdata.integrations.accelerate import prepare_loader

    trackers = {"log_with": args.log_with, "project_dir": args.log_dir} if args.log_with else {}
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), **trackers)
    if args.log_with:
        accelerator.init_trackers("knitdata_grpo")  # TensorBoard: <log-dir>/knitdata_grpo/events.out.tfevents.*
    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(args.seed)
    model = TinyPolicy()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt = accelerator.prepare(model, opt)

    src = open_source(args, rank, world)
    collate = RecordingCollate()
    # log_every=1: knitdata's metrics (staleness, data wait, bytes, store fill...) go to accelerator.log each step
    loader = prepare_loader(accelerator, src.source, fetch=args.fetch, collate=collate,
                            log_every=1 if args.log_with else None)
    assert accelerator.prepare(loader) is loader  # not a DataLoader: Accelerate leaves it alone

    version = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)  # the hook positions this rank's loader from its own JSON
        loader.commit()  # Ray engine: release what precedes the resume point (a no-op when already committed)
        last = loader.last_info  # restored from this rank's JSON: one optimizer step per mini-batch
        version = 0 if last is None else last.minibatch + 1
        src.report_version(version)
    received: list[dict[str, Any]] = []
    rewards: list[float] = []
    losses: list[float] = []
    step_loss = 0.0
    t0 = time.perf_counter()
    stopped = False
    for mb in loader:
        info = mb.info
        with loader.accumulate(model, mb):
            loss_sum, _ = grpo_loss(model, mb)
            loss = loss_sum * loader.loss_scale(mb)
            accelerator.backward(loss)
            opt.step()  # a no-op unless info.is_last (accelerator.sync_gradients)
            opt.zero_grad()
        step_loss += float(loss.detach())
        if not mb.is_empty:
            rewards.extend(mb.scalars["reward"].tolist())
        received.append(
            {
                "minibatch": info.minibatch,
                "microbatch": info.microbatch,
                "num_microbatches": info.num_microbatches,
                "is_last": info.is_last,
                "ids": list(info.trajectory_ids),
                "payload_bytes": collate.pop(info),
                "tensor_bytes": mb.nbytes,
                "tokens": mb.num_tokens,
            }
        )
        if info.is_last:
            version += 1
            src.report_version(version)
            losses.append(step_loss)
            step_loss = 0.0
            if args.stop_after is not None and version >= args.stop_after:
                ckpt = args.ckpt_dir or (str(Path(args.out).with_suffix("")) + "_ckpt" if args.out else "ckpt")
                accelerator.save_state(ckpt)  # writes knitdata_loader_rank{r}.json on every rank
                stopped = True
                break
    loader.close()
    src.close()
    if src.producer_error:
        raise RuntimeError("the rollout producer failed") from src.producer_error[0]
    metrics = loader.dataset.metrics.to_dict() if hasattr(loader.dataset, "metrics") else {}
    mine = {
        "rank": rank,
        "world": world,
        "pid": os.getpid(),
        "engine": src.engine,
        "resumed_from": args.resume_from,
        "stopped": stopped,
        "final_version": version,
        "received": received,
        "planned": src.planned,
        "payload_bytes": sum(r["payload_bytes"] for r in received),
        "bytes_fetched": metrics.get("bytes_fetched"),
        "wait_s_total": metrics.get("wait_s_total"),
        "losses": losses,
        "mean_reward": sum(rewards) / max(1, len(rewards)),
        "wall_s": time.perf_counter() - t0,
    }
    everyone = gather_object([mine]) if world > 1 else [mine]
    if accelerator.is_main_process:
        everyone = sorted(everyone, key=lambda d: d["rank"])
        print(f"{'rank':>4} {'pid':>7} {'microbatches':>12} {'trajectories':>12} {'payload_bytes':>13} {'steps':>5} "
              f"{'mean_reward':>11}")
        for d in everyone:
            n_traj = sum(len(r["ids"]) for r in d["received"])
            print(
                f"{d['rank']:>4} {d['pid']:>7} {len(d['received']):>12} {n_traj:>12} {d['payload_bytes']:>13} "
                f"{len(d['losses']):>5} {d['mean_reward']:>11.3f}"
            )
        first = everyone[0]["losses"]
        print(
            f"world={world} engine={src.engine} version={version} stopped={stopped} "
            f"loss first/last step={first[0] if first else float('nan'):.4f}/{first[-1] if first else float('nan'):.4f}"
        )
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"world": world, "ranks": everyone}, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()
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
