"""Gradient synchronization of model replicas trained by consumer threads of one process (embedded engine).

On the embedded engine every consumer is a thread of one process, and threads cannot use DDP (a process group
has one rank per process). Each consumer thread trains its own replica of the model on its own micro-batches;
without synchronization the replicas drift apart. :class:`ThreadGradientSync` is the all-reduce those
replicas need: at each optimizer step every thread calls :meth:`~ThreadGradientSync.all_reduce` between its
last micro-batch's backward (``mb.info.is_last``) and ``optimizer.step()``; the call waits for the other
threads (a barrier), then gives every replica the same gradient: the average over the replicas (DDP's
semantics, so the loss scaling of the docs, ``loss_sum * world / info.global_loss_tokens``, gives the token
mean of the whole mini-batch), or their sum with ``average=False``.

Every replica receives bitwise the same values (each parameter is reduced once, in rank order, by one of the
threads, and copied into every replica), so replicas that start equal (:meth:`~ThreadGradientSync.broadcast`)
and take the same optimizer steps stay bitwise equal. A parameter without a gradient on a rank counts as zero
there; one without a gradient on every rank is left without one.

Example (two consumer threads, one replica each):

    >>> import threading, torch
    >>> from knitdata import BatchSpec, Pipeline, Trajectory
    >>> from knitdata.replicas import ThreadGradientSync
    >>> spec = BatchSpec({"math": 4}, num_minibatches=2, group_size=2)
    >>> pipe = Pipeline(spec, num_consumers=2, token_budget=64)
    >>> for i in range(4):
    ...     _ = pipe.put(Trajectory(id=f"t{i}", source="math", group=f"g{i // 2}", prompt_ids=torch.tensor([1, 2]),
    ...                             response_ids=torch.tensor([3, 4, 5 + i])))
    >>> _ = pipe.close()
    >>> sync = ThreadGradientSync(world_size=2)
    >>> models = [torch.nn.Embedding(16, 4) for _ in range(2)]
    >>> def train(rank):
    ...     model = models[rank]
    ...     sync.broadcast(model, rank)                 # every replica starts from rank 0's weights
    ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     for mb in pipe.dataset(rank, timeout=30):
    ...         loss = (model(mb.input_ids).sum(-1) * mb.loss_mask).sum() * 2 / mb.info.global_loss_tokens
    ...         loss.backward()
    ...         if mb.info.is_last:
    ...             sync.all_reduce(model, rank)        # the average of the two replicas' gradients
    ...             opt.step(); opt.zero_grad()
    >>> threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
    >>> for t in threads: t.start()
    >>> for t in threads: t.join()
    >>> torch.equal(models[0].weight, models[1].weight)
    True

A consumer thread that fails should call :meth:`~ThreadGradientSync.abort` (for example in ``except``), so
that the others raise instead of waiting; a thread that has called this object before and then ended is
noticed on its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from knitdata.errors import ConfigError, EngineError

__all__ = ["ThreadGradientSync"]

#: Seconds between checks, while a thread waits for the others, that they are still alive.
_POLL_S = 0.2


def _params(model: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(model, nn.Module):
        return list(model.parameters())
    return list(model)


class ThreadGradientSync:
    """All-reduce of gradients (and broadcast of parameters) among ``world_size`` replicas, one per thread.

    One object serves one set of replicas for the whole run; after :meth:`abort` (or a failure it detects) every
    call raises, so build a new one to start again.

    Args:
        world_size: Number of consumer threads, one replica each (the pipeline's ``num_consumers``).
        average: Divide the sum by ``world_size`` (DDP's semantics, the default) or leave the sum.
        timeout: Seconds a thread waits for the others at one call before it raises (``None``: no limit).

    Raises:
        ConfigError: ``world_size`` is not a positive int, or ``timeout`` is negative.
    """

    def __init__(self, world_size: int, *, average: bool = True, timeout: float | None = 1800.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise ConfigError(f"timeout must be a non-negative number or None, got {timeout!r}")
        self.world_size = world_size
        self.average = bool(average)
        self.timeout = None if timeout is None else float(timeout)
        self._cond = threading.Condition()
        self._generation = 0
        self._here: set[int] = set()
        self._threads: dict[int, threading.Thread] = {}
        self._broken: str | None = None
        self._params: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        self._reduced: dict[int, torch.Tensor | None] = {}

    def __repr__(self) -> str:
        return f"ThreadGradientSync(world_size={self.world_size}, average={self.average}, timeout={self.timeout})"

    # ------------------------------------------------------------------ public
    def all_reduce(self, model: nn.Module | Iterable[torch.Tensor], rank: int) -> None:
        """Give this rank's replica the average (or sum) of every replica's gradients; waits for all ranks.

        Call it on every rank at every optimizer step, after the backward of the last micro-batch
        (``mb.info.is_last``) and before ``optimizer.step()``.

        Args:
            model: This rank's replica (its ``parameters()``, in a fixed order), or its parameters.
            rank: This thread's rank, ``0 <= rank < world_size`` (the rank of its dataset).

        Raises:
            ConfigError: A bad rank, or the replicas' parameters differ in number or shape (the message
                names the parameter and the ranks).
            EngineError: Another rank called :meth:`abort`, its thread ended, or ``timeout`` passed first.
        """
        params = self._publish(rank, model, "all_reduce")
        # every replica's parameters are published: this rank reduces parameters rank, rank + N, ... in rank
        # order (so the result does not depend on timing), into new tensors every rank then copies from
        reduced: dict[int, torch.Tensor | None] = {}
        for i in range(rank, len(params), self.world_size):
            acc: torch.Tensor | None = None
            for replica in self._params:
                g = replica[i].grad
                if g is None:
                    continue
                if acc is None:
                    acc = g.detach().clone()
                else:
                    acc += g.detach().to(acc.device)
            if acc is not None and self.average:
                acc /= self.world_size
            reduced[i] = acc
        with self._cond:
            self._reduced.update(reduced)
            self._barrier(rank, "all_reduce")
        for i, p in enumerate(params):
            value = self._reduced[i]
            if value is None:
                continue
            if p.grad is None:
                p.grad = value.to(device=p.device, dtype=p.dtype, copy=True)
            else:
                p.grad.copy_(value)
        # no barrier here: nobody reads another replica's tensors or overwrites the reduced ones before every
        # rank has reached the next call's first barrier, that is, before every rank has copied

    def broadcast(self, model: nn.Module | Iterable[torch.Tensor], rank: int, src: int = 0) -> None:
        """Copy rank ``src``'s parameters into every replica (call it on every rank before training).

        Args:
            model: This rank's replica, or its parameters.
            rank: This thread's rank.
            src: The rank whose parameters every replica takes.

        Raises:
            ConfigError / EngineError: As :meth:`all_reduce`.
        """
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ConfigError(f"src must be a rank in [0, {self.world_size}), got {src!r}")
        params = self._publish(rank, model, "broadcast")
        if rank != src:
            with torch.no_grad():
                for p, q in zip(params, self._params[src]):
                    p.copy_(q)
        with self._cond:
            self._barrier(rank, "broadcast")  # rank src changes nothing before every replica has copied

    def abort(self, reason: str = "a consumer thread failed") -> None:
        """Make every waiting and later call raise :class:`~knitdata.errors.EngineError` with ``reason``.

        Call it from a consumer thread that fails, so that the other threads stop instead of waiting.
        """
        with self._cond:
            if self._broken is None:
                self._broken = reason
            self._cond.notify_all()

    # ------------------------------------------------------------------ barrier
    def _publish(self, rank: int, model: nn.Module | Iterable[torch.Tensor], what: str) -> list[torch.Tensor]:
        """Publish this rank's parameters, wait for every rank, and check that the replicas agree."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        params = _params(model)
        with self._cond:
            self._threads[rank] = threading.current_thread()
            self._params[rank] = params
            # the last rank to arrive drops the previous call's reduced values: every rank has copied them
            self._barrier(rank, what, on_last=self._reduced.clear)
            first = self._params[0]
            problem = None
            if len(params) != len(first):
                problem = f"rank {rank}'s replica has {len(params)} parameters, rank 0's {len(first)}"
            else:
                bad = next((i for i, (p, q) in enumerate(zip(params, first)) if p.shape != q.shape), None)
                if bad is not None:
                    problem = (f"parameter {bad} has shape {tuple(params[bad].shape)} on rank {rank} and "
                               f"{tuple(first[bad].shape)} on rank 0")
            if problem is not None:
                self._broken = problem
                self._cond.notify_all()
                raise ConfigError(f"gradient sync: {problem} (every consumer thread needs a replica of one model)")
        return params

    def _barrier(self, rank: int, what: str, on_last: Callable[[], object] | None = None) -> None:
        """Wait, holding ``self._cond``, until every rank has arrived; raise if that cannot happen.

        ``on_last`` runs (under the lock) in the rank that arrives last, before any rank goes on.
        """
        if self._broken is not None:
            raise EngineError(f"gradient sync of rank {rank} ({what}) stopped: {self._broken}")
        if rank in self._here:
            raise ConfigError(f"rank {rank} is already waiting at {what}: call it from one thread per rank")
        gen = self._generation
        self._here.add(rank)
        if len(self._here) == self.world_size:
            if on_last is not None:
                on_last()
            self._here.clear()
            self._generation += 1
            self._cond.notify_all()
            return
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while self._generation == gen:
            if self._broken is None:
                dead = sorted(r for r, t in self._threads.items() if r not in self._here and not t.is_alive())
                left = None if deadline is None else deadline - time.monotonic()
                if dead:
                    self._broken = f"the thread of rank(s) {dead} ended before reaching {what}"
                elif left is not None and left <= 0:
                    missing = sorted(set(range(self.world_size)) - self._here)
                    self._broken = (f"rank {rank} waited {self.timeout:g}s at {what} for rank(s) {missing}: every "
                                    "consumer thread must call it at every optimizer step")
                else:
                    self._cond.wait(_POLL_S if left is None else min(_POLL_S, left))
                    continue
                self._cond.notify_all()
            self._here.discard(rank)
            raise EngineError(f"gradient sync of rank {rank} ({what}) stopped: {self._broken}")
