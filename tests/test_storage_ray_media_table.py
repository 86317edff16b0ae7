"""knitdata.engines.ray.media without Ray: a Ray unit's media table (exact counts under any sequence of holds and
drops) and what a client sends per put call (each distinct item once, nothing the unit holds, content again after
a "missing" answer, references resolved elsewhere or refused)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.codec import decode_media, decode_trajectory
from knitdata.engines.ray.media import MediaSender, UnitMedia, content_bytes, media_spill_id, resolved_from_spill
from knitdata.errors import MediaRefError, ValidationError
from knitdata.record import MediaItem, Trajectory


def _item(seed: int, n: int = 12) -> MediaItem:
    g = torch.Generator().manual_seed(seed)
    return MediaItem("image", tensor=torch.randint(0, 256, (3, n, n), generator=g, dtype=torch.uint8))


def _traj(tid: str, media: list[MediaItem]) -> Trajectory:
    return Trajectory(id=tid, source="s", group="g", prompt_ids=torch.arange(4), response_ids=torch.arange(4),
                      media=media)


def _staged(item: MediaItem) -> list:
    return [f"ref-{item.digest}", item.nbytes, item.nbytes + 100]


def _descs(items: list[MediaItem]) -> list[list]:
    return [[m.digest, m.kind, m.nbytes, False] for m in items]


ITEMS = [_item(i, 4 + i) for i in range(5)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.lists(st.integers(0, 4), max_size=4)), max_size=25))
def test_unit_media_counts_stay_exact(ops):
    """Holds (a trajectory's items, repeats included) and drops in any order: the sum of the references equals the
    (trajectory, media) pairs held, bytes equal the distinct items' bytes, an item is held exactly while used."""
    table = UnitMedia()
    held: dict[str, list[int]] = {}
    for put, t, idx in ops:
        tid = f"t{t}"
        if put and tid not in held:
            items = [ITEMS[i] for i in idx]
            planned = table.plan(_descs(items), {m.digest: _staged(m) for m in items})
            assert not isinstance(planned, str)
            new, nbytes = planned
            assert nbytes == sum(ITEMS[i].nbytes for i in set(idx) if ITEMS[i].digest not in table.entries)
            table.hold(tid, _descs(items), new, None)
            held[tid] = idx
        elif not put and tid in held:
            table.drop(tid, None)
            del held[tid]
        check = table.check()
        assert check["ok"], check
        used = {i for idx in held.values() for i in idx}
        assert set(table.entries) == {ITEMS[i].digest for i in used}
        assert table.bytes == sum(ITEMS[i].nbytes for i in used)
        assert table.pairs == sum(len(idx) for idx in held.values())
        for i in used:
            assert table.entries[ITEMS[i].digest][3] == sum(idx.count(i) for idx in held.values())


def test_unit_media_plan_answers_missing_and_kind_without_changing_anything():
    table = UnitMedia()
    a, b = ITEMS[0], ITEMS[1]
    assert table.plan(_descs([a, b]), {a.digest: _staged(a)}) == "missing:1"
    new, n = table.plan(_descs([a]), {a.digest: _staged(a)})
    table.hold("t0", _descs([a]), new, None)
    assert table.plan([[a.digest, "video", 0, True]], {}) == "kind:0"
    new, n = table.plan([[a.digest, "image", 0, True]], {})  # a reference to a held item: no new bytes
    assert (new, n) == ({}, 0)
    table.hold("t1", [[a.digest, "image", 0, True]], new, None)
    st_ = table.stats()
    assert st_["media_items"] == 1 and st_["media_refs"] == 2 and st_["media_resolved"] == 1
    assert st_["media_bytes_saved"] == a.nbytes
    assert table.drop("t0", None) == 0 and table.drop("t1", None) == a.nbytes and table.drop("t1", None) == 0


def test_sender_sends_each_item_once_per_call_and_not_again():
    big, small = ITEMS[3], ITEMS[4]
    group = [_traj(f"t{i}", [big, _item(100 + i)]) for i in range(4)]
    sender = MediaSender("u0", True)
    recs, content = sender.encode(group)
    assert set(content) == {big.digest} | {t.media[1].digest for t in group}  # the shared item once
    assert all(len(r) == 4 and r[2] == t.nbytes - sum(m.nbytes for m in t.media) for r, t in zip(recs, group))
    back = decode_trajectory(recs[0][1].data)
    assert [m.reference for m in back.media] == [True, True]  # records carry references only
    assert decode_media(content[big.digest][0].data).tensor.equal(big.tensor)
    assert content_bytes(content) == sum(int(v[0].nbytes) for v in content.values())
    sender.mark_sent(recs)
    recs2, content2 = sender.encode([_traj("t9", [big, small])])
    assert set(content2) == {small.digest}  # the unit holds the group's item: not sent again
    _r, resent = sender.encode([_traj("t9", [big, small])], resend=True)
    assert set(resent) == {big.digest, small.digest}
    # the unit freed it: "missing" -> forgotten, its content goes with the next call
    assert sender.fix("missing:0", _traj("t9", [big]), None) == {}
    assert set(sender.encode([_traj("t9", [big])])[1]) == {big.digest}


def test_sender_resolves_or_refuses_references_and_per_trajectory_copies():
    held = ITEMS[2]
    ref = _traj("t5", [MediaItem.ref("image", held.digest)])
    sender = MediaSender("u0", True)
    recs, content = sender.encode([ref])
    assert content is None and recs[0][3] == [[held.digest, "image", 0, True]]
    with pytest.raises(MediaRefError) as e:
        sender.fix("missing:0", ref, lambda d: None)
    assert e.value.trajectory_id == "t5" and e.value.digest == held.digest and e.value.field == "media.0"
    rec = np.frombuffer(b"record", dtype=np.uint8)
    assert sender.fix("missing:0", ref, lambda d: (rec, held.nbytes)) == {held.digest: [rec, held.nbytes, True]}
    with pytest.raises(ValidationError, match="differs from the kind"):
        sender.fix("kind:0", ref, None)
    copies = MediaSender("u1", False)
    recs, content = copies.encode([_traj("t6", [held])])
    assert content is None and len(recs[0]) == 3 and recs[0][2] == _traj("t6", [held]).nbytes
    with pytest.raises(MediaRefError, match="media_dedup=False"):
        copies.encode([ref])


def test_spilled_references_resolve_from_the_media_samples():
    a = ITEMS[0]

    class Store(dict):
        def get(self, key):  # SpillStore.get raises KeyError for an absent id
            return self[key]

    store = Store()
    store[media_spill_id(a.digest)] = _traj("x", [a])
    traj = _traj("t0", [MediaItem.ref("image", a.digest), MediaItem.ref("image", a.digest)])
    got = resolved_from_spill(store, traj)
    assert got is not None and got.media[0] is got.media[1] and got.media[0].tensor.equal(a.tensor)
    assert resolved_from_spill(store, _traj("t1", [MediaItem.ref("image", ITEMS[1].digest)])) is None
