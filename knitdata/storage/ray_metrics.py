"""Cross-node byte counters of the Ray engine (pure Python: no Ray import, JSON state).

Two places count bytes, separately (issue 6):

* **read side** -- where a consumer reads a payload: the reader's Ray node against the Ray node holding
  the object (the node of the unit that owns it, or every node holding a copy from
  ``ray.experimental.get_object_locations``, see :func:`knitdata.storage.ray_unit.read_records`). A read
  is *cross-node* when the reader's node holds no copy; Ray then pulls the object over the network. Counted per fetch mode, per placement and per step (mini-batch).
* **put side** -- where a producer puts a payload: the producer's node against the unit's node.

A :class:`TransferMeter` lives in each process that reads or puts; processes report their counters to the
coordinator (:meth:`TransferMeter.to_dict` / :meth:`TransferMeter.merge`), which sums them. The size of a
meter is bounded by the number of (placement, mode) pairs plus ``max_steps`` step rows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

__all__ = ["TransferMeter"]

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
