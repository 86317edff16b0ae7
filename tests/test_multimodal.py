"""MultimodalCollator / MultimodalBatch: unique tables, offsets, per-micro-batch indices, keys, devices."""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from _multimodal_helpers import make_layout  # noqa: E402

from knitdata.errors import MediaError  # noqa: E402
from knitdata.media.multimodal import EqualInputs, MediaTable, MultimodalCollator  # noqa: E402
from knitdata.media.process import MediaProcessor, ProcessedMedia, audio_item, image_item, patchify, processed_digest  # noqa: E402
from knitdata.record import MediaItem, Trajectory  # noqa: E402


def _traj(i, group, media):
    return Trajectory(id=f"t{i}", source="v", group=group, prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2]),
                      media=media)


def _png(color, size=(8, 8)) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", size, color).save(b, "PNG")
    return b.getvalue()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 4), key=st.sampled_from(["digest", "provenance"]))
def test_every_occurrence_points_at_its_processed_item(seed, k, key):
    rng = random.Random(seed)
    mbs = make_layout(rng, groups=rng.randint(1, 4), group_size=rng.randint(1, 4), max_items=2, max_len=4, k=k)
    batch = MultimodalCollator(key=key)(mbs)
    assert batch.num_microbatches == k
    assert [list(t) for t in batch.trajectory_ids] == [[t.id for t in mb] for mb in mbs]
    n_occ = 0
    for i, mb in enumerate(mbs):
        occ = batch.for_microbatch(i).get("image")
        expected = [(j, n) for j, t in enumerate(mb) for n in range(len(t.media))]
        got = [] if occ is None else list(zip(occ.trajectory.tolist(), occ.item.tolist()))
        assert got == expected  # trajectory order, then media order
        for u, j, n in zip([] if occ is None else occ.index.tolist(), *zip(*got)) if got else []:
            assert torch.equal(batch.tables["image"].item(u), mb[j].media[n].tensor)
        n_occ += len(expected)
    assert batch.num_occurrences == n_occ
    if n_occ:
        table = batch.tables["image"]
        assert table.offsets[0] == 0 and table.offsets[-1] == table.values.shape[0]
        assert len(table.keys) == table.num_items == len(set(table.keys))
        assert bool((table.lengths > 0).all())
    else:
        assert batch.is_empty


def test_digest_finds_shared_images_provenance_does_not():
    a, b = image_item(_png((255, 0, 0))), image_item(_png((0, 0, 255)))
    a_again = image_item(np.array(Image.open(io.BytesIO(_png((255, 0, 0))))))  # same pixels, stored decoded
    mbs = [[_traj(0, "g0", [a]), _traj(1, "g0", [a])], [_traj(2, "g1", [a_again, b])], [_traj(3, "g1", [a_again, b])]]
    coll = dict(preprocess={"image": patchify(4)})
    d = MultimodalCollator(**coll, key="digest")(mbs)
    p = MultimodalCollator(**coll, key="provenance")(mbs)
    assert d.num_occurrences == p.num_occurrences == 6
    assert d.tables["image"].num_items == 2 and p.tables["image"].num_items == 3
    assert p.tables["image"].keys == (("g0", 0), ("g1", 0), ("g1", 1))
    assert d.for_microbatch(2)["image"].index.tolist() == [0, 1]
    assert p.for_microbatch(2)["image"].index.tolist() == [1, 2]


@st.composite
def _processed_inputs(draw):
    """Processed inputs that are often equal, or differ in one value anywhere (sampled or not), in dtype, shape,
    sample rate, kind or metadata: what processed_digest tells apart."""
    base = torch.arange(draw(st.integers(1, 300)), dtype=torch.float32)
    out = []
    for _ in range(draw(st.integers(1, 8))):
        t, kind, rate, meta = base.clone(), "audio", 16000, None
        change = draw(st.sampled_from(["none", "none", "value", "dtype", "shape", "rate", "kind", "meta", "nan"]))
        if change == "value":
            t[draw(st.integers(0, t.numel() - 1))] += 1
        elif change == "dtype":
            t = t.to(torch.bfloat16)
        elif change == "shape" and t.numel() % 2 == 0:
            t = t.reshape(2, -1)
        elif change == "rate":
            rate = 8000
        elif change == "kind":
            kind, rate = "image", None
        elif change == "meta":
            meta = {"grid": torch.tensor([1, draw(st.integers(0, 2)), 3])}
        elif change == "nan":
            t[0] = float("nan")  # equal bytes are equal inputs, NaN or not
        out.append(ProcessedMedia(kind, t if t.dim() > 1 else t[:, None], rate, meta))
    return out


