"""Tests of the transfer benchmark (benchmarks/transfer.py): its pieces, an in-process run, and the smoke run.

The smoke run (`python -m benchmarks transfer --smoke`, every mode, transferqueue included when installed, with the
default `--compute accel`) runs in a subprocess under the 240 s hard time-out of issue 8; it checks the JSON keys
and that every run delivered each trajectory exactly once. The CPU-compute mode runs in-process on the embedded
engine. Timings are reported, never asserted (except that a calibrated wait lasts at least its calibration).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import transfer as tb
from benchmarks.common import baselines, consumer, models, output, summary, workload
from knitdata.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

SMALL = workload.TransferWorkload(group_size=2, prompt_tokens=16, response_tokens=16, image_shape=(3, 56, 56),
                            num_consumers=2, microbatch_size=2, microbatches_per_step=2, warmup_steps=1, steps=1,
                            vocab=64)
SMALL_VLM = dataclasses.replace(models.SMOKE_VLM, d_model=8, d_vision=8, vocab=64)


def test_workload_defaults_match_issue_8():
    w = workload.TransferWorkload()
    assert (w.group_size, w.tokens, w.image_shape, w.num_consumers) == (8, 2048, (3, 448, 448), 4)
    assert (w.microbatch_size, w.microbatches_per_step, w.warmup_steps, w.steps) == (4, 4, 3, 10)
    assert w.trajectories_per_step == 64 and w.groups_per_step == 8
    json.dumps(w.to_dict())


@pytest.mark.parametrize("kw", [{"steps": 0}, {"group_size": 3}, {"microbatch_size": 3}, {"warmup_steps": -1}])
def test_workload_rejects_bad_configs(kw):
    with pytest.raises(ConfigError):
        workload.TransferWorkload(**kw)


def test_make_group_is_deterministic_and_shares_one_image():
    g1 = workload.make_group(SMALL, 3, 1)
    g2 = workload.make_group(SMALL, 3, 1)
    assert [t.id for t in g1] == [t.id for t in g2]
    assert all(a.equals(b) for a, b in zip(g1, g2))
    assert len({id(t.media[0].tensor) for t in g1}) == 1  # one image object per group
    assert len({t.media[0].digest for t in g1}) == 1
    other = workload.make_group(SMALL, 3, 0)
    assert other[0].media[0].digest != g1[0].media[0].digest
    assert all(t.num_tokens == SMALL.tokens for t in g1)


def test_transferqueue_row_index_maps_to_trajectory_ids():
    ids = [t.id for s in range(SMALL.total_steps) for g in workload.make_step_groups(SMALL, s) for t in g]
    assert [baselines._tq_id(SMALL, i) for i in range(len(ids))] == ids


def test_loopback_check():
    assert baselines._is_loopback("127.0.0.1") and baselines._is_loopback("::1")
    assert not baselines._is_loopback("192.0.2.2") and not baselines._is_loopback("0.0.0.0")


def _rec(step, ids, exposed=0.01):
    return consumer.ConsumerStepRecord(step, exposed, 0.1, 0.2, 1, 10, 20, list(ids), [exposed])


def test_summarize_counts_lost_duplicated_and_unexpected():
    w = dataclasses.replace(SMALL, warmup_steps=1, steps=1)
    recs = [[_rec(0, ["a", "b"]), _rec(1, ["c"], 0.03)], [_rec(0, ["b"]), _rec(1, ["x"], 0.05)]]
    s = summary.summarize_mode(recs, w, expected_ids={"a", "b", "c", "d"})
    assert (s["delivered"], s["lost"], s["duplicated"], s["unexpected"]) == (5, 1, 1, 1)
    assert s["exactly_once"] is False
    assert s["exposed_latency_s"] == pytest.approx(0.04)  # mean over consumers of the measured step
    assert s["exposed_latency_max_s"] == pytest.approx(0.05)
    ok = summary.summarize_mode([[_rec(0, ["a"]), _rec(1, ["b"])]], w, expected_ids={"a", "b"})
    assert ok["exactly_once"] and ok["lost"] == ok["duplicated"] == 0


def test_flop_counts_separate_encoder_copies():
    f = models.count_step_flops(SMALL_VLM, SMALL)
    k, b = SMALL.microbatches_per_step, SMALL.microbatch_size
    unique = SMALL.per_consumer_step // SMALL.group_size
    assert f["unique_images_per_step"] == unique
    assert f["step_dup"] - f["step_shared"] == pytest.approx((k * b - unique) * f["encoder_image"])
    assert f["encoder_image"] > 0 and f["backbone_microbatch"] > 0


def _items(w, cfg, encoding, trajs):
    kw = consumer.dataset_kwargs(w, cfg, encoding)
    k, b = w.microbatches_per_step, w.microbatch_size
    mbs = [trajs[i * b:(i + 1) * b] for i in range(k)]
    media = kw["media_collator"](mbs) if "media_collator" in kw else None
    out = []
    for i, mb in enumerate(mbs):
        m = kw["collate"](mb)
        inputs = {kd: m.tensors[f"{kd}_inputs"] for kd in w.media_kinds} if encoding == "dup" else None
        out.append(consumer.StepItem(tuple(t.id for t in mb), m.input_ids, inputs, media, i, k, i == k - 1, 0))
    return out


def test_duplicated_and_shared_encoding_give_the_same_gradients():
    trajs = [t for g in workload.make_step_groups(SMALL, 0)[:2] for t in g]
    grads = {}
    for enc in workload.ENCODINGS:
        tr = consumer._Trainer(SMALL, SMALL_VLM, enc)
        for item in _items(SMALL, SMALL_VLM, enc, trajs):
            tr.microbatch(item)
        grads[enc] = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    assert grads["dup"].keys() == grads["shared"].keys()
    assert any(n.startswith("encoder.") for n in grads["dup"])
    for n, g in grads["dup"].items():
        torch.testing.assert_close(grads["shared"][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("compute", workload.COMPUTE_MODES)
def test_embedded_run_in_process_is_exactly_once_and_reports_the_keys(compute):
    res = tb.run_transfer_benchmark(SMALL, ["iter_embedded"], shared_modes=["iter_embedded"], cfg=SMALL_VLM,
                                    timeout_s=60, progress=False, log=lambda s: None, compute=compute,
                                    calibration_reps=1)
    m = res["modes"]["iter_embedded"]
    assert m["exactly_once"] and m["shared"]["exactly_once"]
    assert m["delivered"] == SMALL.total_steps * SMALL.trajectories_per_step
    assert m["microbatches_per_step"] == [SMALL.microbatches_per_step]
    assert m["exposed_latency_s"] >= 0 and m["step_s"] > 0
    assert res["iter_reference_mode"] == "iter_embedded"
    assert res["speedup_encoding"] is not None and res["speedup_end_to_end_cpu"] is None
    assert res["speedup_end_to_end_projected_gpu"]["rate_tflops"] == models.DEFAULT_GPU_TFLOPS
    json.dumps(output.strict_json(res), allow_nan=False)
    text = summary.format_table(res)
    assert "iter_embedded" in text and "exactly-once in every run: True" in text
    # the summary under the compute mode's key: iter_embedded always runs alone, broken down by call
    assert res["compute"] == compute and res["compute_measures"] == workload.COMPUTE_MEASURES[compute]
    summ = res[compute]
    b = summ["breakdown"]["iter_embedded"]
    assert b["next_ms"] == pytest.approx(b["wait_ms"] + b["own_ms"], rel=0.2, abs=0.05)
    assert b["state_dict_ms"] > 0 and b["commit_ms"] > 0 and b["wait_ms"] >= 0 and b["own_ms"] >= 0
    assert summ["alone"]["iter_embedded"]["step_s"] == m["step_s"]
    assert summ["alone"]["iter_embedded"]["shared"]["exposed_ms"] == pytest.approx(m["shared"]["exposed_ms"])
    assert summ["wait_sources"] and set(summ["wait_sources"]) <= {"data_wait_s_total", "wait_s_total"}
    assert summ["loadavg"]["start"] and summ["loadavg"]["end"]
    if compute == "accel":
        cal = res["calibration"]
        for enc in workload.ENCODINGS:
            assert len(cal[enc]["microbatch_s"]) == SMALL.microbatches_per_step and cal[enc]["step_s"] > 0
            assert summ["calibration"][enc]["step_s"] == cal[enc]["step_s"]
        # the consumers waited the calibrated compute (a sleep: at least that long, per step)
        assert m["compute_s"] >= 0.9 * cal["dup"]["step_s"]
        assert "calibrated compute" in text
    else:
        assert "calibration" not in res


@pytest.mark.slow  # every mode in processes (~90 s): make test-slow (and .ci/run after make test)
@pytest.mark.timeout(300)
def test_smoke_run_every_mode(tmp_path):
    """`python -m benchmarks transfer --smoke` (accel compute, 2 consumer processes; hard time-out 240 s): JSON keys,
    the summary of the accel mode, exactly-once in every mode."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (the process modes and transferqueue need it)")
    out = tmp_path / "transfer.json"
    plot = tmp_path / "transfer.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "benchmarks", "transfer", "--smoke", "--no-progress", "--json", str(out),
           "--plot", str(plot), "--shared-modes", "transferqueue_best", "iter", "iter_embedded"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert json.loads(out.read_text())["command"].startswith("python -m benchmarks transfer --smoke")
    res = json.loads(out.read_text())
    have_tq = importlib.util.find_spec("transfer_queue") is not None
    modes = list(workload.MODES) if have_tq else [m for m in workload.MODES if m != "transferqueue"]
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
        assert set(best["variants"]) == set(workload.TQ_BEST_VARIANTS)
        assert best["chosen_variant"] in workload.TQ_BEST_VARIANTS and best["shared"]["chosen_variant"] in workload.TQ_BEST_VARIANTS
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
    # --compute accel (the default): calibrated compute, alone runs, the breakdown by call and the ratios
    assert res["compute"] == "accel" and "GPU node" in res["compute_measures"]
    acc = res["accel"]
    for enc in workload.ENCODINGS:
        assert res["calibration"][enc]["step_s"] > 0 and acc["calibration"][enc]["microbatch_s"]
    alone = ["iter", "iter_embedded", "floor"] + (["transferqueue", "transferqueue_best"] if have_tq else [])
    for m in alone:
        assert acc["alone"][m]["exposed_ms"] >= 0 and acc["alone"][m]["step_s"] > 0, m
        b = acc["breakdown"][m]
        assert all(b[k] >= 0 for k in ("wait_ms", "own_ms", "state_dict_ms", "commit_ms")), m
    assert acc["breakdown"]["iter"]["state_dict_ms"] > 0 and acc["breakdown"]["iter"]["commit_ms"] > 0
    # the floor (no data system) beside them: its calls are a pop, a two-key state and an enqueued commit
    assert acc["ratios"]["exposed_iter_over_floor"] > 0 and res["controls"]["floor"]["interleaved"] is False
    if have_tq:
        assert acc["ratios"]["exposed_transferqueue_best_over_floor"] > 0
    for m in ("sample", "eager", "iter"):
        assert acc["interleaved"][m]["step_s"] > 0, m
    assert acc["end_to_end_alone"]["iter_dup"]["step_s"] > 0
    assert acc["end_to_end_interleaved"]["iter_shared"]["step_s"] > 0
    if have_tq:
        assert acc["alone"]["transferqueue"]["wait_ms"] > 0 and acc["alone"]["transferqueue"]["own_ms"] >= 0
        assert acc["end_to_end_alone"]["tq_dup"]["step_s"] > 0 and acc["end_to_end_alone"]["tq_sync_dup"]["step_s"] > 0
        for k in ("exposed_transferqueue_best_over_iter", "exposed_transferqueue_over_iter",
                  "step_iter_over_transferqueue_best_dup", "exposed_iter_embedded_over_iter"):
            assert acc["ratios"][k] > 0, k
        assert acc["acceptance"]["exposed_transferqueue_over_iter_ge_100"]["applies"] is True
    assert acc["loadavg"]["start"] and acc["loadavg"]["end"]
    # the consumers waited at least the calibrated compute per step
    assert res["controls"]["iter"]["compute_s"] >= 0.9 * res["calibration"]["dup"]["step_s"]
    proj = res["speedup_end_to_end_projected_gpu"]
    assert proj["rate_tflops"] > 0 and "model" in proj
    assert res["gpu_projection"]["projected"] is True and res["gpu_projection"]["assumptions"]["not_measured"]
    assert res["exactly_once_all_runs"] is True
    # SharedEncoding on the Ray engine: its TrajectoryDataset with a media_collator
    shared_iter = [r for r in res["runs"] if r["mode"] == "iter" and r.get("encoding") == "shared"]
    assert shared_iter and "knitdata.engines.ray.engine" in shared_iter[0].get("engine", ""), shared_iter
    assert plot.stat().st_size > 0


