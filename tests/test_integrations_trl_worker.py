"""knitdata.integrations.trl.worker: the AsyncGRPOTrainer rollout worker against TRL 1.16's real data path.

The test thread plays the trainer's side without a model: TRL's ``RolloutQueueDataset`` (its staleness drop),
``FixedCountBatcher`` and ``DataCollatorForRollout`` read the worker's queue, and after each optimizer step's
micro-batches the test syncs weights (the engine's ``send_weights``) and calls ``update_model_version`` as
``AsyncGRPOTrainer._sync_weight`` does. The full trainer runs in tests/test_example_trl_async_grpo.py.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections import defaultdict
from types import SimpleNamespace as NS
from typing import Any

import pytest

pytest.importorskip("trl")
warnings.filterwarnings("ignore", message=".*experimental.*")

import torch  # noqa: E402
from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import (  # noqa: E402
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
)

from knitdata import BatchSpec  # noqa: E402
from knitdata.errors import ConfigError, StateError  # noqa: E402
from knitdata.integrations.trl import STATE_FILE, KnitdataRolloutWorker, trained_prompts  # noqa: E402
from knitdata.rollout import RolloutGroup, RolloutSample  # noqa: E402

EOS = 2


class ScriptedEngine:
    """Generates ``prompt[0] % 5 + 1`` tokens per response (prompt 0 of each source ends at once), one token per
    call when the worker asks for one, ``delay`` seconds a call; ``version`` counts weight syncs as TRL's does."""

    def __init__(self, delay: float = 0.0) -> None:
        self.version, self.delay, self.calls = 0, delay, 0
        self._lock = threading.Lock()

    def pause(self) -> None:
        self._lock.acquire()

    def send_weights(self, iterator: Any) -> None:
        list(iterator)
        self.version += 1

    def resume(self) -> None:
        self._lock.release()

    def generate(self, prompts: Any, *, n: int, max_new_tokens: int, request_ids: Any) -> list[RolloutGroup]:
        time.sleep(self.delay)
        with self._lock:
            self.calls += 1
            out = []
            for p, rid in zip(prompts, request_ids):
                length = int(p[1]) % 5 + 1  # the response's full length, from the prompt
                done = len(p) - 3          # tokens generated before (continuations carry them in the prompt)
                k = min(max_new_tokens, length - done)
                samples = []
                for i in range(n):
                    ids = [10 + i] * (k - 1) + ([EOS] if done + k == length else [10 + i])
                    samples.append(RolloutSample(rid, i, prompt_ids=list(p), response_ids=ids, logprobs=[-0.5] * k,
                                                 status="completed" if ids[-1] == EOS else "truncated",
                                                 finish_reason="stop" if ids[-1] == EOS else "length",
                                                 version=self.version))
                out.append(RolloutGroup(rid, samples))
            return out


def reward(completion_ids: Any, source: Any, **kw: Any) -> list[float]:
    return [float(len(c)) + (0.5 if s == "a" else 0.0) for c, s in zip(completion_ids, source)]


def _args(**over: Any) -> AsyncGRPOConfig:
    base = dict(output_dir="unused", per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=2,
                max_staleness=1, token_budget=0, weight_sync_steps=1, use_cpu=True, report_to=[])
    return AsyncGRPOConfig(**{**base, **over})


def _worker(engine: Any, **kw: Any) -> KnitdataRolloutWorker:
    spec = BatchSpec({"a": 4, "b": 4}, num_minibatches=2, group_size=2)  # 4 samples per step: a group of each
    sources = {s: [[1, i, 7] for i in range(40)] for s in ("a", "b")}
    return KnitdataRolloutWorker(spec, sources, engine, reward, max_new_tokens=5, **kw)


