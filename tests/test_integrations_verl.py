"""knitdata.integrations.verl against verl 0.9.1's V1 trainer: its config files and plugin loader build the sampler,
its ``KVBatchMeta`` carries the result, and its own ``ReplayBufferAsync`` runs beside it on the same store.

TransferQueue itself needs a Ray cluster, so the store is :class:`FakeStore`: a dict behind exactly the KV calls the
sampler makes (``kv_list``, ``kv_batch_get``, ``kv_clear``), patched into the ``transfer_queue`` module (verl's
sampler reads the same module), plus ``kv_put`` for what verl's trainer and agent loop write (:class:`Rollout`
writes the keys and tags of ``trainer_base._submit_batch_to_rollout`` and ``agent_loop_tq``).
"""

from __future__ import annotations

import copy
import os
import random
import re
import shlex
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knitdata.errors import ConfigError, DataTimeoutError, StateError, ValidationError

try:
    with warnings.catch_warnings():  # verl names each training engine it cannot load (megatron, ...): none is used
        warnings.simplefilter("ignore", UserWarning)
        import transfer_queue
        import verl
        from transfer_queue import KVBatchMeta
        from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer
        from verl.utils.import_utils import load_extern_type
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict
except ImportError as e:  # pragma: no cover - make install-dev installs verl (see the Makefile)
    pytest.skip(f"verl 0.9 is not importable here ({e!r}); `make install-dev` installs it", allow_module_level=True)

from knitdata.integrations.verl import KnitdataSampler, staleness_in_minibatches

# the scenarios drop groups on purpose (knitdata warns once per source that its dropped groups starve it; the sampler
# reports it as training/knitdata/bound_starved/<source>); verl 0.9.1's own builder calls its deprecated
# load_extern_type
pytestmark = [pytest.mark.filterwarnings("ignore:staleness bound. source .* is starved:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:.*load_extern_type.* is deprecated:FutureWarning")]
ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "pkg://knitdata.integrations.verl"


# ------------------------------------------------------------------------------------------------ the fake store
class FakeStore:
    """TransferQueue's KV calls over dicts: partition -> key -> {"tag": ..., "fields": ...}; tags merge on put."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[str, dict[str, Any]]] = {}
        self.on_list: list[Any] = []  # called before each listing: the rollout makes progress meanwhile
        self.list_calls = 0
        self.cleared: list[str] = []

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        self.list_calls += 1
        for hook in list(self.on_list):
            hook()
        return {pid: {k: copy.deepcopy(v["tag"]) for k, v in items.items()}
                for pid, items in self.parts.items() if partition_id in (None, pid)}

    def kv_batch_get(self, keys: Any, partition_id: str, select_fields: Any = None) -> Any:
        keys = [keys] if isinstance(keys, str) else list(keys)
        part = self.parts.get(partition_id, {})
        rows = []
        for k in keys:
            if k not in part:
                raise ValueError(f"key {k!r} not found in partition {partition_id!r}")
            fields = part[k]["fields"]
            sel = [select_fields] if isinstance(select_fields, str) else list(select_fields or fields)
            if any(f not in fields for f in sel):
                raise ValueError(f"empty fields {[f for f in sel if f not in fields]} in key {k!r}")
            rows.append({f: fields[f] for f in sel})
        return list_of_dict_to_tensordict(rows)

    def kv_clear(self, keys: Any, partition_id: str) -> None:
        keys = [keys] if isinstance(keys, str) else list(keys)
        for k in keys:
            self.parts.get(partition_id, {}).pop(k, None)
        self.cleared.extend(keys)

    def kv_put(self, key: str, partition_id: str, fields: dict | None = None, tag: dict | None = None) -> None:
        entry = self.parts.setdefault(partition_id, {}).setdefault(key, {"tag": {}, "fields": {}})
        entry["tag"].update(tag or {})
        entry["fields"].update(fields or {})

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None, tags: list[dict] | None = None) -> None:
        assert fields is None, "the sampler writes tags only"
        for key, tag in zip(keys, tags or [{}] * len(keys)):
            self.kv_put(key, partition_id, tag=tag)

    def keys(self, partition_id: str = "train") -> set[str]:
        return set(self.parts.get(partition_id, {}))


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> FakeStore:
    fake = FakeStore()
    for name in ("kv_list", "kv_batch_get", "kv_clear", "kv_put", "kv_batch_put"):
        monkeypatch.setattr(transfer_queue, name, getattr(fake, name))
    return fake


class Rollout:
    """What verl writes: prompts tagged pending with their global step, then ``rollout_n`` trajectories
    ``{uid}_{session}_0`` (tags of ``agent_loop_tq``, fields with ``data_source``) and the terminal status."""

    def __init__(self, store: FakeStore, n: int = 2, partition: str = "train") -> None:
        self.store, self.n, self.partition = store, n, partition
        self.source: dict[str, str] = {}
        self.version: dict[str, int] = {}
        self.inflight: list[str] = []
        self.global_steps = 1
        self.refills: list[int] = []
        self._next = 0
        self.mix: list[str] = []  # the dataloader's data_source sequence (cycled)

    def dispatch(self, sources: list[str], global_steps: int | None = None) -> list[str]:
        g = self.global_steps if global_steps is None else global_steps
        uids = []
        for s in sources:
            uid = f"p{self._next:05d}"
            self._next += 1
            self.store.kv_put(uid, self.partition, tag={"is_prompt": True, "status": "pending", "global_steps": g},
                              fields={"uid": uid, "data_source": s, "index": self._next})  # async modes keep these
            self.source[uid], self.version[uid] = s, g
            self.inflight.append(uid)
            uids.append(uid)
        return uids

    def refill(self, n: int) -> int:
        """verl's ``refill_fn`` (``_add_prompts_to_generate``): the next ``n`` dataloader prompts."""
        self.refills.append(n)
        start = self._next
        return len(self.dispatch([self.mix[(start + i) % len(self.mix)] for i in range(n)]))

    def finish(self, uid: str, *, fail: bool = False, field: str = "data_source", source: str | None = None) -> None:
        self.store.kv_put(uid, self.partition, tag={"status": "running"})
        g = self.version[uid]
        for i in range(self.n):
            self.store.kv_put(
                f"{uid}_{i}_0", self.partition,
                fields={field: self.source[uid] if source is None else source, "responses": torch.arange(5)},
                tag={"status": "success", "prompt_len": 3, "response_len": 5, "seq_len": 8, "global_steps": g,
                     "min_global_steps": g, "max_global_steps": self.global_steps})
        self.store.kv_put(uid, self.partition, tag={"status": "failure" if fail else "finished"})
        self.inflight.remove(uid)


