"""A sampler for verl's V1 trainer: per-source quotas and a hard staleness bound (extra: ``knitdata[verl]``).

verl 0.9's V1 trainer (``trainer.use_v1=true``) keeps rollouts in TransferQueue, a key-value store, and asks a
*sampler* for each mini-batch: ``sample(global_steps, partition_id, batch_size) -> (KVBatchMeta, metrics)``. Its
own sampler takes the oldest finished groups whatever their data source, so a slow-generating dataset can fall to
zero share. :class:`KnitdataSampler` is a drop-in replacement, named by three overrides of verl's command line
(``docs/verl.md`` has the same as YAML)::

    trainer.v1.sampler.custom_sampler.path=pkg://knitdata.integrations.verl
    trainer.v1.sampler.custom_sampler.name=KnitdataSampler
    '+trainer.v1.sampler.sampler_kwargs.quotas={math: 48, code: 16}'

On each call it lists the store (``kv_list``), reads the ``data_source`` of each newly finished group (one
``kv_batch_get`` per call, of one trajectory per group) and offers the groups to a knitdata admission policy
(:class:`~knitdata.admission.ConstraintPreservingAdmission` by default): every train batch of
``data.train_batch_size`` prompt groups holds exactly ``quotas[s]`` groups of each source ``s``, cut into
``parameter_sync_step`` mini-batches by knitdata's exact feasibility check, and surplus groups wait for a later
step. The staleness bound is verl's own: with ``max_off_policy_threshold = T`` a group dispatched at global step
``P`` is trained at global step ``G`` only if ``G - P + 1 <= T``. In knitdata's count (one version per mini-batch)
that is ``max_staleness = T * M - 1`` with a group's version ``P * M`` (``M = parameter_sync_step``), so knitdata's
bound drops exactly the groups verl's would. ``max_off_policy_strategy`` maps to knitdata's ``on_stale``:

- ``drop``: a finished group past the bound is removed from the store (``kv_clear``) and ``refill_fn`` dispatches
  that many fresh prompts, as verl's async sampler does;
- ``wait``: as verl's ``wait``, admission of a new mini-batch waits while a group still generating is at its last
  admissible global step, so that it can finish and be trained; the bound still drops what expires anyway.

Nothing is delivered twice: a delivered group's prompt key is cleared at once (as verl's sampler does; the trainer
clears the trajectories after the step). Nothing is lost: a group stays in the store until it is delivered or
dropped, and the sampler keeps no state that TransferQueue does not hold between global steps, so verl's own
checkpoint (``tq.save_checkpoint``) resumes it: a new sampler over the restored store continues with the same
quotas. Groups whose rollout failed are cleared and refilled, as verl's async sampler does.

What verl's public sampler interface does not allow: ``refill_fn`` dispatches the *next* dataloader prompts, so
a dropped group is replaced by whatever source comes next, not by its own prompt; generating a given prompt again
exists only as the trainer's private ``_reissue_inflight_prompts``. ``sampler_kwargs.regenerate=same_prompt`` opts
into :func:`reissue`, a copy of that method's few lines for the dropped groups (checked against the pinned verl's
source by the tests); the default stays on the public ``refill_fn``. And the trainer never asks a custom sampler
for its state (``_save_checkpoint`` saves TransferQueue only), which is why this sampler keeps none of its own
across global steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from knitdata.admission import AdmissionPolicy, AdmittedMiniBatch, BatchSpec, make_policy
from knitdata.errors import ConfigError, DataTimeoutError, OptionalDependencyError, StateError, ValidationError
from knitdata.record import TrajectoryMeta

__all__ = ["KnitdataSampler", "SAMPLER_KWARGS", "reissue", "staleness_in_minibatches"]

#: The keys of ``trainer.v1.sampler.sampler_kwargs`` this sampler reads, with their defaults (``quotas`` required).
SAMPLER_KWARGS: dict[str, Any] = {
    "quotas": None,
    "bounds": None,
    "policy": "constraint_preserving",
    "source_field": "data_source",
    "refill_multiple": None,
    "poll_interval": None,
    "timeout_s": 3600.0,
    "regenerate": "refill",
}

_TERMINAL = ("finished", "failure")
_STATUSES = ("pending", "running", "finished", "failure")


def staleness_in_minibatches(max_off_policy_threshold: int | None, parameter_sync_step: int) -> int | None:
    """knitdata's ``max_staleness`` (versions counted per mini-batch) equal to verl's ``max_off_policy_threshold``.

    verl admits a group dispatched at global step ``P`` into global step ``G`` iff ``G - P + 1 <= T``; a global step
    has ``M = parameter_sync_step`` mini-batches. With the group's version ``P * M`` and mini-batch ``k`` of step
    ``G`` at version ``G * M + k``, knitdata's rule ``G * M + k - P * M <= eta`` holds for every ``k < M`` iff
    ``G - P <= T - 1``, when ``eta = T * M - 1``.

    Example::

        assert staleness_in_minibatches(2, 4) == 7
        assert staleness_in_minibatches(None, 4) is None
    """
    if max_off_policy_threshold is None:
        return None
    return int(max_off_policy_threshold) * int(parameter_sync_step) - 1


def _plain(x: Any) -> Any:
    """An OmegaConf node as plain containers (interpolations resolved); anything else as is."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        return x
    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    return x


