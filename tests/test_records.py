"""Tests of knitdata.control.records: typed records inside the process, the same JSON at the boundaries."""

from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.control.records import (
    Admitted,
    ConsumerId,
    Fenced,
    HandOut,
    ItemRef,
    LeaseNews,
    PlacementView,
    PlanEntry,
    ProducerNews,
    Refusal,
    Stored,
    item_refs,
)
from knitdata.errors import FieldTypeError, KnitdataError, StoreFull, ValidationError
from knitdata.planner import MicroBatchInfo
from knitdata.record import TrajectoryMeta

ROOT = Path(__file__).resolve().parent.parent

#: The keys of a plan entry's former dict form (``{"j", "minibatch", "microbatch", "info", "items", "fp"}``).
ENTRY_KEYS = {"j", "minibatch", "microbatch", "info", "items", "fp"}

ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=8)
small = st.integers(0, 10_000)


@st.composite
def entries(draw: st.DrawFn) -> PlanEntry:
    k = draw(st.integers(1, 4))
    i = draw(st.integers(0, k - 1))
    n = draw(st.integers(0, 4))
    tids = tuple(draw(st.lists(ids, min_size=n, max_size=n)))
    info = MicroBatchInfo(draw(small), draw(small), draw(small), draw(st.integers(0, 3)), i, k, i == k - 1,
                          draw(small), draw(small), draw(small), tids, tuple(draw(st.lists(small, min_size=n,
                                                                                           max_size=n))))
    items = [ItemRef(t, draw(st.sampled_from(["node0", "node1"])), draw(small)) for t in tids]
    fp = draw(st.none() | st.text("0123456789abcdef", min_size=16, max_size=16))
    return PlanEntry(draw(small), info.minibatch, i, info, items, fp)


def _old_entry_form(e: PlanEntry) -> dict:
    """The dict a plan entry was before it was typed (control/state.py ``queue_row`` at 09a9e70)."""
    return {"j": e.j, "minibatch": e.minibatch, "microbatch": e.microbatch, "info": e.info.to_dict(),
            "items": [[it.id, it.unit, it.nbytes] for it in e.items], "fp": e.fp}


@settings(max_examples=60, deadline=None)
@given(entries())
def test_a_plan_entry_round_trips_through_the_snapshot_json_as_its_old_dict(e: PlanEntry) -> None:
    assert e.to_json() == _old_entry_form(e)
    text = json.dumps(e.to_json(), sort_keys=False)
    assert text == json.dumps(_old_entry_form(e))  # byte for byte, key order included
    assert PlanEntry.from_json(json.loads(text)) == e


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(small, small, st.integers(0, 3), small, st.integers(-1, 50)), max_size=4), ids,
       st.booleans(), st.integers(0, 3), small, st.integers(0, 2))
def test_row_records_are_written_as_the_old_arrays_and_read_back(recs, token, release, worker, rank, replica) -> None:
    handouts = [HandOut(*r) for r in recs]
    assert json.dumps(handouts) == json.dumps([list(r) for r in recs])  # journal lines of handed_many unchanged
    assert [HandOut(*x) for x in json.loads(json.dumps(handouts))] == handouts
    news = LeaseNews(rank, worker, token, handouts, release, replica)
    assert json.dumps(news) == json.dumps([rank, worker, token, [list(r) for r in recs], release, replica])
    back = LeaseNews(*json.loads(json.dumps(news)))
    assert back._replace(records=[HandOut(*r) for r in back.records]) == news
    for rec in (Fenced(rank, worker, token, "host:1 (lease epoch 2)"), ProducerNews(token, "host:1", release),
                ConsumerId(rank, worker, replica), ItemRef(token, "node0", rank)):
        assert json.dumps(rec) == json.dumps(list(rec))
        assert type(rec)(*json.loads(json.dumps(rec))) == rec
    assert ConsumerId(rank, worker, replica) == (rank, worker, replica)  # keys of the lease book, as before
    assert hash(ConsumerId(rank, worker, replica)) == hash((rank, worker, replica))


def test_a_handout_without_version_reads_as_the_old_four_field_record() -> None:
    assert HandOut(3, 1, 0, 3) == (3, 1, 0, 3, -1)
    assert HandOut(*[3, 1, 0, 3]).version == -1


@settings(max_examples=40, deadline=None)
@given(ids, st.sampled_from(["ValidationError", "FieldTypeError", "StoreFull", "NoSuchError", "KeyError"]),
       st.none() | st.sampled_from(["reward", "scalars.x"]))
def test_a_refusal_rebuilds_its_error_naming_trajectory_and_field(tid: str, name: str, field: str | None) -> None:
    cls = {"ValidationError": ValidationError, "FieldTypeError": FieldTypeError, "StoreFull": StoreFull}.get(
        name, KnitdataError)
    if cls in (ValidationError, FieldTypeError):
        made = cls("bad value", trajectory_id=tid, field=field)
    else:
        made = cls("bad value")
    r = Refusal(tid, name, str(made), field)
    assert json.dumps(r) == json.dumps([tid, name, str(made), field])
    assert Refusal(*json.loads(json.dumps(r))) == r
    err = r.to_exception(" (2 more refused in this batch)")
    assert type(err) is cls
    assert str(err) == str(made) + " (2 more refused in this batch)"
    if cls in (ValidationError, FieldTypeError):
        assert err.trajectory_id == tid and err.field == field
        assert str(err).startswith(f"trajectory {tid!r}: ")


def test_refusal_of_an_exception_names_its_field() -> None:
    r = Refusal.of("t3", ValidationError("not finite", trajectory_id="t3", field="reward"))
    assert r == ("t3", "ValidationError", "trajectory 't3': field 'reward': not finite", "reward")
    assert Refusal.of("t4", StoreFull("full")).field is None