# ---------------------------------------------------------------------------------------------- omni, 2x2, --gpu
OMNI_VLM_SMALL = dataclasses.replace(models.OMNI_SMOKE_VLM, d_model=8, d_vision=8, vocab=64)
OMNI_SMALL = workload.omni_workload(2, 56, cfg=OMNI_VLM_SMALL, group_size=2, response_tokens=16, num_consumers=2,
                              microbatch_size=2, microbatches_per_step=2, warmup_steps=1, steps=1, vocab=64,
                              audio_seconds=1.0)


def test_omni_workload_defaults_fit_the_model():
    w = workload.omni_workload()
    assert (w.workload, w.video_frames, w.frame_px, w.audio_seconds, w.audio_rate) == ("omni", 4, 224, 30.0, 16000)
    assert w.group_size == 8 and w.media_kinds == ("image", "audio") and w.image_items == 4
    assert models.media_tokens(models.OMNI_VLM, w) + 64 <= w.prompt_tokens
    seed = workload.omni_workload(16, 448)  # the seed's setting stays available
    assert seed.item_shape == (3, 448, 448) and models.media_tokens(models.OMNI_VLM, seed) < seed.prompt_tokens
    with torch.device("meta"):
        models.TinyVLM(models.OMNI_VLM, seed)
    with pytest.raises(ConfigError):
        workload.TransferWorkload(workload="video")
    with pytest.raises(ConfigError):
        workload.omni_workload(audio_seconds=0.01)


