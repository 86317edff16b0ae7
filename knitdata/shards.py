"""Trajectories as webdataset tar shards: export, read back, and a rank-aware, resumable dataset.

A shard is a plain tar file (readable by ``tar``, webdataset, or any tar library). Each trajectory is one
webdataset *sample*: consecutive members sharing the key (the trajectory id). For a trajectory ``t7`` with
one extra tensor ``logp`` and one PNG image, ``tar tf`` lists::

    t7.json                 header (UTF-8 JSON, see below)
    t7.loss_mask.npy        tensors as .npy (numpy format 1.0, never pickled)
    t7.m0.png               media: encoded bytes under the extension their magic says (png/jpg/flac/wav...),
                            decoded media tensors as .npy
    t7.prompt_ids.npy
    t7.response_ids.npy
    t7.t_logp.npy           extra tensors: ``t_<name>`` (or ``t<i>`` when the name is not a safe token)
    t7.token_versions.npy

The JSON header holds ``format`` (``"knitdata.shard"``), ``format_version``, ``id``, ``source``,
``group``, ``gen_version``, ``scalars``, ``fields`` (reserved tensors: member, dtype, shape),
``tensors`` (extra tensors: original name, member, dtype, shape), ``media`` (kind, digest,
sample rate, member, encoding), ``members`` (``{member: [size, crc32]}``, the sample's manifest) and,
for exported train batches, ``replay`` (train batch, mini-batch index, global step, position).
``bfloat16`` has no ``.npy`` dtype: its raw bits are stored as ``uint16`` and the JSON records the
real dtype.

Reading never unpickles: ``.npy`` headers are parsed with ``allow_pickle`` semantics off (object dtypes
are refused), sizes are checked against the member before anything is allocated, and members the
header does not name (``.pyd``, ``.pth``...) are ignored, never decoded.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import tarfile
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeGuard

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from knitdata.errors import CodecError, ConfigError, FieldTypeError, StateError, ValidationError
from knitdata.record import MediaItem, Trajectory

__all__ = [
    "SHARD_FORMAT",
    "SHARD_FORMAT_VERSION",
    "MAX_JSON_BYTES",
    "DEFAULT_MAX_MEMBER_BYTES",
    "EncodedSample",
    "ReplayInfo",
    "encode_sample",
    "decode_sample",
    "check_key",
    "write_shards",
    "write_admitted_batches",
    "read_shards",
    "read_admitted_batches",
    "iter_shard_samples",
    "count_samples",
    "expand_urls",
    "ShardDataset",
]

#: Read size for members of non-seekable shard streams.
_STREAM_CHUNK = 1 << 20

SHARD_FORMAT = "knitdata.shard"
SHARD_FORMAT_VERSION = 1
#: Largest JSON header member accepted when reading.
MAX_JSON_BYTES = 16 * 1024 * 1024
#: Default largest member accepted when reading (a declared size above it is refused before reading).
DEFAULT_MAX_MEMBER_BYTES = 8 * 1024**3

OnError = str | Callable[[Exception], Any]

# ----------------------------------------------------------------------------------------- dtypes / npy

_TORCH_TO_NP: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype("bool"),
    torch.uint8: np.dtype("uint8"),
    torch.int8: np.dtype("int8"),
    torch.int16: np.dtype("<i2"),
    torch.uint16: np.dtype("<u2"),
    torch.int32: np.dtype("<i4"),
    torch.uint32: np.dtype("<u4"),
    torch.int64: np.dtype("<i8"),
    torch.uint64: np.dtype("<u8"),
    torch.float16: np.dtype("<f2"),
    torch.float32: np.dtype("<f4"),
    torch.float64: np.dtype("<f8"),
}
_NPSTR_TO_TORCH: dict[str, torch.dtype] = {v.str: k for k, v in _TORCH_TO_NP.items()}
_DTYPE_NAME: dict[torch.dtype, str] = {d: str(d).removeprefix("torch.") for d in [*_TORCH_TO_NP, torch.bfloat16]}
_NAME_DTYPE: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_NAME.items()}
_NPY_MAGIC = b"\x93NUMPY"
_JSON_CRC = b',"json_crc32":'
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_RESERVED = ("prompt_ids", "response_ids", "loss_mask", "token_versions")
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_MAX_DIMS = 64  # torch's limit on dimensions
_MAX_ELEMENTS = 2**62  # stays clear of int64 overflow in stride and size computations


def _npy_header(dtype: np.dtype, shape: Sequence[int]) -> bytes:
    """Return a .npy (format 1.0) header for a C-ordered array; the data follows it directly."""
    shp = tuple(int(s) for s in shape)
    d = f"{{'descr': {dtype.str!r}, 'fortran_order': False, 'shape': {shp!r}, }}"
    body = d.encode("latin1")
    # magic(6) + version(2) + len(2) + body + padding + "\n" is a multiple of 64 (numpy's alignment)
    pad = -(10 + len(body) + 1) % 64
    body = body + b" " * pad + b"\n"
    if len(body) > 65535:
        raise CodecError(f"npy header too long for shape {tuple(shape)}")
    return _NPY_MAGIC + b"\x01\x00" + len(body).to_bytes(2, "little") + body


def _tensor_to_npy(t: torch.Tensor, *, trajectory_id: str, field: str) -> tuple[list[Any], int, str, list[int]]:
    """Return ``(buffers, size, dtype_name, shape)``: a .npy member as zero-copy buffers."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype not in _DTYPE_NAME:
        raise FieldTypeError(
            f"dtype {t.dtype} cannot be stored in a shard; convert it to one of {sorted(_NAME_DTYPE)}",
            trajectory_id=trajectory_id,
            field=field,
        )
    name = _DTYPE_NAME[t.dtype]
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    arr = t.numpy()
    header = _npy_header(arr.dtype, arr.shape)
    data = arr.reshape(-1).view(np.uint8).data if arr.size else b""
    return [header, data], len(header) + arr.nbytes, name, list(t.shape)


_OWN_NPY = re.compile(rb"\{'descr': '([<|][a-z]\d)', 'fortran_order': False, 'shape': \(([\d, ]*)\), \} *\n")


