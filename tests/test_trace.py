"""Tests of knitdata.observe.trace: a trace of an embedded run and of a 2-node Ray run, checked against Chrome's
trace-event format (the JSON Perfetto opens), merged on one clock, and drawn as the timeline figure."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.errors import CodecError
from knitdata.observe import trace as tracing

ROOT = Path(__file__).resolve().parent.parent

PHASES_WITH_TS = {"X", "i", "I", "C", "B", "E"}
METADATA_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index", "process_labels"}


def check_trace(data: Any) -> list[str]:
    """Problems of ``data`` as a Chrome trace-event JSON object (the "traceEvents" format); ``[]``: valid.

    Required per the format: every event has ``ph`` (str), ``name`` (str), ``pid`` and ``tid`` (int); timed phases
    a numeric ``ts`` (microseconds); ``X`` a numeric ``dur >= 0``; ``i`` a scope ``s`` of g/p/t if given; ``C``
    numeric ``args``; ``M`` a known metadata name with ``args.name`` a string for the *_name ones; ``cat`` a str and
    ``args`` an object when present. Complete (``X``) events of one thread appear in ``ts`` order and nest.
    """
    errs: list[str] = []
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        return ["top level is not an object with a traceEvents list"]
    last_ts: dict[tuple[int, int], float] = {}
    open_spans: dict[tuple[int, int], list[float]] = {}
    for k, e in enumerate(data["traceEvents"]):
        where = f"event {k} ({e.get('name') if isinstance(e, dict) else e!r})"
        if not isinstance(e, dict):
            errs.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if not isinstance(ph, str) or ph not in PHASES_WITH_TS | {"M"}:
            errs.append(f"{where}: bad ph {ph!r}")
            continue
        if not isinstance(e.get("name"), str):
            errs.append(f"{where}: name is not a string")
        for key in ("pid", "tid"):
            if not isinstance(e.get(key), int) or isinstance(e.get(key), bool):
                errs.append(f"{where}: {key} is not an int")
        if "cat" in e and not isinstance(e["cat"], str):
            errs.append(f"{where}: cat is not a string")
        if "args" in e and not isinstance(e["args"], dict):
            errs.append(f"{where}: args is not an object")
        if ph == "M":
            if e.get("name") not in METADATA_NAMES:
                errs.append(f"{where}: unknown metadata name")
            elif e["name"].endswith("_name") and not isinstance((e.get("args") or {}).get("name"), str):
                errs.append(f"{where}: metadata without args.name")
            continue
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
            errs.append(f"{where}: ts {ts!r} is not a non-negative number")
            continue
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                errs.append(f"{where}: dur {dur!r} is not a non-negative number")
                continue
            key = (e["pid"], e["tid"])
            if ts < last_ts.get(key, 0.0):
                errs.append(f"{where}: X events of thread {key} not in ts order")
            last_ts[key] = ts
            stack = open_spans.setdefault(key, [])
            while stack and stack[-1] <= ts + 0.01:  # ts and dur are floats of microseconds: 10 ns of rounding
                stack.pop()
            if stack and ts + dur > stack[-1] + 0.01:
                errs.append(f"{where}: overlaps an enclosing X event of thread {key} without nesting")
            stack.append(ts + dur)
        if ph == "i" and e.get("s", "t") not in ("g", "p", "t"):
            errs.append(f"{where}: bad instant scope {e.get('s')!r}")
        if ph == "C" and not all(isinstance(v, (int, float)) for v in (e.get("args") or {}).values()):
            errs.append(f"{where}: counter args not numeric")
    return errs


def by_name(events: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [e for e in events if e.get("name") == name and e.get("ph") != "M"]


def check_one_clock(events: Sequence[Mapping[str, Any]], run_s: float) -> None:
    """Every process's events lie within the run's span, and causality holds across processes: no hand-out of a
    mini-batch (a trainer's process) precedes its admission (the coordinator's)."""
    timed = [e for e in events if e["ph"] != "M"]
    assert min(e["ts"] for e in timed) == 0
    span = max(e["ts"] + e.get("dur", 0) for e in timed)
    assert span <= run_s * 1e6, (span, run_s)
    admitted = {}
    for e in by_name(events, "admit"):
        admitted.setdefault(e["args"]["step"], e["ts"])
    handouts = by_name(events, "handout")
    assert handouts
    for e in handouts:
        assert e["ts"] + 2000 >= admitted[e["args"]["step"]], (e, admitted[e["args"]["step"]])  # 2 ms: rtt bound


def _trajs(n: int, sources: Sequence[str] = ("math", "code")) -> list[Any]:
    from knitdata import Trajectory

    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        out.append(Trajectory(id=f"t{i}", source=sources[(i // 2) % len(sources)], group=f"g{i // 2}",
                              gen_version=0, prompt_ids=torch.randint(0, 100, (6,), generator=g),
                              response_ids=torch.randint(0, 100, (10,), generator=g), scalars={"reward": float(i)}))
    return out


def _embedded_run(path: Path, spill_dir: Path | None = None) -> tuple[float, int]:
    """2 consumer threads, a producer thread; the trace merged by shutdown(). Returns (seconds, micro-batches)."""
    from knitdata import BatchSpec, Pipeline

    spec = BatchSpec({"math": 4, "code": 4}, num_minibatches=2, group_size=2)
    t0 = time.monotonic()
    pipe = Pipeline(spec, num_consumers=2, trace=str(path), spill_dir=spill_dir,
                    capacity_bytes=256 if spill_dir else 1 << 30)
    counts = [0, 0]

    def consume(rank: int) -> None:
        for mb in pipe.dataset(rank, fetch="iter"):
            counts[rank] += 1
            time.sleep(0.002)  # compute
            if rank == 0 and mb.info.is_last:
                pipe.report_version(pipe.version + 1)

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for tr in _trajs(32):
        pipe.put(tr)
    pipe.close()
    for t in threads:
        t.join(timeout=60)
    pipe.shutdown()
    return time.monotonic() - t0, sum(counts)


@pytest.fixture
def no_tracer():
    tracing.stop()
    yield
    tracing.stop()


def test_embedded_run_trace_is_valid_and_plots(tmp_path: Path, no_tracer: None) -> None:
    path = tmp_path / "run.json"
    seconds, n = _embedded_run(path, spill_dir=tmp_path / "spill")
    assert n > 0
    assert len(tracing.parts(path)) == 1
    data = json.loads(path.read_text())
    assert check_trace(data) == []
    events = data["traceEvents"]
    names = {e["name"] for e in events}
    for want in ("put", "admit", "plan", "fetch", "wait", "handout", "compute", "commit", "release", "spill",
                 "version", "process_name", "thread_name"):
        assert want in names, want
    admit = by_name(events, "admit")
    assert len(admit) == 8  # 32 trajectories, mini-batches of 4
    assert all(a["args"]["held_by"] in ("math", "code") and sum(a["args"]["by_source"].values()) == 4
               for a in admit)
    assert {e["args"]["rank"] for e in by_name(events, "wait")} == {0, 1}
    assert len(by_name(events, "handout")) == n
    check_one_clock(events, seconds)
    # the staleness split of the hand-outs as a counter (issue 45): versions generating and queued, seconds queued
    split = by_name(events, "staleness")
    assert split and all(e["ph"] == "C" and set(e["args"]) == {"generating", "queued", "queued_s"} for e in split)
    assert all(e["args"]["generating"] >= 0 and e["args"]["queued_s"] >= 0 for e in split)
    # the command users run: merge again (idempotent on the same parts) and draw the figure
    out = tmp_path / "fig.png"
    r = subprocess.run([sys.executable, "-m", "knitdata", "trace", str(path), "--plot", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1 processes" in r.stdout
    tl = tracing.timeline(tracing.load(path))
    assert sorted(tl["ranks"]) == [0, 1] and len(tl["admissions"]) == 8 and len(tl["arrivals"]) == 32


def test_off_records_nothing(tmp_path: Path, no_tracer: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.ENV, raising=False)
    from knitdata import BatchSpec, Pipeline

    pipe = Pipeline(BatchSpec({"math": 2}, num_minibatches=1, group_size=2))
    for t in _trajs(2, ("math",)):
        pipe.put(t)
    pipe.close()
    assert len(list(pipe.dataset(0))) == 1
    assert tracing.tracer is None and pipe.trace_path is None and pipe.write_trace() is None


def test_env_turns_it_on(tmp_path: Path, no_tracer: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tracing.ENV, str(tmp_path / "env.json"))
    from knitdata import BatchSpec, Pipeline

    pipe = Pipeline(BatchSpec({"math": 2}, num_minibatches=1, group_size=2))
    for t in _trajs(2, ("math",)):
        pipe.put(t)
    pipe.close()
    assert len(list(pipe.dataset(0))) == 1
    summary = pipe.write_trace()
    assert summary is not None and summary["processes"] == 1
    assert check_trace(json.loads((tmp_path / "env.json").read_text())) == []


def test_merge_errors_and_torn_part(tmp_path: Path) -> None:
    from knitdata.errors import ConfigError

    with pytest.raises(ConfigError, match="no trace parts"):
        tracing.merge(tmp_path / "none.json")
    # a process killed while writing: the complete lines count, the torn one is dropped
    part = tracing.part_path(tmp_path / "t.json", "unit-n0", 123)
    Path(part).write_text('[\n{"ph": "X", "name": "store", "pid": 123, "tid": 1, "ts": 5.0, "dur": 1.0},\n'
                          '{"ph": "M", "name": "knitdata_clock", "pid": 123, "tid": 0, "ts": 0, '
                          '"args": {"offset_us": 10.0}},\n{"ph": "X", "name": "sto')
    summary = tracing.merge(tmp_path / "t.json")
    assert summary["events"] == 1 and summary["processes"] == 1
    data = json.loads((tmp_path / "t.json").read_text())
    assert check_trace(data) == []


@settings(max_examples=25, deadline=None)
@given(offsets=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=4))
def test_merge_applies_each_process_offset(tmp_path_factory: pytest.TempPathFactory, offsets: list[float]) -> None:
    """One event per process at local time 1000 us: merged, each lies at 1000 + its offset (shifted to start at 0)."""
    d = tmp_path_factory.mktemp("m")
    for pid, off in enumerate(offsets, start=1):
        Path(tracing.part_path(d / "t.json", "p", pid)).write_text(
            f'[\n{{"ph": "M", "name": "knitdata_clock", "pid": {pid}, "tid": 0, "ts": 0, "args": {{"offset_us": {off}}}}},\n'
            f'{{"ph": "i", "name": "e", "pid": {pid}, "tid": 1, "ts": 1000.0, "s": "t"}},\n')
    tracing.merge(d / "t.json")
    evs = {e["pid"]: e["ts"] for e in tracing.load(d / "t.json")}
    base = min(offsets)
    for pid, off in enumerate(offsets, start=1):
        assert evs[pid] == pytest.approx(off - base, abs=1e-2)


def test_check_trace_rejects_bad_events() -> None:
    ok = {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0.0, "dur": 5.0}
    assert check_trace({"traceEvents": [ok]}) == []
    assert check_trace([ok])
    assert check_trace({"traceEvents": [{**ok, "dur": -1}]})
    assert check_trace({"traceEvents": [{**ok, "pid": "1"}]})
    assert check_trace({"traceEvents": [ok, {**ok, "ts": 3.0, "dur": 5.0}]})  # overlaps without nesting
    assert check_trace({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {}}]})


def test_one_tracer_per_process(tmp_path: Path, no_tracer: None) -> None:
    from knitdata.errors import ConfigError

    t = tracing.start(tmp_path / "a.json", "main")
    assert tracing.start(tmp_path / "a.json", "other") is t
    with pytest.raises(ConfigError, match="already traces"):
        tracing.start(tmp_path / "b.json", "main")


@pytest.mark.slow
def test_ray_two_node_trace(tmp_path: Path) -> None:
    from tests._ray_helpers import ClusterProcess, run_scenario

    path = tmp_path / "ray.json"
    with ClusterProcess(nodes=2) as cluster:
        res = run_scenario(cluster.address, "traced_run", timeout_s=240, trace=str(path))
    # the command users run after the job: merge every process's part and draw the figure
    out = tmp_path / "ray.png"
    r = subprocess.run([sys.executable, "-m", "knitdata", "trace", str(path), "--plot", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(path.read_text())
    assert check_trace(data) == []
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    roles = sorted(n.split()[1] for n in names.values())
    # the driver, the coordinator, a unit per node, and each rank's process (attached by name)
    assert roles == ["coordinator", "driver", "process", "process", "unit-n0", "unit-n1"], roles
    pids_with_events = {e["pid"] for e in events if e["ph"] != "M"}
    assert pids_with_events == set(names), "every process recorded events"
    assert {e["args"]["rank"] for e in by_name(events, "wait")} == {0, 1}
    assert len(by_name(events, "handout")) == res["microbatches"]
    assert by_name(events, "store") and by_name(events, "put") and by_name(events, "fetch")
    assert all(abs(o) < 1e6 for o in res["offsets_us"])  # one host: offsets are the round trips' error
    check_one_clock(events, res["seconds"])


@pytest.mark.slow
def test_ray_coordinator_restart_is_traced(tmp_path: Path) -> None:
    """A Ray job killed whole and started again (the same journal): the new coordinator records the replay of its
    journal as ``restart`` in its own part, and the trace merged by the job's exit is valid."""
    from tests._ray_helpers import ClusterProcess, run_scenario

    spill = str(tmp_path / "spill")
    path = tmp_path / "restart.json"
    with ClusterProcess(nodes=1) as cluster:
        first = run_scenario(cluster.address, "whole_job_first", timeout_s=240, spill_root=spill, pipeline="tr")
        second = run_scenario(cluster.address, "whole_job_resume", timeout_s=240, spill_root=spill, pipeline="tr",
                              state=first["state"], trace=str(path))
    assert second["replayed"] > 0
    data = json.loads(path.read_text())
    assert check_trace(data) == []
    events = data["traceEvents"]
    coordinator = {e["pid"] for e in events if e["name"] == "process_name" and "coordinator" in e["args"]["name"]}
    restarts = by_name(events, "restart")
    assert len(restarts) == 1 and restarts[0]["pid"] in coordinator
    assert restarts[0]["args"]["replayed"] == second["replayed"]
    assert restarts[0]["args"]["journal"].endswith("tr.journal")


