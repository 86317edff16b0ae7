"""One conformance suite for every engine: the same scenarios (``tests/_conformance.py``) on the embedded
engine (in this process) and on the Ray engine (a driver subprocess on a local 2-node ``ray.cluster_utils``
cluster), with the same expectations. The exactly-once resume cases are in ``tests/test_conformance_resume.py``
(their own file: pytest-xdist runs each file on one worker), the runner in ``tests/_conformance_run.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _conformance as cf  # noqa: E402
from _conformance_run import ENGINES, ENGINES_RAY_SLOW, cluster, run_on  # noqa: E402,F401 - cluster: the module's fixture

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("engine", ENGINES_RAY_SLOW)  # Ray's run (28-31 s) in make test-slow
def test_concurrent_first_puts_cannot_mix_schemas(engine, request):
    res = run_on(engine, request, "schema_race", rounds=3 if engine == "ray" else 6)
    for outcome in res["results"]:
        assert sorted(outcome.values()) == ["ValidationError", "ok"], outcome


EXPECTED_ERRORS = {
    "duplicate_id": ("ValidationError", "t0", "id"),
    "unknown_source": ("ValidationError", "t500", "source"),
    "schema": ("ValidationError", "t501", "scalars.bonus"),
    "withdrawn": ("ValidationError", "t502", "group"),
    "not_a_trajectory": ("FieldTypeError", None, "traj"),
    "bad_rank": ("ConfigError", None, None),
    "bad_fetch": ("ConfigError", None, None),
    "foreign_state": ("StateError", None, None),
    "put_after_close": ("PipelineClosedError", None, None),
    "store_full": ("StoreFull", None, None),
}


@pytest.mark.parametrize("engine", ENGINES)
def test_same_faults_same_errors(engine, request):
    res = run_on(engine, request, "errors")
    got = {k: tuple(v[:3]) for k, v in res.items()}
    assert got == EXPECTED_ERRORS, {k: res[k] for k in res if tuple(res[k][:3]) != EXPECTED_ERRORS.get(k)}
    assert "t702" in res["store_full"][3] and "rank 0: 1 uncommitted" in res["store_full"][3], res["store_full"]


@pytest.mark.parametrize("engine", ENGINES)
def test_no_wait_without_bound(engine, request):
    res = run_on(engine, request, "bounded_waits")
    assert res["timeout"][0] == "DataTimeoutError", res["timeout"]
    assert res["timeout_s"] < 10
    assert "math" in res["timeout"][3] or "code" in res["timeout"][3], res["timeout"]
    assert res["incomplete"][0] == "IncompleteStreamError", res["incomplete"]
    assert "g2" in res["incomplete"][3], res["incomplete"]
    assert res["incomplete_s"] < 20


def test_embedded_refuses_worker_processes():
    res = cf.run("workers", engine="embedded")
    assert res["refused"][0] == "EngineError"
    assert "ray" in res["refused"][1].lower()


@pytest.mark.ray
@pytest.mark.parametrize("fetch", ["iter"])
def test_ray_workers_split_in_plan_order_and_resume(fetch, request):
    ref = cf.run("workers", engine="embedded", fetch=fetch)["ref"]
    res = run_on("ray", request, "workers", fetch=fetch)
    assert res["before"] == ref[: len(res["before"])]
    assert res["before"] + res["after"] == ref


# ------------------------------------------------------------------------------------------------ fencing
def _ids(rows: list[Any]) -> list[str]:
    return [i for ids, _pos in rows for i in ids]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_replaced_but_alive_consumer_is_fenced(engine, request):
    """Issue 23.2: A takes one micro-batch of rank 0 and stalls; B takes rank 0 over; A's next call raises an
    error naming the rank and the newer holder; every micro-batch is delivered exactly once."""
    res = run_on(engine, request, "fencing")
    assert res["b"].get("error", ["no error"])[0] == "no error", res["b"]
    a_ids, b_ids = _ids(res["a_taken"] + res["a_after"]), _ids(res["b"]["rows"])
    assert res["a_after"] == [], "the fenced consumer got more micro-batches"
    assert res["a_error"][0] == "FencedError", res["a_error"]
    assert "rank 0" in res["a_error"][3] and "newer" in res["a_error"][3], res["a_error"]
    both = a_ids + b_ids
    assert len(both) == len(set(both)), "delivered twice"
    assert len(both) == 32, "dropped"
    if res["ref"] is not None:
        assert res["a_taken"] + res["b"]["rows"] == res["ref"]
    assert res["b"]["first_s"] < 5, "the newer holder waited for the lease"


# ------------------------------------------------------------------------------------------------ replays
@pytest.mark.parametrize("engine", ENGINES_RAY_SLOW)  # Ray's run (28-31 s) in make test-slow
def test_a_reordered_refill_is_refused(engine, request):
    """Issue 23.3: a new job refilled in another order than the run that saved the state: an error naming the
    rank and the mismatch, never a silent duplicate or skip."""
    res = run_on(engine, request, "replay", reorder=True)
    assert res["error"][0] == "StateError", res
    assert "rank 0" in res["error"][3] and "order" in res["error"][3], res["error"]
    ok = run_on(engine, request, "replay", reorder=False)
    assert ok["error"][0] == "no error", ok["error"]
    ids = _ids(ok["taken"] + ok["rest"])
    assert len(ids) == len(set(ids)) == 32


@pytest.mark.parametrize("engine", ENGINES_RAY_SLOW)
def test_a_refill_shorter_than_the_saved_position_is_refused(engine, request):
    """A new job refilled with fewer puts than the run that saved the state (its rollout log was cut): the rank gets
    a StateError naming it, the saved position and how far the refill got, not a silent empty pass."""
    res = run_on(engine, request, "replay", reorder=False, save_after=5, short=8)
    assert res["put_error"][0] == "no error", res["put_error"]
    assert res["error"][0] == "StateError", res
    msg = res["error"][3]
    assert "rank 0" in msg and "before the position" in msg and "fewer trajectories" in msg, msg
    assert res["rest"] == []


# ----------------------------------------------------------------------------------------------- rollback
@pytest.mark.parametrize("engine", ENGINES)
def test_rollback_to_the_last_saved_state_with_the_defaults(engine, request):
    """Issues 23.4 and 23.5: save and commit every 3 steps with the default release, crash after step 8,
    restore the step-6 state: the stream continues exactly there, and report_version accepts the rollback."""
    res = run_on(engine, request, "rollback")
    assert res["error"][0] == "no error", res["error"]
    assert res["taken"][: res["saved_at"]] + res["rest"] == res["ref"]


# ------------------------------------------------------------------------------------------ producers gone
@pytest.mark.parametrize("engine", ENGINES)
def test_a_producer_that_dies_without_close_does_not_stall_consumers(engine, request):
    """Issue 23.9: the consumer gets IncompleteStreamError naming the producer within its producer timeout
    (its threads ended; on Ray its process exited: PRODUCER_TTL_S without a report), not after 1,800 s."""
    res = run_on(engine, request, "producer_dies")
    assert res["error"][0] == "IncompleteStreamError", res["error"]
    assert "stopped without close()" in res["error"][3] and "math" in res["error"][3], res["error"]
    assert res["after_s"] < (40 if engine == "ray" else 10), res


# --- replica ---
@pytest.mark.parametrize("engine,num_workers", [("embedded", 0), pytest.param("ray", 0, marks=[pytest.mark.ray,
                                                                                                 pytest.mark.slow]),
                                                pytest.param("ray", 2, marks=[pytest.mark.ray, pytest.mark.slow])])
def test_replicas_see_identical_streams_exactly_once(engine, num_workers, request):
    """Issue 25.2: dp=2 x 2 replicas. The replicas of each rank get byte-identical streams, equal to the rank's
    stream without replicas (exactly once per rank); a replica that crashed after saving resumes on its own with
    exactly the micro-batches after its state while the other goes on, its payloads still held until it did.
    On Ray also through StatefulDataLoader worker processes."""
    res = run_on(engine, request, "replicas", num_workers=num_workers)
    assert all(e[0] == "no error" for e in res["errors"].values()), res["errors"]
    ref, streams, stop = res["ref"], res["streams"], 2
    ids = [i for rows in ref for ids, _pos, _digest in rows for i in ids]
    assert len(ids) == len(set(ids)) == res["puts"]  # each rank's stream: every trajectory once over the ranks
    for r in range(2):
        assert streams[f"{r}/0"] == ref[r], f"rank {r} replica 0"
    assert streams["1/1"] == ref[1]
    assert streams["0/1"] == ref[0][:stop] and res["state_next"] == stop
    assert res["rest"] == ref[0][stop:]  # the resumed replica: exactly the rest, byte for byte
    # while replica 1 of rank 0 stood at its state, rank 0 held everything after it; rank 1 released all
    assert res["held"]["committed"] == [stop, len(ref[1])], res["held"]
    assert res["held"]["held_microbatches"] == [len(ref[0]) - stop, 0], res["held"]
    assert res["held"]["held_trajectories"] == sum(len(i) for i, _p, _d in ref[0][stop:]), res["held"]
    assert res["after"]["held_trajectories"] == 0 and res["after"]["released"] == res["puts"], res["after"]
    assert res["bad_num_replicas"][0] == "ConfigError" and "num_replicas=3" in res["bad_num_replicas"][3]


# --- stale ---
@pytest.mark.parametrize("engine", ENGINES_RAY_SLOW)
def test_staleness_bound_keeps_quotas(engine, request):
    """Issue 26.3 on every engine: random arrival orders and versions, max_staleness=1 with drop and wait: nothing
    trained is staler than the bound (trainer version - gen_version), every train batch holds its exact quotas, and
    with regeneration of what was dropped every train batch completes; drops are counted per source."""
    eta = 1
    res = run_on(engine, request, "staleness_bound", eta=eta)
    for run, r in res.items():
        by_batch: dict[int, dict[str, int]] = {}
        for b, source, version, gv in r["trained"]:
            assert 0 <= version - gv <= eta, (run, b, source, version, gv)
            by_batch.setdefault(b, {"math": 0, "code": 0})[source] += 1
        assert by_batch == {b: {"math": 4, "code": 4} for b in range(3)}, (run, by_batch)
        dropped = sum(r["bound"]["dropped_groups"].values())
        assert dropped == len(r["dropped"]), run
        assert r["token_staleness"]["count"] == 24 and r["token_staleness"]["worst"] <= eta, run
    assert sum(len(r["dropped"]) for run, r in res.items() if run.startswith("drop/")) > 0
    assert all(r["bound"]["on_stale"] == run.split("/")[0] for run, r in res.items())


# --- reshape ---
def _check_reshape(res: dict[str, Any]) -> None:
    """Every case: the phases' trajectory ids together are every id put, each once (0 lost, 0 duplicated)."""
    want = sorted(res["all"])
    assert res["cases"]
    for case, phases in res["cases"].items():
        got = [i for ids in phases for i in ids]
        dup = sorted({i for i in got if got.count(i) > 1})
        assert not dup, f"{case}: delivered twice: {dup[:10]}"
        lost = sorted(set(want) - set(got))
        assert not lost, f"{case}: never delivered: {lost[:10]}"
        assert sorted(got) == want, case


