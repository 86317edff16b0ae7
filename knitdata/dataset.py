"""One consumer's view of the pipeline: an ``IterableDataset`` of its micro-batches in plan order.

:class:`TrajectoryDataset` yields the :class:`~knitdata.collate.MicroBatch` es of one rank, each with its
:class:`~knitdata.collate.MicroBatchInfo` (``.info``), blocking until the next mini-batch is admitted and
ending once the pipeline is closed and drained (or after ``max_minibatches`` per iteration). Payloads are
fetched only when needed:

* ``sample``: one storage request per trajectory, when the micro-batch is asked for (baseline);
* ``eager``: the consumer's whole share of the mini-batch before its first micro-batch;
* ``iter``: micro-batch ``i + 1`` is fetched, decoded, collated (and pinned / copied to ``device``) on a
  background thread (:class:`knitdata.prefetch.Prefetcher`) while micro-batch ``i`` computes; prefetch runs
  across mini-batch boundaries whenever the next mini-batch is already admitted.

With a ``media_collator`` (e.g. :class:`~knitdata.multimodal.MultimodalCollator`) the share of each
mini-batch is fetched at its first micro-batch and every micro-batch's ``media`` is the
:class:`~knitdata.multimodal.MultimodalBatch` of the whole share (``media.for_microbatch(info.microbatch)``
selects its rows). After a resume in the middle of a mini-batch the table covers the remaining
micro-batches only (the earlier ones are empty lists).

State (:meth:`TrajectoryDataset.state_dict`): the position after the last micro-batch handed out, a few
integers, JSON-serializable, constant size. A dataset of a freshly built pipeline fed the same puts and
loaded with it continues exactly after that micro-batch; so does ``StatefulDataLoader(ds, batch_size=None,
num_workers=0)``. Release follows the pipeline's ``release`` mode: by default (``"step"``) a rank's payloads
stay in storage until the rank starts its next mini-batch or calls :meth:`TrajectoryDataset.commit`, so a
consumer that crashes mid-step and restores its last step-boundary state receives that step again.

Engines: on ``"embedded"`` DataLoader worker processes are refused (a forked worker never sees later puts).
The dataset exposes no ``generator`` attribute (Accelerate would try to synchronize it) and has
:meth:`TrajectoryDataset.set_epoch`.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset, get_worker_info

from knitdata.errors import ConfigError, EngineError, StateError
from knitdata.metrics import ConsumerMetrics
from knitdata.planner import PlannedMicroBatch
from knitdata.record import Trajectory

if TYPE_CHECKING:  # pragma: no cover
    from knitdata.collate import MicroBatch
    from knitdata.pipeline import Pipeline

__all__ = ["TrajectoryDataset", "FETCH_MODES"]

#: Fetch modes (DESIGN.md §4).
FETCH_MODES: tuple[str, ...] = ("sample", "eager", "iter")

_STATE_FORMAT = "knitdata.TrajectoryDataset"
_STATE_VERSION = 1


class TrajectoryDataset(IterableDataset):
    """The micro-batches of consumer ``rank``, in plan order. Build it with :meth:`Pipeline.dataset`.

    Args:
        pipeline: The pipeline.
        rank: The consumer.
        fetch: ``"sample"``, ``"eager"`` or ``"iter"``.
        collate: ``collate(trajectories, info) -> MicroBatch``; default :class:`~knitdata.collate.TokenCollator`.
        media_collator: ``media_collator(list_of_micro_batches) -> MultimodalBatch``, or ``None``.
        prefetch_depth: Micro-batches prepared ahead in ``iter`` mode.
        device: Device the prefetcher copies micro-batches to (``iter`` mode).
        pin_memory: Pin on the prefetch thread (default: when CUDA is used).
        max_minibatches: Each iteration stops after this many mini-batches (``None``: until drained).

    Attributes:
        metrics: The rank's :class:`~knitdata.metrics.ConsumerMetrics` (exposed latency, bytes, fetch time).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        rank: int,
        *,
        fetch: str = "iter",
        collate: Callable[..., Any] | None = None,
        media_collator: Callable[..., Any] | None = None,
        prefetch_depth: int = 2,
        device: Any = None,
        pin_memory: bool | None = None,
        max_minibatches: int | None = None,
    ) -> None:
        super().__init__()
        pipeline._check_rank(rank)
        if fetch not in FETCH_MODES:
            raise ConfigError(f"unknown fetch mode {fetch!r}; choose one of {FETCH_MODES}")
        if max_minibatches is not None and (not isinstance(max_minibatches, int) or max_minibatches < 1):
            raise ConfigError(f"max_minibatches must be a positive int or None, got {max_minibatches!r}")
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ConfigError(f"prefetch_depth must be an int >= 1, got {prefetch_depth!r}")
        if collate is None:
            from knitdata.collate import TokenCollator

            collate = TokenCollator()
        self.pipeline = pipeline
        self.rank = rank
        self.fetch = fetch
        self.collate = collate
        self.media_collator = media_collator
        self.prefetch_depth = prefetch_depth
        self.device = device
        self.pin_memory = pin_memory
        self.max_minibatches = max_minibatches
        self.metrics: ConsumerMetrics = pipeline.metrics(rank)
        self._lock = threading.Lock()
        self._step, self._micro = pipeline._get_position(rank)
        self._end_step: int | None = None
        self._epoch = 0
        self._handed_out = 0
        self._active: weakref.ref[_ConsumerIterator] | None = None

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[MicroBatch]:
        if get_worker_info() is not None:
            raise EngineError(
                f"TrajectoryDataset of an in-process Pipeline (engine={self.pipeline.engine!r}) cannot run in "
                "DataLoader worker processes (a forked worker never sees later puts): use num_workers=0 "
                "(fetch='iter' already prefetches on a background thread), or the Ray engine across processes: "
                "Pipeline(..., engine='ray', engine_options={'cross_process': True, ...}).dataset(rank) or "
                "knitdata.storage.ray_engine.RayPipeline"
            )
        with self._lock:
            self._close_active()
            if self._end_step is None and self.max_minibatches is not None:
                self._end_step = self._step + self.max_minibatches
            it = _ConsumerIterator(self, self._step, self._micro, self._end_step)
            self._active = weakref.ref(it)
        return it

    def stateful_loader(self, **kwargs: Any) -> Any:
        """``torchdata.stateful_dataloader.StatefulDataLoader(self, batch_size=None, num_workers=0, **kwargs)``.

        Its ``set_vital`` deprecation warning is filtered. Save and load its ``state_dict()`` per rank.

        Raises:
            EngineError: ``num_workers > 0`` on the embedded engine.
        """
        if kwargs.get("num_workers", 0):
            raise EngineError(
                "num_workers > 0 needs the cross-process Ray engine (engine='ray' with "
                "engine_options={'cross_process': True}); an in-process Pipeline serves num_workers=0 only"
            )
        from torchdata.stateful_dataloader import StatefulDataLoader

        kwargs.setdefault("batch_size", None)
        kwargs.setdefault("num_workers", 0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(self, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch (Accelerate calls it). Plan order does not depend on it."""
        self._epoch = int(epoch)

    @property
    def epoch(self) -> int:
        """The epoch last set."""
        return self._epoch

    def close(self) -> None:
        """Stop the active iterator (its prefetch thread); the position stays after the last micro-batch handed out."""
        with self._lock:
            self._close_active()

    def _close_active(self) -> None:
        it = self._active() if self._active is not None else None
        if it is not None:
            it.close()
        self._active = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position after the last micro-batch handed out (constant size)."""
        with self._lock:
            return {
                "format": _STATE_FORMAT,
                "version": _STATE_VERSION,
                "rank": self.rank,
                "num_consumers": self.pipeline.num_consumers,
                "minibatch": self._step,
                "microbatch": self._micro,
                "end_minibatch": self._end_step,
                "epoch": self._epoch,
                "handed_out": self._handed_out,
            }

    def commit(self, state: dict[str, Any] | None = None) -> int:
        """Commit a position: payloads of this rank's micro-batches before it are released from storage.

        Call it right after saving ``state_dict()`` (or the ``StatefulDataLoader``'s state) durably: a
        restore may go back to any committed-or-later state, never before. With the pipeline's default
        ``release="step"`` a commit also happens whenever this rank starts its next mini-batch.

        Args:
            state: A state from :meth:`state_dict` (or a ``StatefulDataLoader`` state holding one); default:
                the current position.

        Returns:
            The number of micro-batches released.

        Raises:
            StateError: ``state`` is not a state of this rank.
        """
        if state is None:
            with self._lock:
                pos = (self._step, self._micro)
        else:
            inner = _find_state(state)
            if inner is None or inner.get("rank") != self.rank:
                raise StateError(f"commit() needs a state of rank {self.rank} from state_dict(), got {state!r:.200}")
            try:
                pos = (int(inner["minibatch"]), int(inner["microbatch"]))
            except (KeyError, TypeError, ValueError) as e:
                raise StateError(f"bad {_STATE_FORMAT} state {inner!r:.200}: {e}") from e
        return self.pipeline._commit_upto(self.rank, pos)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the micro-batch ``state`` was taken at; releases the payloads before it.

        Raises:
            StateError: The state is not a TrajectoryDataset state, or belongs to another rank or layout.
        """
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise StateError(f"not a {_STATE_FORMAT} state: {state!r:.200}")
        if state.get("version") != _STATE_VERSION:
            raise StateError(f"unsupported state version {state.get('version')!r}; expected {_STATE_VERSION}")
        if state.get("rank") != self.rank or state.get("num_consumers") != self.pipeline.num_consumers:
            raise StateError(
                f"state of rank {state.get('rank')} of {state.get('num_consumers')} consumers loaded into rank "
                f"{self.rank} of {self.pipeline.num_consumers}: save and load one state per rank"
            )
        try:
            step, micro = int(state["minibatch"]), int(state["microbatch"])
            end = state.get("end_minibatch")
            end = None if end is None else int(end)
            epoch, handed = int(state.get("epoch", 0)), int(state.get("handed_out", 0))
        except (KeyError, TypeError, ValueError) as e:
            raise StateError(f"bad {_STATE_FORMAT} state {state!r:.200}: {e}") from e
        if step < 0 or micro < 0:
            raise StateError(f"negative position ({step}, {micro}) in state")
        with self._lock:
            self._close_active()
            self._step, self._micro, self._end_step = step, micro, end
            self._epoch, self._handed_out = epoch, handed
        self.pipeline._seek(self.rank, step, micro)

    # ------------------------------------------------------------------ internals
    def _handed(self, pmb: PlannedMicroBatch, it: _ConsumerIterator) -> bool:
        """Commit ``pmb`` for ``it``; ``False`` (nothing committed) if ``it`` was closed meanwhile.

        Under the dataset lock, so that a concurrent ``close()``/``iter()``/``load_state_dict()`` either sees
        the position after ``pmb`` or makes ``it`` drop it: never both (a micro-batch handed out twice).
        """
        with self._lock:
            if it.done:
                return False
            if pmb.is_last:
                self._step, self._micro = pmb.minibatch + 1, 0
            else:
                self._step, self._micro = pmb.minibatch, pmb.microbatch + 1
            self._handed_out += 1
            self.pipeline._commit(self.rank, pmb)
        return True

    def _ended(self, it: _ConsumerIterator) -> None:
        with self._lock:
            if self._active is not None and self._active() is it:
                self._active = None
                self._end_step = None

    def __repr__(self) -> str:
        return (
            f"TrajectoryDataset(rank={self.rank}, fetch={self.fetch!r}, position=({self._step}, {self._micro}), "
            f"engine={self.pipeline.engine!r})"
        )


def _find_state(state: Any) -> dict[str, Any] | None:
    """The dataset state inside ``state`` (itself, or nested in a ``StatefulDataLoader`` state)."""
    if isinstance(state, dict):
        if state.get("format") == _STATE_FORMAT:
            return state
        for v in state.values():
            found = _find_state(v)
            if found is not None:
                return found
    return None


class _ConsumerIterator(Iterator["MicroBatch"]):
    """One pass over a consumer's micro-batches; commits each micro-batch as it is handed out.

    The producing generator (run on the prefetch thread in ``iter`` mode) holds neither this iterator nor the
    dataset, so an abandoned iterator is collected and its ``__del__`` stops the thread.
    """

    def __init__(self, ds: TrajectoryDataset, step: int, micro: int, end_step: int | None) -> None:
        self._ds = ds
        self._stop = threading.Event()
        self._done = False
        self._inner: Iterator[tuple[PlannedMicroBatch, Any]] | None = None
        ds.pipeline._claim(ds.rank, self)
        source = _produce(ds.pipeline, ds.rank, ds.fetch, ds.collate, ds.media_collator, ds.metrics, self._stop,
                          step, micro, end_step)
        if ds.fetch == "iter":
            from knitdata.prefetch import Prefetcher

            self._inner = Prefetcher(source, depth=ds.prefetch_depth, device=ds.device, pin_memory=ds.pin_memory)
        else:
            self._inner = source

    def __next__(self) -> MicroBatch:
        if self._done or self._inner is None:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            pmb, mb = next(self._inner)
        except StopIteration:
            self._finish()
            raise
        except BaseException:
            if self._done:  # closed by another thread while waiting (iter mode: the prefetcher stopped): pass ends
                raise StopIteration from None
            self.close()
            raise
        wait = time.perf_counter() - t0
        if not self._ds._handed(pmb, self):
            raise StopIteration  # closed by another thread while this item was prepared: not committed
        self._ds.metrics.record_wait(wait, is_last=pmb.is_last, empty=not pmb.trajectories)
        return mb

    @property
    def done(self) -> bool:
        """Whether the pass ended or was closed."""
        return self._done

    def _finish(self) -> None:
        self._ds._ended(self)
        self.close()
        if self._ds.pipeline.release == "step":  # a finished pass is at a mini-batch boundary: commit it
            self._ds.commit()

    def close(self) -> None:
        """Stop producing; items prepared but not handed out are dropped (they were not committed)."""
        if self._inner is None:
            return
        self._done = True
        self._stop.set()
        inner, self._inner = self._inner, None
        close = getattr(inner, "close", None)
        if close is not None:
            try:
                close()
            except ValueError:  # a generator running on another thread: it sees the stop flag instead
                pass
        self._ds.pipeline._unclaim(self._ds.rank, self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _produce(pipe: Pipeline, rank: int, fetch: str, collate: Callable[..., Any], media_collator: Callable[..., Any] | None,
             metrics: ConsumerMetrics, stop: threading.Event, step: int, micro: int,
             end_step: int | None) -> Iterator[tuple[PlannedMicroBatch, Any]]:
    """Fetch and collate the micro-batches of ``rank`` from position (step, micro), in plan order."""
    whole_share = fetch == "eager" or media_collator is not None
    while True:
        if end_step is not None and step >= end_step:
            return
        plan = pipe._wait_plan(step, stop)
        if plan is None:
            return
        if plan.minibatch != step:
            step, micro = plan.minibatch, 0
            if end_step is not None and step >= end_step:
                return
        row = plan.microbatches[rank]
        cache: dict[str, Trajectory] = {}
        media = None
        for i in range(micro, len(row)):
            pmb = row[i]
            t0 = time.perf_counter()
            nbytes = local = requests = ntraj = 0
            if whole_share:
                if i == micro:
                    metas = [m for p in row[micro:] for m in p.trajectories]
                    trajs, nbytes, local, requests = pipe._fetch(metas, rank, per_trajectory=False)
                    cache = {t.id: t for t in trajs}
                    ntraj = len(trajs)
                    if media_collator is not None:
                        media = media_collator(
                            [[] if j < micro else [cache[m.id] for m in p.trajectories] for j, p in enumerate(row)]
                        )
                trajs = [cache[m.id] for m in pmb.trajectories]
            else:
                trajs, nbytes, local, requests = pipe._fetch(pmb.trajectories, rank, per_trajectory=fetch == "sample")
                ntraj = len(trajs)
            mb = collate(trajs, pmb.to_info())
            if media is not None:
                mb.media = media
            metrics.record_fetch(time.perf_counter() - t0, nbytes=nbytes, local_bytes=local, requests=requests,
                                 trajectories=ntraj)
            yield pmb, mb
            if stop.is_set():
                return
        step, micro = plan.minibatch + 1, 0
