"""The control plane's journal: format, torn writes, damage, and replay into an identical state."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.admission import BatchSpec
from knitdata.control import JOURNALED_OPS, ControlPlane, fields_of
from knitdata.control.journal import SNAPSHOT_SUFFIX, Journal, read_snapshot, write_snapshot
from knitdata.errors import CodecError, ConfigError, KnitdataError, QuotaInfeasibleError, StateError
from knitdata.placement import ConsumerLayout
from knitdata.record import Trajectory


def _config(n: int = 2) -> dict:
    spec = BatchSpec({"a": 4, "b": 4}, num_minibatches=2, group_size=2)
    return {"spec": spec.to_dict(), "layout": ConsumerLayout.uniform(2, n // 2 or 1).to_dict(), "token_budget": 40}


def _traj(i: int) -> Trajectory:
    import torch

    return Trajectory(id=f"t{i}", source="ab"[(i // 2) % 2], group=f"g{i // 2}", gen_version=0,
                      prompt_ids=torch.arange(4), response_ids=torch.arange(8 + i % 3), scalars={"r": 1.0})


def _put(plane: ControlPlane, t: Trajectory) -> dict:
    """One trajectory's one-round-trip put (stored on a unit, then admitted there)."""
    meta = {**t.meta().to_dict(), "fields": fields_of(t.scalars, {})}
    return plane.admission.admit_many("node" + str(int(t.id[1:]) // 2 % 2), [[meta, 8, f"token-{t.id}"]])


def _drive(plane: ControlPlane, n: int) -> None:
    for i in range(n):
        _put(plane, _traj(i))
    plane.admission.withdraw("gx")
    for rank in range(plane.state.layout.num_consumers):
        got = plane.leasing.next_entries(rank, 0, 0.0)
        for e in got.entries:
            plane.positions.handed(rank, e.j, e.minibatch, e.microbatch)
    plane.positions.commit(0, 1)
    plane.positions.report_version(1)


def _state(p: ControlPlane) -> dict:
    s = p.state
    return {"planned": s.planned, "committed": s.committed, "position": s.position, "seq": s.seq,
            "queues": [sorted(q) for q in s.queues], "entries": [[q[j].items for j in sorted(q)] for q in s.queues],
            "live": sorted(s.live), "pending": sorted(s.pending), "version": s.version, "schema": p.admission.schema,
            "placement": s.placement.state_dict()}


def test_replay_rebuilds_the_same_state_and_the_same_future(tmp_path):
    released: list = []
    path = tmp_path / "run.journal"
    a = ControlPlane(_config(), {"node0": "node0", "node1": "node1"}, lambda u, ids, wait: released.append((u, ids)),
                     journal=Journal(path, fsync_every_s=0))
    _drive(a, 16)
    b = ControlPlane(_config(), {"node0": "node0", "node1": "node1"}, lambda u, ids, wait: None)
    assert b.recover(str(path)) == len(list(Journal.read(path)))
    assert _state(b) == _state(a)
    # both continue identically: the next puts are placed and planned the same way
    for p in (a, b):
        for i in range(16, 24):
            _put(p, _traj(i))
    assert _state(b) == _state(a)


def test_a_retried_put_after_a_restart_is_accepted_once(tmp_path):
    path = tmp_path / "run.journal"
    a = ControlPlane(_config(), {"node0": "node0", "node1": "node1"}, lambda u, ids, wait: None, journal=Journal(path))
    t = _traj(0)
    first = _put(a, t)
    b = ControlPlane(_config(), {"node0": "node0", "node1": "node1"}, lambda u, ids, wait: None)
    b.recover(str(path))
    again = _put(b, t)  # the caller never saw the answer and retries
    assert again.accepted == first.accepted and not again.errors
    assert len(b.state.pending) == 1


def test_torn_last_line_is_dropped_and_damage_elsewhere_is_a_codec_error(tmp_path):
    path = tmp_path / "j"
    j = Journal(path)
    for v in range(3):
        j.append("report_version", [v])
    j.close()
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # a crash inside the last write
    assert [a for _op, a in Journal.read(path)] == [[0], [1]]
    lines = data.split(b"\n")
    lines[1] = lines[1].replace(b"[0]", b"[9]")  # checksum no longer matches, not the last line (0: the header)
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(CodecError, match="line 2"):
        list(Journal.read(path))


def _frame(obj) -> bytes:
    body = json.dumps(obj).encode()
    return body + b"\t" + f"{zlib.crc32(body) & 0xFFFFFFFF:08x}".encode() + b"\n"


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                           max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(obj=json_values, op=st.sampled_from(sorted(JOURNALED_OPS) + ["nope", ""]))
def test_crafted_records_with_valid_checksums_replay_only_knitdata_errors(tmp_path_factory, obj, op):
    """A record that frames and checksums correctly but carries any structure: reading or replaying it raises
    only KnitdataError (never TypeError, KeyError, ...)."""
    path = tmp_path_factory.mktemp("j") / "j"
    path.write_bytes(_frame({"op": op, "args": obj}) + _frame({"op": "report_version", "args": [1]})
                     + _frame(obj))
    plane = ControlPlane(_config(), {"node0": "node0", "node1": "node1"}, lambda u, ids, wait: None)
    try:
        plane.recover(str(path))
    except KnitdataError:
        pass


# ---------------------------------------------------------------------------------------------- compaction
ADMISSIONS = ["constraint_preserving", "train_batch", "fifo", "linear_target"]
UNITS = {"node0": "node0", "node1": "node1"}


def _cfg(admission: str = "constraint_preserving", release: str = "step") -> dict:
    return {**_config(), "admission": admission, "release": release}


def _meta(i: int, group: int | None = None, fields: dict | None = None) -> dict:
    g = i // 2 if group is None else group
    return {"id": f"t{i}", "source": "ab"[g % 2], "group": f"g{g}", "gen_version": i % 3, "num_tokens": 12 + i % 5,
            "nbytes": 100 + 7 * (i % 11), "fields": fields or {"scalars": ["r"], "tensors": {}}}


class _Driver:
    """Applies one abstract step to a plane: the same steps give the same calls on any plane in the same state."""

    def __init__(self) -> None:
        self.next_id = 0
        self.last_admit: tuple | None = None

    def step(self, plane: ControlPlane, kind: str, x: int) -> object:
        try:
            return self._step(plane, kind, x)
        except KnitdataError as e:
            return ("error", type(e).__name__, str(e))

    def _step(self, plane: ControlPlane, kind: str, x: int) -> object:
        if kind == "put":  # one trajectory's one-round-trip put
            i = self.next_id
            self.next_id += 1
            return plane.admission.admit_many(sorted(UNITS)[x % 2], [[_meta(i), 4 + x % 5, f"token-{i}"]])
        if kind == "admit":  # the one-round-trip put: stored on a unit first, then admitted in one call
            ids = list(range(self.next_id, self.next_id + 1 + x % 3))
            self.next_id += len(ids)
            self.last_admit = (sorted(UNITS)[x % 2], [[_meta(i), 4 + i % 3, f"token-{i}"] for i in ids])
            return plane.admission.admit_many(*self.last_admit)
        if kind == "admit_batches":  # concurrent puts a unit sends together, each batch on its own
            batches = []
            for _ in range(2):
                ids = list(range(self.next_id, self.next_id + 1 + x % 2))
                self.next_id += len(ids)
                batches.append([[_meta(i), 3, f"token-{i}"] for i in ids])
            return plane.admission.admit_batches(sorted(UNITS)[x % 2], batches)
        if kind == "admit_retry":  # the same call again (the answer was lost): recognized by its put tokens
            return None if self.last_admit is None else plane.admission.admit_many(*self.last_admit)
        if kind == "bad_put":  # other fields than the schema: refused
            i = self.next_id
            self.next_id += 1
            return plane.admission.admit_many(sorted(UNITS)[x % 2], [[_meta(i, fields={"scalars": ["q"], "tensors": {}}), 3,
                                                            f"token-{i}"]])
        if kind == "report":  # a consumer process's report: hand-outs, a commit and a version, journaled one by one
            rank = x % plane.state.layout.num_consumers
            got = plane.leasing.next_entries(rank, plane.positions.start_point(rank).next, 0.0)
            recs = [[e.j, e.minibatch, e.microbatch, e.j] for e in got.entries[:2]]
            return plane.leasing.report([[rank, 0, f"tok{rank}", recs, False]], [[rank, plane.state.position[rank]]], plane.state.version)
        if kind == "withdraw":
            return plane.admission.withdraw(f"g{x % (self.next_id // 2 + 1)}")
        if kind == "version":
            return plane.positions.report_version(plane.state.version + x % 2)
        if kind == "hand":
            rank = x % plane.state.layout.num_consumers
            got = plane.leasing.next_entries(rank, plane.positions.start_point(rank).next, 0.0)
            for e in got.entries[: 1 + x % 3]:
                plane.positions.handed(rank, e.j, e.minibatch, e.microbatch)
            return got
        if kind == "commit":
            rank = x % plane.state.layout.num_consumers
            return plane.positions.commit(rank, plane.state.position[rank] - x % 2)
        if kind == "seek":
            rank = x % plane.state.layout.num_consumers
            return plane.positions.seek(rank, max(0, plane.state.position[rank] + x % 3 - 1))
        if kind == "in_flight":
            return plane.admission.set_in_flight({"a": x % 8, "b": 8})
        if kind == "close":
            return plane.admission.close()
        raise AssertionError(kind)


STEP_KINDS = (["put"] * 5 + ["admit"] * 3 + ["admit_batches", "admit_retry", "bad_put", "withdraw", "version"]
              + ["hand"] * 3 + ["report", "commit", "seek", "in_flight"])


def _releases(log: list, *, wait: bool = False) -> list[str]:
    return sorted(i for u, ids, w in log if w == wait for i in ids)


@settings(max_examples=40, deadline=None)
@given(admission=st.sampled_from(ADMISSIONS), release=st.sampled_from(["step", "commit", "handout"]),
       steps=st.lists(st.tuples(st.sampled_from(STEP_KINDS + ["compact", "compact_crash", "compact"]),
                                st.integers(0, 100)), min_size=1, max_size=50),
       close=st.booleans(), after=st.lists(st.tuples(st.sampled_from(STEP_KINDS), st.integers(0, 100)),
                                           max_size=10))
def test_recovering_a_compacted_journal_equals_a_full_replay(tmp_path_factory, admission, release, steps, close,
                                                             after):
    """Random plane calls with compactions (and crashes between snapshot and rotation) at random points: the
    plane recovered from snapshot + journal is the plane a full replay of an uncompacted journal gives, and the
    next calls answer the same."""
    d = tmp_path_factory.mktemp("c")
    cfg = _cfg(admission, release)
    ja, jb = Journal(d / "a.journal", compact_every=0), Journal(d / "b.journal", compact_every=0)
    a = ControlPlane(cfg, UNITS, lambda u, ids, w: None, journal=ja)
    b = ControlPlane(cfg, UNITS, lambda u, ids, w: None, journal=jb)
    da, db = _Driver(), _Driver()
    since = 0  # records in a's current segment
    snapshot_at = None  # a's state when the snapshot that recovery uses was taken
    for kind, x in steps + ([("close", 0)] if close else []):
        if kind == "compact":
            a.compact()
            since, snapshot_at = 0, a.state_dict()
            continue
        if kind == "compact_crash":  # steps (1) and (2) of a compaction, then a crash before the rotation
            with a.state.cond:
                write_snapshot(ja.path + SNAPSHOT_SUFFIX, a.state_dict(), run=ja.run, segment=ja.segment,
                               records=ja.records)
            snapshot_at = a.state_dict()
            continue
        n0 = ja.records
        assert da.step(a, kind, x) == db.step(b, kind, x)
        since += ja.records - n0
    ja.close()
    jb.close()
    assert a.state_dict() == b.state_dict()
    # the journal holds only the records after the last completed compaction
    assert len(list(Journal.read(ja.path))) == since
    logs: dict[str, list] = {"a": [], "b": []}
    ra = ControlPlane(cfg, UNITS, lambda u, ids, w: logs["a"].append((u, list(ids), w)))
    rb = ControlPlane(cfg, UNITS, lambda u, ids, w: logs["b"].append((u, list(ids), w)))
    ra.recover(ja.path)
    rb.recover(jb.path)
    assert ra.state_dict() == rb.state_dict() == a.state_dict()
    if snapshot_at is not None:
        assert ra.state.journaling.replayed <= rb.state.journaling.replayed
    # releases sent before the snapshot are sent again (fewer than RECENT_RELEASES here): the same as a full replay
    assert set(_releases(logs["a"])) == set(_releases(logs["b"]))
    # and both continue identically
    for kind, x in after:
        assert da.step(ra, kind, x) == db.step(rb, kind, x)
    assert ra.state_dict() == rb.state_dict()


def test_automatic_compaction_keeps_the_journal_short_and_recovers(tmp_path):
    path = tmp_path / "run.journal"
    j = Journal(path, compact_every=10, fsync_every_s=0)
    a = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None, journal=j)
    drv = _Driver()
    for k in range(95):
        drv.step(a, ["put", "put", "hand", "version"][k % 4], k)
    assert j.segment >= 8 and len(list(Journal.read(path))) == j.records < 10
    assert Journal.read_header(path) == (j.run, j.segment)
    b = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None)
    assert not b.state.journaling.snapshot_loaded
    assert b.recover(str(path)) == j.records == b.state.journaling.replayed
    assert b.state.journaling.snapshot_loaded and b.state_dict() == a.state_dict()
    # a restarted coordinator opens the journal again: it goes on counting from the segment's records
    j.close()
    j2 = Journal(path, compact_every=10)
    assert (j2.run, j2.segment, j2.records) == (j.run, j.segment, j.records)
    j2.close()