def _train(worker: KnitdataRolloutWorker, engine: ScriptedEngine, args: AsyncGRPOConfig, steps: int,
           start_step: int = 0) -> tuple[list[Any], set[int]]:
    """What AsyncGRPOTrainer does around its data path: cold sync, start, then per step GA micro-batches, a sync."""
    metrics: dict[str, list[Any]] = defaultdict(list)
    worker.configure(args, NS(global_step=start_step))
    version = 0

    def sync() -> None:
        nonlocal version
        engine.pause()
        engine.send_weights(iter([]))
        engine.resume()
        version += 1
        worker.update_model_version(version)

    sync()
    worker.start()
    ds = RolloutQueueDataset(worker.rollout_buffer, lambda: version, worker.check_health, 60.0, metrics,
                             max_staleness=args.max_staleness, poll_interval_s=0.5)
    batches = iter(FixedCountBatcher(ds, 1, args.per_device_train_batch_size))
    groups: set[int] = set()
    collate = DataCollatorForRollout(0, 1, groups_trained=groups, metrics=metrics)
    steps_out = []
    try:
        for _ in range(steps):
            step = [collate([next(batches)]) for _ in range(args.gradient_accumulation_steps)]
            steps_out.append(step)
            sync()
            worker.raise_if_failed()
    finally:
        worker.stop()
    assert metrics["sample/dropped_stale_total"] == []  # TRL's own staleness check dropped nothing
    return steps_out, groups


def test_steps_hold_exact_shares_within_the_bound_and_partial_rollouts_cross_weight_updates() -> None:
    engine = ScriptedEngine(delay=0.005)
    worker = _worker(engine, chunk_tokens=1)
    steps, groups = _train(worker, engine, _args(), steps=8)
    assert len(worker.history) >= 8
    for j, rec in enumerate(worker.history[:8]):
        assert rec.step == j + 1 and rec.per_source == {"a": 2, "b": 2}
        assert rec.trained_version == j + 1
        assert 0 <= rec.max_staleness <= 1
    # TRL's collator trained what the worker recorded: 2 groups a step, plus at most the next step's
    recorded = {worker.group_id(t) for rec in worker.history[:8] for t in rec.trajectory_ids}
    assert recorded <= groups and len(recorded) == 16
    # generations were cut at every token and continued: some under weights newer than their first token's
    spans = [s for rec in worker.history[:8] for s in rec.token_version_spans]
    assert max(spans) >= 1
    # the samples TRL packed carry the engine's log-probs on their response tokens, 0 elsewhere
    for step in steps:
        for batch in step:
            assert set(batch["old_log_probs"][batch["token_index"] >= 0].tolist()) <= {-0.5}


def test_state_saved_after_a_step_resumes_without_repeating_or_losing_prompts(tmp_path: Any) -> None:
    engine = ScriptedEngine()
    worker = _worker(engine)
    _train(worker, engine, _args(), steps=3)
    folder = tmp_path / "checkpoint-2"
    worker.save_state(str(folder), 2)
    state = json.loads((folder / STATE_FILE).read_text())
    first = {t for rec in worker.history[:2] for t in rec.trajectory_ids}
    assert trained_prompts(state) == {"a": [0, 1], "b": [0, 1]}

    engine2 = ScriptedEngine()
    resumed = _worker(engine2)
    resumed.load_state(str(folder))
    _train(resumed, engine2, _args(), steps=2, start_step=2)
    assert [r.step for r in resumed.history[:2]] == [3, 4]
    later = [t for rec in resumed.history[:2] for t in rec.trajectory_ids]
    keys = {(t.split("-p")[0], int(t.split("-p")[1].split("-")[0])) for t in later}
    assert keys == {("a", 2), ("a", 3), ("b", 2), ("b", 3)}  # step 3 of the first run was redone, nothing else
    assert not first & set(later)


def test_resume_without_the_worker_state_or_with_another_spec_is_refused(tmp_path: Any) -> None:
    worker = _worker(ScriptedEngine())
    with pytest.raises(StateError, match="checkpoint-3.*missing"):
        worker.configure(_args(output_dir=str(tmp_path)), NS(global_step=3))
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / STATE_FILE).write_text(json.dumps({"format": "knitdata-trl-worker/1", "global_step": 3,
                                                 "spec": {"other": 1}, "trained": {}}))
    with pytest.raises(StateError, match="saved with spec"):
        worker.configure(_args(output_dir=str(tmp_path)), NS(global_step=3))


