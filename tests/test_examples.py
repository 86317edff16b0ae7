"""Runs every example: the Accelerate GRPO loop on 2 CPU processes (full run, stop, resume), the plain PyTorch
loop (threads, and torchrun with 2 processes), the standalone loader benchmark, and the rollout worker running
Hugging Face ``generate`` into a pipeline.

The Accelerate checks: two ranks really ran (each reports its own rank, world and pid), each rank received
exactly the micro-batches of the plan (recomputed here, in this process, from the same deterministic rollout),
with payload bytes on every rank, no trajectory reached two ranks, and a stop (``--stop-after`` ->
``accelerator.save_state``) plus a resume (``--resume-from`` -> ``accelerator.load_state``) delivers exactly
the uninterrupted sequence, no duplicates, no gaps, and ends in the same model state.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
TIMEOUT_S = 240
TRAIN_BATCHES = 3
STOP_AFTER = 3  # optimizer steps (mini-batches) before the simulated stop


def _ray_engine_available() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("knitdata.engines.ray.engine") is not None
    except ModuleNotFoundError:
        return False


#: The GRPO example runs on the Ray engine (rollout producer in its own process) when it is installed.
ENGINE = os.environ.get("KNITDATA_EXAMPLES_ENGINE") or ("ray" if _ray_engine_available() else "embedded")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                "MASTER_ADDR": "127.0.0.1", "TOKENIZERS_PARALLELISM": "false",
                "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str], timeout: float = TIMEOUT_S) -> str:
    """Run ``cmd`` in its own process group; kill the whole group on timeout; fail with its output."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout}s (hang?):\n{out[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-6000:]}")
    return out


def _load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"knitdata_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _accelerate_launch(*args: str) -> str:
    return _run([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
                 "--main_process_port", str(_free_port()), str(EXAMPLES / "grpo_accelerate.py"), *args])


# ---------------------------------------------------------------------------------------------- GRPO + Accelerate
@pytest.fixture(scope="module")
def ray_host():
    """The GRPO example's rollout producer as its own process, hosting a loopback Ray cluster with two
    pipelines fed the same rollout: ``full`` (uninterrupted run) and ``sr`` (stop, then resume)."""
    if ENGINE != "ray":
        yield None
        return
    cmd = [sys.executable, str(EXAMPLES / "grpo_accelerate.py"), "--role", "producer", "--pipeline-name", "full,sr",
           "--world", "2", "--train-batches", str(TRAIN_BATCHES)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    seen: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    address = None
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while address is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                pytest.fail(f"the Ray rollout producer did not start within {TIMEOUT_S}s:\n{''.join(seen)[-4000:]}")
            seen.append(line)
            if line.startswith("{") and "address" in line:
                address = json.loads(line)["address"]
        assert address.startswith("127.0.0.1:"), address  # loopback only
        yield address
    finally:
        try:
            proc.stdin.close()
            proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, OSError):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def grpo(tmp_path_factory, ray_host) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("grpo")
    ckpt = tmp / "ckpt"
    common = ["--train-batches", str(TRAIN_BATCHES), "--engine", ENGINE]

    def src(name: str) -> list[str]:
        return ["--ray-address", ray_host, "--pipeline-name", name] if ray_host else []

    outs = {
        "full": _accelerate_launch(*common, *src("full"), "--out", str(tmp / "full.json")),
        "stop": _accelerate_launch(*common, *src("sr"), "--stop-after", str(STOP_AFTER), "--ckpt-dir", str(ckpt),
                                   "--out", str(tmp / "stop.json")),
    }
    outs["resume"] = _accelerate_launch(*common, *src("sr"), "--resume-from", str(ckpt), "--out",
                                        str(tmp / "resume.json"))
    runs = {k: json.loads((tmp / f"{k}.json").read_text()) for k in ("full", "stop", "resume")}
    return {"runs": runs, "stdout": outs, "ckpt": ckpt}


@pytest.fixture(scope="module")
def grpo_plan() -> list[list[tuple[int, int, tuple[str, ...], int]]]:
    """The plan of every rank, recomputed in this process from the example's deterministic rollout."""
    from knitdata.pipeline import Pipeline

    ex = _load_example("grpo_accelerate")
    args = ex.parse_args(["--train-batches", str(TRAIN_BATCHES)])
    spec = ex.make_spec(args.group_size, args.groups_per_source, args.num_minibatches)
    plan: list[list[tuple[int, int, tuple[str, ...], int]]] = [[], []]

    def on_plan(admitted, p):
        for r in range(2):
            plan[r].extend((m.minibatch, m.microbatch, m.trajectory_ids, m.nbytes) for m in p.microbatches[r])

    pipe = Pipeline(spec, num_consumers=2, token_budget=args.token_budget, capacity_bytes=64 << 20, on_plan=on_plan)
    for t in ex.rollout_stream(spec, args.train_batches, args.seed):
        pipe.put(t)
    pipe.close()
    assert plan[0] and plan[1]
    return plan