#: [N, W, N', W', save point(, N'')]: ranks take (point + 3 r) % 7 micro-batches before their states are saved.
RESHAPE_CASES = [[2, 0, 3, 0, 2], [4, 0, 1, 0, 1], [1, 0, 2, 0, 3, 2], [3, 0, 2, 0, 4, 3]]
#: Ray in make test: one reshape, two DataLoader workers on the resumed side (every (N, N') runs in make test-slow:
#: test_reshape_full_matrix)
RESHAPE_CASES_RAY = [[1, 0, 2, 2, 3]]


@pytest.mark.parametrize("engine", ENGINES)
def test_reshape_resumes_onto_another_number_of_ranks(engine, request):
    """Issue 25.1: states of N ranks (W workers) resume on N' ranks (W' workers) in a fresh pipeline refilled
    with the same puts, and again after that: 0 lost, 0 duplicated (by trajectory id)."""
    cases = RESHAPE_CASES if engine == "embedded" else RESHAPE_CASES_RAY
    _check_reshape(run_on(engine, request, "reshape", cases=cases))


@pytest.mark.parametrize("engine", ENGINES_RAY_SLOW)
def test_reshape_a_live_pipeline(engine, request):
    """Issue 25.1, case 2: the live pipeline is reshaped (pipe.reshape) and new ranks continue in it."""
    cases = [[2, 0, 3, 0, 2], [3, 0, 1, 0, 4]] if engine == "embedded" else [[2, 0, 3, 0, 2]]
    _check_reshape(run_on(engine, request, "reshape", cases=cases, mode="live"))