def make(store: FakeStore, rollout: Rollout | None, *, quotas: dict[str, int], M: int = 1, T: int | None = None,
         strategy: str = "drop", refill_fn: Any = None, **kw: Any) -> KnitdataSampler:
    """The sampler as verl's trainer builds a custom one (``trainer_base._build_replay_buffer``)."""
    return KnitdataSampler(trainer_mode="separate_async", trainer_config={"parameter_sync_step": M},
                           max_off_policy_threshold=T, max_off_policy_strategy=strategy,
                           sampler_kwargs={"quotas": quotas, "poll_interval": 0, "timeout_s": 10, **kw},
                           refill_fn=refill_fn or (None if rollout is None else rollout.refill))


def groups_of(batch: Any) -> list[str]:
    """The group uids of a KVBatchMeta, in order, once each."""
    return list(dict.fromkeys(k.split("_")[0] for k in batch.keys))


# ------------------------------------------------------------------------------------------- verl's config path
def _doc_blocks(lang: str) -> list[str]:
    text = (ROOT / "docs" / "verl.md").read_text(encoding="utf-8")
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def _build_through_verl(cfg: Any) -> Any:
    """verl's own builder (``PPOTrainer._build_replay_buffer``) on a trainer that has only what it reads."""
    trainer = types.SimpleNamespace(config=cfg, trainer_mode=cfg.trainer.v1.trainer_mode,
                                    _add_prompts_to_generate=lambda n: n)
    return PPOTrainer._build_replay_buffer(trainer)


