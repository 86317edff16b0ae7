"""Background prefetch with exact state, pinned staging and side-stream host-to-device copies.

(The tensor side, pinning, staging buffers and device copies, is in :mod:`knitdata.consumer.staging`.)

:class:`Prefetcher` pulls items from an iterator on one background thread into a bounded queue (``depth``)
while the consumer computes. Right after each item is produced it snapshots the source's state
(``state_fn()``) and keeps the snapshot with the item; :meth:`Prefetcher.state_dict` returns the snapshot of
the item last handed out, so items prefetched but not consumed never move the resume point (the
``torchdata.nodes`` Prefetcher/PinMemory pattern).

Hand-off: a thread hand-off is not free under the GIL. A consumer woken for an item has to wait for the GIL
while the producer runs on into the next item, dropping and retaking the GIL in every torch call, each time
waking the consumer for nothing; with no compute to overlap this cost about 0.35 ms per 0.5 ms item
(``python -m benchmarks loader``). So: (1) when the consumer waits for an item, the producer, once it queued it,
sleeps until the consumer took it (one clean switch); (2) when the queue is empty and the thread is not
inside the source, the consumer pulls the next item itself (work stealing); (3) when the consumer spends
less than ``inline_below_s`` between ``__next__`` calls (25th percentile of the last 8 items; nothing to
overlap), the thread stays parked and only refills the queue once the consumer has been away for 5 ms.
(4) A pop that leaves items queued wakes no thread: a wake-up costs the consumer about 15 µs right after its
compute, and the woken thread then competes with the consumer's next calls. The thread, parked on a full queue,
checks for room on its own every quarter of the consumer's time per item (0.5 ms at least, less often while the
consumer is away longer than usual), so it refills during the consumer's compute; a pop that empties the
queue wakes it at once. The source is only ever run by one thread at a time, items come out in order, exactly
once.

Paths:

* CPU (no CUDA, or ``device`` None/``"cpu"``): plain background prefetch, nothing is pinned.
* CUDA: on the background thread the item is pinned (``pin_memory()``), copied to ``device`` with
  ``non_blocking=True`` on a dedicated side :class:`torch.cuda.Stream`, and an event is recorded after the
  copy. The background thread waits for that event (only it blocks, the GIL is released), so the pinned
  staging memory in flight is bounded by one item. In ``__next__`` the consumer's current stream waits on
  the event (``wait_event``: no host block) and every device tensor is ``record_stream``-ed on the current
  stream, so the caching allocator does not hand its memory to the side stream while the consumer still
  uses it. With a :class:`PinnedBufferPool` the item's CPU tensors are packed into one reused pinned
  staging buffer (by power-of-two size class) and copied with a single H2D copy into one device block of
  which the item's tensors are views.

Memory: at most ``depth + 1`` items are produced and not yet handed out (``depth`` queued, one being put);
on the CUDA path those are on the device, plus one pinned staging copy.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

from knitdata.consumer.staging import (
    CudaTransfer,
    PinnedBufferPool,
    collect_tensors,
    host_memory_stats,
    map_tensors,
    move_tensors,
    pin_tensors,
)
from knitdata.errors import ConfigError, StateError
from knitdata.observe.metrics import PrefetchStats
from knitdata.threads import Job, spawn

# PinnedBufferPool, map_tensors and host_memory_stats live in knitdata.consumer.staging, PrefetchStats in knitdata.observe.metrics;
# also here as before those splits
__all__ = ["Prefetcher", "PrefetchQueue", "PrefetchStats", "PinnedBufferPool", "map_tensors", "host_memory_stats"]

T = TypeVar("T")

_POLL_S = 0.05  # how often a blocked producer checks for close()
#: A thread parked on a full queue checks for room each this share of the consumer's period. 0.02 was measured
#: against it (interleaved pairs of ``bench transfer``, Ray ``iter``, accel compute, 2 cores): the image workload's
#: trainer-thread work per step fell by about 0.02 ms, but the omni workload at the seed's size (CPU-bound consumers)
#: stepped 0.71 -> 0.88 s and 0.49 -> 0.73 s with shared encoding; kept at 0.25.
_ROOM_CHECK_FRACTION = 0.25
_ROOM_CHECK_MIN_S = 0.0005  # ... but not more often than this
_ROOM_CHECK_START_S = 0.005  # ... and this often before the consumer's period is known
_IDLE_S = 0.005  # in inline mode the thread refills the queue once the consumer has been away this long
_INLINE_WINDOW = 8  # consumer times (between __next__ calls) whose median picks inline or threaded mode
_FOLD_AT = 256  # waits of items pulled inline kept before they are folded into the stats
_BUSY = object()  # Prefetcher._pull: not pulled


# ---------------------------------------------------------------------------------------------- thread
class PrefetchQueue:
    """The hand-off between a :class:`Prefetcher`'s thread and its consumer (``Prefetcher.queue``); deliberately
    not the Prefetcher, so that an abandoned one can be collected while its thread runs.

    A consumer on a hot path may take a prepared item itself with :meth:`pop` instead of calling
    ``next(prefetcher)`` (one Python frame instead of several, which right after a trainer's compute is most of the
    cost of a pop): ``knitdata``'s dataset iterator (:mod:`knitdata.consumer.dataset`) does, and the prefetcher's own
    ``__next__`` starts with it. Everything else is the prefetcher's: fields below ``items`` are guarded by
    ``cond`` (its lock is reentrant: a finalizer run by the garbage collector on a thread that holds it must not
    deadlock), except the ones :meth:`pop` writes (only the consumer pops; the thread only appends).

    Attributes:
        items: Items produced and not yet handed out, in order: ``(kind, index, payload, state, event)``.
        fast: A consumer may pop plain items itself (threaded mode, not closed).
        inline_below_s: The prefetcher's ``inline_below_s`` (a consumer back sooner goes through ``next()``).
        left_at: ``time.perf_counter()`` when the consumer last took an item.
        period: The consumer's time per item at its last pop (0: not known yet).
        popped: Items the consumer popped itself (counted as handed out with a zero wait).
        parked: What the thread waits for: ``"turn"``, ``"room"`` or ``"handoff"`` (``None``: it runs).
    """

    def __init__(self, source: Iterator[Any], state_fn: Callable[[], dict] | None, depth: int,
                 transfer: Callable[[Any], tuple[Any, Any]] | None, pin: bool, stats: PrefetchStats,
                 inline: bool = False, inline_below_s: float = 0.0):
        self.source = source
        self.state_fn = state_fn
        self.depth = depth
        self.transfer = transfer
        self.pin = pin
        self.stats = stats
        self.lock = threading.RLock()  # ``cond``'s lock (a ``with`` on it makes no Python call)
        self.cond = threading.Condition(self.lock)
        self.room = threading.Lock()  # a binary semaphore: released by the consumer after a pop (room to produce)
        self.room.acquire()
        self.items: collections.deque = collections.deque()
        self.index = 0  # index of the next entry to produce
        self.stop = False  # close(): the thread exits, nothing more is produced
        self.finished = False  # the end or an error was produced: the source is not touched again
        self.producing = False  # someone (the thread, or the consumer inline) holds the source
        # the consumer runs the source itself; the thread refills only while it is away. Starts inline: a
        # consumer that asks at once gets its first item without a thread hand-off.
        self.inline = inline
        self.fast = not inline
        self.inline_below_s = inline_below_s
        self.in_next = False  # the consumer is inside __next__
        self.left_at = time.perf_counter()
        self.period = 0.0
        self.popped = 0
        self.waiting = False  # the consumer is blocked in __next__ until an entry is queued
        self.parked: str | None = None
        self.job: Job | None = None  # the thread's (see knitdata.threads): done once it no longer touches the source

    def pop(self) -> tuple | None:
        """The fast pop, on the consumer's thread, lock-free: the oldest prepared item
        ``("plain", index, payload, None, None)`` when :attr:`fast` is true, that item needs nothing but returning
        ``payload`` (any other kind goes through ``next(prefetcher)``), and the consumer came back at least
        :attr:`inline_below_s` after :attr:`left_at`; else ``None`` (nothing taken).

        It sets ``period`` and ``left_at`` (now), counts the item in :attr:`popped`, and wakes the thread if it is
        parked on a full queue that this pop emptied (else it refills at its next check, :func:`_room_check_s`: no
        wake-up right after the consumer's compute), or waiting for the consumer to take the item it queued.
        """
        items = self.items
        if not (self.fast and items and items[0][0] == "plain"):
            return None
        now = time.perf_counter()
        if now - self.left_at < self.inline_below_s:
            return None
        entry = items.popleft()  # only the consumer pops: the item peeked at is the one popped
        self.period = now - self.left_at
        self.left_at = now
        self.popped += 1
        parked = self.parked
        if parked == "room":
            if not items:
                try:  # (_signal, inlined: one frame on the trainer's thread)
                    self.room.release()
                except RuntimeError:  # already signalled
                    pass
        elif parked == "handoff":
            with self.cond:
                self.cond.notify_all()
        return entry  # type: ignore[no-any-return]


def _snapshot(state_fn: Callable[[], dict]) -> Any:
    state = state_fn()
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        raise StateError(f"state_fn() must return a JSON-serializable dict, got {state!r}: {e}") from e


def _make(sh: PrefetchQueue, index: int) -> tuple[tuple, bool]:
    """Pull one item from the source and prepare it; returns ``(entry, last)`` (``last``: end or error).

    The caller holds the source (``sh.producing``), so only one thread runs this at a time.
    """
    st = sh.stats
    t0 = time.perf_counter()
    try:
        item = next(sh.source)
    except StopIteration:
        return ("end", index, None, None, None), True
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer, in order
        return ("error", index, e, None, None), True
    st.produce_s += time.perf_counter() - t0
    st.produced += 1
    try:
        snap = _snapshot(sh.state_fn) if sh.state_fn is not None else None
        event = None
        if sh.transfer is not None:
            item, event = sh.transfer(item)
        elif sh.pin:
            t1 = time.perf_counter()
            item = pin_tensors(item)
            st.pin_s += time.perf_counter() - t1
    except BaseException as e:  # noqa: BLE001
        return ("error", index, e, None, None), True
    # "plain": nothing for the consumer to do but return it (no state, no device copy): its fast path checks one field
    return ("plain" if snap is None and event is None else "item", index, item, snap, event), False


def _may_produce(sh: PrefetchQueue, now: float) -> bool:
    """Whether the thread may take the source now (called with ``sh.cond`` held)."""
    if sh.producing or sh.finished:
        return False
    if not sh.inline:
        return True
    # inline: the consumer produces for itself; the thread refills the queue only while the consumer is away
    return not sh.in_next and now - sh.left_at >= _IDLE_S


def _room_check_s(sh: PrefetchQueue) -> float:
    """How long a thread parked on a full queue sleeps before it checks for room again (a pop that leaves items
    queued does not wake it): :data:`_ROOM_CHECK_FRACTION` of the consumer's time per item, longer while the
    consumer is away for more than twice that (an optimizer step, an evaluation), at most :data:`_POLL_S`."""
    period = sh.period
    if period <= 0.0:
        return _ROOM_CHECK_START_S
    wait = max(_ROOM_CHECK_MIN_S, period * _ROOM_CHECK_FRACTION)
    away = time.perf_counter() - sh.left_at
    if away > 2.0 * period:
        wait = max(wait, away * _ROOM_CHECK_FRACTION)
    return min(wait, _POLL_S)


def _produce(sh: PrefetchQueue) -> None:
    # a pooled thread (knitdata.threads) keeps thread-local torch state between jobs: start from a new thread's
    torch.set_grad_enabled(True)
    cond = sh.cond
    while True:
        with cond:
            while not sh.stop:
                now = time.perf_counter()
                if _may_produce(sh, now):
                    break
                timeout = _POLL_S
                if sh.inline and not sh.in_next and not sh.producing:
                    timeout = min(_POLL_S, max(_IDLE_S - (now - sh.left_at), 1e-4))
                sh.parked = "turn"
                cond.wait(timeout)
                sh.parked = None
            if sh.stop:
                return
            sh.producing = True
            index = sh.index
        entry, last = _make(sh, index)
        cond.acquire()
        try:
            if not sh.stop and len(sh.items) >= sh.depth:
                # wait for room: check again every _room_check_s(), or when the consumer releases the lock (a
                # C-level signal: the consumer's pop takes no lock) after a pop that emptied the queue.
                # ``parked`` is set before the check below: a pop either comes first (and the check sees the
                # room) or sees ``parked`` and signals when it empties the queue.
                sh.parked = "room"
                while not sh.stop and len(sh.items) >= sh.depth:
                    cond.release()
                    try:
                        sh.room.acquire(timeout=_room_check_s(sh))
                    finally:
                        cond.acquire()
                sh.parked = None
            sh.producing = False
            if sh.stop:
                return
            sh.items.append(entry)
            sh.index += 1
            sh.finished = last
            if sh.waiting:
                cond.notify_all()
                # Hand over: sleep (without the GIL) until the consumer has taken the entry. Running on instead
                # makes the woken consumer wait for the GIL while this thread drops and retakes it in every
                # torch call of the next item, paying a thread wake-up each time.
                sh.parked = "handoff"
                while sh.items and not sh.stop:  # taken: the queue holds nothing after it
                    cond.wait(_POLL_S)
                sh.parked = None
        finally:
            cond.release()
        del entry
        if last:
            return


def _shutdown(sh: PrefetchQueue) -> None:
    with sh.cond:
        sh.stop = True
        sh.fast = False
        sh.items.clear()
        sh.cond.notify_all()
    _signal(sh.room)


def _signal(lock: threading.Lock) -> None:
    """Release a lock used as a binary semaphore (already released: the signal is pending)."""
    try:
        lock.release()
    except RuntimeError:
        pass


# ---------------------------------------------------------------------------------------------- prefetcher
class Prefetcher(Iterator[T], Generic[T]):
    """Prefetch items of ``source`` on a background thread, with exact resume state.

    Args:
        source: The iterator to pull from: by the background thread, or by the consumer's thread inside
            ``__next__`` when there is nothing to overlap (see ``inline_below_s``); never by two at once.
        state_fn: Returns the source's JSON-serializable state; called right after each item is produced,
            on the thread that produced it (and once here, before the thread starts).
        depth: Items queued ahead of the consumer (the source runs at most ``depth + 1`` items ahead).
        pin_memory: Pin items on the background thread. ``None``: when CUDA is available and ``device`` is
            not the CPU. ``True`` without CUDA warns and does not pin (pinning needs CUDA).
        device: Copy items to this device on the background thread (CUDA: side stream, see the module
            doc). ``None`` or ``"cpu"``: items stay where the source put them.
        pool: Optional :class:`PinnedBufferPool` for staging (CUDA device only).
        inline_below_s: Consumer time per item (the 25th percentile over the last 8 items, measured between
            ``__next__`` calls) below which there is nothing to overlap: the consumer then pulls from the source itself
            when the queue is empty, and the thread only refills the queue while the consumer is away (more
            than 5 ms). Above it every item is produced ahead on the thread. ``0`` disables inline pulls.
            Without a device copy only (the CUDA path always copies on the thread). Items pulled inline are
            produced under the consumer thread's thread-local torch state (grad mode, inference mode,
            autocast), as in a synchronous loop.

    Raises:
        ConfigError: ``depth < 1``, a negative ``inline_below_s``, a CUDA device without CUDA, or a pool
            without a CUDA device.
        StateError: ``state_fn()`` does not return JSON-serializable data.

    Example:
        >>> pf = Prefetcher(iter(range(3)), depth=2)
        >>> list(pf)
        [0, 1, 2]

    Resume: build the source again, load ``prefetcher.state_dict()`` into it, wrap it in a new Prefetcher.
    """

    def __init__(
        self,
        source: Iterable[T] | Iterator[T],
        *,
        state_fn: Callable[[], dict] | None = None,
        depth: int = 2,
        pin_memory: bool | None = None,
        device: str | torch.device | None = None,
        pool: PinnedBufferPool | None = None,
        inline_below_s: float = 2e-4,
    ):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"depth must be an int >= 1, got {depth!r}")
        if not isinstance(inline_below_s, (int, float)) or not inline_below_s >= 0:
            raise ConfigError(f"inline_below_s must be a number >= 0, got {inline_below_s!r}")
        dev = None if device is None else torch.device(device)
        cuda = dev is not None and dev.type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} needs CUDA, which is not available; use device=None or 'cpu'")
        if pool is not None and not cuda:
            raise ConfigError("a PinnedBufferPool stages copies to a CUDA device; pass device='cuda' or no pool")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available() and (dev is None or dev.type == "cuda")
        elif pin_memory and not torch.cuda.is_available():
            warnings.warn("Prefetcher(pin_memory=True) without CUDA: nothing is pinned", stacklevel=2)
            pin_memory = False
        self.depth = depth
        self.device = dev
        self.pin_memory = bool(pin_memory)
        self.pool = pool
        self._stats = PrefetchStats()
        self._pulled: list[float] = []  # waits of items pulled inline since then (each its production time)
        transfer: Callable[[Any], tuple[Any, Any]] | None = None
        self._cuda_device: torch.device | None = None
        if cuda:
            assert dev is not None
            transfer = CudaTransfer(dev, self.pin_memory, pool, self._stats)
            self._cuda_device = transfer.device
        elif dev is not None and dev.type not in ("cpu", "meta"):
            def transfer(item: Any, _d: torch.device = dev) -> tuple[Any, Any]:  # other accelerators: plain copy
                return move_tensors(item, _d, False), None
        self._state: Any = _snapshot(state_fn) if state_fn is not None else {}
        #: Seconds the last ``__next__`` was blocked until its item was ready (or produced it itself).
        self.last_wait_s = 0.0
        self._index = 0
        self._done = False
        #: Called on the consumer's thread when ``__next__`` is about to block until the thread queues an item (not
        #: when it produces one itself; ``None``: nothing). The dataset relays its queued control reports there.
        self.on_wait: Callable[[], None] | None = None
        self.inline_below_s = float(inline_below_s) if transfer is None else 0.0
        self._plain = state_fn is None and transfer is None and not self.pin_memory  # items need nothing but a pull
        self._away: collections.deque = collections.deque(maxlen=_INLINE_WINDOW)  # consumer time per item
        self._popped_seen = 0  # the queue's ``popped`` as of the last stats fold
        #: The hand-off with the thread: a consumer may pop prepared items itself (see :class:`PrefetchQueue`).
        self.queue = PrefetchQueue(iter(source), state_fn, depth, transfer, self.pin_memory and transfer is None,
                                   self._stats, inline=self.inline_below_s > 0, inline_below_s=self.inline_below_s)
        self._finalizer = weakref.finalize(self, _shutdown, self.queue)
        self.queue.job = spawn(functools.partial(_produce, self.queue), "knitdata-prefetch")

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        sh = self.queue
        items = sh.items
        if sh.fast and items and (entry := sh.pop()) is not None:  # the fast path: a plain item prepared
            if self.inline_below_s > 0:
                self._away.append(sh.period)
            self.last_wait_s = 0.0  # a zero wait: folded into the stats when they are read
            return entry[2]  # type: ignore[no-any-return]
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        if sh.inline and not items and self._plain and t0 - sh.left_at < self.inline_below_s:
            # nothing to overlap, nothing queued: the short path. A short time away keeps inline mode (it cannot
            # raise the window's low quantile); a long one goes below, where the mode is picked
            self._away.append(t0 - sh.left_at)
            if (item := self._pull(sh, t0)) is not _BUSY:
                return item  # type: ignore[no-any-return]
            self._away.pop()  # counted again below
        cond = sh.cond
        entry, steal, blocked = None, False, 0.0
        with cond:
            sh.in_next = True
            sh.period = t0 - sh.left_at
            if self.inline_below_s > 0:
                self._away.append(t0 - sh.left_at)
                # a low quantile: time slices lost to other processes only ever lengthen a sample
                inline = sorted(self._away)[len(self._away) // 4] < self.inline_below_s
                if inline != sh.inline:
                    sh.inline = inline
                    sh.fast = not inline and not sh.stop
                    if sh.parked == "turn":
                        cond.notify_all()
            try:
                while True:
                    if sh.items:
                        entry = sh.items.popleft()
                        if sh.parked == "room":
                            _signal(sh.room)
                        break
                    if sh.stop:
                        self._done, sh.fast = True, False
                        raise StateError("the prefetch thread stopped (closed?); build a new Prefetcher")
                    if self.inline_below_s > 0 and not sh.producing and not sh.finished:
                        sh.producing = steal = True  # work stealing: nothing queued, the thread idle: run it here
                        index = sh.index
                        break
                    if sh.job is None or sh.job.done.is_set():
                        self._done, sh.fast = True, False
                        raise StateError("the prefetch thread stopped (closed?); build a new Prefetcher")
                    if blocked == 0.0 and self.on_wait is not None:  # about to block: once per __next__
                        self.on_wait()
                    sh.waiting = True
                    tb = time.perf_counter()
                    cond.wait(_POLL_S)
                    blocked += time.perf_counter() - tb
                    sh.waiting = False
            finally:
                sh.waiting = False
                if sh.parked == "handoff":
                    cond.notify_all()
                if not steal:
                    sh.in_next = False
                    sh.left_at = time.perf_counter()
        if steal:
            last = True
            tb = time.perf_counter()
            try:
                entry, last = _make(sh, index)
                self._stats.inline += not last
            finally:
                blocked += time.perf_counter() - tb
                with cond:
                    sh.producing = False
                    sh.index += 1
                    sh.finished = sh.finished or last
                    if not sh.inline and sh.parked == "turn":
                        cond.notify_all()
                    sh.in_next = False
                    sh.left_at = time.perf_counter()
        assert entry is not None  # taken from the queue or made by _make above
        return self._hand_out(entry, t0, time.perf_counter() - t0, blocked)

    def _pull(self, sh: PrefetchQueue, t0: float) -> Any:
        """Inline, nothing queued, items that need nothing but a pull (called at ``t0``): take the next one from the
        source on this thread with the least bookkeeping (about 5 µs less per item than a pull by the general path,
        with the caches cold); :data:`_BUSY` when the thread holds the source, or the end was reached."""
        with sh.lock:
            mine = not (sh.producing or sh.finished or sh.stop or sh.items)
            if mine:
                sh.producing = sh.in_next = True
                sh.period = t0 - sh.left_at
        if not mine:
            return _BUSY
        try:
            item = next(sh.source)
        except BaseException:  # the end, or an error: re-raised in order (nothing is queued after it)
            with sh.lock:
                sh.producing = sh.in_next = False
                sh.finished = True
                sh.left_at = time.perf_counter()
            self._finish()
            raise
        t1 = time.perf_counter()
        with sh.lock:
            sh.producing = sh.in_next = False
            sh.index += 1
            sh.left_at = t1
        self._index += 1
        self.last_wait_s = wait = t1 - t0
        pulled = self._pulled
        pulled.append(wait)  # folded into the stats when they are read, or when many
        if len(pulled) >= _FOLD_AT:
            self._fold()
        return item

    def _hand_out(self, entry: tuple, t0: float, wait: float, blocked: float = 0.0) -> T:
        """The tail of ``__next__``: end, error or item (made visible to the current CUDA stream), counted."""
        self.last_wait_s = blocked
        kind, index, payload, snap, event = entry
        st = self._fold()  # folds the fast path's items first: the recent waits stay in order
        if kind == "end":
            self._finish()
            raise StopIteration
        if kind == "error":
            self._finish()
            raise payload
        expected = self._index + self.queue.popped
        assert index == expected, f"prefetch out of order: got {index}, expected {expected}"
        self._index += 1
        if event is not None:
            t1 = time.perf_counter()
            cur = torch.cuda.current_stream(self._cuda_device)
            cur.wait_event(event)
            tensors, opaque = collect_tensors(payload)
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(cur)
            for o in opaque:
                if callable(getattr(o, "record_stream", None)):
                    o.record_stream(cur)
            st.h2d_wait_s += time.perf_counter() - t1
        st.items += 1
        st.wait_s += wait
        st.max_wait_s = max(st.max_wait_s, wait)
        st.recent_wait_s.append(wait)
        if snap is not None:
            self._state = snap
        return payload

    @property
    def stats(self) -> PrefetchStats:
        """What this prefetcher measured (consumer-side fields as of the last item handed out)."""
        return self._fold()

    def _fold(self) -> PrefetchStats:
        st = self._stats
        popped = self.queue.popped
        n = popped - self._popped_seen  # items taken by the fast pop since the last fold (waits of 0)
        if n:
            self._popped_seen = popped
            st.items += n
            st.recent_wait_s.extend(itertools.repeat(0.0, n))
        pulled = self._pulled
        if pulled:
            self._pulled = []
            total = sum(pulled)
            st.items += len(pulled)
            st.produced += len(pulled)
            st.inline += len(pulled)
            st.produce_s += total
            st.wait_s += total
            st.max_wait_s = max(st.max_wait_s, *pulled)
            st.recent_wait_s.extend(pulled)
        return st

    def set_depth(self, depth: int) -> None:
        """Queue up to ``depth`` items ahead from now on (the thread checks at its next item; any thread).

        Raises:
            ConfigError: ``depth < 1``.
        """
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"depth must be an int >= 1, got {depth!r}")
        sh = self.queue
        with sh.cond:
            self.depth = sh.depth = depth
        _signal(sh.room)

    def state_dict(self) -> dict[str, Any]:
        """The source state (``state_fn()``) as of the item last handed out; before any item, as of construction.

        Returns ``{}`` when no ``state_fn`` was given.
        """
        return json.loads(json.dumps(self._state))

    @property
    def items_handed_out(self) -> int:
        """Number of items handed out so far (returned by ``__next__`` or popped by the consumer itself)."""
        return self._index + self.queue.popped

    def _finish(self) -> None:
        # The source ended (or failed): the thread no longer touches it. Signal it without waiting for it to
        # exit (on a busy machine a thread wake-up can take a time slice).
        self._done = True
        self._finalizer()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background thread and drop queued items. Idempotent; also runs on garbage collection.

        Args:
            timeout: Seconds to wait for the thread; a source blocked inside ``next()`` cannot be interrupted
                (the thread is a daemon and exits after that call returns).
        """
        self._done = True
        sh = self.queue
        job = sh.job
        with sh.cond:
            busy = sh.producing and job is not None and job.is_alive()  # the thread (or a consumer) in the source
        self._finalizer()
        # a thread parked (not in the source) sees the stop flag when it wakes and never takes the source again:
        # nothing to wait for. One inside the source finishes that item first.
        if busy and job is not None and not job.is_current():
            job.join(timeout)
            _shutdown(sh)  # anything put while we waited

    @property
    def closed(self) -> bool:
        """True once closed or exhausted."""
        return self._done

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Prefetcher(depth={self.depth}, device={self.device}, pin_memory={self.pin_memory}, "
                f"items={self.stats.items}, closed={self._done})")
