"""Tests for knitdata.storage.spill: bounded random-access spill store in tar shards, rotation, recovery, threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from _shards_helpers import make_traj, trajectories  # noqa: E402

from knitdata.errors import CodecError, ConfigError, StoreFull, ValidationError  # noqa: E402
from knitdata.shards import read_shards  # noqa: E402
from knitdata.storage.spill import SpillStore, recover  # noqa: E402


def _disk(d) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".tar"))


def _shard_files(d) -> list[str]:
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".tar"))


def test_put_get_release(tmp_path):
    trajs = [make_traj(i, extra=1000) for i in range(6)]
    with SpillStore(tmp_path, max_bytes=10**7) as s:
        sizes = [s.put(t) for t in trajs]
        assert len(s) == 6 and "traj-00003" in s and "nope" not in s
        assert s.used_bytes == _disk(tmp_path) == sum(sizes)
        for t in reversed(trajs):
            assert s.get(t.id).equals(t)
        # random access: a get reads only that sample's bytes, not the shard
        before = s.stats["get_bytes"]
        s.get(trajs[2].id)
        assert s.stats["get_bytes"] - before < sizes[2] <= s.used_bytes / 3
        with pytest.raises(ValidationError, match="traj-00001"):
            s.put(trajs[1])
        assert s.pop(trajs[0].id).equals(trajs[0]) and trajs[0].id not in s
        assert s.release(trajs[1].id) is True and s.release(trajs[1].id) is False
        with pytest.raises(KeyError, match="traj-00001"):
            s.get(trajs[1].id)
        with pytest.raises(KeyError):
            s.delete(trajs[1].id)
        s.delete(trajs[2].id)
        assert len(s) == 3 and s.ids() == [t.id for t in trajs[3:]]
        # the shard is a webdataset shard like any other: read it with read_shards and tar
        s.flush()
        (path,) = _shard_files(tmp_path)
        res = subprocess.run(["tar", "tf", path], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0 and res.stdout.count(".json") == 6
        assert [t.id for t in read_shards(path)] == [t.id for t in trajs]
        exported = s.export(str(tmp_path / "exp" / "e-%03d.tar"))
        assert [t.id for t in read_shards(exported)] == [t.id for t in trajs[3:]]
    with pytest.raises(ConfigError, match="SpillStore.open"):
        SpillStore(tmp_path, max_bytes=10**7)


def test_max_bytes_and_nothing_lost(tmp_path):
    trajs = [make_traj(i, extra=20_000, media=False) for i in range(10)]
    one = SpillStore(tmp_path / "probe", max_bytes=10**8)
    size = one.put(trajs[0])
    one.close()
    s = SpillStore(tmp_path / "s", max_bytes=4 * size + 2048, shard_maxsize=10**9)
    accepted = []
    with pytest.raises(StoreFull, match="release trajectories or raise max_bytes"):
        for t in trajs:
            s.put(t)
            accepted.append(t)
    assert len(accepted) == 4 and s.used_bytes <= s.max_bytes
    assert all(s.get(t.id).equals(t) for t in accepted)  # a refused put loses nothing accepted
    assert trajs[4].id not in s and s.used_bytes == _disk(tmp_path / "s")
    for t in accepted:
        s.release(t.id)
    assert s.used_bytes == 0 and _shard_files(tmp_path / "s") == []  # all released: the shard is gone
    s.put(trajs[4])
    assert s.get(trajs[4].id).equals(trajs[4])


def test_rotation_keeps_disk_bounded(tmp_path):
    trajs = [make_traj(i, extra=2000, media=False) for i in range(8)]
    s = SpillStore(tmp_path, max_bytes=200_000, shard_maxsize=30_000)
    peak_files = 0
    live: list[str] = []
    for rnd in range(25):  # a sliding window: far more bytes pass through than max_bytes
        for t in trajs[:3]:
            t2 = make_traj(0, extra=2000, media=False)
            t2.id = f"r{rnd}-{t.id}"
            s.put(t2)
            live.append(t2.id)
        while len(live) > 4:
            s.release(live.pop(0))
        peak_files = max(peak_files, len(_shard_files(tmp_path)))
        assert s.used_bytes == _disk(tmp_path) <= s.max_bytes
    assert s.stats["shards_deleted"] > 5 and peak_files <= 4
    assert sorted(s.ids()) == sorted(live)


def test_recover_after_crash(tmp_path):
    trajs = [make_traj(i, extra=500) for i in range(12)]
    s = SpillStore(tmp_path, max_bytes=10**8, shard_maxsize=40_000)
    for t in trajs:
        s.put(t)
    for t in trajs[::4]:
        s.release(t.id)
    assert s.num_shards > 2
    # the process "dies" here: no close, no flush
    r = recover(tmp_path, max_bytes=10**8)
    want = [t for i, t in enumerate(trajs) if i % 4]
    assert r.ids() == [t.id for t in want]
    assert all(r.get(t.id).equals(t) for t in want)
    assert r.used_bytes == _disk(tmp_path)
    # the recovered store keeps working, and a second recovery sees the same state
    extra = make_traj(99)
    r.put(extra)
    r.release(want[0].id)
    r.close()
    r2 = SpillStore.open(tmp_path, verify=False)
    assert r2.ids() == [t.id for t in want[1:]] + [extra.id]
    assert r2.get(extra.id).equals(extra)


def test_recover_torn_write(tmp_path):
    trajs = [make_traj(i, extra=3000) for i in range(4)]
    s = SpillStore(tmp_path, max_bytes=10**8)
    for t in trajs:
        s.put(t)
    s.close()
    (path,) = _shard_files(tmp_path)
    with tarfile.open(path) as tf:
        big = next(m for m in tf.getmembers() if m.name == "traj-00003.t_big.npy")
    with open(path, "r+b") as f:  # crash in the middle of the last put
        f.truncate(big.offset_data + 100)
    with pytest.warns(RuntimeWarning, match="traj-00003|truncated"):
        r = SpillStore.open(tmp_path)
    assert r.ids() == [t.id for t in trajs[:3]]
    assert all(r.get(t.id).equals(t) for t in trajs[:3])
    res = subprocess.run(["tar", "tf", path], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr  # repaired: a clean tar again
    assert r.used_bytes == _disk(tmp_path)


def test_corruption_detected(tmp_path):
    t = make_traj(1, extra=1000)
    s = SpillStore(tmp_path, max_bytes=10**7)
    s.put(t)
    (path,) = _shard_files(tmp_path)
    with tarfile.open(path) as tf:
        m = next(m for m in tf.getmembers() if m.name.endswith("t_big.npy"))
    with open(path, "r+b") as f:
        f.seek(m.offset_data + m.size - 1)
        f.write(b"\x7f")
    with pytest.raises(CodecError, match="CRC32"):
        s.get(t.id)
    with pytest.warns(RuntimeWarning, match="CRC32"):
        assert len(SpillStore.open(tmp_path)) == 0


def test_threads(tmp_path):
    s = SpillStore(tmp_path, max_bytes=10**8, shard_maxsize=50_000)
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            for i in range(15):
                t = make_traj(i, media=(i % 3 == 0), extra=200)
                t.id = f"w{w}-{i}"
                s.put(t)
                back = s.get(t.id)
                assert back.equals(t)
                if i % 2:
                    s.release(t.id)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not errors, errors
    assert len(s) == 4 * 8 and s.used_bytes == _disk(tmp_path)
    r = SpillStore.open(tmp_path)
    assert sorted(r.ids()) == sorted(s.ids())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(trajs=st.lists(trajectories(), min_size=1, max_size=4, unique_by=lambda t: t.id), shard=st.integers(1, 5000))
def test_hypothesis_spill_roundtrip(trajs, shard):
    with tempfile.TemporaryDirectory() as d:
        s = SpillStore(d, max_bytes=10**8, shard_maxsize=shard)
        for t in trajs:
            s.put(t)
        assert all(s.get(t.id).equals(t) for t in trajs)
        s.release(trajs[0].id)
        assert s.used_bytes == _disk(d)
        r = SpillStore.open(d)
        assert r.ids() == [t.id for t in trajs[1:]]
        assert all(r.get(t.id).equals(t) for t in trajs[1:])
        s.close()
        r.close()


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError):
        SpillStore(tmp_path, max_bytes=0)
    with pytest.raises(ConfigError):
        SpillStore.open(tmp_path / "missing")
    s = SpillStore(tmp_path, max_bytes=10**6, fsync=True)
    t = make_traj(0, media=False)
    s.put(t)
    s.close()
    with pytest.raises(ValidationError, match="closed"):
        s.get(t.id)
    assert json.dumps(s.stats)


# ------------------------------------------------------------------------------------ structure fuzz


def _crafted_shard(directory: str, t, edit=None, *, key: str | None = None) -> None:
    """Write spill-000000.tar holding ``t`` with its JSON header edited, re-framed with valid CRC32s and tar headers."""
    import io
    import zlib

    from knitdata.shards import encode_sample

    sample = encode_sample(t)
    members = [(suffix, b"".join(bytes(b) for b in bufs)) for suffix, bufs, _n in sample.members]
    header = json.loads(members[0][1])
    header.pop("json_crc32")
    if edit is not None:
        header = edit(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    body = body[:-1] + b',"json_crc32":%d}' % zlib.crc32(body[:-1]) if isinstance(header, dict) else body
    members[0] = ("json", body)
    with tarfile.open(os.path.join(directory, "spill-000000.tar"), "w", format=tarfile.USTAR_FORMAT) as tf:
        for suffix, data in members:
            ti = tarfile.TarInfo(f"{key or t.id}.{suffix}")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def _open_and_get_outcome(directory: str, verify: bool) -> str:
    """Recover the store and read everything back: ``"ok"``/``"knitdata"``, or what else escaped."""
    import warnings

    from knitdata.errors import KnitdataError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            store = SpillStore.open(directory, verify=verify)
    except KnitdataError:
        return "knitdata"
    except Exception as e:  # noqa: BLE001 - the fuzz reports anything else
        return f"open: {type(e).__name__}: {e}"
    try:
        for tid in store.ids():
            try:
                traj = store.get(tid)
            except KnitdataError:
                continue
            except Exception as e:  # noqa: BLE001
                return f"get: {type(e).__name__}: {e}"
            try:
                traj.validate()
            except Exception as e:  # noqa: BLE001
                return f"get returned an invalid trajectory: {type(e).__name__}: {e}"
        return "ok"
    finally:
        store.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.integers(0, 50), st.data(), st.booleans())
def test_structure_fuzz_spill_recovery_only_raises_knitdata_errors(i: int, data, verify: bool) -> None:
    from _fuzz_helpers import mutate

    t = make_traj(i, media=i % 3 == 0)
    mutations: list[str] = []

    def edit(h):
        m, how = mutate(data, h)
        mutations.extend(how)
        return m

    with tempfile.TemporaryDirectory() as d:
        _crafted_shard(d, t, edit)
        outcome = _open_and_get_outcome(d, verify)
    assert outcome in ("ok", "knitdata"), (mutations, outcome)


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: {**h, "members": [1, 2]},
        lambda h: {**h, "members": "x"},
        lambda h: {**h, "members": {k: [v[0]] for k, v in h["members"].items()}},
        lambda h: {**h, "members": {k: [str(v[0]), v[1]] for k, v in h["members"].items()}},
        lambda h: {**h, "source": None},
        lambda h: {**h, "scalars": [["a", 1]]},
        lambda h: {**h, "gen_version": 7},
        lambda h: [h],
        lambda h: "x",
    ],
)
@pytest.mark.parametrize("verify", [True, False])
def test_crafted_spill_headers_are_skipped_or_refused(tmp_path, edit, verify) -> None:
    _crafted_shard(str(tmp_path), make_traj(1), edit)
    assert _open_and_get_outcome(str(tmp_path), verify) in ("ok", "knitdata")


@pytest.mark.parametrize("line", ["\u00b2 0 traj-00001", "0 \u0661 traj-00001", "x", "0 0", "-1 -1 a", "0 99999999999999999999999 a"])
def test_crafted_release_log_lines_are_ignored(tmp_path, line) -> None:
    t = make_traj(1)
    _crafted_shard(str(tmp_path), t)
    with open(os.path.join(tmp_path, "released.log"), "w", encoding="utf-8") as f:
        f.write(line + "\n")
    with SpillStore.open(tmp_path) as s:
        assert s.get(t.id).equals(t)