def _int_setting(kw: Mapping[str, Any], key: str, lo: int) -> int:
    v = kw[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"trainer.v1.sampler.sampler_kwargs.{key} must be an int >= {lo}, got {v!r}")
    return v


def _settings(trainer_mode: str, trainer_config: Any, max_off_policy_threshold: Any, max_off_policy_strategy: Any,
              sampler_kwargs: Any, poll_interval: float) -> dict[str, Any]:
    """The sampler's settings from verl's constructor arguments, checked (ConfigError naming the config path)."""
    kw = dict(SAMPLER_KWARGS)
    given = _plain(sampler_kwargs) or {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"trainer.v1.sampler.sampler_kwargs must be a mapping, got {type(given).__name__}")
    unknown = sorted(set(given) - set(SAMPLER_KWARGS))
    if unknown:
        raise ConfigError(f"trainer.v1.sampler.sampler_kwargs: unknown keys {unknown}; known {sorted(SAMPLER_KWARGS)}")
    kw.update(given)
    if not isinstance(kw["quotas"], Mapping) or not kw["quotas"]:
        raise ConfigError("trainer.v1.sampler.sampler_kwargs.quotas must map each data_source to its prompt groups "
                          f"per train batch (summing to data.train_batch_size), got {kw['quotas']!r}")
    cfg = _plain(trainer_config) or {}
    M = cfg.get("parameter_sync_step", 1) if isinstance(cfg, Mapping) else 1
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ConfigError(f"trainer.v1.{trainer_mode}.parameter_sync_step must be an int >= 1, got {M!r}")
    if max_off_policy_threshold is not None and (isinstance(max_off_policy_threshold, bool)
                                                 or not isinstance(max_off_policy_threshold, int)
                                                 or max_off_policy_threshold < 1):
        raise ConfigError("trainer.v1.sampler.max_off_policy_threshold must be null or an int >= 1, got "
                          f"{max_off_policy_threshold!r}")
    if max_off_policy_strategy not in ("drop", "wait"):
        raise ConfigError("trainer.v1.sampler.max_off_policy_strategy must be 'drop' or 'wait', got "
                          f"{max_off_policy_strategy!r}")
    bounds = kw["bounds"]
    try:
        spec = BatchSpec({str(s): q for s, q in kw["quotas"].items()}, num_minibatches=M, group_size=1,
                         bounds=None if bounds is None else {str(s): (b[0], b[1]) for s, b in bounds.items()})
    except (ConfigError, TypeError, IndexError, AttributeError) as e:
        raise ConfigError(f"trainer.v1.sampler.sampler_kwargs (quotas, bounds) with parameter_sync_step={M}: {e}") from e
    # knitdata's on_stale: verl ignores the strategy without a threshold, knitdata refuses "wait" without a bound
    on_stale = max_off_policy_strategy if max_off_policy_threshold is not None else "drop"
    # refuse an unknown policy (or one that cannot keep the bound) now, not at the first step
    make_policy(str(kw["policy"]), spec, continuous=True,
                max_staleness=staleness_in_minibatches(max_off_policy_threshold, M), on_stale=on_stale)
    if kw["refill_multiple"] is None:  # verl's data.gen_batch_size defaults to data.train_batch_size
        kw["refill_multiple"] = spec.batch_size
    interval = kw["poll_interval"] if kw["poll_interval"] is not None else poll_interval
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval < 0:
        raise ConfigError(f"trainer.v1.sampler.sampler_kwargs.poll_interval must be seconds >= 0, got {interval!r}")
    timeout = kw["timeout_s"]
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"trainer.v1.sampler.sampler_kwargs.timeout_s must be null or seconds > 0, got {timeout!r}")
    if kw["regenerate"] not in ("refill", "same_prompt"):
        raise ConfigError("trainer.v1.sampler.sampler_kwargs.regenerate must be 'refill' or 'same_prompt', got "
                          f"{kw['regenerate']!r}")
    if kw["regenerate"] == "same_prompt" and trainer_mode == "sync":
        raise ConfigError("sampler_kwargs.regenerate=same_prompt needs an async trainer_mode: verl's sync trainer does "
                          "not keep the prompts in TransferQueue")
    return {**kw, "spec": spec, "num_minibatches": M, "on_stale": on_stale, "policy": str(kw["policy"]),
            "source_field": str(kw["source_field"]), "refill_multiple": _int_setting(kw, "refill_multiple", 1),
            "poll_interval": float(interval), "timeout_s": None if timeout is None else float(timeout)}