def test_omni_group_shares_a_video_and_a_flac_clip():
    from knitdata.media.process import load_audio

    g = workload.make_group(OMNI_SMALL, 0, 1)
    kinds = [m.kind for m in g[0].media]
    assert kinds == ["image"] * OMNI_SMALL.video_frames + ["audio"]
    assert all([m.digest for m in t.media] == [m.digest for m in g[0].media] for t in g)
    clip = g[0].media[-1]
    assert clip.data is not None and clip.data[:4] == b"fLaC"
    samples, rate = load_audio(clip.data)
    assert rate == OMNI_SMALL.audio_rate and samples.shape[0] == OMNI_SMALL.audio_samples
    assert g[0].media[0].tensor.shape == OMNI_SMALL.item_shape


def test_omni_dup_and_shared_give_the_same_gradients():
    trajs = [t for g in workload.make_step_groups(OMNI_SMALL, 0)[:2] for t in g]
    grads = {}
    for enc in workload.ENCODINGS:
        tr = consumer._Trainer(OMNI_SMALL, OMNI_VLM_SMALL, enc)
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
    assert "FLAC audio clip" in summary.format_table(res)


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
    group = workload.make_group(w, 0, 1)
    dec = baselines._TQDecode(w, cfg)
    item = dec.dup(_tq_rows(w, group), 1, 2)
    assert item.ids == tuple(t.id for t in group) and item.index == 1 and item.is_last
    ref = consumer._DupCollator(w, cfg)(group)
    for kind in w.media_kinds:
        torch.testing.assert_close(item.inputs[kind], ref.tensors[f"{kind}_inputs"])
    items = dec.shared([_tq_rows(w, group), _tq_rows(w, workload.make_group(w, 0, 2))])
    assert [i.index for i in items] == [0, 1] and items[1].is_last
    assert items[0].media.num_unique == 2 * len(group[0].media)  # each group's media once
    import pickle

    assert isinstance(pickle.loads(pickle.dumps(dec)), baselines._TQDecode)  # it travels to the loader's workers


