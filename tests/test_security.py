"""Security: no pickle on knitdata's own data, crafted inputs cannot run code, oversized lengths fail fast.

* A static check walks the AST of every module of the ``knitdata`` package and fails on any use of pickle-like
  deserializers (``pickle``, ``cloudpickle``, ``dill``, ``marshal``, ``shelve``, ``joblib``, ``torch.load`` /
  ``torch.save``, ``np.load(..., allow_pickle=True)``, ``eval``/``exec``) or of ``.pth``/``.pyd``/``.pkl``
  file names in code, outside an explicit allow-list (empty: none in our own data paths).
* Crafted records, shards, spill shards (the Ray units' write-through spill too) and loader states that would run code if they
  were unpickled are loaded: nothing runs (a marker file is never created) and each is refused with a
  knitdata error or loads as inert bytes.
* Length fields claiming terabytes are refused with :class:`CodecError` before any large allocation
  (tracked with ``tracemalloc``, and with a guard on ``bytearray`` where a reader allocates from a header).
* The Ray engine binds only where the user says: the default ``connect()`` is loopback-only with the
  dashboard off (checked on the arguments handed to ``ray.init``, without starting Ray).
"""

from __future__ import annotations

import ast
import io
import json
import pickle  # noqa: S403 - used only to craft malicious payloads that knitdata must refuse
import struct
import tarfile
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import knitdata
from knitdata import codec
from knitdata.errors import CodecError, KnitdataError, StateError
from knitdata.record import MediaItem, Trajectory

PKG = Path(knitdata.__file__).resolve().parent

# ----------------------------------------------------------------------------------- static check

_BANNED_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib", "pickletools"}
_BANNED_CALLS = {("torch", "load"), ("torch", "save"), ("torch", "jit.load")}
_BANNED_EXTS = (".pth", ".pyd", ".pkl", ".pickle", ".pt")