def _received(rank_entry: dict[str, Any]) -> list[tuple[int, int, tuple[str, ...]]]:
    return [(r["minibatch"], r["microbatch"], tuple(r["ids"])) for r in rank_entry["received"]]


def test_grpo_two_ranks_really_ran(grpo):
    for name, run in grpo["runs"].items():
        ranks = run["ranks"]
        assert run["world"] == 2 and [d["rank"] for d in ranks] == [0, 1], name
        assert all(d["world"] == 2 for d in ranks), name
        assert ranks[0]["pid"] != ranks[1]["pid"], f"{name}: both entries came from one process"
        assert all(d["engine"] == ENGINE for d in ranks), name
    assert "world=2" in grpo["stdout"]["full"]


def test_grpo_each_rank_gets_exactly_its_plan_with_payload(grpo, grpo_plan):
    full = grpo["runs"]["full"]["ranks"]
    for r, d in enumerate(full):
        expected = [(mb, i, ids) for mb, i, ids, _ in grpo_plan[r]]
        assert _received(d) == expected, f"rank {r} did not receive its planned micro-batches"
        if d["planned"]:  # embedded engine: the plan this rank's own pipeline made agrees too
            assert [(p["minibatch"], p["microbatch"], tuple(p["ids"])) for p in d["planned"]] == expected
        # payload bytes received (Trajectory.nbytes of what was collated) match the plan, micro-batch by micro-batch
        assert [x["payload_bytes"] for x in d["received"]] == [nb for *_, nb in grpo_plan[r]]
        assert d["payload_bytes"] == sum(nb for *_, nb in grpo_plan[r]) > 0, r
        if d["bytes_fetched"] is not None:  # embedded engine: the dataset's own counter agrees
            assert d["bytes_fetched"] == d["payload_bytes"]
        assert all(x["tensor_bytes"] > 0 for x in d["received"] if x["ids"])
        assert len(d["losses"]) == TRAIN_BATCHES * 2  # one optimizer step per mini-batch
    # both ranks stepped through the same micro-batch slots (DDP never waits on a missing one)
    assert [(mb, i) for mb, i, _ in _received(full[0])] == [(mb, i) for mb, i, _ in _received(full[1])]


def test_grpo_no_trajectory_reaches_two_ranks(grpo, grpo_plan):
    ids = [set(i for *_, ids in _received(d) for i in ids) for d in grpo["runs"]["full"]["ranks"]]
    assert not (ids[0] & ids[1])
    every = {i for r in range(2) for _, _, ids_, _ in grpo_plan[r] for i in ids_}
    assert ids[0] | ids[1] == every and len(every) == TRAIN_BATCHES * 16
    for d in grpo["runs"]["full"]["ranks"]:
        flat = [i for *_, ids in _received(d) for i in ids]
        assert len(flat) == len(set(flat))


def test_grpo_stop_and_resume_continue_exactly(grpo):
    runs = grpo["runs"]
    for r in range(2):
        assert (grpo["ckpt"] / f"knitdata_loader_rank{r}.json").is_file()
        state = json.loads((grpo["ckpt"] / f"knitdata_loader_rank{r}.json").read_text())
        assert state["rank"] == r and state["world"] == 2
        assert state["last_info"]["minibatch"] == STOP_AFTER - 1 and state["last_info"]["is_last"]
        full, stop, resume = (_received(runs[k]["ranks"][r]) for k in ("full", "stop", "resume"))
        assert runs["stop"]["ranks"][r]["stopped"] and all(mb < STOP_AFTER for mb, _, _ in stop)
        assert resume and all(mb >= STOP_AFTER for mb, _, _ in resume)
        assert stop + resume == full, f"rank {r}: stop + resume differs from the uninterrupted delivery"
        flat = [i for *_, ids in stop + resume for i in ids]
        assert len(flat) == len(set(flat))
        assert runs["resume"]["ranks"][r]["final_version"] == runs["full"]["ranks"][r]["final_version"]
    # model and optimizer resumed too: the last optimizer steps see the same loss as without the stop
    assert runs["resume"]["ranks"][0]["losses"] == pytest.approx(runs["full"]["ranks"][0]["losses"][STOP_AFTER:], rel=1e-5,
                                                                 abs=1e-7)