def test_exposed_latency_counts_the_state_calls_after_the_step():
    import time

    tr = consumer._Trainer(SMALL, SMALL_VLM, "dup")
    items = iter(_items(SMALL, SMALL_VLM, "dup", [t for g in workload.make_step_groups(SMALL, 0)[:2] for t in g]))
    src = consumer.StepSource("x", tr, lambda: (next(items), 0.003, 0.001), lambda: time.sleep(0.02) or {"s": 1},
                     lambda st: time.sleep(0.01) if st == {"s": 1} else None)
    rec = consumer._run_step(0, src)
    assert rec.state_dict_s >= 0.02 and rec.commit_call_s >= 0.01
    assert rec.commit_s == pytest.approx(rec.state_dict_s + rec.commit_call_s, abs=1e-4)
    assert rec.exposed_s == pytest.approx(0.006 + rec.commit_s, abs=1e-4) and rec.microbatches == 2
    assert rec.data_wait_s == pytest.approx(0.002)  # reported by the source per next()


def test_data_wait_comes_from_the_probe_when_next_does_not_report_it():
    """knitdata's sources report waiting through the dataset's metrics, read around the step (outside the timed
    calls); the summary splits next() into wait and own work."""
    tr = consumer._Trainer(SMALL, SMALL_VLM, "dup")
    items = iter(_items(SMALL, SMALL_VLM, "dup", [t for g in workload.make_step_groups(SMALL, 0)[:2] for t in g]))
    total = iter([1.0, 1.004])  # cumulative seconds before and after the step
    src = consumer.StepSource("x", tr, lambda: (next(items), 0.005, None), wait_probe=lambda: next(total))
    rec = consumer._run_step(1, src)
    assert rec.data_wait_s == pytest.approx(0.004) and sum(rec.waits) == pytest.approx(0.01)
    w = dataclasses.replace(SMALL, warmup_steps=1, steps=1)
    s = summary.summarize_mode([[_rec(0, ["a"]), rec]], w)
    b = s["breakdown_ms"]
    assert b["wait_ms"] == pytest.approx(4.0) and b["own_ms"] == pytest.approx(6.0) and b["next_ms"] == pytest.approx(10.0)
    assert s["data_wait_known"] is True


class _Metrics:
    def __init__(self, d):
        self.d = d

    def to_dict(self):
        return dict(self.d)


class _DS:
    def __init__(self, d):
        self.metrics = _Metrics(d)


def test_wait_probe_prefers_data_wait_and_falls_back_to_wait_total():
    assert consumer._data_wait_probe(_DS({"wait_s_total": 2.0, "data_wait_s_total": 0.5}))() == 0.5
    assert consumer.metrics_wait_key({"wait_s_total": 2.0, "data_wait_s_total": 0.5}) == "data_wait_s_total"
    assert consumer._data_wait_probe(_DS({"wait_s_total": 2.0}))() == 2.0  # a library without data_wait_s_total
    assert consumer.metrics_wait_key({"wait_s_total": 2.0}) == "wait_s_total"
    assert consumer._data_wait_probe(_DS({}))() == 0.0 and consumer.metrics_wait_key({}) == "unavailable"