def test_a_snapshot_left_by_a_deleted_journal_is_ignored(tmp_path):
    path = tmp_path / "run.journal"
    a = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None, journal=Journal(path, compact_every=0))
    drv = _Driver()
    for k in range(6):
        drv.step(a, "put", k)
    a.compact()
    a.state.journaling.journal.close()
    path.unlink()  # the finished run's journal is removed; its snapshot stays
    b = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None, journal=Journal(path, compact_every=0))
    d2 = _Driver()
    d2.step(b, "put", 1)
    d2.step(b, "put", 2)
    c = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None)
    assert c.recover(str(path)) == 2
    assert not c.state.journaling.snapshot_loaded  # the other run's snapshot is ignored
    assert c.state_dict() == b.state_dict() != a.state_dict()


@pytest.mark.parametrize("damage", ["garble", "truncate", "delete", "other_run", "crafted"])
def test_a_damaged_or_missing_snapshot_the_journal_needs_is_a_clear_codec_error(tmp_path, damage):
    path = tmp_path / "run.journal"
    j = Journal(path, compact_every=0)
    a = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None, journal=j)
    drv = _Driver()
    for k in range(8):
        drv.step(a, "put", k)
    a.compact()
    drv.step(a, "put", 9)
    snap = tmp_path / ("run.journal" + SNAPSHOT_SUFFIX)
    data = snap.read_bytes()
    if damage == "garble":
        snap.write_bytes(data[:50] + bytes([data[50] ^ 0x55]) + data[51:])
    elif damage == "truncate":
        snap.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        snap.unlink()
    elif damage == "other_run":
        write_snapshot(snap, a.state_dict(), run="someone-else", segment=0, records=0)
    else:  # a valid checksum around a state that is not a plane's
        write_snapshot(snap, {**a.state_dict(), "planned": [1]}, run=j.run, segment=0, records=0)
    b = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None)
    with pytest.raises(CodecError, match="snapshot"):
        b.recover(str(path))


