"""``knitdata bench journal``: a tiny smoke run (figures are not asserted, only their shape and consistency)."""

from __future__ import annotations

import json

from knitdata.cli import main


def test_journal_bench_smoke_compares_settings_side_by_side(tmp_path, capsys) -> None:
    out = tmp_path / "journal.json"
    rc = main(["bench", "journal", "--trajectories", "600", "--compact-every", "0", "200", "--repeats", "1",
               "--dir", str(tmp_path / "j"), "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    none, compacted = report["settings"]["0"], report["settings"]["200"]
    assert none["equal"] and compacted["equal"]  # both recover the plane that ran
    assert none["compactions"] == 0 and none["snapshot_bytes"] == 0 and none["replayed"] == none["journal_records"]
    assert compacted["compactions"] >= 2 and compacted["snapshot_bytes"] > 0
    assert compacted["journal_records"] < 200 and compacted["replayed"] == compacted["journal_records"]
    assert compacted["journal_bytes"] < none["journal_bytes"]
    assert len(report["loadavg_start"]) == 3
    text = capsys.readouterr().out
    assert "restart s" in text and "load average" in text