@settings(max_examples=60, deadline=None)
@given(inputs=_processed_inputs())
def test_equal_inputs_are_found_exactly_when_their_digests_are_equal(inputs):
    same = EqualInputs()
    keys = [same.key(pm, i) for i, pm in enumerate(inputs)]
    digests = [processed_digest(pm) for pm in inputs]
    for i in range(len(inputs)):
        first = digests.index(digests[i])  # the first input equal to this one keeps its key
        assert keys[i] == first


def test_equal_inputs_compare_beyond_the_sampled_values():
    a = torch.zeros(10_000)
    b = a.clone()
    b[1] = 1.0  # 10_000 // 64 = 156: index 1 is not among the sampled values
    same = EqualInputs()
    assert same.key(ProcessedMedia("image", a[:, None]), "a") == "a"
    assert same.key(ProcessedMedia("image", b[:, None]), "b") == "b"
    assert same.key(ProcessedMedia("image", a.clone()[:, None]), "c") == "a"


def test_many_inputs_equal_on_the_sampled_values_are_told_apart_by_digest():
    inputs = []
    for i in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 3, 11, 9, 0, 12, 12]:  # past the compared limit, with repeats
        t = torch.zeros(10_000)
        t[1] = float(i)  # never sampled: every input agrees on the signature
        inputs.append(ProcessedMedia("image", t[:, None]))
    same = EqualInputs()
    keys = [same.key(pm, n) for n, pm in enumerate(inputs)]
    digests = [processed_digest(pm) for pm in inputs]
    assert keys == [digests.index(d) for d in digests]


def test_digest_keys_keep_raw_items_of_another_kind_or_rate_apart():
    samples = torch.rand(1600, 1)
    a16, a8 = audio_item(samples, sample_rate=16000), audio_item(samples, sample_rate=8000)  # one digest (the samples), two rates
    assert a16.digest == a8.digest
    batch = MultimodalCollator()([[_traj(0, "g", [a16]), _traj(1, "h", [a8])]])
    table = batch.tables["audio"]
    assert table.num_items == 2 and table.sample_rates.tolist() == [16000, 8000]
    assert batch.for_microbatch(0)["audio"].index.tolist() == [0, 1]
    with pytest.raises(MediaError, match="different media under index 0"):  # one group, two rates: not one item
        MultimodalCollator(key="provenance")([[_traj(0, "g", [a16]), _traj(1, "g", [a8])]])


def test_each_distinct_item_processed_once():
    calls = []

    def prep(x):
        calls.append(1)
        return patchify(4)(x)

    a = image_item(_png((1, 2, 3)))
    mbs = [[_traj(i, "g", [a]) for i in range(4)], [_traj(i + 4, "h", [a]) for i in range(4)]]
    for key in ("digest", "provenance"):
        calls.clear()
        MultimodalCollator({"image": prep}, key=key)(mbs)
        assert len(calls) == 1


def test_reordered_microbatches_get_matching_indices():
    rng = random.Random(7)
    mbs = make_layout(rng, groups=3, group_size=3, max_items=2, max_len=3, k=3)
    fwd = MultimodalCollator()(mbs)
    rev = MultimodalCollator()(mbs[::-1])
    for i in range(3):
        f_occ, r_occ = fwd.for_microbatch(i).get("image"), rev.for_microbatch(2 - i).get("image")
        if f_occ is None:
            assert r_occ is None
            continue
        f_items = [fwd.tables["image"].item(u) for u in f_occ.index.tolist()]
        r_items = [rev.tables["image"].item(u) for u in r_occ.index.tolist()]
        assert all(torch.equal(x, y) for x, y in zip(f_items, r_items))


def test_variable_lengths_packed_and_gather_slice():
    items = [MediaItem(kind="image", tensor=torch.randn(n, 3)) for n in (2, 5, 1)]
    mbs = [[_traj(0, "a", [items[0], items[1]])], [_traj(1, "b", [items[2], items[0]])]]
    batch = MultimodalCollator()(mbs)
    t = batch.tables["image"]
    assert t.offsets.tolist() == [0, 2, 7, 8] and t.lengths.tolist() == [2, 5, 1] and t.values.shape == (8, 3)
    g = t.gather(batch.for_microbatch(1)["image"].index)
    assert g.offsets.tolist() == [0, 1, 3] and torch.equal(g.values, torch.cat([items[2].tensor, items[0].tensor]))
    s = t.slice(1, 3)
    assert s.offsets.tolist() == [0, 5, 6] and torch.equal(s.item(1), items[2].tensor)
    assert batch.nbytes > t.nbytes > 0