#: (relative path, what, enclosing function) -> why it is allowed. Keep it empty for knitdata's data paths;
#: every entry needs a one-line justification (e.g. a user's own model checkpoint, never knitdata's data).
ALLOWED: dict[tuple[str, str, str], str] = {}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _scan_source(rel: str, src: str) -> list[tuple[str, str, str, int]]:
    """Return ``(rel, what, function, line)`` for each suspicious use in one module."""
    tree = ast.parse(src)
    docs = _docstring_nodes(tree)
    found: list[tuple[str, str, str, int]] = []
    func_of: dict[int, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(fn):
                func_of[id(sub)] = fn.name
    for node in ast.walk(tree):
        where = func_of.get(id(node), "<module>")
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in _BANNED_MODULES:
                    found.append((rel, f"import {a.name}", where, line))
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in _BANNED_MODULES:
                found.append((rel, f"from {node.module} import", where, line))
            if node.module == "torch" and any(a.name in ("load", "save") for a in node.names):
                found.append((rel, "from torch import load/save", where, line))
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, tail = name.partition(".")
            if (head, tail) in _BANNED_CALLS or name in ("eval", "exec") or head in _BANNED_MODULES:
                found.append((rel, f"call {name}", where, line))
            if name.endswith(("np.load", "numpy.load", "read_array")):
                for kw in node.keywords:
                    if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                        found.append((rel, f"call {name}(allow_pickle=...)", where, line))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            low = node.value.lower()
            for ext in _BANNED_EXTS:
                i = low.find(ext)
                # a file extension: followed by end, a quote-ish boundary or a non-identifier character
                if i >= 0 and (i + len(ext) == len(low) or not low[i + len(ext)].isalnum()):
                    found.append((rel, f"string with {ext!r}: {node.value[:60]!r}", where, line))
    return found


def test_static_scan_detects_what_it_must():
    """The scanner itself: it flags each banned use (so an empty result means something)."""
    src = (
        "import pickle\nimport torch\nimport numpy as np\n"
        "def f(p):\n    torch.save({}, p)\n    x = torch.load(p)\n    y = np.load(p, allow_pickle=True)\n"
        "    eval('1')\n    return pickle.loads(b'')\n"
        "def g():\n    '''a docstring may say pickle and model.pth'''\n    return 'weights.pth'\n"
    )
    whats = [w for _r, w, _f, _l in _scan_source("x.py", src)]
    assert "import pickle" in whats
    assert "call torch.save" in whats and "call torch.load" in whats
    assert any("allow_pickle" in w for w in whats)
    assert "call eval" in whats and "call pickle.loads" in whats
    assert any(".pth" in w for w in whats) and len([w for w in whats if ".pth" in w]) == 1  # not the docstring


def test_no_pickle_like_deserializers_in_the_package():
    found = []
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 10
    for path in files:
        rel = str(path.relative_to(PKG.parent))
        for hit in _scan_source(rel, path.read_text(encoding="utf-8")):
            key = (hit[0], hit[1], hit[2])
            if key not in ALLOWED:
                found.append(hit)
    assert not found, "pickle-like (de)serialization in knitdata's own code:\n" + "\n".join(map(str, found))


def test_webdataset_writers_never_use_pickle_encoders():
    """Every ``ShardWriter``/``TarWriter`` knitdata creates passes ``encoder=False`` (no .pyd/.pth encoders)."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] in ("ShardWriter", "TarWriter"):
                enc = [k for k in node.keywords if k.arg == "encoder"]
                if not enc or not (isinstance(enc[0].value, ast.Constant) and enc[0].value.value is False):
                    bad.append(f"{path.name}:{node.lineno}")
    assert not bad, f"webdataset writers without encoder=False: {bad}"


# ----------------------------------------------------------------------------------- crafted payloads


class _Boom:
    """Unpickling this creates the marker file: the proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _evil(tmp_path: Path) -> tuple[bytes, Path]:
    marker = tmp_path / "PWNED"
    return pickle.dumps(_Boom(str(marker))), marker


def _traj(i: int = 0) -> Trajectory:
    return Trajectory(id=f"t{i}", source="a", group=f"g{i}", prompt_ids=torch.tensor([1, 2]),
                      response_ids=torch.tensor([3, 4, 5]), scalars={"reward": 1.0},
                      tensors={"logp": torch.zeros(3)}, media=[MediaItem("image", data=b"\x89PNG\r\n\x1a\nxx")])


def _reframe(header: dict, data: bytes = b"") -> bytearray:
    """Build a record around an arbitrary header (valid prefix and CRC): the codec's own framing."""
    hb = json.dumps(header).encode()
    start = (24 + len(hb) + 63) // 64 * 64
    total = start + len(data) + 4
    out = bytearray(total)
    struct.pack_into("<4sHHIIQ", out, 0, b"KNTD", 1, 0, len(hb), 0, total)
    out[24 : 24 + len(hb)] = hb
    out[start : start + len(data)] = data
    struct.pack_into("<I", out, total - 4, zlib.crc32(memoryview(out)[: total - 4]))
    return out


def test_pickle_bytes_are_not_a_record(tmp_path):
    evil, marker = _evil(tmp_path)
    for buf in (evil, evil + bytes(64), b"KNTD" + evil):
        with pytest.raises(CodecError):
            codec.decode_trajectory(buf)
    assert not marker.exists()


def test_record_with_pickle_payload_and_object_dtype_is_inert(tmp_path):
    evil, marker = _evil(tmp_path)
    # a pickle as a "bytes" buffer: it stays bytes, never unpickled
    rec = codec.encode_tensors({"note": "x"}, {"blob": evil})
    meta, vals = codec.decode_tensors(rec)
    assert vals["blob"] == evil and not marker.exists()
    # a header asking for an object dtype or a pickle "dtype" is refused
    for dtype in ("object", "O", "pickle", "|O"):
        buf = _reframe({"meta": {}, "buffers": {"x": {"dtype": dtype, "shape": [len(evil)], "offset": 0,
                                                          "nbytes": len(evil)}}}, evil)
        with pytest.raises(CodecError):
            codec.decode_tensors(buf)
    # a trajectory record whose media "kind" or fields are crafted: refused by validation, not executed
    good = codec.encode_trajectory(_traj())
    _m, vals = codec.decode_tensors(good)
    hdr = json.loads(bytes(good[24 : 24 + struct.unpack_from("<I", good, 8)[0]]))
    hdr["meta"]["media"][0]["kind"] = {"__reduce__": ["os.system", ["touch " + str(marker)]]}
    with pytest.raises(KnitdataError):
        codec.decode_trajectory(_reframe(hdr, bytes(good[(24 + struct.unpack_from('<I', good, 8)[0] + 63) // 64 * 64:-4])))
    assert not marker.exists()


def test_oversized_record_length_fields_fail_fast_without_allocation():
    good = codec.encode_trajectory(_traj())
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        cases = []
        # total length claiming ~1 EiB
        b = bytearray(good)
        struct.pack_into("<Q", b, 16, 2**60)
        cases.append(b)
        # header length claiming 4 GiB
        b = bytearray(good)
        struct.pack_into("<I", b, 8, 2**32 - 1)
        cases.append(b)
        # a buffer whose shape claims terabytes (consistent nbytes), valid CRC: refused by the bounds check
        cases.append(_reframe({"meta": {}, "buffers": {"x": {"dtype": "float64", "shape": [2**40], "offset": 0,
                                                             "nbytes": 2**43}}}))
        # shape product overflowing int64 with nbytes 0 (a zero-size trick)
        cases.append(_reframe({"meta": {}, "buffers": {"x": {"dtype": "uint8", "shape": [2**62, 2**62, 0],
                                                             "offset": 0, "nbytes": 1}}}))
        for i, buf in enumerate(cases):
            with pytest.raises(CodecError):
                codec.decode_tensors(buf)
            if i < 2:  # framing fields: a stream of records is refused too
                with pytest.raises(CodecError):
                    list(codec.iter_records(bytes(buf) + bytes(buf)))
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < 16 * 2**20, f"decoding crafted headers allocated {peak - base} bytes"


def _npy_bytes(arr_header: str, data: bytes) -> bytes:
    h = arr_header.encode("latin1")
    pad = 64 - (10 + len(h) + 1) % 64
    h = h + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + data


def _tar_bytes(members: list[tuple[str, bytes]], *, fake_size: dict[str, int] | None = None) -> bytes:
    bio = io.BytesIO()
    with tarfile.open(fileobj=bio, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    raw = bytearray(bio.getvalue())
    for name, size in (fake_size or {}).items():
        pos = raw.find(name.encode())
        # rewrite the size field of the ustar header that starts at pos (size at offset 124, 12 bytes octal)
        raw[pos + 124 : pos + 136] = b"%011o\0" % size
        raw[pos + 148 : pos + 156] = b"        "
        raw[pos + 148 : pos + 155] = b"%06o\0" % sum(raw[pos : pos + 512])
    return bytes(raw)


def _shard_members(traj: Trajectory) -> dict[str, bytes]:
    from knitdata.shards import encode_sample

    sample = encode_sample(traj)
    return {k: bytes(v) if not isinstance(v, bytes) else v for k, v in sample.as_dict().items() if k != "__key__"}


def test_shard_with_pickled_npy_members_cannot_run_code(tmp_path):
    from knitdata.shards import read_shards

    evil, marker = _evil(tmp_path)
    members = _shard_members(_traj())
    # replace response_ids.npy with an object-dtype .npy (np.load(allow_pickle=True) would unpickle it)
    bio = io.BytesIO()
    np.save(bio, np.array([_Boom(str(marker))], dtype=object), allow_pickle=True)
    assert not marker.exists()
    names = sorted(members)
    npy_name = next(n for n in names if n.startswith("response_ids"))
    header = json.loads(members["json"])
    tampered = dict(members)
    tampered[npy_name] = bio.getvalue()
    header["members"][npy_name] = [len(bio.getvalue()), None]  # also forge the manifest
    header.pop("json_crc32", None)
    for v in header["members"].values():
        v[1] = None
    tampered["json"] = json.dumps(header).encode()
    # and add members that webdataset would decode with pickle if asked to
    tampered["extra.pyd"] = evil
    tampered["weights.pth"] = evil
    path = tmp_path / "evil-000000.tar"
    path.write_bytes(_tar_bytes([(f"t0.{k}", v) for k, v in sorted(tampered.items())]))
    with pytest.raises(CodecError):
        list(read_shards([str(path)]))
    assert not marker.exists()


def test_shard_member_claiming_terabytes_fails_fast(tmp_path, monkeypatch):
    from knitdata import shards

    members = _shard_members(_traj())
    path = tmp_path / "big-000000.tar"
    path.write_bytes(_tar_bytes([(f"t0.{k}", v) for k, v in sorted(members.items())], fake_size={"t0.json": 2**40}))
    requested: list[int] = []
    real = bytearray

    def guarded(*a, **k):
        if a and isinstance(a[0], int):
            requested.append(a[0])
            if a[0] > 64 * 2**20:
                raise MemoryError(f"test guard: bytearray({a[0]}) requested from a crafted length field")
        return real(*a, **k)

    monkeypatch.setattr(shards, "bytearray", guarded, raising=False)
    with pytest.raises(CodecError):
        list(shards.read_shards([str(path)]))
    assert all(n <= 64 * 2**20 for n in requested)


def test_compressed_shard_member_claiming_gigabytes_fails_fast(tmp_path, monkeypatch):
    import gzip

    from knitdata import shards

    members = _shard_members(_traj())
    raw = _tar_bytes([(f"t0.{k}", v) for k, v in sorted(members.items())], fake_size={"t0.json": 4 * 2**30})
    path = tmp_path / "big-000000.tar.gz"
    path.write_bytes(gzip.compress(raw))
    real = bytearray

    def guarded(*a, **k):
        if a and isinstance(a[0], int) and a[0] > 64 * 2**20:
            raise MemoryError(f"test guard: bytearray({a[0]}) requested from a crafted length field")
        return real(*a, **k)

    monkeypatch.setattr(shards, "bytearray", guarded, raising=False)
    with pytest.raises(CodecError):  # a MemoryError here means the 4 GiB would really have been allocated
        list(shards.read_shards([str(path)]))


def test_spill_shards_crafted_on_disk_cannot_run_code(tmp_path):
    from knitdata.storage.spill import SpillStore

    evil, marker = _evil(tmp_path)
    d = tmp_path / "spill"
    with SpillStore(d, max_bytes=1 << 20) as s:
        s.put(_traj(0))
        s.put(_traj(1))
    shard = next(d.glob("spill-*.tar"))
    # append a sample made of pickles and an object-dtype .npy; overwrite t1's response_ids with a pickle
    data = bytearray(shard.read_bytes())
    pos = data.find(b"t1.response_ids.npy")
    assert pos > 0
    hdr_end = pos + 512
    size = int(bytes(data[pos + 124 : pos + 135]), 8)
    data[hdr_end : hdr_end + min(size, len(evil))] = evil[:size]
    shard.write_bytes(bytes(data).rstrip(b"\0") + bytes(-len(bytes(data).rstrip(b"\0")) % 512))
    with open(shard, "ab") as f:
        f.write(_tar_bytes([("t9.json", evil), ("t9.prompt_ids.npy", evil), ("t9.x.pyd", evil)]))
    with pytest.warns(RuntimeWarning):
        store = SpillStore.open(d, verify=True)
    try:
        assert "t1" not in store and "t9" not in store  # corrupted and crafted samples are skipped
        assert "t0" in store and store.get("t0").equals(_traj(0))
    finally:
        store.close()
    assert not marker.exists()


def test_loader_states_are_json_and_crafted_states_are_refused(tmp_path):
    from knitdata.admission import BatchSpec
    from knitdata.pipeline import Pipeline

    evil, marker = _evil(tmp_path)
    pipe = Pipeline(BatchSpec({"a": 2}, num_minibatches=1), num_consumers=1)
    ds = pipe.dataset(0, fetch="sample")
    state = ds.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain JSON, nothing else
    bad_states = [
        {"__reduce__": "os.system"},
        {**state, "minibatch": evil.hex()},
        {**state, "minibatch": {"py/object": "os.system"}},
        {**state, "rank": 1},
        {**state, "format": "pickle"},
        {**state, "minibatch": -1},
        json.loads(json.dumps({**state, "microbatch": [1, 2]})),
    ]
    for s in bad_states:
        with pytest.raises(StateError):
            ds.load_state_dict(s)
    with pytest.raises(StateError):
        ds.load_state_dict(evil)  # type: ignore[arg-type]
    pipe.close()
    assert not marker.exists()


# ----------------------------------------------------------------------------------- Ray binding


def test_ray_connect_defaults_are_loopback_only_and_dashboard_off(monkeypatch):
    ray = pytest.importorskip("ray")
    from knitdata.engines.ray import connect as ray_connect

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda address=None, **kw: calls.append({"address": address, **kw}))
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeID": "n"}])
    monkeypatch.setattr(ray_connect, "_INIT_PID", None)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", True, raising=False)
    ray_connect.connect()
    assert len(calls) == 1
    kw = calls[0]
    assert kw["address"] == "local"  # a new local Ray, never an existing cluster found on the machine
    assert kw["_node_ip_address"] == "127.0.0.1"
    assert kw["include_dashboard"] is False
    assert "dashboard_host" not in kw or kw["dashboard_host"] in ("127.0.0.1", "localhost")
    # attaching to a cluster with a node off loopback is refused by default
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeManagerAddress": "10.1.2.3", "NodeID": "n"}])
    with pytest.raises(KnitdataError, match="loopback"):
        ray_connect.check_loopback()


def test_ray_engine_default_binding_is_documented():
    pytest.importorskip("ray")
    from knitdata.engines.ray import engine as ray_engine

    doc = (ray_engine.__doc__ or "") + (knitdata.engines.ray.connect.connect.__doc__ or "")
    assert "127.0.0.1" in doc and "dashboard" in doc.lower()
