"""The ``floor`` mode of ``bench transfer``: what handing a ready micro-batch to the trainer costs on this machine with
no data system at all, measured beside the systems in the same run.

Each consumer holds its share of the run's trajectories in memory (made before the run starts) and a background
thread builds its micro-batches with knitdata's own collators, the work ``iter``'s prefetch thread does (collate;
with shared encoding the step's media table), at most a few ahead. The trainer's data calls are the least any
prefetching design can make: a ``deque`` pop per micro-batch (no lock and no signal: the thread polls for room), a
two-key state after the optimizer step and that state appended to a ``deque`` the thread drains (the enqueued
commit). No storage, no control plane, no hand-out record, no metric: what remains is the cost, on this host and
under the same load, of passing an object between two threads of a busy Python process (waking from the compute,
taking the GIL back from a thread that collates).

A first version had the trainer signal the thread (under a ``Condition``) after each pop; it exposed 0.62 ms per step
on the image workload, more than knitdata's ``iter``: the signal hands the GIL to a thread that goes on collating.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import torch

from benchmarks.common.consumer import StepItem, dataset_kwargs, step_item
from benchmarks.common.models import VLMConfig
from benchmarks.common.workload import TransferWorkload, make_group, trajectory_id
from knitdata.errors import EngineError
from knitdata.record import Trajectory

__all__ = ["FloorSource", "floor_ids"]


def floor_ids(w: TransferWorkload) -> set[str]:
    """Every trajectory id of the run (what the floor's consumers deliver together, each once)."""
    return {trajectory_id(step, g, j) for step in range(w.total_steps) for g in range(w.groups_per_step)
            for j in range(w.group_size)}


class FloorSource:
    """Consumer ``rank``'s micro-batches, built ahead by a thread from trajectories in memory (see the module).

    Args:
        rank: The consumer.
        w: The workload (the rank's groups of every step, split into ``microbatches_per_step`` in order).
        cfg: The model (its media preprocessing).
        encoding: ``"dup"`` (every trajectory's own encoder inputs) or ``"shared"`` (the step's media table on its
            micro-batches, built with the step's first).
        depth: Micro-batches ready ahead (with shared encoding at least a step's plus one, as ``iter`` grows to).
        timeout_s: The longest ``fetch`` waits for the thread.
    """

    def __init__(self, rank: int, w: TransferWorkload, cfg: VLMConfig, encoding: str, depth: int = 2,
                 timeout_s: float = 120.0):
        groups_per_rank = w.per_consumer_step // w.group_size
        mine = range(rank * groups_per_rank, (rank + 1) * groups_per_rank)
        self.steps: list[list[Trajectory]] = [[t for g in mine for t in make_group(w, s, g)]
                                              for s in range(w.total_steps)]
        kw = dataset_kwargs(w, cfg, encoding)
        self.collate = kw["collate"]
        self.media_collator = kw.get("media_collator")
        self.kinds = w.media_kinds
        self.w = w
        self.depth = depth if self.media_collator is None else max(depth, w.microbatches_per_step + 1)
        self.timeout_s = timeout_s
        self.items: collections.deque[Any] = collections.deque()
        self.commits: collections.deque[Any] = collections.deque()
        self.cond = threading.Condition()
        self.waiting = False  # the trainer waits for a micro-batch (set under cond)
        self.room_poll_s = 0.0005
        self.stop = False
        self.last_wait = 0.0
        self.taken = 0
        self.thread = threading.Thread(target=self._run, name=f"floor-{rank}", daemon=True)
        self.thread.start()

    def _item(self, trajs: list[Trajectory], index: int, media: Any) -> StepItem:
        mb = self.collate(trajs, None)
        if media is not None:
            mb.media = media
        k = self.w.microbatches_per_step
        return step_item(mb, tuple(t.id for t in trajs), index, k, index == k - 1, self.kinds)

    def _run(self) -> None:
        torch.set_num_threads(1)
        b, k = self.w.microbatch_size, self.w.microbatches_per_step
        try:
            for trajs in self.steps:
                parts = [trajs[i * b:(i + 1) * b] for i in range(k)]
                media = self.media_collator(parts) if self.media_collator is not None else None
                for i, part in enumerate(parts):
                    item = self._item(part, i, media)
                    while len(self.items) >= self.depth:  # room: polled, so that a pop never signals
                        if self.stop:
                            return
                        time.sleep(self.room_poll_s)
                    with self.cond:
                        if self.stop:
                            return
                        self.items.append(item)
                        if self.waiting:
                            self.cond.notify_all()
                    while self.commits:  # the trainer's enqueued commits (nothing to release here)
                        self.commits.popleft()
        except BaseException as e:  # handed to the trainer
            with self.cond:
                self.items.append(e)
                self.cond.notify_all()

    def fetch(self) -> StepItem:
        """The next micro-batch: a ``deque`` pop when one is ready (no lock, no signal; ``last_wait`` 0), else the
        wait for it."""
        self.last_wait = 0.0
        try:
            x = self.items.popleft()
        except IndexError:
            t0 = time.perf_counter()
            deadline = time.monotonic() + self.timeout_s
            with self.cond:
                self.waiting = True
                try:
                    while not self.items:
                        if not self.thread.is_alive() or time.monotonic() > deadline:
                            raise EngineError(f"the floor's thread delivered nothing within {self.timeout_s} s "
                                              f"(micro-batch {self.taken})") from None
                        self.cond.wait(0.5)
                finally:
                    self.waiting = False
                x = self.items.popleft()
            self.last_wait = time.perf_counter() - t0
        if isinstance(x, BaseException):
            raise x
        self.taken += 1
        return x  # type: ignore[no-any-return]

    def state(self) -> dict[str, int]:
        """The position after the last micro-batch taken (two keys)."""
        return {"taken": self.taken, "step": self.taken // self.w.microbatches_per_step}

    def commit(self, state: Any) -> None:
        """Enqueue ``state`` for the thread (it drains them between micro-batches)."""
        self.commits.append(state)

    def close(self) -> None:
        """Stop the thread (it finishes the micro-batch it builds)."""
        self.stop = True
        self.thread.join(timeout=10)
