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
           "--plot", str(plot), "--shared-modes", "transferqueue_best", "iter", "iter_embedded"]
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
    for key in ("latency_ratio_transferqueue_vs_iter", "latency_ratio_transferqueue_best_vs_iter",
                "speedup_encoding", "speedup_end_to_end_cpu"):
        assert key in res
    if have_tq:
        assert res["latency_ratio_transferqueue_vs_iter"] > 0
        assert res["latency_ratio_transferqueue_best_vs_iter"] > 0
        assert all(v.startswith("127.") for v in res["transferqueue"]["addresses"].values())
        best = res["modes"]["transferqueue_best"]
        assert set(best["variants"]) == set(tb.TQ_BEST_VARIANTS)
        assert best["chosen_variant"] in tb.TQ_BEST_VARIANTS and best["shared"]["chosen_variant"] in tb.TQ_BEST_VARIANTS
        assert best["exposed_latency_s"] == min(v["exposed_latency_s"] for v in best["variants"].values())
        for cell in ("tq_dup", "tq_shared", "iter_dup", "iter_shared"):
            assert res["end_to_end"][cell]["step_s"] > 0 and res["end_to_end"][cell]["exposed_ms"] >= 0, cell
    # the alone control of iter, and knitdata's per-step state_dict() + commit() counted as exposed
    assert res["controls"]["iter"]["exposed_ms"] >= 0 and res["controls"]["iter"]["step_s"] > 0
    assert res["controls"]["iter"]["interleaved"] is False and res["modes"]["iter"]["interleaved"] is True
    assert res["modes"]["iter"]["exposed_commit_s"] > 0
    assert res["modes"]["iter"]["exposed_latency_s"] >= res["modes"]["iter"]["exposed_commit_s"]
    for r in res["control_runs"]:
        assert (r["lost"], r["duplicated"], r["unexpected"]) == (0, 0, 0), r["mode"]
        assert r["delivered"] == r["expected"] == total, r["mode"]
    proj = res["speedup_end_to_end_projected_gpu"]
    assert proj["rate_tflops"] > 0 and "model" in proj
    assert res["gpu_projection"]["projected"] is True and res["gpu_projection"]["assumptions"]["not_measured"]
    assert res["exactly_once_all_runs"] is True
    # SharedEncoding on the Ray engine: its TrajectoryDataset with a media_collator
    shared_iter = [r for r in res["runs"] if r["mode"] == "iter" and r.get("encoding") == "shared"]
    assert shared_iter and "knitdata.engines.ray" in shared_iter[0].get("engine", ""), shared_iter
    assert plot.stat().st_size > 0


# ---------------------------------------------------------------------------------------------- omni, 2x2, --gpu
OMNI_VLM_SMALL = dataclasses.replace(tb.OMNI_SMOKE_VLM, d_model=8, d_vision=8, vocab=64)
OMNI_SMALL = tb.omni_workload(2, 56, cfg=OMNI_VLM_SMALL, group_size=2, response_tokens=16, num_consumers=2,
                              microbatch_size=2, microbatches_per_step=2, warmup_steps=1, steps=1, vocab=64,
                              audio_seconds=1.0)


def test_omni_workload_defaults_fit_the_model():
    w = tb.omni_workload()
    assert (w.workload, w.video_frames, w.frame_px, w.audio_seconds, w.audio_rate) == ("omni", 4, 224, 30.0, 16000)
    assert w.group_size == 8 and w.media_kinds == ("image", "audio") and w.image_items == 4
    assert tb.media_tokens(tb.OMNI_VLM, w) + 64 <= w.prompt_tokens
    seed = tb.omni_workload(16, 448)  # the seed's setting stays available
    assert seed.item_shape == (3, 448, 448) and tb.media_tokens(tb.OMNI_VLM, seed) < seed.prompt_tokens
    with torch.device("meta"):
        tb.TinyVLM(tb.OMNI_VLM, seed)
    with pytest.raises(ConfigError):
        tb.TransferWorkload(workload="video")
    with pytest.raises(ConfigError):
        tb.omni_workload(audio_seconds=0.01)


