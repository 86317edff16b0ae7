"""One consumer's view of the pipeline: an ``IterableDataset`` of its micro-batches in plan order, any engine.

:class:`TrajectoryDataset` yields the :class:`~knitdata.consumer.collate.MicroBatch` es of one rank, each with its
:class:`~knitdata.consumer.collate.MicroBatchInfo` (``.info``), waiting (up to ``timeout``) until the next mini-batch is
admitted and ending once the pipeline is closed and drained (or after ``max_minibatches`` per iteration).
It reads the plan from the control plane and the payloads from the storage units through the engine
(:class:`knitdata.engines.Engine`), so the same class serves the embedded and the Ray engine. Payloads are
fetched only when needed, as the fetch mode (:mod:`knitdata.consumer.fetch`) says:

* ``sample``: one storage request per trajectory, when the micro-batch is asked for (baseline);
* ``eager``: the consumer's whole share of the mini-batch before its first micro-batch;
* ``iter``: the next micro-batches are fetched, decoded, collated (and pinned / copied to ``device``) on a
  background thread (:class:`knitdata.consumer.prefetch.Prefetcher`) while the current one computes, across
  mini-batch boundaries.

The control-plane calls of a rank go through its :class:`~knitdata.consumer.session.ConsumerSession`; a micro-batch goes
through the stages of :mod:`knitdata.consumer.session` (plan, read, collate, media, metrics), the same on every engine.

With a ``media_collator`` (e.g. :class:`~knitdata.media.multimodal.MultimodalCollator`) the share of each mini-batch
is fetched at its first micro-batch and every micro-batch's ``media`` is the
:class:`~knitdata.media.multimodal.MultimodalBatch` of the whole share (``media.for_microbatch(info.microbatch)``
selects its rows). After a resume in the middle of a mini-batch the table covers the remaining micro-batches
only (the earlier ones are empty lists).

Positions: the rank's micro-batches are numbered ``j = 0, 1, 2, ...`` over the whole run (plans are
deterministic, so ``j`` names the same micro-batch in a fresh pipeline fed the same puts). DataLoader worker
``w`` of ``W`` (Ray engine) takes the micro-batches with ``j % W == w``; the DataLoader's round robin hands them
out in plan order. State (:meth:`TrajectoryDataset.state_dict`): the next ``j`` of this (worker's) iteration, a
few integers of JSON. A new dataset without a loaded state continues after the last micro-batch handed out
to the rank; a consumer that crashed loads its saved state instead.

Replicas: the tensor/pipeline-parallel peers of data-parallel rank ``rank`` build their datasets with
``replica=k, num_replicas=R`` (:func:`knitdata.parallel.replica_layout` derives them from a ``DeviceMesh``). Each
replica receives the same micro-batches in the same order, holds its own lease (a newer iterator of replica ``k``
fences only replica ``k``'s older one), and saves and resumes on its own; the rank's payloads are released once
every replica is past them.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset, get_worker_info

from knitdata.consumer.fetch import FETCH_MODES, FetchMode
from knitdata.consumer.session import (
    ConsumerSession,
    DatasetOptions,
    MediaStage,
    PlanStage,
    Production,
    RankPosition,
    ReadStage,
)
from knitdata.control.rankstates import MERGED_FORMAT, collect_states, planning_guard, planning_of
from knitdata.control.records import PlanEntry
from knitdata.engines.base import Engine
from knitdata.errors import ConfigError, EngineError, KnitdataError, StateError
from knitdata.observe import trace as tracing
from knitdata.observe.metrics import PENDING_LIMIT, ConsumerMetrics

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from knitdata.consumer.collate import MicroBatch
    from knitdata.consumer.fetch import Source
    from knitdata.consumer.prefetch import PrefetchQueue

__all__ = ["TrajectoryDataset", "FETCH_MODES", "STATE_FORMAT", "find_states", "commit_point"]

#: ``format of a :class:`TrajectoryDataset` state.
STATE_FORMAT = "knitdata.TrajectoryDataset"
_STATE_VERSION = 3
_OLD_STATE_VERSIONS = (2,)  # read too (no fingerprint: a refill cannot be checked against them)


def find_states(obj: Any, out: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every dataset state nested in ``obj`` (itself, or a ``StatefulDataLoader`` state with worker snapshots)."""
    return collect_states(obj, (STATE_FORMAT,), out)


