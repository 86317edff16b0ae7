"""ShardDataset: a rank-aware, resumable ``IterableDataset`` over shards."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from knitdata.codec import is_count
from knitdata.errors import CodecError, ConfigError, StateError
from knitdata.record import Trajectory
from knitdata.shards.format import decode_sample
from knitdata.shards.reader import count_samples, expand_urls, iter_shard_samples

__all__ = ["ShardDataset"]


class ShardDataset(IterableDataset):
    """Reads shards for one consumer: equal sample counts per rank, DataLoader workers without duplicates.

    The global sample order is the shards' order (``urls``) then sample order within each shard. Rank ``r``
    of ``world_size`` takes a contiguous block of ``n`` samples, so every rank reads only the shards its
    block overlaps. ``uneven`` says what happens when the total ``N`` is not a multiple of ``world_size``:
    ``"drop"`` (``n = N // world_size``, the last ``N % world_size`` samples are not read), ``"pad"``
    (``n = ceil(N / world_size)``, the last rank's block wraps around to the first samples, which are then
    read twice) or ``"strict"`` (raise :class:`~knitdata.errors.ConfigError`). Within a rank, DataLoader
    worker ``w`` of ``W`` takes a contiguous part of the block; together the workers yield the block exactly
    once.

    The rank and count are explicit (never read from the environment). ``state_dict`` records how many
    samples this (rank, worker) has yielded in the current epoch; ``load_state_dict`` makes the next
    ``__iter__`` continue exactly after them (skipping data without decoding it), which is what
    ``torchdata.stateful_dataloader.StatefulDataLoader`` needs per worker.

    End of epoch: a state saved after an epoch's last sample (before its ``StopIteration``) resumes with nothing
    left of that epoch. A state saved once the epoch has ended (after ``StopIteration``) records that end; loaded
    into the dataset itself, the next ``__iter__`` yields nothing and the one after it starts the next epoch (the
    ``torchdata.nodes`` convention, a loader without ``restart_on_stop_iteration``). Inside
    ``torchdata.stateful_dataloader.StatefulDataLoader`` (any ``num_workers``) the loader's own convention holds:
    its state taken at the last item resumes with nothing, its state taken after the epoch's end starts a full
    new epoch (the loader drops the empty pass itself). A pass begins when ``iter()`` is called.

    Args:
        urls: Shard paths or a brace pattern.
        rank: This consumer's rank.
        world_size: Number of consumers.
        uneven: ``"drop"``, ``"pad"`` or ``"strict"`` (see above).
        transform: Optional function applied to each trajectory (e.g. tokenize or collate).
        sample_counts: Samples per shard, if known (skips the header scan that counts them).
        verify: Check member CRC32s.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        uneven: str = "drop",
        transform: Callable[[Trajectory], Any] | None = None,
        sample_counts: Sequence[int] | None = None,
        verify: bool = True,
    ):
        super().__init__()
        self.urls = expand_urls(urls)
        if not self.urls:
            raise ConfigError("ShardDataset needs at least one shard")
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ConfigError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        if uneven not in ("drop", "pad", "strict"):
            raise ConfigError(f"uneven must be 'drop', 'pad' or 'strict', got {uneven!r}")
        if sample_counts is not None and len(sample_counts) != len(self.urls):
            raise ConfigError(f"sample_counts has {len(sample_counts)} entries for {len(self.urls)} shards")
        self.rank, self.world_size, self.uneven = rank, world_size, uneven
        self.transform, self.verify = transform, verify
        self._counts = list(sample_counts) if sample_counts is not None else None
        self._epoch = 0
        self._yielded = 0
        self._resume: int | None = None
        # True once an epoch ended and the next one has not started: a state saved now is an end-of-epoch state
        self._epoch_end = False
        self._resume_end = False

    # -------------------------------------------------------------------------------- layout
    @property
    def sample_counts(self) -> list[int]:
        """Samples per shard (counted from tar headers on first use)."""
        if self._counts is None:
            self._counts = [count_samples(u) for u in self.urls]
        return self._counts

    @property
    def total_samples(self) -> int:
        """Samples over all shards."""
        return sum(self.sample_counts)

    @property
    def samples_per_rank(self) -> int:
        """Samples every rank yields per epoch (the same on every rank)."""
        n, w = self.total_samples, self.world_size
        if self.uneven == "strict" and n % w:
            raise ConfigError(f"{n} samples do not split evenly over {w} ranks; use uneven='drop' or 'pad'")
        return -(-n // w) if self.uneven == "pad" else n // w

    def _my_indices(self) -> tuple[int, int, int]:
        """Return ``(first, count, worker)``: global start index and count for this (rank, worker)."""
        n = self.samples_per_rank
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        lo, hi = wid * n // nw, (wid + 1) * n // nw
        return self.rank * n + lo, hi - lo, wid

    def __len__(self) -> int:
        return self.samples_per_rank

    # -------------------------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Any]:
        # the pass is fixed here, when iter() is called, not at its first next(): StatefulDataLoader (num_workers=0)
        # builds an iterator from a loaded state and, when that state's epoch had ended, drops it unstarted and
        # calls iter() again for the next epoch
        first, count, _wid = self._my_indices()
        if self._resume_end:  # loaded an end-of-epoch state: this pass yields nothing, the next one starts over
            self._resume_end = False
            self._resume = None
            self._epoch_end = True
            return iter(())
        skip = self._resume or 0
        self._resume = None
        self._yielded = skip
        self._epoch_end = False
        return self._pass(first + skip, count - skip)

    def _pass(self, pos: int, remaining: int) -> Iterator[Any]:
        """Yield ``remaining`` samples from global index ``pos`` on, then end the epoch."""
        total = self.total_samples
        if total == 0 or remaining <= 0:
            self._end_epoch()
            return
        cum = np.cumsum([0, *self.sample_counts])
        while remaining > 0:
            g = pos % total
            shard = int(np.searchsorted(cum, g, side="right") - 1)
            within = g - int(cum[shard])
            take = min(remaining, int(cum[shard + 1]) - g)
            got = 0
            for key, members in iter_shard_samples(self.urls[shard], start=within):
                traj, _h = decode_sample(key, members, where=self.urls[shard], verify=self.verify)
                self._yielded += 1
                got += 1
                yield self.transform(traj) if self.transform is not None else traj
                if got == take:
                    break
            if got < take:
                raise CodecError(
                    f"shard {self.urls[shard]!r} holds fewer samples than counted ({within + got} < {within + take}); "
                    "the shards changed after the dataset was created"
                )
            pos += take
            remaining -= take
        self._end_epoch()

    def _end_epoch(self) -> None:
        self._epoch += 1
        self._yielded = 0
        self._epoch_end = True

    # -------------------------------------------------------------------------------- state
    def _layout(self) -> dict[str, Any]:
        """What a state must match to resume here: rank, world, shards and this DataLoader worker's place."""
        info = get_worker_info()
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "uneven": self.uneven,
            "num_shards": len(self.urls),
            "total_samples": self.total_samples,
            "worker": info.id if info is not None else 0,
            "num_workers": info.num_workers if info is not None else 1,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return JSON-serializable resume state of this (rank, worker)."""
        return {
            "format": "knitdata.ShardDataset",
            "version": 1,
            **self._layout(),
            "epoch": self._epoch,
            "yielded": self._yielded,
            "epoch_end": self._epoch_end,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``__iter__`` continues after the samples already yielded.

        A state saved at the end of an epoch (``epoch_end``) makes the next ``__iter__`` yield nothing; the
        one after it starts the next epoch (``torchdata.nodes`` convention). States without ``epoch_end``
        (saved by older versions) resume at the position they record.

        Raises:
            StateError: If the state belongs to another rank, worker layout or set of shards.
        """
        if not isinstance(state, Mapping) or state.get("format") != "knitdata.ShardDataset":
            raise StateError(f"not a ShardDataset state: {state!r}")
        for k, v in self._layout().items():
            if state.get(k) != v:
                raise StateError(
                    f"state has {k}={state.get(k)!r} but this dataset has {k}={v!r}; resume with the same shards, "
                    "rank, world size and number of DataLoader workers"
                )
        _f, count, _w = self._my_indices()
        y = state.get("yielded")
        if not is_count(y) or y > count:
            raise StateError(f"bad 'yielded' {y!r:.80} (this worker has {count} samples per epoch)")
        epoch = state.get("epoch", 0)
        if not is_count(epoch):
            raise StateError(f"bad 'epoch' {epoch!r:.80}: expected a non-negative int")
        end = state.get("epoch_end", False)
        if not isinstance(end, bool) or (end and y != 0):
            raise StateError(f"bad 'epoch_end' {end!r:.80} with 'yielded' {y!r} (an ended epoch records 0 yielded)")
        self._epoch = epoch
        self._yielded = y
        self._resume = y
        self._epoch_end = end
        self._resume_end = end
