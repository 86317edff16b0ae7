"""Reading shards: tar members of one shard (bounded, seek-skipping), sample counts, trajectories, replays."""

from __future__ import annotations

import io
import os
import tarfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

from knitdata.codec import is_count
from knitdata.errors import CodecError, ConfigError
from knitdata.record import Trajectory
from knitdata.shards.format import ReplayInfo, decode_sample

__all__ = [
    "BrokenShardError",
    "DEFAULT_MAX_MEMBER_BYTES",
    "OnError",
    "expand_urls",
    "iter_shard_samples",
    "count_samples",
    "read_shards",
    "read_admitted_batches",
]

#: Read size for members of non-seekable shard streams.
_STREAM_CHUNK = 1 << 20
#: Default largest member accepted when reading (a declared size above it is refused before reading).
DEFAULT_MAX_MEMBER_BYTES = 8 * 1024**3

#: What a reader does with a bad sample: ``"raise"``, ``"skip"`` or a callable given the error.
OnError = str | Callable[[Exception], Any]


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


class BrokenShardError(CodecError):
    """A shard's tar stream itself is broken (a truncated member or a corrupted header): nothing after that point in
    the shard can be read. The message names the shard, the sample and the member; samples before it were intact.
    With ``on_error="skip"`` (or a callable) the reader goes on with the next shard; a callable can tell this
    (the rest of the shard lost) from a single bad sample (a plain :class:`~knitdata.errors.CodecError`)."""


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
            raise BrokenShardError(
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
        BrokenShardError: If the tar structure is broken (truncated member or header); samples yielded before
            it were intact.
        CodecError: A member over ``max_member_bytes``.
    """
    f, seekable = _open(url)
    try:
        try:
            tf = tarfile.open(fileobj=f, mode="r:" if seekable else "r|*")
        except tarfile.TarError as e:
            raise BrokenShardError(f"shard {url!r}: not a readable tar file: {e}") from e
        index = -1
        key: str | None = None
        cur: dict[str, bytearray] = {}
        while True:
            try:
                ti = tf.next()
            except (tarfile.TarError, OSError, EOFError) as e:
                raise BrokenShardError(
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
                raise BrokenShardError(
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
                raise BrokenShardError(
                    f"shard {url!r}, sample {k!r}: member {name!r} is truncated or unreadable: {e}"
                ) from e
            if n != ti.size:
                raise BrokenShardError(
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
        fields = [v for v in raw if is_count(v)]
        if len(fields) != len(raw) or fields[3] >= fields[4]:
            _handle(on_error, CodecError(f"sample {traj.id!r}: bad replay information {r!r:.300}"))
            continue
        info = ReplayInfo(*fields)
        if cur and cur[0][0].step != info.step:
            yield from flush()
        cur.append((info, traj))
    yield from flush()


# ----------------------------------------------------------------------------------------- dataset