def test_a_torn_last_line_is_cut_off_when_the_journal_is_opened_again(tmp_path):
    path = tmp_path / "run.journal"
    j = Journal(path)
    for v in range(3):
        j.append("report_version", [v])
    j.close()
    path.write_bytes(path.read_bytes()[:-5])  # the process died inside its last write
    j2 = Journal(path)  # the restarted process appends after the last whole record
    assert j2.records == 2
    j2.append("report_version", [7])
    j2.close()
    assert [a for _op, a in Journal.read(path)] == [[0], [1], [7]]


def test_an_old_journal_without_a_header_is_segment_zero_and_compacts(tmp_path):
    path = tmp_path / "old.journal"
    path.write_bytes(_frame({"op": "report_version", "args": [1]}) + _frame({"op": "report_version", "args": [2]}))
    j = Journal(path, compact_every=0)
    assert (j.run, j.segment, j.records) == (None, 0, 2)
    a = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None, journal=j)
    a.recover(str(path))
    assert a.state.version == 2
    a.positions.report_version(3)
    a.compact()
    a.positions.report_version(4)
    b = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None)
    assert b.recover(str(path)) == 1 and b.state.version == 4
    assert Journal.read_header(path) == (j.run, 1)


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_from_state_dict_rebuilds_the_plane_for_every_policy(admission):
    a = ControlPlane(_cfg(admission), UNITS, lambda u, ids, w: None)
    drv = _Driver()
    for k in range(40):
        drv.step(a, STEP_KINDS[k * 7 % len(STEP_KINDS)], k)
    snap = json.loads(json.dumps(a.state_dict()))  # what a file gives back
    b = ControlPlane.from_state_dict(snap, lambda u, ids, w: None)
    assert b.state_dict() == a.state_dict()
    d2 = _Driver()
    d2.next_id = drv.next_id
    for k in range(10):
        assert drv.step(a, "put", k) == d2.step(b, "put", k)
    assert b.state_dict() == a.state_dict()
    with pytest.raises(StateError, match="configuration"):
        ControlPlane(_cfg("fifo" if admission != "fifo" else "train_batch"), UNITS,
                     lambda u, ids, w: None).load_state_dict(snap)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, (*prefix, i))


