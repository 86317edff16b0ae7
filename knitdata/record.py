"""The trajectory record: what rollout produces and training consumes.

A :class:`Trajectory` is one finished rollout (see the docs' Concepts page). Its :class:`TrajectoryMeta` is the small,
JSON-serializable view that admission and planning see: they never touch payloads.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from knitdata.errors import FieldTypeError, ValidationError

__all__ = [
    "MEDIA_KINDS",
    "PACKED_META",
    "SUPPORTED_DTYPES",
    "MediaItem",
    "Trajectory",
    "TrajectoryMeta",
    "tensor_digest",
    "bytes_digest",
    "media_digest",
    "metas_by_group",
]

#: Media kinds a trajectory may carry.
MEDIA_KINDS: tuple[str, ...] = ("image", "audio", "video")

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
#: Tensor dtypes a trajectory may hold (what :mod:`knitdata.codec`, shards and Ray can carry).
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)
_RESERVED_TENSORS = ("prompt_ids", "response_ids", "loss_mask", "token_versions")


def bytes_digest(data: bytes | bytearray | memoryview) -> str:
    """Return the content digest (BLAKE2b-128, hex) of raw bytes.

    Args:
        data: The bytes to hash.

    Returns:
        A 32-character lowercase hex string.
    """
    return hashlib.blake2b(bytes(data) if isinstance(data, memoryview) else data, digest_size=16).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """Return the content digest of a tensor: dtype, shape and values (BLAKE2b-128, hex).

    Two tensors get the same digest exactly when they have the same dtype, shape and bytes.

    Args:
        t: The tensor to hash (any device; it is copied to the CPU if needed).

    Returns:
        A 32-character lowercase hex string.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # the buffer itself: no copy of the bytes
    return h.hexdigest()


def media_digest(item: MediaItem) -> str:
    """Return the content digest of a media item (its :attr:`MediaItem.digest`: computed once at construction).

    A producer that put an item with its content can later put :meth:`MediaItem.ref` with this digest instead.
    """
    return item.digest


@dataclass(frozen=True)
class MediaItem:
    """One image, audio clip or video attached to a trajectory.

    Either ``tensor`` (decoded pixels ``uint8 [C, H, W]`` or ``[H, W, C]``, or audio samples
    ``float32 [frames]``/``[frames, channels]``, or already processed encoder inputs) or ``data``
    (encoded file bytes: PNG, JPEG, FLAC, WAV, or a video container: MP4, WebM...) must be given, not both.
    A decoded video is ``uint8 [T, C, H, W]`` frames, already sampled.

    A *reference* (``reference=True``, or :meth:`ref`) holds no content, only the digest of an item the pipeline
    already holds (put with its content before, e.g. with the group's first member or an earlier turn): storage
    resolves it at put to the one copy it keeps of that digest, and refuses it with
    :class:`~knitdata.errors.MediaRefError` when no unit of the pipeline holds it. Its :attr:`nbytes` is 0.

    Attributes:
        kind: ``"image"``, ``"audio"`` or ``"video"``.
        tensor: Decoded content, or ``None``.
        data: Encoded bytes, or ``None``.
        sample_rate: Audio sample rate in Hz (audio only).
        digest: Content digest; computed from the content when left empty (a reference must give it).
        reference: A reference to held media by ``digest``: neither ``tensor`` nor ``data``.

    Example:
        >>> img = MediaItem("image", tensor=torch.zeros(3, 2, 2, dtype=torch.uint8))
        >>> ref = MediaItem.ref("image", img.digest)
        >>> ref.is_reference, ref.nbytes, ref.digest == media_digest(img)
        (True, 0, True)
    """

    kind: str
    tensor: torch.Tensor | None = None
    data: bytes | None = None
    sample_rate: int | None = None
    digest: str = ""
    reference: bool = False

    def __post_init__(self) -> None:
        if self.kind not in MEDIA_KINDS:
            raise ValidationError(
                f"unknown media kind {self.kind!r}; expected one of {MEDIA_KINDS}", field="media.kind"
            )
        if self.reference is not False:
            if self.reference is not True:
                raise FieldTypeError(f"reference must be a bool, got {self.reference!r}", field="media.reference")
            if self.tensor is not None or self.data is not None:
                raise ValidationError("a reference holds neither `tensor` nor `data`, only the digest", field="media")
            if not isinstance(self.digest, str) or not self.digest:
                raise ValidationError("a reference needs the digest of the held item it refers to",
                                      field="media.digest")
            if self.sample_rate is not None and (not isinstance(self.sample_rate, int) or self.sample_rate <= 0):
                raise ValidationError(f"sample_rate must be a positive int, got {self.sample_rate!r}",
                                      field="media.sample_rate")
            return
        if (self.tensor is None) == (self.data is None):
            raise ValidationError("give exactly one of `tensor` or `data`", field="media")
        if self.tensor is not None and not isinstance(self.tensor, torch.Tensor):
            raise FieldTypeError(f"expected a torch.Tensor, got {type(self.tensor).__name__}", field="media.tensor")
        if self.data is not None and not isinstance(self.data, (bytes, bytearray)):
            raise FieldTypeError(f"expected bytes, got {type(self.data).__name__}", field="media.data")
        if self.sample_rate is not None and (not isinstance(self.sample_rate, int) or self.sample_rate <= 0):
            raise ValidationError(f"sample_rate must be a positive int, got {self.sample_rate!r}", field="media.sample_rate")
        if not self.digest:
            d = tensor_digest(self.tensor) if self.tensor is not None else bytes_digest(self.data)  # type: ignore[arg-type]
            object.__setattr__(self, "digest", d)

    @classmethod
    def ref(cls, kind: str, digest: str, *, sample_rate: int | None = None) -> MediaItem:
        """A reference to a held media item by its digest (no content; see the class docstring).

        Args:
            kind: ``"image"``, ``"audio"`` or ``"video"``.
            digest: The held item's :attr:`digest` (:func:`media_digest`).
            sample_rate: Audio sample rate in Hz (audio only).
        """
        return cls(kind, sample_rate=sample_rate, digest=digest, reference=True)

    @property
    def is_reference(self) -> bool:
        """Whether this is a reference (no content), see :meth:`ref`."""
        return self.reference

    @property
    def nbytes(self) -> int:
        """Size of the content in bytes (0 for a reference)."""
        if self.reference:
            return 0
        if self.tensor is not None:
            return self.tensor.numel() * self.tensor.element_size()
        return len(self.data)  # type: ignore[arg-type]


