"""Tests of knitdata.codec: exact round trips, corruption and truncation only ever raise CodecError."""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

from knitdata.codec import (  # noqa: E402
    FORMAT_VERSION,
    MAGIC,
    decode_tensors,
    decode_trajectory,
    encode_tensors,
    encode_trajectory,
    iter_records,
    record_length,
)
from knitdata.errors import CodecError, KnitdataError  # noqa: E402
from knitdata.record import MediaItem, Trajectory  # noqa: E402

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]
INT_DTYPES = [torch.int32, torch.int64, torch.int16, torch.uint8]


def _tensor(draw, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    hi = 100 if dtype != torch.uint8 else 255
    return torch.randint(0, hi, shape, generator=g).to(dtype)


@st.composite
def trajectories(draw) -> Trajectory:
    n_prompt = draw(st.integers(0, 40))
    n_resp = draw(st.integers(1, 40))
    dt = draw(st.sampled_from(INT_DTYPES))
    prompt = _tensor(draw, dt, (n_prompt,))
    resp = _tensor(draw, dt, (n_resp,))
    mask = None
    if draw(st.booleans()):
        mask = _tensor(draw, draw(st.sampled_from([torch.bool, torch.float32, torch.uint8])), (n_resp,))
    gen = draw(st.integers(0, 50))
    tv = None
    if draw(st.booleans()):
        tv = gen + torch.randint(0, 3, (n_resp,))
        tv[draw(st.integers(0, n_resp - 1))] = gen
    scalars = draw(
        st.dictionaries(
            st.text("abcdefgh_", min_size=1, max_size=8),
            st.floats(allow_nan=False, allow_infinity=False, width=64) | st.integers(-1000, 1000),
            max_size=4,
        )
    )
    tensors = {}
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        tensors[f"x{i}"] = _tensor(draw, dtype, shape)
    media = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["image", "audio"]))
        if draw(st.booleans()):
            media.append(MediaItem(kind, data=draw(st.binary(min_size=0, max_size=64))))
        elif kind == "image":
            media.append(MediaItem(kind, tensor=_tensor(draw, torch.uint8, (3, draw(st.integers(1, 6)), 4))))
        else:
            media.append(MediaItem(kind, tensor=_tensor(draw, torch.float32, (draw(st.integers(1, 50)),)), sample_rate=16000))
    return Trajectory(
        id=draw(st.text("abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12)),
        source=draw(st.sampled_from(["math", "code", "vision"])),
        group=draw(st.text("abc123", min_size=1, max_size=5)),
        prompt_ids=prompt,
        response_ids=resp,
        gen_version=gen,
        loss_mask=mask,
        token_versions=tv,
        scalars=scalars,
        tensors=tensors,
        media=media,
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories(), st.booleans())
def test_trajectory_round_trip_is_exact(traj: Trajectory, readonly: bool) -> None:
    buf = encode_trajectory(traj)
    assert record_length(buf) == len(buf)
    back = decode_trajectory(bytes(buf) if readonly else buf)
    assert back.equals(traj)
    assert back.meta() == traj.meta()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories(), st.data())
def test_random_corruption_only_raises_codec_error(traj: Trajectory, data) -> None:
    buf = bytearray(encode_trajectory(traj))
    mode = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if mode == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            pos = data.draw(st.integers(0, len(buf) - 1))
            buf[pos] ^= data.draw(st.integers(1, 255))
    elif mode == "truncate":
        buf = buf[: data.draw(st.integers(0, len(buf) - 1))]
    elif mode == "extend":
        buf += data.draw(st.binary(min_size=1, max_size=16))
    else:
        start = data.draw(st.integers(0, len(buf) - 1))
        buf[start : start + 8] = data.draw(st.binary(min_size=8, max_size=8))
    try:
        back = decode_trajectory(buf)
    except CodecError:
        return
    # a splice may rewrite bytes with identical ones: then the record must decode to the original
    assert back.equals(traj)


def _forge(header: dict, payload: bytes = b"", total: int | None = None) -> bytearray:
    """Build a record with a valid checksum around an arbitrary (possibly malicious) header."""
    hdr = json.dumps(header).encode()
    data_start = (24 + len(hdr) + 63) // 64 * 64
    body = bytearray(data_start) + bytearray(payload)
    n = len(body) + 4 if total is None else total
    struct.pack_into("<4sHHIIQ", body, 0, MAGIC, FORMAT_VERSION, 0, len(hdr), 0, n)
    body[24 : 24 + len(hdr)] = hdr
    body += struct.pack("<I", zlib.crc32(body))
    return body


def test_oversized_length_fields_are_refused_before_allocation() -> None:
    huge = {"meta": {}, "buffers": {"x": {"dtype": "float32", "shape": [1 << 40], "offset": 0, "nbytes": 4 << 40}}}
    with pytest.raises(CodecError, match="exceeds"):
        decode_tensors(_forge(huge))
    mismatch = {"meta": {}, "buffers": {"x": {"dtype": "float32", "shape": [10], "offset": 0, "nbytes": 8}}}
    with pytest.raises(CodecError, match="do not match"):
        decode_tensors(_forge(mismatch, b"\0" * 64))
    with pytest.raises(CodecError, match="truncated"):
        decode_tensors(_forge({"meta": {}, "buffers": {}}, total=1 << 50))


@pytest.mark.parametrize(
    "spec",
    [
        {"dtype": "object", "shape": [1], "offset": 0, "nbytes": 1},
        {"dtype": "float32", "shape": [-1], "offset": 0, "nbytes": 4},
        {"dtype": "float32", "shape": [1], "offset": -64, "nbytes": 4},
        {"dtype": "float32", "shape": "1", "offset": 0, "nbytes": 4},
        "not a dict",
    ],
)
def test_malformed_buffer_specs_are_refused(spec) -> None:
    with pytest.raises(CodecError):
        decode_tensors(_forge({"meta": {}, "buffers": {"x": spec}}, b"\0" * 64))


def test_header_must_be_json_and_describe_a_trajectory() -> None:
    with pytest.raises(CodecError, match="does not hold a trajectory"):
        decode_trajectory(encode_tensors({"type": "other"}, {}))
    with pytest.raises(CodecError, match="field .id. must be a string"):
        decode_trajectory(encode_tensors({"type": "trajectory"}, {}))
    bad = bytearray(encode_tensors({"a": 1}, {}))
    bad[24] = ord("[")  # break the JSON, then fix the checksum so only the header is wrong
    struct.pack_into("<I", bad, len(bad) - 4, zlib.crc32(bad[:-4]))
    with pytest.raises(CodecError, match="not valid JSON"):
        decode_tensors(bad)


def test_not_a_record_and_wrong_version() -> None:
    with pytest.raises(CodecError, match="not a knitdata record"):
        decode_tensors(b"PK\x03\x04" + b"\0" * 60)
    rec = encode_tensors({}, {})
    struct.pack_into("<H", rec, 4, 99)
    with pytest.raises(CodecError, match="format version"):
        decode_tensors(rec)
    with pytest.raises(KnitdataError):
        decode_tensors(b"")


def test_pickle_payload_is_never_executed(tmp_path) -> None:
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    blob = pickle.dumps(Evil())
    for candidate in (blob, _forge({"meta": {"type": "trajectory"}, "buffers": {}}, blob)):
        with pytest.raises(CodecError):
            decode_trajectory(candidate)
    assert not marker.exists()


def test_tensors_and_bytes_round_trip_and_views_are_zero_copy() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    rec = encode_tensors({"k": [1, 2]}, {"x": x, "raw": b"hello", "empty": torch.empty(0, 3)})
    meta, values = decode_tensors(rec)
    assert meta == {"k": [1, 2]}
    assert torch.equal(values["x"], x) and values["raw"] == b"hello" and values["empty"].shape == (0, 3)
    # a writable input is decoded in place: the tensor aliases the record, unless copy=True
    base = torch.frombuffer(rec, dtype=torch.uint8).data_ptr()
    assert base <= values["x"].data_ptr() < base + len(rec)
    copied = decode_tensors(rec, copy=True)[1]["x"]
    assert not (base <= copied.data_ptr() < base + len(rec)) and torch.equal(copied, x)
    with pytest.raises(CodecError, match="not supported"):
        encode_tensors({}, {"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(CodecError, match="JSON"):
        encode_tensors({"bad": object()}, {})


def test_iter_records_splits_concatenations() -> None:
    recs = [encode_tensors({"i": i}, {"x": torch.full((i,), i)}) for i in range(5)]
    blob = b"".join(bytes(r) for r in recs)
    out = [decode_tensors(r)[0]["i"] for r in iter_records(blob)]
    assert out == list(range(5))
    with pytest.raises(CodecError):
        list(iter_records(blob[:-3]))


# ------------------------------------------------------------------------------------ structure fuzz


def _split(buf: bytes | bytearray) -> tuple[dict, bytes]:
    """A record's JSON header (decoded) and its data section (aligned buffers, without the CRC)."""
    hlen = struct.unpack_from("<I", buf, 8)[0]
    header = json.loads(bytes(buf[24 : 24 + hlen]))
    data_start = (24 + hlen + 63) // 64 * 64
    return header, bytes(buf[data_start : len(buf) - 4])


def _reframe(header: object, data: bytes) -> bytearray:
    """Frame ``header`` (any JSON value) and a data section into a record with valid lengths and CRC32."""
    hdr = json.dumps(header).encode()  # NaN/Infinity allowed: json.loads reads them back
    data_start = (24 + len(hdr) + 63) // 64 * 64
    body = bytearray(data_start) + bytearray(data)
    total = len(body) + 4
    struct.pack_into("<4sHHIIQ", body, 0, MAGIC, FORMAT_VERSION, 0, len(hdr), 0, total)
    body[24 : 24 + len(hdr)] = hdr
    body += struct.pack("<I", zlib.crc32(body))
    return body


def _decode_outcome(buf: bytearray) -> str:
    """``"ok"`` (a valid trajectory), ``"knitdata"`` (a KnitdataError) or the name of any other exception."""
    try:
        traj = decode_trajectory(buf)
        traj.validate()
        traj.meta()
        encode_trajectory(traj)  # what decodes must encode again
        return "ok"
    except KnitdataError:
        return "knitdata"
    except Exception as e:  # noqa: BLE001 - the fuzz reports anything else
        return f"{type(e).__name__}: {e}"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories(), st.data())
def test_structure_fuzz_valid_checksum_only_raises_knitdata_errors(traj: Trajectory, data) -> None:
    from _fuzz_helpers import mutate

    header, body = _split(encode_trajectory(traj))
    mutated, how = mutate(data, header)
    outcome = _decode_outcome(_reframe(mutated, body))
    assert outcome in ("ok", "knitdata"), (how, outcome)


_M0 = {"kind": "image", "digest": "d" * 32, "sample_rate": None, "encoded": True}


def _crafted_base() -> tuple[dict, bytes]:
    traj = Trajectory(
        id="t0",
        source="math",
        group="g",
        prompt_ids=torch.tensor([1, 2]),
        response_ids=torch.tensor([3, 4, 5]),
        scalars={"reward": 1.0},
        tensors={"x": torch.zeros(2, 3)},
        media=[MediaItem("image", data=b"\x89PNG....")],
    )
    return _split(encode_trajectory(traj))


def _set(h: dict, path: tuple, value: object) -> dict:
    obj = h
    for k in path[:-1]:
        obj = obj[k]
    if value is _DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return h


_DELETE = object()

#: Crafted header changes (path, new value) found by the structure fuzz; each must raise a KnitdataError.
CRAFTED = [
    (("buffers", "prompt_ids", "dtype"), ["int64"]),
    (("buffers", "prompt_ids", "dtype"), {"a": 1}),
    (("buffers", "prompt_ids", "shape"), [True, 1]),
    (("buffers", "prompt_ids", "shape"), [0, 2**40, 2**40]),
    (("buffers", "prompt_ids", "shape"), [1] * 80),
    (("buffers", "t/x"), {"dtype": "float32", "shape": [0, 2**40, 2**40], "offset": 0, "nbytes": 0}),
    (("buffers", "m/0"), {"dtype": "bytes", "shape": [0, 8], "offset": 0, "nbytes": 0}),
    (("buffers", "prompt_ids", "offset"), 1),
    (("buffers", "prompt_ids", "offset"), -64),
    (("buffers", "prompt_ids", "offset"), 2.0),
    (("buffers", "prompt_ids", "nbytes"), 2**64),
    (("buffers", "prompt_ids"), [1, 2]),
    (("buffers", "zzz"), {"dtype": "uint8", "shape": [0], "offset": 0, "nbytes": 0}),
    (("meta", "scalars"), [[1, 2, 3]]),
    (("meta", "scalars"), [["a", 1.0]]),
    (("meta", "scalars"), "ab"),
    (("meta", "scalars", "reward"), None),
    (("meta", "tensors"), "x"),
    (("meta", "tensors"), [["x"]]),
    (("meta", "tensors"), {"x": 1}),
    (("meta", "tensors", 0), {"a": 1}),
    (("meta", "media"), {"0": _M0}),
    (("meta", "media"), "x"),
    (("meta", "media", 0), [1]),
    (("meta", "media", 0, "digest"), [1]),
    (("meta", "media", 0, "digest"), 7),
    (("meta", "media", 0, "kind"), ["image"]),
    (("meta", "media", 0, "kind"), "hologram"),
    (("meta", "media", 0, "sample_rate"), True),
    (("meta", "media", 0, "sample_rate"), -5),
    (("meta", "media", 0, "encoded"), False),
    (("meta", "media", 0, "encoded"), "yes"),
    (("meta", "media", 0, "encoded"), _DELETE),
    (("meta", "id"), ["t0"]),
    (("meta", "id"), _DELETE),
    (("meta", "gen_version"), 2.5),
    (("meta", "gen_version"), -(2**70)),
    (("meta", "gen_version"), True),
    (("meta", "group"), None),
    (("meta", "type"), _DELETE),
    (("meta",), [1, 2]),
    (("buffers",), [1]),
]


@pytest.mark.parametrize(("path", "value"), CRAFTED, ids=[f"{'.'.join(map(str, p))}={v!r:.20}" for p, v in CRAFTED])
def test_crafted_headers_with_valid_checksums_raise_codec_errors(path, value) -> None:
    header, body = _crafted_base()
    buf = _reframe(_set(header, path, value), body)
    with pytest.raises(KnitdataError):
        decode_trajectory(buf)


def test_reframing_an_unchanged_header_decodes_the_original() -> None:
    header, body = _crafted_base()
    back = decode_trajectory(_reframe(header, body))
    assert back.scalars == {"reward": 1.0} and back.media[0].data == b"\x89PNG...."


# ------------------------------------------------------------------------------------ media references (issue 43)
def _media_traj(refs_too: bool = True) -> tuple[Trajectory, MediaItem, MediaItem]:
    img = MediaItem("image", tensor=torch.arange(48, dtype=torch.uint8).view(3, 4, 4))
    clip = MediaItem("audio", data=b"RIFF-not-really", sample_rate=16000)
    media = [img, clip] + ([MediaItem.ref("image", img.digest)] if refs_too else [])
    return Trajectory(id="r1", source="s", group="g", prompt_ids=torch.arange(3), response_ids=torch.arange(2),
                      media=media), img, clip


def test_inline_record_of_content_items_is_the_format_before_references():
    """Old records (no "ref" key) are what inline encoding still writes for content items: byte for byte."""
    t, img, clip = _media_traj(refs_too=False)
    old_meta = {"type": "trajectory", "id": "r1", "source": "s", "group": "g", "gen_version": 0, "scalars": {},
                "tensors": [], "media": [{"kind": "image", "digest": img.digest, "sample_rate": None, "encoded": False},
                                         {"kind": "audio", "digest": clip.digest, "sample_rate": 16000,
                                          "encoded": True}]}
    old = encode_tensors(old_meta, {"prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "m/0": img.tensor,
                                    "m/1": bytes(clip.data)})
    assert encode_trajectory(t) == old
    back = decode_trajectory(old)
    assert back.equals(t) and not any(m.is_reference for m in back.media)


def test_refs_mode_writes_no_media_buffer_and_resolves_on_decode():
    t, img, clip = _media_traj()
    inline, refs = encode_trajectory(t), encode_trajectory(t, media="refs")
    assert len(refs) < len(inline) - img.nbytes
    meta, values = decode_tensors(refs)
    assert not [k for k in values if k.startswith("m/")]
    assert all(m["ref"] is True and "nbytes" in m for m in meta["media"])
    assert [m["nbytes"] for m in meta["media"]] == [img.nbytes, clip.nbytes, 0]
    unresolved = decode_trajectory(refs)  # a reference for a unit to resolve later
    assert [m.is_reference for m in unresolved.media] == [True, True, True]
    assert [m.digest for m in unresolved.media] == [img.digest, clip.digest, img.digest]
    for media in ({img.digest: img, clip.digest: clip}, {img.digest: img, clip.digest: clip}.get):
        back = decode_trajectory(refs, media=media)
        assert back.media[0] is img and back.media[1] is clip and back.media[2] is img
    partial = decode_trajectory(inline, media={img.digest: img})  # inline: only the reference item resolves
    assert partial.media[2] is img and partial.media[0] is not img and torch.equal(partial.media[0].tensor, img.tensor)


def test_resolved_item_must_match_the_reference():
    t, img, clip = _media_traj()
    with pytest.raises(CodecError, match="resolved"):
        decode_trajectory(encode_trajectory(t, media="refs"), media={img.digest: clip, clip.digest: clip})
    with pytest.raises(CodecError, match="media must be one of"):
        encode_trajectory(t, media="lazy")


def test_bad_reference_descriptions_raise_codec_error():
    t, img, _clip = _media_traj(refs_too=False)
    meta, values = decode_tensors(encode_trajectory(t, media="refs"))
    for bad in ({"ref": 1}, {"ref": True, "digest": ""}):
        m = json.loads(json.dumps(meta))
        m["media"][0].update(bad)
        with pytest.raises(CodecError):
            decode_trajectory(encode_tensors(m, values))
    m = json.loads(json.dumps(meta))
    with pytest.raises(CodecError, match="has a buffer"):  # a reference with a buffer
        decode_trajectory(encode_tensors(m, {**values, "m/0": img.tensor}))


def test_media_record_round_trip_and_corruption():
    from knitdata.codec import decode_media, encode_media

    _t, img, clip = _media_traj()
    for item in (img, clip):
        buf = encode_media(item)
        back = decode_media(buf)
        assert (back.kind, back.digest, back.sample_rate, back.data) == (item.kind, item.digest, item.sample_rate,
                                                                        item.data)
        assert back.tensor is None if item.tensor is None else torch.equal(back.tensor, item.tensor)
        buf[len(buf) // 2] ^= 0xFF
        with pytest.raises(CodecError):
            decode_media(buf)
    with pytest.raises(CodecError, match="reference"):
        encode_media(MediaItem.ref("image", img.digest))
    with pytest.raises(CodecError, match="media item"):
        decode_media(encode_trajectory(_t))
    with pytest.raises(CodecError, match="buffer"):
        decode_media(encode_tensors({"type": "media", "kind": "image", "digest": "d", "sample_rate": None,
                                     "encoded": True}, {"m": img.tensor}))
