"""Binary encoding of trajectories (and of any named tensors) for wire and disk, without pickle.

Layout of one record (all integers little-endian)::

    offset  size  field
    0       4     magic  b"KNTD"
    4       2     format version (1)
    6       2     flags (0)
    8       4     header length H in bytes
    12      4     reserved (0)
    16      8     total length T of the record in bytes, checksum included
    24      H     header: UTF-8 JSON object (typed description of every buffer)
    ...           raw tensor buffers, each starting at a 64-byte aligned offset
    T-4     4     CRC32 of bytes [0, T-4)

The decoder checks, in this order and before any allocation that depends on the header: the fixed
prefix, that ``T`` equals the buffer length, that ``H`` fits, the CRC32, and then that every buffer
described by the header lies inside the record with a size equal to ``prod(shape) * itemsize``. Any
violation raises :class:`~knitdata.errors.CodecError`. Decoded tensors are zero-copy views into the
record (a read-only input is copied once, as a whole).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeGuard

import torch

from knitdata.errors import CodecError, ValidationError
from knitdata.record import MediaItem, Trajectory

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "encode_tensors",
    "decode_tensors",
    "encode_trajectory",
    "decode_trajectory",
    "encode_media",
    "decode_media",
    "MEDIA_MODES",
    "MediaResolver",
    "iter_records",
    "record_length",
    "DTYPES",
    "MAX_DIMS",
    "MAX_ELEMENTS",
    "is_count",
    "check_shape",
]

MAGIC = b"KNTD"
FORMAT_VERSION = 1
#: Largest JSON header accepted (a header is metadata, never payload).
MAX_HEADER_BYTES = 16 * 1024 * 1024
_PREFIX = struct.Struct("<4sHHIIQ")  # magic, version, flags, header_len, reserved, total_len
_CRC = struct.Struct("<I")
_ALIGN = 64

#: The tensor dtypes knitdata stores (wire records, shards, spill), by name.
DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
#: torch's limit on tensor dimensions.
MAX_DIMS = 64
#: Most elements a decoded tensor may hold (stays clear of int64 overflow in stride and size computations).
MAX_ELEMENTS = 2**62
_BYTES = "bytes"  # pseudo dtype for raw byte strings


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def encode_tensors(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor | bytes]) -> bytearray:
    """Encode a JSON-serializable ``meta`` dict and named tensors (or raw bytes) into one record.

    Args:
        meta: JSON-serializable metadata stored in the header under ``"meta"``.
        tensors: Named CPU tensors (any whitelisted dtype, any shape) or ``bytes`` values.

    Returns:
        The record as a ``bytearray`` (allocated once).

    Raises:
        CodecError: On an unsupported dtype or a non-serializable ``meta``.
    """
    specs: dict[str, dict[str, Any]] = {}
    bodies: list[tuple[str, torch.Tensor | bytes]] = list(tensors.items())
    # first pass: sizes (offsets relative to the data section)
    rel = 0
    for name, value in bodies:
        if isinstance(value, (bytes, bytearray, memoryview)):
            nbytes = len(value)
            specs[name] = {"dtype": _BYTES, "shape": [nbytes], "offset": rel, "nbytes": nbytes}
        elif isinstance(value, torch.Tensor):
            if value.dtype not in _DTYPE_NAMES:
                raise CodecError(f"tensor {name!r}: dtype {value.dtype} is not supported by the codec")
            nbytes = value.numel() * value.element_size()
            specs[name] = {
                "dtype": _DTYPE_NAMES[value.dtype],
                "shape": list(value.shape),
                "offset": rel,
                "nbytes": nbytes,
            }
        else:
            raise CodecError(f"value {name!r}: expected a tensor or bytes, got {type(value).__name__}")
        rel = _align(rel + nbytes)
    try:
        header = json.dumps({"meta": meta, "buffers": specs}, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise CodecError(f"metadata is not JSON-serializable: {e}") from e
    data_start = _align(_PREFIX.size + len(header))
    total = data_start + rel + _CRC.size
    out = bytearray(total)
    _PREFIX.pack_into(out, 0, MAGIC, FORMAT_VERSION, 0, len(header), 0, total)
    out[_PREFIX.size : _PREFIX.size + len(header)] = header
    mv = memoryview(out)
    for name, value in bodies:
        spec = specs[name]
        start = data_start + spec["offset"]
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            if spec["nbytes"]:
                dst = torch.frombuffer(mv[start : start + spec["nbytes"]], dtype=torch.uint8)
                dst.copy_(t.reshape(-1).view(torch.uint8))
        else:
            mv[start : start + spec["nbytes"]] = value
    crc = zlib.crc32(mv[: total - _CRC.size])
    _CRC.pack_into(out, total - _CRC.size, crc)
    return out


def record_length(buf: bytes | bytearray | memoryview, offset: int = 0) -> int:
    """Return the total length of the record starting at ``offset`` (reads only the fixed prefix).

    Raises:
        CodecError: If the prefix is truncated or not knitdata's.
    """
    mv = memoryview(buf)
    if len(mv) - offset < _PREFIX.size + _CRC.size:
        raise CodecError(f"truncated record: {len(mv) - offset} bytes, need at least {_PREFIX.size + _CRC.size}")
    magic, version, _flags, header_len, _res, total = _PREFIX.unpack_from(mv, offset)
    if magic != MAGIC:
        raise CodecError(f"not a knitdata record (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported record format version {version} (this knitdata reads {FORMAT_VERSION})")
    if total < _PREFIX.size + header_len + _CRC.size:
        raise CodecError(f"record length {total} is smaller than its header ({header_len} bytes) needs")
    return int(total)


def _decode_frame(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], memoryview]:
    mv = memoryview(buf)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    total = record_length(mv)
    if total != len(mv):
        kind = "truncated" if total > len(mv) else "oversized"
        raise CodecError(f"{kind} record: header says {total} bytes, buffer has {len(mv)}")
    _m, _v, _f, header_len, _r, _t = _PREFIX.unpack_from(mv, 0)
    if header_len > MAX_HEADER_BYTES:
        raise CodecError(f"header of {header_len} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    (stored,) = _CRC.unpack_from(mv, total - _CRC.size)
    actual = zlib.crc32(mv[: total - _CRC.size])
    if stored != actual:
        raise CodecError(f"checksum mismatch (stored {stored:#010x}, computed {actual:#010x}): corrupted record")
    try:
        header = json.loads(bytes(mv[_PREFIX.size : _PREFIX.size + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CodecError(f"record header is not valid JSON: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("buffers"), dict):
        raise CodecError("record header lacks its 'buffers' table")
    return header, mv


def decode_tensors(
    buf: bytes | bytearray | memoryview, *, copy: bool | None = None
) -> tuple[Any, dict[str, torch.Tensor | bytes]]:
    """Decode a record written by :func:`encode_tensors`.

    Args:
        buf: The record (exactly one, no trailing bytes).
        copy: ``True`` copies the record once so tensors do not alias ``buf``. ``False`` never copies:
            tensors view ``buf`` even when it is read-only (e.g. Ray's shared-memory object store, for a
            zero-copy read); writing to them is then undefined. ``None`` (default) copies once only when
            ``buf`` is read-only.

    Returns:
        ``(meta, values)``: the metadata and a dict of tensors (views into the record) or bytes.

    Raises:
        CodecError: If the record is truncated, corrupted or inconsistent.
    """
    header, mv = _decode_frame(buf)
    total = len(mv)
    data_start = _align(_PREFIX.size + _PREFIX.unpack_from(mv, 0)[3])
    data_end = total - _CRC.size
    specs = header["buffers"]
    checked: list[tuple[str, str, list[int], int, int]] = []
    for name, spec in specs.items():
        checked.append(_check_spec(name, spec, data_end - data_start))
    if copy or (copy is None and mv.readonly):
        mv = memoryview(bytearray(mv))
    elif mv.readonly:
        # zero-copy view of read-only memory: torch warns because it cannot enforce read-only-ness
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return header.get("meta"), _materialize(mv, checked, data_start)
    return header.get("meta"), _materialize(mv, checked, data_start)


def is_count(x: Any) -> TypeGuard[int]:
    """Return whether ``x`` is a non-negative JSON int (no bool, no float)."""
    return type(x) is int and x >= 0


def check_shape(shape: Any, where: str) -> list[int]:
    """Check a decoded shape (a list of counts, at most :data:`MAX_DIMS`, addressable) before any allocation.

    Args:
        shape: The shape as read from a header.
        where: Location for the error message (buffer, member, trajectory).

    Returns:
        The shape, as a list of ints.

    Raises:
        CodecError: If the shape is not a list of non-negative ints, has too many dimensions, or describes
            more elements than a tensor can address.
    """
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(is_count(s) for s in shape):
        raise CodecError(f"{where}: bad shape {shape!r:.200}")
    if math.prod(s for s in shape if s) > MAX_ELEMENTS:  # an empty tensor's other dims stay addressable
        raise CodecError(f"{where}: shape {shape!r:.200} is beyond what a tensor can address")
    return shape


def _check_spec(name: str, spec: Any, data_bytes: int) -> tuple[str, str, list[int], int, int]:
    """Validate one buffer description (structure and bounds; never touches the data)."""
    if not isinstance(spec, dict):
        raise CodecError(f"buffer {name!r}: bad description {spec!r:.200}")
    dtype_name, shape, offset, nbytes = spec.get("dtype"), spec.get("shape"), spec.get("offset"), spec.get("nbytes")
    if not isinstance(dtype_name, str) or (dtype_name != _BYTES and dtype_name not in DTYPES):
        raise CodecError(f"buffer {name!r}: unsupported dtype {dtype_name!r:.200}")
    shape = check_shape(shape, f"buffer {name!r}")
    if dtype_name == _BYTES and len(shape) != 1:
        raise CodecError(f"buffer {name!r}: a bytes buffer has a 1-D shape, got {shape!r:.200}")
    if not (is_count(offset) and is_count(nbytes)):
        raise CodecError(f"buffer {name!r}: bad offset/nbytes {offset!r:.100}/{nbytes!r:.100}")
    if offset % _ALIGN:
        raise CodecError(f"buffer {name!r}: offset {offset} is not {_ALIGN}-byte aligned")
    itemsize = 1 if dtype_name == _BYTES else _ITEMSIZE[dtype_name]
    if math.prod(shape) * itemsize != nbytes:
        raise CodecError(f"buffer {name!r}: shape {shape} and dtype {dtype_name} do not match {nbytes} bytes")
    if offset + nbytes > data_bytes:
        raise CodecError(
            f"buffer {name!r}: [{offset}, {offset + nbytes}) exceeds the record's data section of {data_bytes} bytes"
        )
    return name, dtype_name, shape, offset, nbytes


def _materialize(
    mv: memoryview, checked: list[tuple[str, str, list[int], int, int]], data_start: int
) -> dict[str, torch.Tensor | bytes]:
    values: dict[str, torch.Tensor | bytes] = {}
    for name, dtype_name, shape, offset, nbytes in checked:
        start = data_start + offset
        if dtype_name == _BYTES:
            values[name] = bytes(mv[start : start + nbytes])
        elif nbytes == 0:
            values[name] = torch.empty(shape, dtype=DTYPES[dtype_name])
        else:
            values[name] = torch.frombuffer(mv, dtype=DTYPES[dtype_name], count=math.prod(shape), offset=start).view(shape)
    return values


def iter_records(buf: bytes | bytearray | memoryview) -> Iterator[memoryview]:
    """Split a concatenation of records into one memoryview per record.

    Raises:
        CodecError: If the concatenation ends inside a record.
    """
    mv = memoryview(buf)
    pos = 0
    while pos < len(mv):
        n = record_length(mv, pos)
        if pos + n > len(mv):
            raise CodecError(f"truncated record at byte {pos}: needs {n} bytes, {len(mv) - pos} left")
        yield mv[pos : pos + n]
        pos += n


# ---------------------------------------------------------------------------------------- trajectories


#: The media modes of :func:`encode_trajectory`.
MEDIA_MODES: tuple[str, ...] = ("inline", "refs")
#: What :func:`decode_trajectory` resolves a referenced digest with: a mapping or a callable (``None``: not held).
MediaResolver = Mapping[str, MediaItem] | Callable[[str], "MediaItem | None"]


def _media_desc(m: MediaItem, ref: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": m.kind, "digest": m.digest, "sample_rate": m.sample_rate, "encoded": m.data is not None}
    if ref:
        d["ref"] = True
        d["nbytes"] = m.nbytes
    return d


def encode_trajectory(traj: Trajectory, *, media: str = "inline") -> bytearray:
    """Encode one trajectory into a self-describing, checksummed record (no pickle).

    Args:
        traj: A validated trajectory.
        media: ``"inline"`` (default): each media item's content is a buffer of the record (a reference item,
            :meth:`MediaItem.ref <knitdata.record.MediaItem.ref>`, is written as a reference). ``"refs"``: no
            media buffer at all; each media description carries ``"ref": true`` with its kind, digest,
            sample rate, ``encoded`` and ``nbytes``, for a reader that holds (or fetches) each item once
            (:func:`encode_media`) and resolves the references with :func:`decode_trajectory`'s ``media``.

    Returns:
        The record bytes.

    Raises:
        CodecError: An unknown ``media`` mode.
    """
    if media not in MEDIA_MODES:
        raise CodecError(f"media must be one of {MEDIA_MODES}, got {media!r}")
    refs = media == "refs"
    values: dict[str, torch.Tensor | bytes] = {"prompt_ids": traj.prompt_ids, "response_ids": traj.response_ids}
    if traj.loss_mask is not None:
        values["loss_mask"] = traj.loss_mask
    if traj.token_versions is not None:
        values["token_versions"] = traj.token_versions
    for k, v in traj.tensors.items():
        values[f"t/{k}"] = v
    descs = []
    for i, m in enumerate(traj.media):
        ref = refs or m.reference
        if not ref:
            values[f"m/{i}"] = m.tensor if m.tensor is not None else bytes(m.data)  # type: ignore[arg-type]
        descs.append(_media_desc(m, ref))
    meta = {
        "type": "trajectory",
        "id": traj.id,
        "source": traj.source,
        "group": traj.group,
        "gen_version": traj.gen_version,
        "scalars": {k: (float(v) if isinstance(v, float) else int(v)) for k, v in traj.scalars.items()},
        "tensors": list(traj.tensors),
        "media": descs,
    }
    return encode_tensors(meta, values)


def _resolve(media: MediaResolver | None, digest: str) -> MediaItem | None:
    if media is None:
        return None
    if isinstance(media, Mapping):
        return media.get(digest)
    return media(digest)


def decode_trajectory(buf: bytes | bytearray | memoryview, *, copy: bool | None = None,
                      media: MediaResolver | None = None) -> Trajectory:
    """Decode a record written by :func:`encode_trajectory` and validate the result.

    Args:
        buf: The record.
        copy: See :func:`decode_tensors`.
        media: Resolves the record's media references: ``{digest: MediaItem}`` or a callable ``digest ->
            MediaItem or None``; the item found takes the reference's place (the very object: equal digests
            decode to the same item). A reference not resolved decodes to a reference
            (:meth:`MediaItem.ref <knitdata.record.MediaItem.ref>`), for a unit to resolve later.

    Raises:
        CodecError: If the record is corrupted or is not a trajectory, or a resolved item's digest or kind
            differs from the reference's.
        ValidationError: If it decodes to an invalid trajectory.
    """
    meta, values = decode_tensors(buf, copy=copy)
    media_specs, tensor_names = _check_trajectory_meta(meta, values)
    try:
        items = []
        for i, m in enumerate(media_specs):
            if m.get("ref"):
                found = _resolve(media, m["digest"])
                if found is None:
                    items.append(MediaItem.ref(m["kind"], m["digest"], sample_rate=m["sample_rate"]))
                    continue
                if not isinstance(found, MediaItem) or found.digest != m["digest"] or found.kind != m["kind"]:
                    raise CodecError(f"trajectory record {meta['id']!r:.80}: media {i}: the item resolved for "
                                     f"{m['kind']} {m['digest']} is {getattr(found, 'kind', type(found).__name__)} "
                                     f"{getattr(found, 'digest', '')}")
                items.append(found)
                continue
            v = values[f"m/{i}"]
            if m["encoded"]:
                items.append(MediaItem(m["kind"], data=v, sample_rate=m["sample_rate"], digest=m["digest"]))  # type: ignore[arg-type]
            else:
                items.append(MediaItem(m["kind"], tensor=v, sample_rate=m["sample_rate"], digest=m["digest"]))  # type: ignore[arg-type]
        return Trajectory(
            id=meta["id"],
            source=meta["source"],
            group=meta["group"],
            gen_version=meta["gen_version"],
            prompt_ids=values["prompt_ids"],  # type: ignore[arg-type]
            response_ids=values["response_ids"],  # type: ignore[arg-type]
            loss_mask=values.get("loss_mask"),  # type: ignore[arg-type]
            token_versions=values.get("token_versions"),  # type: ignore[arg-type]
            scalars=dict(meta["scalars"]),
            tensors={k: values[f"t/{k}"] for k in tensor_names},  # type: ignore[misc]
            media=items,
        )
    except (KeyError, TypeError, ValueError) as e:  # defence in depth: the checks above should catch these
        if isinstance(e, (ValidationError, CodecError)):
            raise
        raise CodecError(f"trajectory record is missing or mistypes a field: {e!r}") from e


def encode_media(item: MediaItem) -> bytearray:
    """Encode one media item as its own checksummed record (meta ``type "media"``: kind, digest, sample rate,
    ``encoded``; one buffer ``"m"``): the unit a store keeps, ships or saves once per digest.

    Raises:
        CodecError: ``item`` is a reference (it has no content to encode).
    """
    if item.reference:
        raise CodecError(f"media {item.digest}: a reference has no content to encode")
    value = item.tensor if item.tensor is not None else bytes(item.data)  # type: ignore[arg-type]
    meta = {"type": "media", "kind": item.kind, "digest": item.digest, "sample_rate": item.sample_rate,
            "encoded": item.data is not None}
    return encode_tensors(meta, {"m": value})


def decode_media(buf: bytes | bytearray | memoryview, *, copy: bool | None = None) -> MediaItem:
    """Decode a record written by :func:`encode_media` (the tensor views the record; see :func:`decode_tensors`).

    Raises:
        CodecError: The record is corrupted or does not hold one media item.
        ValidationError: It decodes to an invalid item (e.g. an unknown kind).
    """
    meta, values = decode_tensors(buf, copy=copy)
    if not isinstance(meta, dict) or meta.get("type") != "media":
        raise CodecError("record does not hold a media item")
    kind, digest, rate, encoded = meta.get("kind"), meta.get("digest"), meta.get("sample_rate"), meta.get("encoded")
    if not isinstance(kind, str) or not isinstance(digest, str) or not digest or not isinstance(encoded, bool):
        raise CodecError(f"media record: bad kind/digest/encoded {kind!r:.40}/{digest!r:.60}/{encoded!r:.20}")
    if rate is not None and type(rate) is not int:
        raise CodecError(f"media record {digest}: sample_rate must be an int or null, got {rate!r:.40}")
    value = values.get("m")
    if set(values) != {"m"} or encoded != isinstance(value, bytes):
        raise CodecError(f"media record {digest}: its buffer is missing or not {'bytes' if encoded else 'a tensor'}")
    if encoded:
        return MediaItem(kind, data=value, sample_rate=rate, digest=digest)  # type: ignore[arg-type]
    return MediaItem(kind, tensor=value, sample_rate=rate, digest=digest)  # type: ignore[arg-type]


_TRAJ_FIELDS = ("id", "source", "group")
_FIXED_BUFFERS = ("prompt_ids", "response_ids", "loss_mask", "token_versions")


def _check_trajectory_meta(meta: Any, values: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Validate the structure of a trajectory record's metadata against its buffers (header only).

    Returns:
        ``(media descriptions, extra tensor names)``, both checked.
    """
    if not isinstance(meta, dict) or meta.get("type") != "trajectory":
        raise CodecError("record does not hold a trajectory")
    tid = meta.get("id")
    where = f"trajectory record {tid!r:.80}"
    for k in _TRAJ_FIELDS:
        if not isinstance(meta.get(k), str):
            raise CodecError(f"{where}: field {k!r} must be a string, got {meta.get(k)!r:.80}")
    if not is_count(meta.get("gen_version")):
        raise CodecError(f"{where}: field 'gen_version' must be a non-negative int, got {meta.get('gen_version')!r:.80}")
    scalars = meta.get("scalars")
    if not isinstance(scalars, dict) or not all(
        type(v) in (int, float) for v in scalars.values()
    ):
        raise CodecError(f"{where}: field 'scalars' must map names to numbers, got {scalars!r:.200}")
    names = meta.get("tensors")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CodecError(f"{where}: field 'tensors' must be a list of names, got {names!r:.200}")
    media = meta.get("media")
    if not isinstance(media, list):
        raise CodecError(f"{where}: field 'media' must be a list, got {media!r:.200}")
    for i, m in enumerate(media):
        if not isinstance(m, dict):
            raise CodecError(f"{where}: media {i}: bad description {m!r:.200}")
        kind, digest, rate, encoded = m.get("kind"), m.get("digest"), m.get("sample_rate"), m.get("encoded")
        if not isinstance(kind, str) or not isinstance(digest, str) or not isinstance(encoded, bool):
            raise CodecError(f"{where}: media {i}: bad kind/digest/encoded {kind!r:.40}/{digest!r:.60}/{encoded!r:.20}")
        if rate is not None and type(rate) is not int:
            raise CodecError(f"{where}: media {i}: sample_rate must be an int or null, got {rate!r:.40}")
        ref = m.get("ref", False)
        if ref is not False:
            if ref is not True or not digest:
                raise CodecError(f"{where}: media {i}: bad reference {ref!r:.20} to digest {digest!r:.60}")
            if f"m/{i}" in values:
                raise CodecError(f"{where}: media {i}: a reference has a buffer")
            continue
        value = values.get(f"m/{i}")
        if encoded != isinstance(value, bytes):
            raise CodecError(f"{where}: media {i}: its buffer is missing or not {'bytes' if encoded else 'a tensor'}")
    known = set(_FIXED_BUFFERS) | {f"t/{n}" for n in names} | {f"m/{i}" for i, m in enumerate(media) if not m.get("ref")}
    for name in values:
        if name not in known:
            raise CodecError(f"{where}: buffer {name!r:.80} is not described by the metadata")
    for name in ("prompt_ids", "response_ids"):
        if name not in values:
            raise CodecError(f"{where}: buffer {name!r} is missing")
    for n in names:
        if f"t/{n}" not in values:
            raise CodecError(f"{where}: buffer for tensor {n!r:.80} is missing")
    return media, names
