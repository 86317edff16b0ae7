"""knitdata.replicas.ThreadGradientSync: the gradient all-reduce of consumer threads of one process (no DDP).

Replicas trained by consumer threads of an embedded pipeline stay bitwise equal, and equal to one model trained on
every micro-batch of each mini-batch; the reduction is exact (rank order) for any number of replicas and shapes;
a failing, ended, late or mismatched thread makes the others raise instead of waiting.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata import BatchSpec, Pipeline, TokenCollator, Trajectory
from knitdata.errors import ConfigError, EngineError
from knitdata.replicas import ThreadGradientSync

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 24


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def loss_sum(model: torch.nn.Module, mb: Any) -> torch.Tensor:
    if mb.is_empty:
        return sum(p.sum() for p in model.parameters()) * 0.0
    logp = torch.log_softmax(model(mb.input_ids)[:, :-1], -1)
    logp = logp.gather(-1, mb.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    adv = (mb.scalars["reward"] - 0.5).to(logp.dtype).unsqueeze(1)
    return -(adv * logp * mb.loss_mask[:, 1:]).sum()


def _trajectories(spec: BatchSpec, seed: int = 0) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in spec.sources:
        for k in range(spec.quotas[s] // spec.group_size):
            prompt = torch.randint(1, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
            for r in range(spec.group_size):
                resp = torch.randint(1, VOCAB, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
                out.append(Trajectory(id=f"{s}{k}r{r}", source=s, group=f"{s}{k}", prompt_ids=prompt.clone(),
                                      response_ids=resp, scalars={"reward": float(torch.rand(1, generator=g))}))
    return out


def _train_threads(world: int, *, average: bool = True, lr: float = 0.5) -> dict[str, Any]:
    """``world`` consumer threads of one embedded pipeline, one replica each (different initial weights, then
    ``broadcast``), SGD with ``all_reduce`` at every ``is_last``; returns the replicas, what each mini-batch held,
    rank 0's initial weights and the trajectories."""
    spec = BatchSpec({"a": 8, "b": 8}, num_minibatches=4, group_size=2)  # 2 groups per step: a rank has none
    trajs = _trajectories(spec)
    pipe = Pipeline(spec, num_consumers=world, token_budget=20)
    for t in trajs:
        pipe.put(t)
    pipe.close()
    sync = ThreadGradientSync(world, average=average, timeout=60)
    torch.manual_seed(0)
    models = [TinyLM().double() for _ in range(world)]  # every replica different until the broadcast
    initial = copy.deepcopy(models[0])
    minibatches: dict[int, list[str]] = {}
    counts: dict[int, int] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def train(rank: int) -> None:
        model = models[rank]
        try:
            sync.broadcast(model, rank)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            for mb in pipe.dataset(rank, timeout=60):
                scale = world if average else 1
                (loss_sum(model, mb) * scale / mb.info.global_loss_tokens).backward()
                with lock:
                    minibatches.setdefault(mb.info.minibatch, []).extend(mb.info.trajectory_ids)
                    counts[mb.info.minibatch] = mb.info.global_loss_tokens
                if mb.info.is_last:
                    sync.all_reduce(model, rank)
                    opt.step()
                    opt.zero_grad()
        except BaseException as e:
            errors.append(e)
            sync.abort(repr(e))

    threads = [threading.Thread(target=train, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return {"models": models, "initial": initial, "minibatches": minibatches, "counts": counts, "trajs": trajs}


@pytest.mark.parametrize("average", [True, False], ids=["average", "sum"])
def test_thread_replicas_stay_bitwise_equal_and_equal_one_model_trained_on_every_microbatch(average):
    run = _train_threads(3, average=average)
    models = run["models"]
    for p0, *others in zip(*(m.parameters() for m in models)):
        assert all(torch.equal(p0, p) for p in others)
    # the reference: one model, each mini-batch's trajectories in one micro-batch, the token mean, one step
    ref = copy.deepcopy(run["initial"])
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    by_id = {t.id: t for t in run["trajs"]}
    collate = TokenCollator()
    assert sorted(run["minibatches"]) == [0, 1, 2, 3]
    for k in sorted(run["minibatches"]):
        mb = collate([by_id[i] for i in run["minibatches"][k]])
        assert mb.num_loss_tokens == run["counts"][k]
        (loss_sum(ref, mb) / run["counts"][k]).backward()  # average of world-scaled = sum of unscaled
        opt.step()
        opt.zero_grad()
    for p, q in zip(models[0].parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), float((p - q).detach().abs().max())
    moved = max(float((p - q).detach().abs().max())
                for p, q in zip(models[0].parameters(), run["initial"].parameters()))
    assert moved > 1e-3  # the steps did train


def _run_ranks(world: int, fn) -> list[Any]:
    """Run ``fn(rank)`` in ``world`` threads; the result or the exception of each."""
    out: list[Any] = [None] * world

    def target(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out[r] = e

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return out


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 4), average=st.booleans(),
       shapes=st.lists(st.lists(st.integers(1, 3), min_size=0, max_size=2), min_size=1, max_size=5),
       none_mask=st.integers(0, 2**20), seed=st.integers(0, 2**16))
def test_all_reduce_is_the_rank_order_sum_on_every_replica(world, average, shapes, none_mask, seed):
    """Any number of replicas and parameter shapes, some gradients missing: every replica gets the sum in rank order
    (divided by the world size with ``average``), bitwise; a parameter without a gradient anywhere keeps none."""
    g = torch.Generator().manual_seed(seed)
    values = [[torch.randn(tuple(s), generator=g, dtype=torch.float64) for s in shapes] for _ in range(world)]
    has = [[bool((none_mask >> (r * len(shapes) + i)) & 1) or r == i % max(world, 1) and i % 3 != 2
            for i in range(len(shapes))] for r in range(world)]
    params = [[torch.nn.Parameter(torch.zeros(tuple(s), dtype=torch.float64)) for s in shapes] for _ in range(world)]
    for r in range(world):
        for i, p in enumerate(params[r]):
            p.grad = values[r][i].clone() if has[r][i] else None
    sync = ThreadGradientSync(world, average=average, timeout=20)
    res = _run_ranks(world, lambda r: sync.all_reduce(params[r], r))
    assert all(x is None for x in res), res
    for i in range(len(shapes)):
        want = None
        for r in range(world):
            if has[r][i]:
                want = values[r][i].clone() if want is None else want + values[r][i]
        if want is not None and average:
            want = want / world
        for r in range(world):
            got = params[r][i].grad
            if want is None:
                assert got is None
            else:
                assert got is not None and torch.equal(got, want), (i, r)


def test_broadcast_copies_rank_src_parameters():
    torch.manual_seed(1)
    models = [TinyLM() for _ in range(3)]
    want = [p.detach().clone() for p in models[2].parameters()]
    sync = ThreadGradientSync(3)
    res = _run_ranks(3, lambda r: sync.broadcast(models[r], r, src=2))
    assert all(x is None for x in res), res
    for m in models:
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), want))
    with pytest.raises(ConfigError, match="src must be a rank"):
        ThreadGradientSync(2).broadcast(models[0], 0, src=2)


