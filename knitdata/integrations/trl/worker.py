"""A rollout worker for TRL's ``AsyncGRPOTrainer`` whose samples come from a knitdata pipeline.

``trl.experimental.async_grpo.AsyncGRPOTrainer(rollout_worker=...)`` (TRL 1.16) takes any object with a
``rollout_buffer`` queue of ``RolloutSample`` objects, a ``metrics_queue`` and ``start`` / ``stop`` /
``update_model_version`` / ``check_health``. The trainer (rank 0, ``dispatch_batches=True``) reads the queue one
sample at a time, drops a sample when ``model_version - sample.model_version > max_staleness``, and with
``token_budget=0`` (its ``FixedCountBatcher``) cuts micro-batches of ``per_device_train_batch_size x world`` samples
in queue order; ``gradient_accumulation_steps`` of them make one optimizer step.

:class:`KnitdataRolloutWorker` runs two threads beside the trainer:

* the **producer** takes prompts from several sources, generates ``group_size`` responses per prompt on a
  generation engine (:class:`~knitdata.integrations.trl.engine.HFGenerationEngine` or your own) in chunks of
  ``chunk_tokens``; a response cut by a chunk boundary is an aborted segment, continued with the engine's newest
  weights (:class:`knitdata.rollout.SegmentBuffer`: each token keeps the version that made it), scores finished
  groups with TRL-style reward functions, and puts them into a :class:`knitdata.Pipeline` whose quotas,
  ``max_staleness`` (TRL's, read from the trainer's arguments) and ``version_offset`` (TRL's version at train
  begin) are set so that knitdata's mini-batch ``t`` is TRL's optimizer step ``t``;
* the **feeder** hands each admitted mini-batch to the trainer's queue, in order, at most one step ahead of the
  trainer (the trainer's data loader reads one micro-batch ahead).

So every optimizer step holds exactly each source's quota share, and no sample is older than ``max_staleness`` of
TRL's model versions when the step that trains it runs (knitdata admits nothing staler), so TRL never drops one
and its batch boundaries stay knitdata's. :attr:`KnitdataRolloutWorker.callback` (pass it in ``callbacks=``)
checks the trainer's arguments at train begin, writes the worker's state (the prompts trained so far, per source)
into each checkpoint folder TRL saves, and loads it when ``train(resume_from_checkpoint=...)`` resumes: prompts
trained before the checkpoint are not generated again, every other one is (nothing trained twice, none lost).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, cast

import numpy as np
from transformers import TrainerCallback
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from knitdata.admission import BatchSpec
from knitdata.errors import ConfigError, PipelineClosedError, RolloutThrottled, StateError
from knitdata.pipeline import Pipeline
from knitdata.record import Trajectory
from knitdata.rollout import RolloutGroup, SegmentBuffer

_log = logging.getLogger(__name__)

__all__ = ["GenerationEngine", "StepRecord", "KnitdataRolloutWorker", "KnitdataTRLCallback", "STATE_FILE",
           "trained_prompts"]

#: The worker's state file in each of TRL's ``checkpoint-N`` folders.
STATE_FILE = "knitdata_trl_worker.json"
_FORMAT = "knitdata-trl-worker/1"
RewardFunc = Callable[..., Sequence[float | None]]


class GenerationEngine(Protocol):
    """What the worker generates with (e.g. :class:`~knitdata.integrations.trl.engine.HFGenerationEngine`)."""

    version: int  # TRL's model_version of the weights the engine holds

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, max_new_tokens: int,
                 request_ids: Sequence[str]) -> list[RolloutGroup]:
        """``n`` samples per prompt, each tagged with the version of the weights that made it."""
        ...


@dataclass
class StepRecord:
    """One optimizer step as the trainer read it from the worker's queue.

    Attributes:
        step: TRL's ``global_step`` after this step (1-based).
        trajectory_ids: Its samples, in the order the trainer read them.
        per_source: Samples per source.
        trained_version: TRL's ``model_version`` while the step trains (weights before the step).
        gen_versions: Each sample's oldest token version (its ``model_version`` in TRL).
        read_versions: TRL's version when each sample was read (TRL's drop check uses it).
        token_version_spans: Per sample, its newest minus its oldest token version (> 0: a partial rollout
            continued across weight updates).
    """

    step: int
    trajectory_ids: list[str] = field(default_factory=list)
    per_source: dict[str, int] = field(default_factory=dict)
    trained_version: int = 0
    gen_versions: list[int] = field(default_factory=list)
    read_versions: list[int] = field(default_factory=list)
    token_version_spans: list[int] = field(default_factory=list)

    @property
    def max_staleness(self) -> int:
        """The stalest sample of the step, in TRL's versions, when the step trains."""
        return max((self.trained_version - v for v in self.gen_versions), default=0)


