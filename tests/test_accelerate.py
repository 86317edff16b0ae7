"""knitdata.integrations.accelerate: prepare() leaves the loader alone, device placement, plan-driven gradient
accumulation (single process and under DDP with two gloo ranks), and per-rank state through save_state/load_state.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _accelerate_helpers import SPEC, TinyLM, ddp_worker, make_trajs, token_loss_sum  # noqa: E402
from _state_harness import run_test_save_load_state  # noqa: E402

from knitdata.errors import ConfigError, StateError, ValidationError  # noqa: E402
from knitdata.integrations.accelerate import AcceleratedLoader, prepare_loader, rank_and_world, state_path  # noqa: E402
from knitdata.pipeline import Pipeline  # noqa: E402

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def acc():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    a = Accelerator(cpu=True)
    yield a
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _filled_pipeline(train_batches: int = 2, consumers: int = 1, plans: list | None = None) -> Pipeline:
    cb = None if plans is None else (lambda a, p: plans.append(p))
    pipe = Pipeline(SPEC, num_consumers=consumers, token_budget=24, on_plan=cb)
    for t in make_trajs(train_batches):
        pipe.put(t)
    pipe.close()
    return pipe


def _ids(mbs) -> list[tuple[int, int, tuple[str, ...]]]:
    return [(mb.info.minibatch, mb.info.microbatch, mb.info.trajectory_ids) for mb in mbs]


def test_prepare_passes_loader_through_and_rank_world(acc):
    loader = prepare_loader(acc, _filled_pipeline())
    assert not isinstance(loader, torch.utils.data.DataLoader)
    assert acc.prepare(loader) is loader
    assert acc._dataloaders == []  # Accelerate did not register (and will not re-shard) it
    assert (loader.rank, loader.world) == rank_and_world(acc) == (0, 1)
    assert not hasattr(loader, "generator") and not hasattr(loader.dataset, "generator")
    loader.set_epoch(3)
    assert loader.dataset.epoch == 3
    loader.close()


def test_delivers_plan_in_order_on_accelerator_device(acc):
    plans: list = []
    pipe = _filled_pipeline(plans=plans)
    loader = prepare_loader(acc, pipe, fetch="iter")
    got = list(loader)
    expected = [(p.minibatch, pmb.microbatch, pmb.trajectory_ids) for p in plans for pmb in p.microbatches[0]]
    assert _ids(got) == expected and len(got) > 0
    assert sorted(i for *_, ids in expected for i in ids) == sorted(t.id for t in make_trajs(2))
    for mb in got:
        assert mb.input_ids.device == acc.device
    assert loader.last_info == got[-1].info
    loader.close()


def test_config_errors(acc):
    pipe = _filled_pipeline(consumers=2)
    with pytest.raises(ConfigError, match="num_consumers=accelerator.num_processes"):
        prepare_loader(acc, pipe)
    with pytest.raises(ConfigError, match="rank 1"):
        AcceleratedLoader(pipe.dataset(1), acc)
    with pytest.raises(ConfigError, match="Pipeline"):
        prepare_loader(acc, object())
    acc.gradient_state.plugin_kwargs["num_steps"] = 4  # as Accelerator(gradient_accumulation_steps=4) would
    try:
        with pytest.raises(ConfigError, match="gradient_accumulation_steps=1"):
            prepare_loader(acc, _filled_pipeline())
    finally:
        acc.gradient_state.plugin_kwargs["num_steps"] = 1


def test_factory_source(acc):
    pipe = _filled_pipeline()
    seen = []

    def factory(rank, world):
        seen.append((rank, world))
        return pipe.dataset(rank, fetch="sample")

    loader = prepare_loader(acc, factory)
    assert seen == [(0, 1)] and len(list(loader)) > 0
    with pytest.raises(ConfigError):
        prepare_loader(acc, factory, fetch="iter")


def test_accumulate_steps_optimizer_only_on_last_microbatch(acc):
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    loader = prepare_loader(acc, _filled_pipeline(1), fetch="eager")
    seen_multi = False
    for mb in loader:
        before = [p.detach().clone() for p in model.parameters()]
        with loader.accumulate(model, mb):
            assert acc.sync_gradients == mb.info.is_last
            acc.backward(token_loss_sum(model, mb) * loader.loss_scale(mb))
            opt.step()
            opt.zero_grad()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert changed == mb.info.is_last, mb.info
        if mb.info.num_microbatches > 1:
            seen_multi = True
            if not mb.info.is_last:  # gradients kept for accumulation
                assert all(p.grad is not None for p in model.parameters())
    assert seen_multi, "workload should have mini-batches of several micro-batches"
    assert loader.loss_scale(mb) == pytest.approx(1.0 / mb.info.global_loss_tokens)
    with pytest.raises(ValidationError):
        loader.loss_scale(object())


def test_save_load_state_through_accelerator_hooks(acc, tmp_path):
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    full = _ids(prepare_loader(acc, _filled_pipeline(3), register_hooks=False))

    loader = prepare_loader(acc, _filled_pipeline(3), fetch="iter")
    first = []
    for mb in loader:
        first.append(mb)
        if mb.info.is_last and mb.info.minibatch == 2:
            break
    acc.save_state(str(tmp_path / "ckpt"))
    f = state_path(tmp_path / "ckpt", 0)
    assert f.name == "knitdata_loader_rank0.json"
    state = json.loads(f.read_text())
    assert state["rank"] == 0 and state["world"] == 1 and state["dataset"]["minibatch"] == 3
    loader.close()

    # a fresh pipeline fed the same puts, a fresh loader, load_state positions it through the hook
    loader2 = prepare_loader(acc, _filled_pipeline(3), fetch="iter")
    acc.load_state(str(tmp_path / "ckpt"))
    rest = list(loader2)
    got = _ids(first) + _ids(rest)
    assert got == full
    assert len({i for *_, ids in got for i in ids}) == sum(len(ids) for *_, ids in got)  # no duplicates
    loader2.close()


def test_state_errors(acc, tmp_path):
    loader = prepare_loader(acc, _filled_pipeline(), register_hooks=False)
    with pytest.raises(StateError, match="knitdata_loader_rank0.json"):
        loader.load_state(tmp_path)
    bad = loader.state_dict()
    bad["rank"] = 1
    with pytest.raises(StateError, match="same number of processes"):
        loader.load_state_dict(bad)
    (tmp_path / "knitdata_loader_rank0.json").write_text("{not json")
    with pytest.raises(StateError, match="damaged"):
        loader.load_state(tmp_path)
    p = loader.save_state(tmp_path / "x")
    json.loads(p.read_text())
    loader.load_state(tmp_path / "x")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DDP_TIMEOUT_S = 120


@pytest.mark.timeout(DDP_TIMEOUT_S + 30)
def test_ddp_two_ranks_gradient_equals_full_minibatch_mean(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(ddp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + DDP_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"2-rank Accelerate run did not finish within {DDP_TIMEOUT_S}s (hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ids_per_rank = []
    for r, d in enumerate(res):
        assert "error" not in d, d["error"]
        assert (d["process_index"], d["num_processes"]) == (r, 2)
        assert "MULTI_CPU" in d["distributed_type"]
        lasts = [s for s in d["steps"] if s["is_last"]]
        assert len(lasts) == SPEC.num_minibatches
        for s in d["steps"]:
            assert s["sync_gradients"] == s["is_last"]
        for s in lasts:
            assert s["same_on_ranks"] and s["grad_norm"] > 0
            assert s["max_abs_err"] < 1e-12, s
        ids_per_rank.append({i for s in d["steps"] for i in s["ids"]})
    # the two ranks got disjoint shares covering the train batch, in the same number of micro-batches
    assert not (ids_per_rank[0] & ids_per_rank[1])
    assert ids_per_rank[0] | ids_per_rank[1] == {t.id for t in make_trajs(1)}
    assert [(s["minibatch"], s["microbatch"]) for s in res[0]["steps"]] == [
        (s["minibatch"], s["microbatch"]) for s in res[1]["steps"]
    ]


class _CommittingDataset:
    """A dataset with ``commit`` (as the Ray engine's, with release="commit")."""

    rank = 0

    def __init__(self):
        self.pos = 0
        self.commits: list[dict] = []

    def __iter__(self):
        return iter(())

    def state_dict(self):
        return {"next": self.pos}

    def load_state_dict(self, state):
        self.pos = state["next"]

    def set_epoch(self, epoch):
        pass

    def commit(self, state):
        self.commits.append(dict(state))
        return state["next"]


class _Plain(_CommittingDataset):
    commit = None


def test_save_state_commits_after_writing(acc, tmp_path):
    ds = _CommittingDataset()
    ds.pos = 7
    loader = AcceleratedLoader(ds, acc, register_hooks=False)
    path = loader.save_state(tmp_path)
    assert json.loads(path.read_text())["dataset"] == {"next": 7}
    assert ds.commits == [{"next": 7}]
    assert loader.commit() == 7
    ds2 = _CommittingDataset()
    AcceleratedLoader(ds2, acc, register_hooks=False, commit_on_save=False).save_state(tmp_path / "b")
    assert ds2.commits == []
    assert AcceleratedLoader(_Plain(), acc, register_hooks=False).commit() is None  # nothing to commit


@pytest.mark.parametrize("fetch", ["eager", "iter"])
def test_loader_state_harness(acc, fetch):
    """The shared save/load check (tests/_state_harness.py): the Accelerate loader's state (the dataset's
    position, epoch, last info) taken after any micro-batch resumes a fresh loader on a fresh pipeline."""
    n = len(list(prepare_loader(acc, _filled_pipeline(), fetch=fetch, register_hooks=False)))

    def make():
        loader = prepare_loader(acc, _filled_pipeline(), fetch=fetch, register_hooks=False)
        loader.set_epoch(2)
        return loader

    ref = run_test_save_load_state(make, range(n + 1), key=lambda mb: (*_ids([mb])[0], mb.input_ids.tolist()))
    assert len(ref[0]) == n > 2


def test_load_state_of_another_world_size_merges_every_rank(acc, tmp_path):
    """Issue 25.1: a checkpoint written by 2 processes loads into 1 (every knitdata_loader_rank*.json is read
    and the dataset states merged): every trajectory once, none lost."""
    two = Pipeline(SPEC, num_consumers=2, token_budget=24)
    trajs = make_trajs(2)
    for t in trajs:
        two.put(t)
    two.close()
    template = AcceleratedLoader(_filled_pipeline().dataset(0), acc, register_hooks=False).state_dict()
    taken = []
    for r in range(2):
        ds = two.dataset(r, fetch="sample")
        for k, mb in enumerate(ds):
            taken += mb.info.trajectory_ids
            if k == r:
                break
        state = {**template, "rank": r, "world": 2, "dataset": ds.state_dict()}
        (tmp_path / f"knitdata_loader_rank{r}.json").write_text(json.dumps(state))
        ds.close()
    one = Pipeline(SPEC, num_consumers=1, token_budget=24)
    loader = prepare_loader(acc, one, register_hooks=False, fetch="sample")
    assert loader.load_state(tmp_path) == tmp_path  # the world differs: every rank's file merged
    for t in trajs:
        one.put(t)
    one.close()
    rest = [i for mb in loader for i in mb.info.trajectory_ids]
    assert sorted(taken + rest) == sorted(t.id for t in trajs)
    (tmp_path / "knitdata_loader_rank1.json").unlink()
    with pytest.raises(StateError, match=r"ranks \[1\] are missing"):
        prepare_loader(acc, Pipeline(SPEC, num_consumers=1, token_budget=24), register_hooks=False).load_state(tmp_path)


# ---------------------------------------------------------------------------------------------- metrics to trackers
def test_log_every_is_checked(acc):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="log_every"):
            prepare_loader(acc, _filled_pipeline(), log_every=bad)


