"""Hugging Face Accelerate integration: one rank's knitdata loader inside an Accelerate training loop.

``accelerator.prepare()`` rewrites every :class:`torch.utils.data.DataLoader` it is given (accelerate 1.15,
``Accelerator._prepare_one``: only ``isinstance(obj, DataLoader)`` objects are touched). Over an
``IterableDataset`` it either dispatches batches from rank 0 or makes every rank read the whole stream and
keep ``1/N`` of it: a rank-aware knitdata dataset would be silently cut. :class:`AcceleratedLoader`
therefore *wraps* a :class:`~knitdata.consumer.dataset.TrajectoryDataset` instead of subclassing ``DataLoader``;
``prepare()`` returns it unchanged (it is neither a DataLoader, a module, an optimizer nor a scheduler), and
you do not need to pass it to ``prepare()`` at all. What it does the Accelerate way:

* **Rank and world** come from Accelerate's state (``accelerator.process_index`` / ``num_processes``, the
  same values as :class:`accelerate.PartialState`); the pipeline must have exactly that many consumers.
* **Device placement**: each micro-batch goes through :func:`accelerate.utils.send_to_device`, which calls
  :meth:`knitdata.consumer.collate.MicroBatch.to` (media included). With ``fetch="iter"`` on CUDA the copy already
  happens on the prefetch thread (side stream), and ``send_to_device`` is then a no-op.
* **Gradient accumulation** follows the plan, not a fixed ``gradient_accumulation_steps``: the micro-batches
  of one mini-batch are ``info.microbatch = 0..K-1`` and ``info.is_last`` marks the optimizer step (K is
  the same on every rank). :meth:`AcceleratedLoader.accumulate` sets ``accelerator.sync_gradients`` to
  ``info.is_last`` (so a prepared optimizer's ``step``/``zero_grad`` and a prepared scheduler's ``step``
  are no-ops on every micro-batch but the last) and enters ``accelerator.no_sync(model)`` for all but
  the last micro-batch. Losses are scaled by the mini-batch's
  global loss tokens (:meth:`AcceleratedLoader.loss_scale`), so the Accelerator must keep
  ``gradient_accumulation_steps=1`` (``accelerator.backward`` would divide again otherwise).
* **Per-rank state**: :meth:`AcceleratedLoader.save_state` writes ``<dir>/knitdata_loader_rank{r}.json``
  (one JSON file per rank, written atomically) and :meth:`AcceleratedLoader.load_state` reads it back.
  Several loaders on one Accelerator (a train and an eval loader) keep distinct files: without ``name=``, the
  loaders hooked to one Accelerator are named in the order they are built, as Accelerate numbers its own
  dataloaders (``knitdata_loader``, ``knitdata_loader_1``, ...), so build them in the same order when resuming
  (or give each a ``name=``); two hooked loaders with one explicit name are refused.
  By default both are hooked into ``accelerator.save_state`` / ``accelerator.load_state`` through
  ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``, which Accelerate runs on *every*
  process with the resolved checkpoint directory. (Accelerate's ``register_for_checkpointing`` objects
  are written by the main process only, with ``torch.save``, and its one dataloader state is shared by
  all ranks, accelerate#3080: neither fits per-rank loader state.)

* **Metrics**: with ``log_every=N`` (or :func:`log_metrics`) the dataset's per-step figures
  (:meth:`~knitdata.consumer.dataset.TrajectoryDataset.step_metrics`: staleness, exposed data wait, bytes, admission delay,
  store fill, spills, flat keys under ``knitdata/``) go to ``accelerator.log``, so to every tracker the
  Accelerator was built with (``log_with="tensorboard"``, ``"wandb"``...).

The loader holds nothing beyond the micro-batch being handed out, so its state (the dataset's position
after the last micro-batch handed out) is exactly what the training loop has consumed. Save at an
optimizer-step boundary (after ``info.is_last``) so model, optimizer and loader agree.

Example (``model``, ``opt``, ``per_token_loss`` and the pipeline ``pipeline`` are yours; on a Ray-engine pipeline
every rank attaches with ``Pipeline.attach(name, address=...)``):

```python
from accelerate import Accelerator
from knitdata.integrations.accelerate import prepare_loader

accelerator = Accelerator()                        # keep gradient_accumulation_steps=1: the plan decides
model, opt = accelerator.prepare(model, opt)       # the loader does not go through prepare()
loader = prepare_loader(accelerator, pipeline, fetch="iter")
for mb in loader:
    with loader.accumulate(model, mb):             # no_sync and sync_gradients=False until mb.info.is_last
        loss = (per_token_loss(model, mb) * mb.loss_mask).sum() * loader.loss_scale(mb)
        accelerator.backward(loss)
        opt.step(); opt.zero_grad()                # skipped by Accelerate unless mb.info.is_last
accelerator.save_state("ckpt")                     # also ckpt/knitdata_loader_rank{r}.json, committed
```
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from knitdata.errors import ConfigError, StateError, ValidationError

if TYPE_CHECKING:  # pragma: no cover
    from knitdata.consumer.collate import MicroBatch, MicroBatchInfo
    from knitdata.consumer.dataset import TrajectoryDataset

__all__ = [
    "AcceleratedLoader",
    "prepare_loader",
    "state_path",
    "rank_and_world",
    "STATE_FILE_PREFIX",
    "log_metrics",
]

#: File name prefix of the per-rank state files (``<prefix>_rank{r}.json``).
STATE_FILE_PREFIX = "knitdata_loader"

_FORMAT = "knitdata.AcceleratedLoader"
_VERSION = 1

# accelerator -> {state file name prefix: (weak reference to) the loader hooked under it}: the names taken on each
# Accelerator (weak both ways: neither an Accelerator nor a dropped loader is kept alive by the table)
_HOOKED: weakref.WeakKeyDictionary[Any, dict[str, weakref.ref[AcceleratedLoader]]] = weakref.WeakKeyDictionary()


def _hooked_names(accelerator: Any) -> dict[str, AcceleratedLoader]:
    """The live loaders hooked to ``accelerator``, by name (a snapshot of :func:`_name_table`)."""
    table = _name_table(accelerator)
    return {name: loader for name, ref in list(table.items()) if (loader := ref()) is not None}


def _name_table(accelerator: Any) -> dict[str, weakref.ref[AcceleratedLoader]]:
    try:
        return _HOOKED.setdefault(accelerator, {})
    except TypeError:  # not weakly referenceable: keep the table on the object itself
        table: dict[str, weakref.ref[AcceleratedLoader]] = accelerator.__dict__.setdefault(
            "_knitdata_loader_names", {})
        return table


def state_path(directory: str | os.PathLike[str], rank: int, name: str = STATE_FILE_PREFIX) -> Path:
    """Path of rank ``rank``'s loader state in checkpoint ``directory``: ``<directory>/<name>_rank{rank}.json``."""
    return Path(directory) / f"{name}_rank{int(rank)}.json"