def _matrix(ws: tuple[int, ...], points: tuple[int, ...]) -> list[list[int]]:
    sizes = (1, 2, 3, 4, 8)
    return [[n, w, n2, w2, p] for n in sizes for n2 in sizes for w in ws for w2 in ws for p in points]


def _ray_matrix() -> list[list[int]]:
    """Every (N, N') once, each with one of the four (W, W') in {0, 2}^2 in turn and a save point in turn, so that
    every worker combination meets every N and every N' (25 cases, ~10 minutes: each starts worker processes)."""
    combos, points = [(0, 0), (0, 2), (2, 0), (2, 2)], (1, 4, 2)
    cases = [[n, n2] for n in (1, 2, 3, 4, 8) for n2 in (1, 2, 3, 4, 8)]
    return [[n, combos[k % 4][0], n2, combos[k % 4][1], points[k % 3]] for k, (n, n2) in enumerate(cases)]


@pytest.mark.slow
@pytest.mark.timeout(3700)
@pytest.mark.parametrize("engine", ENGINES)
def test_reshape_full_matrix(engine, request):
    """Issue 25.1 acceptance: every (N, N') in {1, 2, 3, 4, 8}^2; on the embedded engine at five save points (it
    has no worker processes); on Ray each pair once, with W, W' in {0, 2} in turn (the whole 200-case product,
    ``_matrix((0, 2), (1, 4))``, takes about an hour: run it by hand with KNITDATA_RESHAPE_FULL=1)."""
    if engine == "embedded":
        cases = _matrix((0,), (0, 1, 2, 4, 6))
    else:
        cases = _matrix((0, 2), (1, 4)) if os.environ.get("KNITDATA_RESHAPE_FULL") else _ray_matrix()
    _check_reshape(run_on(engine, request, "reshape", timeout_s=3600.0, cases=cases))