@pytest.mark.parametrize("over, words", [
    ({"per_device_train_batch_size": 3}, "6 samples per optimizer step, but the spec's mini-batch holds 4"),
    ({"token_budget": 64}, "token_budget=64"),
    ({"weight_sync_steps": 2}, "weight_sync_steps=2"),
    ({"num_generations": 4}, "num_generations=4"),
    ({"max_staleness": 0}, "max_staleness=0"),  # hung: TRL's loader reads the next step before its weights exist
])
def test_trainer_settings_that_break_step_boundaries_are_refused(over: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        _worker(ScriptedEngine()).configure(_args(**over), NS(global_step=0))


def test_start_without_the_callback_and_bad_construction_are_refused() -> None:
    with pytest.raises(ConfigError, match="callbacks=\\[worker.callback\\]"):
        _worker(ScriptedEngine()).start()
    spec = BatchSpec({"a": 4}, num_minibatches=2, group_size=2)
    with pytest.raises(ConfigError, match="differ from the spec"):
        KnitdataRolloutWorker(spec, {"b": [[1]]}, ScriptedEngine(), reward)
    with pytest.raises(ConfigError, match="no prompts"):
        KnitdataRolloutWorker(spec, {"a": []}, ScriptedEngine(), reward)
    with pytest.raises(ConfigError, match="string prompts need processing_class"):
        w = KnitdataRolloutWorker(spec, {"a": ["hello"]}, ScriptedEngine(), reward)
        w.configure(_args(per_device_train_batch_size=1), NS(global_step=0))
        w.start()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                w.raise_if_failed()
                time.sleep(0.01)
        except StateError as e:
            raise e.__cause__ from None  # the producer's error, raised in the trainer's thread
        finally:
            w.stop()


def test_hf_generation_engine_loads_streamed_weights_and_counts_versions() -> None:
    import transformers

    from knitdata.integrations.trl import HFGenerationEngine

    cfg = transformers.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    policy, copy = transformers.Qwen2ForCausalLM(cfg), transformers.Qwen2ForCausalLM(cfg)
    engine = HFGenerationEngine(copy, pad_token_id=0, eos_token_id=2)
    engine.pause()
    engine.send_weights(iter(policy.named_parameters()))
    engine.resume()
    assert engine.version == 1
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), copy.parameters()))
    [g] = engine.generate([[1, 5, 6]], n=3, max_new_tokens=4, request_ids=["r"])
    s = g.samples[0]
    with torch.no_grad():  # the engine's log-probs are the policy's own
        logits = policy(torch.tensor([[1, 5, 6, *s.response_ids.tolist()]])).logits[0, 2:-1]
    ref = torch.log_softmax(logits, -1).gather(1, s.response_ids[:, None])[:, 0]
    torch.testing.assert_close(s.logprobs, ref, atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="'nope' is not in the generation model"):
        engine.send_weights(iter([("nope", torch.zeros(1))]))


def test_import_without_trl_names_the_extra() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['trl'] = None\n"
            "try:\n    import knitdata.integrations.trl.worker\nexcept ImportError as e:\n"
            "    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("OptionalDependencyError") and "pip install 'knitdata[trl]'" in out, out


def test_a_nan_reward_counts_as_unscored_as_in_trls_own_worker() -> None:
    # TRL's AsyncRolloutWorker turns None into NaN and sums with nansum: a function's NaN is a None. The worker
    # stopped the run instead ("field 'scalars.advantage': must be finite, got nan")
    def half_nan(completion_ids: Any, source: Any, **kw: Any) -> list[float]:
        return [float("nan") if i == 0 else float(len(c)) for i, c in enumerate(completion_ids)]

    engine = ScriptedEngine()
    spec = BatchSpec({"a": 4, "b": 4}, num_minibatches=2, group_size=2)
    worker = KnitdataRolloutWorker(spec, {s: [[1, i, 7] for i in range(40)] for s in ("a", "b")}, engine,
                                   [half_nan, reward], max_new_tokens=5)
    steps, _ = _train(worker, engine, _args(), steps=2)
    assert [rec.per_source for rec in worker.history[:2]] == [{"a": 2, "b": 2}] * 2
    advantages = torch.cat([batch["advantages"].flatten() for step in steps for batch in step])
    assert torch.isfinite(advantages).all()