def test_cli_without_parts_fails_naming_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from knitdata.cli import main

    assert main(["trace", str(tmp_path / "missing.json")]) == 1
    err = capsys.readouterr().err
    assert "no trace parts" in err and "missing.json" in err


# ---------------------------------------------------------------------------------------------- restart
def _plane_put(plane: Any, i: int) -> None:
    from knitdata.control import fields_of

    t = _trajs(i + 1)[i]
    meta = {**t.meta().to_dict(), "fields": fields_of(t.scalars, {})}
    plane.admission.admit_many("node0", [[meta, 8, f"token-{t.id}"]])


def test_restart_records_the_journal_replay(tmp_path: Path, no_tracer: None) -> None:
    """A control plane recovered from its journal (what a restarted coordinator does) records a ``restart`` span
    with the records replayed, on the thread that recovered, inside the run's trace."""
    from knitdata import BatchSpec
    from knitdata.control import ControlPlane
    from knitdata.control.journal import Journal
    from knitdata.placement import ConsumerLayout

    spec = BatchSpec({"math": 4, "code": 4}, num_minibatches=2, group_size=2)
    config = {"spec": spec.to_dict(), "layout": ConsumerLayout.uniform(1, 1).to_dict(), "token_budget": 64}
    journal = tmp_path / "run.journal"
    first = ControlPlane(config, {"node0": "node0"}, lambda u, ids, wait: None, journal=Journal(journal, fsync_every_s=0))
    for i in range(12):
        _plane_put(first, i)
    records = len(list(Journal.read(journal)))
    assert records >= 12
    path = tmp_path / "restart.json"
    tracing.start(path, "coordinator")
    again = ControlPlane(config, {"node0": "node0"}, lambda u, ids, wait: None)
    assert again.recover(str(journal)) == records
    tracing.stop()
    tracing.merge(path)
    data = json.loads(path.read_text())
    assert check_trace(data) == []
    restarts = by_name(data["traceEvents"], "restart")
    assert len(restarts) == 1
    r = restarts[0]
    assert r["ph"] == "X" and r["cat"] == "coordinator" and r["dur"] > 0
    assert r["args"] == {"journal": str(journal), "replayed": records, "snapshot": False}
    assert r["tid"] == threading.get_native_id()
    # the admissions the replay redid lie inside the restart span
    admits = by_name(data["traceEvents"], "admit")
    assert len(admits) == 3  # 12 trajectories, mini-batches of 4
    assert all(r["ts"] <= a["ts"] <= r["ts"] + r["dur"] for a in admits)