def _parse_own_npy_header(buf: memoryview) -> tuple[tuple[int, ...], bool, np.dtype, int] | None:
    """Fast path for the headers knitdata writes (version 1.0, C order); ``None`` means use numpy's parser."""
    if len(buf) < 10 or bytes(buf[:8]) != _NPY_MAGIC + b"\x01\x00":
        return None
    hlen = int.from_bytes(buf[8:10], "little")
    m = _OWN_NPY.fullmatch(bytes(buf[10 : 10 + hlen]))
    if m is None or m.group(1).decode() not in _NPSTR_TO_TORCH:
        return None
    parts = m.group(2).decode().replace(" ", "").split(",")
    if parts and parts[-1] == "":
        parts.pop()  # "(3,)"
    if not all(p.isdigit() for p in parts):
        return None
    shape = tuple(int(p) for p in parts)
    return shape, False, np.dtype(m.group(1).decode()), 10 + hlen


def _parse_npy_header(buf: memoryview, where: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """Parse any .npy header with numpy's own (literal_eval based, pickle-free) reader."""
    if len(buf) < 10 or bytes(buf[:6]) != _NPY_MAGIC:
        raise CodecError(f"{where}: not a .npy member")
    try:
        fp = io.BytesIO(bytes(buf[: min(len(buf), 65536 + 12)]))
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            npshape, fortran, npdtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            npshape, fortran, npdtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise CodecError(f"{where}: unsupported .npy version {version}")
        return tuple(npshape), bool(fortran), npdtype, fp.tell()
    except CodecError:
        raise
    except Exception as e:  # numpy raises ValueError/SyntaxError on crafted headers
        raise CodecError(f"{where}: bad .npy header: {e}") from e


def _npy_to_tensor(buf: memoryview, dtype_name: str, shape: Sequence[int], where: str) -> torch.Tensor:
    """Parse one .npy member without pickle; check dtype and size before touching the data."""
    if len(buf) < 10 or bytes(buf[:6]) != _NPY_MAGIC:
        raise CodecError(f"{where}: not a .npy member")
    fast = _parse_own_npy_header(buf)
    if fast is not None:
        npshape, fortran, npdtype, start = fast
    else:
        npshape, fortran, npdtype, start = _parse_npy_header(buf, where)
    if not isinstance(npdtype, np.dtype) or len(npshape) > _MAX_DIMS or not all(_is_count(s) for s in npshape):
        raise CodecError(f"{where}: bad .npy shape {npshape!r:.200}")
    if math.prod(s for s in npshape if s) > _MAX_ELEMENTS:
        raise CodecError(f"{where}: .npy shape {npshape!r:.200} is beyond what a tensor can address")
    if npdtype.hasobject:
        raise CodecError(f"{where}: .npy holds Python objects; refused (loading it would need pickle)")
    torch_dtype = _NPSTR_TO_TORCH.get(npdtype.str)
    if torch_dtype is None:
        raise CodecError(f"{where}: unsupported .npy dtype {npdtype.str!r}")
    want = _NAME_DTYPE.get(dtype_name)
    if want is None:
        raise CodecError(f"{where}: unknown dtype {dtype_name!r} in the JSON header")
    stored = torch.uint16 if want == torch.bfloat16 else want
    if stored != torch_dtype:
        raise CodecError(f"{where}: .npy dtype {npdtype.str!r} does not match the header's {dtype_name!r}")
    if list(npshape) != list(shape):
        raise CodecError(f"{where}: .npy shape {tuple(npshape)} does not match the header's {tuple(shape)}")
    count = math.prod(npshape)
    nbytes = count * npdtype.itemsize
    if start + nbytes != len(buf):
        raise CodecError(f"{where}: .npy declares {nbytes} data bytes, the member holds {len(buf) - start}")
    if count == 0:
        out = torch.empty(tuple(npshape), dtype=torch_dtype)
    else:
        src = buf if not buf.readonly else memoryview(bytearray(buf))
        out = torch.frombuffer(src, dtype=torch_dtype, count=count, offset=start)  # zero-copy when writable
        if fortran:
            out = out.view(tuple(reversed(npshape))).permute(*reversed(range(len(npshape)))).contiguous()
        else:
            out = out.view(tuple(npshape))
    if want == torch.bfloat16:
        out = out.view(torch.bfloat16)
    return out


# ----------------------------------------------------------------------------------------- media

_MAGICS: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\x89PNG\r\n\x1a\n", "png"),
    (0, b"\xff\xd8\xff", "jpg"),
    (0, b"GIF8", "gif"),
    (0, b"fLaC", "flac"),
    (0, b"OggS", "ogg"),
    (0, b"ID3", "mp3"),
)


def _media_ext(data: bytes | bytearray) -> str:
    """Extension for encoded media bytes, from their magic (``bin`` when unknown)."""
    head = bytes(data[:16])
    for off, magic, ext in _MAGICS:
        if head[off : off + len(magic)] == magic:
            return ext
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return "bin"


# ----------------------------------------------------------------------------------------- samples


def check_key(traj: Trajectory) -> str:
    """Return the shard key of a trajectory (its id) after checking it is a safe key.

    Raises:
        ValidationError: If the id contains a character that would split or misplace the sample.
    """
    key = traj.id
    if not isinstance(key, str) or not key or any(c in key for c in "./\\\x00\n") or key.strip() != key:
        raise ValidationError(
            "id cannot be a shard key: it must be non-empty, without '.', '/', '\\', NUL, newline or "
            "surrounding spaces; rename the trajectory",
            trajectory_id=str(key),
            field="id",
        )
    return key


@dataclass
class EncodedSample:
    """One trajectory encoded as webdataset members.

    Attributes:
        key: The sample key (trajectory id).
        members: ``(suffix, buffers, size)`` per member, JSON header first; ``buffers`` concatenate to the
            member's bytes (zero-copy views of the tensors).
    """

    key: str
    members: list[tuple[str, list[Any], int]]

    @property
    def nbytes(self) -> int:
        """Total bytes of all members (tar headers excluded)."""
        return sum(m[2] for m in self.members)

    def as_dict(self) -> dict[str, Any]:
        """Return the sample as webdataset's writer expects it: ``{"__key__": key, suffix: bytes}``."""
        out: dict[str, Any] = {"__key__": self.key}
        for suffix, bufs, _size in self.members:
            out[suffix] = (
                bufs[0] if len(bufs) == 1 else b"".join(bytes(b) if not isinstance(b, bytes) else b for b in bufs)
            )
        return out