def test_docs_command_line_builds_the_sampler_through_verls_config_and_plugin_loader() -> None:
    (bash,) = _doc_blocks("bash")[1:2]
    words = shlex.split(bash.replace("\\\n", " "))
    assert words[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    cfg = _compose(words[3:])
    sampler = _build_through_verl(cfg)
    assert type(sampler).__name__ == "KnitdataSampler"
    assert load_extern_type(cfg.trainer.v1.sampler.custom_sampler.path, "KnitdataSampler") is KnitdataSampler
    assert dict(sampler.spec.quotas) == {"code": 16, "math": 48}
    assert sampler.num_minibatches == 2 and sampler.spec.minibatch_size == cfg.data.train_batch_size // 2
    assert sampler.max_off_policy_threshold == 2 and sampler.max_staleness == 2 * 2 - 1
    assert sampler.refill_multiple == 64  # data.gen_batch_size unset: verl fetches whole train batches
    readme = re.search(r"## In verl's V1 trainer.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert readme is not None  # the README's three overrides, with the batch size they need
    short = _build_through_verl(_compose([*shlex.split(readme.group(1).replace("\\\n", " ")), "data.train_batch_size=64"]))
    assert type(short).__name__ == "KnitdataSampler" and short.spec.quotas == sampler.spec.quotas


def test_docs_yaml_builds_the_sampler_through_verls_config_and_plugin_loader() -> None:
    from omegaconf import OmegaConf

    (yaml,) = _doc_blocks("yaml")
    for extra, multiple in (([], 64), (["data.gen_batch_size=8"], 8)):
        cfg = _compose(extra)
        OmegaConf.set_struct(cfg, False)
        cfg = OmegaConf.merge(cfg, OmegaConf.create(yaml))
        sampler = _build_through_verl(cfg)
        assert isinstance(sampler, KnitdataSampler)
        assert sampler.spec.batch_size == cfg.data.train_batch_size == 64
        assert sampler.max_off_policy_strategy == "drop" and sampler.num_minibatches == 2
        assert sampler.refill_multiple == multiple  # ${oc.select:data.gen_batch_size,null} resolved


def test_the_installed_verl_is_in_the_pinned_range() -> None:
    from packaging.specifiers import SpecifierSet

    line = re.search(r'^verl = \["verl([^"]*)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert line is not None
    assert verl.__version__ in SpecifierSet(line.group(1)), (verl.__version__, line.group(1))


# ----------------------------------------------------------------------------------------------- quotas and bound
def run_steps(store: FakeStore, rollout: Rollout, sampler: KnitdataSampler, steps: int, start: int = 1,
              record: dict[str, Any] | None = None) -> dict[str, Any]:
    """verl's loop: each global step dispatches a train batch, samples ``M`` mini-batches, clears them after."""
    rec = record if record is not None else {"batches": [], "delivered": [], "metrics": []}
    M, m = sampler.num_minibatches, sampler.spec.minibatch_size
    for g in range(start, start + steps):
        rollout.global_steps = g
        rollout.dispatch([rollout.mix[(rollout._next + i) % len(rollout.mix)] for i in range(sampler.spec.batch_size)])
        step: list[list[str]] = []
        for _ in range(M):
            batch, metrics = sampler.sample(global_steps=g, partition_id="train", batch_size=m)
            assert isinstance(batch, KVBatchMeta) and batch.partition_id == "train"
            uids = groups_of(batch)
            assert len(uids) == m and len(batch.keys) == m * rollout.n
            assert all(t["status"] == "success" and t["seq_len"] == 8 for t in batch.tags)
            for u in uids:  # the bound, in verl's count
                assert sampler.max_off_policy_threshold is None or g - rollout.version[u] + 1 <= sampler.max_off_policy_threshold
                assert u not in store.keys()  # the prompt key is cleared on delivery
            step.append(uids)
            rec["delivered"].extend(uids)
            rec["metrics"].append(metrics)
            transfer_queue.kv_clear(keys=batch.keys, partition_id="train")  # the trainer, after the step
        rec["batches"].append(step)
    return rec


def finish_randomly(rollout: Rollout, rng: random.Random, most: int) -> None:
    for uid in rng.sample(rollout.inflight, min(len(rollout.inflight), rng.randint(0, most))):
        rollout.finish(uid, fail=rng.random() < 0.05)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), M=st.sampled_from([1, 2]), T=st.sampled_from([None, 1, 2, 3]),
       policy=st.sampled_from(["constraint_preserving", "linear_target"]))
def test_every_train_batch_holds_the_quotas_exactly_within_the_bound(store: FakeStore, seed: int, M: int,
                                                                      T: int | None, policy: str) -> None:
    store.parts.clear()
    store.on_list.clear()
    rng = random.Random(seed)
    rollout = Rollout(store)
    rollout.mix = ["math"] * 4 + ["code", "chem"] * 2 + [rng.choice(["math", "code", "chem"]) for _ in range(3)]
    rng.shuffle(rollout.mix)  # the quotas' mix and some surplus: the sampler refills what is short
    quotas = {"math": 4, "code": 2, "chem": 2}
    sampler = make(store, rollout, quotas=quotas, M=M, T=T, policy=policy, refill_multiple=1)
    store.on_list.append(lambda: finish_randomly(rollout, rng, 3))
    rollout.dispatch(list(rollout.mix))  # async warm-up
    rec = run_steps(store, rollout, sampler, steps=4)
    for step in rec["batches"]:
        counts: dict[str, int] = {}
        for mb in step:
            for u in mb:
                counts[rollout.source[u]] = counts.get(rollout.source[u], 0) + 1
        assert counts == quotas
    assert len(rec["delivered"]) == len(set(rec["delivered"]))  # nothing twice
    # nothing lost: every dispatched group was delivered, dropped/failed (cleared, refilled) or is still in the store
    left = {k.split("_")[0] for k in store.keys()}
    gone = {u for u in rollout.source if u not in left and u not in rec["delivered"]}
    dropped = sum(v for m in rec["metrics"] for k, v in m.items()
                  if k in ("training/off_policy/evicted_samples", "training/rollout_failure/evicted_samples"))
    assert len(gone) == dropped
    assert all(u in store.cleared for u in gone)
    for metrics in rec["metrics"]:
        assert sum(metrics[f"training/knitdata/groups/{s}"] for s in quotas) == sampler.spec.minibatch_size
        if T is not None:
            assert metrics["training/knitdata/off_policy_span/max"] <= T


def test_linear_target_splits_each_quota_evenly_over_the_mini_batches(store: FakeStore) -> None:
    rollout = Rollout(store)
    rollout.mix = ["math", "math", "math", "code"]
    sampler = make(store, rollout, quotas={"math": 6, "code": 2}, M=2, policy="linear_target", refill_multiple=1)
    store.on_list.append(lambda: [rollout.finish(u) for u in list(rollout.inflight)])
    rec = run_steps(store, rollout, sampler, steps=3)
    for step in rec["batches"]:
        assert [sorted(rollout.source[u] for u in mb) for mb in step] == [["code", "math", "math", "math"]] * 2


def test_a_stale_group_is_dropped_cleared_and_refilled_exactly_as_verls_rule(store: FakeStore) -> None:
    rollout = Rollout(store)
    rollout.mix = ["a"]
    sampler = make(store, rollout, quotas={"a": 2, "b": 2}, T=1, refill_multiple=1)
    first = rollout.dispatch(["a", "a", "b", "b", "b"])
    for u in first:
        rollout.finish(u)
    batch, metrics = sampler.sample(1, "train", 4)
    assert sorted(groups_of(batch)) == sorted(first[:4])  # oldest first, then arrival order
    # the fifth group cannot join step 2 (G - P + 1 = 2 > T = 1): dropped as soon as step 1's mini-batch is out,
    # where verl's sampler would find it at step 2
    late = first[4]
    assert metrics["training/off_policy/evicted_samples"] == 1 and metrics["training/knitdata/dropped/b"] == 1
    assert metrics["training/off_policy/evicted_samples_staleness/max"] == 2
    assert not any(k.split("_")[0] == late for k in store.keys())  # prompt and trajectories cleared
    assert rollout.refills == [1]  # verl's async sampler refills what it evicts
    rollout.global_steps = 2
    second = [u for u in rollout.inflight]  # the refill, dispatched at step 1: stale at step 2 as well
    second += rollout.dispatch(["a", "a", "b", "b"])
    for u in second:
        rollout.finish(u)
    batch, metrics = sampler.sample(2, "train", 4)
    assert sorted(groups_of(batch)) == sorted(second[1:])
    assert metrics["training/off_policy/evicted_samples"] == 1 and rollout.refills == [1, 1]
    assert sampler.totals == {"delivered": {"a": 4, "b": 4}, "dropped": {"b": 1, "a": 1}}


def test_drops_the_same_groups_as_verls_own_async_sampler(store: FakeStore) -> None:
    """One source with the quota = the batch: verl's ReplayBufferAsync and KnitdataSampler, each on a copy of the
    same store, evict the same stale groups and deliver the same keys with the same tags."""
    rollout = Rollout(store)
    for g in (1, 2, 3, 4):
        rollout.global_steps = g
        for u in rollout.dispatch(["math"] * (2 if g < 4 else 4), global_steps=g):
            rollout.finish(u)
    snapshot = copy.deepcopy(store.parts)
    results = []
    for cls in ("verl", "knitdata"):
        store.parts = copy.deepcopy(snapshot)
        store.cleared = []
        refills: list[int] = []
        if cls == "verl":
            buf = ReplayBufferAsync(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2,
                                    max_off_policy_strategy="drop", sampler_kwargs={}, poll_interval=0,
                                    refill_fn=refills.append)
        else:
            buf = make(store, None, quotas={"math": 4}, T=2)
            buf.refill_fn, buf.refill_multiple = refills.append, 1
        batch, _ = buf.sample(global_steps=5, partition_id="train", batch_size=4)
        evicted = {k.split("_")[0] for k in set(snapshot["train"]) - store.keys()} - set(groups_of(batch))
        results.append((sorted(zip(batch.keys, [sorted(t.items()) for t in batch.tags])), evicted, refills))
    assert results[0] == results[1]
    assert len(results[0][1]) == 6  # the groups of steps 1-3 (span 5 - P + 1 > 2)


def test_a_source_whose_groups_keep_arriving_stale_is_reported_starved(store: FakeStore) -> None:
    rollout = Rollout(store)
    rollout.mix = ["a"]
    sampler = make(store, rollout, quotas={"a": 1, "b": 1}, M=2, T=1, refill_multiple=1)
    stale = rollout.dispatch(["a", "a"], global_steps=0)  # e.g. left from before a restart, finished late
    (fresh_b,) = rollout.dispatch(["b"])
    for u in (*stale, fresh_b):
        rollout.finish(u)
    batch, metrics = sampler.sample(1, "train", 1)
    assert groups_of(batch) == [fresh_b]
    assert metrics["training/knitdata/dropped/a"] == 2 and metrics["training/knitdata/bound_starved/a"] == 1
    assert rollout.refills == [2]  # both dropped in one read of the store, refilled together
    for u in list(rollout.inflight):  # the refills: fresh groups of a
        rollout.finish(u)
    batch, metrics = sampler.sample(1, "train", 1)
    assert rollout.source[groups_of(batch)[0]] == "a" and metrics["training/knitdata/bound_starved/a"] == 0


@pytest.mark.parametrize("strategy", ["wait", "drop"])
def test_wait_holds_the_step_until_groups_at_their_last_step_finish(store: FakeStore, strategy: str) -> None:
    rollout = Rollout(store)
    rollout.mix = ["a"]
    sampler = make(store, rollout, quotas={"a": 2}, T=2, strategy=strategy, refill_multiple=1)
    old = rollout.dispatch(["a"] * 4)
    rollout.finish(old[0])
    rollout.finish(old[1])
    assert groups_of(sampler.sample(1, "train", 2)[0]) == old[:2]
    rollout.global_steps = 2
    new = rollout.dispatch(["a", "a"])
    rollout.finish(new[0])
    rollout.finish(new[1])
    calls = store.list_calls
    store.on_list.append(lambda: [rollout.finish(u) for u in old[2:] if u in rollout.inflight]
                         if store.list_calls >= calls + 5 else None)
    got = groups_of(sampler.sample(2, "train", 2)[0])
    if strategy == "wait":  # old[2:] are at their last admissible step (2 - 1 + 1 = T): waited for, trained
        assert got == old[2:] and store.list_calls >= calls + 5
        return
    # drop: the ready ones now; old[2:] finish later, past the bound at step 3, and are dropped
    assert got == new and store.list_calls == calls + 1
    rollout.global_steps = 3
    third = rollout.dispatch(["a", "a"])
    for u in [*old[2:], *third]:
        rollout.finish(u)
    batch, metrics = sampler.sample(3, "train", 2)
    assert groups_of(batch) == third and metrics["training/off_policy/evicted_samples"] == 2


def test_failed_groups_are_cleared_and_refilled_in_multiples(store: FakeStore) -> None:
    rollout = Rollout(store)
    rollout.mix = ["a"]
    sampler = make(store, rollout, quotas={"a": 2}, refill_multiple=2)
    uids = rollout.dispatch(["a"] * 4)
    rollout.finish(uids[0], fail=True)
    rollout.finish(uids[1])
    rollout.finish(uids[2])
    batch, metrics = sampler.sample(1, "train", 2)
    assert groups_of(batch) == uids[1:3] and metrics["training/rollout_failure/evicted_samples"] == 1
    assert rollout.refills == [] and not any(k.startswith(uids[0]) for k in store.keys())  # 1 owed, kept as credit
    rollout.finish(uids[3], fail=True)
    store.on_list.append(lambda: [rollout.finish(u) for u in list(rollout.inflight)])
    batch, _ = sampler.sample(2, "train", 2)
    assert rollout.refills == [2] and len(groups_of(batch)) == 2


def test_a_starved_source_is_asked_for_when_nothing_generates_and_named_on_timeout(store: FakeStore) -> None:
    rollout = Rollout(store)
    rollout.mix = ["b"]
    sampler = make(store, rollout, quotas={"a": 1, "b": 1}, refill_multiple=1)
    for u in rollout.dispatch(["a", "a"]):
        rollout.finish(u)
    store.on_list.append(lambda: [rollout.finish(u) for u in list(rollout.inflight)])
    batch, metrics = sampler.sample(1, "train", 2)
    assert rollout.refills == [1] and metrics["training/knitdata/starved/b"] == 1
    assert metrics["training/knitdata/starvation_refills"] == 1
    assert sorted(rollout.source[u] for u in groups_of(batch)) == ["a", "b"]
    lonely = make(store, None, quotas={"a": 1, "b": 1}, timeout_s=0.05)
    with pytest.raises(DataTimeoutError, match=r"short \{'b': 1\}"):
        lonely.sample(1, "train", 2)


def test_a_new_sampler_over_the_restored_store_resumes_exactly(store: FakeStore) -> None:
    rng = random.Random(7)
    rollout = Rollout(store)
    rollout.mix = ["math", "code", "math", "math"]
    quotas = {"math": 3, "code": 1}
    first = make(store, rollout, quotas=quotas, M=2, T=3, refill_multiple=1)
    store.on_list.append(lambda: finish_randomly(rollout, rng, 2))
    rollout.dispatch(rollout.mix * 2)
    rec = run_steps(store, rollout, first, steps=2)
    # verl saved TransferQueue after step 2 and the process died; on resume a new sampler reads the restored store
    saved = copy.deepcopy(store.parts)
    store.parts = saved
    second = make(store, rollout, quotas=quotas, M=2, T=3, refill_multiple=1)
    run_steps(store, rollout, second, steps=2, start=3, record=rec)
    assert len(rec["delivered"]) == len(set(rec["delivered"])) == 4 * 4
    for step in rec["batches"]:
        assert sorted(rollout.source[u] for mb in step for u in mb) == ["code"] + ["math"] * 3


def test_validation_partition_takes_the_oldest_finished_groups(store: FakeStore) -> None:
    rollout = Rollout(store, partition="val")
    sampler = make(store, None, quotas={"math": 2})
    uids = rollout.dispatch(["math", "other", "math"])
    for u in uids[::-1]:
        rollout.finish(u)
    batch, metrics = sampler.sample(1, "val", 3)
    assert groups_of(batch) == uids and metrics == {} and batch.partition_id == "val"
    assert not store.keys("val") & set(uids)


def test_sampleable_counts_for_verls_hybrid_rollout_switch(store: FakeStore) -> None:
    rollout = Rollout(store)
    sampler = make(store, rollout, quotas={"a": 2})
    uids = rollout.dispatch(["a"] * 3)
    assert sampler.get_sampleable_count(1, "train") == 0
    rollout.finish(uids[0])
    assert sampler.get_sampleable_count(1, "train") == 1
    store.on_list.append(lambda: [rollout.finish(u) for u in list(rollout.inflight)])
    ready, metrics = sampler.wait_for_sampleable(1, "train", 3)
    assert ready == set(uids) and metrics == {}
    assert groups_of(sampler.sample(1, "train", 2)[0]) == uids[:2]


# ---------------------------------------------------------------------- regenerate=same_prompt (a private verl path)
class Trainer:
    """What :func:`reissue` uses of verl's ``PPOTrainer``: ``_add_prompts_to_generate`` (passed as ``refill_fn``)
    and ``agent_loop_manager.generate_sequences`` (here: the rollout starts the prompts again)."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout, self.generated = rollout, []
        self.agent_loop_manager = types.SimpleNamespace(generate_sequences=self._generate)

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        return self.rollout.refill(num_prompts)

    def _generate(self, batch: Any) -> None:
        self.generated.append(batch)
        for uid in batch["uid"]:
            self.rollout.version[uid] = batch["global_steps"]
            self.rollout.inflight.append(uid)


def test_same_prompt_generates_a_dropped_group_again_instead_of_the_next_dataloader_prompt(store: FakeStore) -> None:
    rollout = Rollout(store)
    rollout.mix = ["a"]
    trainer = Trainer(rollout)
    sampler = make(store, None, quotas={"a": 1, "b": 1}, T=1, regenerate="same_prompt",
                   refill_fn=trainer._add_prompts_to_generate)
    (stale,) = rollout.dispatch(["b"], global_steps=0)
    (fresh,) = rollout.dispatch(["a"])
    rollout.finish(stale)
    rollout.finish(fresh)
    store.on_list.append(lambda: [rollout.finish(u) for u in list(rollout.inflight)] if trainer.generated else None)
    batch, metrics = sampler.sample(1, "train", 2)
    assert sorted(groups_of(batch)) == sorted([stale, fresh])  # the b prompt, generated again at step 1
    assert rollout.refills == [] and metrics["training/knitdata/regenerated"] == 1
    (again,) = trainer.generated
    assert list(again["uid"]) == [stale] and list(again["data_source"]) == ["b"] and again["global_steps"] == 1
    assert all(t["global_steps"] == 1 for k, t in zip(batch.keys, batch.tags) if k.startswith(stale))


def test_the_reissue_copy_follows_the_pinned_verls_private_method() -> None:
    """:func:`reissue` copies ``PPOTrainer._reissue_inflight_prompts`` of verl 0.9.1: the calls it makes are there."""
    import inspect

    src = inspect.getsource(PPOTrainer._reissue_inflight_prompts)
    for line in ('batch = tq.kv_batch_get(keys=inflight_uids, partition_id=partition_id)',
                 'tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)',
                 'tags = [{"is_prompt": True, "status": "pending", "global_steps": self.global_steps}',
                 'tq.kv_batch_put(keys=inflight_uids, partition_id=partition_id, tags=tags)',
                 'self.agent_loop_manager.generate_sequences(batch)'):
        assert line in src, line
    assert "refill_fn=self._add_prompts_to_generate" in inspect.getsource(PPOTrainer._build_replay_buffer)
    cfg = _compose(["trainer.v1.trainer_mode=colocate_async", f"trainer.v1.sampler.custom_sampler.path={PLUGIN}",
                    "trainer.v1.sampler.custom_sampler.name=KnitdataSampler",
                    "+trainer.v1.sampler.sampler_kwargs={quotas: {a: 1}, regenerate: same_prompt}",
                    "data.train_batch_size=1"])

    class Stub:
        config, trainer_mode = cfg, "colocate_async"

        def _add_prompts_to_generate(self, num_prompts: int) -> int:
            return num_prompts

    stub = Stub()
    sampler = PPOTrainer._build_replay_buffer(stub)
    assert sampler.regenerate == "same_prompt" and sampler._trainer is stub
    with pytest.raises(ConfigError, match="refill_fn must be the trainer's _add_prompts_to_generate"):
        make(FakeStore(), Rollout(FakeStore()), quotas={"a": 1}, regenerate="same_prompt")
    with pytest.raises(ConfigError, match="needs an async trainer_mode"):
        KnitdataSampler("sync", {}, None, "drop", {"quotas": {"a": 1}, "regenerate": "same_prompt"},
                        refill_fn=stub._add_prompts_to_generate)


# ----------------------------------------------------------------------------------------------------- bad input
def test_a_group_of_an_unknown_source_is_named_and_nothing_is_lost(store: FakeStore) -> None:
    rollout = Rollout(store)
    sampler = make(store, rollout, quotas={"math": 2})
    good = rollout.dispatch(["math", "math"])
    (bad,) = rollout.dispatch(["poetry"])
    for u in (*good, bad):
        rollout.finish(u)
    before = store.kv_list()
    with pytest.raises(ValidationError, match=rf"verl group '{bad}': data_source 'poetry' has no quota"):
        sampler.sample(1, "train", 2)
    assert store.kv_list() == before and store.cleared == []
    with pytest.raises(ValidationError, match=rf"group '{bad}'"):
        make(store, rollout, quotas={"math": 2}).sample(1, "train", 2)


def test_a_group_without_a_source_field_is_named(store: FakeStore) -> None:
    rollout = Rollout(store)
    sampler = make(store, rollout, quotas={"math": 1})
    (u,) = rollout.dispatch(["math"])
    rollout.finish(u, field="source")
    (w,) = rollout.dispatch(["math"])
    rollout.finish(w)
    with pytest.raises(ValidationError, match=rf"verl group '{u}' \(trajectory '{u}_0_0', partition 'train'\) has no "
                                              "'data_source' field"):
        sampler.sample(1, "train", 1)
    store.parts.clear()
    (v,) = rollout.dispatch(["math"])
    rollout.finish(v, source="")
    with pytest.raises(ValidationError, match="non-empty string"):
        make(store, rollout, quotas={"math": 1}, source_field="data_source").sample(1, "train", 1)


def test_a_call_out_of_step_or_of_another_size_is_refused(store: FakeStore) -> None:
    rollout = Rollout(store)
    sampler = make(store, rollout, quotas={"a": 4}, M=2)
    for u in rollout.dispatch(["a"] * 8):
        rollout.finish(u)
    with pytest.raises(ConfigError, match="batch_size=4.*mini-batches of 2"):
        sampler.sample(1, "train", 4)
    sampler.sample(1, "train", 2)
    with pytest.raises(StateError, match="global_steps=2.*at global step 1, mini-batch 1 of 2"):
        sampler.sample(2, "train", 2)
    sampler.sample(1, "train", 2)
    sampler.sample(2, "train", 2)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sampler_kwargs": {}}, "sampler_kwargs.quotas must map"),
    ({"sampler_kwargs": {"quotas": {"a": 2}, "quota": 1}}, r"unknown keys \['quota'\]"),
    ({"sampler_kwargs": {"quotas": {"a": 3}}, "trainer_config": {"parameter_sync_step": 2}}, "parameter_sync_step=2"),
    ({"sampler_kwargs": {"quotas": {"a": 2}, "policy": "lifo"}}, "unknown admission policy 'lifo'"),
    ({"sampler_kwargs": {"quotas": {"a": 2}, "bounds": {"b": [0, 1]}}}, "bounds names source 'b'"),
    ({"max_off_policy_threshold": 0}, "max_off_policy_threshold must be null or an int >= 1"),
    ({"max_off_policy_strategy": "keep"}, "max_off_policy_strategy must be 'drop' or 'wait'"),
    ({"filter_groups_metric": "acc"}, "filter_groups"),
    ({"sampler_kwargs": {"quotas": {"a": 2}, "timeout_s": 0}}, "timeout_s"),
    ({"sampler_kwargs": {"quotas": {"a": 2}, "refill_multiple": 0}}, "refill_multiple"),
])
def test_bad_settings_are_refused_with_their_config_path(kwargs: dict[str, Any], message: str | None) -> None:
    args: dict[str, Any] = {"trainer_mode": "separate_async", "trainer_config": {}, "max_off_policy_threshold": None,
                            "max_off_policy_strategy": "drop", "sampler_kwargs": {"quotas": {"a": 2}}}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message or "."):
        KnitdataSampler(**args)


def test_staleness_in_minibatches_is_verls_rule() -> None:
    for T in (1, 2, 5):
        for M in (1, 2, 4):
            eta = staleness_in_minibatches(T, M)
            for P in range(0, 8):
                for G in range(P, P + 8):
                    knit = all(G * M + k - P * M <= eta for k in range(M))  # type: ignore[operator]
                    assert knit == (G - P + 1 <= T)
    assert staleness_in_minibatches(None, 3) is None


@pytest.mark.slow
def test_on_a_real_transferqueue() -> None:
    """The fake store's answers are TransferQueue's: the same run on a real one (Ray on loopback, about 20 s to
    start) delivers exact quotas per global step, drops the stale group, clears and refills the failed one."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from _ray_helpers import run_json_subprocess

    out = run_json_subprocess([sys.executable, str(ROOT / "tests" / "_verl_real_tq.py")], "verl on TransferQueue",
                              timeout_s=240)
    for step in out["steps"]:
        assert [len(mb) for mb in step] == [2, 2]
        assert sorted(s for mb in step for s in mb) == ["code", "math", "math", "math"]
    metrics = out["metrics"]
    assert sum(m.get("training/rollout_failure/evicted_samples", 0) for m in metrics) == 1
    assert sum(m.get("training/off_policy/evicted_samples", 0) for m in metrics) >= 1
    assert all(m["training/knitdata/off_policy_span/max"] <= 1 for m in metrics)
    assert sum(out["refills"]) >= 2