def test_provenance_conflict_and_unpackable_shapes():
    a, b = MediaItem(kind="image", tensor=torch.randn(2, 3)), MediaItem(kind="image", tensor=torch.randn(2, 3))
    with pytest.raises(MediaError, match="different media") as ei:
        MultimodalCollator(key="provenance")([[_traj(0, "g", [a]), _traj(1, "g", [b])]])
    assert ei.value.trajectory_id == "t1" and ei.value.item == 0
    c = MediaItem(kind="image", tensor=torch.randn(2, 4))
    with pytest.raises(MediaError, match="row shape") as ei:
        MultimodalCollator()([[_traj(0, "g", [a])], [_traj(1, "h", [c])]])
    assert ei.value.trajectory_id == "t1"
    with pytest.raises(ValueError):
        MultimodalCollator(key="nope")
    with pytest.raises(MediaError, match="t5"):
        MultimodalCollator()([[_traj(5, "g", [MediaItem(kind="image", data=b"junk")])]])


def test_audio_table_keeps_rates():
    sr = [8000, 16000]
    items = [MediaItem(kind="audio", tensor=torch.randn(40), sample_rate=r) for r in sr]
    batch = MultimodalCollator(processor=MediaProcessor({"audio": lambda x, rate: x.reshape(-1, 4)}))(
        [[_traj(0, "g", [items[0]]), _traj(1, "h", [items[1], items[0]])]]
    )
    t = batch.tables["audio"]
    assert t.sample_rates.tolist() == sr and t.lengths.tolist() == [10, 10]
    assert batch.for_microbatch(0)["audio"].index.tolist() == [0, 1, 0]


def test_to_is_memoized_and_empty_like():
    batch = MultimodalCollator()([[_traj(0, "g", [MediaItem(kind="image", tensor=torch.randn(2, 3))])]])
    assert batch.to("cpu") is batch  # already there
    moved = batch.to("meta")
    assert moved is batch.to("meta") and moved.tables["image"].values.device.type == "meta"
    assert moved.for_microbatch(0)["image"].index.device.type == "meta"
    d = MediaTable.empty_like("image", (3,), torch.float32, length=2)
    assert d.num_items == 1 and d.values.shape == (2, 3) and float(d.values.abs().sum()) == 0
    with pytest.raises(IndexError):
        batch.for_microbatch(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA device")
def test_pin_memory():
    batch = MultimodalCollator()([[_traj(0, "g", [MediaItem(kind="image", tensor=torch.randn(2, 3))])]])
    pinned = batch.pin_memory()
    assert pinned.tables["image"].values.is_pinned() and pinned is batch.pin_memory()
    on = pinned.to("cuda", non_blocking=True)
    assert on.tables["image"].values.is_cuda


def _with_grid(pixels):
    """A preprocessing callable returning per-item metadata, like a model processor's image_grid_thw."""
    x = patchify(4)(pixels)
    h, w = pixels.shape[1] // 4, pixels.shape[2] // 4
    return x, {"image_grid_thw": torch.tensor([1, h, w])}


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.sampled_from([(4, 8), (8, 8), (8, 12), (12, 4)]), min_size=1, max_size=4),
       key=st.sampled_from(["digest", "provenance"]), seed=st.integers(0, 1000))