def test_accel_trainer_waits_the_calibrated_compute():
    import time

    cal = {"dup": {"microbatch_s": [0.02, 0.01], "optimizer_step_s": 0.015, "step_s": 0.045}}
    tr = consumer.make_trainer(SMALL, SMALL_VLM, "dup", "accel", cal)
    items = _items(SMALL, SMALL_VLM, "dup", [t for g in workload.make_step_groups(SMALL, 0)[:2] for t in g])
    for item, want in zip(items, (0.02, 0.01)):
        t0, c0 = time.perf_counter(), time.thread_time()
        tr.microbatch(item)
        # waits the calibrated compute (wall) without computing it (CPU of this thread; load-independent)
        assert time.perf_counter() - t0 >= want and time.thread_time() - c0 < 0.05
    t0 = time.perf_counter()
    tr.optimizer_step()
    assert time.perf_counter() - t0 >= 0.015
    with pytest.raises(ConfigError, match="shared"):
        consumer.make_trainer(SMALL, SMALL_VLM, "shared", "accel", cal)
    with pytest.raises(ConfigError, match="calibration"):
        consumer.make_trainer(SMALL, SMALL_VLM, "dup", "accel", None)
    with pytest.raises(ConfigError, match="compute"):
        consumer.make_trainer(SMALL, SMALL_VLM, "dup", "gpu", cal)
    with pytest.raises(ConfigError, match="compute"):
        tb.run_transfer_benchmark(SMALL, ["iter_embedded"], compute="gpu", progress=False)


def test_calibration_times_each_microbatch_of_each_encoding():
    cal = consumer.calibrate_compute(SMALL, SMALL_VLM, reps=2, warmup=0)
    k = SMALL.microbatches_per_step
    for enc in workload.ENCODINGS:
        c = cal[enc]
        assert len(c["microbatch_s"]) == k and all(x > 0 for x in c["microbatch_s"])
        assert all(len(v) == 2 for v in c["samples"]["microbatch_s"])
        assert c["step_s"] == pytest.approx(sum(c["microbatch_s"]) + c["optimizer_step_s"])
    # dup micro-batches all do the same work: one pooled median; shared: the first (encode) and the last differ
    assert len(set(cal["dup"]["microbatch_s"])) == 1 and cal["dup"]["classes"] == ["microbatch"] * k
    assert cal["shared"]["classes"] == ["first", "last"]
    assert consumer._work_classes("shared", 4) == ["first", "middle", "middle", "last"]
    assert consumer._work_classes("shared", 1) == ["only"]
    assert cal["torch_threads"] == 1 and cal["shape"]["trajectories"] == SMALL.microbatch_size
    assert cal["shape"]["tokens"] == SMALL.tokens and cal["model"] == SMALL_VLM.name
    assert torch.get_num_threads() >= 1
    with pytest.raises(ConfigError):
        consumer.calibrate_compute(SMALL, SMALL_VLM, ["triple"])
    with pytest.raises(ConfigError):
        consumer.calibrate_compute(SMALL, SMALL_VLM, reps=0)


def test_calibration_runs_the_encodings_in_blocks_a_b_b_a(monkeypatch):
    order = []

    class Trainer:
        def __init__(self, w, cfg, enc):
            self.enc = enc

        def microbatch(self, item):
            pass

        def optimizer_step(self):
            order.append(self.enc)

    monkeypatch.setattr(consumer, "_Trainer", Trainer)
    monkeypatch.setattr(consumer, "_calibration_items", lambda w, cfg, enc: [None] * w.microbatches_per_step)
    cal = consumer.calibrate_compute(SMALL, SMALL_VLM, reps=3, warmup=1)
    # a drifting load weighs on both encodings alike: blocks a b b a, each block's first step a warm-up
    assert order == ["dup"] * 3 + ["shared"] * 3 + ["shared"] * 2 + ["dup"] * 2
    assert all(len(v) == 3 for enc in workload.ENCODINGS for v in cal[enc]["samples"]["microbatch_s"])
    order.clear()
    cal = consumer.calibrate_compute(SMALL, SMALL_VLM, reps=1, warmup=0)  # one step each: no second block
    assert order == ["dup", "shared"] and all(len(cal[e]["samples"]["optimizer_step_s"]) == 1 for e in ("dup", "shared"))


def _entry(ex, step, **kw):
    return {"exposed_latency_s": ex / 1e3, "exposed_latency_max_s": ex / 1e3, "step_s": step, "compute_s": step / 2,
            "breakdown_ms": {"next_ms": ex / 2, "wait_ms": ex / 4, "own_ms": ex / 4, "state_dict_ms": ex / 4,
                             "commit_ms": ex / 4}, "exactly_once": True, "wait_source": "wait_s_total", **kw}


