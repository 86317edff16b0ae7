"""Tests for benchmarks/report.py: the committed Markdown equals what the committed JSON renders, a changed
value is caught by ``--check``, and every renderer tolerates missing optional keys."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "report.py")

_spec = importlib.util.spec_from_file_location("knitdata_bench_report", SCRIPT)
report = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = report
_spec.loader.exec_module(report)


def _copy_tree(dst: str) -> str:
    """README.md, benchmarks/README.md and benchmarks/results/*.json under ``dst``."""
    os.makedirs(os.path.join(dst, report.RESULTS))
    for rel in report.FILES:
        os.makedirs(os.path.dirname(os.path.join(dst, rel)) or dst, exist_ok=True)
        shutil.copy(os.path.join(ROOT, rel), os.path.join(dst, rel))
    src = os.path.join(ROOT, report.RESULTS)
    for n in os.listdir(src):
        if n.endswith(".json"):
            shutil.copy(os.path.join(src, n), os.path.join(dst, report.RESULTS, n))
    return dst


def _edit_json(root: str, name: str, fn) -> None:
    path = os.path.join(root, report.RESULTS, name)
    with open(path, encoding="utf-8") as fh:
        d = json.load(fh)
    fn(d)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(d, fh)


def test_check_passes_on_the_committed_tree():
    out = subprocess.run([sys.executable, SCRIPT, "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout == ""


def test_every_block_in_the_files_is_registered_and_every_registered_block_is_used():
    names = set()
    for rel in report.FILES:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
            names |= {m.group("name") for m in report.MARKER.finditer(fh.read())}
    assert names == set(report.BLOCKS)


def test_a_changed_json_value_fails_check_with_a_diff_and_a_rerun_fixes_it(tmp_path, capsys):
    root = _copy_tree(str(tmp_path / "repo"))
    assert report.main(["--check", "--root", root]) == 0

    def bump(d):
        d["runs"][0]["throughput_per_s"] = 12345.678

    _edit_json(root, "soak.json", bump)
    capsys.readouterr()
    assert report.main(["--check", "--root", root]) == 1
    diff = capsys.readouterr().out
    assert "+| throughput (trajectories/s) | 12345.7" in diff
    assert "benchmarks/README.md" in diff
    assert report.main(["--root", root]) == 0
    assert report.main(["--check", "--root", root]) == 0
    with open(os.path.join(root, "benchmarks/README.md"), encoding="utf-8") as fh:
        assert "12345.7" in fh.read()


def test_a_hand_edit_inside_a_block_fails_check(tmp_path):
    root = _copy_tree(str(tmp_path / "repo"))
    path = os.path.join(root, "README.md")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    start = text.index("<!-- report:headline -->\n") + len("<!-- report:headline -->\n")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text[:start] + "- 99.9% faster, trust me.\n" + text[start:])
    assert report.main(["--check", "--root", root]) == 1


def test_a_missing_result_file_renders_a_note_not_a_crash(tmp_path):
    root = _copy_tree(str(tmp_path / "repo"))
    os.remove(os.path.join(root, report.RESULTS, "placement.json"))
    files = report.render_all(root)
    new = files["benchmarks/README.md"][1]
    assert "_No committed result yet (`benchmarks/results/placement.json`)._" in new
    assert report.main(["--check", "--root", root]) == 1


def test_unknown_block_name_is_an_error():
    with pytest.raises(KeyError, match="no-such-block"):
        report.render_text("<!-- report:no-such-block -->\n<!-- /report:no-such-block -->\n", ROOT, "x.md")


@pytest.mark.parametrize("name", sorted(report.BLOCKS))
def test_every_renderer_tolerates_empty_results(name):
    b = report.BLOCKS[name]
    text = b.render({n: {} for n in b.files + b.optional})
    assert isinstance(text, str)
    text = b.render({**{n: {} for n in b.files}, **{n: None for n in b.optional}})
    assert isinstance(text, str)


def test_rendering_is_idempotent():
    for rel in report.FILES:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
            once = report.render_text(fh.read(), ROOT, rel)
        assert report.render_text(once, ROOT, rel) == once


def _mode(ms: float, step: float, **kw):
    return {"exposed_latency_s": ms / 1000, "step_s": step, "delivered": 64, "expected": 64, "exactly_once": True,
            "encoding": "dup", **kw}


def test_transfer_renders_the_new_keys_when_present():
    tr = {
        "command": "python benchmarks/transfer.py --no-progress",
        "machine": {"cpus": 2, "loadavg_at_start": [1.0, 2.0, 3.0]},
        "modes": {"transferqueue": _mode(200.0, 0.9), "transferqueue_best": _mode(40.0, 0.8, variant="async"),
                  "iter": _mode(2.0, 0.8, shared=_mode(1.5, 0.6, encoding="shared"))},
        "end_to_end": {"tq_dup": {"step_s": 0.9, "exposed_ms": 40.0}, "tq_shared": {"step_s": 0.7, "exposed_ms": 41.0},
                       "iter_dup": {"step_s": 0.85, "exposed_ms": 2.0}, "iter_shared": {"step_s": 0.61, "exposed_ms": 1.5}},
        "controls": {"iter": {"exposed_ms": 3.25, "step_s": 0.82, "encoding": "dup", "exactly_once": True}},
        "latency_ratio_transferqueue_vs_iter": 100.0,
        "latency_ratio_transferqueue_best_vs_iter": 20.0,
    }
    text = report.render_transfer_result(tr)
    assert "transferqueue_best (async)" in text
    assert "| transferqueue (best) | 0.900 s (40.00 ms exposed) | 0.700 s (41.00 ms exposed) |" in text
    assert "| knitdata iter | 0.850 s (2.00 ms exposed) | 0.610 s (1.50 ms exposed) |" in text
    assert "| iter | dup | 3.25 | 2.00 | 0.820 | yes |" in text
    assert "20.00x interleaved" in text and "100.0x" in text
    assert "load average 1.00 / 2.00 / 3.00 at start" in text
    assert "command `python benchmarks/transfer.py --no-progress`" in text
    # a CPU-compute result does not make the README headline: that comes from the accel mode
    head = report.render_headline({"transfer.json": tr, "admission_skewed.json": None, "encode.json": None,
                                   "transfer_accel.json": None, "transfer_omni_seed_accel.json": None})
    assert "No committed result yet (`benchmarks/results/transfer_accel.json`)" in head and "20.0x" not in head


def test_transfer_without_the_new_keys_renders_the_current_table_only():
    text = report.render_transfer_result({"modes": {"transferqueue": _mode(200.0, 0.9), "iter": _mode(2.0, 0.8)}})
    assert "end_to_end" not in text and "controls" not in text
    assert "| transferqueue | dup |" in text
    assert "Every run delivered each of the 64 trajectories exactly once." in text


def test_transfer_flags_a_mode_that_is_not_exactly_once():
    text = report.render_transfer_result({"modes": {"iter": _mode(2.0, 0.8, exactly_once=False)}})
    assert "**Not exactly once:** iter/dup." in text


def test_transfer_omni_renders_when_present_and_a_note_when_absent():
    b = report.BLOCKS["transfer-omni"]
    assert "No committed result yet" in b.render({"transfer_omni.json": None})
    text = b.render({"transfer_omni.json": {"workload": {"name": "omni", "frames": 16},
                                            "modes": {"iter": _mode(2.0, 0.8)}}})
    assert "frames = 16" in text and "| iter | dup |" in text


def _soak_run(engine: str, thr: float, **kw):
    return {"engine": engine, "throughput_per_s": thr, "lost": 0, "duplicated": 0, "restarts": 3,
            "capacity_bytes": 1 << 20, "store_high_water_bytes": 1 << 19, "rss_growth_bytes": 1 << 21, "ok": True, **kw}


def test_soak_adds_the_cross_process_column_when_present():
    soak = {"runs": [_soak_run("embedded", 600.0), _soak_run("ray", 100.0)]}
    no = report.render_soak({"soak.json": soak, "soak_ray_xproc.json": None})
    assert "| | embedded | ray |".replace("| |", "|  |") in no and "soak_ray_xproc.json" in no
    xp = _soak_run("ray", 55.5, mode="cross_process", loadavg=[4.0, 3.0, 2.0])
    text = report.render_soak({"soak.json": soak, "soak_ray_xproc.json": xp})
    assert "ray (cross-process)" in text
    assert "| throughput (trajectories/s) | 600.0 | 100.0 | 55.5 |" in text
    assert "Load average 4.00 / 3.00 / 2.00" in text


@settings(max_examples=30, deadline=None)
@given(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), st.integers(min_value=0, max_value=10))
def test_soak_table_shows_the_json_figures(thr, lost):
    text = report.render_soak({"soak.json": {"runs": [_soak_run("embedded", thr, lost=lost)]}, "soak_ray_xproc.json": None})
    assert f"| throughput (trajectories/s) | {thr:.1f} |" in text
    assert f"| lost / duplicated | {lost} / 0 |" in text


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), min_size=3, max_size=3),
       st.sampled_from(["loadavg_start", "load_average_start", "loadavg_before"]))
def test_load_text_reads_every_spelling(load, key):
    text = report.load_text({key: load})
    assert text.startswith("load average ") and " / ".join(f"{x:.2f}" for x in load) + " at start" in text


def test_format_helpers_on_missing_values():
    assert report.f(None) == "-" and report.f("x") == "-" and report.f(True) == "-"
    assert report.f(float("nan")) == "-"
    assert report.pct(0.957) == "95.7%"
    assert report.g({"a": {"1": 2}}, "a", 1) == 2
    assert report.g({"a": None}, "a", "b", default=7) == 7
    assert report.table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---:|\n| 1 | 2 |"


def test_admission_and_learning_render_synthetic_results():
    pol = {"arch_staleness_positive_mean": 0.5, "reduction_positive_vs_train_batch": 0.9, "arch_staleness_mean": -0.1,
           "arch_staleness_p95": 1.0, "share_negative": 0.25, "quota_violations": 0}
    adm = {"params": {"name": "skewed", "sources": [{"name": "a", "quota": 8, "mean": 1.0, "sigma": 0.3}]},
           "policies": {"constraint_preserving": pol, "train_batch": {"arch_staleness_positive_mean": 5.0}}}
    text = report.render_admission({f"admission_{s}.json": (adm if s == "skewed" else None) for s in report.SCENARIOS})
    assert "**0.500 (90.0%)**, -0.100, 1.0, 25.0%, 0" in text
    lr = {"params": {"seeds": [0, 1]}, "regimes": {
        "colocated": {"auc": 0.6, "steps_to_0_8": 200.0, "reached_0_8": 2},
        "train_batch": {"auc": 0.45, "steps_to_0_8": None, "reached_0_8": 0, "arch_staleness_positive_mean": 12.0}},
        "gap_closed": {"median": 1.1, "per_seed": {"0": 1.0, "1": 1.2}, "of_mean_auc": 1.05}}
    text = report.render_learning_result(lr)
    assert "| train_batch | 0.450 |" in text and "0/2" in text
    assert "25% below colocated's" in text and "median over seeds 1.10" in text


def _acc(ex, step, **kw):
    return {"exposed_ms": ex, "step_s": step, "compute_s": step * 0.9, "wait_ms": ex / 2, "own_ms": ex / 4,
            "state_dict_ms": ex / 8, "commit_ms": ex / 8, "next_ms": ex * 0.75, "exactly_once": True, **kw}


def _accel_result(kind="image", **over):
    alone = {"transferqueue": _acc(250.0, 0.9), "transferqueue_best": {**_acc(3.0, 0.5, variant="async"),
                                                                       "shared": _acc(2.5, 0.4)},
             "iter": {**_acc(0.12, 0.45), "shared": _acc(0.1, 0.3)}, "iter_embedded": _acc(0.05, 0.44)}
    e2e = {"tq_dup": {"step_s": 0.5, "exposed_ms": 3.0}, "tq_shared": {"step_s": 0.4, "exposed_ms": 2.5},
           "iter_dup": {"step_s": 0.45, "exposed_ms": 0.12}, "iter_shared": {"step_s": 0.3, "exposed_ms": 0.1},
           "tq_sync_dup": {"step_s": 0.9, "exposed_ms": 250.0}}
    ratios = {"exposed_transferqueue_best_over_iter": 25.0, "exposed_transferqueue_over_iter": 2083.3,
              "end_to_end_transferqueue_dup_over_iter_shared": 3.0,
              "end_to_end_transferqueue_best_dup_over_iter_shared": 1.667}
    acc = {"iter_exposed_ms_le_0.15": {"value": 0.12, "op": "<=", "threshold": 0.15, "met": True, "applies": kind == "image"},
           "end_to_end_transferqueue_dup_over_iter_shared_ge_5.8": {
               "value": 3.0, "op": ">=", "threshold": 5.8, "met": False, "applies": kind == "omni_seed"}}
    tr = {"command": "python benchmarks/transfer.py --no-progress", "compute": "accel",
          "compute_measures": "the data path, with the host CPU free during compute",
          "machine": {"cpus": 2, "loadavg_at_start": [0.5, 0.6, 0.7], "loadavg_at_end": [1.0, 1.1, 1.2]},
          "workload": {"workload": "omni" if kind != "image" else "image", "video_frames": 16, "frame_px": 448,
                       "audio_seconds": 30.0},
          "exactly_once_all_runs": True,
          "accel": {"workload_kind": kind, "alone": alone, "interleaved": {"iter": _acc(7.0, 0.46)},
                    "end_to_end_alone": e2e, "ratios": ratios, "acceptance": acc,
                    "ratio_meaning": {"exposed_transferqueue_best_over_iter": "tq best / iter"},
                    "calibration": {"model": "tiny (CPU)", "torch_threads": 1, "reps": 3, "loadavg_before": [0.4, 0.5, 0.6],
                                    "dup": {"microbatch_s": [0.06, 0.06], "optimizer_step_s": 0.002, "step_s": 0.122}}}}
    tr.update(over)
    return tr


def test_transfer_accel_renders_the_summary_by_call():
    text = report.render_transfer_accel_result(_accel_result())
    assert "Compute `accel`; what this run measures (from the JSON): the data path" in text
    assert "| **iter** | dup | **0.120** | 0.060 | 0.030 | 0.015 | 0.015 | 0.450 | 0.405 | yes |" in text
    assert "| transferqueue_best (async) | dup | 3.000 |" in text and "| transferqueue_best | shared | 2.500 | 1.250 |" in text
    assert "| transferqueue synchronous | 0.900 s (250.00 ms exposed) | - |" in text
    assert "| knitdata iter (Ray engine) | 0.450 s (0.12 ms exposed) | 0.300 s (0.10 ms exposed) |" in text
    assert "| `exposed_transferqueue_best_over_iter` | tq best / iter | 25.00x |" in text
    assert "`dup` 60.0 + 60.0 ms per micro-batch and 2.0 ms for the optimizer step" in text
    assert "`iter_exposed_ms_le_0.15` (0.120 <= 0.15): met" in text and "5.8" not in text.split("Acceptance")[1]
    assert "Every run, interleaved and alone, delivered each trajectory exactly once." in text
    assert "load average 0.50 / 0.60 / 0.70 at start, 1.00 / 1.10 / 1.20 at end" in text
    bad = _accel_result()
    bad["accel"]["alone"]["iter"]["exactly_once"] = False
    assert "**Not exactly once:** iter/dup (alone)." in report.render_transfer_accel_result(bad)
    assert "no `accel` section" in report.render_transfer_accel_result({"modes": {}})


def test_headline_transfer_comes_from_the_accel_result():
    none = {"admission_skewed.json": None, "encode.json": None}
    head = report.render_headline({**none, "transfer_accel.json": _accel_result(), "transfer_omni_seed_accel.json": None})
    assert "knitdata `iter` exposes 0.12 ms per step in all its data calls" in head
    assert "(`next()` waiting for data 0.06 ms, its own work 0.03 ms, `state_dict()` 0.015 ms, `commit()` 0.015 ms)" in head
    assert "3.00 ms for transferqueue at its best (transferqueue / iter 25.0x)" in head
    assert "250.00 ms driven synchronously (2083x)" in head
    assert "0.450 / 0.500 s (duplicated encoding), 0.300 / 0.400 s (shared encoding)" in head
    assert "seed's size" not in head
    seed = _accel_result("omni_seed")
    head = report.render_headline({**none, "transfer_accel.json": _accel_result(), "transfer_omni_seed_accel.json": seed})
    assert "omni workload at the seed's size (16 frames at 448 px and 30 s of audio per prompt" in head
    assert "takes 0.300 s per step against 0.900 s for transferqueue driven synchronously" in head
    assert "(3.00x; the seed claims up to 5.8x) and 0.500 s for transferqueue at its best" in head and "(1.67x)" in head
    missing = report.render_headline({**none, "transfer_accel.json": None, "transfer_omni_seed_accel.json": seed})
    assert "No committed result yet (`benchmarks/results/transfer_accel.json`)" in missing


def test_accel_blocks_note_a_missing_result_and_the_machine_prefers_accel():
    for name, fname in (("transfer-accel", "transfer_accel.json"), ("transfer-accel-omni", "transfer_omni_accel.json"),
                        ("transfer-accel-omni-seed", "transfer_omni_seed_accel.json")):
        b = report.BLOCKS[name]
        assert b.optional == (fname,)
        assert f"No committed result yet (`benchmarks/results/{fname}`)" in b.render({fname: None})
        assert "| **iter** | dup |" in b.render({fname: _accel_result()})
    m = report.render_machine({"transfer_accel.json": {"machine": {"cpus": 2}}, "transfer.json": {"machine": {"cpus": 4}},
                               "loader.json": None})
    assert m.startswith("As recorded in `results/transfer_accel.json`: 2 CPUs")
    m = report.render_machine({"transfer_accel.json": None, "transfer.json": {"machine": {"cpus": 4}}, "loader.json": None})
    assert m.startswith("As recorded in `results/transfer.json`: 4 CPUs")


def test_transfer_cpu_table_adds_the_breakdown_when_the_result_has_it():
    e = _mode(5.0, 0.8, breakdown_ms={"wait_ms": 1.0, "own_ms": 2.0, "state_dict_ms": 0.5, "commit_ms": 1.5})
    text = report.render_transfer_result({"compute": "cpu", "compute_measures": "contention", "modes": {"iter": e}})
    assert "| mode | encoding | engine | exposed ms/step | wait ms | own ms | state_dict ms | commit ms | max ms |" in text
    assert "| iter | dup | - | **5.00** | 1.00 | 2.00 | 0.500 | 1.500 |" in text
    assert "Compute `cpu`; what this run measures (from the JSON): contention." in text
