"""Ray units with media stored once (issue 43): one copy per digest with exact reference counts through put,
references, reads, release, spill, a unit's death and a coordinator kill; a consumer's share moves each distinct
media item once. Scenarios run in driver subprocesses (``tests/_ray_media_scenarios.py``) against a local 3-node
cluster; the pytest process never imports Ray."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("ray")

from _ray_helpers import ClusterProcess  # noqa: E402
from _ray_media_scenarios import run_media_scenario  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster() -> ClusterProcess:
    with ClusterProcess(nodes=3, cpus=2, store_mb=128, timeout_s=150) as c:
        yield c


@pytest.fixture(scope="module")
def units(cluster: ClusterProcess) -> dict:
    return run_media_scenario(cluster.address, "media_units")


def _exact(check: dict) -> None:
    assert check["ok"], check
    assert check["pairs"] == check["refs"] and check["bytes"] == check["distinct_bytes"] and not check["leaked"], check


def test_units_hold_one_copy_per_digest_with_exact_counts(units: dict) -> None:
    r = units
    st, check = r["after_put"]["stats"], r["after_put"]["check"]
    _exact(check)
    # 2 groups of 4: per group a video and an image shared, per trajectory its own clip
    assert st["media_items"] == 2 * 2 + 8 and st["media_refs"] == 8 * 3 == check["pairs"]
    assert st["media_bytes"] == r["distinct_media_bytes"]
    assert st["used_bytes"] == r["own_bytes"] + r["distinct_media_bytes"]  # each distinct item once
    assert st["media_bytes_saved"] == r["logical_bytes"] - r["own_bytes"] - r["distinct_media_bytes"]
    # the put sent each distinct item once: records without media + one media record per digest
    put = next(iter(r["put_meter"].values()))
    assert put["local_bytes"] + put["cross_bytes"] == r["traj_record_bytes"] + r["media_record_bytes"]
    # a read moves records + each distinct item once; equal digests are one object; read-only views
    rd = r["read"]
    assert rd["equal"] and rd["same_object"] and rd["media_fetched"] == st["media_items"]
    assert rd["bytes"]["local_bytes"] == r["traj_record_bytes"] + r["media_record_bytes"]
    assert not rd["writable"]
    assert r["read_again_bytes"] == r["read_again_records"]  # the reader holds the share's media: records only
    assert r["get_same_object"]  # one get(): equal digests are one object
    assert r["get_records_decode"]


def test_references_resolved_or_refused_naming_trajectory_and_digest(units: dict) -> None:
    r = units
    assert r["ref_here"] == ["ok"] and r["ref_other_unit"] == ["ok"] and r["ref_other_equal"]
    for key in ("ref_nowhere", "ref_nowhere_admit"):
        err = r[key]
        assert err[0] == "MediaRefError" and err[1] == "t400" and err[2] == "media.1", err
        assert err[4] == "ab" * 16 and "ab" * 16 in err[3], err
    assert all(a == b for a, b in r["ref_nowhere_unchanged"].values()), r["ref_nowhere_unchanged"]
    assert not r["contains_bad"]
    st = r["after_refs"]["stats"]
    _exact(r["after_refs"]["check"])
    assert st["media_resolved"] == 2 and st["media_copied_in"] == 1
    # release: nothing freed while referenced, everything freed after
    _exact(r["after_half"]["check"])
    assert r["after_half"]["still_equal"]
    end = r["after_all"]["stats"]
    _exact(r["after_all"]["check"])
    assert end["used_bytes"] == 0 and end["media_items"] == 0 and end["media_refs"] == 0 and end["num_items"] == 0
    # a client that believed the unit still held the video resent its content: never dropped
    assert r["resent"] == ["ok"] and r["resent_equal"]


def test_spill_unit_loss_and_per_trajectory_copies(units: dict) -> None:
    r = units
    sp = r["spill"]
    assert r["spill_put"] == 4 and sp["equal"]
    _exact(sp["check"])
    assert sp["spill_stats"]["written_through"] == 4 and sp["spill_stats"]["spilled_over"] >= 1  # own records on disk
    assert sp["stats"]["media_items"] == 2 + 4 and sp["stats"]["media_refs"] == 12  # media stay in memory, counted
    _exact(r["spill_after_release"]["check"])
    assert r["spill_after_release"]["stats"]["media_refs"] == 9
    # the unit died: its trajectories come back from the spill with their media (written once per digest)
    assert r["recovered"]["ids"] == ["t1", "t2", "t3"] and r["recovered"]["equal"]
    cp = r["copies"]
    assert cp["equal"] and cp["stats"]["media_items"] == 0 and cp["stats"]["used_bytes"] == r["logical_bytes"]
    assert cp["ref"][0] == "MediaRefError" and "media_dedup=False" in cp["ref"][3]


@pytest.mark.parametrize("fetch", ["eager", pytest.param("iter", marks=pytest.mark.slow),
                                   pytest.param("sample", marks=pytest.mark.slow)])
def test_a_share_moves_each_distinct_media_item_once(cluster: ClusterProcess, fetch: str) -> None:
    r = run_media_scenario(cluster.address, "media_moved_once", fetch=fetch)
    d, c = r["dedup"], r["copies"]
    assert sorted(i for ids in d["shares"].values() for i in ids) == sorted(
        i for ids in c["shares"].values() for i in ids)  # every trajectory once, both ways
    read = d["read"]
    moved = sum(row["local_bytes"] + row["cross_bytes"] for row in read.values())
    assert moved == sum(d["expected_moved"].values()), (read, d["expected_moved"])
    assert d["units_bytes_fetched"] == moved
    c_moved = sum(row["local_bytes"] + row["cross_bytes"] for row in c["read"].values())
    assert c_moved > 3 * moved  # groups of 4 share the video: per-trajectory copies move ~4x
    assert sum(c["stored"].values()) > 3 * sum(d["stored"].values())
    for check in d["media_check"].values():
        _exact(check)
        assert check["pairs"] == 0 and check["items"] == 0  # consumed and released: nothing left


@pytest.mark.slow
def test_counts_exact_through_coordinator_kill_and_unit_loss(cluster: ClusterProcess, tmp_path: Path) -> None:
    r = run_media_scenario(cluster.address, "media_faults", spill_root=str(tmp_path), timeout_s=600)
    ck = r["coordinator"]
    assert ck["killed"] == 2 and not ck["errors"], ck["errors"]
    got = ck["got"][0] + ck["got"][1]
    assert sorted(got) == sorted(ck["all_ids"]) and len(set(got)) == len(got)
    for checks in ck["checks"]:
        for check in checks.values():
            _exact(check)
    for check, st in r["after_put"].values():
        _exact(check)
        assert st["media_refs"] == 24 * 3 and st["media_items"] == 6 * 2 + 24
    for check, st in ck["after"].values():
        _exact(check)
        assert st["used_bytes"] == 0 and st["media_items"] == 0
    un = r["unit"]
    assert un["on_n1"] and un["recovered_equal"]
    assert sorted(un["seen"]) == un["all_ids"]
    check, st = un["n0_after"]
    _exact(check)
    assert st["used_bytes"] == 0 and st["media_items"] == 0


@pytest.mark.slow
def test_a_resumed_unit_rebuilds_media_counts_from_its_spill(cluster: ClusterProcess) -> None:
    r = run_media_scenario(cluster.address, "media_resume")
    b, a, e = r["before"], r["after"], r["end"]
    _exact(b["check"])
    _exact(a["check"])
    # the unreleased payloads (5 of 8) and the media they use: same references, same items as before the death
    assert a["stats"]["num_items"] == r["left"] == 5
    assert a["stats"]["media_refs"] == b["stats"]["media_refs"] == 15
    assert a["stats"]["media_items"] == b["stats"]["media_items"] == 2 + 2 + 5
    assert r["equal"]  # served from disk with their media
    _exact(e["check"])
    assert e["stats"]["media_items"] == 0 and e["stats"]["media_refs"] == 0 and e["stats"]["num_items"] == 0
