"""The consumer side of the Ray engine: one rank's micro-batches, in its process or DataLoader workers.

:class:`RayTrajectoryDataset` follows its rank's plan queue in the coordinator actor
(:mod:`knitdata.storage.ray_engine`) and reads payloads straight from the storage units (zero-copy on the
unit's node). Worker ``w`` of ``W`` yields the rank's micro-batches ``j`` with ``j % W == w``; its state is
``{"next": j}`` per worker (JSON), which ``StatefulDataLoader`` snapshots per worker and restores on
resume. :meth:`RayTrajectoryDataset.commit` releases what precedes a saved state.

Importing this module without Ray installed raises :class:`~knitdata.errors.OptionalDependencyError`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from knitdata.errors import ConfigError, OptionalDependencyError, StateError

try:
    import ray  # noqa: F401
except ImportError as _e:  # pragma: no cover - exercised by monkeypatching in tests
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.storage.ray_dataset)") from _e

from torch.utils.data import IterableDataset, get_worker_info

from knitdata.codec import decode_trajectory
from knitdata.storage.ray_engine import RayClient
from knitdata.storage.ray_metrics import TransferMeter
from knitdata.storage.ray_unit import RayStorageUnit, read_records

__all__ = ["RayTrajectoryDataset", "STATE_FORMAT"]

#: ``format`` field of a :class:`RayTrajectoryDataset` state.
STATE_FORMAT = "knitdata.RayTrajectoryDataset"
_STATE_VERSION = 1
_POLL_S = 1.0


def _dist_rank() -> int | None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


def _find_states(obj: Any, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every dataset state nested in ``obj`` (e.g. a StatefulDataLoader state with worker snapshots)."""
    if isinstance(obj, dict):
        if obj.get("format") == STATE_FORMAT:
            out.append(obj)
        else:
            for v in obj.values():
                _find_states(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _find_states(v, out)
    return out


class RayTrajectoryDataset(IterableDataset):
    """The micro-batches of one consumer rank of a Ray pipeline, in plan order.

    Works in the rank's process and in DataLoader worker processes (``multiprocessing_context="spawn"``,
    see :meth:`stateful_loader`): worker ``w`` of ``W`` yields the rank's micro-batches ``j`` with
    ``j % W == w``, so the DataLoader's round robin hands them out in plan order, each once. The dataset
    attaches to the cluster lazily, in the process that iterates it; pickling it (to spawn workers)
    carries only its configuration.

    Args:
        name: The pipeline's name.
        address: Ray address (``None``: this process's Ray).
        rank: The consumer; default: ``torch.distributed.get_rank()`` (the process group must be initialized).
        fetch: ``"sample"`` (one request per trajectory), ``"eager"`` (the worker's whole share of a
            mini-batch at its first micro-batch) or ``"iter"`` (the next micro-batches fetched, decoded and
            collated on a background thread, ``prefetch_depth`` ahead).
        collate: ``collate(trajectories, info) -> MicroBatch``; default :class:`~knitdata.collate.TokenCollator`.
        media_collator: E.g. :class:`~knitdata.multimodal.MultimodalCollator`: each micro-batch's ``media`` is
            then the :class:`~knitdata.multimodal.MultimodalBatch` of the rank's whole share of its mini-batch
            (the share is fetched at its first micro-batch). Needs the whole share in one process, so it is
            refused in DataLoader worker processes.
        prefetch_depth: Micro-batches prepared ahead in ``iter`` mode.
        loopback_only: See :func:`~knitdata.storage.ray_unit.connect`.
        poll_s: How long one wait for the next plan blocks in the coordinator.

    Raises:
        ConfigError: Bad options, or no rank given outside an initialized process group.
    """

    def __init__(self, name: str = "knitdata", *, address: str | None = None, rank: int | None = None,
                 fetch: str = "iter", collate: Callable[..., Any] | None = None,
                 media_collator: Callable[..., Any] | None = None, prefetch_depth: int = 2,
                 loopback_only: bool = True, poll_s: float = _POLL_S) -> None:
        super().__init__()
        if fetch not in ("sample", "eager", "iter"):
            raise ConfigError(f"unknown fetch mode {fetch!r}; choose one of ('sample', 'eager', 'iter')")
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ConfigError(f"prefetch_depth must be an int >= 1, got {prefetch_depth!r}")
        if rank is None:
            rank = _dist_rank()
            if rank is None:
                raise ConfigError("no rank given and torch.distributed is not initialized: pass rank=...")
        if collate is None:
            from knitdata.collate import TokenCollator

            collate = TokenCollator()
        self.name = name
        self.address = address
        self.rank = int(rank)
        self.fetch = fetch
        self.collate = collate
        self.media_collator = media_collator
        self.prefetch_depth = prefetch_depth
        self.loopback_only = loopback_only
        self.poll_s = poll_s
        self._next: int | None = None  # next micro-batch index of this (worker's) iteration
        self._worker = (0, 1)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("_lock", None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def _client(self) -> RayClient:
        return RayClient.shared(self.name, address=self.address, loopback_only=self.loopback_only)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        wi = get_worker_info()
        w, nw = (wi.id, wi.num_workers) if wi is not None else (0, 1)
        if self.media_collator is not None and nw > 1:
            raise ConfigError(
                "media_collator needs the rank's whole share of a mini-batch in one process (one table of unique "
                "media for all its micro-batches): use num_workers=0 (fetch='iter' prefetches on a thread)"
            )
        client = self._client()
        if not 0 <= self.rank < client.num_consumers:
            raise ConfigError(f"rank {self.rank} is outside 0..{client.num_consumers - 1} of pipeline {self.name!r}")
        with self._lock:
            if self._next is not None and self._worker != (w, nw):
                raise StateError(f"state of worker {self._worker[0]} of {self._worker[1]} loaded into worker {w} "
                                 f"of {nw}: resume with the same num_workers")
            self._worker = (w, nw)
            start = self._next if self._next is not None else w
            self._next = start
        source = _produce(client, self, start, nw)
        if self.fetch == "iter":
            from knitdata.prefetch import Prefetcher

            return _Handout(self, client, Prefetcher(source, depth=self.prefetch_depth))
        return _Handout(self, client, source)

    def stateful_loader(self, **kwargs: Any) -> Any:
        """A ``StatefulDataLoader(self, batch_size=None, ...)``; worker processes are spawned, not forked.

        Save its ``state_dict()`` per rank, then :meth:`commit` it to release what precedes it.
        """
        from torchdata.stateful_dataloader import StatefulDataLoader

        kwargs.setdefault("batch_size", None)
        if kwargs.get("num_workers", 0) > 0:
            kwargs.setdefault("multiprocessing_context", "spawn")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(self, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for Accelerate; plan order does not depend on it."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position: the next micro-batch index of this (worker's) iteration."""
        with self._lock:
            w, nw = self._worker
            if self._next is None:  # not iterated yet in this process: the worker we are in
                wi = get_worker_info()
                w, nw = (wi.id, wi.num_workers) if wi is not None else (0, 1)
            return {"format": STATE_FORMAT, "version": _STATE_VERSION, "name": self.name, "rank": self.rank,
                    "worker": w, "num_workers": nw, "next": self._next if self._next is not None else w}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the micro-batches ``state`` was taken at.

        Raises:
            StateError: Not this dataset's state, or another pipeline's or rank's.
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise StateError(f"not a {STATE_FORMAT} state: {state!r:.200}")
        if state.get("version") != _STATE_VERSION:
            raise StateError(f"unsupported state version {state.get('version')!r}; expected {_STATE_VERSION}")
        if state.get("name") != self.name or state.get("rank") != self.rank:
            raise StateError(f"state of pipeline {state.get('name')!r} rank {state.get('rank')} loaded into pipeline "
                             f"{self.name!r} rank {self.rank}: save and load one state per rank")
        try:
            nxt, w, nw = int(state["next"]), int(state["worker"]), int(state["num_workers"])
        except (KeyError, TypeError, ValueError) as e:
            raise StateError(f"bad {STATE_FORMAT} state {state!r:.200}: {e}") from e
        with self._lock:
            self._next, self._worker = nxt, (w, nw)

    def commit(self, state: Mapping[str, Any] | None = None) -> int:
        """Release every payload before ``state`` (this dataset's or a StatefulDataLoader's state dict).

        Call it after the state is saved: a consumer restored from it receives exactly what follows.

        Returns:
            The rank's committed micro-batch index (everything below it is released).

        Raises:
            StateError: ``state`` holds no state of this dataset's pipeline and rank.
        """
        states = _find_states(state if state is not None else self.state_dict(), [])
        mine = [s for s in states if s.get("name") == self.name and s.get("rank") == self.rank]
        if not mine:
            raise StateError(f"no {STATE_FORMAT} state of pipeline {self.name!r} rank {self.rank} in the given state")
        nw = int(mine[0]["num_workers"])
        nexts = {int(s["worker"]): int(s["next"]) for s in mine}
        # a worker without a snapshot has handed out nothing: its next index is its worker id
        upto = min(nexts.get(w, w) for w in range(nw))
        return self._client().commit(self.rank, upto)

    def __repr__(self) -> str:
        return f"RayTrajectoryDataset(name={self.name!r}, rank={self.rank}, fetch={self.fetch!r}, next={self._next})"


class _Handout(Iterator[Any]):
    """Moves the dataset's position as items are handed out (not when they are prefetched)."""

    def __init__(self, ds: RayTrajectoryDataset, client: RayClient, inner: Iterator[tuple[int, Any]]) -> None:
        self._ds = ds
        self._client = client
        self._inner = inner
        self._nw = ds._worker[1]

    def __next__(self) -> Any:
        j, mb = next(self._inner)
        with self._ds._lock:
            self._ds._next = j + self._nw
        if self._client._info["release"] == "handout":
            self._client._coord.handed_out.remote(self._ds.rank, j)
        return mb

    def close(self) -> None:
        """Stop a background prefetcher."""
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()


def _produce(client: RayClient, ds: RayTrajectoryDataset, j: int, nw: int) -> Iterator[tuple[int, Any]]:
    """Fetch and collate micro-batches ``j, j + nw, ...`` of ``ds.rank`` in plan order."""
    from knitdata.collate import MicroBatchInfo

    rank, fetch, placement = ds.rank, ds.fetch, client.placement
    cache: dict[int, dict[str, Any]] = {}
    share: dict[str, Any] = {}  # eager: records of this worker's share of the current mini-batch
    decoded: dict[str, Any] = {}  # media: trajectories of the share of the current mini-batch
    media: Any = None
    recover = _recoverer(client)
    while True:
        if j not in cache:
            cache.clear()
            while True:
                ans = client._call(client._coord.entries, rank, j, ds.poll_s)
                if "entries" in ans:
                    break
                if ans.get("end"):
                    return
            for e in ans["entries"]:
                cache[e["j"]] = e
        e = cache.pop(j)
        info = MicroBatchInfo.from_dict(e["info"])
        meter = TransferMeter()
        step = int(e["minibatch"])
        if ds.media_collator is not None:
            if media is None or not all(tid in decoded for tid, _u, _n in e["items"]):
                entries = [e, *[x for _k, x in sorted(cache.items())]]  # j .. the end of its mini-batch (nw == 1)
                items = [it for x in entries for it in x["items"]]
                recs = _read(client, items, meter, "eager", placement, step, recover)
                decoded = {it[0]: decode_trajectory(r, copy=False) for it, r in zip(items, recs)}
                # micro-batches before a resume point are empty, so indices stay those of the plan
                groups = [[] for _ in range(info.microbatch)] + [[decoded[t] for t, _u, _n in x["items"]] for x in entries]
                media = ds.media_collator(groups)
            trajs = [decoded.pop(tid) for tid, _u, _n in e["items"]]
            mb = ds.collate(trajs, info)
            mb.media = media
            if info.is_last:
                media = None
            client._coord.report.remote(meter.to_dict())
            yield j, mb
            j += nw
            continue
        if fetch == "eager":
            if not all(tid in share for tid, _u, _n in e["items"]):
                mine = [x for k, x in sorted(cache.items()) if (k - j) % nw == 0]
                items = [it for x in [e, *mine] for it in x["items"]]
                share = dict(zip([it[0] for it in items],
                                 _read(client, items, meter, fetch, placement, step, recover)))
            recs = [share.pop(tid) for tid, _u, _n in e["items"]]
        elif fetch == "sample":
            recs = [r for it in e["items"] for r in _read(client, [it], meter, fetch, placement, step, recover)]
        else:
            recs = _read(client, e["items"], meter, fetch, placement, step, recover)
        trajs = [decode_trajectory(r, copy=False) for r in recs]
        mb = ds.collate(trajs, info)
        client._coord.report.remote(meter.to_dict())
        yield j, mb
        j += nw


def _read(client: RayClient, items: Sequence[Sequence[Any]], meter: TransferMeter, mode: str, placement: str,
          step: int, recover: Callable[[RayStorageUnit, list[str]], Mapping[str, Any]]) -> list[Any]:
    units = client.units
    return read_records([(tid, units[u]) for tid, u, _n in items], meter=meter, mode=mode, placement=placement,
                        step=step, recover=recover)


def _recoverer(client: RayClient) -> Callable[[RayStorageUnit, list[str]], Mapping[str, Any]]:
    def recover(unit: RayStorageUnit, ids: list[str]) -> Mapping[str, Any]:
        if not client._info.get("spill_dir"):
            return {}
        return client._call(client._coord.recover, unit.unit_id, ids)

    return recover
