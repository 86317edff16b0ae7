"""``knitdata bench vlm --smoke`` end to end: the CLI runs, prints the table and writes the documented keys.

No timing is asserted (speed claims come from the benchmark itself): only the keys, their types, that every
mode ran and that the shared modes' gradients match the model's own duplicated path.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("av")

from benchmarks.vlm import MODES  # noqa: E402
from knitdata.cli import main  # noqa: E402


def test_bench_vlm_smoke_writes_the_documented_keys(tmp_path, capsys):
    path = tmp_path / "vlm.json"
    assert main(["bench", "vlm", "--smoke", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "load average" in out
    report = json.loads(path.read_text())
    rows = report["results"]
    families = ("qwen2_5_vl", "qwen2_audio", "qwen2_5_omni", "qwen3_vl")
    assert {(r["family"], r["mode"]) for r in rows} == {(f, m) for f in families for m in MODES}
    for r in rows:
        for key in ("family", "mode", "step_s", "speedup", "peak_mem_bytes", "max_rel_grad_diff"):
            assert key in r, key
        assert r["step_s"] > 0 and r["speedup"] > 0
        assert r["max_rel_grad_diff"] < 1e-4, r  # float32: the shared modes give the model's own gradients
        assert r["occurrences"] > r["unique_items"] > 0
    assert all(r["max_rel_grad_diff"] == 0 for r in rows if r["mode"] == "native")
    for r in rows:
        if r["family"] == "qwen2_5_omni":  # image, video and audio; each unique video decoded once
            assert r["unique_items_by_kind"] == {"audio": 2, "image": 2, "video": 2}, r
            assert r["video_decodes"] == [1, 1], r
        else:
            assert r["video_decodes"] == [] and len(r["unique_items_by_kind"]) == 1
    assert len(report["loadavg_before"]) == 3
