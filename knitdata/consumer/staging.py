"""Tensors of a prefetched item: walking them, pinning, pinned staging buffers and side-stream device copies.

The host-to-device path of :class:`knitdata.consumer.prefetch.Prefetcher` (see its module for the design): on the prefetch
thread an item's tensors are pinned (or packed into one reused pinned buffer of a :class:`PinnedBufferPool`),
copied with ``non_blocking=True`` on a side stream (:class:`CudaTransfer`), and the copy's event is handed to the
consumer's stream.

>>> import torch
>>> map_tensors({"a": torch.ones(2), "b": [torch.zeros(1), "x"]}, lambda t: t + 1)["b"][0]
tensor([1.])
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from knitdata.errors import ConfigError

__all__ = ["map_tensors", "collect_tensors", "pin_tensors", "move_tensors", "host_memory_stats", "PinnedBufferPool",
           "staged_copy", "CudaTransfer"]

_ALIGN = 256  # byte alignment of tensors packed into one staging buffer / device block
_MAX_DEPTH = 8  # nesting depth map_tensors walks into before treating an object as opaque


# ---------------------------------------------------------------------------------------------- structure walk
def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], opaque: Callable[[Any], Any] | None = None,
                _depth: int = 0) -> Any:
    """Apply ``fn`` to every tensor of a nested structure and rebuild it.

    Walks tensors, mappings, lists, tuples (named tuples included) and dataclass instances (e.g.
    :class:`~knitdata.consumer.collate.MicroBatch`). Containers in which nothing changed are returned as is (not
    copied).
    Anything else (or nesting deeper than 8) goes to ``opaque`` (default: returned unchanged).

    Args:
        obj: The structure.
        fn: Applied to each tensor; its result replaces the tensor.
        opaque: Applied to objects the walk does not enter (e.g. to call their own ``pin_memory()``).

    Returns:
        The rebuilt structure.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if obj is None or isinstance(obj, (str, bytes, bytearray, int, float, bool)):
        return obj
    if _depth > _MAX_DEPTH:
        return opaque(obj) if opaque is not None else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fs = dataclasses.fields(obj)
        if all(f.init for f in fs):
            changes = {f.name: map_tensors(getattr(obj, f.name), fn, opaque, _depth + 1) for f in fs}
            if all(v is getattr(obj, k) for k, v in changes.items()):
                return obj
            return dataclasses.replace(obj, **changes)
    elif isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn, opaque, _depth + 1) for k, v in obj.items()}
        if all(v is obj[k] for k, v in items.items()):
            return obj
        if type(obj) is dict:
            return items
        ctor: Any = type(obj)  # a Mapping subclass whose constructor may or may not take a dict
        try:
            return ctor(items)
        except TypeError:
            return items
    elif isinstance(obj, (list, tuple)):
        vals = [map_tensors(v, fn, opaque, _depth + 1) for v in obj]
        if all(a is b for a, b in zip(vals, obj)):
            return obj
        return type(obj)(*vals) if hasattr(obj, "_fields") else type(obj)(vals)
    return opaque(obj) if opaque is not None else obj


def collect_tensors(obj: Any) -> tuple[list[torch.Tensor], list[Any]]:
    tensors: list[torch.Tensor] = []
    opaque: list[Any] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        tensors.append(t)
        return t

    def other(o: Any) -> Any:
        opaque.append(o)
        return o

    map_tensors(obj, keep, other)
    return tensors, opaque