# ------------------------------------------------------------------------------------- media counts (issue 43)
MEDIA_STEPS_EMPTY = ("consumed", "reshape_done", "restored_consumed")


@pytest.mark.parametrize("engine", ENGINES_RAY_SLOW)  # Ray's run (units with their media table) in make test-slow
def test_media_reference_counts_exact_after_every_scenario(engine, request, tmp_path):
    from _media_checks import MEDIA_PER_TRAJ, check_media_exact, held_totals

    res = run_on(engine, request, "media_counts", ckpt_dir=str(tmp_path)) if engine != "embedded" else \
        cf.run("media_counts", engine=engine, ckpt_dir=str(tmp_path))
    reps = res["reports"]
    for step, rep in reps.items():
        check_media_exact(rep, empty=step in MEDIA_STEPS_EMPTY, where=step)
    put = held_totals(reps["put"])
    assert put["pairs"] == 32 * MEDIA_PER_TRAJ and put["num_items"] == 32
    # one copy per digest per unit: 8 group images + 32 clips + the shared screenshot on each of the 2 units
    assert put["media_items"] == 8 + 32 + 2, put
    assert sum(r["media_copied_in"] for r in reps["put"].values()) == 1  # the screenshot, once, to the other unit
    seen = res["seen"]
    assert seen["bad_ref"][:3] == ["MediaRefError", "t900", "media.0"] and "0" * 32 in seen["bad_ref"][3]
    assert seen["rejected_media"] == 1
    assert held_totals(reps["bad_ref"]) == put  # the refused put left nothing behind
    assert held_totals(reps["withdrawn"]) == put  # the withdrawn group's media went with it
    assert held_totals(reps["partial"])["media_refs"] == put["media_refs"] + 3 * MEDIA_PER_TRAJ
    assert seen["consumed"] == seen["reshape_taken"] == seen["restored_consumed"] == 32
    assert held_totals(reps["restored"]) == held_totals(reps["before_checkpoint"])  # bytes and counts kept