def _check_1d_int(tid: str, name: str, t: Any, *, allow_empty: bool, token_ids: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise FieldTypeError(f"expected a 1-D integer torch.Tensor, got {type(t).__name__}", trajectory_id=tid, field=name)
    if t.dtype not in _INT_DTYPES:
        raise FieldTypeError(f"expected an integer dtype, got {t.dtype}", trajectory_id=tid, field=name)
    if t.dim() != 1:
        raise ValidationError(f"expected a 1-D tensor, got shape {tuple(t.shape)}", trajectory_id=tid, field=name)
    if not allow_empty and t.numel() == 0:
        raise ValidationError("must not be empty", trajectory_id=tid, field=name)
    if token_ids and t.numel() and t.is_signed() and int(t.min()) < 0:  # one reduction; the position only on error
        pos = int(torch.nonzero(t < 0)[0, 0])
        raise ValidationError(f"token ids must be >= 0, got {int(t[pos])} at position {pos}", trajectory_id=tid,
                              field=name)


def _scalar_value(v: Any) -> float:
    """A scalar field's value as a Python float: an ``int``, a ``float``, a real numpy scalar (``numpy.float32``,
    ``numpy.int64``...) or a 0-d real tensor or array (``torch.tensor(0.5)``, ``numpy.array(0.5)``).

    Raises:
        TypeError: Anything else (``bool`` and booleans included, complex numbers, strings, tensors of more
            than one element); the message says what it got. ``OverflowError``: an int beyond the float range.
    """
    if type(v) is float or type(v) is int:
        return float(v)
    if isinstance(v, torch.Tensor):
        if v.dim() != 0:
            raise TypeError(f"expected a float or a 0-d tensor, got a tensor of shape {tuple(v.shape)}")
        if v.dtype == torch.bool or v.dtype.is_complex:
            raise TypeError(f"expected a float or a 0-d real tensor, got a 0-d tensor of dtype {v.dtype}")
        return float(v.item())
    if isinstance(v, (np.generic, np.ndarray)):  # a numpy scalar (numpy.float32, numpy.int64...) or array
        if v.shape != ():
            raise TypeError(f"expected a float or a 0-d array, got an array of shape {tuple(v.shape)}")
        if v.dtype.kind not in ("f", "i", "u"):
            raise TypeError(f"expected a float, got a numpy {type(v).__name__} of dtype {v.dtype}")
        return float(v.item())
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"expected a float, got {type(v).__name__}")
    return float(v)  # an int or float subclass


