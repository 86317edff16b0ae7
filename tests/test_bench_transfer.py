"""Tests of the transfer benchmark (knitdata/bench/transfer.py): its pieces, an in-process run, and the smoke run.

The smoke run (`knitdata bench transfer --smoke`, every mode, transferqueue included when installed) runs in a
subprocess under the 240 s hard time-out of issue 8; it checks the JSON keys and that every run delivered each
trajectory exactly once. Timings are reported, never asserted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from knitdata.bench import transfer as tb
from knitdata.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

SMALL = tb.TransferWorkload(group_size=2, prompt_tokens=16, response_tokens=16, image_shape=(3, 56, 56),
                            num_consumers=2, microbatch_size=2, microbatches_per_step=2, warmup_steps=1, steps=1,
                            vocab=64)
SMALL_VLM = dataclasses.replace(tb.SMOKE_VLM, d_model=8, d_vision=8, vocab=64)


def test_workload_defaults_match_issue_8():
    w = tb.TransferWorkload()
    assert (w.group_size, w.tokens, w.image_shape, w.num_consumers) == (8, 2048, (3, 448, 448), 4)
    assert (w.microbatch_size, w.microbatches_per_step, w.warmup_steps, w.steps) == (4, 4, 3, 10)
    assert w.trajectories_per_step == 64 and w.groups_per_step == 8
    json.dumps(w.to_dict())


@pytest.mark.parametrize("kw", [{"steps": 0}, {"group_size": 3}, {"microbatch_size": 3}, {"warmup_steps": -1}])
def test_workload_rejects_bad_configs(kw):
    with pytest.raises(ConfigError):
        tb.TransferWorkload(**kw)


def test_make_group_is_deterministic_and_shares_one_image():
    g1 = tb.make_group(SMALL, 3, 1)
    g2 = tb.make_group(SMALL, 3, 1)
    assert [t.id for t in g1] == [t.id for t in g2]
    assert all(a.equals(b) for a, b in zip(g1, g2))
    assert len({id(t.media[0].tensor) for t in g1}) == 1  # one image object per group
    assert len({t.media[0].digest for t in g1}) == 1
    other = tb.make_group(SMALL, 3, 0)
    assert other[0].media[0].digest != g1[0].media[0].digest
    assert all(t.num_tokens == SMALL.tokens for t in g1)


def test_transferqueue_row_index_maps_to_trajectory_ids():
    ids = [t.id for s in range(SMALL.total_steps) for g in tb.make_step_groups(SMALL, s) for t in g]
    assert [tb._tq_id(SMALL, i) for i in range(len(ids))] == ids


def test_loopback_check():
    assert tb._is_loopback("127.0.0.1") and tb._is_loopback("::1")
    assert not tb._is_loopback("192.0.2.2") and not tb._is_loopback("0.0.0.0")


def _rec(step, ids, exposed=0.01):
    return tb.ConsumerStepRecord(step, exposed, 0.1, 0.2, 1, 10, 20, list(ids), [exposed])


def test_summarize_counts_lost_duplicated_and_unexpected():
    w = dataclasses.replace(SMALL, warmup_steps=1, steps=1)
    recs = [[_rec(0, ["a", "b"]), _rec(1, ["c"], 0.03)], [_rec(0, ["b"]), _rec(1, ["x"], 0.05)]]
    s = tb.summarize_mode(recs, w, expected_ids={"a", "b", "c", "d"})
    assert (s["delivered"], s["lost"], s["duplicated"], s["unexpected"]) == (5, 1, 1, 1)
    assert s["exactly_once"] is False
    assert s["exposed_latency_s"] == pytest.approx(0.04)  # mean over consumers of the measured step
    assert s["exposed_latency_max_s"] == pytest.approx(0.05)
    ok = tb.summarize_mode([[_rec(0, ["a"]), _rec(1, ["b"])]], w, expected_ids={"a", "b"})
    assert ok["exactly_once"] and ok["lost"] == ok["duplicated"] == 0


def test_flop_counts_separate_encoder_copies():
    f = tb.count_step_flops(SMALL_VLM, SMALL)
    k, b = SMALL.microbatches_per_step, SMALL.microbatch_size
    unique = SMALL.per_consumer_step // SMALL.group_size
    assert f["unique_images_per_step"] == unique
    assert f["step_dup"] - f["step_shared"] == pytest.approx((k * b - unique) * f["encoder_image"])
    assert f["encoder_image"] > 0 and f["backbone_microbatch"] > 0


def _items(w, cfg, encoding, trajs):
    kw = tb._dataset_kwargs(w, cfg, encoding)
    k, b = w.microbatches_per_step, w.microbatch_size
    mbs = [trajs[i * b:(i + 1) * b] for i in range(k)]
    media = kw["media_collator"](mbs) if "media_collator" in kw else None
    out = []
    for i, mb in enumerate(mbs):
        m = kw["collate"](mb)
        inputs = {kd: m.tensors[f"{kd}_inputs"] for kd in w.media_kinds} if encoding == "dup" else None
        out.append(tb._Item(tuple(t.id for t in mb), m.input_ids, inputs, media, i, k, i == k - 1, 0))
    return out


def test_duplicated_and_shared_encoding_give_the_same_gradients():
    trajs = [t for g in tb.make_step_groups(SMALL, 0)[:2] for t in g]
    grads = {}
    for enc in tb.ENCODINGS:
        tr = tb._Trainer(SMALL, SMALL_VLM, enc)
        for item in _items(SMALL, SMALL_VLM, enc, trajs):
            tr.microbatch(item)
        grads[enc] = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    assert grads["dup"].keys() == grads["shared"].keys()
    assert any(n.startswith("encoder.") for n in grads["dup"])
    for n, g in grads["dup"].items():
        torch.testing.assert_close(grads["shared"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_embedded_run_in_process_is_exactly_once_and_reports_the_keys():
    res = tb.run_transfer_benchmark(SMALL, ["iter_embedded"], shared_modes=["iter_embedded"], cfg=SMALL_VLM,
                                    timeout_s=60, progress=False, log=lambda s: None)
    m = res["modes"]["iter_embedded"]
    assert m["exactly_once"] and m["shared"]["exactly_once"]
    assert m["delivered"] == SMALL.total_steps * SMALL.trajectories_per_step
    assert m["microbatches_per_step"] == [SMALL.microbatches_per_step]
    assert m["exposed_latency_s"] >= 0 and m["step_s"] > 0
    assert res["iter_reference_mode"] == "iter_embedded"
    assert res["speedup_encoding"] is not None and res["speedup_end_to_end_cpu"] is None
    assert res["speedup_end_to_end_projected_gpu"]["rate_tflops"] == tb.DEFAULT_GPU_TFLOPS
    json.dumps(tb._clean(res), allow_nan=False)
    text = tb.format_table(res)
    assert "iter_embedded" in text and "exactly-once in every run: True" in text


@pytest.mark.timeout(300)
def test_smoke_run_every_mode(tmp_path):
    """`knitdata bench transfer --smoke` (hard time-out 240 s): JSON keys, exactly-once in every mode."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (the process modes and transferqueue need it)")
    out = tmp_path / "transfer.json"
    plot = tmp_path / "transfer.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "knitdata", "bench", "transfer", "--smoke", "--no-progress", "--json", str(out),
           "--plot", str(plot), "--shared-modes", "iter", "iter_embedded"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads(out.read_text())
    have_tq = importlib.util.find_spec("transfer_queue") is not None
    modes = list(tb.MODES) if have_tq else [m for m in tb.MODES if m != "transferqueue"]
    if not have_tq:
        assert any("transferqueue is not installed" in n for n in res["notes"])
    w = res["workload"]
    total = (w["warmup_steps"] + w["steps"]) * w["trajectories_per_step"]
    for m in modes:
        d = res["modes"][m]
        assert d["exposed_latency_s"] is not None and d["step_s"] > 0, m
    for r in res["runs"]:
        assert (r["lost"], r["duplicated"], r["unexpected"]) == (0, 0, 0), r["mode"]
        assert r["delivered"] == r["expected"] == total, r["mode"]
    for key in ("latency_ratio_transferqueue_vs_iter", "speedup_encoding", "speedup_end_to_end_cpu"):
        assert key in res
    if have_tq:
        assert res["latency_ratio_transferqueue_vs_iter"] > 0
        assert all(v.startswith("127.") for v in res["transferqueue"]["addresses"].values())
    proj = res["speedup_end_to_end_projected_gpu"]
    assert proj["rate_tflops"] > 0 and "model" in proj
    assert res["exactly_once_all_runs"] is True
    # SharedEncoding on the Ray engine: its TrajectoryDataset with a media_collator
    shared_iter = [r for r in res["runs"] if r["mode"] == "iter" and r.get("encoding") == "shared"]
    assert shared_iter and "knitdata.engines.ray" in shared_iter[0].get("engine", ""), shared_iter
    assert plot.stat().st_size > 0