def _replace(obj, path, value):
    if not path:
        return value
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    out[path[0]] = _replace(obj[path[0]], path[1:], value)
    return out


def _sample_snapshot(close: bool) -> dict:
    a = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None)
    drv = _Driver()
    for k in range(30):
        drv.step(a, STEP_KINDS[k * 5 % len(STEP_KINDS)], k)
    if close:
        drv.step(a, "put", 0)
        a.admission.close()
    else:
        for k in range(40):  # nothing more in flight: the plane stops, and its error is in the snapshot
            try:
                for g in sorted({m.group for m in a.state.pending.values()}):
                    a.admission.withdraw(g)
                a.admission.set_in_flight({"a": 0, "b": 0})
            except QuotaInfeasibleError:
                break
            drv.step(a, "put", k)
        assert a.state.error is not None
    return json.loads(json.dumps(a.state_dict()))


_SAMPLES = [_sample_snapshot(False), _sample_snapshot(True)]
_SAMPLE_PATHS = sorted({(i, p) for i, snap in enumerate(_SAMPLES) for p in _paths(snap)}, key=repr)


@settings(max_examples=150, deadline=None)
@given(where=st.sampled_from(_SAMPLE_PATHS), value=json_values, delete=st.booleans())
def test_crafted_snapshots_with_valid_checksums_give_only_knitdata_errors(tmp_path_factory, where, value, delete):
    """A snapshot whose structure is mutated anywhere (a value replaced by any JSON, or a key dropped), re-framed
    with a valid checksum and a matching run: loading it and replaying the journal after it raises only
    KnitdataError (and a load that succeeds leaves a plane that answers calls)."""
    sample, where = _SAMPLES[where[0]], where[1]
    if delete and where and isinstance(where[-1], str):
        parent = sample
        for k in where[:-1]:
            parent = parent[k]
        state = _replace(sample, where[:-1], {k: v for k, v in parent.items() if k != where[-1]})
    else:
        state = _replace(sample, where, value)
    d = tmp_path_factory.mktemp("s")
    path = d / "run.journal"
    j = Journal(path, compact_every=0)
    j.append("report_version", [5])
    j.close()
    with open(str(path) + SNAPSHOT_SUFFIX, "wb") as f:  # framed by hand: any JSON, Infinity included
        f.write(_frame({"snapshot": 1, "run": j.run, "segment": 0, "records": 0, "state": state}))
    plane = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None)
    try:
        plane.recover(str(path))
    except KnitdataError:
        return
    drv = _Driver()
    drv.next_id = 1000
    for k, kind in enumerate(STEP_KINDS):
        drv.step(plane, kind, k)  # only KnitdataErrors, which the driver catches
    json.dumps(plane.state_dict(), allow_nan=False)