@dataclass
class Trajectory:
    """One finished rollout.

    Construction validates every field and raises :class:`~knitdata.errors.ValidationError` or
    :class:`~knitdata.errors.FieldTypeError` naming the trajectory id and the field.

    Attributes:
        id: Unique id of the trajectory (non-empty string, no ``.`` or ``/``: it becomes a shard key).
        source: Where the prompt came from (e.g. ``"math"``).
        group: Group id (GRPO: the n responses of one prompt share it).
        prompt_ids: 1-D integer tensor of prompt token ids, each >= 0 (may be empty).
        response_ids: 1-D integer tensor of response token ids, each >= 0 (non-empty).
        gen_version: Policy version that generated it; under partial rollout the oldest among its tokens.
        loss_mask: 1-D mask over the response tokens (bool, integer or float); all ones when ``None``.
        token_versions: Optional 1-D integer tensor of per-response-token policy versions.
        scalars: Named finite float fields (reward, advantage, ...). An ``int``, a real numpy scalar
            (``numpy.float32``, ``numpy.int64``) or a 0-d real tensor or array is accepted and stored as a Python
            ``float`` (``{"reward": 1}`` holds ``1.0``); ``bool`` is refused.
        tensors: Extra named tensors (e.g. old log-probs).
        media: Images and audio clips.
    """

    id: str
    source: str
    group: str
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    gen_version: int = 0
    loss_mask: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None
    scalars: dict[str, float] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    media: list[MediaItem] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field; raise an error naming the trajectory and the field on the first problem.

        Also converts ``int``, numpy and 0-d tensor scalars to ``float`` (see ``scalars``).
        """
        if not isinstance(self.id, str) or not self.id:
            raise ValidationError(f"id must be a non-empty string, got {self.id!r}", field="id")
        tid = self.id
        if any(c in tid for c in "./\\\x00") or tid.strip() != tid:
            raise ValidationError(
                "id must not contain '.', '/', '\\', NUL or surrounding spaces (it becomes a shard key)",
                trajectory_id=tid,
                field="id",
            )
        for name in ("source", "group"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValidationError(f"must be a non-empty string, got {v!r}", trajectory_id=tid, field=name)
        if isinstance(self.gen_version, bool) or not isinstance(self.gen_version, int) or self.gen_version < 0:
            raise ValidationError(
                f"must be a non-negative int, got {self.gen_version!r}", trajectory_id=tid, field="gen_version"
            )
        _check_1d_int(tid, "prompt_ids", self.prompt_ids, allow_empty=True, token_ids=True)
        _check_1d_int(tid, "response_ids", self.response_ids, allow_empty=False, token_ids=True)
        n = self.response_ids.numel()
        if self.loss_mask is not None:
            m = self.loss_mask
            if not isinstance(m, torch.Tensor):
                raise FieldTypeError(f"expected a torch.Tensor, got {type(m).__name__}", trajectory_id=tid, field="loss_mask")
            if m.dtype not in SUPPORTED_DTYPES:
                raise FieldTypeError(f"unsupported dtype {m.dtype}", trajectory_id=tid, field="loss_mask")
            if m.dim() != 1 or m.numel() != n:
                raise ValidationError(
                    f"shape {tuple(m.shape)} does not match response length {n}", trajectory_id=tid, field="loss_mask"
                )
            if m.dtype.is_floating_point and not bool(torch.isfinite(m).all()):
                raise ValidationError("contains non-finite values", trajectory_id=tid, field="loss_mask")
        if self.token_versions is not None:
            _check_1d_int(tid, "token_versions", self.token_versions, allow_empty=False)
            if self.token_versions.numel() != n:
                raise ValidationError(
                    f"length {self.token_versions.numel()} does not match response length {n}",
                    trajectory_id=tid,
                    field="token_versions",
                )
            lo = int(self.token_versions.min())
            if lo != self.gen_version:
                raise ValidationError(
                    f"gen_version {self.gen_version} must equal the oldest token version {lo}",
                    trajectory_id=tid,
                    field="gen_version",
                )
        if not isinstance(self.scalars, Mapping):
            raise FieldTypeError("must be a mapping of name to float", trajectory_id=tid, field="scalars")
        for k, v in self.scalars.items():
            fname = f"scalars.{k}"
            if not isinstance(k, str) or not k:
                raise ValidationError("scalar names must be non-empty strings", trajectory_id=tid, field=fname)
            try:
                finite = math.isfinite(_scalar_value(v))
            except OverflowError:  # an int beyond the float range
                finite = False
            except TypeError as e:
                raise FieldTypeError(str(e), trajectory_id=tid, field=fname) from None
            if not finite:
                raise ValidationError(f"must be finite, got {v!r:.40}", trajectory_id=tid, field=fname)
        if any(type(v) is not float for v in self.scalars.values()):
            # documented: scalars are floats; an int, a numpy scalar or a 0-d tensor becomes a float
            self.scalars = {k: _scalar_value(v) for k, v in self.scalars.items()}
        if not isinstance(self.tensors, Mapping):
            raise FieldTypeError("must be a mapping of name to tensor", trajectory_id=tid, field="tensors")
        for k, v in self.tensors.items():
            fname = f"tensors.{k}"
            if not isinstance(k, str) or not k or k in _RESERVED_TENSORS:
                raise ValidationError(
                    f"tensor names must be non-empty strings other than {_RESERVED_TENSORS}", trajectory_id=tid, field=fname
                )
            if not isinstance(v, torch.Tensor):
                raise FieldTypeError(f"expected a torch.Tensor, got {type(v).__name__}", trajectory_id=tid, field=fname)
            if v.dtype not in SUPPORTED_DTYPES:
                raise FieldTypeError(
                    f"dtype {v.dtype} cannot be stored (supported: bool, (u)int8-64, float16/32/64, bfloat16)",
                    trajectory_id=tid,
                    field=fname,
                )
            if v.dtype.is_floating_point and v.numel() and not bool(torch.isfinite(v).all()):
                raise ValidationError("contains non-finite values", trajectory_id=tid, field=fname)
        if not isinstance(self.media, (list, tuple)):
            raise FieldTypeError("must be a list of MediaItem", trajectory_id=tid, field="media")
        for i, item in enumerate(self.media):
            if not isinstance(item, MediaItem):
                raise FieldTypeError(
                    f"expected a MediaItem, got {type(item).__name__}", trajectory_id=tid, field=f"media[{i}]"
                )
            if item.tensor is not None and item.tensor.dtype not in SUPPORTED_DTYPES:
                raise FieldTypeError(
                    f"dtype {item.tensor.dtype} cannot be stored", trajectory_id=tid, field=f"media[{i}].tensor"
                )

    # ------------------------------------------------------------------ derived values
    @property
    def num_tokens(self) -> int:
        """Prompt plus response tokens."""
        return int(self.prompt_ids.numel() + self.response_ids.numel())

    @property
    def version_mean(self) -> float:
        """Token-weighted mean policy version (``gen_version`` without per-token versions)."""
        if self.token_versions is None:
            return float(self.gen_version)
        return float(self.token_versions.double().mean())

    @property
    def version_span(self) -> int:
        """Newest minus oldest token version (0 without per-token versions: one version generated it all)."""
        if self.token_versions is None or self.token_versions.numel() == 0:
            return 0
        return int(self.token_versions.max()) - int(self.token_versions.min())

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors and media payloads (the size a store accounts for)."""
        total = 0
        for t in (self.prompt_ids, self.response_ids, self.loss_mask, self.token_versions, *self.tensors.values()):
            if t is not None:
                total += t.numel() * t.element_size()
        return total + sum(m.nbytes for m in self.media)

    def meta(self, *, location: str | None = None, seq: int = -1) -> TrajectoryMeta:
        """Return the metadata view used by admission and planning.

        Args:
            location: Id of the storage unit holding the payload, if known.
            seq: Arrival sequence number (set by the pipeline).
        """
        return TrajectoryMeta(
            id=self.id,
            source=self.source,
            group=self.group,
            gen_version=self.gen_version,
            version_mean=self.version_mean,
            num_tokens=self.num_tokens,
            nbytes=self.nbytes,
            media_digests=tuple(m.digest for m in self.media),
            location=location,
            seq=seq,
            version_span=self.version_span,
        )

    def equals(self, other: Trajectory) -> bool:
        """Exact equality of every field, dtypes and shapes included."""

        def teq(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
            if a is None or b is None:
                return a is None and b is None
            return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))

        if (self.id, self.source, self.group, self.gen_version) != (other.id, other.source, other.group, other.gen_version):
            return False
        if dict(self.scalars) != dict(other.scalars) or set(self.tensors) != set(other.tensors):
            return False
        for name in ("prompt_ids", "response_ids", "loss_mask", "token_versions"):
            if not teq(getattr(self, name), getattr(other, name)):
                return False
        if not all(teq(v, other.tensors[k]) for k, v in self.tensors.items()):
            return False
        if len(self.media) != len(other.media):
            return False
        for a, b in zip(self.media, other.media):
            if (a.kind, a.digest, a.sample_rate, a.data) != (b.kind, b.digest, b.sample_rate, b.data):
                return False
            if not teq(a.tensor, b.tensor):
                return False
        return True


