"""The shard sample format: one trajectory as webdataset members (JSON header, ``.npy`` tensors, media bytes).

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
sample rate, member, encoding: ``"bytes"``, ``"tensor"``, or ``"ref"``: a reference by digest to media
written once elsewhere, no member), ``members`` (``{member: [size, crc32]}``, the sample's manifest) and,
for exported train batches, ``replay`` (train batch, mini-batch index, global step, position).
``bfloat16`` has no ``.npy`` dtype: its raw bits are stored as ``uint16`` and the JSON records the
real dtype.

Reading never unpickles: ``.npy`` headers are parsed with ``allow_pickle`` semantics off (object dtypes
are refused), sizes are checked against the member before anything is allocated, and members the
header does not name (``.pyd``, ``.pth``...) are ignored, never decoded.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from knitdata.codec import check_shape, is_count
from knitdata.errors import CodecError, ValidationError
from knitdata.record import MediaItem, Trajectory
from knitdata.shards.npy import media_ext, npy_to_tensor, tensor_to_npy

__all__ = [
    "SHARD_FORMAT",
    "SHARD_FORMAT_VERSION",
    "MAX_JSON_BYTES",
    "EncodedSample",
    "ReplayInfo",
    "check_key",
    "encode_sample",
    "decode_sample",
]

SHARD_FORMAT = "knitdata.shard"
SHARD_FORMAT_VERSION = 1
#: Largest JSON header member accepted when reading.
MAX_JSON_BYTES = 16 * 1024 * 1024

_JSON_CRC = b',"json_crc32":'
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_RESERVED = ("prompt_ids", "response_ids", "loss_mask", "token_versions")
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


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
        bufs, size, dname, shape = tensor_to_npy(t, trajectory_id=key, field=name)
        member = f"{name}.npy"
        members.append((member, bufs, size))
        fields.append({"name": name, "member": member, "dtype": dname, "shape": shape})
    tensors: list[dict[str, Any]] = []
    for i, (name, t) in enumerate(traj.tensors.items()):
        field = f"t_{name}" if _SAFE_NAME.match(name) else f"t{i}"
        bufs, size, dname, shape = tensor_to_npy(t, trajectory_id=key, field=f"tensors.{name}")
        member = f"{field}.npy"
        members.append((member, bufs, size))
        tensors.append({"name": name, "member": member, "dtype": dname, "shape": shape})
    media: list[dict[str, Any]] = []
    for i, m in enumerate(traj.media):
        entry: dict[str, Any] = {"kind": m.kind, "digest": m.digest, "sample_rate": m.sample_rate}
        if m.reference:  # a reference to media held (or written) elsewhere: no member
            entry.update(member=None, encoding="ref")
        elif m.data is not None:
            member = f"m{i}.{media_ext(m.data)}"
            members.append((member, [bytes(m.data)], len(m.data)))
            entry.update(member=member, encoding="bytes")
        else:
            assert m.tensor is not None
            bufs, size, dname, shape = tensor_to_npy(m.tensor, trajectory_id=key, field=f"media[{i}]")
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


def _read_header(raw: Any, key: str, loc: str, verify: bool) -> dict[str, Any]:
    """Parse and check a sample's JSON header member (size, JSON, own CRC32, format, version, id, manifest)."""
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
    if not isinstance(header.get("members"), dict):
        raise CodecError(f"{loc}: header lacks its member manifest")
    return header


def _member_views(manifest: dict[str, Any], members: Mapping[str, Any], loc: str, verify: bool) -> dict[str, memoryview]:
    """Check every member the manifest lists (present, size, CRC32) and return byte views of them."""
    missing = [m for m in manifest if m not in members]
    if missing:
        raise CodecError(f"{loc}: incomplete sample, missing members {missing} (truncated shard?)")
    views: dict[str, memoryview] = {}
    for member, spec in manifest.items():
        mv = _as_mv(members[member])
        if not (
            isinstance(spec, list)
            and len(spec) == 2
            and is_count(spec[0])
            and (spec[1] is None or is_count(spec[1]))
        ):
            raise CodecError(f"{loc}: bad manifest entry for {member!r}: {spec!r:.200}")
        if len(mv) != spec[0]:
            raise CodecError(f"{loc}: member {member!r} has {len(mv)} bytes, the manifest says {spec[0]} (truncated?)")
        if verify and spec[1] is not None and zlib.crc32(mv) != spec[1]:
            raise CodecError(f"{loc}: member {member!r} fails its CRC32 check (corrupted)")
        views[member] = mv
    return views


def _tensor(views: Mapping[str, memoryview], spec: Any, what: str) -> torch.Tensor:
    """Decode the .npy member a header entry names (``what`` starts with the sample's location)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("member"), str) or spec["member"] not in views:
        raise CodecError(f"{what}: bad or unlisted member {spec!r}")
    if not spec["member"].endswith(".npy"):
        raise CodecError(f"{what}: tensors must be .npy members, got {spec['member']!r}")
    shape, dtype = check_shape(spec.get("shape"), what), spec.get("dtype")
    if not isinstance(dtype, str):
        raise CodecError(f"{what}: bad dtype {dtype!r:.80}")
    return npy_to_tensor(views[spec["member"]], dtype, shape, f"{what}, member {spec['member']!r}")


def _media(header: dict[str, Any], views: Mapping[str, memoryview], loc: str) -> list[MediaItem]:
    media = []
    for i, m in enumerate(header["media"]):
        if m.get("encoding") == "bytes":
            if m.get("member") not in views:
                raise CodecError(f"{loc}: media {i}: bad or unlisted member {m.get('member')!r}")
            media.append(
                MediaItem(m["kind"], data=bytes(views[m["member"]]), sample_rate=m["sample_rate"], digest=m["digest"])
            )
        elif m.get("encoding") == "ref":
            media.append(MediaItem.ref(m["kind"], m["digest"], sample_rate=m["sample_rate"]))
        elif m.get("encoding") == "tensor":
            item = _tensor(views, m, f"{loc}: media {i}")
            media.append(MediaItem(m["kind"], tensor=item, sample_rate=m["sample_rate"], digest=m["digest"]))
        else:
            raise CodecError(f"{loc}: media {i}: unknown encoding {m.get('encoding')!r}")
    return media


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
    header = _read_header(members.get("json"), key, loc, verify)
    views = _member_views(header["members"], members, loc, verify)
    _check_sample_header(header, loc)
    try:
        values = {f["name"]: _tensor(views, f, f"{loc}: field {f.get('name')!r}") for f in header["fields"]}
        if set(values) - set(_RESERVED):
            raise CodecError(f"{loc}: unknown fields {sorted(set(values) - set(_RESERVED))}")
        extra = {str(t["name"]): _tensor(views, t, f"{loc}: tensor {t.get('name')!r}") for t in header["tensors"]}
        media = _media(header, views, loc)
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
    if not is_count(header.get("gen_version")):
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
        if not isinstance(kind, str) or not isinstance(digest, str) or not (
                isinstance(member, str) or (member is None and m.get("encoding") == "ref" and digest)):
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
