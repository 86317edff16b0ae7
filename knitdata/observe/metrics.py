"""Per-consumer metrics: time blocked waiting for data, bytes fetched, fetch latency per micro-batch; what a
prefetcher measured (:class:`PrefetchStats`).

Memory is bounded: per-event series keep the last ``window`` values; totals are counters.
"""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["TransferMeter", "ConsumerMetrics", "PrefetchStats", "summarize", "PENDING_LIMIT"]

#: Waits a :class:`ConsumerMetrics` holds unfolded before the appender folds them (bounds memory when nobody reads).
PENDING_LIMIT = 1024
#: Series at least this long are summarized with ``numpy.partition`` (shorter ones: a sort is as fast).
_PARTITION_FROM = 64
_FLOATS = {float}


def summarize(values: Iterable[float]) -> dict[str, float]:
    """Count, mean, p50, p95 and max of ``values`` (zeros when empty).

    A long series of floats (a metrics window holds up to 10,000) has its order statistics picked by
    ``numpy.partition`` instead of a full sort (about 2x faster at 10,000); the figures are the same values.
    """
    v = values if type(values) is list else list(values)
    n = len(v)
    if not n:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
    lo, hi, i95 = (n - 1) // 2, n // 2, min(n - 1, int(round(0.95 * (n - 1))))
    at: Any
    if n >= _PARTITION_FROM and set(map(type, v)) == _FLOATS:  # (a map of a C function: no bytecode per value)
        picked = np.partition(np.array(v, dtype=np.float64), sorted({lo, hi, i95, n - 1}))
        at = {k: float(picked[k]) for k in (lo, hi, i95, n - 1)}  # the four order statistics, as Python floats
    else:
        at = sorted(v)
    return {
        "count": n,
        "mean": statistics.fmean(v),
        "p50": at[lo] if n % 2 else 0.5 * (at[lo] + at[hi]),
        "p95": at[i95],
        "max": at[n - 1],
    }


