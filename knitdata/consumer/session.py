"""The consumer's side of the pipeline: its dialogue with the control plane, and the stages of a micro-batch.

:class:`ConsumerSession` is everything a :class:`~knitdata.consumer.dataset.TrajectoryDataset` asks the control plane for
one rank (where to start, lease, verify, seek, commit, the end-of-pass report); the hand-outs themselves go through
the iterator's :class:`~knitdata.consumer.handoff.ConsumerLease` and the process's
:class:`~knitdata.consumer.handoff.ControlSender`, off the trainer's thread.

A micro-batch goes through composed stages, the same on every engine up to the engine's ``read``:

* :class:`PlanStage`: the worker's next plan entry (``engine.control.leasing.next_entries``, a
  mini-batch's entries at a time);
* :class:`ReadStage`: its payloads (``engine.read``, decoded), grouped into reads by the
  :class:`~knitdata.consumer.fetch.FetchMode`: per micro-batch, or the worker's whole share of the mini-batch at once;
* collate: ``collate(trajectories, info) -> MicroBatch``;
* :class:`MediaStage`: the media table of the share (with a ``media_collator``);
* metrics: :meth:`~knitdata.observe.metrics.ConsumerMetrics.record_fetch`.

:class:`Production` runs them in order; the fetch mode decides where (``iter``: on a prefetch thread). Where a
rank stands (what was handed out, what ``state_dict`` reports, what the producing thread stamps) is one
:class:`RankPosition`; the dataset's options are declared once, :class:`DatasetOptions`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from knitdata.consumer.collate import MicroBatchInfo
from knitdata.consumer.fetch import FetchMode, fetch_mode
from knitdata.consumer.handoff import ConsumerLease
from knitdata.control.plane import LEASE_TTL_S
from knitdata.control.records import ItemRef, LeaseGrant, PlanEntry, StartPoint
from knitdata.engines.base import Engine
from knitdata.errors import ConfigError, DataTimeoutError, FencedError
from knitdata.observe import trace as tracing

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from knitdata.observe.metrics import ConsumerMetrics

__all__ = ["ConsumerSession", "PlanStage", "ReadStage", "MediaStage", "Production", "RankPosition", "DatasetOptions",
           "DEFAULT_TIMEOUT_S", "POLL_S"]

#: Seconds each wait for the next entries lasts before checking for a stop (and the dataset's timeout).
POLL_S = 1.0

_unit, _nbytes = itemgetter(1), itemgetter(2)  # of a plan entry's item (ItemRef: id, unit, nbytes)


class ConsumerSession:
    """The control-plane calls of consumer ``rank`` in this process (every engine; JSON-like values).

    Args:
        engine: The pipeline's engine.
        rank: The consumer.
        replica: The rank's tensor/pipeline-parallel replica (0 without replicas).
    """

    def __init__(self, engine: Engine, rank: int, replica: int = 0) -> None:
        self.engine = engine
        self.rank = rank
        self.replica = replica

    def register(self, num_replicas: int) -> None:
        """Tell the control plane that every rank has ``num_replicas`` replicas (``ConfigError`` when it disagrees)."""
        self.engine.control.positions.register_replicas(num_replicas)

    def start(self, worker: int, num_workers: int) -> tuple[int, tuple[int, str] | None]:
        """Where worker ``worker`` of ``num_workers`` starts without a loaded state: ``(next j, fingerprint)``
        (after the last micro-batch handed out to the rank's replica)."""
        ans = self.engine.control.positions.start_point(self.rank, self.replica)
        return _start(ans, worker, num_workers)

    def lease(self, worker: int, num_workers: int, cap: int | None,
              ) -> tuple[ConsumerLease, tuple[int, tuple[int, str] | None]]:
        """Take the (rank, worker) lease for a new iterator (fencing an older one); returns it and where the rank's
        new iterator starts (as :meth:`start`)."""
        import uuid

        engine = self.engine
        lease, ans = engine.sender.acquire(self.rank, worker, uuid.uuid4().hex, wait_s=LEASE_TTL_S + 5.0,
                                           replica=self.replica)
        lease.send_each = engine.release == "handout"
        lease.auto_step = engine.release == "step" and num_workers == 1
        lease.cap = cap
        return lease, _start(ans, worker, num_workers)

    def verify(self, length: int, fp: str, where: str) -> None:
        """Check that the rank's first ``length`` micro-batches have fingerprint ``fp`` (else ``StateError``)."""
        self.engine.control.positions.verify(self.rank, length, fp, where)

    def resumed_at(self, minibatch: int) -> None:
        """The rank loaded a state saved before or inside mini-batch ``minibatch`` (the staleness bound counts the
        mini-batches before it as finished until the trainer's first version report)."""
        self.engine.control.positions.resumed_at(self.rank, minibatch)

    def seek(self, j: int) -> None:
        """The rank (its replica) continues at micro-batch ``j`` (a state was loaded)."""
        self.engine.control.positions.seek(self.rank, j, self.replica)

    def commit(self, upto: int, *, wait: bool, relayed: bool = False) -> int | None:
        """Release the rank's payloads before ``upto``: queued for the sender, or sent now (``wait``: the count).

        ``relayed``: a live iterator of the rank relays the sender's wake (see
        :meth:`~knitdata.consumer.handoff.ControlSender.request`), so the caller's thread makes no system call.
        """
        sender = self.engine.sender
        if not wait:
            sender.commit(self.rank, upto, self.replica, relayed=relayed)
            return None
        sender.flush()
        return int(self.engine.control.positions.commit(self.rank, upto, self.replica))

    def flush(self) -> None:
        """Send this process's queued hand-out records and commits now, and wait for it."""
        self.engine.sender.flush()

    def end(self, lease: ConsumerLease, metrics: ConsumerMetrics) -> None:
        """An iterator ended: its last records, then the lease goes; the rank's metrics are reported (best effort) to
        a control plane in another process. A plane in this process is read with this process's live metrics
        (:meth:`~knitdata.engines.base.Engine.stats`), so no summary is made at each pass end (it sorts every
        series of the metrics' window)."""
        lease.end()
        if self.engine.in_process:
            return
        try:
            self.engine.report_consumer(self.rank, metrics.to_dict())
        except Exception:  # noqa: BLE001 - best effort: the control plane is gone (shutdown)
            pass


def _start(ans: StartPoint | LeaseGrant, worker: int, num_workers: int) -> tuple[int, tuple[int, str] | None]:
    base = int(ans.next)
    fp = None if ans.fp is None else (base, str(ans.fp))
    return base + ((worker - base) % num_workers), fp


class PlanStage:
    """The plan entries of micro-batches ``j, j + nw, ...`` of a rank, in plan order (a mini-batch's at a time).

    Attributes:
        end: The first mini-batch this pass does not reach (``None``: until drained), set at the first entry.
    """

    def __init__(self, engine: Engine, rank: int, lease: ConsumerLease, stop: threading.Event, j: int, nw: int,
                 timeout: float | None, max_minibatches: int | None, end: int | None) -> None:
        self.engine = engine
        self.rank = rank
        self.lease = lease
        self.stop = stop
        self.j = j
        self.nw = nw
        self.timeout = timeout
        self.max_minibatches = max_minibatches
        self.end = end
        self.cache: dict[int, PlanEntry] = {}  # entries of the current mini-batch from j on, by j
        self.last_step: int | None = None  # the mini-batch of the last entry returned

    def next(self) -> PlanEntry | None:
        """The next entry of this worker, or ``None`` at the end of the pass (or when stopped).

        At the first micro-batch of a mini-batch it waits (up to the dataset's timeout, in :data:`POLL_S` slices) for
        the entries from there to the end of the mini-batch.
        """
        self.lease.relay()  # hand-outs that free storage, or a commit, ask for a report: it goes now (off the trainer)
        j, cache = self.j, self.cache
        if j not in cache:
            if self.end is not None and self.last_step is not None and self.last_step + 1 >= self.end:
                return None  # the next micro-batch of this worker is past the last mini-batch of this pass
            cache.clear()
            t0 = time.monotonic()
            while j not in cache:  # one loop, no helper: the path of a micro-batch stays short
                if self.stop.is_set():
                    return None
                wait = POLL_S
                if self.timeout is not None:
                    left = self.timeout - (time.monotonic() - t0)
                    if left <= 0:
                        raise DataTimeoutError(
                            f"rank {self.rank} waited {self.timeout:.0f} s for its micro-batch {j} (dataset timeout); "
                            f"admission is still waiting for: {self.engine.control.reporting.missing()}. Check that producers "
                            "are alive and put every member of each group (withdraw() a group whose member was "
                            "refused), or raise the dataset's timeout")
                    wait = min(wait, left)
                try:
                    lease = self.lease
                    ans = self.engine.control.leasing.next_entries(self.rank, j, wait, lease.token, lease.worker,
                                                                   lease.replica)
                except FencedError as err:
                    self.lease.fence("a newer iterator", str(err))  # nothing prefetched is handed out any more
                    raise
                for entry in ans.entries:
                    cache[entry.j] = entry
                if ans.end:
                    return None
        e = cache.pop(j)
        step = e.minibatch
        if self.end is None and self.max_minibatches is not None:
            self.end = step + self.max_minibatches
        if self.end is not None and step >= self.end:
            return None
        self.j = j + self.nw
        self.last_step = step
        return e


class ReadStage:
    """The payloads of each entry, read through the engine as the fetch mode groups them.

    With ``whole_share`` (``eager``, ``iter`` on the embedded engine, or a media collator) the worker's share of a
    mini-batch (the entry and the rest of its mini-batch in the plan stage's cache) is read at its first micro-batch
    and served from here.

    Attributes:
        rows: The entries of the share read by the last :meth:`read` (``None``: it read no new share).
        row_batches: The trajectories of each of :attr:`rows`, in order (``None`` with it).
        nbytes, local, requests, trajectories: What the last :meth:`read` fetched.
    """

    def __init__(self, engine: Engine, rank: int, fetch: FetchMode, plan: PlanStage, whole_share: bool) -> None:
        self.engine = engine
        self.fetch = fetch
        self.plan = plan
        self.whole_share = whole_share
        self.share_fetch = fetch if fetch.whole_share else fetch_mode("eager")  # how a share is read
        self.local_units = engine.local_units(rank)
        self.share: dict[int, list[Any]] = {}  # the trajectories of each entry (j) of the share read last
        self.rows: list[PlanEntry] | None = None
        self.row_batches: list[list[Any]] | None = None
        self.nbytes = self.local = self.requests = self.trajectories = 0

    def read(self, e: PlanEntry) -> list[Any]:
        """The trajectories of entry ``e``, in order."""
        items = e.items
        self.rows = self.row_batches = None
        if not self.whole_share:
            batch = self.engine.read(items, fetch=self.fetch, step=e.minibatch) if items else []
            self.trajectories = len(batch)
            self._count(items, self.fetch)
            return batch
        j = e.j
        if not items:  # padding: reads nothing
            self.nbytes = self.local = self.requests = self.trajectories = 0
            return []
        read = self.share.pop(j, None)
        if read is not None:  # a later micro-batch of the share read at its first
            self.nbytes = self.local = self.requests = self.trajectories = 0
            return read
        rows = [e]
        nw = self.plan.nw
        cache = self.plan.cache
        for k in sorted(cache):
            if (k - j) % nw == 0:
                rows.append(cache[k])
        every: list[ItemRef] = []
        for x in rows:
            every += x.items
        trajs = self.engine.read(every, fetch=self.share_fetch, step=e.minibatch)
        # each entry's trajectories, sliced from the one read in entry order
        batches, k = [], 0
        for x in rows:
            n = k + len(x.items)
            batches.append(trajs[k:n])
            k = n
        self.share = dict(zip([x.j for x in rows[1:]], batches[1:]))
        self.trajectories = len(trajs)
        self.rows, self.row_batches = rows, batches
        self._count(every, self.share_fetch)
        return batches[0]

    def _count(self, items: Sequence[ItemRef], fetch: FetchMode) -> None:
        nbytes = int(sum(map(_nbytes, items)))
        units = set(map(_unit, items))
        local_units = self.local_units
        if units <= local_units:  # the common case: every unit read is on this node
            local = nbytes
        elif units.isdisjoint(local_units):
            local = 0
        else:
            local = int(sum([it.nbytes for it in items if it.unit in local_units]))
        self.nbytes, self.local = nbytes, local
        self.requests = fetch.requests(items)


class MediaStage:
    """The media table of the worker's share of each mini-batch (a ``media_collator``'s), on every micro-batch.

    Args:
        collator: ``media_collator(list_of_micro_batches) -> MultimodalBatch``.
        depth: The prefetch depth asked for.

    Attributes:
        grow: A weak reference to the prefetcher's ``set_depth`` (``None``: no prefetcher): the prefetch thread is
            let work a whole share ahead (the next share is prepared while the current mini-batch computes).
    """

    def __init__(self, collator: Callable[..., Any], depth: int) -> None:
        self.collator = collator
        self.depth = depth
        self.grow: weakref.WeakMethod[Any] | None = None
        self.media: Any = None

    def attach(self, mb: Any, e: PlanEntry, row_batches: list[list[Any]] | None, info: MicroBatchInfo) -> None:
        """Give ``mb`` the share's media table (built when a new share was read: the trajectories of each of its
        entries, ``row_batches``, from entry ``e`` on)."""
        if row_batches is not None:
            groups: list[list[Any]] = [[] for _ in range(e.microbatch)]
            groups += row_batches
            self.media = self.collator(groups)
            set_depth = self.grow() if self.grow is not None else None
            if set_depth is not None and int(info.num_microbatches) + 1 > self.depth:
                self.depth = int(info.num_microbatches) + 1  # the next share, not the one after
                set_depth(self.depth)
        if self.media is not None:
            mb.media = self.media
        if info.is_last:
            self.media = None


class Production:
    """The micro-batches of a plan, made on the calling thread: read, collate, media, metrics (the
    :class:`~knitdata.consumer.fetch.Source` of ``sample`` and ``eager``; ``iter`` runs it on a prefetch thread).

    Each item is ``(entry, micro-batch, is_last, empty, position)``: ``is_last`` (the micro-batch ends its
    mini-batch), ``empty`` (it holds no trajectory) and ``position`` (``stamp(entry, n)`` for the n-th entry of this
    plan, ``(entry, n)`` without ``stamp``: the consumer's position once it handed this one out) are made here, so
    that the trainer's thread does not look into the entry for its metrics or build its position.

    Attributes:
        last_wait_s: Seconds the last ``next()`` took (the caller waited for all of it).
    """

    queue = None  # nothing is prepared ahead (Source)
    on_wait: Callable[[], None] | None = None

    def __init__(self, plan: PlanStage, reader: ReadStage, collate: Callable[..., Any], media: MediaStage | None,
                 metrics: ConsumerMetrics, stop: threading.Event,
                 stamp: Callable[[PlanEntry, int], tuple[Any, ...]] | None = None) -> None:
        self.plan, self.reader, self.collate, self.media = plan, reader, collate, media
        self.metrics, self.stop, self.stamp = metrics, stop, stamp
        self.n = 0
        self.last_wait_s = 0.0

    def __iter__(self) -> Production:
        return self

    def __next__(self) -> tuple[PlanEntry, Any, bool, bool, tuple[Any, ...]]:
        plan, reader = self.plan, self.reader
        ts = time.perf_counter()
        if self.stop.is_set() or (e := plan.next()) is None:
            raise StopIteration
        t0 = time.perf_counter()
        batch = reader.read(e)
        info = e.info
        mb = self.collate(batch, info)
        if self.media is not None:
            self.media.attach(mb, e, reader.row_batches, info)
        t1 = time.perf_counter()
        self.metrics.record_fetch(t1 - t0, nbytes=reader.nbytes, local_bytes=reader.local,
                                  requests=reader.requests, trajectories=reader.trajectories)
        tr = tracing.tracer
        if tr is not None:  # perf_counter() is the trace clock (in seconds)
            tr.span("fetch", "consumer", t0 * 1e6, t1 * 1e6,
                    {"rank": plan.rank, "step": e.minibatch, "microbatch": e.microbatch, "bytes": reader.nbytes,
                     "local_bytes": reader.local, "requests": reader.requests})
        self.n = n = self.n + 1
        self.last_wait_s = t1 - ts
        return e, mb, info.is_last, not e.items, (e, n) if self.stamp is None else self.stamp(e, n)

    def close(self) -> None:
        """Nothing more is made."""
        self.stop.set()

    def set_depth(self, depth: int) -> None:
        """Nothing is made ahead: ignored."""


#: Default seconds a consumer waits for its next micro-batch before :class:`~knitdata.errors.DataTimeoutError`
#: (:attr:`DatasetOptions.timeout`; also ``knitdata.pipeline.DEFAULT_TIMEOUT_S``).
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class DatasetOptions:
    """How one rank's dataset fetches, collates and waits: the keywords of
    :class:`~knitdata.consumer.dataset.TrajectoryDataset` and :meth:`Pipeline.dataset <knitdata.pipeline.Pipeline.dataset>`,
    declared once. Both keep a real signature (defaults visible in the reference); ``tests/test_dataset.py`` checks
    that their names, annotations, defaults and ``Args`` entries are these fields', so they cannot drift apart.

    Attributes:
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

    Example:
        >>> DatasetOptions(fetch="eager", prefetch_depth=4).validate(0).name
        'eager'
    """

    fetch: str | FetchMode = "iter"
    collate: Callable[..., Any] | None = None
    media_collator: Callable[..., Any] | None = None
    prefetch_depth: int = 2
    device: str | torch.device | None = None
    pin_memory: bool | None = None
    max_minibatches: int | None = None
    timeout: float | None = DEFAULT_TIMEOUT_S
    replica: int | None = None
    num_replicas: int | None = None

    def validate(self, rank: int) -> FetchMode:
        """Check the options of rank ``rank``'s dataset; returns the fetch mode.

        Raises:
            ConfigError: An unknown fetch mode, or a bad depth, limit, timeout or replica (named).
        """
        replica, num_replicas = self.replica, self.num_replicas
        if (replica is None) != (num_replicas is None) or (num_replicas is not None and (
                isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1
                or isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < num_replicas)):
            raise ConfigError(f"rank {rank}: replica and num_replicas go together, with 0 <= replica < num_replicas "
                              f"(ints), got replica={replica!r}, num_replicas={num_replicas!r}")
        mode = fetch_mode(self.fetch)
        mm = self.max_minibatches
        if mm is not None and (isinstance(mm, bool) or not isinstance(mm, int) or mm < 1):
            raise ConfigError(f"max_minibatches must be a positive int or None, got {mm!r}")
        depth = self.prefetch_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"prefetch_depth must be an int >= 1, got {depth!r}")
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ConfigError(f"timeout must be a positive number of seconds or None, got {t!r}")
        return mode