def test_per_item_metadata_travels_with_its_item(sizes, key, seed):
    rng = np.random.default_rng(seed)
    items = [image_item(torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8))) for h, w in sizes]
    trajs = [_traj(i, f"g{i}", [it]) for i, it in enumerate(items)] + [_traj(99, "g0", [items[0]])]
    random.Random(seed).shuffle(trajs)
    batch = MultimodalCollator({"image": _with_grid}, key=key)([trajs[: len(trajs) // 2], trajs[len(trajs) // 2 :]])
    table = batch.tables["image"]
    grid = table.meta["image_grid_thw"]
    assert grid.shape == (table.num_items, 3)
    assert torch.equal(grid.prod(-1), table.lengths)  # each item's metadata sits in its own row
    sub = table.gather(torch.arange(table.num_items).flip(0))
    assert torch.equal(sub.meta["image_grid_thw"], grid.flip(0))
    assert torch.equal(table.slice(0, 1).meta["image_grid_thw"], grid[:1])
    assert torch.equal(batch.to("cpu").tables["image"].meta["image_grid_thw"], grid)
    assert table.nbytes >= grid.numel() * 8


def test_metadata_must_agree_among_items_of_a_kind():
    calls = iter([{"a": torch.tensor([1])}, {"b": torch.tensor([1])}])

    def pre(pixels):
        return patchify(4)(pixels), next(calls)

    items = [image_item(torch.full((3, 8, 8), v, dtype=torch.uint8)) for v in (0, 9)]
    with pytest.raises(MediaError, match="metadata"):
        MultimodalCollator({"image": pre})([[_traj(0, "g0", [items[0]]), _traj(1, "g1", [items[1]])]])
    with pytest.raises(MediaError, match="must be a tensor"):
        MediaProcessor({"image": lambda p: (patchify(4)(p), {"x": 3})}).process(items[0])
    with pytest.raises(MediaError, match="tuple of 3"):
        MediaProcessor({"image": lambda p: (patchify(4)(p), {}, 1)}).process(items[0])


# ---------------------------------------------------------------- tables built in place; agent episodes by digest
def _shot(seed: int, side: int = 16) -> MediaItem:
    g = torch.Generator().manual_seed(seed)
    return MediaItem("image", tensor=torch.randint(0, 256, (3, side, side), dtype=torch.uint8, generator=g))


def _plain(fn):
    """``fn`` without ``accepts_out``: what a model's own processor is (writes fresh memory)."""
    return lambda pixels: fn(pixels)


@settings(max_examples=30, deadline=None)
@given(picks=st.lists(st.tuples(st.integers(0, 5), st.sampled_from([8, 12, 16])), min_size=1, max_size=12),
       k=st.integers(1, 3), sized=st.booleans(), writes=st.booleans())
def test_tables_packed_in_place_equal_the_concatenated_items(picks, k, sized, writes):
    pool = {(s, side): _shot(s, side) for s, side in picks}
    trajs = [_traj(i, f"g{i}", [pool[p] for p in picks[i : i + 2]]) for i in range(len(picks))]
    mbs = [trajs[j::k] for j in range(k)]
    fn = patchify(4, size=(8, 8) if sized else None)
    batch = MultimodalCollator({"image": fn if writes else _plain(fn)})(mbs)
    table, stats = batch.tables["image"], batch.pack_stats
    assert table.num_items == len(pool) == stats["processed_items"]  # each distinct item processed once
    for i, mb in enumerate(mbs):
        occ = batch.for_microbatch(i).get("image")
        assert (occ is None) == (not mb)
        for u, j, n in [] if occ is None else zip(occ.index.tolist(), occ.trajectory.tolist(), occ.item.tolist()):
            assert torch.equal(table.item(u), fn(mb[j].media[n].tensor))
    assert stats["table_bytes"] == table.values.numel() * 4
    if writes and (sized or len(pool) == 1):  # every item written straight into the preallocated table
        assert stats["copied_bytes"] == 0 and stats["placed_bytes"] == stats["table_bytes"]
    if not writes:
        assert stats["placed_bytes"] == 0
        assert stats["copied_bytes"] == (stats["table_bytes"] if len(pool) > 1 else 0)


def test_in_place_packing_removes_the_table_copy():
    """The bytes copied into the table after preprocessing: every item's before, none now (patchify writes there)."""
    shots = [_shot(s, 32) for s in range(6)]
    mbs = [[_traj(g * 4 + j, f"g{g}", shots[: 3 + g]) for j in range(4)] for g in range(3)]
    fn = patchify(8, size=(32, 32))
    new = MultimodalCollator({"image": fn})(mbs)
    old = MultimodalCollator({"image": _plain(fn)})(mbs)
    assert torch.equal(new.tables["image"].values, old.tables["image"].values)
    assert new.tables["image"].num_items == 5
    assert old.pack_stats["copied_bytes"] == old.pack_stats["table_bytes"] == 5 * 16 * 192 * 4
    assert new.pack_stats["copied_bytes"] == 0 and new.pack_stats["placed_bytes"] == new.pack_stats["table_bytes"]


def test_agent_episodes_diverging_after_the_first_screenshot_need_digest_keys():
    """Per-turn samples of 2 sibling episodes: same first screenshot (same env reset), different later ones.

    Digest keys give each occurrence its own screenshot's row (5 distinct of 10 occurrences); provenance keys, which
    would give sibling 1's second screenshot sibling 0's row, refuse the group, naming it and the index."""
    first, a1, a2, b1, b2 = (_shot(s) for s in range(5))
    turns = {0: [[first], [first, a1], [first, a1, a2]], 1: [[first], [first, b1], [first, b1, b2]]}
    trajs = [_traj(10 * e + k, "task", media) for e, ts in turns.items() for k, media in enumerate(ts)]
    mbs = [trajs[:3], trajs[3:]]
    fn = patchify(4, size=(16, 16))
    batch = MultimodalCollator({"image": fn}, key="digest")(mbs)
    table = batch.tables["image"]
    assert table.num_items == 5 and batch.num_occurrences == 12
    assert set(table.keys) == {f"image:0:{m.digest}" for m in (first, a1, a2, b1, b2)}
    for i, mb in enumerate(mbs):
        occ = batch.for_microbatch(i)["image"]
        for u, j, n in zip(occ.index.tolist(), occ.trajectory.tolist(), occ.item.tolist()):
            assert torch.equal(table.item(u), fn(mb[j].media[n].tensor))
    with pytest.raises(MediaError, match="group 'task' carries different media under index 1") as e:
        MultimodalCollator({"image": fn}, key="provenance")(mbs)
    assert e.value.trajectory_id == "t11"
