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
    head = report.render_headline({"transfer.json": tr, "admission_skewed.json": None, "encode.json": None})
    assert "transfer" in head.lower() and "20.0x" in head


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


def test_headline_compares_transfer_runs_alone_when_controls_exist():
    tr = {
        "modes": {"transferqueue": _mode(200.0, 0.9), "transferqueue_best": _mode(0.5, 0.7, variant="async"),
                  "iter": _mode(12.0, 0.8)},
        "controls": {"iter": {"exposed_ms": 10.0}, "transferqueue_best": {"exposed_ms": 30.0},
                     "transferqueue": {"exposed_ms": 250.0}},
        "end_to_end_alone": {"tq_dup": {"step_s": 0.81}, "iter_dup": {"step_s": 0.72}, "tq_shared": {"step_s": 0.58},
                             "iter_shared": {"step_s": 0.6}},
    }
    head = report.render_headline({"transfer.json": tr, "admission_skewed.json": None, "encode.json": None})
    assert "each system run alone" in head
    assert "10.00 ms" in head and "30.00 ms" in head and "; 3.0x)" in head and "(25x)" in head
    assert "0.810 / 0.720 s duplicated encoding" in head and "exposes 0.50 ms against `iter`'s 12.00 ms" in head