def test_compute_summary_ratios_and_acceptance():
    ctl = {"transferqueue": _entry(300.0, 2.0),
           "transferqueue_best": {**_entry(1.0, 1.0, chosen_variant="async"), "shared": _entry(0.5, 0.5)},
           "iter": {**_entry(0.1, 0.9), "shared": _entry(0.2, 0.25)}}
    modes = {"iter": {**_entry(5.0, 1.1), "shared": _entry(4.0, 0.3)}, "iter_embedded": _entry(0.05, 0.8)}
    res = {"compute": "accel", "workload": {"workload": "image"}, "modes": modes, "controls": ctl,
           "machine": {"loadavg_at_start": [1, 1, 1], "loadavg_at_end": [2, 2, 2]},
           "calibration": {"reps": 3, "dup": {"microbatch_s": [0.1], "optimizer_step_s": 0.01, "step_s": 0.11,
                                              "samples": {}}}}
    s = summary.compute_summary(res)
    assert s["alone"]["iter"]["exposed_ms"] == pytest.approx(0.1) and s["alone"]["iter_embedded"]["step_s"] == 0.8
    assert s["interleaved"]["iter"]["exposed_ms"] == pytest.approx(5.0) and "iter_embedded" not in s["interleaved"]
    assert s["breakdown"]["transferqueue"]["wait_ms"] == pytest.approx(75.0)
    assert s["breakdown"]["iter"]["shared"]["commit_ms"] == pytest.approx(0.05)
    assert s["alone"]["transferqueue_best"]["variant"] == "async"
    e = s["end_to_end_alone"]
    assert (e["tq_dup"]["step_s"], e["tq_shared"]["step_s"], e["iter_dup"]["step_s"], e["iter_shared"]["step_s"],
            e["tq_sync_dup"]["step_s"]) == (1.0, 0.5, 0.9, 0.25, 2.0)
    r = s["ratios"]
    assert r["exposed_transferqueue_best_over_iter"] == pytest.approx(10.0)
    assert r["exposed_transferqueue_over_iter"] == pytest.approx(3000.0)
    assert r["step_iter_over_transferqueue_best_dup"] == pytest.approx(0.9)
    assert r["step_iter_over_transferqueue_best_shared"] == pytest.approx(0.5)
    assert r["end_to_end_transferqueue_dup_over_iter_shared"] == pytest.approx(8.0)
    assert r["end_to_end_transferqueue_best_dup_over_iter_shared"] == pytest.approx(4.0)
    assert r["exposed_iter_embedded_over_iter"] == pytest.approx(0.5)
    assert s["ratios_interleaved"]["exposed_transferqueue_best_over_iter"] is None  # no interleaved tq run
    a = s["acceptance"]
    assert a["iter_exposed_ms_le_0.15"]["met"] is True and a["iter_exposed_ms_le_0.15"]["applies"] is True
    assert a["exposed_transferqueue_best_over_iter_ge_5"]["met"] is True
    assert a["step_iter_over_transferqueue_best_shared_le_1"]["met"] is True
    assert a["end_to_end_transferqueue_dup_over_iter_shared_ge_5.8"]["applies"] is False  # judged at omni seed size
    assert s["calibration"]["dup"]["step_s"] == 0.11 and "samples" not in s["calibration"]["dup"]
    assert s["loadavg"] == {"start": [1, 1, 1], "end": [2, 2, 2], "calibration": [None, None]}
    seed = summary.compute_summary({**res, "workload": workload.omni_workload(16, 448).to_dict()})
    assert seed["workload_kind"] == "omni_seed"
    assert seed["acceptance"]["end_to_end_transferqueue_dup_over_iter_shared_ge_5.8"]["applies"] is True
    assert seed["acceptance"]["end_to_end_transferqueue_dup_over_iter_shared_ge_5.8"]["met"] is True
    assert seed["acceptance"]["end_to_end_transferqueue_best_dup_over_iter_shared_ge_1.5"]["met"] is True
    assert summary.compute_summary({**res, "workload": workload.omni_workload().to_dict()})["workload_kind"] == "omni"
    json.dumps(output.strict_json(s), allow_nan=False)


def test_cli_seed_size_and_compute_flags():
    import argparse

    parser = argparse.ArgumentParser()
    tb.add_arguments(parser)
    a = parser.parse_args([])
    assert a.compute == "accel" and a.interleave is None and not a.omni_seed_size
    a = parser.parse_args(["--omni-seed-size", "--compute", "cpu", "--no-interleave"])
    assert a.omni_seed_size and a.compute == "cpu" and a.interleave is False
    w, cfg = tb._workload_of(argparse.Namespace(workload="omni", omni_seed_size=True, omni_frames=None, omni_px=None,
                                                smoke=False), 4, 1)
    assert (w.workload, w.video_frames, w.frame_px, w.audio_seconds, w.audio_rate) == ("omni", 16, 448, 30.0, 16000)
    assert (w.steps, w.warmup_steps) == (4, 1) and cfg is models.OMNI_VLM
    assert summary._workload_kind(w.to_dict()) == "omni_seed"
    # one run's payloads sized against Ray's object store: all pipelines interleaved, one alone
    assert tb._object_store_bytes(SMALL, True, 4) == 4 << 30
    assert tb._object_store_bytes(w, False, 4) >= w.total_steps * w.trajectories_per_step * w.media_bytes


