"""Shared helpers of the on-demand tests: small workloads, consumer threads, and a save/load harness.

The save/load harness follows torchdata.nodes' ``run_test_save_load_state``: iterate a loader to a
midpoint, take its state (through JSON), build a fresh loader over a fresh pipeline fed the same puts,
load the state, finish, and compare with one uninterrupted run.
"""

from __future__ import annotations

import json
import random
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from knitdata.admission import BatchSpec
from knitdata.pipeline import Pipeline
from knitdata.record import Trajectory

__all__ = [
    "Workload",
    "make_traj",
    "make_workload",
    "run_consumers",
    "Delivered",
    "micro_key",
    "collect",
    "stateful_loader",
    "save_load_roundtrip",
]


def make_traj(index: int, source: str, group: str, *, prompt_len: int = 2, response_len: int = 3, gen_version: int = 0,
              extra_bytes: int = 0) -> Trajectory:
    """A small trajectory whose first prompt token is ``index`` (so collated rows can be traced back)."""
    prompt = torch.full((max(1, prompt_len),), index, dtype=torch.int64)
    response = torch.arange(response_len, dtype=torch.int64) + 1
    tensors = {"pad": torch.zeros(extra_bytes, dtype=torch.uint8)} if extra_bytes else {}
    return Trajectory(
        id=f"t{index}",
        source=source,
        group=group,
        prompt_ids=prompt,
        response_ids=response,
        gen_version=gen_version,
        scalars={"reward": float(index % 7)},
        tensors=tensors,
    )


@dataclass
class Workload:
    """A batch spec and the trajectories that fill ``train_batches`` train batches exactly."""

    spec: BatchSpec
    trajs: list[Trajectory]
    train_batches: int


def make_workload(rng: random.Random, *, num_sources: int, group_size: int, num_minibatches: int,
                  groups_per_minibatch_per_source: int, train_batches: int, max_response: int = 2) -> Workload:
    """Quotas ``q_s = groups * group_size * M`` per source; trajectories shuffled (whole train batches).

    Trajectories have 2-6 tokens by default (prompt 1-4, response 1-``max_response``): they fit every token budget
    the tests use (a pipeline refuses a trajectory longer than its ``token_budget`` at put).
    """
    sources = [f"s{i}" for i in range(num_sources)]
    q = groups_per_minibatch_per_source * group_size * num_minibatches
    spec = BatchSpec({s: q for s in sources}, num_minibatches=num_minibatches, group_size=group_size)
    trajs: list[Trajectory] = []
    idx = 0
    for b in range(train_batches):
        batch: list[Trajectory] = []
        for s in sources:
            for g in range(q // group_size):
                for _ in range(group_size):
                    batch.append(make_traj(idx, s, f"b{b}{s}g{g}", response_len=rng.randint(1, max_response),
                                           prompt_len=rng.randint(1, 4), gen_version=b))
                    idx += 1
        # members of a group may arrive in any order, but train batch b+1 only after b is complete
        rng.shuffle(batch)
        trajs.extend(batch)
    return Workload(spec, trajs, train_batches)


def micro_key(mb: Any) -> tuple:
    """(rank, mini-batch, micro-batch, num micro-batches, ids) of a handed-out micro-batch."""
    i = mb.info
    return (i.consumer, i.minibatch, i.microbatch, i.num_microbatches, tuple(i.trajectory_ids))


@dataclass
class Delivered:
    """What consumers received."""

    by_rank: dict[int, list[tuple]] = field(default_factory=dict)
    rows_ok: bool = True
    errors: list[BaseException] = field(default_factory=list)


def _rows_match(mb: Any) -> bool:
    """The collated rows carry the trajectories named by ``info`` (first prompt token = index)."""
    ids = mb.info.trajectory_ids
    if not ids:
        return mb.input_ids.numel() == 0
    firsts = [int(x) for x in mb.input_ids[:, 0]]
    return firsts == [int(t[1:]) for t in ids]


def collect(it: Any, limit: int | None = None) -> list[Any]:
    """Take up to ``limit`` micro-batches from ``it``."""
    out = []
    for mb in it:
        out.append(mb)
        if limit is not None and len(out) >= limit:
            break
    return out


def run_consumers(pipe: Pipeline, *, fetch: str, producer: Callable[[], None] | None = None, delay: float = 0.0,
                  timeout: float = 60.0, **ds_kw: Any) -> Delivered:
    """Run one thread per rank over ``pipe.dataset(rank)`` while ``producer`` (another thread) puts."""
    out = Delivered()
    lock = threading.Lock()

    def consume(rank: int) -> None:
        try:
            got = []
            ok = True
            for mb in pipe.dataset(rank, fetch=fetch, **ds_kw):
                got.append(micro_key(mb))
                ok = ok and _rows_match(mb)
                if delay:
                    time.sleep(delay)  # a slow trainer, so that producers hit a full store
            with lock:
                out.by_rank[rank] = got
                out.rows_ok = out.rows_ok and ok
        except BaseException as e:  # noqa: BLE001 - reported by the test
            with lock:
                out.errors.append(e)

    def produce() -> None:
        try:
            if producer is not None:
                producer()
        except BaseException as e:  # noqa: BLE001
            with lock:
                out.errors.append(e)
        finally:
            pipe.close()

    threads = [threading.Thread(target=consume, args=(r,), daemon=True) for r in range(pipe.num_consumers)]
    threads.append(threading.Thread(target=produce, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            pipe.close()
            raise TimeoutError("a consumer or producer thread did not finish")
    return out


def stateful_loader(ds: Any) -> Any:
    """``StatefulDataLoader(ds, batch_size=None, num_workers=0)`` (set_vital warning filtered by the dataset)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the set_vital warning must not escape
        return ds.stateful_loader()


def save_load_roundtrip(build: Callable[[], Pipeline], puts: Sequence[Trajectory], rank: int, midpoints: Sequence[int],
                        *, fetch: str, use_loader: bool = False, **ds_kw: Any) -> tuple[list[tuple], dict[int, list[tuple]]]:
    """Reference run of ``rank``, then for each midpoint: stop there, JSON the state, resume on a fresh pipeline.

    Returns:
        ``(reference, resumed)`` where ``resumed[k]`` is the first ``k`` micro-batches of one run followed by
        everything the fresh loader yields after loading the state taken at ``k``.
    """

    def fresh() -> Pipeline:
        pipe = build()
        for t in puts:
            pipe.put(t)
        pipe.close()
        return pipe

    def loader_of(pipe: Pipeline) -> tuple[Any, Any]:
        ds = pipe.dataset(rank, fetch=fetch, **ds_kw)
        return ds, (stateful_loader(ds) if use_loader else ds)

    _, ref_loader = loader_of(fresh())
    reference = [micro_key(mb) for mb in ref_loader]
    resumed: dict[int, list[tuple]] = {}
    for k in midpoints:
        ds, loader = loader_of(fresh())
        it = iter(loader)
        head = []
        for _ in range(k):
            try:
                head.append(micro_key(next(it)))
            except StopIteration:
                break
        state = loader.state_dict()
        state = json.loads(json.dumps(state))
        if hasattr(it, "close"):
            it.close()
        ds.close()
        ds2, loader2 = loader_of(fresh())
        loader2.load_state_dict(state)
        tail = [micro_key(mb) for mb in loader2]
        resumed[k] = head + tail
    return reference, resumed