def test_omni_group_shares_a_video_and_a_flac_clip():
    from knitdata.media import load_audio

    g = tb.make_group(OMNI_SMALL, 0, 1)
    kinds = [m.kind for m in g[0].media]
    assert kinds == ["image"] * OMNI_SMALL.video_frames + ["audio"]
    assert all([m.digest for m in t.media] == [m.digest for m in g[0].media] for t in g)
    clip = g[0].media[-1]
    assert clip.data is not None and clip.data[:4] == b"fLaC"
    samples, rate = load_audio(clip.data)
    assert rate == OMNI_SMALL.audio_rate and samples.shape[0] == OMNI_SMALL.audio_samples
    assert g[0].media[0].tensor.shape == OMNI_SMALL.item_shape


def test_omni_dup_and_shared_give_the_same_gradients():
    trajs = [t for g in tb.make_step_groups(OMNI_SMALL, 0)[:2] for t in g]
    grads = {}
    for enc in tb.ENCODINGS:
        tr = tb._Trainer(OMNI_SMALL, OMNI_VLM_SMALL, enc)
        for item in _items(OMNI_SMALL, OMNI_VLM_SMALL, enc, trajs):
            tr.microbatch(item)
        grads[enc] = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    assert any(n.startswith("audio_encoder.") for n in grads["dup"])
    assert grads["dup"].keys() == grads["shared"].keys()
    for n, g in grads["dup"].items():
        torch.testing.assert_close(grads["shared"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_omni_embedded_run_is_exactly_once():
    res = tb.run_transfer_benchmark(OMNI_SMALL, ["iter_embedded"], shared_modes=["iter_embedded"],
                                    cfg=OMNI_VLM_SMALL, timeout_s=60, progress=False, log=lambda s: None)
    m = res["modes"]["iter_embedded"]
    assert m["exactly_once"] and m["shared"]["exactly_once"]
    assert m["delivered"] == OMNI_SMALL.total_steps * OMNI_SMALL.trajectories_per_step
    assert res["workload"]["workload"] == "omni" and res["end_to_end"]["iter_shared"]["step_s"] > 0
    assert m["exposed_commit_s"] > 0  # state_dict() + commit() per step are counted
    assert "FLAC audio clip" in tb.format_table(res)


def _tq_rows(w, group):
    import numpy as np
    from tensordict import TensorDict

    n = len(group)
    fields = {"input_ids": torch.stack([torch.cat([t.prompt_ids, t.response_ids]) for t in group]),
              "tidx": torch.tensor([int(t.id[1:6]) * w.trajectories_per_step + int(t.id[7:10]) * w.group_size
                                    + int(t.id.rsplit("t", 1)[1]) for t in group])}
    if w.workload == "omni":
        clip = torch.from_numpy(np.frombuffer(group[0].media[-1].data, dtype=np.uint8).copy())
        fields["frames"] = torch.stack([m.tensor for m in group[0].media[:-1]]).unsqueeze(0).expand(
            n, -1, -1, -1, -1).contiguous()
        fields["audio"] = clip.unsqueeze(0).expand(n, -1).contiguous()
    else:
        fields["pixel_values"] = group[0].media[0].tensor.unsqueeze(0).expand(n, -1, -1, -1).contiguous()
    return TensorDict(fields, batch_size=n)


@pytest.mark.parametrize("w,cfg", [(SMALL, SMALL_VLM), (OMNI_SMALL, OMNI_VLM_SMALL)], ids=["image", "omni"])
def test_transferqueue_rows_decode_like_knitdata(w, cfg):
    """transferqueue's rows become the same encoder inputs and trajectory ids as knitdata's collators give."""
    pytest.importorskip("tensordict")
    group = tb.make_group(w, 0, 1)
    dec = tb._TQDecode(w, cfg)
    item = dec.dup(_tq_rows(w, group), 1, 2)
    assert item.ids == tuple(t.id for t in group) and item.index == 1 and item.is_last
    ref = tb._DupCollator(w, cfg)(group)
    for kind in w.media_kinds:
        torch.testing.assert_close(item.inputs[kind], ref.tensors[f"{kind}_inputs"])
    items = dec.shared([_tq_rows(w, group), _tq_rows(w, tb.make_group(w, 0, 2))])
    assert [i.index for i in items] == [0, 1] and items[1].is_last
    assert items[0].media.num_unique == 2 * len(group[0].media)  # each group's media once
    import pickle

    assert isinstance(pickle.loads(pickle.dumps(dec)), tb._TQDecode)  # it travels to the loader's workers


def test_exposed_latency_counts_the_state_calls_after_the_step():
    import time

    tr = tb._Trainer(SMALL, SMALL_VLM, "dup")
    items = iter(_items(SMALL, SMALL_VLM, "dup", [t for g in tb.make_step_groups(SMALL, 0)[:2] for t in g]))
    rec = tb._run_step(0, tr, lambda: (next(items), 0.0), lambda: time.sleep(0.02))
    assert rec.commit_s >= 0.02 and rec.exposed_s >= rec.commit_s and rec.microbatches == 2


def test_transferqueue_best_picks_the_lower_exposed_variant_per_encoding_and_the_2x2():
    def s(ex, step):
        return {"exposed_latency_s": ex, "exposed_latency_max_s": ex, "step_s": step, "compute_s": step / 2}

    modes = {"transferqueue_best": {"variants": {"async": {**s(0.03, 1.0), "shared": s(0.05, 0.8)},
                                                 "loader": {**s(0.20, 1.2), "shared": s(0.01, 0.9)}}},
             "iter": {**s(0.002, 0.9), "shared": s(0.001, 0.6)}}
    tb._pick_tq_best(modes)
    best = modes["transferqueue_best"]
    assert best["chosen_variant"] == "async" and best["shared"]["chosen_variant"] == "loader"
    assert best["variants_exposed_ms"] == pytest.approx({"async": 30.0, "loader": 200.0})
    e = tb._two_by_two(modes, "iter")
    assert e["tq_dup"]["step_s"] == 1.0 and e["tq_shared"]["step_s"] == 0.9
    assert e["iter_dup"]["exposed_ms"] == pytest.approx(2.0) and e["iter_shared"]["step_s"] == 0.6
    assert e["effects"]["transfer_dup"] == pytest.approx(1.0 / 0.9)
    assert e["effects"]["encoding_iter"] == pytest.approx(0.9 / 0.6)
    assert e["effects"]["both"] == pytest.approx(1.0 / 0.6)


@pytest.mark.parametrize("workload", tb.WORKLOADS)
def test_gpu_preset_config(workload):
    p = tb.gpu_config(workload)
    assert p.device == "cuda" and p.fetches == ("sample", "eager", "iter") and p.budget_s <= 300
    assert set(p.encodings) == set(tb.ENCODINGS)
    assert tb.media_tokens(p.model, p.workload) <= p.workload.prompt_tokens
    if workload == "omni":
        assert (p.workload.video_frames, p.workload.frame_px) == (16, 448)
    with torch.device("meta"):
        tb.TinyVLM(p.model, p.workload)  # the model builds at the preset's shapes
    json.dumps(p.to_dict())
    with pytest.raises(ConfigError):
        tb.gpu_config("video")


def test_gpu_preset_fails_clearly_without_cuda(monkeypatch, capsys):
    import argparse

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA"):
        tb.require_cuda()
    parser = argparse.ArgumentParser()
    tb.add_arguments(parser)
    assert tb.run(parser.parse_args(["--gpu", "--no-progress"])) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_benchmark_loop_reports_every_fetch_mode(monkeypatch):
    """The --gpu loop and its JSON layout, run here on the CPU device (the CUDA check skipped; no GPU needed)."""
    monkeypatch.setattr(tb, "require_cuda", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    preset = tb.GpuPreset(workload=SMALL, model=SMALL_VLM, device="cpu")
    res = tb.run_gpu_benchmark(preset, timeout_s=60, progress=False, log=lambda s: None)
    assert set(res["modes"]) == {"sample_embedded", "eager_embedded", "iter_embedded"}
    for d in res["modes"].values():
        assert d["exactly_once"] and d["shared"]["exactly_once"] and d["exposed_ms"] >= 0
    assert res["gpu"] is True and res["end_to_end"]["iter_shared"]["step_s"] > 0
    assert res["exactly_once_all_runs"] is True
    assert "CUDA" in tb.format_table(res)
    json.dumps(tb._clean(res), allow_nan=False)
