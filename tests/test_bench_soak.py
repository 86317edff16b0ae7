"""A short soak as a test: ``knitdata bench soak`` end to end (CLI, table, JSON), nothing lost or duplicated.

Long soaks are benchmarks (``python benchmarks/soak.py --seconds 300``); this one runs about 8 seconds with
consumer restarts from saved state every few micro-batches and a producer ten times faster than the consumers.
No timing is asserted: only exactly-once delivery and the memory bounds. The cross-process soak of the Ray
engine (``--processes``: a consumer restart is a SIGKILL of its process and a new process restoring from the
JSON state on disk; one coordinator kill) runs in a subprocess under a hard time-out, so pytest never imports Ray.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.soak import Ledger, SoakConfig, format_table, run_soak, run_soak_processes, summarize_runs
from knitdata.cli import main
from knitdata.errors import ConfigError

REQUIRED_KEYS = ("lost", "duplicated", "store_high_water_bytes", "rss_growth_bytes", "capacity_bytes",
                 "throughput_per_s")


def test_soak_cli_short_run_loses_and_duplicates_nothing(tmp_path, capsys):
    out = tmp_path / "soak.json"
    plot = tmp_path / "soak.png"
    rc = main(["bench", "soak", "--seconds", "6", "--json", str(out), "--no-progress", "--restart-every", "7",
               "--traj-kib", "128", "--consume-ms", "2", "--plot", str(plot)])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert rc == 0, (printed, r.get("errors"))
    for k in REQUIRED_KEYS:
        assert k in r, k
    assert r["lost"] == 0 and r["duplicated"] == 0 and r["corrupt"] == 0 and r["unexpected"] == 0
    assert r["trajectories"] > 0 and r["trajectories"] == r["put"]
    assert r["restarts"] > 0
    assert r["store_high_water_bytes"] <= r["capacity_bytes"] + r["largest_trajectory_bytes"]
    assert r["rss_growth_bytes"] <= r["capacity_bytes"] + 64 * 2**20
    assert r["throughput_per_s"] > 0
    assert "lost" in printed and "duplicated" in printed and "embedded" in printed  # the table
    assert plot.stat().st_size > 0 and len(r["timeline"]) > 5
    assert all(p[1] <= r["store_bound_bytes"] for p in r["timeline"])  # store use sampled over the run


def test_ledger_counts_redelivery_after_restore_apart_from_duplicates():
    led = Ledger()
    for t in ("a", "b", "c"):
        led.accept(t)
    led.commit(["a"])
    led.roll_back(["b"])  # received, then the consumer crashed before saving a state past it
    led.commit(["b"])  # delivered again after the restore: a re-delivery
    assert led.redelivered == 1 and led.duplicated == 0 and led.lost == 1  # "c" never arrived
    led.commit(["a"])  # a real duplicate
    led.commit(["c"])
    assert led.duplicated == 1 and led.lost == 0


def test_soak_config_is_validated_and_table_renders():
    with pytest.raises(ConfigError):
        run_soak(SoakConfig(seconds=1, crash_point="nowhere"), progress=False)
    with pytest.raises(ConfigError):
        run_soak(SoakConfig(seconds=0), progress=False)
    # the cross-process mode is the Ray engine's; checked before anything starts
    with pytest.raises(ConfigError, match="--engine ray"):
        run_soak_processes(SoakConfig(seconds=1, engine="embedded"), progress=False)
    with pytest.raises(ConfigError, match="num_producers"):
        run_soak_processes(SoakConfig(seconds=1, engine="ray"), num_producers=0, progress=False)
    with pytest.raises(ConfigError, match="--engine ray"):
        main(["bench", "soak", "--processes", "--seconds", "1", "--no-progress"])
    row = {"engine": "embedded", "seconds": 1.0, "trajectories": 3, "throughput_per_s": 3.0, "lost": 0,
           "duplicated": 0, "corrupt": 0, "restarts": 1, "redelivered_after_restore": 0, "capacity_bytes": 2**20,
           "store_high_water_bytes": 2**19, "store_bound_bytes": 2**20 + 10, "rss_growth_bytes": 0,
           "rss_bound_bytes": 2**26, "store_put_wait_s": 0.0, "errors": [], "ok": True}
    table = format_table([row])
    assert "throughput" in table and "embedded" in table and "yes" in table
    xproc = dict(row, engine="ray", mode="cross_process", label="ray (processes)", coordinator_restarts=3)
    table = format_table([row, xproc])
    assert "ray (processes)" in table.splitlines()[0]
    assert [ln for ln in table.splitlines() if ln.startswith("coordinator kills")][0].split("|")[2].strip() == "3"
    # one command's JSON with two cross-process runs (a fault-free control beside the faulty run) sums them up
    quiet = dict(xproc, unexpected=0, producer_processes=2, consumer_processes=2, consumer_process_restarts=0,
                 coordinator_restarts=0, throughput_per_s=50.0)
    faulty = dict(quiet, lost=1, consumer_process_restarts=4, coordinator_restarts=2, throughput_per_s=4.0)
    assert summarize_runs([quiet]) == quiet
    s = summarize_runs([quiet, faulty])
    assert s["runs"] == [quiet, faulty] and s["mode"] == "cross_process"
    assert (s["lost"], s["consumer_process_restarts"], s["coordinator_restarts"]) == (1, 4, 2)
    assert s["throughput_per_s"] == 4.0 and s["producer_processes"] == 2 and s["consumer_processes"] == 2
    assert "mode" not in summarize_runs([row | {"mode": "threads", "unexpected": 0}, faulty])


@pytest.mark.slow  # a soak: make test-slow (and .ci/run after make test)
def test_soak_cross_process_ray_survives_consumer_sigkill_and_coordinator_kill(tmp_path):
    """Producer and consumers in their own processes (Ray engine): a consumer process is SIGKILLed mid-step and a
    new one restores from the JSON state on disk; the coordinator actor is SIGKILLed once and replays its
    journal. Nothing is lost, duplicated or unexpected. Ray runs only in the subprocess (hard time-out)."""
    import importlib.util
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed")
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "xproc.json"
    cmd = [sys.executable, "-m", "knitdata", "bench", "soak", "--engine", "ray", "--processes", "--producers", "1",
           "--consumers", "2", "--seconds", "3", "--restart-every", "2", "--max-restarts", "1", "--crash-point",
           "mid_step", "--kill-coordinator", "1", "--max-kills", "1", "--no-progress", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path),
                         start_new_session=True)
    try:
        printed, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        printed, err = p.communicate()
        pytest.fail(f"the cross-process soak did not finish within 240 s:\n{err[-4000:]}")
    assert out.exists(), (p.returncode, printed[-2000:], err[-4000:])
    r = json.loads(out.read_text())
    assert p.returncode == 0, (printed, r.get("errors"), err[-4000:])
    for k in REQUIRED_KEYS + ("coordinator_restarts", "consumer_process_restarts"):
        assert k in r, k
    assert r["mode"] == "cross_process" and r["engine"] == "ray"
    assert r["producer_processes"] == 1 and r["consumer_processes"] == 2
    assert r["lost"] == 0 and r["duplicated"] == 0 and r["unexpected"] == 0 and r["corrupt"] == 0
    assert r["errors"] == []
    assert r["trajectories"] > 0 and r["trajectories"] == r["put"]
    assert r["consumer_process_restarts"] >= 1  # a real process SIGKILL and a new process restoring from disk
    assert r["consumer_processes_started"] == 2 + r["consumer_process_restarts"]
    assert r["rolled_back"] >= 1 and r["redelivered_after_restore"] == r["rolled_back"]  # mid-step: comes again
    assert r["coordinator_restarts"] == 1
    assert r["store_high_water_bytes"] <= r["store_bound_bytes"]
    assert "ray (processes)" in printed  # the table names the mode


def test_soak_reshape_kills_and_restores_whole_jobs(tmp_path):
    """``bench soak --reshape`` (cheap): one job SIGKILLed after a checkpoint, restored onto other nodes and twice the
    ranks, run to the end: every prompt counted exactly ``group_size`` times, the reissued prompts those in flight."""
    out = tmp_path / "soak_reshape.json"
    rc = main(["bench", "soak", "--reshape", "--rounds", "1", "--prompts", "100", "--kill-within", "0.5",
               "--dir", str(tmp_path / "w"), "--json", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0, r["errors"]
    assert r["mode"] == "reshape" and r["kills"] == 1 and r["jobs"] == 2 and r["restores_other_topology"] == 1
    assert r["restores_other_ranks"] == 1 and [x["ranks"] for x in r["rounds"]] == [2, 4]
    assert r["lost"] == 0 and r["duplicated"] == 0 and r["reissue_mismatch"] == [] and r["ok"]
    assert r["trajectories_counted"] == 100 * r["group_size"]