# ---------------------------------------------------------------------------------------------- merge at exit
EXIT_SCRIPT = """
import sys, threading

import torch
from knitdata import BatchSpec, Pipeline, Trajectory

spec = BatchSpec({"math": 4}, num_minibatches=2, group_size=2)
with Pipeline(spec, num_consumers=1, trace=sys.argv[1]) as pipe:
    for i in range(16):
        pipe.put(Trajectory(id=f"t{i}", source="math", group=f"g{i // 2}", gen_version=0,
                            prompt_ids=torch.arange(4), response_ids=torch.arange(8)))
    first = iter(pipe.dataset(0))
    next(first)
print("after the block", flush=True)
n = 1 + sum(1 for _ in first)  # consumed after the block: merged at the process's exit
print("micro-batches", n)
"""


def test_with_block_merges_and_the_exit_merges_again(tmp_path: Path) -> None:
    """An embedded ``with Pipeline(..., trace=path)`` block leaves the merged trace at ``path`` when it ends, and
    the process merges again at its exit (hand-outs after the block included), without write_trace()."""
    script = tmp_path / "run.py"
    script.write_text(EXIT_SCRIPT)
    path = tmp_path / "exit.json"
    r = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    n = int(r.stdout.split("micro-batches")[1])
    data = json.loads(path.read_text())
    assert check_trace(data) == []
    events = data["traceEvents"]
    assert len(by_name(events, "handout")) == n > 1
    assert sum(e["args"]["trajectories"] for e in by_name(events, "put")) == 16
    assert not list(tmp_path.glob("*.tmp"))