def test_item_refs_are_the_metas_id_unit_and_bytes() -> None:
    metas = [TrajectoryMeta(f"t{i}", "s", "g", nbytes=10 * i, location=f"node{i % 2}") for i in range(3)]
    refs = item_refs(metas)
    assert refs == [ItemRef("t0", "node0", 0), ItemRef("t1", "node1", 10), ItemRef("t2", "node0", 20)]
    assert all(type(r) is ItemRef for r in refs) and refs[1].unit == "node1"


def _key_reads(source: str, keys: set[str]) -> list[str]:
    """Reads of the string keys ``keys`` in ``source``: ``x["j"]`` (loaded, not stored) and ``x.get("fp")`` (not a
    config's ``.get``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                and isinstance(node.slice, ast.Constant) and node.slice.value in keys):
            found.append(f"line {node.lineno}: [{node.slice.value!r}]")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and not (isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "config")
              and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in keys):
            found.append(f"line {node.lineno}: .get({node.args[0].value!r})")
    return found


def test_the_consumer_side_reads_plan_entries_by_attribute() -> None:
    """The consumer side (knitdata/consumer) reads no plan entry by string key (35 such reads by this count at
    09a9e70, before the records, with the start point's ``next``/``fp``; the state dicts it writes are stores)."""
    reads = {p.name: _key_reads(p.read_text(), ENTRY_KEYS) for p in sorted((ROOT / "knitdata" / "consumer").glob("*.py"))}
    assert {k: v for k, v in reads.items() if v} == {}
    assert _key_reads('e["minibatch"]; e.get("fp"); s["minibatch"] = 1', ENTRY_KEYS) == [
        "line 1: ['minibatch']", "line 1: .get('fp')"]


def _put_answer() -> Stored:
    metas = [TrajectoryMeta(f"t{i}", "math", "g0", gen_version=1, num_tokens=9 + i, nbytes=64, location="node0", seq=i)
             for i in range(2)]
    refused = Refusal("t9", "ValidationError", "trajectory 't9': field 'id': was already put", "id")
    return Stored(3, Admitted([metas[0], None, metas[1]], [refused], {"load": {"node0": 128}}, 2), "full", 3)


#: Loads pickled put answers (hex lines on stdin) in a process with another string hash, as a Ray worker does.
_LOAD_ELSEWHERE = """
import pickle, sys
from knitdata.record import PACKED_META
for line in sys.stdin.read().split():
    res = pickle.loads(bytes.fromhex(line))
    metas = [m for m in res.admit.accepted if m is not None]
    print(type(res).__name__, type(res.admit).__name__, type(res.admit.errors[0]).__name__, res.stored, res.status,
          res.admit.seq, [m.id for m in metas], res.admit.errors[0].to_exception(),
          all(m.packed == PACKED_META.pack(m.num_tokens, m.nbytes, m.seq, hash(m.id)) for m in metas))
"""


def test_the_put_answers_cross_a_process_as_typed_records_with_that_process_hash() -> None:
    """The Ray hop pickles the put's answers (the unit actor gets the coordinator's :class:`Admitted`, the client the
    actor's :class:`Stored`): they arrive as the same records, each meta's ``packed`` rebuilt with the loading
    process's hash of its id (a meta never carries another process's hash)."""
    res = _put_answer()
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    blobs = [pickle.dumps(res), cloudpickle.dumps(res)]
    for blob in blobs:
        back = pickle.loads(blob)
        assert back == res and type(back.admit) is Admitted and type(back.admit.errors[0]) is Refusal
        assert all(type(m) is TrajectoryMeta for m in back.admit.accepted if m is not None)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", _LOAD_ELSEWHERE], input="\n".join(b.hex() for b in blobs), env=env,
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout.splitlines()
    assert out == ["Stored Admitted Refusal 3 full 2 ['t0', 't1'] trajectory 't9': field 'id': was already put True"] * 2


def test_a_put_answer_compares_by_value_and_is_never_json() -> None:
    """A retried put answers as the first time (equal records); the journal records the call's arguments only, so the
    answers have no JSON form."""
    assert _put_answer() == _put_answer() and _put_answer().admit != Admitted([], [], {}, 2)
    with pytest.raises(TypeError):
        json.dumps(_put_answer())
    assert PlacementView({"load": {}}, 4) == ({"load": {}}, 4) and json.dumps(PlacementView({}, 4)) == "[{}, 4]"


#: The put path's modules, and the keys of the put's former answer dicts (``admit_many``, ``put_admit``,
#: ``placement_view``).
PUT_PATH = ("producer.py", "storage/base.py", "engines/ray/unit.py", "engines/ray/unit_actor.py", "control/admit.py",
            "engines/ray/control.py")
ANSWER_KEYS = {"accepted", "errors", "placement", "seq", "exception", "stored", "admit", "status", "index"}


def test_the_put_path_reads_its_answers_by_attribute() -> None:
    """The put path reads no answer of the put by string key (17 such reads by this count at 5557260, before the
    records: 10 in producer.py, 5 in engines/ray/unit.py, 1 each in storage/base.py and engines/ray/unit_actor.py)."""
    reads = {p: _key_reads((ROOT / "knitdata" / p).read_text(), ANSWER_KEYS) for p in PUT_PATH}
    assert {k: v for k, v in reads.items() if v} == {}
    assert _key_reads('a["accepted"]; a.get("exception"); e.config.get("placement"); d["seq"] = 1', ANSWER_KEYS) == [
        "line 1: ['accepted']", "line 1: .get('exception')"]