def rank_and_world(accelerator: Any = None) -> tuple[int, int]:
    """``(process_index, num_processes)`` from ``accelerator``, or from :class:`accelerate.PartialState`.

    Args:
        accelerator: An :class:`accelerate.Accelerator`, or ``None`` to read the process state
            (initializing it from the launcher's environment if needed).
    """
    if accelerator is None:
        from accelerate import PartialState

        accelerator = PartialState()
    return int(accelerator.process_index), int(accelerator.num_processes)


def _write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class AcceleratedLoader:
    """One rank's micro-batches for an Accelerate loop; not a ``DataLoader``, so ``prepare()`` leaves it alone.

    Build it with :func:`prepare_loader` (rank and world from the accelerator) or directly around the
    dataset of this process's rank.

    Args:
        dataset: The :class:`~knitdata.consumer.dataset.TrajectoryDataset` (or any iterable of
            :class:`~knitdata.consumer.collate.MicroBatch` with ``state_dict``/``load_state_dict``/``set_epoch``) of
            rank ``accelerator.process_index``.
        accelerator: The :class:`accelerate.Accelerator` of the training loop.
        device_placement: Move each micro-batch to ``accelerator.device`` with ``send_to_device``.
        non_blocking: Asynchronous copies (effective from pinned memory to CUDA); default: whether the
            accelerator was built with ``non_blocking`` in its dataloader config.
        register_hooks: Hook :meth:`save_state`/:meth:`load_state` into ``accelerator.save_state`` /
            ``accelerator.load_state`` (on every process).
        name: File name prefix of the per-rank state files. ``None``: ``knitdata_loader`` for the first loader
            hooked to this Accelerator, ``knitdata_loader_1`` for the second, and so on in the order they are
            built (the first free one; a closed loader frees its name); without hooks, ``knitdata_loader``.
        commit_on_save: After :meth:`save_state` wrote the file, :meth:`commit` the saved state.
        log_every: Every this many optimizer steps, when the step's last micro-batch (``info.is_last``) is handed
            out, log the dataset's ``step_metrics()`` with ``accelerator.log(..., step=info.minibatch)`` (see
            :func:`log_metrics`; the main process logs, as Accelerate does). ``None``: never.

    Raises:
        ConfigError: The dataset belongs to another rank or a pipeline with another number of consumers,
            the accelerator accumulates gradients itself (``gradient_accumulation_steps != 1``), the
            dataset exposes a ``generator`` attribute, or another loader is hooked to this Accelerator under
            the same explicit ``name`` (both would write one state file).

    Attributes:
        dataset: The wrapped dataset.
        accelerator: The accelerator.
        rank: This process's rank (``accelerator.process_index``).
        world: Number of ranks (``accelerator.num_processes``).
    """

    def __init__(
        self,
        dataset: TrajectoryDataset | Any,
        accelerator: Any,
        *,
        device_placement: bool = True,
        non_blocking: bool | None = None,
        register_hooks: bool = True,
        name: str | None = None,
        commit_on_save: bool = True,
        log_every: int | None = None,
    ) -> None:
        rank, world = rank_and_world(accelerator)
        if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
            raise ConfigError(f"log_every must be a positive int (optimizer steps) or None, got {log_every!r}")
        ds_rank = getattr(dataset, "rank", rank)
        if ds_rank != rank:
            raise ConfigError(
                f"the dataset is rank {ds_rank}'s but this process is rank {rank} of {world}: build the loader with "
                "prepare_loader(accelerator, pipeline) or pipeline.dataset(rank=accelerator.process_index)"
            )
        pipeline = getattr(dataset, "pipeline", None)
        consumers = getattr(pipeline, "num_consumers", world)
        if consumers != world:
            raise ConfigError(
                f"the pipeline has {consumers} consumers but Accelerate runs {world} processes: build the pipeline "
                "with num_consumers=accelerator.num_processes (one consumer per data-parallel rank)"
            )
        steps = int(getattr(accelerator, "gradient_accumulation_steps", 1))
        if steps != 1:
            raise ConfigError(
                f"Accelerator(gradient_accumulation_steps={steps}): knitdata's plan decides the accumulation "
                "boundary (MicroBatchInfo.is_last) and losses are scaled by the mini-batch's global loss tokens; "
                "build the Accelerator with gradient_accumulation_steps=1 and use loader.accumulate(model, mb)"
            )
        if hasattr(dataset, "generator"):
            raise ConfigError(
                "the dataset has a 'generator' attribute, which Accelerate would try to synchronize across ranks; "
                "remove it (knitdata's plan order does not depend on a random generator)"
            )
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ConfigError(f"name must be a non-empty file name prefix or None, got {name!r}")
        if non_blocking is None:
            cfg = getattr(accelerator, "dataloader_config", None)
            non_blocking = bool(getattr(cfg, "non_blocking", False))
        self.dataset = dataset
        self.accelerator = accelerator
        self.rank = rank
        self.world = world
        self.device_placement = bool(device_placement)
        self.non_blocking = bool(non_blocking)
        self._auto_name = name is None
        self.name: str = STATE_FILE_PREFIX if name is None else name
        self.commit_on_save = bool(commit_on_save)
        self.log_every = log_every
        self._epoch = 0
        self._last_info: MicroBatchInfo | None = None
        self._handles: list[Any] = []
        if register_hooks:
            self.register_hooks()

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[MicroBatch]:
        """Yield this rank's micro-batches (on ``accelerator.device``), continuing from the current position."""
        from accelerate.utils import send_to_device

        device = self.accelerator.device
        for mb in self.dataset:
            if self.device_placement:
                mb = send_to_device(mb, device, non_blocking=self.non_blocking)
            info = self._last_info = getattr(mb, "info", None)
            if self.log_every is not None and info is not None and info.is_last and \
                    (info.minibatch + 1) % self.log_every == 0:
                log_metrics(self.accelerator, self.dataset, step=info.minibatch)
            yield mb

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch and pass it to the dataset (plan order does not depend on it)."""
        self._epoch = int(epoch)
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self._epoch)

    @property
    def last_info(self) -> MicroBatchInfo | None:
        """The :class:`~knitdata.consumer.collate.MicroBatchInfo` of the micro-batch last handed out."""
        return self._last_info

    def close(self) -> None:
        """Stop the dataset's active iterator (prefetch thread) and remove the checkpoint hooks."""
        close = getattr(self.dataset, "close", None)
        if close is not None:
            close()
        self.remove_hooks()

    # ------------------------------------------------------------------ gradient accumulation
    @contextlib.contextmanager
    def accumulate(self, model: Any, mb: MicroBatch | MicroBatchInfo) -> Iterator[None]:
        """Run one micro-batch's forward/backward with the plan's accumulation boundary.

        Sets ``accelerator.sync_gradients = info.is_last`` (so prepared optimizers and schedulers step
        only after the last micro-batch of the mini-batch) and, except on the last micro-batch, enters
        ``accelerator.no_sync(model)`` (no gradient all-reduce). Every rank has the same number of
        micro-batches per mini-batch (empty ones included), so the all-reduces of all ranks line up;
        a rank with an empty micro-batch must still run a (zero-loss) forward and backward.

        Args:
            model: The prepared model (or several, as a tuple/list).
            mb: The micro-batch, or its info.

        Raises:
            ValidationError: The micro-batch carries no :class:`~knitdata.consumer.collate.MicroBatchInfo`.
        """
        info = self._info(mb)
        models = model if isinstance(model, (tuple, list)) else (model,)
        self.accelerator.sync_gradients = bool(info.is_last)
        with contextlib.ExitStack() as stack:
            if not info.is_last:
                for m in models:
                    stack.enter_context(self.accelerator.no_sync(m))
            yield

    def loss_scale(self, mb: MicroBatch | MicroBatchInfo) -> float:
        """Factor turning a per-rank *sum* of per-token losses into the mini-batch's token mean.

        ``world / global_loss_tokens``: DDP averages gradients over ``world`` ranks, so summing
        ``loss_sum * loss_scale`` over the micro-batches of every rank gives the mean over all loss tokens
        of the mini-batch, whatever the split. Falls back to ``global_tokens`` when loss tokens are unknown.

        Raises:
            ValidationError: No info, or a mini-batch with no tokens at all.
        """
        info = self._info(mb)
        denom = info.global_loss_tokens or info.global_tokens
        if denom <= 0:
            raise ValidationError(
                f"mini-batch {info.minibatch} has no (loss) tokens; cannot scale its loss", field="global_loss_tokens"
            )
        return self.world / float(denom)

    @staticmethod
    def _info(mb: Any) -> MicroBatchInfo:
        info = getattr(mb, "info", mb)
        if info is None or not hasattr(info, "is_last"):
            raise ValidationError(
                "the micro-batch carries no MicroBatchInfo; iterate a knitdata TrajectoryDataset (its micro-batches "
                "have .info)",
                field="info",
            )
        return info

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state of this rank: the dataset's position plus rank, world and epoch."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "rank": self.rank,
            "world": self.world,
            "epoch": self._epoch,
            "last_info": None if self._last_info is None else self._last_info.to_dict(),
            "dataset": self.dataset.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same rank and world.

        Raises:
            StateError: Not a loader state, or one of another rank or world size.
        """
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise StateError(f"not a {_FORMAT} state: {state!r:.200}")
        if state.get("version") != _VERSION:
            raise StateError(f"unsupported {_FORMAT} state version {state.get('version')!r}; expected {_VERSION}")
        if state.get("rank") != self.rank or state.get("world") != self.world:
            raise StateError(
                f"loader state of rank {state.get('rank')} of {state.get('world')} loaded into rank {self.rank} of "
                f"{self.world}: resume with the same number of processes (each rank reads its own file)"
            )
        self.dataset.load_state_dict(state["dataset"])
        self._epoch = int(state.get("epoch", 0))
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self._epoch)
        last = state.get("last_info")
        if last is not None:
            from knitdata.consumer.collate import MicroBatchInfo

            self._last_info = MicroBatchInfo.from_dict(last)
        else:
            self._last_info = None

    def save_state(self, directory: str | os.PathLike[str]) -> Path:
        """Write this rank's state to ``<directory>/<name>_rank{rank}.json`` (atomically). Call it on every rank.

        Then, when the dataset has ``commit`` (knitdata's datasets do), commit that state: payloads before
        it are released from storage, and a restart from this checkpoint receives exactly what follows.

        Returns:
            The file written.
        """
        path = state_path(directory, self.rank, self.name)
        state = self.state_dict()
        _write_json_atomic(path, state)
        if self.commit_on_save:
            self.commit(state["dataset"])
        return path

    def commit(self, dataset_state: dict[str, Any] | None = None) -> int | None:
        """Release the payloads before ``dataset_state`` (default: the current position), where supported.

        Call it only once a checkpoint holding that state is durable: a restart from an older state would
        ask for released micro-batches.

        Returns:
            What the dataset's ``commit`` returns, or ``None`` when the dataset has no ``commit``.
        """
        commit = getattr(self.dataset, "commit", None)
        if commit is None:
            return None
        return commit(dataset_state if dataset_state is not None else self.dataset.state_dict())

    def load_state(self, directory: str | os.PathLike[str]) -> Path:
        """Read this rank's state from ``<directory>/<name>_rank{rank}.json``. Call it on every rank.

        A checkpoint written with another number of processes (another world size) is resumed onto this one:
        every rank's file there is read and their dataset states merged (:func:`knitdata.merge_rank_states`), and
        each rank loads the merged state (see "Resume onto another number of ranks" in the docs).

        Returns:
            The file read (the directory, for a checkpoint of another world size).

        Raises:
            StateError: The file is missing or not a valid state of this rank and world, or the files of a
                checkpoint of another world size do not form one complete set.
        """
        path = state_path(directory, self.rank, self.name)
        try:
            with open(path) as f:
                state = json.load(f)
        except FileNotFoundError as e:
            if any(Path(directory).glob(f"{self.name}_rank*.json")):  # fewer ranks saved it: merge theirs
                return self._load_reshaped(directory)
            raise StateError(
                f"no knitdata loader state for rank {self.rank} in {str(directory)!r} (expected {path.name}); was the "
                f"checkpoint written with {self.world} processes and an AcceleratedLoader on every rank? (Loaders "
                "without name= are numbered in the order they are built on the Accelerator: build them in the same "
                "order as the run that saved, or give each a name=.)"
            ) from e
        except json.JSONDecodeError as e:
            raise StateError(f"{path} is not valid JSON ({e}); the checkpoint is damaged") from e
        if isinstance(state, dict) and state.get("format") == _FORMAT and state.get("world") != self.world:
            return self._load_reshaped(directory)
        self.load_state_dict(state)
        return path

    def _load_reshaped(self, directory: str | os.PathLike[str]) -> Path:
        """A checkpoint of another world size: merge every rank's dataset state and load the merged one."""
        from knitdata.control.rankstates import merge_rank_states

        files = sorted(Path(directory).glob(f"{self.name}_rank*.json"))
        states = []
        for f in files:
            try:
                states.append(json.loads(f.read_text()))
            except json.JSONDecodeError as e:
                raise StateError(f"{f} is not valid JSON ({e}); the checkpoint is damaged") from e
        if any(not isinstance(s, dict) or s.get("format") != _FORMAT for s in states):
            raise StateError(f"{directory}: a {self.name}_rank*.json file is not a {_FORMAT} state")
        merged = merge_rank_states([s["dataset"] for s in states])
        self.dataset.load_state_dict(merged)
        self._epoch = max(int(s.get("epoch", 0)) for s in states)
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self._epoch)
        self._last_info = None
        return Path(directory)

    # ------------------------------------------------------------------ hooks
    def register_hooks(self) -> None:
        """Save/load this rank's state inside ``accelerator.save_state`` / ``load_state`` (idempotent).

        Takes this loader's state file name on the Accelerator (see ``name`` in :class:`AcceleratedLoader`).

        Raises:
            ConfigError: The accelerator has no save/load hooks, or another loader is hooked to it under this
                loader's explicit name.
        """
        if self._handles:
            return
        acc = self.accelerator
        if not hasattr(acc, "register_save_state_pre_hook"):
            raise ConfigError(
                f"{type(acc).__name__} has no register_save_state_pre_hook (accelerate >= 0.20 needed); call "
                "loader.save_state(dir) / loader.load_state(dir) next to accelerator.save_state / load_state instead"
            )
        taken = _hooked_names(acc)
        if self._auto_name:
            k, auto = 0, STATE_FILE_PREFIX
            while auto in taken:
                k += 1
                auto = f"{STATE_FILE_PREFIX}_{k}"
            self.name = auto
        elif self.name in taken:
            raise ConfigError(
                f"two loaders hooked to one Accelerator under name={self.name!r}: {taken[self.name]!r} is already "
                f"saved as {self.name}_rank{{r}}.json and this one would overwrite it in accelerator.save_state; give "
                "each loader its own name= (or leave name unset: loaders are then numbered in the order they are built)"
            )
        _name_table(acc)[self.name] = weakref.ref(self)

        def _save_hook(models: Any, weights: Any, output_dir: str) -> None:
            self.save_state(output_dir)

        def _load_hook(models: Any, input_dir: str) -> None:
            self.load_state(input_dir)

        self._handles = [acc.register_save_state_pre_hook(_save_hook), acc.register_load_state_pre_hook(_load_hook)]

    def remove_hooks(self) -> None:
        """Undo :meth:`register_hooks` (and free this loader's state file name on the Accelerator)."""
        for h in self._handles:
            h.remove()
        if self._handles:
            table = _name_table(self.accelerator)
            ref = table.get(self.name)
            if ref is not None and ref() is self:
                del table[self.name]
        self._handles = []

    def __repr__(self) -> str:
        return f"AcceleratedLoader(rank={self.rank}, world={self.world}, dataset={self.dataset!r})"