@pytest.mark.parametrize("bad", [b"NaN", b"Infinity", b"-Infinity", b"[" * 100_000])
def test_snapshots_and_records_with_nan_infinity_or_deep_nesting_are_codec_errors(tmp_path, bad):
    path = tmp_path / "run.journal"
    j = Journal(path, compact_every=0)
    j.close()
    body = b'{"snapshot":1,"run":"' + j.run.encode() + b'","segment":0,"records":0,"state":{"x":' + bad + b"}}"
    (tmp_path / ("run.journal" + SNAPSHOT_SUFFIX)).write_bytes(
        body + b"\t" + f"{zlib.crc32(body) & 0xFFFFFFFF:08x}".encode() + b"\n")
    with pytest.raises(CodecError):
        read_snapshot(str(path) + SNAPSHOT_SUFFIX)
    rec = b'{"op":"report_version","args":[' + bad + b"]}"
    path.write_bytes(path.read_bytes() + rec + b"\t" + f"{zlib.crc32(rec) & 0xFFFFFFFF:08x}".encode() + b"\n"
                     + _frame({"op": "report_version", "args": [1]}))
    with pytest.raises(CodecError):
        list(Journal.read(path))


def test_a_compaction_that_cannot_write_warns_and_the_journal_keeps_growing(tmp_path):
    path = tmp_path / "run.journal"
    (tmp_path / ("run.journal" + SNAPSHOT_SUFFIX)).mkdir()  # the snapshot cannot be written there
    j = Journal(path, compact_every=4)
    a = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None, journal=j)
    drv = _Driver()
    with pytest.warns(RuntimeWarning, match="compaction failed"):
        for k in range(6):
            drv.step(a, "put", k)
    assert j.segment == 0 and j.records == 6  # one failed attempt; the next is compact_every records later
    with pytest.raises(OSError):
        a.compact()
    b = ControlPlane(_cfg(), UNITS, lambda u, ids, w: None)
    assert b.recover(str(path)) == 6  # segment 0 needs no snapshot: a full replay
    assert b.state_dict() == a.state_dict()
    with pytest.raises(ConfigError, match="no journal"):
        b.compact()


