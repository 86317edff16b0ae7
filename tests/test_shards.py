"""Tests for knitdata.shards: webdataset tar export, read back, truncation, security, ShardDataset."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from _shards_helpers import flac_bytes, golden_trajectories, jpg_bytes, make_traj, trajectories  # noqa: E402
from _state_harness import run_test_save_load_state  # noqa: E402

from knitdata.errors import CodecError, ConfigError, FieldTypeError, StateError, ValidationError  # noqa: E402
from knitdata.record import MediaItem, Trajectory  # noqa: E402
from knitdata.shards import (  # noqa: E402
    ShardDataset,
    count_samples,
    decode_sample,
    encode_sample,
    read_admitted_batches,
    read_shards,
    write_admitted_batches,
    write_shards,
)


def _tar_tf(path: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tar", "tf", path], capture_output=True, text=True, timeout=30)


def _same(a: list[Trajectory], b: list[Trajectory]) -> bool:
    return len(a) == len(b) and all(x.equals(y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------- format

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "shard-v1-000000.tar")


def test_shards_written_by_the_single_module_version_still_load() -> None:
    """tests/data/shard-v1-000000.tar was written by ``shards.py`` before it became a package: it still loads,
    and today's writer produces the same bytes (the on-disk format did not move)."""
    got = list(read_shards(GOLDEN))
    want = golden_trajectories()
    assert _same(got, want)
    assert [t.tensors["logp"].dtype for t in got] == [torch.bfloat16] * 3
    assert list(ShardDataset(GOLDEN)) and all(a.equals(b) for a, b in zip(ShardDataset(GOLDEN), want))


def test_todays_writer_writes_the_same_bytes_as_version_1(tmp_path) -> None:
    paths = write_shards(golden_trajectories(), str(tmp_path / "g-%06d.tar"), mtime=0.0)
    with open(paths[0], "rb") as a, open(GOLDEN, "rb") as b:
        assert a.read() == b.read()