def test_transferqueue_best_picks_the_lower_exposed_variant_per_encoding_and_the_2x2():
    def s(ex, step):
        return {"exposed_latency_s": ex, "exposed_latency_max_s": ex, "step_s": step, "compute_s": step / 2}

    modes = {"transferqueue_best": {"variants": {"async": {**s(0.03, 1.0), "shared": s(0.05, 0.8)},
                                                 "loader": {**s(0.20, 1.2), "shared": s(0.01, 0.9)}}},
             "iter": {**s(0.002, 0.9), "shared": s(0.001, 0.6)}}
    summary.pick_tq_best(modes)
    best = modes["transferqueue_best"]
    assert best["chosen_variant"] == "async" and best["shared"]["chosen_variant"] == "loader"
    assert best["variants_exposed_ms"] == pytest.approx({"async": 30.0, "loader": 200.0})
    e = summary.two_by_two(modes, "iter")
    assert e["tq_dup"]["step_s"] == 1.0 and e["tq_shared"]["step_s"] == 0.9
    assert e["iter_dup"]["exposed_ms"] == pytest.approx(2.0) and e["iter_shared"]["step_s"] == 0.6
    assert e["effects"]["transfer_dup"] == pytest.approx(1.0 / 0.9)
    assert e["effects"]["encoding_iter"] == pytest.approx(0.9 / 0.6)
    assert e["effects"]["both"] == pytest.approx(1.0 / 0.6)


@pytest.mark.parametrize("kind", workload.WORKLOADS)
def test_gpu_preset_config(kind):
    p = tb.gpu_config(kind)
    assert p.device == "cuda" and p.fetches == ("sample", "eager", "iter") and p.budget_s <= 300
    assert set(p.encodings) == set(workload.ENCODINGS)
    assert models.media_tokens(p.model, p.workload) <= p.workload.prompt_tokens
    if kind == "omni":
        assert (p.workload.video_frames, p.workload.frame_px) == (16, 448)
    with torch.device("meta"):
        models.TinyVLM(p.model, p.workload)  # the model builds at the preset's shapes
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
    assert "CUDA" in summary.format_table(res)
    json.dumps(output.strict_json(res), allow_nan=False)


