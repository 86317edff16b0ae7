"""knitdata.storage.media.MediaStore: one copy per digest, exact reference counts (issue 43)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.errors import MediaRefError, ValidationError
from knitdata.record import MediaItem
from knitdata.storage.media import MediaStore


def _img(seed: int, side: int = 4) -> MediaItem:
    g = torch.Generator().manual_seed(seed)
    return MediaItem("image", tensor=torch.randint(0, 256, (3, side, side), generator=g, dtype=torch.uint8))


def test_hold_stores_once_and_returns_the_held_item():
    t = MediaStore()
    a, a2 = _img(1), _img(1)  # equal content, distinct objects
    assert a is not a2 and a.digest == a2.digest
    held, new = t.hold("t0", [a])
    assert new == a.nbytes and held[0] is a
    held2, new2 = t.hold("t1", [a2, MediaItem.ref("image", a.digest)])
    assert new2 == 0 and held2[0] is a and held2[1] is a  # the one copy, twice
    assert (len(t), t.bytes, t.pairs, t.refs(a.digest)) == (1, a.nbytes, 3, 3)
    s = t.stats()
    assert s == {"media_items": 1, "media_bytes": a.nbytes, "media_refs": 3, "media_bytes_saved": 2 * a.nbytes,
                 "media_resolved": 1, "media_copied_in": 0}
    assert t.check()["ok"]
    assert t.drop("t0") == 0 and t.refs(a.digest) == 2
    assert t.drop("t1") == a.nbytes and len(t) == 0 and t.bytes == 0 and t.pairs == 0
    assert t.drop("t1") == 0  # unknown: nothing


def test_unresolved_reference_refused_all_or_nothing():
    t = MediaStore()
    a = _img(2)
    t.hold("t0", [a])
    before = (t.stats(), t.check())
    b = _img(3)
    with pytest.raises(MediaRefError) as ei:
        t.hold("t1", [b, MediaItem.ref("image", "f" * 32)])  # b would be new: not stored either
    e = ei.value
    assert (e.trajectory_id, e.field, e.digest, e.index, e.kind) == ("t1", "media.1", "f" * 32, 1, "image")
    assert "t1" in str(e) and "f" * 32 in str(e) and "put the item with its content" in str(e)
    assert (t.stats(), t.check()) == before and not t.holds(b.digest) and "t1" not in t


def test_plan_changes_nothing_and_agrees_with_hold():
    t = MediaStore()
    a, b = _img(4), _img(5)
    t.hold("t0", [a])
    assert t.plan("t1", [a, b, MediaItem.ref("image", b.digest)]) == b.nbytes
    assert len(t) == 1 and t.pairs == 1
    assert t.hold("t1", [a, b, MediaItem.ref("image", b.digest)])[1] == b.nbytes
    with pytest.raises(MediaRefError):
        t.plan("t2", [MediaItem.ref("image", "e" * 32)])


def test_resolve_copies_in_from_elsewhere():
    other = MediaStore()
    a = _img(6)
    other.hold("x", [a])
    t = MediaStore()
    held, new = t.hold("t0", [MediaItem.ref("image", a.digest)], resolve=other.get)
    assert held[0] is a and new == a.nbytes and t.copied_in == 1 and t.resolved == 1
    assert other.drop("x") == a.nbytes  # freed there; still held here (counted on both)
    assert t.get(a.digest) is a and t.drop("t0") == a.nbytes


def test_mismatched_kind_or_rate_refused_and_duplicate_trajectory():
    t = MediaStore()
    clip = MediaItem("audio", tensor=torch.zeros(8), sample_rate=16000)
    t.hold("t0", [clip])
    with pytest.raises(ValidationError, match="sample rate"):
        t.hold("t1", [MediaItem("audio", tensor=torch.zeros(8), sample_rate=8000)])
    with pytest.raises(ValidationError, match="differs"):
        t.hold("t1", [MediaItem.ref("image", clip.digest)])
    assert t.hold("t1", [MediaItem.ref("audio", clip.digest)])[0][0] is clip  # no rate given: the held one's
    with pytest.raises(ValidationError, match="already"):
        t.hold("t1", [clip])
    assert t.check()["ok"] and t.pairs == 2


def test_concurrent_hold_drop_keeps_counts():
    t = MediaStore()
    items = [_img(i) for i in range(4)]

    def work(w: int) -> None:
        for k in range(200):
            tid = f"w{w}-{k}"
            t.hold(tid, [items[k % 4], items[(k + w) % 4]])
            if k % 3:
                t.drop(tid)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    res = t.check()
    assert res["ok"] and res["pairs"] == 4 * 2 * len([k for k in range(200) if k % 3 == 0])


# ------------------------------------------------------------------------------------------- property
_POOL = [_img(100 + i, side=2 + i) for i in range(5)]

ops = st.lists(st.tuples(st.sampled_from(["hold", "drop"]), st.integers(0, 7),
                         st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=4)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_property_matches_a_simple_model(seq):
    """Random hold/drop sequences against a model: refs per digest, bytes of distinct digests, all-or-nothing."""
    t = MediaStore()
    model: dict[str, list[int]] = {}  # trajectory -> pool indices it holds
    for op, tnum, spec in seq:
        tid = f"t{tnum}"
        if op == "drop":
            held_before = {i for v in model.values() for i in v}
            model.pop(tid, None)
            held_after = {i for v in model.values() for i in v}
            assert t.drop(tid) == sum(_POOL[i].nbytes for i in held_before - held_after)
            continue
        items = [MediaItem.ref("image", _POOL[i].digest) if ref else _POOL[i] for i, ref in spec]
        held = {i for v in model.values() for i in v}
        brought: set[int] = set()
        ok = tid not in model
        for i, ref in spec:  # a reference resolves to what is held, or what this trajectory brought before it
            if ref and i not in held and i not in brought:
                ok = False
            brought.add(i)
        if not ok:
            with pytest.raises(ValidationError):  # MediaRefError is one
                t.hold(tid, items)
        else:
            canon, new = t.hold(tid, items)
            assert new == sum(_POOL[i].nbytes for i in {i for i, _r in spec} - held)
            assert all(c.digest == _POOL[i].digest and not c.reference for c, (i, _r) in zip(canon, spec))
            if spec:
                model[tid] = [i for i, _r in spec]
        # the invariants, after every step
        refs: dict[int, int] = {}
        for v in model.values():
            for i in v:
                refs[i] = refs.get(i, 0) + 1
        assert {i: t.refs(_POOL[i].digest) for i in refs} == refs
        assert all(not t.holds(p.digest) for i, p in enumerate(_POOL) if i not in refs)
        assert len(t) == len(refs) and t.bytes == sum(_POOL[i].nbytes for i in refs)
        assert t.pairs == sum(refs.values()) and t.check()["ok"]
        logical = sum(_POOL[i].nbytes * n for i, n in refs.items())
        assert t.stats()["media_bytes_saved"] == logical - t.bytes