def commit_point(state: Any, rank: int) -> int:
    """Where a commit of ``state`` releases rank ``rank`` up to: the state of a :class:`TrajectoryDataset`, or any
    object holding such states (a ``StatefulDataLoader``'s, one per worker).

    Raises:
        StateError: ``state`` holds no state of rank ``rank``, or a malformed one.
    """
    # a state of a dataset as is, else every state nested in it (a loader's)
    states = [state] if type(state) is dict and state.get("format") == STATE_FORMAT else find_states(state)
    mine = [s for s in states if s.get("rank") == rank]
    if not mine:
        raise StateError(f"commit() needs a state of rank {rank} from state_dict(), got {state!r:.200}")
    try:
        nw = int(mine[0]["num_workers"])
        nexts = {int(s["worker"]): int(s["next"]) for s in mine}
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"bad {STATE_FORMAT} state: {e}") from e
    # handed out so far: a prefix of the rank's micro-batches (the DataLoader's round robin), ending at the
    # smallest next index; a worker without a snapshot lies at most nw - 1 below the others' smallest
    upto = min(nexts.values())
    if len(nexts) < nw:
        upto = max(0, upto - (nw - 1))
    return upto


def _fixed_keys(lay: Mapping[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """The keys of a dataset state that change only with the layout or the worker (``lay``: the layout as the
    control plane describes it for the rank)."""
    out: dict[str, Any] = {"layout": lay["layout"], "run": lay.get("run")}
    if lay["history"] is not None:
        out["layout_history"], out["layout_remainder"] = lay["history"], lay["remainder"]
    out.update(fixed)
    return out


def _count(state: Mapping[str, Any], key: str, *, optional: bool = False) -> Any:
    """A non-negative int field of a state (``None`` allowed when ``optional``); else :class:`StateError`."""
    v = state.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise StateError(f"bad {STATE_FORMAT} state: {key!r} must be a non-negative int, got {v!r:.100}")
    return v


class TrajectoryDataset(IterableDataset):
    """The micro-batches of consumer ``rank``, in plan order. Build it with :meth:`Pipeline.dataset`.

    Args:
        engine: The pipeline's engine.
        rank: The consumer.
        fetch: ``"sample"``, ``"eager"`` or ``"iter"``, the name of another registered
            :class:`~knitdata.consumer.fetch.FetchMode`, or a :class:`~knitdata.consumer.fetch.FetchMode`.
        collate: ``collate(trajectories, info) -> MicroBatch``; default :class:`~knitdata.consumer.collate.TokenCollator`.
        media_collator: ``media_collator(list_of_micro_batches) -> MultimodalBatch`` (e.g.
            :class:`~knitdata.media.multimodal.MultimodalCollator`): the media table of the rank's share of each
            mini-batch; ``None``: no media table.
        prefetch_depth: Micro-batches prepared ahead in ``iter`` mode. With a ``media_collator`` at least a
            mini-batch's micro-batches plus one: the next share (payloads and media table) is prepared while the
            current mini-batch computes, so two shares are in memory at most.
        device: Device the prefetch thread copies micro-batches to (``iter`` mode).
        pin_memory: Pin micro-batches on the prefetch thread (default: when CUDA is used).
        max_minibatches: Each iteration stops after this many mini-batches (``None``: until drained).
        timeout: Most seconds to wait for the next micro-batch before :class:`~knitdata.errors.DataTimeoutError`
            (``None``: no limit).
        replica: This dataset's tensor/pipeline-parallel replica of data-parallel rank ``rank`` (its peers receive
            the same micro-batches; :func:`knitdata.replica_layout` derives ``rank``, ``replica`` and
            ``num_replicas`` from a ``DeviceMesh``). ``None``: the rank has one consumer, which acts as replica 0.
        num_replicas: Replicas per data-parallel rank, given with ``replica`` (registered with the control plane;
            every replica of every rank must pass the same number).

    Attributes:
        metrics: The rank's :class:`~knitdata.observe.metrics.ConsumerMetrics` in this process.
    """

    def __init__(
        self,
        engine: Engine,
        rank: int,
        *,
        fetch: str | FetchMode = "iter",
        collate: Callable[..., Any] | None = None,
        media_collator: Callable[..., Any] | None = None,
        prefetch_depth: int = 2,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        max_minibatches: int | None = None,
        timeout: float | None = 1800.0,
        replica: int | None = None,
        num_replicas: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < engine.num_consumers:
            raise ConfigError(f"rank must be an int in 0..{engine.num_consumers - 1}, got {rank!r}")
        options = DatasetOptions(fetch=fetch, collate=collate, media_collator=media_collator,
                                 prefetch_depth=prefetch_depth, device=device, pin_memory=pin_memory,
                                 max_minibatches=max_minibatches, timeout=timeout, replica=replica,
                                 num_replicas=num_replicas)
        mode = options.validate(rank)
        if collate is None:
            from knitdata.consumer.collate import TokenCollator

            collate = TokenCollator()
        self.engine = engine
        self.rank = rank
        self.fetch = mode.name
        self.fetch_mode = mode
        self.collate = collate
        self.media_collator = media_collator
        self.prefetch_depth = prefetch_depth
        self.device = device
        self.pin_memory = pin_memory
        self.max_minibatches = max_minibatches
        self.timeout = timeout
        self.replica, self.num_replicas = replica, num_replicas
        self.options = options
        #: Where this rank (this DataLoader worker) stands; its iterators share it.
        self.position = RankPosition()
        self._active: weakref.ref[_ConsumerIterator] | None = None
        self.session = ConsumerSession(self.engine, self.rank, self.replica or 0)
        if num_replicas is not None:
            self.session.register(num_replicas)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_active"}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._active = None

    @property
    def metrics(self) -> ConsumerMetrics:
        """This process's metrics of the rank."""
        return self.engine.metrics(self.rank)

    @property
    def pipeline_name(self) -> str | None:
        """The name of the pipeline (Ray engine), or ``None``."""
        return self.engine.name

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[MicroBatch]:
        wi = get_worker_info()
        w, nw = (wi.id, wi.num_workers) if wi is not None else (0, 1)
        if wi is not None and not self.engine.supports_worker_processes:
            raise EngineError(
                f"TrajectoryDataset of an {self.engine.kind}-engine Pipeline cannot run in DataLoader worker processes "
                "(a forked worker never sees later puts): use num_workers=0 (fetch='iter' already prefetches on a "
                "background thread), or the Ray engine: Pipeline(..., engine='ray')")
        if self.media_collator is not None and nw > 1:
            raise ConfigError(
                "media_collator needs the rank's whole share of a mini-batch in one process (one table of unique media "
                "for all its micro-batches): use num_workers=0 (fetch='iter' prefetches on a thread)")
        pos = self.position
        with pos.lock:
            self._close_active()
            if pos.next is not None and pos.worker != (w, nw):
                raise StateError(f"state of worker {pos.worker[0]} of {pos.worker[1]} loaded into worker {w} of "
                                 f"{nw}: resume with the same num_workers")
            pos.worker = (w, nw)
            it = _ConsumerIterator(self, w, nw)  # takes the lease (fencing an older iterator), then the position
            self._active = weakref.ref(it)
        return it

    def stateful_loader(self, **kwargs: Any) -> Any:
        """``torchdata.stateful_dataloader.StatefulDataLoader(self, batch_size=None, **kwargs)``.

        Its ``set_vital`` deprecation warning is filtered. Worker processes (Ray engine) are spawned. Save and load
        its ``state_dict()`` per rank, and :meth:`commit` a saved state.

        Raises:
            EngineError: ``num_workers > 0`` on the embedded engine.
        """
        if kwargs.get("num_workers", 0) and not self.engine.supports_worker_processes:
            raise EngineError(
                "num_workers > 0 needs the Ray engine (Pipeline(..., engine='ray')): an embedded-engine pipeline lives "
                "in one process; fetch='iter' already prefetches on a background thread")
        from torchdata.stateful_dataloader import StatefulDataLoader

        kwargs.setdefault("batch_size", None)
        kwargs.setdefault("num_workers", 0)
        if kwargs["num_workers"] > 0:
            kwargs.setdefault("multiprocessing_context", "spawn")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(self, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch (Accelerate calls it). Plan order does not depend on it."""
        self.position.epoch = int(epoch)

    @property
    def epoch(self) -> int:
        """The epoch last set."""
        return self.position.epoch

    def close(self) -> None:
        """Stop the active iterator (its prefetch thread); the position stays after the last micro-batch handed out."""
        with self.position.lock:
            self._close_active()

    def _close_active(self) -> None:
        it = self._active() if self._active is not None else None
        if it is not None:
            it.close()
        self._active = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position after the last micro-batch handed out (constant size).

        It holds a fingerprint of the rank's micro-batches up to there, so that a new job refilled with other puts
        (or the same in another order) refuses it instead of delivering twice or skipping. With ``release="step"``
        the automatic release at the start of each mini-batch never goes past the last state taken (or loaded):
        a job can always roll back to the last state it saved.
        """
        it = self._active() if self._active is not None else None
        pos = self.position
        if it is not None and not it.done:
            # once per step: the state the producing thread stamped on the micro-batch next() handed out last (no
            # lock; the position's fields follow at the next sync)
            quick = pos.stamped(self.engine.layout, it.end)
            if quick is not None:
                it.set_cap(quick["next"])
                return quick
        with pos.lock:
            if it is not None:
                it.sync()
            w, nw = pos.worker
            if pos.next is None:
                wi = get_worker_info()
                w, nw = (wi.id, wi.num_workers) if wi is not None else (0, 1)
            nxt, fp = pos.next, pos.fingerprint
            if nxt is None:
                nxt, fp = self.session.start(w, nw)
            mb, micro = pos.at if pos.at is not None else (None, None)
            end, handed = pos.end, pos.handed_out
            pos.cap = nxt
            if it is not None:
                it.set_cap(nxt)
            lay = pos.layout
            if lay is None or lay.get("run") is None or (lay["history"] is not None and lay["remainder"] is None):
                lay = pos.layout = self.engine.control.reshaping.layout_history(self.rank)
                pos.fixed = None
            layout = self.engine.layout
            fixed = pos.fixed
            if fixed is None or fixed[0] is not layout or fixed[1] != (w, nw):
                keys = {"format": STATE_FORMAT, "version": _STATE_VERSION, "pipeline": self.engine.name,
                        "rank": self.rank, "num_consumers": self.engine.num_consumers, "worker": w,
                        "num_workers": nw, "planning": planning_of(self.engine.config)}
                if self.replica is not None:
                    keys.update(replica=self.replica, num_replicas=self.num_replicas)
                fixed = (layout, (w, nw), _fixed_keys(lay, keys))
                known = lay.get("run") is not None and (lay["history"] is None or lay["remainder"] is not None)
                pos.fixed = fixed if known else None  # else asked for again: the run's mark, a remainder
            epoch = pos.epoch
        # a copy of the fixed keys and the position's
        state = fixed[2].copy()
        state["next"] = nxt
        state["minibatch"] = mb
        state["microbatch"] = micro
        state["end_minibatch"] = end
        state["epoch"] = epoch
        state["handed_out"] = handed
        state["fingerprint"] = None if fp is None else fp[1]
        state["fingerprint_length"] = None if fp is None else fp[0]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the micro-batch ``state`` was taken at; payloads before it are released.

        ``state`` is this rank's own state, or the merged state of all ranks of a run saved with another number of
        ranks or DataLoader workers (:func:`knitdata.merge_rank_states`): then every rank of this pipeline loads
        the same merged state, before iterating; the pipeline applies it once (see
        :mod:`knitdata.control.reshape`) and this rank starts at its first micro-batch of the new layout.

        With replicas, the state of any replica of the same rank may be loaded (they receive the same micro-batches);
        it positions this dataset's replica only.

        Raises:
            StateError: Not a TrajectoryDataset state, one of another rank, layout, pipeline or planning (another
                ``token_budget``, spec...: :func:`~knitdata.control.rankstates.planning_guard`), or a merged state refused.
        """
        if isinstance(state, Mapping) and state.get("format") == MERGED_FORMAT:
            with planning_guard(state, self.engine, self.rank):
                self.engine.control.reshaping.reshape(dict(state), None)
            with self.position.lock:
                self._close_active()
                self.position.reset(int(state.get("epoch") or 0))
            return
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise StateError(f"not a {STATE_FORMAT} state: {state!r:.200}")
        if state.get("version") != _STATE_VERSION and state.get("version") not in _OLD_STATE_VERSIONS:
            raise StateError(f"unsupported state version {state.get('version')!r}; expected {_STATE_VERSION}")
        if state.get("layout_history") is not None:  # a run reshaped before: this pipeline plans through it
            self.engine.control.reshaping.install_history(state["layout_history"])
        if state.get("rank") != self.rank or state.get("num_consumers") != self.engine.num_consumers:
            raise StateError(
                f"state of rank {state.get('rank')} of {state.get('num_consumers')} consumers loaded into rank "
                f"{self.rank} of {self.engine.num_consumers}: save and load one state per rank; to resume onto another "
                "number of ranks, merge the states of all ranks (knitdata.merge_rank_states) and load the merged state "
                "on every new rank")
        nxt, w, nw = _count(state, "next"), _count(state, "worker"), _count(state, "num_workers")
        end, mb, micro = (_count(state, k, optional=True) for k in ("end_minibatch", "minibatch", "microbatch"))
        epoch, handed = _count(state, "epoch", optional=True) or 0, _count(state, "handed_out", optional=True) or 0
        pos = None if mb is None or micro is None else (mb, micro)
        if not w < nw:
            raise StateError(f"bad position in state: worker {w} of {nw}")
        fp_len, fp = _count(state, "fingerprint_length", optional=True), state.get("fingerprint")
        if fp is not None and (not isinstance(fp, str) or fp_len is None or fp_len > nxt):
            raise StateError(f"bad {STATE_FORMAT} state: fingerprint {fp!r:.40} of length {fp_len!r}")
        if fp is not None and fp_len is not None:
            where = (f"after mini-batch {mb} micro-batch {micro - 1}" if pos is not None and micro
                     else f"before mini-batch {mb}" if pos is not None else f"at micro-batch {nxt}")
            with planning_guard(state, self.engine, self.rank):
                self.session.verify(fp_len, fp, where)
        with self.position.lock:
            self._close_active()
            self.position.load(nxt, (w, nw), pos, None if fp is None or fp_len is None else (fp_len, fp), end, epoch,
                               handed)
        if nw == 1:
            self.session.seek(nxt)
        if mb is not None:  # the trainer finished the mini-batches before it (the bound's first version report)
            self.session.resumed_at(mb)

    def commit(self, state: Mapping[str, Any] | None = None, *, wait: bool = False) -> int | None:
        """Commit a position: this rank's payloads before it are released from storage.

        Call it right after saving ``state_dict()`` (or the ``StatefulDataLoader``'s state) durably: a restore may
        go back to any committed-or-later state, never before. With ``release="step"`` a commit also happens
        whenever the rank's iterator starts its next mini-batch, up to the last state taken or loaded at most.

        Args:
            state: A state from :meth:`state_dict`, or a ``StatefulDataLoader`` state holding one per worker;
                default: this dataset's current position.
            wait: Wait for the control plane to apply it and return the count. By default the commit is queued
                for this process's background sender, off the trainer's thread (safe: a commit that never arrives
                only keeps payloads longer; a restore commits again).

        Returns:
            How many micro-batches were released by this call, or ``None`` when it was queued without waiting.

        Raises:
            StateError: ``state`` holds no state of this rank.
        """
        if state is None:
            state = self.state_dict()
        if type(state) is dict and state.get("format") == STATE_FORMAT and state.get("num_workers") == 1:
            upto = state.get("next")  # the common case, once per step: this rank's own state, one worker
            if state.get("rank") == self.rank and type(upto) is int:
                it = self._active() if self._active is not None else None
                if it is not None and not it.done and not wait:  # queued for the sender, whose wake the
                    # iterator's stages relay: no system call on the trainer's thread
                    return self.session.commit(upto, wait=False, relayed=True)
        return self.session.commit(commit_point(state, self.rank), wait=wait)

    def flush(self) -> None:
        """Send this process's queued hand-out records and commits to the control plane now, and wait for it.

        They are sent on their own, off the trainer's thread: soon after a commit or a hand-out that frees storage,
        else with the heartbeat (:data:`~knitdata.consumer.handoff.HEARTBEAT_S`). ``Pipeline.stats()`` sends them first;
        call this before reading the control plane's view of this rank some other way (unit memory, a test).
        """
        self.session.flush()

    def step_metrics(self, *, flush: bool = True, units: bool = True, prefix: str = "knitdata/") -> dict[str, float | int]:
        """This rank's figures for a trainer's logger: one flat ``{"knitdata/...": number}`` dict.

        Call it once per optimizer step (after the micro-batch with ``info.is_last``) and log it where the trainer
        logs (``accelerator.log``, ``SummaryWriter.add_scalar``, ``wandb.log``). The keys are those of
        :func:`knitdata.observe.monitor.flat_metrics` for this rank: staleness (mean, p95, worst; overall, per source and
        of this rank), this rank's exposed data wait in its last step (``knitdata/data_wait_s``), bytes it read
        locally and from other nodes, seconds from put to admission, store fill and spills, and what a staleness
        bound dropped. It costs one control-plane call (plus one per storage unit with ``units``; on the Ray engine
        each is a round trip).

        Args:
            flush: Send this process's queued hand-out records first (so the last step's staleness is counted).
            units: Read the storage units' counters (the ``store/...`` keys).
            prefix: Put before every key.

        Returns:
            ``{key: int | float}``, every value finite.
        """
        from knitdata.observe.monitor import flat_metrics

        if flush:
            self.session.flush()
        stats: dict[str, Any] = dict(self.engine.control.reporting.stats())
        if units:
            found: dict[str, Any] = {}
            for u, unit in self.engine.units.items():
                try:
                    found[u] = unit.stats().to_dict()
                except Exception:  # noqa: BLE001 - a dead unit's actor: its figures are left out
                    found[u] = None
            stats["units"] = found
        return flat_metrics(stats, rank=self.rank, consumer=self.metrics.to_dict(), prefix=prefix)

    # ------------------------------------------------------------------ internals
    def ended(self, it: _ConsumerIterator) -> None:
        """Iterator ``it`` finished its pass: with ``release="step"`` its position is committed (a mini-batch
        boundary). The commit is queued for the report the iterator's lease sends as it ends, right after this (no
        wake-up of the sender's thread, which would compete with that report for the interpreter lock)."""
        with self.position.lock:
            current = self._active is not None and self._active() is it
            if current:
                self._active = None
            upto = self.position.ended(current, self.engine.release == "step")
        if upto is not None:
            self.session.commit(upto, wait=False, relayed=True)

    def __repr__(self) -> str:
        rep = "" if self.replica is None else f", replica={self.replica} of {self.num_replicas}"
        return (f"TrajectoryDataset(rank={self.rank}{rep}, fetch={self.fetch!r}, next={self.position.next}, "
                f"engine={self.engine.kind!r})")


class _ConsumerIterator(Iterator["MicroBatch"]):
    """One pass over a consumer's (worker's) micro-batches; records each one as it is handed out.

    It holds the (rank, worker) lease (:class:`~knitdata.consumer.handoff.ConsumerLease`): taking it fences an older
    iterator of the rank, and the position starts after the last micro-batch that one handed out. ``__next__``
    takes the next micro-batch (in ``iter`` mode from the prefetch queue) and records it in the lease; the
    process's :class:`~knitdata.consumer.handoff.ControlSender` tells the control plane. The producing stages
    (:class:`knitdata.consumer.session.Production`, run on the prefetch thread in ``iter`` mode) hold neither this iterator nor
    the dataset, so an abandoned iterator is collected and its ``__del__`` stops the thread and ends the lease.
    """

    def __init__(self, ds: TrajectoryDataset, worker: int, num_workers: int) -> None:
        self._ds = ds
        self._rank = ds.rank
        self._stop = threading.Event()
        self._done = False
        self._source: Source[tuple[dict[str, Any], Any, bool, bool, tuple[Any, ...]]] | None = None
        self._queue: PrefetchQueue | None = None
        self._position = pos = ds.position  # the producing thread stamps each micro-batch's position (pos.stamp)
        self._session = ds.session
        self._lease, start = ds.session.lease(worker, num_workers, pos.cap)
        j = pos.begin(start)  # after the last micro-batch handed out to the rank (by the iterator fenced, too)
        self._waits = ds.metrics.pending
        self._handed_at: float | None = None  # trace clock of the last hand-out (the trainer computes from there)
        self._metrics = ds.metrics
        engine, mode, opts = ds.engine, ds.fetch_mode, ds.options
        self._plan = plan = PlanStage(engine, ds.rank, self._lease, self._stop, j, num_workers, opts.timeout,
                                      opts.max_minibatches, pos.end)
        media = MediaStage(opts.media_collator, opts.prefetch_depth) if opts.media_collator is not None else None
        reader = ReadStage(engine, ds.rank, mode, plan, whole_share=mode.reads_share(engine) or media is not None)
        made = Production(plan, reader, ds.collate, media, ds.metrics, self._stop, pos.stamp)
        self._source = source = mode.prepare(made, depth=opts.prefetch_depth, device=opts.device,
                                             pin_memory=opts.pin_memory)
        self._queue = source.queue  # iter mode: next() pops prepared micro-batches itself
        # the trainer about to wait for data relays queued reports (by waking the sender's thread: the trainer does
        # not make the report itself)
        source.on_wait = functools.partial(self._lease.relay, False)
        if media is not None:  # the prefetch thread reads a whole share ahead (weakly: the stages must not hold it)
            media.grow = weakref.WeakMethod(source.set_depth)

    def __next__(self) -> MicroBatch:
        # once per micro-batch on the trainer's thread, right after its compute (cold caches): two frames, few objects.
        # In iter mode a prepared micro-batch is popped here (PrefetchQueue.pop), else the source's next() makes it
        q = self._queue
        if q is not None and q.fast and q.items and (got := q.pop()) is not None:  # (nothing queued: no call)
            entry, mb, is_last, empty, position = got[2]
            if self._done:  # closed by another thread meanwhile: not handed out
                raise StopIteration
            t0 = t1 = q.left_at
            blocked = 0.0
        else:
            source = self._source
            if source is None:
                raise StopIteration
            t0 = time.perf_counter()
            try:
                entry, mb, is_last, empty, position = next(source)
            except StopIteration:
                self._finish()
                raise
            except BaseException:
                if self._done:  # closed by another thread while waiting: the pass ends
                    raise StopIteration from None
                self.close()
                raise
            if self._done:  # closed by another thread while this item was prepared: not handed out
                raise StopIteration
            t1 = time.perf_counter()
            blocked = source.last_wait_s
        lease = self._lease
        if t1 > lease.deadline:  # renew first (the sender is late, a report failed), or fenced: take_out raises
            try:
                lease.take_out(entry, t1)
            except KnitdataError:
                self.close()  # a newer iterator holds the rank (or the control plane is gone): nothing more
                raise
        else:
            lease.hand_out(entry)  # a deque append: what it frees and reports is derived off this thread
        self._position.handed = position
        waits = self._waits  # the rank's ConsumerMetrics.pending: one append, folded by readers
        waits.append((t1 - t0, blocked, is_last, empty))
        if len(waits) > PENDING_LIMIT:
            self._metrics.fold()
        if tracing.tracer is not None:
            self._trace(tracing.tracer, entry, t0, t1)
        return mb

    def _trace(self, tr: tracing.Tracer, entry: PlanEntry, t0: float, t1: float) -> None:
        """Record the trainer's wait in ``next()`` (``t0``..``t1``, perf_counter; the hand-out is at its end) and
        the compute since the previous hand-out."""
        start, end = t0 * 1e6, t1 * 1e6  # perf_counter() is the trace clock (in seconds)
        args = {"rank": self._rank, "step": entry.minibatch, "microbatch": entry.microbatch, "j": entry.j}
        if self._handed_at is not None:
            tr.span("compute", "trainer", self._handed_at, start, {"rank": self._rank})
        tr.span("wait", "trainer", start, end, args)  # the merge derives the hand-out at its end
        self._handed_at = end

    def set_cap(self, cap: int) -> None:
        """A state was taken at ``cap``: hand-outs from now on release (``release="step"``) up to it at most."""
        self._lease.set_cap(cap)

    def sync(self) -> None:
        """Bring the dataset's position up to the last micro-batch this iterator handed out."""
        self._position.sync(self._plan.end)

    @property
    def end(self) -> int | None:
        """The first mini-batch this pass does not reach (``None``: until drained, or not known yet)."""
        return self._plan.end

    @property
    def done(self) -> bool:
        """Whether the pass ended or was closed."""
        return self._done

    def _finish(self) -> None:
        self.sync()
        self._ds.ended(self)
        self.close()
        if tracing.tracer is not None:  # the pass ended: its events reach the part file now (off this thread)
            tracing.tracer.wake()

    def close(self) -> None:
        """Stop producing; items prepared but not handed out are dropped (they were not handed out)."""
        if self._source is None:
            return
        self._done = True
        self._stop.set()
        source, self._source, self._queue = self._source, None, None
        source.close()
        self.sync()
        self._session.end(self._lease, self._metrics)  # its last records, then the lease goes

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