def prepare_loader(
    accelerator: Any,
    source: Any,
    *,
    device_placement: bool = True,
    non_blocking: bool | None = None,
    register_hooks: bool = True,
    name: str | None = None,
    log_every: int | None = None,
    **dataset_kwargs: Any,
) -> AcceleratedLoader:
    """Build this process's loader: the dataset of rank ``accelerator.process_index``, wrapped for Accelerate.

    Use it *instead of* passing a DataLoader to ``accelerator.prepare()``.

    Args:
        accelerator: The :class:`accelerate.Accelerator`.
        source: A :class:`~knitdata.pipeline.Pipeline` (or anything with ``dataset(rank, **kw)`` and
            ``num_consumers``, e.g. a Ray-engine client), or a factory ``source(rank, world) -> dataset``.
        device_placement: See :class:`AcceleratedLoader`.
        non_blocking: See :class:`AcceleratedLoader`.
        register_hooks: See :class:`AcceleratedLoader`.
        name: See :class:`AcceleratedLoader`: by default the loaders of one Accelerator are numbered in the order
            they are built (``knitdata_loader``, ``knitdata_loader_1``, ...), so a train and an eval loader keep
            distinct state files.
        log_every: See :class:`AcceleratedLoader`: log knitdata's metrics through ``accelerator.log`` every this
            many optimizer steps (build the Accelerator with ``log_with=...`` and call ``init_trackers`` first).
        **dataset_kwargs: Passed to ``source.dataset`` (``fetch``, ``prefetch_depth``, ``collate``...). With
            ``fetch="iter"`` on a CUDA accelerator, ``device`` defaults to ``accelerator.device`` (copies on
            the prefetch thread's side stream).

    Raises:
        ConfigError: The pipeline's consumer count differs from the number of processes, or another loader is
            hooked to this Accelerator under the same explicit ``name``.
    """
    rank, world = rank_and_world(accelerator)
    dataset_fn: Callable[..., Any] | None = getattr(source, "dataset", None)
    if dataset_fn is not None:
        consumers = getattr(source, "num_consumers", world)
        if consumers != world:
            raise ConfigError(
                f"the pipeline has {consumers} consumers but Accelerate runs {world} processes: build it with "
                "num_consumers=accelerator.num_processes"
            )
        device = getattr(accelerator, "device", None)
        if (
            dataset_kwargs.get("fetch", "iter") == "iter"
            and "device" not in dataset_kwargs
            and device is not None
            and getattr(device, "type", "cpu") == "cuda"
        ):
            dataset_kwargs["device"] = device
        dataset = dataset_fn(rank, **dataset_kwargs)
    elif callable(source):
        if dataset_kwargs:
            raise ConfigError(f"dataset options {sorted(dataset_kwargs)} only apply when source is a pipeline")
        dataset = source(rank, world)
    else:
        raise ConfigError(
            f"source must be a knitdata Pipeline (with .dataset(rank)) or a factory (rank, world) -> dataset, got "
            f"{type(source).__name__}"
        )
    return AcceleratedLoader(
        dataset,
        accelerator,
        device_placement=device_placement,
        non_blocking=non_blocking,
        register_hooks=register_hooks,
        name=name,
        log_every=log_every,
    )