def test_roundtrip_and_standard_tools(tmp_path):
    trajs = [make_traj(i) for i in range(5)]
    paths = write_shards(trajs, str(tmp_path / "out" / "s-%04d.tar"), maxcount=2)
    assert [os.path.basename(p) for p in paths] == ["s-0000.tar", "s-0001.tar", "s-0002.tar"]
    assert _same(list(read_shards(paths)), trajs)
    assert _same(list(read_shards(str(tmp_path / "out" / "s-{0000..0002}.tar"))), trajs)

    res = _tar_tf(paths[0])
    assert res.returncode == 0, res.stderr
    names = res.stdout.split()
    assert names[:9] == [
        "traj-00000.json",
        "traj-00000.loss_mask.npy",
        "traj-00000.m0.png",
        "traj-00000.m1.npy",
        "traj-00000.m2.wav",
        "traj-00000.prompt_ids.npy",
        "traj-00000.response_ids.npy",
        "traj-00000.t1.npy",  # "values.v2/x" is not a safe member name: mapped, recorded in the json
        "traj-00000.t_logp.npy",
    ]
    assert names[9] == "traj-00000.token_versions.npy" and len(names) == 20
    with tarfile.open(paths[0]) as tf:
        header = json.loads(tf.extractfile("traj-00000.json").read())
        assert header["id"] == "traj-00000" and header["format"] == "knitdata.shard"
        assert {t["name"]: (t["member"], t["dtype"]) for t in header["tensors"]} == {
            "logp": ("t_logp.npy", "bfloat16"),
            "values.v2/x": ("t1.npy", "float16"),
        }
        assert header["media"][2] == {
            "kind": "audio",
            "digest": trajs[0].media[2].digest,
            "sample_rate": 16000,
            "member": "m2.wav",
            "encoding": "bytes",
        }
        # every .npy opens with numpy's own loader, pickle off; bfloat16 is stored as its uint16 bits
        for m in tf.getmembers():
            if m.name.endswith(".npy"):
                arr = np.load(io.BytesIO(tf.extractfile(m).read()), allow_pickle=False)
                assert arr.dtype != object
        logp = np.load(io.BytesIO(tf.extractfile("traj-00000.t_logp.npy").read()), allow_pickle=False)
        assert logp.dtype == np.uint16
        assert torch.equal(torch.from_numpy(logp).view(torch.bfloat16), trajs[0].tensors["logp"])
    # webdataset itself groups the members into one sample per trajectory
    import webdataset as wds

    samples = list(wds.WebDataset(paths, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in samples] == [t.id for t in trajs]


def test_media_extensions_by_magic(tmp_path):
    t = make_traj(0, media=False)
    t.media = [
        MediaItem("image", data=jpg_bytes()),
        MediaItem("audio", data=flac_bytes(), sample_rate=16000),
        MediaItem("image", data=b"not an image"),
    ]
    t.validate()
    members = [m[0] for m in encode_sample(t).members]
    assert {"m0.jpg", "m1.flac", "m2.bin"} <= set(members)
    (back,) = read_shards(write_shards([t], str(tmp_path / "m-%02d.tar")))
    assert back.equals(t)


def test_empty_and_config_errors(tmp_path):
    assert write_shards([], str(tmp_path / "e-%02d.tar")) == []
    assert os.listdir(tmp_path) == []
    with pytest.raises(ConfigError, match="printf"):
        write_shards([make_traj(0)], str(tmp_path / "noformat.tar"))
    with pytest.raises(ConfigError):
        list(read_shards(str(tmp_path / "x.tar"), on_error="ignore"))


def test_unsafe_key_is_refused(tmp_path):
    t = make_traj(1)
    t.id = "bad.id"  # bypass construction-time validation: the writer checks again
    with pytest.raises(ValidationError, match="bad.id"):
        write_shards([t], str(tmp_path / "k-%02d.tar"))
    t.id = "a/b"
    with pytest.raises(ValidationError, match="a/b"):
        encode_sample(t)
    with pytest.raises(ValidationError, match="twice"):
        write_shards([make_traj(2), make_traj(2)], str(tmp_path / "dup-%02d.tar"))


def test_unsupported_dtype_names_field(tmp_path):
    t = make_traj(2, media=False)
    t.tensors["c"] = torch.zeros(2, dtype=torch.complex64)
    with pytest.raises(FieldTypeError, match="tensors.c"):
        write_shards([t], str(tmp_path / "d-%02d.tar"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    trajs=__import__("hypothesis").strategies.lists(trajectories(), min_size=1, max_size=3, unique_by=lambda t: t.id)
)
def test_hypothesis_roundtrip(trajs):
    with tempfile.TemporaryDirectory() as d:
        paths = write_shards(trajs, os.path.join(d, "h-%03d.tar"), maxcount=2)
        back = list(read_shards(paths))
        assert _same(back, trajs)
        assert sum(count_samples(p) for p in paths) == len(trajs)


# ------------------------------------------------------------------------------------------- damage


def _members(path: str) -> list[tarfile.TarInfo]:
    with tarfile.open(path) as tf:
        return tf.getmembers()


def _truncate_in(path: str, member_name: str) -> None:
    m = next(m for m in _members(path) if m.name == member_name)
    assert m.size > 10
    with open(path, "r+b") as f:
        f.truncate(m.offset_data + m.size // 2)


@pytest.fixture
def two_shards(tmp_path):
    trajs = [make_traj(i, extra=256) for i in range(8)]
    paths = write_shards(trajs, str(tmp_path / "t-%02d.tar"), maxcount=4)
    assert len(paths) == 2
    return trajs, paths


def test_truncated_last_member(two_shards):
    trajs, paths = two_shards
    last = _members(paths[1])[-1].name
    assert last == "traj-00007.token_versions.npy"
    _truncate_in(paths[1], last)
    assert _tar_tf(paths[0]).returncode == 0 and _tar_tf(paths[0]).stdout.count(".json") == 4
    assert _tar_tf(paths[1]).returncode != 0  # standard tools see the damage too
    with pytest.raises(CodecError) as ei:
        list(read_shards(paths))
    assert paths[1] in str(ei.value) and "traj-00007" in str(ei.value)
    with pytest.warns(RuntimeWarning, match="traj-00007"):
        back = list(read_shards(paths, on_error="skip"))
    assert _same(back, trajs[:7])
    errors = []
    assert _same(list(read_shards(paths, on_error=errors.append)), trajs[:7]) and len(errors) == 1


def test_truncated_middle_member(two_shards):
    trajs, paths = two_shards
    _truncate_in(paths[0], "traj-00001.t_big.npy")
    with pytest.raises(CodecError) as ei:
        list(read_shards(paths))
    assert paths[0] in str(ei.value) and "traj-00001" in str(ei.value)
    with pytest.warns(RuntimeWarning):
        back = list(read_shards(paths, on_error="skip"))
    # sample 0 before the cut and the whole second shard survive
    assert _same(back, [trajs[0], *trajs[4:]])


def test_truncated_between_members_is_detected(two_shards):
    trajs, paths = two_shards
    # cut exactly at a member boundary inside the last sample: tar sees a clean end, the manifest does not
    m = next(m for m in _members(paths[1]) if m.name == "traj-00007.response_ids.npy")
    with open(paths[1], "r+b") as f:
        f.truncate(m.offset)
    with pytest.raises(CodecError, match="incomplete sample"):
        list(read_shards(paths[1]))
    with pytest.warns(RuntimeWarning):
        assert _same(list(read_shards(paths[1], on_error="skip")), trajs[4:7])


def test_corrupted_byte_fails_crc(two_shards):
    trajs, paths = two_shards
    m = next(m for m in _members(paths[0]) if m.name == "traj-00002.t_big.npy")
    with open(paths[0], "r+b") as f:
        f.seek(m.offset_data + m.size - 3)
        b = f.read(1)
        f.seek(m.offset_data + m.size - 3)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CodecError, match="CRC32"):
        list(read_shards(paths[0]))
    with pytest.warns(RuntimeWarning):
        assert _same(list(read_shards(paths[0], on_error="skip")), [trajs[0], trajs[1], trajs[3]])
    # the JSON header is covered too: change a scalar's digit
    m = next(m for m in _members(paths[0]) if m.name == "traj-00001.json")
    with open(paths[0], "r+b") as f:
        f.seek(m.offset_data)
        raw = f.read(m.size)
        i = raw.index(b'"advantage":-0.125') + len(b'"advantage":-0.12')
        f.seek(m.offset_data + i)
        f.write(b"6")
    with pytest.raises(CodecError, match="JSON header fails its CRC32"):
        list(read_shards(paths[0]))


# ------------------------------------------------------------------------------------------- security


def _write_raw_tar(path: str, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


class _Boom:
    """Unpickling this creates a directory: proof that code ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _forge_header(members: dict[str, bytes], key: str, edit) -> None:
    """Edit a sample's JSON header the way an attacker would: drop every checksum, then change it."""
    header = json.loads(members[f"{key}.json"])
    header.pop("json_crc32")
    header["members"] = {m: [spec[0], None] for m, spec in header["members"].items()}
    edit(header)
    members[f"{key}.json"] = json.dumps(header).encode()


def _sample_members(t: Trajectory) -> list[tuple[str, bytes]]:
    s = encode_sample(t).as_dict()
    key = s.pop("__key__")
    return [(f"{key}.{k}", bytes(v)) for k, v in sorted(s.items())]


def test_pickle_members_never_loaded(tmp_path):
    marker = str(tmp_path / "pwned")
    evil = pickle.dumps(_Boom(marker))
    t = make_traj(3, media=False)
    members = _sample_members(t)
    members[1:1] = [(f"{t.id}.evil.pyd", evil), (f"{t.id}.evil.pth", evil)]  # inside the sample
    path = str(tmp_path / "evil.tar")
    _write_raw_tar(path, members)
    (back,) = read_shards(path)
    assert back.equals(t) and not os.path.exists(marker)
    ds = ShardDataset(path)
    assert [x.id for x in ds] == [t.id] and not os.path.exists(marker)


def test_object_npy_refused(tmp_path):
    marker = str(tmp_path / "pwned2")
    t = make_traj(4, media=False)
    members = dict(_sample_members(t))
    buf = io.BytesIO()
    np.save(buf, np.array([_Boom(marker)] * 3, dtype=object), allow_pickle=True)
    name = f"{t.id}.t_logp.npy"
    members[name] = buf.getvalue()
    _forge_header(members, t.id, lambda h: h["members"].update({"t_logp.npy": [len(buf.getvalue()), None]}))
    path = str(tmp_path / "obj.tar")
    _write_raw_tar(path, sorted(members.items()))
    with pytest.raises(CodecError, match="Python objects"):
        list(read_shards(path))
    assert not os.path.exists(marker)


def test_oversized_declared_sizes_refused(tmp_path):
    t = make_traj(5, media=False)
    members = dict(_sample_members(t))
    # a .npy whose header declares 10**12 elements but holds a few bytes
    fake = bytearray(members[f"{t.id}.prompt_ids.npy"])
    hdr = fake[: fake.index(b"\n") + 1].decode("latin1")
    new_hdr = hdr.replace(str(tuple(t.prompt_ids.shape)), "(1000000000000,)")
    body = new_hdr[10:].rstrip("\n").rstrip(" ")
    body = body + " " * (-(10 + len(body) + 1) % 64) + "\n"
    npy = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1") + bytes(fake[len(hdr) :])
    members[f"{t.id}.prompt_ids.npy"] = npy

    def edit(h):
        h["members"]["prompt_ids.npy"] = [len(npy), None]
        h["fields"][0]["shape"] = [10**12]

    _forge_header(members, t.id, edit)
    path = str(tmp_path / "big.tar")
    _write_raw_tar(path, sorted(members.items()))
    with pytest.raises(CodecError, match="declares"):
        list(read_shards(path))
    # a tar member declaring more bytes than allowed is refused before it is read
    good = write_shards([t], str(tmp_path / "g-%02d.tar"))
    with pytest.raises(CodecError, match="over the limit"):
        list(read_shards(good, max_member_bytes=100))


# ------------------------------------------------------------------------------------------- replay


@dataclass(frozen=True)
class _Meta:
    id: str


@dataclass(frozen=True)
class _MiniBatch:
    train_batch: int
    index: int
    step: int
    trajectories: tuple


def test_admitted_batches_replay(tmp_path):
    trajs = {t.id: t for t in (make_traj(i, media=False) for i in range(12))}
    order = list(trajs)[::-1]
    batches = [
        _MiniBatch(b, k, b * 2 + k, tuple(_Meta(i) for i in order[(b * 2 + k) * 3 : (b * 2 + k) * 3 + 3]))
        for b in range(2)
        for k in range(2)
    ]
    paths = write_admitted_batches(batches, str(tmp_path / "r-%02d.tar"), fetch=trajs, maxcount=5)
    assert len(paths) == 3
    replay = list(read_admitted_batches(paths))
    assert [(i.train_batch, i.minibatch, i.step, i.size) for i, _ in replay] == [
        (0, 0, 0, 3),
        (0, 1, 1, 3),
        (1, 0, 2, 3),
        (1, 1, 3, 3),
    ]
    assert [t.id for _, ts in replay for t in ts] == order
    assert all(t.equals(trajs[t.id]) for _, ts in replay for t in ts)
    with pytest.raises(ConfigError, match="fetch"):
        write_admitted_batches(batches, str(tmp_path / "x-%02d.tar"))
    # mini-batches may carry the trajectories themselves
    paths2 = write_admitted_batches(
        [_MiniBatch(0, 0, 0, tuple(trajs[i] for i in order[:2]))], str(tmp_path / "y-%02d.tar")
    )
    ((info, ts),) = read_admitted_batches(paths2)
    assert info.step == 0 and [t.id for t in ts] == order[:2]


# ------------------------------------------------------------------------------------------- dataset


@pytest.fixture(scope="module")
def ten(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds")
    trajs = [make_traj(i, media=False, tokens=4) for i in range(10)]
    paths = write_shards(trajs, str(d / "d-%02d.tar"), maxcount=4)  # 4 + 4 + 2
    return [t.id for t in trajs], paths


def test_dataset_rank_split(ten):
    ids, paths = ten
    per = [[t.id for t in ShardDataset(paths, rank=r, world_size=3)] for r in range(3)]
    assert per == [ids[0:3], ids[3:6], ids[6:9]]  # drop: 3 each, sample 9 not read
    pad = [[t.id for t in ShardDataset(paths, rank=r, world_size=3, uneven="pad")] for r in range(3)]
    assert pad == [ids[0:4], ids[4:8], [ids[8], ids[9], ids[0], ids[1]]]
    assert len(ShardDataset(paths, rank=0, world_size=4, uneven="pad")) == 3
    with pytest.raises(ConfigError, match="evenly"):
        len(ShardDataset(paths, world_size=3, uneven="strict"))
    with pytest.raises(ConfigError):
        ShardDataset(paths, rank=3, world_size=3)
    assert [t.id for t in ShardDataset(paths, rank=1, world_size=2, uneven="strict")] == ids[5:]
    # transform and explicit counts (no header scan)
    ds = ShardDataset(paths, world_size=1, transform=lambda t: t.num_tokens, sample_counts=[4, 4, 2])
    assert len(list(ds)) == 10


def test_dataset_workers_no_duplicates(ten):
    ids, paths = ten
    for rank in range(2):
        ds = ShardDataset(paths, rank=rank, world_size=2)
        got = [t.id for t in DataLoader(ds, batch_size=None, num_workers=2)]
        assert sorted(got) == ids[rank * 5 : rank * 5 + 5]


def test_dataset_resume_exact(ten):
    ids, paths = ten
    ds = ShardDataset(paths, rank=0, world_size=1)
    it = iter(ds)
    first = [next(it).id for _ in range(6)]
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["yielded"] == 6
    ds2 = ShardDataset(paths, rank=0, world_size=1)
    ds2.load_state_dict(state)
    rest = [t.id for t in ds2]
    assert first + rest == ids
    assert ds2.state_dict()["epoch"] == 1 and ds2.state_dict()["yielded"] == 0
    assert [t.id for t in ds2] == ids  # next epoch starts over
    with pytest.raises(StateError, match="rank"):
        ShardDataset(paths, rank=1, world_size=2).load_state_dict(state)


def _save_load_at(paths: list[str], midpoint: int, *, world_size: int = 1, rank: int = 0, fresh: bool = True,
                  **kw) -> tuple[list[str], list[str], list[str]]:
    """Save after ``midpoint`` samples (``-1``: after the epoch's ``StopIteration``), load, iterate twice.

    Returns (uninterrupted epoch, first pass after the load, second pass after the load).
    """
    ds = ShardDataset(paths, rank=rank, world_size=world_size, **kw)
    it = iter(ds)
    head = [next(it).id for _ in range(max(midpoint, 0))]
    state = json.loads(json.dumps(ds.state_dict()))
    tail = [t.id for t in it]
    if midpoint < 0:
        state = json.loads(json.dumps(ds.state_dict()))
    target = ShardDataset(paths, rank=rank, world_size=world_size, **kw) if fresh else ds
    target.load_state_dict(state)
    return head + tail, [t.id for t in target], [t.id for t in target]


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "same"])
@pytest.mark.parametrize("world_size,rank,uneven", [(1, 0, "drop"), (3, 2, "pad"), (2, 1, "drop")])
def test_dataset_save_load_at_every_midpoint(ten, fresh, world_size, rank, uneven):
    ids, paths = ten
    n = len(ShardDataset(paths, rank=rank, world_size=world_size, uneven=uneven))
    for midpoint in range(n + 1):  # 0 (before any sample) ... n (after the last sample, before StopIteration)
        epoch, after, next_epoch = _save_load_at(paths, midpoint, world_size=world_size, rank=rank, fresh=fresh,
                                                 uneven=uneven)
        assert len(epoch) == n
        assert epoch[:midpoint] + after == epoch, midpoint  # exactly the rest of the epoch, in order
        assert next_epoch == epoch, midpoint  # the iteration after the resumed one is a full epoch


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "same"])
def test_dataset_end_of_epoch_state_yields_nothing_more(ten, fresh):
    ids, paths = ten
    epoch, after, next_epoch = _save_load_at(paths, -1, fresh=fresh)
    assert epoch == ids
    assert after == []  # torchdata.nodes convention: the end state, loaded without a restart, yields nothing more
    assert next_epoch == ids  # and the iteration after it starts the next epoch
    # the state saved after the empty pass is still an end state; a new epoch starts after one more pass
    ds = ShardDataset(paths)
    list(ds)
    end = ds.state_dict()
    assert end["epoch_end"] is True and end["epoch"] == 1 and end["yielded"] == 0
    ds.load_state_dict(end)
    assert list(ds) == [] and ds.state_dict() == end
    it = iter(ds)
    assert next(it).id == ids[0] and ds.state_dict()["epoch_end"] is False
    # a state without the key (older versions) resumes where it says; a contradictory one is refused
    old = {k: v for k, v in end.items() if k != "epoch_end"}
    ds.load_state_dict(old)
    assert [t.id for t in ds] == ids
    with pytest.raises(StateError, match="epoch_end"):
        ds.load_state_dict({**end, "yielded": 3})
    with pytest.raises(StateError, match="epoch_end"):
        ds.load_state_dict({**end, "epoch_end": "yes"})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from([(1, 0, "drop"), (3, 2, "pad"), (2, 1, "drop"), (3, 0, "drop")]), data=st.data())