# ---------------------------------------------------------------------------------------------- compatibility
FIXTURE = Path(__file__).parent / "data" / "control_state_946d369"


def test_a_journal_and_snapshot_written_by_knitdata_946d369_recover_to_its_state(tmp_path):
    """tests/data/control_state_946d369 was written by knitdata at 946d369 (before the plane was split and the
    two-phase put removed): puts, a withdrawal, hand-outs, commits, a compaction (the snapshot), then more calls
    in segment 1; ``state.json`` is that plane's final ``snapshot()``. This version recovers the very same state,
    and writes it in the same format plus the reshape part of format 3 (the queued mini-batches as admitted)."""
    for f in FIXTURE.iterdir():
        if f.name != "state.json":
            shutil.copy(f, tmp_path / f.name)
    want = json.loads((FIXTURE / "state.json").read_text())
    plane = ControlPlane(_config(), UNITS, lambda u, ids, w: None)
    assert plane.recover(str(tmp_path / "run.journal")) == len(list(Journal.read(tmp_path / "run.journal"))) > 0
    got = json.loads(json.dumps(plane.state_dict()))
    assert got.pop("format") == 3 and want["format"] == 2
    assert got.pop("reshape")["segments"] is None
    assert got == {k: v for k, v in want.items() if k != "format"}
    again = ControlPlane.from_state_dict(want, lambda u, ids, w: None).state_dict()
    assert again.pop("reshape")["layout"] == plane.state_dict()["reshape"]["layout"]  # records: from the queues
    assert {**again, "format": 2} == want