def _verl_trainer(refill_fn: Any) -> Any:
    """verl's trainer behind ``refill_fn`` (its bound ``_add_prompts_to_generate``), for ``regenerate=same_prompt``."""
    trainer = getattr(refill_fn, "__self__", None)
    if trainer is None or getattr(refill_fn, "__name__", "") != "_add_prompts_to_generate":
        raise ConfigError("sampler_kwargs.regenerate=same_prompt re-dispatches through verl's trainer: refill_fn must be "
                          "the trainer's _add_prompts_to_generate, as verl 0.9's _build_replay_buffer passes it; got "
                          f"{refill_fn!r}")
    return trainer


def reissue(tq: Any, trainer: Any, partition_id: str, uids: list[str], trajectory_keys: list[str],
            global_steps: int) -> Any:
    """Generate the prompt groups ``uids`` again (their old trajectories cleared) at ``global_steps``.

    verl 0.9.1 has this only as the private ``PPOTrainer._reissue_inflight_prompts`` (for groups in flight at a
    checkpoint) and its public dispatch hook, ``refill_fn``, takes the next dataloader prompts instead. This is that
    method's body for given groups: the prompt fields verl keeps in TransferQueue (async modes), the group's tag back
    to ``pending`` at the current step, and the trainer's ``agent_loop_manager.generate_sequences``.
    ``tests/test_integrations_verl.py`` checks the copy against the pinned verl's source.

    Raises:
        StateError: The store does not hold the prompts (verl's sync mode does not keep them).
    """
    from verl.utils.tensordict_utils import assign_non_tensor_data

    try:
        batch = tq.kv_batch_get(keys=uids, partition_id=partition_id)
    except (KeyError, ValueError, RuntimeError) as e:
        raise StateError(f"cannot regenerate verl groups {uids[:5]}: their prompts are not in TransferQueue ({e})") from e
    if trajectory_keys:
        tq.kv_clear(keys=trajectory_keys, partition_id=partition_id)
    assign_non_tensor_data(batch, "global_steps", global_steps)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": global_steps} for _ in uids]
    tq.kv_batch_put(keys=uids, partition_id=partition_id, tags=tags)
    trainer.agent_loop_manager.generate_sequences(batch)
    return batch


def _shortfall(policy: AdmissionPolicy) -> dict[str, int]:
    """Groups each source lacks for the rest of its quota in the current train batch (ready ones counted)."""
    ready = policy.ready_counts()
    return {s: max(0, r - ready[s]) for s, r in policy.remaining_quota().items()}


def _timeout_message(policy: AdmissionPolicy, prompts: Mapping[str, Mapping[str, Any]], global_steps: int,
                     waited: float, k: int) -> str:
    generating: dict[str, int] = {}
    for t in prompts.values():
        if t["status"] in ("pending", "running"):
            generating[t["status"]] = generating.get(t["status"], 0) + 1
    short = {s: n for s, n in _shortfall(policy).items() if n}
    return (f"KnitdataSampler waited {waited:.0f} s (timeout_s) for mini-batch {k} of global step {global_steps}: per "
            f"source, groups still needed this train batch {policy.remaining_quota()}, ready {policy.ready_counts()}, "
            f"short {short}; prompt groups generating {generating} (of unknown source until they finish). Give the "
            "short sources more weight in the dataloader, or lower their quotas")


