"""Per-consumer metrics: time blocked waiting for data, bytes fetched, fetch latency per micro-batch.

Memory is bounded: per-event series keep the last ``window`` values; totals are counters.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

__all__ = ["ConsumerMetrics", "summarize"]


def summarize(values: Iterable[float]) -> dict[str, float]:
    """Count, mean, p50, p95 and max of ``values`` (zeros when empty)."""
    v = sorted(values)
    if not v:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
    return {
        "count": len(v),
        "mean": statistics.fmean(v),
        "p50": v[(len(v) - 1) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2]),
        "p95": v[min(len(v) - 1, int(round(0.95 * (len(v) - 1))))],
        "max": v[-1],
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
        self.reset()

    def reset(self) -> None:
        """Zero every counter and series."""
        with self._lock:
            self._wait: deque[float] = deque(maxlen=self.window)
            self._step_wait: deque[float] = deque(maxlen=self.window)
            self._fetch: deque[float] = deque(maxlen=self.window)
            self._cur_step = 0.0
            self.microbatches = 0
            self.empty_microbatches = 0
            self.wait_s_total = 0.0
            self.fetch_s_total = 0.0
            self.bytes_fetched = 0
            self.local_bytes = 0
            self.remote_bytes = 0
            self.requests = 0
            self.trajectories = 0

    def record_wait(self, seconds: float, *, is_last: bool, empty: bool = False) -> None:
        """The trainer spent ``seconds`` inside ``next()`` for one micro-batch (``is_last``: end of a step)."""
        with self._lock:
            self._wait.append(seconds)
            self.wait_s_total += seconds
            self.microbatches += 1
            self.empty_microbatches += int(empty)
            self._cur_step += seconds
            if is_last:
                self._step_wait.append(self._cur_step)
                self._cur_step = 0.0

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
        with self._lock:
            return list(self._wait)

    @property
    def wait_per_step_s(self) -> list[float]:
        """Exposed latency per optimizer step (sum over the step's micro-batches)."""
        with self._lock:
            return list(self._step_wait)

    @property
    def fetch_latency_s(self) -> list[float]:
        """Latency of the last fetches (fetch + decode + collate of one micro-batch)."""
        with self._lock:
            return list(self._fetch)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable summary."""
        with self._lock:
            return {
                "rank": self.rank,
                "microbatches": self.microbatches,
                "empty_microbatches": self.empty_microbatches,
                "trajectories": self.trajectories,
                "wait_s_total": self.wait_s_total,
                "fetch_s_total": self.fetch_s_total,
                "bytes_fetched": self.bytes_fetched,
                "local_bytes": self.local_bytes,
                "remote_bytes": self.remote_bytes,
                "requests": self.requests,
                "wait_per_microbatch_s": summarize(self._wait),
                "wait_per_step_s": summarize(self._step_wait),
                "fetch_latency_s": summarize(self._fetch),
            }

    def __repr__(self) -> str:
        d = self.to_dict()
        return (
            f"ConsumerMetrics(rank={self.rank}, microbatches={d['microbatches']}, wait_s_total={d['wait_s_total']:.4f}, "
            f"bytes_fetched={d['bytes_fetched']})"
        )