def test_a_second_train_on_a_stopped_worker_is_refused_at_start() -> None:
    # trainer.train() twice: TRL starts its rollout worker once per trainer and stops it at the end of train(), so
    # the second run waited for TRL's heartbeat (300 s), then failed with a message about admission
    engine = ScriptedEngine()
    worker = _worker(engine)
    _train(worker, engine, _args(), steps=1)
    with pytest.raises(StateError, match="new KnitdataRolloutWorker"):
        worker.configure(_args(), NS(global_step=0))  # the callback, at the second train's begin
    worker.update_model_version(engine.version)      # the same trainer: TRL's model_version goes on
    with pytest.raises(StateError, match="new KnitdataRolloutWorker"):
        worker.start()


def test_hf_generation_engine_leaves_the_process_rng_alone_and_repeats_its_samples() -> None:
    # new-user audit: generate reseeded the process-wide RNG (torch.manual_seed per call), from the worker's thread,
    # so the user's torch.manual_seed no longer decided the trainer's random numbers
    import transformers

    from knitdata.integrations.trl import HFGenerationEngine

    cfg = transformers.Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    engine = HFGenerationEngine(model, pad_token_id=0, eos_token_id=2, seed=7)
    torch.manual_seed(1234)
    alone = torch.rand(5)
    torch.manual_seed(1234)
    first = engine.generate([[5, 6], [7]], n=3, max_new_tokens=6, request_ids=["r0", "r1"])
    assert torch.equal(torch.rand(5), alone)  # the user's seed still decides the stream
    # the samples come from the engine's seed and call count, whatever the process RNG holds
    torch.manual_seed(999)
    again = HFGenerationEngine(model, pad_token_id=0, eos_token_id=2, seed=7).generate(
        [[5, 6], [7]], n=3, max_new_tokens=6, request_ids=["r0", "r1"])
    assert [[s.response_ids.tolist() for s in g.samples] for g in again] == \
        [[s.response_ids.tolist() for s in g.samples] for g in first]
    other = HFGenerationEngine(model, pad_token_id=0, eos_token_id=2, seed=8).generate(
        [[5, 6], [7]], n=3, max_new_tokens=6, request_ids=["r0", "r1"])
    assert [[s.response_ids.tolist() for s in g.samples] for g in other] != \
        [[s.response_ids.tolist() for s in g.samples] for g in first]
    # sampled, not greedy: 6 responses of up to 6 tokens over 48 ids are not all alike
    assert len({tuple(s.response_ids.tolist()) for g in first for s in g.samples}) > 1
    for g, prompt in zip(first, ([5, 6], [7])):  # the behaviour log-probs are still the policy's own
        for s in g.samples:
            with torch.no_grad():
                logits = model(torch.tensor([[*prompt, *s.response_ids.tolist()]])).logits[0, len(prompt) - 1:-1]
            ref = torch.log_softmax(logits, -1).gather(1, s.response_ids[:, None])[:, 0]
            torch.testing.assert_close(s.logprobs, ref, atol=1e-5, rtol=0)


def test_a_normal_end_does_not_warn_and_reports_what_was_generated_ahead() -> None:
    # new-user audit: stop() at the end of every normal train() warned "pipeline closed with N trajectories never
    # admitted" about the groups generated ahead of the last step (here: 4 trajectories of source a)
    spec = BatchSpec({"a": 8, "b": 4}, num_minibatches=2, group_size=2)
    left = []
    for _ in range(4):  # how much is generated ahead is timing: run until some was, at most 4 times
        engine = ScriptedEngine(delay=0.01)
        worker = KnitdataRolloutWorker(spec, {s: [[1, i, 7] for i in range(40)] for s in ("a", "b")}, engine,
                                       reward, max_new_tokens=5, chunk_tokens=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(worker, engine, _args(per_device_train_batch_size=3), steps=3)
        assert not [w for w in caught if "never admitted" in str(w.message)], [str(w.message) for w in caught]
        report = worker.closed_report  # reported where a user reads it, not warned
        assert report is not None and report["dropped_trajectories"] == sum(report["by_source"].values())
        left.append(report["dropped_trajectories"])
        if left[-1]:
            break
    assert left[-1] > 0, left