def test_with_block_merge_at_its_end(tmp_path: Path, no_tracer: None) -> None:
    from knitdata import BatchSpec, Pipeline

    path = tmp_path / "block.json"
    with Pipeline(BatchSpec({"math": 2}, num_minibatches=1, group_size=2), trace=str(path)) as pipe:
        for t in _trajs(2, ("math",)):
            pipe.put(t)
        assert not path.exists()
    assert check_trace(json.loads(path.read_text())) == []
    assert len(by_name(tracing.load(path), "admit")) == 1


# ---------------------------------------------------------------------------------------------- part format
def test_part_torn_in_its_last_flush_keeps_the_complete_records(tmp_path: Path, no_tracer: None) -> None:
    from knitdata.errors import CodecError

    path = tmp_path / "torn.json"
    t = tracing.start(path, "unit-n0")
    for k in range(3):
        for i in range(4):
            t.span("store", "storage", 1000.0 * k + 10 * i, 1000.0 * k + 10 * i + 5, {"k": k, "i": i})
        t.flush()
    tracing.stop()
    text = Path(t.file).read_text()
    assert len(text.splitlines()) == 5  # the header, the process's metadata, one line per flush
    cut = text.rstrip("\n")
    Path(t.file).write_text(cut[: cut.rindex('{"k":2,"i":2}') + 5])  # killed inside the last flush's third record
    got = [e for e in tracing.read_part(t.file) if e["name"] == "store"]
    assert [(e["args"]["k"], e["args"]["i"]) for e in got] == [(k, i) for k in range(3) for i in range(4)][:10]
    assert tracing.merge(path)["events"] == 10
    assert check_trace(json.loads(path.read_text())) == []
    # damage before the last line is not a torn write: an error naming the part and the line
    lines = text.splitlines()
    lines[2] = lines[2][:-3]
    Path(t.file).write_text("\n".join(lines) + "\n")
    with pytest.raises(CodecError, match=r"torn\.json\.unit-n0\.[\w-]+-\d+\.json.* line 3"):
        tracing.merge(path)