#: Layout of :attr:`TrajectoryMeta.packed`: ``num_tokens``, ``nbytes``, ``seq`` and ``hash(id)``, little-endian int64.
PACKED_META = struct.Struct("<qqqq")


@dataclass(frozen=True, slots=True)
class TrajectoryMeta:
    """What admission and planning know of a trajectory: no payload.

    Attributes:
        id: Trajectory id.
        source: Source name.
        group: Group id.
        gen_version: Oldest policy version among its tokens.
        version_mean: Token-weighted mean policy version.
        num_tokens: Prompt plus response tokens.
        nbytes: Payload size in bytes.
        media_digests: Content digests of its media items, in order.
        location: Id of the storage unit holding the payload (``None`` if not stored yet).
        seq: Arrival sequence number (monotonic per pipeline; ``-1`` if unknown).
        version_span: Newest minus oldest token version (a partial rollout continued under newer weights; 0
            when one version generated every token).
        packed: ``num_tokens``, ``nbytes``, ``seq`` and ``hash(id)`` as four little-endian int64
            (:data:`PACKED_META`), set at construction; ``None`` when a count is not an integer that fits. The
            planner reads a whole mini-batch of them as one buffer (``b"".join``, then ``numpy.frombuffer``)
            instead of a pass over the objects per field. ``hash(id)`` is this process's string hash: a meta
            unpickled or copied is built again, so it is never carried from another process. Not an
            argument, not compared, not in :meth:`to_dict`.
    """

    id: str
    source: str
    group: str
    gen_version: int = 0
    version_mean: float = 0.0
    num_tokens: int = 0
    nbytes: int = 0
    media_digests: tuple[str, ...] = ()
    location: str | None = None
    seq: int = -1
    version_span: int = 0
    packed: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            packed: bytes | None = PACKED_META.pack(self.num_tokens, self.nbytes, self.seq, hash(self.id))
        except (struct.error, TypeError, OverflowError):
            packed = None  # not int64 integers (or an unhashable id): the planner reads the fields themselves
        object.__setattr__(self, "packed", packed)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # rebuilt through __init__ where it is loaded: ``packed`` holds that process's hash of the id
        return (type(self), (self.id, self.source, self.group, self.gen_version, self.version_mean, self.num_tokens,
                             self.nbytes, self.media_digests, self.location, self.seq, self.version_span))

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serializable dict."""
        return {
            "id": self.id,
            "source": self.source,
            "group": self.group,
            "gen_version": self.gen_version,
            "version_mean": self.version_mean,
            "num_tokens": self.num_tokens,
            "nbytes": self.nbytes,
            "media_digests": list(self.media_digests),
            "location": self.location,
            "seq": self.seq,
            **({"version_span": self.version_span} if self.version_span else {}),  # partial rollouts only
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrajectoryMeta:
        """Inverse of :meth:`to_dict`; raises :class:`~knitdata.errors.ValidationError` on bad input."""
        try:
            return cls(
                id=str(d["id"]),
                source=str(d["source"]),
                group=str(d["group"]),
                gen_version=int(d.get("gen_version", 0)),
                version_mean=float(d.get("version_mean", d.get("gen_version", 0))),
                num_tokens=int(d.get("num_tokens", 0)),
                nbytes=int(d.get("nbytes", 0)),
                media_digests=tuple(str(x) for x in d.get("media_digests", ())),
                location=None if d.get("location") is None else str(d["location"]),
                seq=int(d.get("seq", -1)),
                version_span=int(d.get("version_span", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValidationError(f"bad trajectory metadata {dict(d)!r}: {e}", field="meta") from e


def metas_by_group(metas: Sequence[TrajectoryMeta]) -> dict[str, list[TrajectoryMeta]]:
    """Group metadata by ``group`` id, keeping arrival order within and across groups."""
    out: dict[str, list[TrajectoryMeta]] = {}
    for m in metas:
        out.setdefault(m.group, []).append(m)
    return out