class RankPosition:
    """Where one rank's dataset (its DataLoader worker's) stands: the one owner of what was handed out, of what
    ``state_dict`` reports and of what the producing thread stamps on each micro-batch. The dataset and its
    iterators share one; the producing thread only calls :meth:`stamp`.

    Fields other than :attr:`handed` change under :attr:`lock`. :attr:`handed` is written once per micro-batch by
    the iterator's ``next()`` on the trainer's thread (one attribute, no lock) and folded into the fields by
    :meth:`sync`.

    Attributes:
        lock: Guards the fields (reentrant: an iterator closed under it brings the position up to date).
        next: The next ``j`` of this worker's pass; ``None``: the rank's position at the control plane.
        worker: ``(worker, num_workers)`` of the pass.
        at: ``(minibatch, microbatch)`` after the last micro-batch handed out, or ``None``.
        fingerprint: ``(length, fingerprint)`` of the rank's prefix the position covers, or ``None``.
        end: The first mini-batch the pass does not reach (``None``: until drained or not known yet).
        epoch: The epoch last set.
        handed_out: Micro-batches handed out, as of the last :meth:`sync` (or state loaded).
        cap: ``release="step"`` never releases past the last state taken or loaded (``None``: no cap).
        layout: What states carry about the layout (the control plane's ``layout_history`` of the rank), or ``None``.
        fixed: ``(engine layout, (worker, num_workers), keys)``: the keys of a state that change only with the layout
            or the worker, or ``None`` (not known yet). :meth:`stamp` reads it on the producing thread.
        handed: ``(last entry handed out, how many since the pass began, its stamped state)``.
        synced: How many of the pass's hand-outs :meth:`sync` folded in.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.next: int | None = None
        self.worker = (0, 1)
        self.at: tuple[int, int] | None = None
        self.fingerprint: tuple[int, str] | None = None
        self.end: int | None = None
        self.epoch = 0
        self.handed_out = 0
        self.cap: int | None = None
        self.layout: dict[str, Any] | None = None
        self.fixed: tuple[Any, tuple[int, int], dict[str, Any]] | None = None
        self.handed: tuple[Any, ...] = (None, 0, None)
        self.synced = 0

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.lock = threading.RLock()

    def begin(self, start: tuple[int, tuple[int, str] | None]) -> int:
        """A pass begins (under :attr:`lock`): without a position, at ``start`` (``(next j, fingerprint)``, after the
        last micro-batch handed out to the rank); returns the pass's first ``j``."""
        if self.next is None:
            self.next, self.fingerprint = start
        self.handed, self.synced = (None, 0, None), 0
        return self.next

    def stamp(self, e: PlanEntry, n: int) -> tuple[Any, ...]:
        """The position once entry ``e`` (the pass's ``n``-th) is handed out, made on the producing thread:
        ``(e, n, (fixed, state))``, ``state`` as ``state_dict`` returns it but for end, epoch and count (set when
        taken); ``(e, n, None)`` while :attr:`fixed` is not known or ``e`` has no fingerprint."""
        fixed, fp = self.fixed, e.fp
        if fixed is None or fp is None:
            return e, n, None
        j, mb = e.j, e.minibatch
        state = fixed[2].copy()
        state["next"] = j + fixed[1][1]
        state["minibatch"], state["microbatch"] = (mb + 1, 0) if e.info.is_last else (mb, e.microbatch + 1)
        state["end_minibatch"] = state["epoch"] = state["handed_out"] = None
        state["fingerprint"], state["fingerprint_length"] = fp, j + 1
        return e, n, (fixed, state)

    def stamped(self, layout: Any, end: int | None) -> dict[str, Any] | None:
        """The state stamped on the last micro-batch handed out, completed (no lock; once per step), or ``None``
        when there is none for ``layout`` (the engine's) and this worker: then :meth:`sync` and build it."""
        fixed = self.fixed
        if fixed is None or fixed[0] is not layout or fixed[1] != self.worker:
            return None
        _last, taken, pre = self.handed
        if pre is None or pre[0] is not fixed:
            return None
        state: dict[str, Any] = pre[1].copy()
        state["end_minibatch"] = self.end if self.end is not None else end
        state["epoch"] = self.epoch
        state["handed_out"] = self.handed_out + taken - self.synced
        self.cap = state["next"]
        return state

    def sync(self, end: int | None) -> None:
        """Fold the hand-outs of the pass since the last call into the fields (``end``: the pass's, if known)."""
        with self.lock:
            last, taken, _pre = self.handed
            if last is None or taken == self.synced:
                return
            self.handed_out += taken - self.synced
            self.synced = taken
            j = last.j
            self.next = j + self.worker[1]
            self.at = (last.minibatch + 1, 0) if last.info.is_last else (last.minibatch, last.microbatch + 1)
            if last.fp is not None:
                self.fingerprint = (j + 1, last.fp)
            if self.end is None and end is not None:
                self.end = end

    def load(self, nxt: int, worker: tuple[int, int], at: tuple[int, int] | None, fingerprint: tuple[int, str] | None,
             end: int | None, epoch: int, handed_out: int) -> None:
        """Continue at a loaded state's position (under :attr:`lock`; the state caps releases)."""
        self.next, self.worker, self.at, self.fingerprint, self.end = nxt, worker, at, fingerprint, end
        self.epoch, self.handed_out, self.cap = epoch, handed_out, nxt

    def reset(self, epoch: int) -> None:
        """Forget the position (under :attr:`lock`): the rank starts at its first micro-batch of a new layout."""
        self.next, self.fingerprint, self.at, self.end, self.layout, self.fixed = None, None, None, None, None, None
        self.epoch, self.handed_out, self.cap = epoch, 0, None

    def ended(self, current: bool, release_step: bool) -> int | None:
        """A pass ended (under :attr:`lock`; ``current``: the dataset's active one): where a ``release="step"`` commit
        goes (a mini-batch boundary, not past :attr:`cap`), or ``None``."""
        if current:
            self.end = None
        if not release_step or self.worker[1] != 1 or self.next is None:
            return None
        return self.next if self.cap is None else min(self.next, self.cap)
