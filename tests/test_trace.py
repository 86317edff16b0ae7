"""Tests of knitdata.trace: a trace of an embedded run and of a 2-node Ray run, checked against Chrome's
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

from knitdata import trace as tracing

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


def test_cli_without_parts_fails_naming_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from knitdata.cli import main

    assert main(["trace", str(tmp_path / "missing.json")]) == 1
    err = capsys.readouterr().err
    assert "no trace parts" in err and "missing.json" in err
