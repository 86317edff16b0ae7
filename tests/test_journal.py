"""The control plane's journal: format, torn writes, damage, and replay into an identical state."""

from __future__ import annotations

import json
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.admission import BatchSpec
from knitdata.control import ControlPlane, fields_of
from knitdata.control.journal import JOURNALED_OPS, Journal
from knitdata.errors import CodecError, KnitdataError
from knitdata.placement import ConsumerLayout
from knitdata.record import Trajectory


def _config(n: int = 2) -> dict:
    spec = BatchSpec({"a": 4, "b": 4}, num_minibatches=2, group_size=2)
    return {"spec": spec.to_dict(), "layout": ConsumerLayout.uniform(2, n // 2 or 1).to_dict(), "token_budget": 40}


def _traj(i: int) -> Trajectory:
    import torch

    return Trajectory(id=f"t{i}", source="ab"[(i // 2) % 2], group=f"g{i // 2}", gen_version=0,
                      prompt_ids=torch.arange(4), response_ids=torch.arange(8 + i % 3), scalars={"r": 1.0})


def _drive(plane: ControlPlane, n: int) -> None:
    for i in range(n):
        t = _traj(i)
        meta = {**t.meta().to_dict(), "fields": fields_of(t.scalars, {})}
        r = plane.reserve(meta)
        plane.offer(t.id, r["seq"], 8)
    plane.withdraw("gx")
    for rank in range(plane.layout.num_consumers):
        got = plane.next_entries(rank, 0, 0.0)
        for e in got.get("entries", []):
            plane.handed(rank, e["j"], e["minibatch"], e["microbatch"])
    plane.commit(0, 1)
    plane.report_version(1)


def _state(p: ControlPlane) -> dict:
    return {"planned": p.planned, "committed": p.committed, "position": p.position, "seq": p.seq,
            "queues": [sorted(q) for q in p.queues], "entries": [[q[j]["items"] for j in sorted(q)] for q in p.queues],
            "live": sorted(p.live), "pending": sorted(p.pending), "version": p.version, "schema": p.schema,
            "placement": p.placement.state_dict()}


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
            t = _traj(i)
            r = p.reserve({**t.meta().to_dict(), "fields": fields_of(t.scalars, {})})
            p.offer(t.id, r["seq"], 8)
    assert _state(b) == _state(a)


def test_a_retried_offer_after_a_restart_is_accepted_once(tmp_path):
    path = tmp_path / "run.journal"
    a = ControlPlane(_config(), {"node0": "node0", "node1": "node1"}, lambda u, ids, wait: None, journal=Journal(path))
    t = _traj(0)
    r = a.reserve({**t.meta().to_dict(), "fields": fields_of(t.scalars, {})})
    first = a.offer(t.id, r["seq"], 8)
    b = ControlPlane(_config(), {"node0": "node0", "node1": "node1"}, lambda u, ids, wait: None)
    b.recover(str(path))
    assert b.offer(t.id, r["seq"], 8) == first  # the caller never saw the answer and retries
    assert len(b.pending) == 1


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