@pytest.mark.timeout(180)
def test_consumer_processes_exit_when_the_driver_dies():
    """A benchmark killed mid-run (a time-out) leaves no consumer process behind."""
    import signal
    import time

    code = ("import time\nfrom benchmarks.common import harness\npool = harness.WorkerPool(1)\n"
            "print(pool.procs[0].pid, flush=True)\ntime.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(driver.stdout.readline())
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 150
    alive = True
    while alive and time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as fh:
                alive = fh.read().split()[2] != "Z"
        except FileNotFoundError:
            alive = False
        time.sleep(0.5)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the consumer process outlived its driver"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_without_the_interleaved_run(tmp_path):
    """`--no-interleave`: each knitdata mode runs alone only (Ray started for it), exactly once."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (the process modes need it)")
    out = tmp_path / "transfer.json"
    cmd = [sys.executable, "-m", "benchmarks", "transfer", "--smoke", "--no-progress", "--json", str(out), "--plot", "",
           "--modes", "iter", "iter_embedded", "--no-interleave"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads(out.read_text())
    assert {r["mode"] for r in res["runs"]} == {"iter_embedded"}  # nothing interleaved: iter ran alone only
    assert {r["mode"] for r in res["control_runs"]} == {"iter"}
    for r in res["runs"] + res["control_runs"]:
        assert (r["lost"], r["duplicated"], r["unexpected"]) == (0, 0, 0) and r["delivered"] == r["expected"], r["mode"]



# --- omni ---
OMNI_MP4 = dataclasses.replace(OMNI_SMALL, video_container=True)


def test_omni_container_workload_is_decoded_by_the_consumers():
    """--omni-video container: one MP4 per group, decoded with PyAV; dup and shared give the same gradients, the
    container is decoded once per unique video with shared encoding, and transferqueue's rows decode alike."""
    pytest.importorskip("av")
    from knitdata.media.video import probe_video

    g = workload.make_group(OMNI_MP4, 0, 1)
    assert [m.kind for m in g[0].media] == ["video", "audio"] and OMNI_MP4.media_kinds == ("video", "audio")
    frames, _ = probe_video(g[0].media[0].data)
    assert len(frames) == OMNI_MP4.video_frames
    trajs = [t for grp in workload.make_step_groups(OMNI_MP4, 0)[:2] for t in grp]
    grads = {}
    for enc in workload.ENCODINGS:
        tr = consumer._Trainer(OMNI_MP4, OMNI_VLM_SMALL, enc)
        for item in _items(OMNI_MP4, OMNI_VLM_SMALL, enc, trajs):
            tr.microbatch(item)
        grads[enc] = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    assert grads["dup"].keys() == grads["shared"].keys() and any(n.startswith("encoder.") for n in grads["dup"])
    for n, gr in grads["dup"].items():
        torch.testing.assert_close(grads["shared"][n], gr, rtol=1e-4, atol=1e-6, msg=n)
    col = consumer.dataset_kwargs(OMNI_MP4, OMNI_VLM_SMALL, "shared")["media_collator"]
    col([trajs[:2], trajs[2:]])
    assert sorted(col.processor.decodes.values()) == [1, 1]  # 2 groups: each container decoded once
    with pytest.raises(ConfigError, match="even"):
        dataclasses.replace(OMNI_MP4, video_frames=3)
    args = argparse.Namespace(workload="omni", omni_seed_size=False, omni_frames=None, omni_px=None, smoke=True,
                              omni_video="container")
    assert tb._workload_of(args, 1, 1)[0].video_container


def test_omni_container_transferqueue_rows_decode_like_knitdata():
    pytest.importorskip("av")
    pytest.importorskip("tensordict")
    import numpy as np
    from tensordict import TensorDict

    group = workload.make_group(OMNI_MP4, 0, 1)
    n = len(group)
    fields = {"input_ids": torch.stack([torch.cat([t.prompt_ids, t.response_ids]) for t in group]),
              "tidx": torch.tensor([int(t.id[1:6]) * OMNI_MP4.trajectories_per_step
                                    + int(t.id[7:10]) * OMNI_MP4.group_size + int(t.id.rsplit("t", 1)[1]) for t in group])}
    for name, item in (("video", group[0].media[0]), ("audio", group[0].media[1])):
        fields[name] = torch.from_numpy(np.frombuffer(item.data, dtype=np.uint8).copy()).unsqueeze(0).expand(n, -1)
    item = baselines._TQDecode(OMNI_MP4, OMNI_VLM_SMALL).dup(TensorDict(fields, batch_size=n), 1, 2)
    ref = consumer.dataset_kwargs(OMNI_MP4, OMNI_VLM_SMALL, "dup")["collate"](group)  # knitdata's dup collate
    assert item.ids == tuple(t.id for t in group)
    for kind in OMNI_MP4.media_kinds:
        torch.testing.assert_close(item.inputs[kind], ref.tensors[f"{kind}_inputs"])


# ------------------------------------------------------------------------------------- media stored once (43)
@pytest.mark.parametrize("dedup", [True, False])
def test_runs_report_bytes_stored_moved_and_the_storage_high_water_mark(dedup):
    """Each knitdata run reports, from its units' stats, bytes stored per group, the high-water mark and bytes
    moved per step; with media stored once a group's image is held once, with copies once per member."""
    res = tb.run_transfer_benchmark(SMALL, ["iter_embedded"], shared_modes=[], cfg=SMALL_VLM, timeout_s=60,
                                    progress=False, log=lambda s: None, compute="accel", calibration_reps=1,
                                    media_dedup=dedup)
    assert res["media_dedup"] is dedup
    m = res["modes"]["iter_embedded"]
    st = m["storage"]
    image = 3 * 56 * 56
    groups = SMALL.total_steps * SMALL.groups_per_step
    assert st["media_dedup"] is dedup and st["groups"] == groups
    own = st["bytes_stored_per_group"] - (image if dedup else SMALL.group_size * image)
    assert 0 < own < SMALL.group_size * 4096  # tokens and tensors of the group's members, nothing more
    assert st["high_water_bytes"] >= st["bytes_stored_per_group"] * groups  # the whole workload was put first
    assert st["media_items"] == (groups if dedup else 0)
    assert st["media_bytes_saved"] == ((SMALL.group_size - 1) * image * groups if dedup else 0)
    row = res["media"]["by_mode"]["iter_embedded/dup"]
    assert (row["dedup"] if dedup else row["copies"])["bytes_stored_per_group"] == st["bytes_stored_per_group"]
    text = summary.format_table(res)
    assert "stored MiB/group" in text and "high-water MiB" in text


def test_media_summary_compares_dedup_with_copies():
    def run(stored: float, moved: float, step: float) -> dict:
        return {"step_s": step, "exposed_latency_s": 0.001, "exposed_latency_max_s": 0.002, "compute_s": step,
                "breakdown_ms": {"wait_ms": 0.5}, "bytes_moved_per_step": moved,
                "storage": {"bytes_stored_per_group": stored, "high_water_bytes": 10 * stored, "media_dedup": True}}
    res = {"media_dedup": True, "controls": {"iter": run(10.0, 100.0, 1.0)},
           "media_copies": {"iter": run(80.0, 700.0, 1.1)}}
    row = summary.media_summary(res)["by_mode"]["iter/dup"]
    assert row["dedup"]["bytes_stored_per_group"] == 10.0 and row["copies"]["bytes_moved_per_step"] == 700.0
    r = row["ratios_copies_over_dedup"]
    assert r["bytes_stored_per_group"] == 8.0 and r["bytes_moved_per_step"] == 7.0 and r["step_s"] == pytest.approx(1.1)
    assert "iter/shared" not in summary.media_summary(res)["by_mode"]


def test_copies_controls_are_knitdata_process_modes():
    with pytest.raises(ConfigError, match="copies_controls"):
        tb.run_transfer_benchmark(SMALL, ["iter_embedded"], copies_controls=["floor"], progress=False)