@pytest.mark.parametrize("op", ["reserve", "reserve_many", "offer", "offer_many", "unreserve"])
def test_a_journal_holding_a_call_of_the_removed_two_phase_put_is_a_clear_codec_error(tmp_path, op):
    path = tmp_path / "run.journal"
    path.write_bytes(_frame({"op": "report_version", "args": [1]}) + _frame({"op": op, "args": [{"id": "t0"}]}))
    with pytest.raises(CodecError, match=f"record 2 is a call of {op}\\(\\), the two-phase put, which this version"):
        ControlPlane(_cfg(), UNITS, lambda u, ids, w: None).recover(str(path))


def test_a_snapshot_with_puts_in_progress_of_the_two_phase_put_is_refused_by_name():
    state = json.loads((FIXTURE / "state.json").read_text())
    assert state["putting"] == []  # what every engine wrote (none used the two-phase put)
    meta = {**_meta(99), "seq": 99, "location": None}
    del meta["fields"]
    state["putting"] = [["t99", "node0", meta, None]]
    with pytest.raises(StateError, match=r"puts in progress of the two-phase put \(\['t99'\]\)"):
        ControlPlane.from_state_dict(state, lambda u, ids, w: None)


def test_a_record_whose_operation_is_not_a_method_name_is_a_codec_error(tmp_path):
    path = tmp_path / "j"
    path.write_bytes(_frame({"op": "", "args": []}) + _frame({"op": "report_version", "args": [1]}))
    with pytest.raises(CodecError, match="line 1: operation '' is not a method name"):
        list(Journal.read(path))
    path.write_bytes(_frame({"op": "stats", "args": []}))  # a control call, but not a journaled one
    with pytest.raises(CodecError, match="unknown operation 'stats'"):
        ControlPlane(_cfg(), UNITS, lambda u, ids, w: None).recover(str(path))


SNAPSHOT_FIXTURE = Path(__file__).parent / "data" / "control_snapshot_b559aa6.json"


def test_a_snapshot_is_written_byte_for_byte_as_before_the_parts_owned_their_state():
    """tests/data/control_snapshot_b559aa6.json was written by knitdata at b559aa6, while every field lived in
    the one shared state and Durability wrote them all: four ranks, 23 puts, a withdrawal, hand-outs, a commit, a
    version report, a restore from that snapshot, 5 more puts and a commit. The parts now write their own slices
    and Durability gathers them: the same calls write the same bytes, and the file loads back to them."""
    from knitdata.control.journal import dumps_strict

    p = ControlPlane(_config(4), UNITS, lambda u, ids, w: None)
    _drive(p, 23)
    q = ControlPlane.from_state_dict(p.state_dict(), lambda u, ids, w: None)
    for i in range(23, 28):
        _put(q, _traj(i))
    q.positions.commit(0, 2)
    want = SNAPSHOT_FIXTURE.read_bytes().rstrip(b"\n")
    assert dumps_strict(q.state_dict()) == want
    again = ControlPlane.from_state_dict(json.loads(want), lambda u, ids, w: None)
    assert dumps_strict(again.state_dict()) == want


def test_each_snapshot_key_is_written_by_one_slice_in_the_order_of_SNAPSHOT_KEYS():
    """The shared state's slice and the parts' own (admission, observations, reshape) are disjoint, and with the
    frame they make the whole snapshot, written in :data:`SNAPSHOT_KEYS` order."""
    from knitdata.control.durability import SNAPSHOT_KEYS

    p = ControlPlane(_config(), UNITS, lambda u, ids, w: None)
    _drive(p, 9)
    slices = [p.state.state_dict()] + [part.state_dict() for part in p.durability.slices]
    keys = [k for sl in slices for k in sl]
    assert len(keys) == len(set(keys))
    assert set(p.admission.state_dict()) == {"schema", "withdrawn"} and p.admission.state_dict()["withdrawn"] == ["gx"]
    assert set(keys) | {"format", "config", "unit_nodes", "putting"} == set(SNAPSHOT_KEYS) - {"replicas"}
    assert list(p.state_dict()) == [k for k in SNAPSHOT_KEYS if k != "replicas"]