def log_metrics(accelerator: Any, dataset: Any, step: int | None = None, *, main_process_only: bool = True,
                **metrics_kwargs: Any) -> dict[str, float | int]:
    """Log a rank's knitdata figures through ``accelerator.log`` (TensorBoard, Weights & Biases, ... trackers).

    The figures are the dataset's ``step_metrics()`` (:meth:`knitdata.consumer.dataset.TrajectoryDataset.step_metrics`):
    flat keys under ``knitdata/`` (staleness, exposed data wait, bytes, admission delay, store fill, spills, what a
    staleness bound dropped). ``accelerator.log`` writes on the main process only, so by default the other ranks
    skip the control-plane call and return ``{}``.

    Args:
        accelerator: The :class:`accelerate.Accelerator` (its trackers set up with ``log_with`` and
            ``init_trackers``).
        dataset: The rank's :class:`~knitdata.consumer.dataset.TrajectoryDataset`, or an :class:`AcceleratedLoader`.
        step: The step to log at (the optimizer step; e.g. ``mb.info.minibatch``).
        main_process_only: Only the main process reads and logs the figures.
        **metrics_kwargs: Passed to ``step_metrics`` (``flush``, ``units``, ``prefix``).

    Returns:
        What was logged (``{}`` on the other processes).

    Raises:
        ConfigError: The dataset has no ``step_metrics`` (not a knitdata dataset).
    """
    ds = getattr(dataset, "dataset", dataset) if isinstance(dataset, AcceleratedLoader) else dataset
    fn = getattr(ds, "step_metrics", None)
    if fn is None:
        raise ConfigError(f"{type(ds).__name__} has no step_metrics(): pass a knitdata TrajectoryDataset or an "
                          "AcceleratedLoader")
    if main_process_only and not bool(getattr(accelerator, "is_main_process", True)):
        return {}
    values: dict[str, float | int] = fn(**metrics_kwargs)
    accelerator.log(values, step=step)
    return values
