"""examples/grpo_vlm.py --family qwen2_5_omni: GRPO on a tiny Qwen2.5-Omni thinker (image, video, audio per
prompt) under ``accelerate launch``.

One process with ``--check-grads``: the first step's gradients equal the model's own duplicated forward (both
towers). Two processes (slow): both ranks train every step on their own share, over gloo.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("av")

sys.path.insert(0, str(Path(__file__).parent))
from test_example_grpo_vlm import BIN, EXAMPLE, TIMEOUT_S, _free_port, _run  # noqa: E402


def _launch(n: int, out: Path, *extra: str) -> dict:
    flags = ["--multi_gpu"] if n > 1 else ["--cpu"]
    _run([str(BIN / "accelerate"), "launch", *flags, "--num_processes", str(n), "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
          "--main_process_port", str(_free_port()), str(EXAMPLE), "--family", "qwen2_5_omni", "--out", str(out),
          *extra])
    return json.loads(out.read_text())


@pytest.mark.slow  # about a minute of process start-up on 2 busy cores; the gradients are tested in test_integrations_omni
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_grpo_omni_one_process_matches_the_duplicated_forward(tmp_path):
    res = _launch(1, tmp_path / "one.json", "--check-grads")
    (r,) = res["ranks"]
    assert res["family"] == "qwen2_5_omni" and r["steps"] == 4 and all(abs(x) < 1e3 for x in r["losses"])
    # every group shares an image, a video and a clip: 3 unique items per group, encoded once per step
    assert r["unique_images"] % 3 == 0 and 0 < r["unique_images"] < r["image_occurrences"], r
    assert r["max_rel_grad_diff"] < 1e-5, r  # float32 model


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_grpo_omni_two_processes_under_accelerate(tmp_path):
    res = _launch(2, tmp_path / "two.json")
    assert res["world"] == 2 and [r["rank"] for r in res["ranks"]] == [0, 1]
    for r in res["ranks"]:
        assert r["steps"] == 4 and 0 < r["unique_images"] < r["image_occurrences"], r