class KnitdataSampler:
    """verl's V1 sampler plugin: admits finished groups by per-source quotas under a hard staleness bound.

    verl builds it with its ``ReplayBuffer`` constructor arguments (``trainer.v1.sampler`` and the trainer's
    ``_add_prompts_to_generate`` as ``refill_fn``); the quotas come in ``sampler_kwargs``:

    - ``quotas`` (required): prompt groups per source per train batch; they sum to ``data.train_batch_size``.
    - ``bounds``: optional ``{source: [lo, hi]}`` groups per mini-batch.
    - ``policy``: a knitdata admission policy name (default ``constraint_preserving``).
    - ``source_field``: the per-sample field naming the source (default ``data_source``).
    - ``refill_multiple``: refills are requested in multiples of this, the rest kept as credit (verl's
      ``refill_fn`` refuses counts that are not multiples of ``data.gen_batch_size``); default ``null``: the sum of
      the quotas (``data.train_batch_size``, verl's default ``gen_batch_size``). The docs' config passes
      ``${oc.select:data.gen_batch_size,null}``.
    - ``poll_interval``: seconds between polls of the store (default: the constructor's, verl's 2.0).
    - ``regenerate``: ``refill`` (default) replaces a group the bound dropped by ``refill_fn``'s next dataloader
      prompt; ``same_prompt`` generates the dropped prompt again, so its source keeps its supply (async modes; the
      one part that follows a private verl method, see :func:`reissue`).
    - ``timeout_s``: a ``sample`` call that has waited this long raises
      :class:`~knitdata.errors.DataTimeoutError` naming the sources short of their quota (``null``: wait forever).

    Args:
        trainer_mode: ``sync``, ``colocate_async`` or ``separate_async``.
        trainer_config: ``trainer.v1.<trainer_mode>``; its ``parameter_sync_step`` (default 1) is the number of
            mini-batches ``M`` per global step.
        max_off_policy_threshold: verl's ``T`` (``None``: no bound), see :func:`staleness_in_minibatches`.
        max_off_policy_strategy: ``drop`` or ``wait`` (knitdata's ``on_stale``).
        sampler_kwargs: The settings above.
        poll_interval: Seconds between polls of the store.
        refill_fn: Dispatches an exact number of fresh prompts (verl's trainer passes it).
        filter_groups_metric: verl's DAPO group filter; not supported with quotas (``None`` only).
        train_batch_size: Accepted for verl's signature; unused.
        gen_batch_size: Accepted for verl's signature; unused (see ``refill_multiple``).
        max_inflight_gen_batches: Accepted for verl's signature; unused.
        sync_refill_failed_groups: Accepted for verl's signature; failed groups are always cleared and refilled.

    Raises:
        ConfigError: A bad setting (named with its config path).
        OptionalDependencyError: TransferQueue is not installed.
    """

    def __init__(self, trainer_mode: str, trainer_config: Any, max_off_policy_threshold: int | None,
                 max_off_policy_strategy: str, sampler_kwargs: Any, poll_interval: float = 2.0,
                 refill_fn: Callable[[int], Any] | None = None, filter_groups_metric: str | None = None,
                 train_batch_size: int | None = None, gen_batch_size: int | None = None,
                 max_inflight_gen_batches: int = 1, sync_refill_failed_groups: bool = False) -> None:
        try:
            import transfer_queue
        except ImportError as e:
            raise OptionalDependencyError("transferqueue", "verl", "knitdata's verl sampler") from e
        self._tq = transfer_queue
        if filter_groups_metric is not None:
            raise ConfigError("algorithm.filter_groups (DAPO) is not supported by KnitdataSampler: quotas count "
                              "every finished group; turn filter_groups off or use verl's built-in sampler")
        kw = _settings(trainer_mode, trainer_config, max_off_policy_threshold, max_off_policy_strategy,
                       sampler_kwargs, poll_interval)
        self.spec: BatchSpec = kw["spec"]
        self.policy_name: str = kw["policy"]
        self.num_minibatches: int = kw["num_minibatches"]
        self.max_staleness = staleness_in_minibatches(max_off_policy_threshold, self.num_minibatches)
        self.on_stale: str = kw["on_stale"]
        self.source_field: str = kw["source_field"]
        self.refill_multiple: int = kw["refill_multiple"]
        self.poll_interval: float = kw["poll_interval"]
        self.timeout_s: float | None = kw["timeout_s"]
        self.regenerate: str = kw["regenerate"]
        self._trainer = _verl_trainer(refill_fn) if self.regenerate == "same_prompt" else None
        self.trainer_mode = trainer_mode
        self.trainer_config = trainer_config
        self.max_off_policy_threshold = max_off_policy_threshold
        self.max_off_policy_strategy = max_off_policy_strategy
        self.sampler_kwargs = sampler_kwargs
        self.refill_fn = refill_fn
        self._policy: AdmissionPolicy | None = None
        self._first_step: int | None = None  # G0: the global step of the first train mini-batch
        self._delivered = 0  # train mini-batches delivered
        self._queue: deque[AdmittedMiniBatch] = deque()  # admitted ahead, not yet delivered
        self._offered: dict[str, str] = {}  # uid -> source of groups offered and not delivered or dropped
        self._refill_credit = 0
        self._idle_refills = 0
        self._refilled = False
        self._listing: dict[str, dict[str, Any]] = {}
        self._prompts: dict[str, dict[str, Any]] = {}
        self._trajs: dict[str, list[str]] = {}
        self.totals: dict[str, dict[str, int]] = {"delivered": {}, "dropped": {}}

    # -- verl's interface -------------------------------------------------------------------------------------------
    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict[str, Any]]:
        """The next mini-batch of ``batch_size`` prompt groups, as verl's ``KVBatchMeta``, and its metrics.

        ``partition_id="train"``: by quotas and the bound (blocks until the policy admits a mini-batch);
        any other partition (validation): every finished group is sampleable, oldest first, as in verl.

        Raises:
            ConfigError: ``batch_size`` is not the quotas' mini-batch size.
            StateError: ``global_steps`` is not the step this sampler is at (``M`` calls per global step).
            ValidationError: A finished group has no ``data_source`` or one without a quota (the group is named;
                nothing is cleared).
            DataTimeoutError: ``timeout_s`` passed; the message names what each source still lacks.
        """
        if partition_id != "train":
            return self._sample_plain(partition_id, batch_size)
        m = self.spec.minibatch_size
        if batch_size != m:
            raise ConfigError(f"sample(batch_size={batch_size}) but the quotas {dict(self.spec.quotas)} make mini-batches "
                              f"of {m} groups (sum / parameter_sync_step={self.num_minibatches}): make "
                              "sampler_kwargs.quotas sum to data.train_batch_size")
        policy = self._policy_for(global_steps)
        expected = self._first_step + self._delivered // self.num_minibatches  # type: ignore[operator]
        if global_steps != expected:
            raise StateError(f"sample(global_steps={global_steps}) but this sampler is at global step {expected}, "
                             f"mini-batch {self._delivered % self.num_minibatches} of {self.num_minibatches} "
                             "(parameter_sync_step calls per global step)")
        metrics: dict[str, Any] = {}
        start = time.monotonic()
        starved: dict[str, int] | None = None
        self._idle_refills = 0  # at most 4 train batches of prompts asked for per call while nothing generates
        while True:
            self._refresh(partition_id, metrics)
            if not self._queue and not self._must_wait(global_steps):
                self._queue.extend(policy.poll(now=time.time()))
            self._settle_drops(partition_id, metrics, global_steps)
            if self._queue:
                break
            if starved is None:
                starved = _shortfall(policy)
            self._refill_if_idle(policy, partition_id, metrics)
            waited = time.monotonic() - start
            if self.timeout_s is not None and waited >= self.timeout_s:
                raise DataTimeoutError(_timeout_message(policy, self._prompts, global_steps, waited,
                                                        self._delivered % self.num_minibatches))
            time.sleep(self.poll_interval)
        mb = self._queue.popleft()
        batch = self._deliver(partition_id, mb)
        self._metrics(metrics, mb, global_steps, time.monotonic() - start, starved or {})
        return batch, metrics

    def get_sampleable_count(self, global_steps: int, partition_id: str) -> int:
        """Finished groups waiting for a mini-batch (admitted ahead or ready), for verl's hybrid rollout switch."""
        if partition_id != "train":
            self._list(partition_id)
            return sum(1 for t in self._prompts.values() if t.get("status") in _TERMINAL)
        self._policy_for(global_steps)
        self._refresh(partition_id, {})
        return self._sampleable()

    def wait_for_sampleable(self, global_steps: int, partition_id: str, target_count: int) -> tuple[set[str], dict]:
        """Poll until ``target_count`` groups are sampleable (see :meth:`get_sampleable_count`); returns their uids
        and the eviction metrics meanwhile.

        Raises:
            DataTimeoutError: ``timeout_s`` passed first.
        """
        metrics: dict[str, Any] = {}
        start = time.monotonic()
        while True:
            n = self.get_sampleable_count(global_steps, partition_id)
            self._settle_drops(partition_id, metrics, global_steps)
            if n >= target_count:
                uids = {t.group for mb in self._queue for t in mb.trajectories} | (
                    set(self._offered) if partition_id == "train" else
                    {u for u, t in self._prompts.items() if t.get("status") in _TERMINAL})
                return uids, metrics
            if self.timeout_s is not None and time.monotonic() - start >= self.timeout_s:
                raise DataTimeoutError(f"waited {self.timeout_s:.0f} s for {target_count} sampleable groups in "
                                       f"partition {partition_id!r}; {n} are")
            time.sleep(self.poll_interval)

    # -- the store ---------------------------------------------------------------------------------------------------
    def _list(self, partition_id: str) -> None:
        """Read the partition's keys and tags: prompt groups (``is_prompt``) and trajectories by group uid."""
        data = self._tq.kv_list(partition_id) or {}
        items = data.get(partition_id, {}) or {}
        prompts: dict[str, dict[str, Any]] = {}
        trajs: dict[str, list[str]] = {}
        for key, tag in items.items():
            if tag.get("is_prompt", False):
                status = tag.get("status")
                if status not in _STATUSES:
                    raise ValidationError(f"verl group {key!r} in partition {partition_id!r} has status {status!r}; "
                                          f"expected one of {_STATUSES}", trajectory_id=key, field="status")
                prompts[key] = tag
            else:
                trajs.setdefault(key.split("_")[0], []).append(key)
        self._listing, self._prompts, self._trajs = items, prompts, trajs
        self._refilled = False  # refills since this listing are not in it yet

    def _clear(self, partition_id: str, uids: list[str]) -> None:
        """Remove whole groups (prompt key and trajectories) from the store."""
        keys = [k for u in uids for k in (u, *self._trajs.get(u, ()))]
        if keys:
            self._tq.kv_clear(keys=keys, partition_id=partition_id)
        for u in uids:
            self._prompts.pop(u, None)
            self._trajs.pop(u, None)

    def _sources(self, partition_id: str, uids: list[str]) -> dict[str, str]:
        """Each group's source, read from its first trajectory's ``source_field``."""
        if not uids:
            return {}
        keys = [self._trajs[u][0] for u in uids]
        try:
            values = self._tq.kv_batch_get(keys=keys, partition_id=partition_id,
                                           select_fields=[self.source_field])[self.source_field]
        except (KeyError, ValueError, RuntimeError) as e:
            for u, k in zip(uids, keys):  # name the group: read them one by one
                try:
                    self._tq.kv_batch_get(keys=[k], partition_id=partition_id, select_fields=[self.source_field])
                except (KeyError, ValueError, RuntimeError) as one:
                    raise ValidationError(f"verl group {u!r} (trajectory {k!r}, partition {partition_id!r}) has no "
                                          f"{self.source_field!r} field: {one}", trajectory_id=u,
                                          field=self.source_field) from e
            raise ValidationError(f"cannot read {self.source_field!r} of verl groups {uids[:5]} (partition "
                                  f"{partition_id!r}): {e}", trajectory_id=uids[0], field=self.source_field) from e
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) != len(uids):
            raise ValidationError(f"kv_batch_get returned {len(values)} values of {self.source_field!r} for "
                                  f"{len(uids)} groups", trajectory_id=uids[0], field=self.source_field)
        out: dict[str, str] = {}
        for u, v in zip(uids, values):
            v = getattr(v, "data", v)
            if not isinstance(v, str) or not v:
                raise ValidationError(f"verl group {u!r}: {self.source_field} must be a non-empty string, got {v!r}",
                                      trajectory_id=u, field=self.source_field)
            if v not in self.spec.quotas:
                raise ValidationError(f"verl group {u!r}: {self.source_field} {v!r} has no quota; "
                                      f"sampler_kwargs.quotas names {list(self.spec.quotas)}: add it there, or leave "
                                      "its rows out of the training data", trajectory_id=u, field=self.source_field)
            out[u] = v
        return out

    # -- admission ---------------------------------------------------------------------------------------------------
    def _policy_for(self, global_steps: int) -> AdmissionPolicy:
        if isinstance(global_steps, bool) or not isinstance(global_steps, int) or global_steps < 0:
            raise StateError(f"sample(global_steps={global_steps!r}): verl's global step must be an int >= 0")
        if self._policy is None:
            self._first_step = global_steps
            self._policy = make_policy(self.policy_name, self.spec, continuous=True, max_staleness=self.max_staleness,
                                       on_stale=self.on_stale,
                                       version_offset=global_steps * self.num_minibatches)
        return self._policy

    def _refresh(self, partition_id: str, metrics: dict[str, Any]) -> None:
        """List the store; clear and refill failed groups; offer newly finished groups to the policy."""
        assert self._policy is not None
        self._list(partition_id)
        failed = [u for u, t in self._prompts.items() if t["status"] == "failure"
                  or (t["status"] == "finished" and not self._trajs.get(u))]
        failed = [u for u in failed if u not in self._offered]
        if failed:
            self._clear(partition_id, failed)
            key = "training/rollout_failure/evicted_samples"
            metrics[key] = metrics.get(key, 0) + len(failed)
            self._refill(len(failed), partition_id)
        new = sorted((u for u, t in self._prompts.items() if t["status"] == "finished" and u not in self._offered),
                     key=lambda u: (int(self._prompts[u].get("global_steps", 0)), u))
        sources = self._sources(partition_id, new)  # validates every new group before any is offered
        M = self.num_minibatches
        metas = []
        for u in new:
            tokens = sum(int(self._listing[k].get("seq_len", 0) or 0) for k in self._trajs[u])
            metas.append(TrajectoryMeta(id=u, source=sources[u], group=u, num_tokens=tokens,
                                        gen_version=int(self._prompts[u].get("global_steps", 0)) * M))
            self._offered[u] = sources[u]
        self._policy.offer(metas)

    def _must_wait(self, global_steps: int) -> bool:
        """verl's ``wait``: a group still generating is at its last admissible global step."""
        T = self.max_off_policy_threshold
        if T is None or self.max_off_policy_strategy != "wait":
            return False
        return any(t["status"] in ("pending", "running") and global_steps - int(t.get("global_steps", 0)) + 1 >= T
                   for t in self._prompts.values())

    def _settle_drops(self, partition_id: str, metrics: dict[str, Any], global_steps: int) -> None:
        """Clear the groups the bound dropped, count them and refill as many prompts."""
        assert self._policy is not None
        dropped = self._policy.take_dropped()
        self._policy.pop_released()
        if not dropped:
            return
        uids = [d["group"] for d in dropped]
        if self._trainer is not None and partition_id == "train":
            reissue(self._tq, self._trainer, partition_id, uids, [k for u in uids for k in self._trajs.get(u, ())],
                    global_steps)
            for u in uids:
                self._trajs.pop(u, None)
            self._refilled = True  # generating again, which this listing does not show yet
        else:
            self._clear(partition_id, uids)
        spans = []
        for d in dropped:
            self._offered.pop(d["group"], None)
            tot = self.totals["dropped"]
            tot[d["source"]] = tot.get(d["source"], 0) + 1
            key = f"training/knitdata/dropped/{d['source']}"
            metrics[key] = metrics.get(key, 0) + 1
            spans.append(self._first_step_of_mb(d["step"]) - d["version"] // self.num_minibatches + 1)
        n = metrics.get("training/off_policy/evicted_samples", 0)
        metrics["training/off_policy/evicted_samples"] = n + len(dropped)
        metrics["training/off_policy/evicted_samples_staleness/max"] = max(
            [metrics.get("training/off_policy/evicted_samples_staleness/max", 0), *spans])
        if self._trainer is None:
            self._refill(len(dropped), partition_id)
        else:
            metrics["training/knitdata/regenerated"] = metrics.get("training/knitdata/regenerated", 0) + len(uids)

    def _first_step_of_mb(self, step: int) -> int:
        """verl's global step of knitdata's mini-batch ``step``."""
        return (self._first_step or 0) + step // self.num_minibatches

    def _refill(self, n: int, partition_id: str) -> None:
        """Ask verl for ``n`` fresh prompts, in multiples of ``refill_multiple`` (the rest is kept as credit)."""
        if partition_id != "train" or self.refill_fn is None:
            return
        self._refill_credit += n
        k = self._refill_credit - self._refill_credit % self.refill_multiple
        if k > 0:
            self._refill_credit -= k
            self._refilled = True
            self.refill_fn(k)

    def _refill_if_idle(self, policy: AdmissionPolicy, partition_id: str, metrics: dict[str, Any]) -> None:
        """Nothing is generating and the mini-batch cannot be filled: ask for as many prompts as are missing (at most 4
        train batches per ``sample`` call: a source the data never supplies ends in ``timeout_s``, not a flood)."""
        if self._refilled or any(t["status"] in ("pending", "running") for t in self._prompts.values()):
            return
        short = min(sum(_shortfall(policy).values()), 4 * self.spec.batch_size - self._idle_refills)
        if short > 0 and self.refill_fn is not None:
            self._idle_refills += short
            metrics["training/knitdata/starvation_refills"] = metrics.get("training/knitdata/starvation_refills", 0) + short
            mult, credit = self.refill_multiple, self._refill_credit
            self._refill(-(-(credit + short) // mult) * mult - credit, partition_id)

    def _sampleable(self) -> int:
        assert self._policy is not None
        return sum(len(mb.trajectories) for mb in self._queue) + sum(self._policy.ready_counts().values())

    # -- output ------------------------------------------------------------------------------------------------------
    def _deliver(self, partition_id: str, mb: AdmittedMiniBatch) -> Any:
        """Clear the groups' prompt keys (never delivered again) and return their trajectories as a KVBatchMeta."""
        uids = [t.group for t in mb.trajectories]
        missing = [u for u in uids if u not in self._trajs]
        if missing:
            raise StateError(f"verl groups {missing[:5]} were admitted but their trajectories left the store before "
                             "delivery (cleared by another process?)")
        keys = [k for u in uids for k in self._trajs[u]]
        tags = [self._listing[k] for k in keys]
        self._tq.kv_clear(keys=uids, partition_id=partition_id)
        for t in mb.trajectories:
            self._offered.pop(t.group, None)
            self._prompts.pop(t.group, None)
            tot = self.totals["delivered"]
            tot[t.source] = tot.get(t.source, 0) + 1
        self._delivered += 1
        return self._tq.KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags)

    def _metrics(self, metrics: dict[str, Any], mb: AdmittedMiniBatch, global_steps: int, waited: float,
                 starved: Mapping[str, int]) -> None:
        counts = mb.counts()
        spans = [global_steps - t.gen_version // self.num_minibatches + 1 for t in mb.trajectories]
        for s in self.spec.sources:
            metrics[f"training/knitdata/groups/{s}"] = counts.get(s, 0)
            metrics[f"training/knitdata/starved/{s}"] = int(starved.get(s, 0))
        metrics["training/knitdata/off_policy_span/max"] = max(spans)
        metrics["training/knitdata/off_policy_span/mean"] = sum(spans) / len(spans)
        starving = (self._policy.bound_stats() or {}).get("starved", {}) if self._policy is not None else {}
        for s, flag in starving.items():  # knitdata's signal: max(2, quota) groups of s dropped in a row
            metrics[f"training/knitdata/bound_starved/{s}"] = int(bool(flag))
        metrics["training/knitdata/wait_s"] = waited
        metrics["training/knitdata/ahead"] = self._sampleable()

    def _sample_plain(self, partition_id: str, batch_size: int) -> tuple[Any, dict[str, Any]]:
        """verl's rule for validation: the ``batch_size`` oldest terminal groups, once that many are terminal."""
        start = time.monotonic()
        while True:
            self._list(partition_id)
            done = [u for u, t in self._prompts.items() if t["status"] in _TERMINAL]
            if len(done) >= batch_size:
                break
            if self.timeout_s is not None and time.monotonic() - start >= self.timeout_s:
                raise DataTimeoutError(f"waited {self.timeout_s:.0f} s for {batch_size} finished groups in partition "
                                       f"{partition_id!r}; {len(done)} are")
            time.sleep(self.poll_interval)
        done.sort(key=lambda u: (int(self._prompts[u].get("global_steps", 0)), u))
        uids = done[:batch_size]
        self._tq.kv_clear(keys=uids, partition_id=partition_id)
        keys = [k for u in uids for k in self._trajs.get(u, ())]
        return self._tq.KVBatchMeta(partition_id=partition_id, keys=keys, tags=[self._listing[k] for k in keys]), {}
