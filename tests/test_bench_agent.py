"""``knitdata bench agent --smoke`` end to end: the CLI runs, prints the ratios and the load, writes the documented keys.

No timing is asserted (speed claims come from the benchmark itself): the byte and item counts are exact, so they are
checked exactly: each distinct screenshot stored, moved, processed and encoded once per mini-batch with content
addressing; every occurrence with per-trajectory copies; the fold gradients those of the duplicated forward.
"""

from __future__ import annotations

import json

from benchmarks.agent import FORMS, RUNS
from knitdata.cli import main


def test_bench_agent_smoke_counts_each_screenshot_once(tmp_path, capsys):
    path = tmp_path / "agent.json"
    assert main(["bench", "agent", "--smoke", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "copies / knitdata: moved" in out and "load average" in out
    report = json.loads(path.read_text())
    rows = {(r["form"], r["run"]): r for r in report["results"]}
    assert set(rows) == {(f, r) for f in FORMS for r in RUNS}
    for form in FORMS:
        k, c = rows[form, "knitdata"], rows[form, "copies"]
        shot = k["screenshot_bytes"]
        assert k["distinct"] == c["distinct"] and k["occurrences"] == c["occurrences"] > k["distinct"]
        # stored, processed, encoded once per mini-batch with content addressing; every copy without
        assert k["media_items_stored"] == k["processed"] == k["encoded"] == k["distinct"]
        assert c["media_items_stored"] == c["encoded"] == c["occurrences"] and c["processed"] == c["distinct"]
        # moved once: the same token payloads plus each distinct screenshot once vs every occurrence
        assert k["token_bytes_per_step"] == c["token_bytes_per_step"] > 0
        assert k["moved_bytes_per_step"] == k["token_bytes_per_step"] + k["distinct"] * shot
        assert c["moved_bytes_per_step"] == c["token_bytes_per_step"] + c["occurrences"] * shot
        assert k["stored_bytes_per_step"] < c["stored_bytes_per_step"]
        assert k["table_copied_bytes"] == c["table_copied_bytes"] == 0  # patchify wrote into the table
        assert k["table_copied_bytes_before"] == k["table_bytes"] > 0  # before: the whole table copied again
        assert k["max_rel_grad_diff"] < 1e-5 and c["max_rel_grad_diff"] is None
        assert k["step_s"] > 0 and c["step_s"] > 0 and k["high_water_bytes"] > 0
        q = report["ratios"][form]
        assert abs(q["moved"] - c["moved_bytes_per_step"] / k["moved_bytes_per_step"]) < 1e-9
    assert report["ratios"]["turns"]["moved"] > report["ratios"]["episode"]["moved"] > 1
    assert len(report["loadavg_before"]) == 3 and len(report["loadavg_after"]) == 3


def test_video_patches_are_written_into_the_collators_table():
    """The omni workload's video preprocessing writes every frame's patches into the table (no second copy)."""
    import torch

    from benchmarks.common.models import OMNI_SMOKE_VLM, preprocess
    from benchmarks.common.workload import omni_workload
    from knitdata import MediaItem, MultimodalCollator, Trajectory, patchify

    w = omni_workload(frames=2, frame_px=28, video_container=True, cfg=OMNI_SMOKE_VLM)
    fn = preprocess(w, OMNI_SMOKE_VLM)["video"]
    p = OMNI_SMOKE_VLM.patch
    videos = [MediaItem("video", tensor=torch.randint(0, 256, (2, 3, 28, 28), dtype=torch.uint8)) for _ in range(2)]
    trajs = [Trajectory(id=f"t{i}", source="v", group="g", prompt_ids=torch.tensor([1]),
                        response_ids=torch.tensor([2]), media=[videos[i % 2]]) for i in range(4)]
    batch = MultimodalCollator({"video": fn})([trajs])
    table = batch.tables["video"]
    assert table.num_items == 2 and batch.pack_stats["copied_bytes"] == 0
    assert batch.pack_stats["placed_bytes"] == batch.pack_stats["table_bytes"]
    for u, v in enumerate(videos):
        assert torch.equal(table.item(u), torch.cat([patchify(p, size=(28, 28))(f) for f in v.tensor]))