def pin_tensors(obj: Any) -> Any:
    def pin(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t

    def other(o: Any) -> Any:
        return o.pin_memory() if callable(getattr(o, "pin_memory", None)) else o

    return map_tensors(obj, pin, other)


def move_tensors(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=non_blocking)

    def other(o: Any) -> Any:
        if not callable(getattr(o, "to", None)):
            return o
        try:
            return o.to(device, non_blocking=non_blocking)
        except TypeError:
            return o.to(device)

    return map_tensors(obj, move, other)


def host_memory_stats() -> dict[str, Any]:
    """Return ``torch.cuda.host_memory_stats()`` (pinned host allocator) as a JSON-able dict; ``{}`` without CUDA."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return {}
    try:
        stats = torch.cuda.host_memory_stats()
    except RuntimeError:
        return {}
    return {str(k): (v if isinstance(v, (int, float)) else str(v)) for k, v in stats.items()}


# ---------------------------------------------------------------------------------------------- pinned pool
class PinnedBufferPool:
    """A bounded pool of pinned host staging buffers, reused by power-of-two size class.

    The CUDA caching host allocator rounds each pinned block up to a power of two and never splits
    blocks, so ragged batches fragment it (pytorch#150517, #97432). Staging every item through a buffer
    of its size class, reused across items, keeps pinned memory to a few blocks.

    Args:
        max_cached_bytes: Bound on the bytes of free buffers kept for reuse; a released buffer that would
            exceed it is dropped (returned to torch). Buffers in use are not counted against it.
        min_size: Smallest size class in bytes (a power of two).
        pin: Allocate page-locked memory. ``None``: when CUDA is available. Without CUDA pinning is
            impossible; ``pin=False`` gives ordinary memory (used to test the pool logic on CPU).

    Raises:
        ConfigError: Bad sizes, or ``pin=True`` without CUDA.
    """

    def __init__(self, max_cached_bytes: int = 256 << 20, *, min_size: int = 64 << 10, pin: bool | None = None):
        if max_cached_bytes < 0:
            raise ConfigError(f"max_cached_bytes must be >= 0, got {max_cached_bytes}")
        if min_size < 1 or min_size & (min_size - 1):
            raise ConfigError(f"min_size must be a positive power of two, got {min_size}")
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise ConfigError("pin=True needs CUDA; use pin=None (auto) or pin=False on a machine without a GPU")
        self.max_cached_bytes = int(max_cached_bytes)
        self.min_size = int(min_size)
        self.pin = bool(pin)
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.dropped = 0
        self.cached_bytes = 0
        self.in_use_bytes = 0
        self.high_water_bytes = 0

    def size_class(self, nbytes: int) -> int:
        """The buffer size that serves ``nbytes``: the next power of two, at least ``min_size``."""
        n = max(int(nbytes), self.min_size)
        return 1 << (n - 1).bit_length()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Return a ``uint8`` buffer of at least ``nbytes`` (exactly its size class); give it back with :meth:`release`."""
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                buf = free.pop()
                self.cached_bytes -= size
                self.hits += 1
            else:
                buf = None
                self.misses += 1
            self.in_use_bytes += size
            self.high_water_bytes = max(self.high_water_bytes, self.in_use_bytes + self.cached_bytes)
        if buf is None:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`acquire`; the caller must be done with it (its copies finished)."""
        size = buf.numel()
        with self._lock:
            self.in_use_bytes -= size
            if self.cached_bytes + size <= self.max_cached_bytes:
                self._free[size].append(buf)
                self.cached_bytes += size
            else:
                self.dropped += 1

    def clear(self) -> None:
        """Drop every cached buffer."""
        with self._lock:
            self._free.clear()
            self.cached_bytes = 0

    def stats(self) -> dict[str, Any]:
        """Counters as a JSON-able dict (plus ``host_memory_stats`` of torch when CUDA is present)."""
        with self._lock:
            out: dict[str, Any] = {
                "hits": self.hits,
                "misses": self.misses,
                "dropped": self.dropped,
                "cached_bytes": self.cached_bytes,
                "in_use_bytes": self.in_use_bytes,
                "high_water_bytes": self.high_water_bytes,
                "size_classes": {str(k): len(v) for k, v in sorted(self._free.items()) if v},
            }
        if self.pin:
            out["host_memory_stats"] = host_memory_stats()
        return out


def staged_copy(
    obj: Any, device: torch.device, pool: PinnedBufferPool, non_blocking: bool
) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
    """Copy every CPU tensor of ``obj`` to ``device`` through one pooled staging buffer and one device block.

    Returns ``(moved, staging, block)``: the moved structure (its CPU tensors replaced by views into
    ``block``), and the staging buffer to release once the copy has finished (``None`` if nothing was staged).
    Objects the walk does not enter are moved with their own ``to()``.
    """
    tensors, _ = collect_tensors(obj)
    layout: dict[int, tuple[int, int]] = {}  # id(tensor) -> (offset, nbytes)
    total = 0
    for t in tensors:
        if t.device.type != "cpu" or id(t) in layout:
            continue
        nb = t.numel() * t.element_size()
        layout[id(t)] = (total, nb)
        total += -(-nb // _ALIGN) * _ALIGN
    if not layout:
        return move_tensors(obj, device, non_blocking), None, None
    staging = pool.acquire(total)
    with torch.no_grad():
        for t in tensors:
            if id(t) in layout:
                off, nb = layout[id(t)]
                staging[off : off + nb].view(t.dtype).view(t.shape).copy_(t)
    block = torch.empty(total, dtype=torch.uint8, device=device)
    block.copy_(staging[:total], non_blocking=non_blocking)
    views: dict[int, torch.Tensor] = {}
    for t in tensors:
        if id(t) in layout and id(t) not in views:
            off, nb = layout[id(t)]
            views[id(t)] = block[off : off + nb].view(t.dtype).view(t.shape)

    def swap(t: torch.Tensor) -> torch.Tensor:
        return views[id(t)] if id(t) in views else t.to(device, non_blocking=non_blocking)

    def other(o: Any) -> Any:
        return move_tensors(o, device, non_blocking)

    return map_tensors(obj, swap, other), staging, block


# ---------------------------------------------------------------------------------------------- transfer
class CudaTransfer:
    """Runs on the prefetch thread: pin (or stage), copy on a side stream, wait for the copy.

    Args:
        device: The CUDA device.
        pin: Pin items first.
        pool: Stage into this pool's pinned buffers instead.
        stats: The prefetcher's :class:`~knitdata.observe.metrics.PrefetchStats` (``pin_s``, ``copy_s``,
            ``bytes_copied`` are added to).
    """

    def __init__(self, device: torch.device, pin: bool, pool: PinnedBufferPool | None, stats: Any):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.pin = pin
        self.pool = pool
        self.stats = stats
        self.stream = torch.cuda.Stream(device=device)
        self._thread_ready = False

    def __call__(self, item: Any) -> tuple[Any, Any]:
        if not self._thread_ready:  # the current device is per thread
            torch.cuda.set_device(self.device)
            self._thread_ready = True
        st = self.stats
        staging = None
        with torch.cuda.stream(self.stream):
            if self.pool is not None:
                t0 = time.perf_counter()
                moved, staging, block = staged_copy(item, self.device, self.pool, non_blocking=True)
                nbytes = 0 if block is None else block.numel()
                st.pin_s += time.perf_counter() - t0  # staging + issuing the copy
            else:
                t0 = time.perf_counter()
                host = pin_tensors(item) if self.pin else item
                t1 = time.perf_counter()
                st.pin_s += t1 - t0
                nbytes = sum(t.numel() * t.element_size() for t in collect_tensors(host)[0] if t.device.type == "cpu")
                moved = move_tensors(host, self.device, non_blocking=True)
            t1 = time.perf_counter()
            event = torch.cuda.Event()
            event.record(self.stream)
        event.synchronize()  # blocks this thread only; bounds pinned memory in flight to one item
        st.copy_s += time.perf_counter() - t1
        st.bytes_copied += nbytes
        if staging is not None:
            self.pool.release(staging)  # type: ignore[union-attr]
        return moved, event
