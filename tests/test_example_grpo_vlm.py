"""examples/grpo_vlm.py: GRPO on a tiny random-init Qwen2.5-VL with SharedEncoding, one process and two.

One process with ``--check-grads``: the first step's gradients equal the model's own duplicated forward.
Two processes under ``accelerate launch --multi_gpu`` on CPU (gloo): both ranks train every step on their
own images (fold's encoder backward inside DDP's synchronized last micro-batch).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "grpo_vlm.py"
BIN = Path(sys.executable).parent
TIMEOUT_S = 240


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                "MASTER_ADDR": "127.0.0.1", "TOKENIZERS_PARALLELISM": "false"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str]) -> str:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {TIMEOUT_S}s (hang?):\n{out[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-6000:]}")
    return out


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_grpo_vlm_one_process_matches_the_duplicated_forward(tmp_path):
    out = tmp_path / "one.json"
    _run([sys.executable, str(EXAMPLE), "--check-grads", "--out", str(out)])
    res = json.loads(out.read_text())
    (r,) = res["ranks"]
    assert r["steps"] == 4 and all(abs(x) < 1e3 for x in r["losses"])
    assert 0 < r["unique_images"] < r["image_occurrences"]  # groups share their image: encoded once
    assert r["max_rel_grad_diff"] < 1e-5, r


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_grpo_vlm_two_processes_under_accelerate(tmp_path):
    out = tmp_path / "two.json"
    _run([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
          "--main_process_port", str(_free_port()), str(EXAMPLE), "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["world"] == 2 and [r["rank"] for r in res["ranks"]] == [0, 1]
    for r in res["ranks"]:
        assert r["steps"] == 4, r
        assert 0 < r["unique_images"] < r["image_occurrences"], r