def _thread_spans(draw: Any) -> list[tuple[str, float, float, int]]:
    """One thread's spans in recording order: puts (some with a plan inside, recorded first) and other spans,
    one after another with random gaps."""
    out: list[tuple[str, float, float, int]] = []
    t = 0.0
    for _ in range(draw(st.integers(0, 30))):
        t += draw(st.sampled_from([0.0, 5.0, 200.0, 900.0, 1500.0, 20_000.0]))
        dur = draw(st.sampled_from([0.0, 3.0, 40.0, 3000.0]))
        kind = draw(st.sampled_from(["put", "put", "put", "put+plan", "fetch"]))
        if kind == "put+plan":
            out.append(("plan", t + dur / 4, t + dur / 2, 0))
            kind = "put"
        out.append((kind, t, t + dur, draw(st.integers(1, 3))))
        t += dur
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_bursts_of_puts_join_and_still_nest(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """Puts of a thread that follow each other closely become one event (``calls``, summed ``by_source``); no
    trajectory is lost, a burst stays within BURST_MAX_US, and every thread's spans still nest (schema check)."""
    spans = [_thread_spans(data.draw) for _ in range(2)]
    path = tmp_path_factory.mktemp("b") / "b.json"
    tracing.stop()
    t = tracing.start(path, "producer")
    try:
        def record(rows: list[tuple[str, float, float, int]]) -> None:
            for name, a, b, n in rows:
                if name == "put":
                    t.burst("put", "producer", a, b, {"math": n})
                else:
                    t.span(name, "x", a, b, None)

        threads = [threading.Thread(target=record, args=(rows,)) for rows in spans]
        for th in threads:
            th.start()
            th.join()  # one after the other: each thread's records stay in its order either way
    finally:
        tracing.stop()
    if not any(spans):
        return
    tracing.merge(path)
    events = tracing.load(path)
    assert check_trace({"traceEvents": events}) == []
    puts = by_name(events, "put")
    want = [sum(n for name, _a, _b, n in rows if name == "put") for rows in spans]
    assert sum(e["args"]["trajectories"] for e in puts) == sum(e["args"]["by_source"]["math"] for e in puts) == sum(want)
    assert sum(e["args"]["calls"] for e in puts) == sum(name == "put" for rows in spans for name, *_ in rows)
    assert all(e["dur"] <= tracing.BURST_MAX_US + 1e-3 and e["args"]["busy_us"] <= e["dur"] + 1e-3 for e in puts)
    others = [e for e in events if e["ph"] == "X" and e["name"] != "put"]
    assert len(others) == sum(name != "put" for rows in spans for name, *_ in rows)


def test_bursts_from_threads_while_flushing_lose_nothing(tmp_path: Path, no_tracer: None) -> None:
    """Producer threads put while the writer flushes (and takes their open bursts) over and over: every put is in
    exactly one written event."""
    path = tmp_path / "c.json"
    t = tracing.start(path, "producer", flush_s=0.001)
    stop = threading.Event()

    def produce(k: int) -> None:
        for i in range(500):
            a = tracing.now_us()
            t.burst("put", "producer", a, a + 1.0, "math" if i % 2 else {"code": 2})

    def flusher() -> None:
        while not stop.is_set():
            t.flush()

    f = threading.Thread(target=flusher)
    f.start()
    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    f.join()
    tracing.stop()
    tracing.merge(path)
    puts = by_name(tracing.load(path), "put")
    assert sum(e["args"]["calls"] for e in puts) == 2000
    assert sum(e["args"]["by_source"].get("math", 0) for e in puts) == 1000
    assert sum(e["args"]["by_source"].get("code", 0) for e in puts) == 2000
    assert sum(e["args"]["trajectories"] for e in puts) == 3000
    assert t.recorded == 2000  # each put counts once


def test_merge_derives_handouts_from_waits_when_a_part_has_none(tmp_path: Path, no_tracer: None) -> None:
    """A hand-out is the end of the trainer's wait: a part that records waits only gets them at merge (one per
    wait, its args), and a part that records them gets no second one."""
    path = tmp_path / "h.json"
    t = tracing.start(path, "trainer")
    for j in range(3):
        t.span("wait", "trainer", 100.0 * j, 100.0 * j + 40, {"rank": 1, "step": 0, "microbatch": j, "j": j})
    tracing.stop()
    tracing.merge(path)
    events = tracing.load(path)
    assert check_trace({"traceEvents": events}) == []
    waits, handouts = by_name(events, "wait"), by_name(events, "handout")
    assert [(h["ts"], h["args"]) for h in handouts] == [(w["ts"] + w["dur"], w["args"]) for w in waits]
    t = tracing.start(path, "rank1")  # another part of the same trace, recording its hand-outs itself
    t.span("wait", "trainer", 0.0, 10.0, {"rank": 0, "j": 0})
    t.instant("handout", "trainer", {"rank": 0, "j": 0}, ts_us=10.0)
    tracing.stop()
    tracing.merge(path)
    assert len(by_name(tracing.load(path), "handout")) == 3 + 1


class _Spans(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Each worker records one ``item`` span per item it yields (in the worker process)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        wid = 0 if info is None else info.id
        for i in range(3):
            tr = tracing.tracer
            assert tr is not None, "the forked worker does not trace"
            t0 = tracing.now_us()
            tr.span("item", "worker", t0, t0 + 1.0, {"worker": wid, "i": i})
            yield torch.tensor([wid, i])


def test_forked_dataloader_workers_trace_into_parts_of_their_own(tmp_path: Path, no_tracer: None) -> None:
    """DataLoader workers started by fork while the parent traces: each writes its own part (role ``<role>-fork``,
    the parent's clock offset), flushed at the worker's exit; what the parent had recorded and not yet written
    before the fork is written once, by the parent."""
    path = tmp_path / "fork.json"
    t = tracing.start(path, "main", flush_s=3600)  # nothing written before stop(): the fork copies the events
    t0 = tracing.now_us()
    t.span("before", "main", t0, t0 + 1.0, None)
    # a child that runs exec right after the fork (subprocess with preexec_fn, as Ray starts its processes) gets
    # no part and no thread
    subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: None, check=True, timeout=60)
    dl = torch.utils.data.DataLoader(_Spans(), batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = sorted(tuple(x.tolist()) for x in dl)
    assert got == sorted((w, i) for w in range(2) for i in range(3))
    t.span("after", "main", t0 + 2.0, t0 + 3.0, None)
    tracing.stop()
    files = tracing.parts(path)
    assert sorted(Path(f).name.split(".")[-3] for f in files) == ["main", "main-fork", "main-fork"], files
    tracing.merge(path)
    events = tracing.load(path)
    assert check_trace({"traceEvents": events}) == []
    assert len(by_name(events, "before")) == len(by_name(events, "after")) == 1
    items = by_name(events, "item")
    assert sorted((e["args"]["worker"], e["args"]["i"]) for e in items) == sorted((w, i) for w in range(2) for i in range(3))
    pids = {e["pid"] for e in items}
    assert len(pids) == 2 and t.pid not in pids
    for f in files:
        if ".main-fork." in f:  # the parent's clock offset, and where it came from
            clock = [e for e in tracing.read_part(f) if e.get("name") == "knitdata_clock"][-1]
            assert clock["args"] == {"offset_us": t.offset_us, "role": "main-fork", "forked_from": t.pid}


def test_parts_written_on_other_hosts_are_copied_next_to_the_trace(tmp_path: Path, no_tracer: None) -> None:
    """What the Ray engine does at ``flush_trace``/``shutdown``: each node's unit sends the parts its host holds and
    the merging host lacks (or holds shorter); they are written next to the trace, once, and merge with the rest."""
    here, there = tmp_path / "a" / "run.json", tmp_path / "b" / "run.json"  # one path, two hosts' filesystems
    for path, role in ((here, "driver"), (there, "unit-n1"), (there, "process")):
        t = tracing.Tracer(path, role, flush_s=3600)
        t0 = tracing.now_us()
        t.span(f"work-{role}", "x", t0, t0 + 5.0, {"role": role})
        t.close()
    known = tracing.part_sizes(here)
    assert list(known) == [Path(tracing.part_path(here, "driver")).name]
    found = tracing.parts_missing_from(there, known)
    assert sorted(found) == sorted(Path(tracing.part_path(there, r)).name for r in ("unit-n1", "process"))
    written = tracing.write_parts(here, found)
    assert len(written) == 2 and all(Path(w).parent == here.parent for w in written)
    assert tracing.parts_missing_from(there, tracing.part_sizes(here)) == {}  # nothing more to copy
    assert tracing.write_parts(here, found) == []  # as long here already: not written again
    summary = tracing.merge(here)
    assert summary["parts"] == 3
    events = tracing.load(here)
    assert {e["name"] for e in events if e["ph"] == "X"} == {"work-driver", "work-unit-n1", "work-process"}
    with pytest.raises(CodecError, match="not a part file"):
        tracing.write_parts(here, {"../evil.json": b"{}"})