def test_log_metrics_needs_a_knitdata_dataset(acc):
    from knitdata.integrations.accelerate import log_metrics

    with pytest.raises(ConfigError, match="step_metrics"):
        log_metrics(acc, [1, 2, 3])


@pytest.mark.timeout(300)
def test_example_logs_knitdata_metrics_to_tensorboard(tmp_path):
    """The GRPO example with ``--log-with tensorboard`` (one process, as its docstring says): knitdata's per-step
    metrics reach TensorBoard's event file through ``accelerator.log``; read back with TensorBoard's own reader."""
    import subprocess

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(__file__).resolve().parent.parent
    logdir = tmp_path / "runs"
    out = tmp_path / "grpo.json"
    proc = subprocess.run([sys.executable, str(root / "examples" / "grpo_accelerate.py"), "--engine", "embedded",
                           "--train-batches", "2", "--log-with", "tensorboard", "--log-dir", str(logdir),
                           "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = list(logdir.rglob("events.out.tfevents.*"))
    assert events, f"no event file under {logdir}: {list(logdir.rglob('*'))}"
    acc_ = EventAccumulator(str(events[0].parent))
    acc_.Reload()
    tags = set(acc_.Tags()["scalars"])
    steps = json.loads(out.read_text())["ranks"][0]["final_version"]
    for tag in ("knitdata/staleness/mean", "knitdata/staleness/p95", "knitdata/staleness/max",
                "knitdata/data_wait_s", "knitdata/bytes_local", "knitdata/bytes_remote",
                "knitdata/admission_delay_s/mean", "knitdata/store/fill", "knitdata/store/spilled_items"):
        assert tag in tags, sorted(tags)
    assert any(t.startswith("knitdata/staleness/") and t.count("/") == 3 for t in tags)  # per source
    fill = acc_.Scalars("knitdata/store/fill")
    assert [e.step for e in fill] == list(range(steps))  # one point per optimizer step
    assert all(0.0 <= e.value <= 1.0 for e in fill)
    assert acc_.Scalars("knitdata/steps")[-1].value == steps


# ---------------------------------------------------------------------------------------------- several loaders
def _run_phase(ckpt: Path, phase: str, out: Path) -> dict:
    import subprocess

    # os._exit once the result is written: a rare C++ abort in interpreter teardown ("terminate called without an
    # active exception", torch's threads) is not what this test checks
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from _accelerate_helpers import two_loaders_phase; "
            "two_loaders_phase(*sys.argv[2:]); os._exit(0)")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(ckpt), phase, str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    return result


@pytest.mark.timeout(300)
def test_train_and_eval_loaders_resume_each_their_own_state(tmp_path):
    """Issue 45.4: a train and an eval loader built with default names on one Accelerator keep two state files;
    after accelerator.load_state in a new process each continues where it stopped: nothing trained twice, none lost."""
    ckpt = tmp_path / "ckpt"
    before = _run_phase(ckpt, "save", tmp_path / "save.json")
    after = _run_phase(ckpt, "load", tmp_path / "load.json")
    assert before["names"] == after["names"] and len(set(before["names"])) == 2
    assert len(before["files"]) == 2, before["files"]  # one file per loader (rank 0 each)
    for role, batches in (("train", 3), ("eval", 2)):
        ids = before["seen"][role] + after["seen"][role]
        assert before["seen"][role] and after["seen"][role], role
        assert len(ids) == len(set(ids)), f"{role}: handed out twice: {sorted(i for i in ids if ids.count(i) > 1)}"
        assert sorted(ids) == sorted(t.id for t in make_trajs(batches)), role


def test_two_hooked_loaders_with_one_name_are_refused(acc):
    """Issue 45.4: two loaders hooked to one Accelerator under the same explicit name would write one file."""
    train = prepare_loader(acc, _filled_pipeline(), name="loader")
    with pytest.raises(ConfigError, match=r"'loader'.*already"):
        prepare_loader(acc, _filled_pipeline(), name="loader")
    train.close()  # its hooks and name are released
    again = prepare_loader(acc, _filled_pipeline(), name="loader")
    assert again.name == "loader"
    again.close()