def test_dataset_state_harness(ten, layout, data):
    """The shared save/load check (tests/_state_harness.py): midpoints of both epochs, initial and end states."""
    _ids, paths = ten
    world_size, rank, uneven = layout
    n = len(ShardDataset(paths, rank=rank, world_size=world_size, uneven=uneven))
    mids = data.draw(st.lists(st.integers(0, n), min_size=1, max_size=3, unique=True))
    ref = run_test_save_load_state(lambda: ShardDataset(paths, rank=rank, world_size=world_size, uneven=uneven),
                                   mids, key=lambda t: (t.id, t.response_ids.tolist()), epochs=2,
                                   end_of_epoch="empty")
    assert len(ref[0]) == n and ref[0] == ref[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_state_harness_in_stateful_dataloader(ten, workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    ids, paths = ten

    def loader():
        return StatefulDataLoader(ShardDataset(paths), batch_size=None, num_workers=workers, collate_fn=lambda t: t.id)

    ref = run_test_save_load_state(loader, [0, 3, 7, 10], epochs=2, reads_back=False)
    assert sorted(ref[0]) == ids and ref[1] == ref[0]


def test_dataset_resume_with_stateful_dataloader_workers(ten):
    from torchdata.stateful_dataloader import StatefulDataLoader

    ids, paths = ten

    def loader():
        return StatefulDataLoader(ShardDataset(paths), batch_size=None, num_workers=2, collate_fn=lambda t: t.id)

    dl = loader()
    it = iter(dl)
    seen = [next(it) for _ in range(5)]
    state = dl.state_dict()
    json.dumps(state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"])
    del it, dl
    dl2 = loader()
    dl2.load_state_dict(state)
    rest = list(dl2)
    assert sorted(seen + rest) == ids and len(seen + rest) == 10


def test_member_larger_than_file_refused_before_allocating(tmp_path):
    path = str(tmp_path / "liar.tar")
    ti = tarfile.TarInfo("k.json")
    ti.size = 8 * 10**9  # the header claims 8 GB, the file holds a few bytes
    with open(path, "wb") as f:
        f.write(ti.tobuf(tarfile.GNU_FORMAT) + b"{}" + bytes(510))
    with pytest.raises(CodecError, match="truncated"):
        list(read_shards(path))
    with pytest.warns(RuntimeWarning):
        assert list(read_shards(path, on_error="skip")) == []


def test_gzip_shards(tmp_path):
    trajs = [make_traj(i) for i in range(3)]
    paths = write_shards(trajs, str(tmp_path / "z-%02d.tar.gz"), maxcount=2)
    with open(paths[0], "rb") as f:
        assert f.read(2) == b"\x1f\x8b"
    assert _same(list(read_shards(paths)), trajs)
    assert [t.id for t in ShardDataset(paths, rank=1, world_size=2)] == [trajs[1].id]


# ------------------------------------------------------------------------------------ structure fuzz


def _reframe_sample(header: dict, members: dict[str, bytes]) -> dict[str, bytes]:
    """Re-frame a (mutated) JSON header with a valid json_crc32, as the writer computes it."""
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body = body[:-1] + b',"json_crc32":%d}' % zlib.crc32(body[:-1])
    return {**members, "json": body}


def _sample_outcome(key: str, members: dict[str, bytes], validate: bool) -> str:
    """``"ok"`` (a valid trajectory), ``"knitdata"`` (a KnitdataError) or the name of any other exception."""
    from knitdata.errors import KnitdataError

    try:
        traj, _h = decode_sample(key, {k: bytearray(v) for k, v in members.items()}, validate=validate)
    except KnitdataError:
        return "knitdata"
    except Exception as e:  # noqa: BLE001 - the fuzz reports anything else
        return f"{type(e).__name__}: {e}"
    try:  # what decodes (even unvalidated) must be a valid trajectory that encodes again
        traj.validate()
        encode_sample(traj)
    except Exception as e:  # noqa: BLE001
        return f"decoded an invalid trajectory: {type(e).__name__}: {e}"
    return "ok"


def _split_sample(t: Trajectory) -> tuple[dict, dict[str, bytes]]:
    s = encode_sample(t).as_dict()
    s.pop("__key__")
    members = {k: bytes(v) for k, v in s.items()}
    header = json.loads(members["json"])
    header.pop("json_crc32")
    return header, members


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(trajectories(), st.data(), st.booleans())
def test_structure_fuzz_sample_headers_only_raise_knitdata_errors(t: Trajectory, data, validate: bool) -> None:
    from _fuzz_helpers import mutate

    header, members = _split_sample(t)
    mutated, how = mutate(data, header)
    outcome = _sample_outcome(t.id, _reframe_sample(mutated, members), validate)
    assert outcome in ("ok", "knitdata"), (how, outcome)


#: Crafted sample-header changes found by the structure fuzz (path, value); each must raise a KnitdataError.
SAMPLE_CRAFTED = [
    (("members",), [1, 2]),
    (("members",), "x"),
    (("fields",), {"a": 1}),
    (("fields", 0), "prompt_ids"),
    (("fields", 0, "shape"), [True]),
    (("fields", 0, "shape"), [0, 2**40, 2**40]),
    (("fields", 0, "dtype"), ["int64"]),
    (("fields", 1, "name"), ["response_ids"]),
    (("tensors",), "ab"),
    (("scalars",), [["a", 1]]),
    (("scalars",), "xy"),
    (("scalars", "reward"), None),
    (("scalars", "reward"), 10**400),
    (("gen_version",), 1.5),
    (("gen_version",), True),
    (("source",), 3),
    (("media", 0, "digest"), [1]),
    (("media", 0, "sample_rate"), True),
    (("media", 0, "kind"), {"a": 1}),
    (("media", 0, "member"), ["m0.png"]),
    (("media", 0, "encoding"), None),
    (("media", 0), None),
    (("media",), {"0": 1}),
]


@pytest.mark.parametrize(("path", "value"), SAMPLE_CRAFTED, ids=[".".join(map(str, p)) + f"={v!r:.15}" for p, v in SAMPLE_CRAFTED])
@pytest.mark.parametrize("validate", [True, False])
def test_crafted_sample_headers_raise_knitdata_errors(path, value, validate) -> None:
    from knitdata.errors import KnitdataError

    t = make_traj(5)
    t.scalars["reward"] = 1.0
    header, members = _split_sample(t)
    obj = header
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value
    with pytest.raises(KnitdataError):
        decode_sample(t.id, {k: bytearray(v) for k, v in _reframe_sample(header, members).items()}, validate=validate)


def test_reframed_unchanged_sample_header_decodes() -> None:
    t = make_traj(6)
    header, members = _split_sample(t)
    back, _h = decode_sample(t.id, _reframe_sample(header, members))
    assert back.equals(t)


_NPY_WEIRD = st.one_of(
    st.sampled_from(["'<i8'", "'|u1'", "'<f4'", "'|O'", "'<c8'", "'>i8'", "[('a', '<i4')]", "'V8'", "None", "1"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _NPY_WEIRD,
    st.sampled_from(["False", "True", "None", "'x'"]),
    st.lists(st.integers(-3, 2**70) | st.sampled_from([0, 1, 8, 2**62, 2**64]), max_size=70).map(tuple)
    | st.sampled_from(["(8,)", "(-1,)", "[8]", "(8.0,)", "None", "'8'", "(True,)"]),
    st.booleans(),
)
def test_structure_fuzz_npy_headers_only_raise_knitdata_errors(descr, fortran, shape, match_json) -> None:
    """Crafted .npy headers (valid member CRC32s, matching or not the JSON shape) never escape as other errors."""
    t = make_traj(7, media=False)
    header, members = _split_sample(t)
    shape_txt = shape if isinstance(shape, str) else repr(shape)
    body = f"{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape_txt}, }}".encode("latin1")
    body += b" " * (-(10 + len(body) + 1) % 64) + b"\n"
    old = members["prompt_ids.npy"]
    data = old[10 + int.from_bytes(old[8:10], "little") :]
    npy = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + data
    members["prompt_ids.npy"] = npy
    header["members"]["prompt_ids.npy"] = [len(npy), zlib.crc32(npy)]
    if match_json and isinstance(shape, tuple):
        header["fields"][0]["shape"] = list(shape)
    outcome = _sample_outcome(t.id, _reframe_sample(header, members), True)
    assert outcome in ("ok", "knitdata"), outcome


@pytest.mark.parametrize("shape", [(0, 2**40, 2**40), (0, 2**70), (1,) * 70, (0,) * 65])
def test_crafted_empty_npy_with_huge_dims_is_refused(shape) -> None:
    """Found by the structure fuzz: an empty .npy whose other dims overflow torch's stride computation."""
    t = make_traj(7, media=False)
    header, members = _split_sample(t)
    body = f"{{'descr': '<i8', 'fortran_order': False, 'shape': {shape!r}, }}".encode("latin1")
    body += b" " * (-(10 + len(body) + 1) % 64) + b"\n"
    npy = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body
    members["prompt_ids.npy"] = npy
    header["members"]["prompt_ids.npy"] = [len(npy), zlib.crc32(npy)]
    header["fields"][0].update(shape=list(shape), dtype="int64")
    with pytest.raises(CodecError):
        decode_sample(t.id, _reframe_sample(header, members))


def _replay_shard(path: str, replays: list) -> None:
    """A shard of len(replays) samples whose replay information is crafted (valid CRC32s)."""
    members = []
    for i, replay in enumerate(replays):
        t = make_traj(20 + i, media=False)
        header, raw = _split_sample(t)
        header["replay"] = replay
        framed = _reframe_sample(header, raw)
        members += [(f"{t.id}.{k}", bytes(v)) for k, v in sorted(framed.items())]
    _write_raw_tar(path, members)


_GOOD = {"train_batch": 0, "minibatch": 0, "step": 0, "position": 0, "size": 1}


@pytest.mark.parametrize(
    "bad",
    [
        {**_GOOD, "size": float("inf")},
        {**_GOOD, "size": 10**18},  # would build a list of 10**18 positions
        {**_GOOD, "position": -1},
        {**_GOOD, "position": 1},
        {**_GOOD, "step": True},
        {**_GOOD, "step": "0"},
        {**_GOOD, "minibatch": None},
        {k: v for k, v in _GOOD.items() if k != "size"},
        [0, 0, 0, 0, 1],
    ],
)
def test_crafted_replay_information_raises_codec_error(tmp_path, bad) -> None:
    path = str(tmp_path / "r.tar")
    _replay_shard(path, [bad])
    with pytest.raises(CodecError):
        list(read_admitted_batches(path))
    with pytest.warns(RuntimeWarning):
        assert list(read_admitted_batches(path, on_error="skip")) == []


def test_replay_size_larger_than_the_batch_is_incomplete(tmp_path) -> None:
    path = str(tmp_path / "r.tar")
    _replay_shard(path, [{**_GOOD, "size": 3}, {**_GOOD, "position": 1, "size": 3}])
    with pytest.raises(CodecError, match="incomplete"):
        list(read_admitted_batches(path))
    ok = str(tmp_path / "ok.tar")
    _replay_shard(ok, [{**_GOOD, "size": 2}, {**_GOOD, "position": 1, "size": 2}])
    ((info, trajs),) = list(read_admitted_batches(ok))
    assert info.size == 2 and len(trajs) == 2


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_structure_fuzz_loader_states_only_raise_state_errors(ten, data) -> None:
    from _fuzz_helpers import mutate

    _ids, paths = ten
    ds = ShardDataset(paths, rank=0, world_size=1)
    it = iter(ds)
    next(it)
    state, how = mutate(data, json.loads(json.dumps(ds.state_dict())))
    fresh = ShardDataset(paths, rank=0, world_size=1)
    try:
        fresh.load_state_dict(state)
    except StateError:
        return
    got = [t.id for t in fresh]  # an accepted state resumes cleanly
    assert len(got) <= 10, how


# torchdata's TestEndOfEpochBehavior (meta-pytorch/data, test/stateful_dataloader/test_state_dict.py) on
# ShardDataset, its 4 cases: num_workers 0 and 2, each with two batchings (torchdata's second parameter, shuffle,
# does not apply to an IterableDataset: batch_size 1 and None take its place). In each, a StatefulDataLoader state
# taken at the last item ("sd_in") yields nothing when loaded; one taken after the epoch's end ("sd_out") starts a
# full new epoch. Before ShardDataset fixed its pass when iter() is called, both num_workers=0 cases failed.
def _end_of_epoch_loader(paths: list[str], num_workers: int, batch_size: int | None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(ShardDataset(paths), batch_size=batch_size, num_workers=num_workers,
                              collate_fn=(lambda t: t.id) if batch_size is None else (lambda b: [t.id for t in b]))


def _count_items_yielded(loader, batch_size: int | None) -> list[str]:
    return [i for x in loader for i in (x if batch_size else [x])]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [1, None])
def test_torchdata_end_of_epoch_behavior(ten, num_workers, batch_size):
    ids, paths = ten
    dl = _end_of_epoch_loader(paths, num_workers, batch_size)
    num_items_yielded = 0
    sd_in = None
    for _batch in dl:
        num_items_yielded += 1
        sd_in = dl.state_dict()
    sd_out = dl.state_dict()
    assert num_items_yielded == len(ids)
    dataloader_sd_in = _end_of_epoch_loader(paths, num_workers, batch_size)
    dataloader_sd_in.load_state_dict(sd_in)
    assert _count_items_yielded(dataloader_sd_in, batch_size) == []  # saved at the last item: nothing left
    dataloader_sd_out = _end_of_epoch_loader(paths, num_workers, batch_size)
    dataloader_sd_out.load_state_dict(sd_out)
    got = _count_items_yielded(dataloader_sd_out, batch_size)  # saved after the epoch's end: a full new epoch
    assert sorted(got) == ids and len(got) == len(ids)


def test_a_broken_tar_is_reported_under_a_public_name(two_shards):
    """Issue 45.8: the error of a shard whose tar stream breaks (the rest of the shard lost) is a public, documented
    class (it was the private ``_BrokenShard`` in tracebacks and in what an on_error callable received)."""
    from knitdata.shards import BrokenShardError

    _trajs, paths = two_shards
    _truncate_in(paths[0], "traj-00001.t_big.npy")
    errors: list[Exception] = []
    list(read_shards(paths, on_error=errors.append))
    [err] = errors
    assert type(err) is BrokenShardError and isinstance(err, CodecError)
    assert not type(err).__name__.startswith("_") and "_BrokenShard" not in repr(err)
    assert type(err).__module__.startswith("knitdata.") and paths[0] in str(err)
