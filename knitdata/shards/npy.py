"""Tensors as ``.npy`` members (numpy format 1.0, never pickled): the shard format's tensor encoding.

The dtype whitelist, dimension and element limits and shape checks are :mod:`knitdata.codec`'s (one set of
rules for every stored tensor); this module only adds the ``.npy`` framing. ``bfloat16`` has no ``.npy``
dtype: its raw bits are stored as ``uint16`` and the sample's JSON header records the real dtype.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from knitdata.codec import DTYPES, check_shape
from knitdata.errors import CodecError, FieldTypeError

__all__ = ["tensor_to_npy", "npy_to_tensor", "media_ext"]

# little-endian numpy dtype of every codec dtype .npy can name (bfloat16 travels as uint16)
_TORCH_TO_NP: dict[torch.dtype, np.dtype] = {
    t: np.dtype(name).newbyteorder("<") for name, t in DTYPES.items() if t is not torch.bfloat16
}
_NPSTR_TO_TORCH: dict[str, torch.dtype] = {v.str: k for k, v in _TORCH_TO_NP.items()}
_DTYPE_NAME: dict[torch.dtype, str] = {t: name for name, t in DTYPES.items()}
_NPY_MAGIC = b"\x93NUMPY"
_OWN_NPY = re.compile(rb"\{'descr': '([<|][a-z]\d)', 'fortran_order': False, 'shape': \(([\d, ]*)\), \} *\n")


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


def tensor_to_npy(t: torch.Tensor, *, trajectory_id: str, field: str) -> tuple[list[Any], int, str, list[int]]:
    """Encode a tensor as a .npy member.

    Args:
        t: The tensor (any device; copied to the CPU if needed).
        trajectory_id: Named in errors.
        field: Named in errors.

    Returns:
        ``(buffers, size, dtype_name, shape)``: the member as zero-copy buffers (header, data), its size
        in bytes, the dtype's name and the shape.

    Raises:
        FieldTypeError: If the dtype cannot be stored.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype not in _DTYPE_NAME:
        raise FieldTypeError(
            f"dtype {t.dtype} cannot be stored in a shard; convert it to one of {sorted(DTYPES)}",
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


def _checked_header(buf: memoryview, dtype_name: str, shape: Sequence[int], where: str) -> tuple[list[int], bool, np.dtype, int]:
    """Parse and check a member's .npy header against the JSON header's dtype and shape (no data touched)."""
    if len(buf) < 10 or bytes(buf[:6]) != _NPY_MAGIC:
        raise CodecError(f"{where}: not a .npy member")
    fast = _parse_own_npy_header(buf)
    npshape, fortran, npdtype, start = fast if fast is not None else _parse_npy_header(buf, where)
    if not isinstance(npdtype, np.dtype):
        raise CodecError(f"{where}: bad .npy shape {npshape!r:.200}")
    checked = check_shape(list(npshape), f"{where}: .npy")
    if npdtype.hasobject:
        raise CodecError(f"{where}: .npy holds Python objects; refused (loading it would need pickle)")
    torch_dtype = _NPSTR_TO_TORCH.get(npdtype.str)
    if torch_dtype is None:
        raise CodecError(f"{where}: unsupported .npy dtype {npdtype.str!r}")
    want = DTYPES.get(dtype_name)
    if want is None:
        raise CodecError(f"{where}: unknown dtype {dtype_name!r} in the JSON header")
    stored = torch.uint16 if want == torch.bfloat16 else want
    if stored != torch_dtype:
        raise CodecError(f"{where}: .npy dtype {npdtype.str!r} does not match the header's {dtype_name!r}")
    if checked != list(shape):
        raise CodecError(f"{where}: .npy shape {tuple(npshape)} does not match the header's {tuple(shape)}")
    nbytes = math.prod(checked) * npdtype.itemsize
    if start + nbytes != len(buf):
        raise CodecError(f"{where}: .npy declares {nbytes} data bytes, the member holds {len(buf) - start}")
    return checked, fortran, npdtype, start


def npy_to_tensor(buf: memoryview, dtype_name: str, shape: Sequence[int], where: str) -> torch.Tensor:
    """Decode one .npy member without pickle, checking dtype and size before touching the data.

    Args:
        buf: The member's bytes (a writable buffer is decoded zero-copy; a read-only one is copied once).
        dtype_name: The dtype the sample's JSON header records (``bfloat16`` is stored as ``uint16``).
        shape: The shape the JSON header records.
        where: Location for error messages (shard, sample, member).

    Returns:
        The tensor.

    Raises:
        CodecError: If the header is malformed, holds objects, or disagrees with ``dtype_name``/``shape``
            or with the member's size.
    """
    npshape, fortran, npdtype, start = _checked_header(buf, dtype_name, shape, where)
    torch_dtype = _NPSTR_TO_TORCH[npdtype.str]
    count = math.prod(npshape)
    if count == 0:
        out = torch.empty(tuple(npshape), dtype=torch_dtype)
    else:
        src = buf if not buf.readonly else memoryview(bytearray(buf))
        out = torch.frombuffer(src, dtype=torch_dtype, count=count, offset=start)  # zero-copy when writable
        if fortran:
            out = out.view(tuple(reversed(npshape))).permute(*reversed(range(len(npshape)))).contiguous()
        else:
            out = out.view(tuple(npshape))
    if DTYPES[dtype_name] == torch.bfloat16:
        out = out.view(torch.bfloat16)
    return out


_MAGICS: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\x89PNG\r\n\x1a\n", "png"),
    (0, b"\xff\xd8\xff", "jpg"),
    (0, b"GIF8", "gif"),
    (0, b"fLaC", "flac"),
    (0, b"OggS", "ogg"),
    (0, b"ID3", "mp3"),
)


def media_ext(data: bytes | bytearray) -> str:
    """Return the member extension for encoded media bytes, from their magic (``bin`` when unknown)."""
    head = bytes(data[:16])
    for off, magic, ext in _MAGICS:
        if head[off : off + len(magic)] == magic:
            return ext
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return "bin"