class ConsumerMetrics:
    """Counters of one consumer (rank); thread-safe (fetches run on the prefetch thread).

    Attributes:
        rank: The consumer.
        window: Events kept per series.
    """

    def __init__(self, rank: int, window: int = 10_000) -> None:
        self.rank = rank
        self.window = window
        self._lock = threading.Lock()
        #: Waits recorded on the trainer's thread and not folded in yet: ``(seconds, data_wait, is_last, empty)``
        #: tuples. The rank's iterator appends to it directly (one append, no call, no lock); readers fold it
        #: (:meth:`fold`), and so does the appender past :data:`PENDING_LIMIT`. Never replaced.
        self.pending: deque[tuple[float, float, bool, bool]] = deque()
        self.reset()

    def reset(self) -> None:
        """Zero every counter and series."""
        with self._lock:
            self._wait: deque[float] = deque(maxlen=self.window)
            self._data_wait: deque[float] = deque(maxlen=self.window)
            self._step_wait: deque[float] = deque(maxlen=self.window)
            self._step_data_wait: deque[float] = deque(maxlen=self.window)
            self._cur_step_data = 0.0
            self._steps = 0
            self._fetch: deque[float] = deque(maxlen=self.window)
            self._cur_step = 0.0
            self.pending.clear()
            self._microbatches = 0
            self._empty = 0
            self._wait_total = 0.0
            self._data_wait_total = 0.0
            self.fetch_s_total = 0.0
            self.bytes_fetched = 0
            self.local_bytes = 0
            self.remote_bytes = 0
            self.requests = 0
            self.trajectories = 0

    def record_wait(self, seconds: float, *, is_last: bool, empty: bool = False, data_wait: float | None = None) -> None:
        """The trainer spent ``seconds`` inside ``next()`` for one micro-batch (``is_last``: end of a step).

        Called on the trainer's thread (one per rank and process): one append, no lock; readers fold it in.

        Args:
            seconds: Time inside ``next()``.
            is_last: The micro-batch ends its mini-batch (a step).
            empty: The micro-batch holds no trajectory.
            data_wait: Of ``seconds``, the time blocked until the micro-batch was ready (default: all of it).
        """
        self.note_wait(seconds, seconds if data_wait is None else data_wait, is_last, empty)

    def note_wait(self, seconds: float, data_wait: float, is_last: bool, empty: bool) -> None:
        """:meth:`record_wait` with positional arguments (the dataset's hot path): one append, folded by readers."""
        pending = self.pending
        pending.append((seconds, data_wait, is_last, empty))
        if len(pending) > PENDING_LIMIT:  # folded by readers; this bounds it when nobody reads
            self.fold()

    def fold(self) -> None:
        """Fold the waits recorded since the last fold (:attr:`pending`) into the series and totals (any thread)."""
        with self._lock:
            pending = self.pending
            while pending:
                seconds, dw, is_last, empty = pending.popleft()
                self._wait.append(seconds)
                self._data_wait.append(dw)
                self._wait_total += seconds
                self._data_wait_total += dw
                self._microbatches += 1
                self._empty += int(empty)
                self._cur_step += seconds
                self._cur_step_data += dw
                if is_last:
                    self._step_wait.append(self._cur_step)
                    self._step_data_wait.append(self._cur_step_data)
                    self._steps += 1
                    self._cur_step = self._cur_step_data = 0.0

    @property
    def microbatches(self) -> int:
        """Micro-batches handed out."""
        self.fold()
        return self._microbatches

    @property
    def empty_microbatches(self) -> int:
        """Empty micro-batches handed out (a rank with nothing in a mini-batch, kept in step)."""
        self.fold()
        return self._empty

    @property
    def wait_s_total(self) -> float:
        """Seconds the trainer spent inside ``next()``."""
        self.fold()
        return self._wait_total

    @property
    def data_wait_s_total(self) -> float:
        """Of :attr:`wait_s_total`, the seconds ``next()`` was blocked until the micro-batch was ready."""
        self.fold()
        return self._data_wait_total

    def record_fetch(self, seconds: float, *, nbytes: int, local_bytes: int, requests: int, trajectories: int) -> None:
        """One micro-batch (or share) fetch: latency, bytes, how many were local, storage requests."""
        with self._lock:
            self._fetch.append(seconds)
            self.fetch_s_total += seconds
            self.bytes_fetched += nbytes
            self.local_bytes += local_bytes
            self.remote_bytes += nbytes - local_bytes
            self.requests += requests
            self.trajectories += trajectories

    @property
    def wait_per_microbatch_s(self) -> list[float]:
        """Exposed latency of the last micro-batches (seconds in ``next()``)."""
        self.fold()
        with self._lock:
            return list(self._wait)

    @property
    def wait_per_step_s(self) -> list[float]:
        """Exposed latency per optimizer step (sum over the step's micro-batches)."""
        self.fold()
        with self._lock:
            return list(self._step_wait)

    @property
    def data_wait_per_step_s(self) -> list[float]:
        """Of :attr:`wait_per_step_s`, the seconds each step was blocked until its micro-batches were ready."""
        self.fold()
        with self._lock:
            return list(self._step_data_wait)

    @property
    def steps(self) -> int:
        """Steps (mini-batches) whose last micro-batch was handed out."""
        self.fold()
        return self._steps

    @property
    def fetch_latency_s(self) -> list[float]:
        """Latency of the last fetches (fetch + decode + collate of one micro-batch)."""
        with self._lock:
            return list(self._fetch)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable summary."""
        self.fold()
        with self._lock:
            return {
                "rank": self.rank,
                "microbatches": self._microbatches,
                "empty_microbatches": self._empty,
                "trajectories": self.trajectories,
                "wait_s_total": self._wait_total,
                "data_wait_s_total": self._data_wait_total,
                "fetch_s_total": self.fetch_s_total,
                "bytes_fetched": self.bytes_fetched,
                "local_bytes": self.local_bytes,
                "remote_bytes": self.remote_bytes,
                "requests": self.requests,
                "wait_per_microbatch_s": summarize(list(self._wait)),
                "data_wait_per_microbatch_s": summarize(list(self._data_wait)),
                "wait_per_step_s": summarize(list(self._step_wait)),
                "data_wait_per_step_s": summarize(list(self._step_data_wait)),
                "steps": self._steps,
                "last_step_wait_s": self._step_wait[-1] if self._step_wait else 0.0,
                "last_step_data_wait_s": self._step_data_wait[-1] if self._step_data_wait else 0.0,
                "fetch_latency_s": summarize(self._fetch),
            }

    def __repr__(self) -> str:
        d = self.to_dict()
        return (
            f"ConsumerMetrics(rank={self.rank}, microbatches={d['microbatches']}, wait_s_total={d['wait_s_total']:.4f}, "
            f"bytes_fetched={d['bytes_fetched']})"
        )


_FIELDS = ("reads", "local_bytes", "cross_bytes", "cross_reads")


class TransferMeter:
    """Counts payload bytes read and put, local or across nodes. Thread-safe.

    Args:
        max_steps: Per-step rows kept at most (oldest dropped first), so the meter stays bounded.

    Example:
        >>> m = TransferMeter()
        >>> m.record_read(100, cross=True, mode="iter", placement="index_mod", step=0)
        >>> m.totals()["read"]["cross_bytes"]
        100
    """

    def __init__(self, *, max_steps: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._max_steps = max_steps
        self._read: dict[str, dict[str, int]] = {}  # "placement/mode" -> counters
        self._put: dict[str, dict[str, int]] = {}  # "placement" -> counters
        self._steps: OrderedDict[str, dict[str, int]] = OrderedDict()  # "placement/mode/step" -> counters

    @staticmethod
    def _bump(table: dict[str, dict[str, int]], key: str, nbytes: int, cross: bool) -> None:
        row = table.setdefault(key, dict.fromkeys(_FIELDS, 0))
        row["reads"] += 1
        if cross:
            row["cross_bytes"] += nbytes
            row["cross_reads"] += 1
        else:
            row["local_bytes"] += nbytes

    def record_read(self, nbytes: int, *, cross: bool, mode: str, placement: str, step: int = -1) -> None:
        """Count one payload of ``nbytes`` read by a consumer (``cross``: from another node)."""
        with self._lock:
            self._bump(self._read, f"{placement}/{mode}", int(nbytes), cross)
            key = f"{placement}/{mode}/{int(step)}"
            self._bump(self._steps, key, int(nbytes), cross)
            self._steps.move_to_end(key)
            while len(self._steps) > self._max_steps:
                self._steps.popitem(last=False)

    def record_put(self, nbytes: int, *, cross: bool, placement: str) -> None:
        """Count one payload of ``nbytes`` put by a producer (``cross``: into another node's unit)."""
        with self._lock:
            self._bump(self._put, placement, int(nbytes), cross)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable counters (``read``, ``put``, ``steps``)."""
        with self._lock:
            return {
                "read": {k: dict(v) for k, v in self._read.items()},
                "put": {k: dict(v) for k, v in self._put.items()},
                "steps": {k: dict(v) for k, v in self._steps.items()},
            }

    def merge(self, other: Mapping[str, Any]) -> None:
        """Add counters from another meter's :meth:`to_dict` (e.g. reported by a consumer process)."""
        with self._lock:
            for name, table in (("read", self._read), ("put", self._put), ("steps", self._steps)):
                for key, row in dict(other.get(name, {})).items():
                    mine = table.setdefault(key, dict.fromkeys(_FIELDS, 0))
                    for f in _FIELDS:
                        mine[f] += int(row.get(f, 0))
            while len(self._steps) > self._max_steps:
                self._steps.popitem(last=False)

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            self._read.clear()
            self._put.clear()
            self._steps.clear()

    def totals(self, placement: str | None = None, mode: str | None = None) -> dict[str, dict[str, int]]:
        """Sum the read and put counters, optionally for one placement and/or one fetch mode.

        Returns:
            ``{"read": {...}, "put": {...}}`` with ``reads``, ``local_bytes``, ``cross_bytes``,
            ``cross_reads`` (put counters ignore ``mode``).
        """
        out = {"read": dict.fromkeys(_FIELDS, 0), "put": dict.fromkeys(_FIELDS, 0)}
        with self._lock:
            for key, row in self._read.items():
                p, m = key.split("/", 1)
                if (placement is None or p == placement) and (mode is None or m == mode):
                    for f in _FIELDS:
                        out["read"][f] += row[f]
            for p, row in self._put.items():
                if placement is None or p == placement:
                    for f in _FIELDS:
                        out["put"][f] += row[f]
        return out

    def cross_bytes_per_step(self, placement: str, mode: str) -> dict[int, int]:
        """Cross-node read bytes per step for one placement and fetch mode."""
        prefix = f"{placement}/{mode}/"
        with self._lock:
            return {int(k[len(prefix) :]): v["cross_bytes"] for k, v in self._steps.items() if k.startswith(prefix)}


@dataclass
class PrefetchStats:
    """What a :class:`~knitdata.consumer.prefetch.Prefetcher` measured. Consumer-side fields are updated in ``__next__`` (items
    the consumer pulled itself are folded in when the stats are read); producer-side ones on the background thread.

    Attributes:
        items: Items handed out.
        wait_s: Total time the consumer spent blocked in ``__next__`` waiting for an item (exposed latency).
        max_wait_s: Longest single wait.
        recent_wait_s: Per-item waits of the last 4096 items (bounded).
        h2d_wait_s: Host time in ``__next__`` spent making device copies visible to the current stream.
        produced: Items pulled from the source.
        produce_s: Time spent inside ``next(source)`` (by the background thread, or by the consumer inline).
        pin_s: Background time spent pinning / staging into pinned memory.
        copy_s: Background time from issuing a host-to-device copy to its completion.
        bytes_copied: Bytes of tensors copied host-to-device.
        inline: Items the consumer pulled from the source itself (queue empty and the thread idle), counted
            in ``produced`` too.
    """

    items: int = 0
    wait_s: float = 0.0
    max_wait_s: float = 0.0
    recent_wait_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    h2d_wait_s: float = 0.0
    produced: int = 0
    produce_s: float = 0.0
    pin_s: float = 0.0
    copy_s: float = 0.0
    bytes_copied: int = 0
    inline: int = 0

    @property
    def mean_wait_s(self) -> float:
        """Mean wait per handed-out item."""
        return self.wait_s / self.items if self.items else 0.0

    @property
    def median_wait_s(self) -> float:
        """Median of the recent per-item waits."""
        return statistics.median(self.recent_wait_s) if self.recent_wait_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (per-item waits summarized, not listed)."""
        return {
            "items": self.items,
            "wait_s": self.wait_s,
            "mean_wait_s": self.mean_wait_s,
            "median_wait_s": self.median_wait_s,
            "max_wait_s": self.max_wait_s,
            "h2d_wait_s": self.h2d_wait_s,
            "produced": self.produced,
            "produce_s": self.produce_s,
            "pin_s": self.pin_s,
            "copy_s": self.copy_s,
            "bytes_copied": self.bytes_copied,
            "inline": self.inline,
        }
