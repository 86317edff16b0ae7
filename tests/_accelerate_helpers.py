"""Helpers of tests/test_accelerate.py: a deterministic workload, a token-level loss, and a 2-rank DDP worker.

The worker runs in spawned processes (importable by name because the test puts this directory on sys.path).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import zlib
from pathlib import Path
from typing import Any

import torch

from knitdata import Trajectory
from knitdata.admission import BatchSpec

VOCAB = 16
SPEC = BatchSpec({"a": 4, "b": 4}, num_minibatches=2, group_size=2)


def make_trajs(train_batches: int = 2, seed: int = 0) -> list[Trajectory]:
    """Deterministic trajectories in put order (sources interleaved, groups of SPEC.group_size)."""
    out: list[Trajectory] = []
    gs = SPEC.group_size
    for b in range(train_batches):
        for i in range(SPEC.quotas["a"] // gs):
            for s in SPEC.sources:
                group = f"b{b}-{s}-g{i}"
                g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{group}".encode()))
                prompt = torch.randint(0, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
                for j in range(gs):
                    n = int(torch.randint(3, 12, (1,), generator=g))
                    resp = torch.randint(0, VOCAB, (n,), generator=g)
                    out.append(
                        Trajectory(
                            id=f"{group}-r{j}",
                            source=s,
                            group=group,
                            prompt_ids=prompt.clone(),
                            response_ids=resp,
                            gen_version=b,
                            scalars={"advantage": float(j) - 0.5},
                        )
                    )
    return out


class TinyLM(torch.nn.Module):
    """Embedding + linear head in float64 (exact gradient comparisons)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8, dtype=torch.float64)
        self.head = torch.nn.Linear(8, VOCAB, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def token_loss_sum(model: torch.nn.Module, mb: Any) -> torch.Tensor:
    """Sum over loss tokens of ``-advantage * log p(token)``; an empty micro-batch gives a zero loss with a forward."""
    if mb.is_empty:
        return model(torch.zeros(1, 1, dtype=torch.long)).sum() * 0.0
    logits = model(mb.input_ids)[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, mb.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    adv = mb.scalars["advantage"].to(torch.float64).unsqueeze(1)
    return (-adv * logp * mb.loss_mask[:, 1:].to(torch.float64)).sum()


def reference_grads(trajs: list[Trajectory]) -> dict[str, torch.Tensor]:
    """Gradient of the mean token loss over ``trajs`` (one process, no DDP)."""
    from knitdata.consumer.collate import TokenCollator

    model = TinyLM()
    mb = TokenCollator()(trajs)
    loss = token_loss_sum(model, mb) / float(mb.loss_mask[:, 1:].sum())
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: Accelerator(cpu=True) over gloo, one mini-batch through AcceleratedLoader.accumulate."""
    result: dict[str, Any] = {"rank": rank}
    try:
        os.environ.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
        )
        torch.set_num_threads(1)
        from accelerate import Accelerator

        from knitdata.integrations.accelerate import prepare_loader
        from knitdata.pipeline import Pipeline

        acc = Accelerator(cpu=True)
        result["process_index"], result["num_processes"] = acc.process_index, acc.num_processes
        result["distributed_type"] = str(acc.distributed_type)
        model = TinyLM()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        model, opt = acc.prepare(model, opt)
        trajs = make_trajs(1)
        plans: list[Any] = []
        pipe = Pipeline(SPEC, num_consumers=world, token_budget=24, on_plan=lambda a, p: plans.append(p))
        for t in trajs:
            pipe.put(t)
        pipe.close()
        loader = prepare_loader(acc, pipe, fetch="eager")
        by_id = {t.id: t for t in trajs}
        steps: list[dict[str, Any]] = []
        for mb in loader:
            info = mb.info
            with loader.accumulate(model, mb):
                loss = token_loss_sum(model, mb) * loader.loss_scale(mb)
                acc.backward(loss)
            grads = {n: p.grad.detach().clone() for n, p in model.module.named_parameters() if p.grad is not None}
            entry: dict[str, Any] = {"minibatch": info.minibatch, "microbatch": info.microbatch, "is_last": info.is_last,
                                     "sync_gradients": acc.sync_gradients, "ids": list(info.trajectory_ids)}
            if info.is_last:
                plan = next(p for p in plans if p.minibatch == info.minibatch)
                mine = [by_id[m.id] for r in range(world) for m in plan.share(r)]
                ref = reference_grads(mine)
                entry["max_abs_err"] = max(float((grads[n] - ref[n]).abs().max()) for n in ref)
                entry["grad_norm"] = float(sum(g.norm() ** 2 for g in grads.values()) ** 0.5)
                # the same on every rank after the synchronized backward
                flat = torch.cat([grads[n].flatten() for n in sorted(grads)])
                gathered = [torch.zeros_like(flat) for _ in range(world)]
                torch.distributed.all_gather(gathered, flat)
                entry["same_on_ranks"] = all(torch.equal(gathered[0], g) for g in gathered)
                opt.zero_grad()
            else:
                flat = torch.cat([grads[n].flatten() for n in sorted(grads)]) if grads else torch.zeros(1)
                entry["local_grad_norm"] = float(flat.norm())
            steps.append(entry)
        result["steps"] = steps
        loader.close()
        acc.wait_for_everyone()
        acc.end_training()
    except BaseException:  # report, never hang the parent
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # the result is written: skip the interpreter's teardown, where torch's gloo threads (kept alive by DDP after
    # end_training) abort the process now and then (docs/troubleshooting.md, "terminate called without an active
    # exception"); the examples end the same way
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def two_loaders_phase(ckpt: str, phase: str, out: str) -> None:
    """Issue 45.4, as a user runs it: one Accelerator, a train and an eval loader (``prepare_loader`` with default
    names, in that order), a prepared model and optimizer. ``phase="save"``: train 2 of 3 optimizer steps, evaluate
    1 of 2 eval steps, ``accelerator.save_state(ckpt)``. ``phase="load"`` (a new process): the same setup,
    ``accelerator.load_state(ckpt)``, then the rest of both loaders. Writes the trajectory ids each loader handed
    out (and an error, if any) to ``out`` as JSON."""
    result: dict[str, Any] = {"phase": phase}
    try:
        torch.set_num_threads(1)
        from accelerate import Accelerator

        from knitdata.integrations.accelerate import prepare_loader
        from knitdata.pipeline import Pipeline

        acc = Accelerator(cpu=True)
        model, opt = acc.prepare(TinyLM(), torch.optim.SGD(TinyLM().parameters(), lr=0.1))
        pipes = {}
        for role, batches, seed in (("train", 3, 0), ("eval", 2, 1)):
            pipe = Pipeline(SPEC, num_consumers=1, token_budget=24)
            for t in make_trajs(batches, seed=seed):
                pipe.put(t)
            pipe.close()
            pipes[role] = pipe
        train = prepare_loader(acc, pipes["train"], fetch="eager")
        evals = prepare_loader(acc, pipes["eval"], fetch="eager")
        result["names"] = [train.name, evals.name]
        seen: dict[str, list[str]] = {"train": [], "eval": []}
        stop = {"train": 1, "eval": 0} if phase == "save" else {"train": None, "eval": None}
        if phase == "load":
            acc.load_state(ckpt)
        for role, loader in (("train", train), ("eval", evals)):
            for mb in loader:
                if role == "train":
                    with loader.accumulate(model, mb):
                        acc.backward(token_loss_sum(model, mb) * loader.loss_scale(mb))
                        opt.step()
                        opt.zero_grad()
                seen[role] += list(mb.info.trajectory_ids)
                if mb.info.is_last and mb.info.minibatch == stop[role]:
                    break
        if phase == "save":
            acc.save_state(ckpt)
        result["seen"] = seen
        result["files"] = sorted(p.name for p in Path(ckpt).glob("*.json"))
        train.close()
        evals.close()
    except BaseException:  # report, never hang the parent
        result["error"] = traceback.format_exc()
    Path(out).write_text(json.dumps(result))