def encode_sample(traj: Trajectory, *, replay: Mapping[str, Any] | None = None, checksum: bool = True) -> EncodedSample:
    """Encode one trajectory into webdataset members (JSON header, .npy tensors, media bytes).

    Args:
        traj: The trajectory.
        replay: Optional JSON-serializable replay information stored in the header under ``"replay"``.
        checksum: Store a CRC32 of every member in the manifest (checked when reading).

    Returns:
        The encoded sample.

    Raises:
        ValidationError: If the id is not a safe shard key.
        FieldTypeError: If a tensor has a dtype shards cannot hold.
    """
    key = check_key(traj)
    members: list[tuple[str, list[Any], int]] = []
    fields: list[dict[str, Any]] = []
    for name in _RESERVED:
        t = getattr(traj, name)
        if t is None:
            continue
        bufs, size, dname, shape = _tensor_to_npy(t, trajectory_id=key, field=name)
        member = f"{name}.npy"
        members.append((member, bufs, size))
        fields.append({"name": name, "member": member, "dtype": dname, "shape": shape})
    tensors: list[dict[str, Any]] = []
    for i, (name, t) in enumerate(traj.tensors.items()):
        field = f"t_{name}" if _SAFE_NAME.match(name) else f"t{i}"
        bufs, size, dname, shape = _tensor_to_npy(t, trajectory_id=key, field=f"tensors.{name}")
        member = f"{field}.npy"
        members.append((member, bufs, size))
        tensors.append({"name": name, "member": member, "dtype": dname, "shape": shape})
    media: list[dict[str, Any]] = []
    for i, m in enumerate(traj.media):
        entry: dict[str, Any] = {"kind": m.kind, "digest": m.digest, "sample_rate": m.sample_rate}
        if m.data is not None:
            member = f"m{i}.{_media_ext(m.data)}"
            members.append((member, [bytes(m.data)], len(m.data)))
            entry.update(member=member, encoding="bytes")
        else:
            assert m.tensor is not None
            bufs, size, dname, shape = _tensor_to_npy(m.tensor, trajectory_id=key, field=f"media[{i}]")
            member = f"m{i}.npy"
            members.append((member, bufs, size))
            entry.update(member=member, encoding="tensor", dtype=dname, shape=shape)
        media.append(entry)
    manifest = {}
    for member, bufs, size in members:
        crc = 0
        if checksum:
            for b in bufs:
                crc = zlib.crc32(b, crc)
        manifest[member] = [size, crc if checksum else None]
    header: dict[str, Any] = {
        "format": SHARD_FORMAT,
        "format_version": SHARD_FORMAT_VERSION,
        "id": traj.id,
        "source": traj.source,
        "group": traj.group,
        "gen_version": traj.gen_version,
        "scalars": {
            k: (v if isinstance(v, int) and not isinstance(v, bool) else float(v)) for k, v in traj.scalars.items()
        },
        "fields": fields,
        "tensors": tensors,
        "media": media,
        "members": manifest,
    }
    if replay is not None:
        header["replay"] = dict(replay)
    try:
        hjson = json.dumps(header, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ValidationError(f"header is not JSON-serializable: {e}", trajectory_id=key, field="replay") from e
    if checksum:  # the header protects itself: CRC32 of every byte before the field, appended last
        hjson = hjson[:-1] + _JSON_CRC + b"%d}" % zlib.crc32(hjson[:-1])
    members.insert(0, ("json", [hjson], len(hjson)))
    return EncodedSample(key, members)


def _as_mv(b: Any) -> memoryview:
    mv = memoryview(b)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    return mv


def decode_sample(
    key: str, members: Mapping[str, Any], *, where: str = "", verify: bool = True, validate: bool = True
) -> tuple[Trajectory, dict[str, Any]]:
    """Decode one sample's members into a trajectory.

    Args:
        key: The sample key.
        members: ``{suffix: bytes-like}`` (``"json"``, ``"prompt_ids.npy"``...). Writable ``bytearray``
            (views) are decoded zero-copy; read-only bytes are copied once per tensor.
        where: Location for error messages (e.g. the shard path).
        verify: Check the CRC32 of each member against the manifest.
        validate: Run :meth:`Trajectory.validate` on the result. Only a store reading back its own
            CRC-checked samples (validated when they were put) may turn this off.

    Returns:
        ``(trajectory, header)``.

    Raises:
        CodecError: If the sample is incomplete, corrupted, or not knitdata's format; the message names
            the shard (``where``) and the sample.
    """
    loc = f"shard {where!r}, sample {key!r}" if where else f"sample {key!r}"
    raw = members.get("json")
    if raw is None:
        raise CodecError(f"{loc}: no JSON header member ({key}.json); the sample is incomplete or not knitdata's")
    if len(raw) > MAX_JSON_BYTES:
        raise CodecError(f"{loc}: JSON header of {len(raw)} bytes exceeds {MAX_JSON_BYTES}")
    raw = bytes(raw)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CodecError(f"{loc}: JSON header is not valid: {e}") from e
    if verify and isinstance(header, dict):
        listed = header.get("members")
        listed = listed.values() if isinstance(listed, dict) else ()
        members_crc = [v[1] for v in listed if isinstance(v, list) and len(v) == 2]
        if "json_crc32" in header:
            cut = raw.rfind(_JSON_CRC)
            if cut < 0 or zlib.crc32(raw[:cut]) != header["json_crc32"]:
                raise CodecError(f"{loc}: JSON header fails its CRC32 check (corrupted)")
        elif any(c is not None for c in members_crc):
            raise CodecError(f"{loc}: JSON header lost its CRC32 field (corrupted)")
    if not isinstance(header, dict) or header.get("format") != SHARD_FORMAT:
        raise CodecError(
            f"{loc}: not a knitdata shard sample (format {header.get('format') if isinstance(header, dict) else None!r})"
        )
    if header.get("format_version") != SHARD_FORMAT_VERSION:
        raise CodecError(
            f"{loc}: shard format version {header.get('format_version')!r} is not {SHARD_FORMAT_VERSION}; "
            "upgrade knitdata to read it"
        )
    if header.get("id") != key:
        raise CodecError(f"{loc}: header id {header.get('id')!r} does not match the sample key")
    manifest = header.get("members")
    if not isinstance(manifest, dict):
        raise CodecError(f"{loc}: header lacks its member manifest")
    missing = [m for m in manifest if m not in members]
    if missing:
        raise CodecError(f"{loc}: incomplete sample, missing members {missing} (truncated shard?)")
    views: dict[str, memoryview] = {}
    for member, spec in manifest.items():
        mv = _as_mv(members[member])
        if not (
            isinstance(spec, list)
            and len(spec) == 2
            and _is_count(spec[0])
            and (spec[1] is None or _is_count(spec[1]))
        ):
            raise CodecError(f"{loc}: bad manifest entry for {member!r}: {spec!r:.200}")
        if len(mv) != spec[0]:
            raise CodecError(f"{loc}: member {member!r} has {len(mv)} bytes, the manifest says {spec[0]} (truncated?)")
        if verify and spec[1] is not None and zlib.crc32(mv) != spec[1]:
            raise CodecError(f"{loc}: member {member!r} fails its CRC32 check (corrupted)")
        views[member] = mv

    def tensor(spec: Any, what: str) -> torch.Tensor:
        if not isinstance(spec, dict) or not isinstance(spec.get("member"), str) or spec["member"] not in views:
            raise CodecError(f"{loc}: {what}: bad or unlisted member {spec!r}")
        if not spec["member"].endswith(".npy"):
            raise CodecError(f"{loc}: {what}: tensors must be .npy members, got {spec['member']!r}")
        shape, dtype = spec.get("shape"), spec.get("dtype")
        if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(_is_count(s) for s in shape):
            raise CodecError(f"{loc}: {what}: bad shape {shape!r:.200}")
        if math.prod(s for s in shape if s) > _MAX_ELEMENTS:
            raise CodecError(f"{loc}: {what}: shape {shape!r:.200} is beyond what a tensor can address")
        if not isinstance(dtype, str):
            raise CodecError(f"{loc}: {what}: bad dtype {dtype!r:.80}")
        return _npy_to_tensor(views[spec["member"]], dtype, shape, f"{loc}, member {spec['member']!r}")

    _check_sample_header(header, loc)
    try:
        values = {f["name"]: tensor(f, f"field {f.get('name')!r}") for f in header["fields"]}
        if set(values) - set(_RESERVED):
            raise CodecError(f"{loc}: unknown fields {sorted(set(values) - set(_RESERVED))}")
        extra = {str(t["name"]): tensor(t, f"tensor {t.get('name')!r}") for t in header["tensors"]}
        media = []
        for i, m in enumerate(header["media"]):
            if m.get("encoding") == "bytes":
                if m.get("member") not in views:
                    raise CodecError(f"{loc}: media {i}: bad or unlisted member {m.get('member')!r}")
                media.append(
                    MediaItem(
                        m["kind"], data=bytes(views[m["member"]]), sample_rate=m["sample_rate"], digest=m["digest"]
                    )
                )
            elif m.get("encoding") == "tensor":
                media.append(
                    MediaItem(
                        m["kind"], tensor=tensor(m, f"media {i}"), sample_rate=m["sample_rate"], digest=m["digest"]
                    )
                )
            else:
                raise CodecError(f"{loc}: media {i}: unknown encoding {m.get('encoding')!r}")
        fields = {
            "id": key,
            "source": header["source"],
            "group": header["group"],
            "prompt_ids": values["prompt_ids"],
            "response_ids": values["response_ids"],
            "gen_version": header["gen_version"],
            "loss_mask": values.get("loss_mask"),
            "token_versions": values.get("token_versions"),
            "scalars": dict(header["scalars"]),
            "tensors": extra,
            "media": media,
        }
        if validate:
            traj = Trajectory(**fields)
        else:  # trusted: the same values a validated Trajectory was built from, CRC-checked
            _check_trusted_fields(fields, loc)
            traj = object.__new__(Trajectory)
            for k, v in fields.items():
                object.__setattr__(traj, k, v)
    except CodecError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # defence in depth, after the checks
        raise CodecError(
            f"{loc}: header is missing or mistypes a field, or decodes to an invalid trajectory: {e}"
        ) from e
    return traj, header


def _is_count(x: Any) -> TypeGuard[int]:
    return type(x) is int and x >= 0  # JSON ints only: no bool, no float


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond the float range
        return False


def _check_sample_header(header: dict[str, Any], loc: str) -> None:
    """Validate the structure of a sample's JSON header (types and shapes of every field; no data)."""
    for k in ("source", "group"):
        if not isinstance(header.get(k), str) or not header[k]:
            raise CodecError(f"{loc}: header field {k!r} must be a non-empty string, got {header.get(k)!r:.80}")
    if not _is_count(header.get("gen_version")):
        raise CodecError(f"{loc}: header field 'gen_version' must be a non-negative int, got {header.get('gen_version')!r:.80}")
    scalars = header.get("scalars")
    if not isinstance(scalars, dict):
        raise CodecError(f"{loc}: header field 'scalars' must be an object, got {scalars!r:.200}")
    for k, v in scalars.items():
        if not k or type(v) not in (int, float) or not _finite(v):
            raise CodecError(f"{loc}: scalar {k!r:.80} must be a finite number under a non-empty name, got {v!r:.80}")
    for k in ("fields", "tensors", "media"):
        entries = header.get(k)
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise CodecError(f"{loc}: header field {k!r} must be a list of objects, got {entries!r:.200}")
    names = [f.get("name") for f in header["fields"]]
    if any(n not in _RESERVED for n in names) or len(set(names)) != len(names):
        raise CodecError(f"{loc}: bad or repeated field names {names!r:.200} (known: {_RESERVED})")
    if "prompt_ids" not in names or "response_ids" not in names:
        raise CodecError(f"{loc}: header lacks prompt_ids or response_ids")
    for t in header["tensors"]:
        if not isinstance(t.get("name"), str) or not t["name"] or t["name"] in _RESERVED:
            raise CodecError(f"{loc}: bad tensor name {t.get('name')!r:.80}")
    for i, m in enumerate(header["media"]):
        kind, digest, rate, member = m.get("kind"), m.get("digest"), m.get("sample_rate"), m.get("member")
        if not isinstance(kind, str) or not isinstance(digest, str) or not isinstance(member, str):
            raise CodecError(f"{loc}: media {i}: bad kind/digest/member {kind!r:.40}/{digest!r:.60}/{member!r:.60}")
        if rate is not None and type(rate) is not int:
            raise CodecError(f"{loc}: media {i}: sample_rate must be an int or null, got {rate!r:.40}")


def _check_trusted_fields(fields: dict[str, Any], loc: str) -> None:
    """What :meth:`Trajectory.validate` checks that the header and tensor metadata decide (no pass over data)."""
    resp = fields["response_ids"]
    n = resp.numel()
    for name in _RESERVED:
        t = fields[name]
        if t is None:
            continue
        if t.dim() != 1 or (name != "loss_mask" and t.dtype not in _INT_DTYPES):
            raise CodecError(f"{loc}: field {name!r}: expected a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
        if name in ("loss_mask", "token_versions") and t.numel() != n:
            raise CodecError(f"{loc}: field {name!r}: length {t.numel()} does not match the response length {n}")
    if n == 0:
        raise CodecError(f"{loc}: field 'response_ids' must not be empty")
    tv = fields["token_versions"]
    if tv is not None and int(tv.min()) != fields["gen_version"]:
        raise CodecError(f"{loc}: gen_version {fields['gen_version']} is not the oldest token version {int(tv.min())}")


# ----------------------------------------------------------------------------------------- writing


def _progress(iterable: Iterable[Any], enabled: bool, desc: str, total: int | None = None) -> Iterable[Any]:
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit="traj")


class _Writer:
    """ShardWriter wrapper: bytes we encode ourselves, PAX headers (long ids), list of written shards."""

    def __init__(self, pattern: str, maxcount: int, maxsize: float, mtime: float | None):
        if "%" not in pattern:
            raise ConfigError(
                f"shard pattern {pattern!r} needs a printf field for the shard number, e.g. 'out-%06d.tar'"
            )
        if maxcount < 1 or maxsize <= 0:
            raise ConfigError(f"maxcount ({maxcount}) and maxsize ({maxsize}) must be positive")
        self.pattern, self.maxcount, self.maxsize, self.mtime = pattern, maxcount, maxsize, mtime
        self.paths: list[str] = []
        self._w: Any = None
        self._seen: set[str] = set()

    def write(self, sample: EncodedSample) -> None:
        import webdataset as wds

        if sample.key in self._seen:
            raise ValidationError("appears twice in one export; shard keys must be unique", trajectory_id=sample.key)
        self._seen.add(sample.key)
        if self._w is None:  # lazily: no empty shard when there is nothing to write
            d = os.path.dirname(self.pattern % 0)
            if d:
                os.makedirs(d, exist_ok=True)
            self._w = wds.ShardWriter(
                self.pattern,
                maxcount=self.maxcount,
                maxsize=self.maxsize,
                verbose=0,
                post=self.paths.append,
                encoder=False,  # never webdataset's .pyd/.pth encoders: values are bytes we made
                format="PAX_FORMAT",
                mtime=self.mtime,
                mode=0o644,
            )
        self._w.write(sample.as_dict())

    def close(self) -> list[str]:
        if self._w is not None:
            self._w.close()
            self._w = None
        return self.paths


def write_shards(
    trajectories: Iterable[Trajectory],
    pattern: str,
    *,
    maxcount: int = 10_000,
    maxsize: float = 1e9,
    progress: bool = False,
    checksum: bool = True,
    mtime: float | None = None,
) -> list[str]:
    """Export trajectories to webdataset tar shards, one sample per trajectory.

    Args:
        trajectories: The trajectories (any iterable; consumed once, memory holds one at a time).
        pattern: Output path with a printf field for the shard number, e.g. ``"out/traj-%06d.tar"``.
        maxcount: Most samples per shard.
        maxsize: Shard size (bytes) after which a new shard starts.
        progress: Show a tqdm progress bar.
        checksum: Store CRC32s of members (checked on read).
        mtime: Fixed member modification time (for reproducible shards); now when ``None``.

    Returns:
        The paths of the written shards, in order (empty when there were no trajectories).

    Raises:
        ValidationError: If an id is not a safe shard key.
        FieldTypeError: If a tensor has an unsupported dtype.
        ConfigError: On a bad pattern or limits.
    """
    w = _Writer(pattern, maxcount, maxsize, mtime)
    total = len(trajectories) if isinstance(trajectories, Sequence) else None
    try:
        for traj in _progress(trajectories, progress, "write shards", total):
            w.write(encode_sample(traj, checksum=checksum))
    finally:
        paths = w.close()
    return paths


@dataclass(frozen=True)
class ReplayInfo:
    """Where a trajectory sat in the admitted stream (stored in exported train batches).

    Attributes:
        train_batch: Train batch index ``b``.
        minibatch: Mini-batch index ``k`` within the train batch.
        step: Global mini-batch counter.
        position: Position of the trajectory within its mini-batch.
        size: Number of trajectories in the mini-batch.
    """

    train_batch: int
    minibatch: int
    step: int
    position: int
    size: int

    def to_dict(self) -> dict[str, int]:
        """Return a JSON-serializable dict."""
        return {
            "train_batch": self.train_batch,
            "minibatch": self.minibatch,
            "step": self.step,
            "position": self.position,
            "size": self.size,
        }


def write_admitted_batches(
    batches: Iterable[Any],
    pattern: str,
    *,
    fetch: Callable[[str], Trajectory] | Mapping[str, Trajectory] | None = None,
    maxcount: int = 10_000,
    maxsize: float = 1e9,
    progress: bool = False,
    checksum: bool = True,
    mtime: float | None = None,
) -> list[str]:
    """Export admitted mini-batches (in admission order) so a replay reconstructs the exact order.

    Args:
        batches: Admitted mini-batches, in order: objects with ``train_batch``, ``index``, ``step`` and
            ``trajectories`` (e.g. ``knitdata.admission.AdmittedMiniBatch``). Their ``trajectories`` may be
            :class:`~knitdata.record.Trajectory` objects or metadata with an ``id`` resolved by ``fetch``.
        pattern: Output path pattern, see :func:`write_shards`.
        fetch: Resolves an id to its trajectory (a callable or a mapping); needed when batches hold metadata.
        maxcount: Most samples per shard.
        maxsize: Shard size in bytes after which a new shard starts.
        progress: Show a tqdm progress bar (per mini-batch).
        checksum: Store CRC32s of members.
        mtime: Fixed member modification time.

    Returns:
        The written shard paths, in order.

    Raises:
        ConfigError: If a batch holds metadata and no ``fetch`` was given, or a batch lacks a field.
    """
    w = _Writer(pattern, maxcount, maxsize, mtime)
    try:
        for mb in _progress(batches, progress, "write batches"):
            try:
                b, k, step, items = int(mb.train_batch), int(mb.index), int(mb.step), list(mb.trajectories)
            except AttributeError as e:
                raise ConfigError(f"admitted mini-batch {mb!r} lacks train_batch/index/step/trajectories: {e}") from e
            for pos, item in enumerate(items):
                if isinstance(item, Trajectory):
                    traj = item
                elif fetch is None:
                    raise ConfigError("batches hold metadata, not trajectories: pass fetch= (a mapping or a callable)")
                else:
                    tid = item.id if hasattr(item, "id") else str(item)
                    traj = fetch[tid] if isinstance(fetch, Mapping) else fetch(tid)
                info = ReplayInfo(b, k, step, pos, len(items)).to_dict()
                w.write(encode_sample(traj, replay=info, checksum=checksum))
    finally:
        paths = w.close()
    return paths


# ----------------------------------------------------------------------------------------- reading


def expand_urls(urls: str | Sequence[str]) -> list[str]:
    """Expand a brace pattern (``"a-{000..009}.tar"``), a ``::``-separated string, or a list of paths."""
    import braceexpand

    if isinstance(urls, (str, os.PathLike)):
        urls = [os.fspath(urls)]
    out: list[str] = []
    for u in urls:
        for part in os.fspath(u).split("::"):
            out.extend(braceexpand.braceexpand(part))
    return out


class _BrokenShard(CodecError):
    """The tar stream itself is broken: nothing after this point in the shard can be read."""


class _SafeReader:
    """File wrapper whose ``read(n)`` allocates only as much as really arrives (tar headers may lie about sizes)."""

    _CHUNK = 1 << 24

    def __init__(self, f: io.BufferedIOBase, size: int | None):
        self._f, self.size = f, size

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            return self._f.read()
        if self.size is not None:
            n = max(0, min(n, self.size - self._f.tell()))
        if n <= self._CHUNK:
            return self._f.read(n)
        parts, left = [], n
        while left > 0:
            b = self._f.read(min(left, self._CHUNK))
            if not b:
                break
            parts.append(b)
            left -= len(b)
        return b"".join(parts)

    def readinto(self, b: Any) -> int:
        mv, got = memoryview(b).cast("B"), 0
        while got < len(mv):
            n = self._f.readinto(mv[got:])
            if not n:
                break
            got += n
        return got

    def seek(self, *args: Any) -> int:
        return self._f.seek(*args)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()


def _open(url: str) -> tuple[Any, bool]:
    if os.path.exists(url):
        f = open(url, "rb")  # noqa: SIM115 - closed by the caller
        head = f.read(6)
        f.seek(0)
        if head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ")):  # compressed: read as a stream
            return _SafeReader(f, None), False
        return _SafeReader(f, os.fstat(f.fileno()).st_size), True
    if "://" in url or url.startswith("pipe:"):
        from webdataset.gopen import gopen

        return _SafeReader(gopen(url, "rb"), None), False
    raise CodecError(f"shard {url!r} does not exist")


def _check_tail(f: BinaryIO, offset: int, url: str) -> None:
    """After the tar's last header: only zero padding may follow (else a header was corrupted)."""
    f.seek(offset)
    while True:
        chunk = f.read(1 << 16)
        if not chunk:
            return
        if chunk.count(0) != len(chunk):
            raise _BrokenShard(
                f"shard {url!r}: unreadable data after byte {offset} (a corrupted or truncated tar header); "
                "samples after it are lost"
            )


def iter_shard_samples(
    url: str, *, start: int = 0, max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES
) -> Iterator[tuple[str, dict[str, bytearray]]]:
    """Yield ``(key, {suffix: bytearray})`` for each sample of one shard, from sample index ``start``.

    Samples before ``start`` are skipped without reading their data (seeking on local files). Only regular
    members are considered; their bytes are not interpreted here.

    Raises:
        CodecError: If the tar structure is broken (truncated member or header); samples yielded before
            it were intact.
    """
    f, seekable = _open(url)
    try:
        try:
            tf = tarfile.open(fileobj=f, mode="r:" if seekable else "r|*")
        except tarfile.TarError as e:
            raise _BrokenShard(f"shard {url!r}: not a readable tar file: {e}") from e
        index = -1
        key: str | None = None
        cur: dict[str, bytearray] = {}
        while True:
            try:
                ti = tf.next()
            except (tarfile.TarError, OSError, EOFError) as e:
                raise _BrokenShard(
                    f"shard {url!r}: broken after sample {key!r} (truncated member?): {e}; later samples are lost"
                ) from e
            tf.members = []  # type: ignore[attr-defined]  # do not accumulate TarInfos (typeshed omits `members`)
            if ti is None:
                break
            if not ti.isreg():
                continue
            name = os.path.basename(ti.name)
            k, dot, suffix = name.partition(".")
            if not dot:
                continue
            if k != key:
                if key is not None and index >= start:
                    yield key, cur
                key, cur = k, {}
                index += 1
            if index < start:
                continue
            if ti.size > max_member_bytes:
                raise CodecError(
                    f"shard {url!r}, sample {k!r}: member {name!r} declares {ti.size} bytes, over the limit of "
                    f"{max_member_bytes}; refused (raise max_member_bytes if it is genuine)"
                )
            if f.size is not None and ti.offset_data + ti.size > f.size:
                raise _BrokenShard(
                    f"shard {url!r}, sample {k!r}: member {name!r} is truncated "
                    f"({max(0, f.size - ti.offset_data)} of {ti.size} bytes in the file)"
                )
            try:
                if seekable and not ti.sparse:  # size checked against the file: one read into the buffer
                    buf = bytearray(ti.size)
                    f.seek(ti.offset_data)
                    n = f.readinto(buf)
                else:  # a stream (.tar.gz, pipe): memory follows the bytes that really arrive, not the header
                    src = tf.extractfile(ti)
                    buf = bytearray()
                    while src is not None and len(buf) < ti.size:
                        chunk = src.read(min(_STREAM_CHUNK, ti.size - len(buf)))
                        if not chunk:
                            break
                        buf += chunk
                    n = len(buf)
            except (tarfile.TarError, OSError, EOFError) as e:
                raise _BrokenShard(
                    f"shard {url!r}, sample {k!r}: member {name!r} is truncated or unreadable: {e}"
                ) from e
            if n != ti.size:
                raise _BrokenShard(
                    f"shard {url!r}, sample {k!r}: member {name!r} is truncated ({n} of {ti.size} bytes)"
                )
            cur[suffix] = buf
        if seekable:
            _check_tail(f, tf.offset, url)
        if key is not None and index >= start:
            yield key, cur
    finally:
        f.close()


def count_samples(url: str) -> int:
    """Count the samples of one shard by reading tar headers only (data is skipped)."""
    f, _seekable = _open(url)
    try:
        try:
            tf = tarfile.open(fileobj=f, mode="r:" if _seekable else "r|*")
        except tarfile.TarError as e:
            raise CodecError(f"shard {url!r}: not a readable tar file: {e}") from e
        n, key = 0, None
        while True:
            try:
                ti = tf.next()
            except (tarfile.TarError, OSError) as e:
                raise CodecError(f"shard {url!r}: broken tar after {n} samples: {e}") from e
            tf.members = []  # type: ignore[attr-defined]  # typeshed omits TarFile.members
            if ti is None:
                return n
            if ti.isreg() and "." in os.path.basename(ti.name):
                k = os.path.basename(ti.name).partition(".")[0]
                if k != key:
                    n, key = n + 1, k
    finally:
        f.close()


def _handle(on_error: OnError, exc: CodecError) -> None:
    if on_error == "raise":
        raise exc
    if on_error == "skip":
        warnings.warn(f"skipping: {exc}", RuntimeWarning, stacklevel=3)
        return
    if callable(on_error):
        on_error(exc)
        return
    raise ConfigError(f"on_error must be 'raise', 'skip' or a callable, got {on_error!r}")


def _read_with_header(
    urls: str | Sequence[str],
    *,
    on_error: OnError = "raise",
    verify: bool = True,
    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
    starts: Mapping[int, int] | None = None,
) -> Iterator[tuple[Trajectory, dict[str, Any]]]:
    if not (on_error in ("raise", "skip") or callable(on_error)):
        raise ConfigError(f"on_error must be 'raise', 'skip' or a callable, got {on_error!r}")
    for i, url in enumerate(expand_urls(urls)):
        start = 0 if starts is None else starts.get(i, 0)
        try:
            for key, members in iter_shard_samples(url, start=start, max_member_bytes=max_member_bytes):
                try:
                    yield decode_sample(key, members, where=url, verify=verify)
                except CodecError as e:
                    _handle(on_error, e)
        except CodecError as e:  # broken tar: the rest of this shard is unreadable
            _handle(on_error, e)


def read_shards(
    urls: str | Sequence[str],
    *,
    on_error: OnError = "raise",
    verify: bool = True,
    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
) -> Iterator[Trajectory]:
    """Read trajectories back from shards, in shard and sample order.

    Args:
        urls: Shard paths (a list, a brace pattern, or a URL webdataset's ``gopen`` understands).
        on_error: ``"raise"`` (default): raise the :class:`~knitdata.errors.CodecError`; ``"skip"``: warn and
            go on with the next intact sample (or the next shard when the tar itself is broken); a callable:
            called with the error (it may re-raise), then the sample is skipped.
        verify: Check member CRC32s.
        max_member_bytes: Members declaring more bytes are refused before reading.

    Yields:
        Trajectories, exactly as written.
    """
    for traj, _h in _read_with_header(urls, on_error=on_error, verify=verify, max_member_bytes=max_member_bytes):
        yield traj


def read_admitted_batches(
    urls: str | Sequence[str], *, on_error: OnError = "raise", verify: bool = True
) -> Iterator[tuple[ReplayInfo, list[Trajectory]]]:
    """Replay shards written by :func:`write_admitted_batches`: yield each mini-batch in admission order.

    Yields:
        ``(info, trajectories)``: the mini-batch's :class:`ReplayInfo` (``position`` 0) and its trajectories
        in their admitted order.

    Raises:
        CodecError: If a sample lacks replay information, or a mini-batch is incomplete (with
            ``on_error="raise"``).
    """
    cur: list[tuple[ReplayInfo, Trajectory]] = []

    def flush() -> Iterator[tuple[ReplayInfo, list[Trajectory]]]:
        if not cur:
            return
        first = cur[0][0]
        ok = len(cur) == first.size and all(i.position == p for p, (i, _t) in enumerate(cur))
        if not ok:
            _handle(on_error, CodecError(f"mini-batch at step {first.step} is incomplete or out of order"))
        else:
            yield ReplayInfo(first.train_batch, first.minibatch, first.step, 0, first.size), [t for _, t in cur]
        cur.clear()

    for traj, header in _read_with_header(urls, on_error=on_error, verify=verify):
        r = header.get("replay")
        if not isinstance(r, dict):
            _handle(
                on_error,
                CodecError(f"sample {traj.id!r} has no replay information; write it with write_admitted_batches"),
            )
            continue
        raw = [r.get(k) for k in ("train_batch", "minibatch", "step", "position", "size")]
        fields = [v for v in raw if _is_count(v)]
        if len(fields) != len(raw) or fields[3] >= fields[4]:
            _handle(on_error, CodecError(f"sample {traj.id!r}: bad replay information {r!r:.300}"))
            continue
        info = ReplayInfo(*fields)
        if cur and cur[0][0].step != info.step:
            yield from flush()
        cur.append((info, traj))
    yield from flush()


# ----------------------------------------------------------------------------------------- dataset


class ShardDataset(IterableDataset):
    """Reads shards for one consumer: equal sample counts per rank, DataLoader workers without duplicates.

    The global sample order is the shards' order (``urls``) then sample order within each shard. Rank ``r``
    of ``world_size`` takes a contiguous block of ``n`` samples, so every rank reads only the shards its
    block overlaps. ``uneven`` says what happens when the total ``N`` is not a multiple of ``world_size``:
    ``"drop"`` (``n = N // world_size``, the last ``N % world_size`` samples are not read), ``"pad"``
    (``n = ceil(N / world_size)``, the last rank's block wraps around to the first samples, which are then
    read twice) or ``"strict"`` (raise :class:`~knitdata.errors.ConfigError`). Within a rank, DataLoader
    worker ``w`` of ``W`` takes a contiguous part of the block; together the workers yield the block exactly
    once.

    The rank and count are explicit (never read from the environment). ``state_dict`` records how many
    samples this (rank, worker) has yielded in the current epoch; ``load_state_dict`` makes the next
    ``__iter__`` continue exactly after them (skipping data without decoding it), which is what
    ``torchdata.stateful_dataloader.StatefulDataLoader`` needs per worker.

    End of epoch follows the ``torchdata.nodes`` convention (a loader without ``restart_on_stop_iteration``):
    a state saved once an epoch has ended (after ``StopIteration``, or after its last sample) records that
    end; loaded, the next ``__iter__`` yields nothing more, and the one after it starts the next epoch.

    Args:
        urls: Shard paths or a brace pattern.
        rank: This consumer's rank.
        world_size: Number of consumers.
        uneven: ``"drop"``, ``"pad"`` or ``"strict"`` (see above).
        transform: Optional function applied to each trajectory (e.g. tokenize or collate).
        sample_counts: Samples per shard, if known (skips the header scan that counts them).
        verify: Check member CRC32s.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        uneven: str = "drop",
        transform: Callable[[Trajectory], Any] | None = None,
        sample_counts: Sequence[int] | None = None,
        verify: bool = True,
    ):
        super().__init__()
        self.urls = expand_urls(urls)
        if not self.urls:
            raise ConfigError("ShardDataset needs at least one shard")
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ConfigError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        if uneven not in ("drop", "pad", "strict"):
            raise ConfigError(f"uneven must be 'drop', 'pad' or 'strict', got {uneven!r}")
        if sample_counts is not None and len(sample_counts) != len(self.urls):
            raise ConfigError(f"sample_counts has {len(sample_counts)} entries for {len(self.urls)} shards")
        self.rank, self.world_size, self.uneven = rank, world_size, uneven
        self.transform, self.verify = transform, verify
        self._counts = list(sample_counts) if sample_counts is not None else None
        self._epoch = 0
        self._yielded = 0
        self._resume: int | None = None
        # True once an epoch ended and the next one has not started: a state saved now is an end-of-epoch state
        self._epoch_end = False
        self._resume_end = False

    # -------------------------------------------------------------------------------- layout
    @property
    def sample_counts(self) -> list[int]:
        """Samples per shard (counted from tar headers on first use)."""
        if self._counts is None:
            self._counts = [count_samples(u) for u in self.urls]
        return self._counts

    @property
    def total_samples(self) -> int:
        """Samples over all shards."""
        return sum(self.sample_counts)

    @property
    def samples_per_rank(self) -> int:
        """Samples every rank yields per epoch (the same on every rank)."""
        n, w = self.total_samples, self.world_size
        if self.uneven == "strict" and n % w:
            raise ConfigError(f"{n} samples do not split evenly over {w} ranks; use uneven='drop' or 'pad'")
        return -(-n // w) if self.uneven == "pad" else n // w

    def _my_indices(self) -> tuple[int, int, int]:
        """Return ``(first, count, worker)``: global start index and count for this (rank, worker)."""
        n = self.samples_per_rank
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        lo, hi = wid * n // nw, (wid + 1) * n // nw
        return self.rank * n + lo, hi - lo, wid

    def __len__(self) -> int:
        return self.samples_per_rank

    # -------------------------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Any]:
        first, count, _wid = self._my_indices()
        if self._resume_end:  # loaded an end-of-epoch state: this pass yields nothing, the next one starts over
            self._resume_end = False
            self._resume = None
            self._epoch_end = True
            return
        skip = self._resume or 0
        self._resume = None
        self._yielded = skip
        self._epoch_end = False
        total = self.total_samples
        if total == 0 or count == 0:
            self._end_epoch()
            return
        cum = np.cumsum([0, *self.sample_counts])
        pos = first + skip
        remaining = count - skip
        while remaining > 0:
            g = pos % total
            shard = int(np.searchsorted(cum, g, side="right") - 1)
            within = g - int(cum[shard])
            take = min(remaining, int(cum[shard + 1]) - g)
            got = 0
            for key, members in iter_shard_samples(self.urls[shard], start=within):
                traj, _h = decode_sample(key, members, where=self.urls[shard], verify=self.verify)
                self._yielded += 1
                got += 1
                yield self.transform(traj) if self.transform is not None else traj
                if got == take:
                    break
            if got < take:
                raise CodecError(
                    f"shard {self.urls[shard]!r} holds fewer samples than counted ({within + got} < {within + take}); "
                    "the shards changed after the dataset was created"
                )
            pos += take
            remaining -= take
        self._end_epoch()

    def _end_epoch(self) -> None:
        self._epoch += 1
        self._yielded = 0
        self._epoch_end = True

    # -------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Return JSON-serializable resume state of this (rank, worker)."""
        info = get_worker_info()
        return {
            "format": "knitdata.ShardDataset",
            "version": 1,
            "rank": self.rank,
            "world_size": self.world_size,
            "uneven": self.uneven,
            "num_shards": len(self.urls),
            "total_samples": self.total_samples,
            "worker": info.id if info is not None else 0,
            "num_workers": info.num_workers if info is not None else 1,
            "epoch": self._epoch,
            "yielded": self._yielded,
            "epoch_end": self._epoch_end,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``__iter__`` continues after the samples already yielded.

        A state saved at the end of an epoch (``epoch_end``) makes the next ``__iter__`` yield nothing; the
        one after it starts the next epoch (``torchdata.nodes`` convention). States without ``epoch_end``
        (saved by older versions) resume at the position they record.

        Raises:
            StateError: If the state belongs to another rank, worker layout or set of shards.
        """
        if not isinstance(state, Mapping) or state.get("format") != "knitdata.ShardDataset":
            raise StateError(f"not a ShardDataset state: {state!r}")
        info = get_worker_info()
        mine = {
            "rank": self.rank,
            "world_size": self.world_size,
            "uneven": self.uneven,
            "num_shards": len(self.urls),
            "total_samples": self.total_samples,
            "worker": info.id if info is not None else 0,
            "num_workers": info.num_workers if info is not None else 1,
        }
        for k, v in mine.items():
            if state.get(k) != v:
                raise StateError(
                    f"state has {k}={state.get(k)!r} but this dataset has {k}={v!r}; resume with the same shards, "
                    "rank, world size and number of DataLoader workers"
                )
        _f, count, _w = self._my_indices()
        y = state.get("yielded")
        if not _is_count(y) or y > count:
            raise StateError(f"bad 'yielded' {y!r:.80} (this worker has {count} samples per epoch)")
        epoch = state.get("epoch", 0)
        if not _is_count(epoch):
            raise StateError(f"bad 'epoch' {epoch!r:.80}: expected a non-negative int")
        end = state.get("epoch_end", False)
        if not isinstance(end, bool) or (end and y != 0):
            raise StateError(f"bad 'epoch_end' {end!r:.80} with 'yielded' {y!r} (an ended epoch records 0 yielded)")
        self._epoch = epoch
        self._yielded = y
        self._resume = y
        self._epoch_end = end
        self._resume_end = end
