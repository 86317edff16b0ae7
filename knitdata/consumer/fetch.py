"""Fetch modes: how a consumer groups its micro-batches' payloads into reads, registered by name.

A :class:`FetchMode` says, for the items (:class:`~knitdata.control.records.ItemRef`) of a plan entry, how they are grouped into storage
requests (:meth:`FetchMode.groups`, used by every engine's ``read``), how those requests are counted
(:meth:`FetchMode.requests`), whether the worker's whole share of a mini-batch is read at its first micro-batch
(:attr:`FetchMode.whole_share`) and whether micro-batches are prepared on a background thread
(:meth:`FetchMode.prepare`, which returns the consumer's :class:`Source`: every mode's implements that one
protocol). The built-in modes:

* ``sample``: one storage request per trajectory, when the micro-batch is asked for (baseline);
* ``eager``: the consumer's whole share of the mini-batch before its first micro-batch;
* ``iter``: the next micro-batches are fetched, decoded, collated (and pinned / copied to a device) on a
  background thread (:class:`knitdata.consumer.prefetch.Prefetcher`) while the current one computes; from an engine
  whose reads copy nothing (the embedded engine) the share is read at once, as ``eager`` does.

>>> from knitdata.control.records import ItemRef
>>> share = [ItemRef("t0", "u0", 10), ItemRef("t1", "u0", 20)]
>>> fetch_mode("sample").requests(share)
2
>>> fetch_mode("iter").requests(share)
1
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from knitdata.control.records import ItemRef
from knitdata.registry import Registry

if TYPE_CHECKING:  # pragma: no cover
    from knitdata.consumer.prefetch import PrefetchQueue

_unit = attrgetter("unit")

__all__ = ["Source", "FetchMode", "SampleFetch", "EagerFetch", "IterFetch", "FETCH_MODES", "fetch_mode"]

#: Items of a plan entry (:class:`~knitdata.control.records.ItemRef`: trajectory id, unit id, nbytes).
Items = Sequence[ItemRef]

T_co = TypeVar("T_co", covariant=True)


class Source(Protocol[T_co]):
    """What the consumer takes its micro-batches from, whatever the fetch mode (:meth:`FetchMode.prepare`):
    :class:`knitdata.consumer.session.Production` (made on the caller's thread) or a :class:`knitdata.consumer.prefetch.Prefetcher`
    over it (made ahead on a background thread).

    Attributes:
        last_wait_s: Seconds the last ``next()`` was blocked until its item was ready (made on the caller's
            thread: the whole call).
        queue: Items prepared ahead that the consumer may pop itself (:meth:`~knitdata.consumer.prefetch.PrefetchQueue.pop`:
            one frame instead of ``next()``'s), or ``None``.
        on_wait: Called on the consumer's thread right before ``next()`` blocks for an item made on another
            thread (``None``: nothing).
    """

    last_wait_s: float
    on_wait: Callable[[], None] | None

    @property
    def queue(self) -> PrefetchQueue | None:
        """Items prepared ahead that the consumer may pop itself, or ``None``."""
        ...

    def __iter__(self) -> Source[T_co]:
        """Itself."""
        ...

    def __next__(self) -> T_co:
        """The next item (``StopIteration`` at the end)."""
        ...

    def close(self) -> None:
        """Stop: nothing more is made; items made and not taken are dropped."""
        ...

    def set_depth(self, depth: int) -> None:
        """Make up to ``depth`` items ahead from now on (a source that makes none ahead ignores it)."""
        ...


class FetchMode:
    """One fetch mode (a strategy object; the built-in ones are registered by :attr:`name`).

    Attributes:
        name: The mode's name (``TrajectoryDataset(fetch=name)``; transfer counters are filed under it).
        whole_share: Read the worker's share of a mini-batch (every micro-batch of it) at its first micro-batch.
    """

    name: str = ""
    whole_share: bool = False

    def reads_share(self, engine: Any) -> bool:
        """Whether a worker reads its whole share of a mini-batch at its first micro-batch from ``engine``
        (default: :attr:`whole_share`)."""
        return self.whole_share

    def groups(self, items: Items) -> Sequence[Items]:
        """``items`` grouped into reads: each group is read with one request per unit (default: one group)."""
        return (items,)

    def requests(self, items: Items) -> int:
        """Storage requests that reading ``items`` takes (default: one per unit)."""
        return len(set(map(_unit, items)))  # a C map: no bytecode per trajectory on the trainer's thread

    def prepare(self, source: Source[Any], *, depth: int, device: Any, pin_memory: bool | None) -> Source[Any]:
        """The source the consumer takes micro-batches from, given the one that makes them on the caller's thread.

        Default: ``source`` itself (micro-batches are made when asked for, on the consumer's thread).
        """
        return source

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SampleFetch(FetchMode):
    """``sample``: one request per trajectory, when the micro-batch is asked for."""

    name = "sample"

    def groups(self, items: Items) -> Sequence[Items]:
        """One group per trajectory."""
        return [(it,) for it in items]

    def requests(self, items: Items) -> int:
        """One per trajectory."""
        return len(items)


class EagerFetch(FetchMode):
    """``eager``: the worker's whole share of a mini-batch at its first micro-batch, one request per unit."""

    name = "eager"
    whole_share = True


class IterFetch(FetchMode):
    """``iter``: micro-batches prepared ahead on a background thread (:class:`~knitdata.consumer.prefetch.Prefetcher`)."""

    name = "iter"

    def reads_share(self, engine: Any) -> bool:
        """The whole share at once from an engine whose reads hand over stored objects
        (:attr:`~knitdata.engines.base.Engine.copy_free_reads`: the embedded engine), one read per micro-batch
        otherwise (a copy that the prefetch thread overlaps with compute, micro-batch by micro-batch)."""
        return bool(engine.copy_free_reads)

    def prepare(self, source: Source[Any], *, depth: int, device: Any, pin_memory: bool | None) -> Source[Any]:
        """A :class:`~knitdata.consumer.prefetch.Prefetcher` over ``source``."""
        from knitdata.consumer.prefetch import Prefetcher

        return Prefetcher(source, depth=depth, device=device, pin_memory=pin_memory)


#: The fetch modes by name (``TrajectoryDataset(fetch=name)``): ``"sample"``, ``"eager"``, ``"iter"``, then any
#: registered since (``FETCH_MODES.register(mode.name, mode)``).
FETCH_MODES: Registry[FetchMode] = Registry(
    "fetch mode", accepts=lambda m: isinstance(m, FetchMode) and isinstance(m.name, str) and bool(m.name))
for _m in (SampleFetch(), EagerFetch(), IterFetch()):
    FETCH_MODES.register(_m.name, _m)


def fetch_mode(mode: str | FetchMode) -> FetchMode:
    """The fetch mode named ``mode`` in :data:`FETCH_MODES` (a :class:`FetchMode` is returned as is).

    Raises:
        ConfigError: No mode of that name.
    """
    return mode if isinstance(mode, FetchMode) else FETCH_MODES.get(mode)