def trained_prompts(state: Mapping[str, Any]) -> dict[str, list[int]]:
    """The prompt indices per source a saved worker state (:data:`STATE_FILE`) records as trained."""
    return {s: list(range(int(d["below"]))) + [int(i) for i in d["extra"]] for s, d in state["trained"].items()}


def _compact(indices: set[int]) -> dict[str, Any]:
    below = 0
    while below in indices:
        below += 1
    return {"below": below, "extra": sorted(i for i in indices if i > below)}


class _FeedQueue(queue.Queue):  # type: ignore[type-arg]
    """The trainer's ``rollout_buffer``: records each sample the trainer takes, in order."""

    def __init__(self, on_read: Callable[[Any], None]) -> None:
        super().__init__()
        self._on_read = on_read

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        self._on_read(item)
        return item


class KnitdataTRLCallback(TrainerCallback):
    """Checks the trainer's arguments, and saves / loads the worker's state with TRL's checkpoints."""

    def __init__(self, worker: KnitdataRolloutWorker) -> None:
        self.worker = worker

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.worker.configure(args, state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.worker.raise_if_failed()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            self.worker.save_state(folder, state.global_step)


class KnitdataRolloutWorker:
    """TRL's ``rollout_worker`` protocol on a knitdata pipeline (see the module docstring).

    Args:
        spec: Quotas per source per train batch, mini-batches (optimizer steps) per train batch, and
            ``group_size`` (responses per prompt: TRL's ``num_generations``).
        sources: Per source, its prompts: token id lists, strings (tokenized with ``processing_class``) or
            dataset rows with a ``"prompt"`` (the other columns reach the reward functions). Cycled when used up.
        engine: Generates (``version``, ``generate``); :class:`~knitdata.integrations.trl.engine.HFGenerationEngine`
            is also the trainer's ``weight_transfer``.
        reward_funcs: TRL-style reward functions ``f(prompts, completions, completion_ids, source, **columns)``
            returning one float (or ``None``; NaN counts as ``None``, as in TRL) per completion; summed.
        processing_class: Tokenizer (string prompts, decoded completions for the reward functions).
        max_new_tokens: Longest response.
        chunk_tokens: Tokens per generation round: a response still running at a round's end is continued in the
            next round with the engine's newest weights (a partial rollout). Default ``max_new_tokens``.
        max_groups_in_flight: Most prompts generating at once (default two mini-batches' worth).
        on_stale: knitdata's ``on_stale``: ``"wait"`` throttles prompt starts to the bound, ``"drop"`` regenerates
            groups the bound dropped.
        token_budget: knitdata's micro-batch token budget (the longest prompt + response must fit).
        timeout_s: Most seconds a thread waits for the trainer or the pipeline.
    """

    def __init__(self, spec: BatchSpec, sources: Mapping[str, Sequence[Any]], engine: GenerationEngine,
                 reward_funcs: RewardFunc | Sequence[RewardFunc], *, processing_class: Any = None,
                 max_new_tokens: int = 32, chunk_tokens: int | None = None, max_groups_in_flight: int | None = None,
                 on_stale: str = "wait", token_budget: int = 8192, timeout_s: float = 600.0) -> None:
        if not isinstance(spec, BatchSpec):
            raise ConfigError(f"spec must be a knitdata BatchSpec, got {type(spec).__name__}")
        if set(sources) != set(spec.quotas):
            raise ConfigError(f"sources {sorted(sources)} differ from the spec's quotas {sorted(spec.quotas)}")
        for s, prompts in sources.items():
            if len(prompts) == 0:
                raise ConfigError(f"source {s!r} has no prompts")
        funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
        if not funcs or not all(callable(f) for f in funcs):
            raise ConfigError("reward_funcs must be a callable or a non-empty list of callables")
        if max_new_tokens < 1 or (chunk_tokens is not None and chunk_tokens < 1):
            raise ConfigError(f"max_new_tokens and chunk_tokens must be >= 1, got {max_new_tokens}, {chunk_tokens}")
        if on_stale not in ("wait", "drop"):
            raise ConfigError(f"on_stale must be 'wait' or 'drop', got {on_stale!r}")
        self.spec, self.sources, self.engine, self.reward_funcs = spec, dict(sources), engine, funcs
        self.processing_class = processing_class
        self.max_new_tokens, self.chunk_tokens = int(max_new_tokens), int(chunk_tokens or max_new_tokens)
        self.minibatch_size = spec.minibatch_size
        self.max_groups_in_flight = max_groups_in_flight or max(1, 2 * self.minibatch_size // spec.group_size)
        self.on_stale, self.token_budget, self.timeout_s = on_stale, int(token_budget), float(timeout_s)
        #: The queue the trainer drains (TRL's ``rollout_buffer``).
        self.rollout_buffer: queue.Queue[Any] = _FeedQueue(self._on_read)
        #: Per-step figures for the trainer's log (TRL's ``metrics_queue``).
        self.metrics_queue: queue.Queue[Any] = queue.Queue()
        #: Pass it to the trainer: ``AsyncGRPOTrainer(..., callbacks=[worker.callback])``.
        self.callback = KnitdataTRLCallback(self)
        #: One record per optimizer step of this run, in order (what the trainer read; see :class:`StepRecord`). The
        #: last may be partial: a step TRL's loader started reading ahead (after ``train()``: one that never trained).
        self.history: list[StepRecord] = []
        #: The pipeline (made by :meth:`start`).
        self.pipeline: Pipeline | None = None
        self.max_staleness: int | None = None
        self.dropped_by_trainer = 0  # samples TRL's staleness check would drop (kept 0 by the bound)
        #: What :meth:`stop` found stored but never admitted (``Pipeline.close``'s report: ``dropped_trajectories``,
        #: ``dropped_groups``, ``by_source``): the groups generated ahead of the last step; ``None`` before it.
        self.closed_report: dict[str, Any] | None = None
        self._cond = threading.Condition()
        self._version = 0
        self._version0 = 0
        self._start_step = 0
        self._trained: dict[str, set[int]] = {s: set() for s in spec.quotas}
        self._loaded_from: str | None = None
        self._state_to_load: str | None = None
        self._configured = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._last_progress = time.monotonic()
        self._group_ids: dict[str, int] = {}
        self._group_prompt: dict[str, tuple[str, int]] = {}  # knitdata group -> (source, prompt index)
        self._traj_meta: dict[str, tuple[str, int, int]] = {}  # trajectory id -> (source, prompt, token span)
        self._reads: list[str] = []
        self._sample_ids: dict[int, str] = {}  # id(RolloutSample in the queue) -> trajectory id
        self._trajectory_group: dict[str, int] = {}

    # ------------------------------------------------------------------ setup (the callback)
    def load_state(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        """Resume from the worker state in ``checkpoint_dir`` (the callback does it when TRL resumes from
        ``<output_dir>/checkpoint-<step>``; call this for a checkpoint elsewhere), before ``trainer.train``."""
        self._state_to_load = os.fspath(checkpoint_dir)

    def configure(self, args: Any, state: Any) -> None:
        """Check the trainer's arguments against the spec; load the state of the checkpoint TRL resumes from.

        Raises:
            ConfigError: A setting that would break the step boundaries or the bound (the message names it).
            StateError: Resuming without the worker's state, or a state of another spec; the worker was stopped (a
                second ``train()``: TRL starts its rollout worker once per trainer).
        """
        self._check_not_stopped()
        world = int(getattr(args, "world_size", 1) or 1)
        per_step = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps) * world
        problems = []
        if per_step != self.minibatch_size:
            problems.append(f"per_device_train_batch_size x gradient_accumulation_steps x world = {per_step} "
                            f"samples per optimizer step, but the spec's mini-batch holds {self.minibatch_size}")
        if args.token_budget != 0:
            problems.append(f"token_budget={args.token_budget}: set token_budget=0 (TRL's fixed-count batcher keeps "
                            f"knitdata's step boundaries; the token-budget batcher cuts elsewhere)")
        if int(args.weight_sync_steps) != 1:
            problems.append(f"weight_sync_steps={args.weight_sync_steps}: the bound counts one TRL version per step; "
                            f"set weight_sync_steps=1")
        if int(args.max_staleness) < 1:
            problems.append(f"max_staleness={args.max_staleness}: TRL's data loader reads a step's first samples "
                            f"before the previous step's weights exist, so a bound of 0 waits forever; set "
                            f"max_staleness >= 1")
        if int(args.num_generations) != self.spec.group_size:
            problems.append(f"num_generations={args.num_generations} differs from the spec's group_size "
                            f"{self.spec.group_size}")
        if problems:
            raise ConfigError("AsyncGRPOConfig does not fit the knitdata worker: " + "; ".join(problems))
        self.max_staleness = int(args.max_staleness)
        self._start_step = int(state.global_step)
        path = self._state_to_load
        if path is None and self._start_step > 0:
            path = os.path.join(args.output_dir, f"checkpoint-{self._start_step}")
        if path is not None:
            self._load(os.path.join(path, STATE_FILE), self._start_step)
        self._configured = True

    def _check_not_stopped(self) -> None:
        if self._stop.is_set():  # TRL starts its rollout worker once per trainer, and stops it at the end of train()
            raise StateError("this KnitdataRolloutWorker ran a train() and was stopped: build a new trainer with a new "
                             "KnitdataRolloutWorker (and a fresh engine) for each train() call, as for a resume")

    def _load(self, file: str, step: int) -> None:
        try:
            with open(file, encoding="utf-8") as f:
                state = json.load(f)
        except FileNotFoundError:
            raise StateError(f"resuming at step {step} but {file} is missing: the checkpoint was not saved with "
                             f"the worker's callback (AsyncGRPOTrainer(..., callbacks=[worker.callback]))") from None
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise StateError(f"{file} is not a knitdata TRL worker state (format {_FORMAT!r})")
        if state["spec"] != self.spec.to_dict():
            raise StateError(f"{file} was saved with spec {state['spec']}, this worker has {self.spec.to_dict()}")
        if int(state["global_step"]) != step:
            raise StateError(f"{file} is the state after step {state['global_step']}, the trainer resumes at {step}")
        self._trained = {s: set(v) for s, v in trained_prompts(state).items()}
        self._loaded_from = file

    def save_state(self, folder: str, global_step: int) -> str:
        """Write the worker's state after ``global_step`` into ``folder`` (atomically); returns the file."""
        done = {s: set(v) for s, v in self._trained.items()}
        for rec in self.history:
            if rec.step <= global_step:
                for tid in rec.trajectory_ids:
                    source, index, _ = self._traj_meta[tid]
                    done[source].add(index)
        if global_step - self._start_step > sum(1 for r in self.history if r.step <= global_step):
            raise StateError(f"saving after step {global_step} but the worker recorded only "
                             f"{len(self.history)} steps since step {self._start_step}")
        state = {"format": _FORMAT, "global_step": int(global_step), "spec": self.spec.to_dict(),
                 "trained": {s: _compact(v) for s, v in done.items()}}
        os.makedirs(folder, exist_ok=True)
        file = os.path.join(folder, STATE_FILE)
        tmp = file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
        return file

    # ------------------------------------------------------------------ TRL's RolloutWorkerProtocol
    def start(self) -> None:
        """Build the pipeline at TRL's current version and start the producer and feeder threads.

        Raises:
            StateError: The worker was stopped (it ran a ``train()``): it runs once; build a new one per run.
            ConfigError: The worker's callback was not given to the trainer.
        """
        self._check_not_stopped()
        if not self._configured or self.max_staleness is None:
            raise ConfigError("the worker's callback did not run: AsyncGRPOTrainer(..., callbacks=[worker.callback])")
        if getattr(self.engine, "version", self._version) != self._version:
            raise StateError(f"the engine holds weights version {self.engine.version} but TRL's model_version is "
                             f"{self._version}: use the engine as the trainer's weight_transfer, fresh per run")
        self._version0 = self._version
        self.pipeline = Pipeline(self.spec, num_consumers=1, max_staleness=self.max_staleness, on_stale=self.on_stale,
                                 admission_options={"version_offset": self._version0}, release="handout",
                                 token_budget=self.token_budget, put_timeout=self.timeout_s, producer_timeout_s=None)
        self.pipeline.report_version(self._version0)
        self._threads = [threading.Thread(target=self._guard, args=(self._produce,), name="knitdata-trl-producer",
                                          daemon=True),
                         threading.Thread(target=self._guard, args=(self._feed,), name="knitdata-trl-feeder",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop both threads and shut the pipeline down. Idempotent. TRL calls it when ``train()`` ends: the groups
        generated ahead of the last step are never admitted by design, so it does not warn about them (a thread's
        failure does); they are in :attr:`closed_report` and an INFO log."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self.pipeline is not None:
            report = self.pipeline.close(warn=self._error is not None)
            if self.closed_report is None:
                self.closed_report = report
                _log.info("knitdata rollout worker stopped with %s trajectories generated ahead, never admitted "
                          "(by source %s)", report.get("dropped_trajectories", 0), report.get("by_source", {}))
        for t in self._threads:
            t.join(timeout=30)
        if self.pipeline is not None:
            self.pipeline.shutdown()

    def update_model_version(self, model_version: int) -> None:
        """TRL's weight sync finished: report the version to the pipeline and let the feeder advance."""
        with self._cond:
            self._version = int(model_version)
            self._cond.notify_all()
        if self.pipeline is not None and not self._stop.is_set():
            self.pipeline.report_version(int(model_version))

    def check_health(self, stale_after_s: float) -> None:
        """Raise the error a worker thread died of, or a StateError when none progressed for ``stale_after_s``."""
        self.raise_if_failed()
        idle = time.monotonic() - self._last_progress
        if self._threads and idle > stale_after_s:
            raise StateError(f"the knitdata worker produced nothing for {idle:.0f} s (> {stale_after_s} s); "
                             f"admission waits for {self.pipeline.internals.control.reporting.missing() if self.pipeline else '?'}")

    def raise_if_failed(self) -> None:
        """Raise what a worker thread failed with, or a StateError if TRL would have dropped a sample."""
        if self._error is not None:
            raise StateError(f"the knitdata rollout worker failed: {self._error!r}") from self._error
        if self.dropped_by_trainer:
            raise StateError(f"TRL dropped {self.dropped_by_trainer} samples as staler than max_staleness="
                             f"{self.max_staleness}: step boundaries no longer match knitdata's mini-batches")

    # ------------------------------------------------------------------ threads
    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except PipelineClosedError:
            if not self._stop.is_set():
                self._error = self._error or StateError("the pipeline closed while the trainer was running")
        except BaseException as e:  # noqa: BLE001 - raised in the trainer's thread by check_health / on_step_end
            if not self._stop.is_set():
                self._error = self._error or e
                if self.pipeline is not None:
                    self.pipeline.close()

    def _produce(self) -> None:
        buffer, starts = SegmentBuffer(), _PromptOrder(self)
        while not self._stop.is_set():
            worked = False
            for d in self.pipeline.dropped() if self.pipeline is not None else []:
                buffer.discard(d["group"])
                starts.requeue(*self._group_prompt.pop(d["group"]))
            pending = buffer.pending()
            if pending:  # continue aborted samples with the newest weights
                budget = min(self.chunk_tokens, min(self.max_new_tokens - c.generated for c in pending))
                groups = self.engine.generate([c.input_ids for c in pending], n=1, max_new_tokens=budget,
                                              request_ids=[c.request_id for c in pending])
                for c, g in zip(pending, groups):
                    seg = _mark_aborted(g, c.generated, self.max_new_tokens).samples[0]
                    done = buffer.add(seg, request_id=c.request_id, index=c.index)
                    if done is not None:
                        self._put(done)
                worked = True
            new = starts.take(self.max_groups_in_flight - len(buffer), self.engine.version)
            if new:
                groups = self.engine.generate([p for _, p in new], n=self.spec.group_size,
                                              max_new_tokens=min(self.chunk_tokens, self.max_new_tokens),
                                              request_ids=[rid for rid, _ in new])
                for g in groups:
                    done = buffer.add_group(_mark_aborted(g, 0, self.max_new_tokens))
                    if done is not None:
                        self._put(done)
                worked = True
            if worked:
                self._last_progress = time.monotonic()
            else:
                with self._cond:
                    self._cond.wait(0.02)

    def _put(self, group: RolloutGroup) -> None:
        source, index = self._group_prompt[group.request_id]
        row = self.sources[source][index % len(self.sources[source])]
        prompt_text, columns = _prompt_and_columns(row, self.processing_class)
        n = len(group.samples)
        completion_ids = [s.response_ids.tolist() for s in group.samples]
        completions = (self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
                       if self.processing_class is not None else [None] * n)
        total = np.zeros(n)
        scored = np.zeros(n, dtype=bool)
        for f in self.reward_funcs:
            out = f(prompts=[prompt_text] * n, completions=completions, completion_ids=completion_ids,
                    source=[source] * n, **{k: [v] * n for k, v in columns.items()})
            if len(out) != n:
                raise ConfigError(f"reward function {getattr(f, '__name__', f)!r} returned {len(out)} rewards for "
                                  f"the {n} completions of group {group.request_id!r}")
            for i, r in enumerate(out):
                if r is not None and not math.isnan(r):  # NaN is None, as in TRL's worker (nansum)
                    total[i] += float(r)
                    scored[i] = True
        rewards = np.where(scored, total, np.nan)
        adv = np.zeros(n)
        if scored.any():  # TRL's advantage: (r - mean) / (std + 1e-8) over the scorable samples of the group
            s = rewards[scored]
            adv[scored] = (s - s.mean()) / (s.std() + 1e-8)
        scalars = [{"reward": float(r) if not math.isnan(r) else 0.0, "advantage": float(a)}
                   for r, a in zip(rewards, adv)]
        trajs = group.trajectories(source, scalars=scalars)
        for t in trajs:
            tv = t.token_versions
            span = 0 if tv is None or tv.numel() == 0 else int(tv.max()) - int(tv.min())
            self._traj_meta[t.id] = (source, index, span)
        newest = max(int(t.token_versions.max()) if t.token_versions is not None and t.token_versions.numel()
                     else int(t.gen_version) for t in trajs)
        self._await_reported(newest)
        assert self.pipeline is not None
        self.pipeline.put_many(trajs)

    def _await_reported(self, version: int) -> None:
        """Wait until the pipeline heard of ``version``: the engine holds new weights from ``send_weights`` on, a
        moment before TRL counts the sync and calls :meth:`update_model_version` (whose report is sent by a thread)."""
        assert self.pipeline is not None
        deadline = time.monotonic() + self.timeout_s
        while self.pipeline.version < version and not self._stop.is_set():
            if time.monotonic() > deadline:
                raise StateError(f"a group generated with weights version {version} waited {self.timeout_s} s for "
                                 f"TRL to report that version (the pipeline has {self.pipeline.version}): use the "
                                 f"engine as the trainer's weight_transfer")
            time.sleep(0.002)

    def _feed(self) -> None:
        assert self.pipeline is not None
        ds = self.pipeline.dataset(0, fetch="eager", collate=_keep, timeout=self.timeout_s)
        for item in ds:
            trajs, info = cast(tuple[list[Trajectory], Any], item)  # what _keep returned
            step = int(info.minibatch)
            need = self._version0 + step - 1
            with self._cond:  # at most one step ahead of the trainer (its loader reads one micro-batch ahead)
                ok = self._cond.wait_for(partial(self._reached, need), timeout=self.timeout_s)
            if self._stop.is_set():
                return
            if not ok:
                raise StateError(f"mini-batch {step} waited {self.timeout_s} s for the trainer to reach version "
                                 f"{need} (it is at {self._version})")
            for t in trajs:
                self.rollout_buffer.put(self._to_trl(t))
            self._last_progress = time.monotonic()

    def _reached(self, version: int) -> bool:
        return self._stop.is_set() or self._version >= version

    def _to_trl(self, t: Trajectory) -> RolloutSample:
        p, r = t.prompt_ids.numpy(), t.response_ids.numpy()
        mask = np.ones(len(r), dtype=np.int64) if t.loss_mask is None else (t.loss_mask.numpy() != 0).astype(np.int64)
        logps = t.tensors["old_logprobs"].float().numpy()
        gid = self._group_ids.setdefault(t.group, len(self._group_ids))
        sample = RolloutSample(
            prompt=[], completion=[], input_ids=np.concatenate([p, r]),
            completion_mask=np.concatenate([np.zeros(len(p), dtype=np.int64), mask]),
            old_log_probs=np.concatenate([np.zeros(len(p), dtype=np.float32), logps]),
            advantage=float(t.scalars["advantage"]), model_version=int(t.gen_version), group_id=gid,
            metrics={"reward": t.scalars["reward"], f"knitdata/reward/{t.source}": t.scalars["reward"]},
            enqueued_at=time.time())
        self._sample_ids[id(sample)] = t.id
        self._trajectory_group[t.id] = gid
        return sample

    def group_id(self, trajectory_id: str) -> int:
        """The ``group_id`` TRL saw for a trajectory handed to the trainer (``KeyError`` if none was)."""
        return self._trajectory_group[trajectory_id]

    def _on_read(self, sample: Any) -> None:
        """The trainer took ``sample`` (in TRL's RolloutQueueDataset, on its thread)."""
        index = len(self._reads)
        tid = self._sample_ids.pop(id(sample))
        self._reads.append(tid)
        if self._version - sample.model_version > (self.max_staleness or 0):
            self.dropped_by_trainer += 1
        j = index // self.minibatch_size
        if j == len(self.history):
            self.history.append(StepRecord(step=self._start_step + j + 1, trained_version=self._version0 + j))
        rec = self.history[j]
        rec.trajectory_ids.append(tid)
        source, _, span = self._traj_meta[tid]
        rec.per_source[source] = rec.per_source.get(source, 0) + 1
        rec.token_version_spans.append(span)
        rec.gen_versions.append(int(sample.model_version))
        rec.read_versions.append(self._version)
        if len(rec.trajectory_ids) == self.minibatch_size:
            self.metrics_queue.put({"knitdata/staleness_max": float(rec.max_staleness),
                                    **{f"knitdata/share/{s}": c / self.minibatch_size
                                       for s, c in rec.per_source.items()}})

class _PromptOrder:
    """Which prompt starts next: the source furthest behind its quota share; the lowest untrained index."""

    def __init__(self, worker: KnitdataRolloutWorker) -> None:
        self.w = worker
        self.next = {s: 0 for s in worker.spec.quotas}
        self.started = {s: 0 for s in worker.spec.quotas}
        self.again: dict[str, deque[int]] = {s: deque() for s in worker.spec.quotas}
        self.attempt: dict[tuple[str, int], int] = {}

    def requeue(self, source: str, index: int) -> None:
        self.again[source].append(index)

    def _index(self, source: str) -> int:
        if self.again[source]:
            return self.again[source].popleft()
        while self.next[source] in self.w._trained[source]:
            self.next[source] += 1
        self.next[source] += 1
        return self.next[source] - 1

    def take(self, room: int, version: int) -> list[tuple[str, list[int]]]:
        out: list[tuple[str, list[int]]] = []
        pipe, quotas = self.w.pipeline, self.w.spec.quotas
        blocked: set[str] = set()
        while len(out) < room and pipe is not None:
            open_ = [s for s in quotas if s not in blocked]
            if not open_:
                break
            source = min(open_, key=lambda s: (self.started[s] / quotas[s], s))
            try:
                pipe.acquire_rollout({source: 1}, version=version, timeout=0)
            except RolloutThrottled:
                blocked.add(source)
                continue
            index = self._index(source)
            attempt = self.attempt[(source, index)] = self.attempt.get((source, index), -1) + 1
            rid = f"{source}-p{index}-a{attempt}"
            self.w._group_prompt[rid] = (source, index)
            self.started[source] += 1
            row = self.w.sources[source][index % len(self.w.sources[source])]
            out.append((rid, _prompt_ids(row, self.w.processing_class)))
        return out


def _keep(trajectories: Sequence[Trajectory], info: Any) -> tuple[list[Trajectory], Any]:
    return list(trajectories), info


def _mark_aborted(group: RolloutGroup, generated_before: int, max_new: int) -> RolloutGroup:
    """A response cut by the round's token budget, short of ``max_new``, is an aborted segment to continue."""
    samples = [s if not (s.status == "truncated" and generated_before + s.response_ids.numel() < max_new)
               else _aborted(s) for s in group.samples]
    return RolloutGroup(group.request_id, samples)


def _aborted(sample: Any) -> Any:
    import dataclasses

    return dataclasses.replace(sample, status="aborted", finish_reason="abort")


def _prompt_and_columns(row: Any, tokenizer: Any) -> tuple[Any, dict[str, Any]]:
    if isinstance(row, Mapping):
        return row["prompt"], {k: v for k, v in row.items() if k != "prompt"}
    return row, {}


def _prompt_ids(row: Any, tokenizer: Any) -> list[int]:
    prompt, _ = _prompt_and_columns(row, tokenizer)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError("string prompts need processing_class= (a tokenizer)")
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], Mapping):
        if tokenizer is None:
            raise ConfigError("conversational prompts need processing_class= (a tokenizer with a chat template)")
        return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
    try:
        return [int(x) for x in prompt]
    except (TypeError, ValueError):
        raise ConfigError(f"a prompt must be token ids, a string or chat messages, got {type(prompt).__name__}") from None