# ---------------------------------------------------------------------------------------------- plain PyTorch
def _check_plain(run: dict[str, Any], consumers: int) -> None:
    ranks = run["ranks"]
    assert [d["rank"] for d in ranks] == list(range(consumers))
    ids = [i for d in ranks for r in d["received"] for i in r["ids"]]
    ex = _load_example("plain_torch")
    expected = {t.id for t in ex.rollout(ex.make_spec(), 2)}
    assert len(ids) == len(set(ids)) and set(ids) == expected
    for d in ranks:
        assert d["payload_bytes"] > 0 and d["steps"] == 2 * 2
        assert all(r["payload_bytes"] > 0 for r in d["received"] if r["ids"])
    assert len({len(d["received"]) for d in ranks}) == 1


def test_plain_torch_threads(tmp_path):
    out = _run([sys.executable, str(EXAMPLES / "plain_torch.py"), "--consumers", "2", "--train-batches", "2",
                "--out", str(tmp_path / "o.json"), "--state-out", str(tmp_path / "st")])
    assert "distinct: 32" in out
    run = json.loads((tmp_path / "o.json").read_text())
    _check_plain(run, 2)
    assert len({d["pid"] for d in run["ranks"]}) == 1
    for r in range(2):
        state = json.loads((tmp_path / "st" / f"loader_rank{r}.json").read_text())
        assert state["dataset_state"]["rank"] == r


def test_plain_torch_torchrun_two_processes(tmp_path, ray_host):
    # on the Ray engine, rank 0 starts the rollout producer process, attached to the running loopback cluster
    extra = ["--ray-address", ray_host] if ray_host else []
    out = _run([str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                str(_free_port()), str(EXAMPLES / "plain_torch.py"), "--engine", ENGINE, "--train-batches", "2",
                "--out", str(tmp_path / "o.json"), *extra])
    assert f"engine={ENGINE} (torchrun)" in out
    assert "distinct: 32" in out
    run = json.loads((tmp_path / "o.json").read_text())
    _check_plain(run, 2)
    assert len({d["pid"] for d in run["ranks"]}) == 2


# ---------------------------------------------------------------------------------------------- benchmark
def test_bench_standalone(tmp_path):
    out = _run([sys.executable, str(EXAMPLES / "bench_standalone.py"), "--train-batches", "1", "--repeats", "1",
                "--response-len", "128", "--hidden", "256", "--compute-ms", "1", "--json", str(tmp_path / "b.json")])
    assert "exposed/step ms" in out
    res = json.loads((tmp_path / "b.json").read_text())
    modes = res["modes"]
    assert {"sample", "eager", "iter"} <= set(modes)
    counts = {m["microbatches"] for m in modes.values()}
    nbytes = {m["bytes"] for m in modes.values()}
    assert len(counts) == 1 and len(nbytes) == 1 and nbytes.pop() > 0  # every mode moved the same data
    for m in modes.values():
        assert m["microbatches_per_s"] > 0 and m["drain_MBps"] > 0 and m["exposed_latency_per_step_s"] >= 0


# ---------------------------------------------------------------------------------------------- rollout worker (HF)
def test_rollout_hf_generate_worker_end_to_end(tmp_path):
    """examples/rollout_hf.py: a worker running HF ``generate`` (continued across weight updates) into the pipeline,
    a trainer reading it; every trajectory trained once, partial rollouts carry their versions, the adapter's
    log-probs equal the trainer's on the tokens of the weights being trained."""
    out = _run([sys.executable, str(EXAMPLES / "rollout_hf.py"), "--train-batches", "3", "--out", str(tmp_path / "r.json")])
    assert "spanning several versions" in out
    run = json.loads((tmp_path / "r.json").read_text())
    trajs = {t["id"]: t for t in run["trajectories"]}
    assert len(trajs) == len(run["trajectories"]) == 3 * 2 * 2 * 4  # batches x sources x groups x group size
    trained = [i for s in run["steps"] for i in s["ids"]]
    assert sorted(trained) == sorted(trajs)  # each exactly once
    assert [s["version"] for s in run["steps"]] == list(range(1, 3 * 2 + 1))  # one optimizer step per mini-batch
    for s in run["steps"]:
        for i in s["ids"]:
            assert max(trajs[i]["token_versions"]) < s["version"]  # generated by weights older than this step's result
    for t in trajs.values():
        v = t["token_versions"]
        assert v == sorted(v) and t["gen_version"] == v[0]
    assert run["multi_version_trajectories"] > 0 and run["segments"] > len(trajs)
    assert run["onpolicy_tokens"] > 0 and run["max_onpolicy_logprob_diff"] < 1e-4