def test_a_thread_that_ended_makes_the_others_raise_naming_it():
    sync = ThreadGradientSync(2, timeout=60)
    models = [TinyLM() for _ in range(2)]
    assert _run_ranks(2, lambda r: sync.broadcast(models[r], r)) == [None, None]
    # rank 1's thread has ended (it called before, so it is known); rank 0 reaches the next all-reduce alone
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"rank\(s\) \[1\] ended before reaching all_reduce"):
        sync.all_reduce(models[0], 0)
    assert time.monotonic() - t0 < 5
    with pytest.raises(EngineError, match="stopped"):  # broken for good: build a new one
        sync.all_reduce(models[0], 0)


def test_abort_releases_a_waiting_thread_with_the_reason():
    sync = ThreadGradientSync(2, timeout=60)
    model = TinyLM()
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(_catch(lambda: sync.all_reduce(model, 0))))
    t.start()
    time.sleep(0.3)
    sync.abort("consumer thread 1 failed: StoreFull")
    t.join(5)
    assert not t.is_alive()
    assert isinstance(box[0], EngineError) and "consumer thread 1 failed: StoreFull" in str(box[0])
    assert "rank 0" in str(box[0])


def _catch(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001
        return e


def test_timeout_names_the_missing_ranks():
    sync = ThreadGradientSync(3, timeout=0.3)
    models = [TinyLM() for _ in range(3)]
    t0 = time.monotonic()
    res = _run_ranks(2, lambda r: sync.all_reduce(models[r], r))  # rank 2 never comes
    assert time.monotonic() - t0 < 5
    assert all(isinstance(e, EngineError) for e in res), res
    assert any("waited 0.3s at all_reduce for rank(s) [2]" in str(e) for e in res), res


def test_replicas_of_different_models_are_refused_on_every_rank():
    sync = ThreadGradientSync(2, timeout=10)
    models = [torch.nn.Linear(2, 2), torch.nn.Linear(3, 2)]
    res = _run_ranks(2, lambda r: sync.all_reduce(models[r], r))
    assert all(isinstance(e, (ConfigError, EngineError)) for e in res), res
    assert any(isinstance(e, ConfigError) and "parameter 0 has shape (2, 3) on rank 1 and (2, 2) on rank 0" in str(e)
               for e in res), res
    sync = ThreadGradientSync(2, timeout=10)
    res = _run_ranks(2, lambda r: sync.all_reduce([torch.nn.Parameter(torch.zeros(1))] * (r + 1), r))
    assert any(isinstance(e, ConfigError) and "has 2 parameters, rank 0's 1" in str(e) for e in res), res


def test_bad_arguments_are_config_errors():
    for kw in ({"world_size": 0}, {"world_size": True}, {"world_size": 2.0}, {"world_size": 2, "timeout": -1}):
        with pytest.raises(ConfigError):
            ThreadGradientSync(**kw)
    sync = ThreadGradientSync(2, timeout=0.2)
    with pytest.raises(ConfigError, match=r"rank must be in \[0, 2\)"):
        sync.all_reduce(TinyLM(), 2)
    assert repr(sync) == "ThreadGradientSync(world_size=2, average=True, timeout=0.2)"
    # one rank from two threads at once
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(_catch(lambda: sync.all_reduce(TinyLM(), 0))))
    t.start()
    time.sleep(0.05)
    with pytest.raises((ConfigError, EngineError)):
        sync.all_reduce(TinyLM(), 0)
    t.join(5)


def test_plain_torch_example_keeps_its_thread_replicas_equal(tmp_path, capsys):
    """``examples/plain_torch.py`` with 3 consumer threads: every replica ends with the same parameters."""
    spec = importlib.util.spec_from_file_location("plain_torch_example", ROOT / "examples" / "plain_torch.py")
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ex
    try:
        spec.loader.exec_module(ex)
        threads = torch.get_num_threads()
        try:
            assert ex.main(["--consumers", "3", "--train-batches", "2", "--out", str(tmp_path / "o.json")]) == 0
        finally:
            torch.set_num_threads(threads)
    finally:
        sys.modules.pop(spec.name, None)
    assert "replicas equal: True" in capsys.readouterr().out
    ranks = json.loads((tmp_path / "o.json").read_text())["ranks"]
    assert len(ranks) == 3 and len({d["param_digest"] for d in ranks}) == 1
    assert all(d["steps"] == 4 for d in ranks)
