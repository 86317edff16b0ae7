"""A bounded on-disk spill store for trajectories, in webdataset tar shards, with random access.

Storage units spill here when they pass their memory capacity and reload on fetch. Each ``put`` appends one
sample (the same members as :mod:`knitdata.shards` exports: ``<id>.json``, ``<id>.<field>.npy``, media bytes)
to the active shard ``spill-NNNNNN.tar`` with one ``writev``; an in-memory index maps the id to its shard and
byte range, so ``get`` is one positional read and a zero-copy decode (no scan). Shards rotate at
``shard_maxsize`` and are deleted as soon as all their samples are released, so disk use stays bounded by
``max_bytes``: a put that would pass it raises :class:`~knitdata.errors.StoreFull` and stores nothing;
what was accepted is never dropped.

Releases are appended to ``released.log`` (``<shard> <offset> <id>`` lines), so :meth:`SpillStore.open`
(after a crash, or on a dead node's disk) rebuilds exactly the unreleased samples from the shards; an
incomplete last sample (torn write) is skipped with a warning and cut off, intact ones are recovered.
Everything is plain tar, JSON and ``.npy``: no pickle.
"""

from __future__ import annotations

import os
import re
import tarfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from knitdata.errors import CodecError, ConfigError, StoreFull, ValidationError
from knitdata.observe import trace as tracing
from knitdata.record import Trajectory
from knitdata.shards import MAX_JSON_BYTES, decode_sample, encode_sample, write_shards

__all__ = ["SpillStore", "recover"]

_BLOCK = 512
_EOA = 2 * _BLOCK  # tar end-of-archive marker
_SHARD_RE = re.compile(r"^spill-(\d{6,})\.tar$")
_LOG = "released.log"
_DIGITS = re.compile(r"^[0-9]{1,20}$")  # ASCII only: str.isdigit() accepts digits int() refuses


@dataclass
class _Entry:
    shard: int
    start: int  # offset of the sample's first tar header
    length: int  # bytes up to the end of its last member's data
    members: dict[str, tuple[int, int]]  # suffix -> (offset relative to start, size)


@dataclass
class _Shard:
    sid: int
    path: str
    fd: int
    size: int
    live: set[str] = field(default_factory=set)
    dead: set[tuple[int, str]] = field(default_factory=set)  # (offset, id) released, logged
    sealed: bool = False


def _pad(n: int) -> int:
    return -n % _BLOCK


def _ustar_header(name: str, size: int, mtime: int) -> bytes:
    """One tar header block (ustar), built directly; PAX via tarfile when the name or size does not fit."""
    raw = name.encode("utf-8")
    if len(raw) >= 100 or not raw.isascii() or size >= 8**11 or mtime >= 8**11:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode = size, mtime, 0o644
        ti.uname = ti.gname = "knitdata"
        return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    b = bytearray(_BLOCK)
    b[0 : len(raw)] = raw
    b[100:108] = b"0000644\0"
    b[108:116] = b"0000000\0"
    b[116:124] = b"0000000\0"
    b[124:136] = b"%011o\0" % size
    b[136:148] = b"%011o\0" % mtime
    b[148:156] = b"        "
    b[156:157] = b"0"
    b[257:265] = b"ustar\x0000"
    b[265:273] = b"knitdata"
    b[297:305] = b"knitdata"
    b[148:155] = b"%06o\0" % sum(b)
    return bytes(b)


class SpillStore:
    """Bounded, thread-safe, random-access spill of trajectories to tar shards.

    Args:
        directory: Directory of the shards (created if needed). It must not hold spill shards already: use
            :meth:`open` to recover those.
        max_bytes: Most bytes the shards may take on disk.
        shard_maxsize: Shard size after which a new shard starts (smaller: released space comes back sooner).
        fsync: ``fsync`` every put and release before returning (durable across power loss; slower).
        checksum: Store and verify CRC32s of members (and of the JSON header). Off, puts and gets skip the
            CRC32 cost (about as much as a page-cache write) and corruption on disk goes unnoticed.

    Raises:
        ConfigError: On bad limits, or when ``directory`` already holds spill shards.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int,
        shard_maxsize: int = 256 * 1024**2,
        fsync: bool = False,
        checksum: bool = True,
        _recovering: bool = False,
    ):
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ConfigError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if not isinstance(shard_maxsize, int) or shard_maxsize <= 0:
            raise ConfigError(f"shard_maxsize must be a positive int, got {shard_maxsize!r}")
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        if not _recovering and any(_SHARD_RE.match(n) for n in os.listdir(self.directory)):
            raise ConfigError(
                f"{self.directory!r} already holds spill shards; use SpillStore.open() to recover them, or remove them"
            )
        self.max_bytes = max_bytes
        self.shard_maxsize = shard_maxsize
        self.fsync = fsync
        self.checksum = checksum
        self._lock = threading.RLock()
        self._index: dict[str, _Entry] = {}
        self._shards: dict[int, _Shard] = {}
        self._active: _Shard | None = None
        self._next_sid = 0
        self._used = 0
        self._closed = False
        self._log_path = os.path.join(self.directory, _LOG)
        self._log_fd = -1
        self._log_lines = 0
        self.stats = {"puts": 0, "gets": 0, "put_bytes": 0, "get_bytes": 0, "shards_deleted": 0}

    # ------------------------------------------------------------------------------------ properties
    @property
    def used_bytes(self) -> int:
        """Bytes the shards take on disk now (released samples count until their shard is deleted)."""
        return self._used

    @property
    def live_bytes(self) -> int:
        """Bytes of the samples not yet released."""
        with self._lock:
            return sum(e.length for e in self._index.values())

    @property
    def num_shards(self) -> int:
        """Shard files on disk."""
        return len(self._shards)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, tid: object) -> bool:
        return tid in self._index

    def ids(self) -> list[str]:
        """Ids held, in spill order."""
        with self._lock:
            return list(self._index)

    # ------------------------------------------------------------------------------------ files
    def _new_shard(self) -> _Shard:
        sid = self._next_sid
        self._next_sid += 1
        path = os.path.join(self.directory, f"spill-{sid:06d}.tar")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        sh = _Shard(sid, path, fd, 0)
        self._shards[sid] = sh
        if self.fsync:
            self._fsync_dir()
        return sh

    def _fsync_dir(self) -> None:
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _seal(self, sh: _Shard) -> None:
        if sh.sealed:
            return
        os.write(sh.fd, bytes(_EOA))
        sh.size += _EOA
        self._used += _EOA
        if self.fsync:
            os.fsync(sh.fd)
        sh.sealed = True
        if self._active is sh:
            self._active = None

    def _drop_shard(self, sh: _Shard, *, count: bool = True) -> None:
        os.close(sh.fd)
        try:
            os.unlink(sh.path)
        except FileNotFoundError:
            pass
        self._used -= sh.size
        del self._shards[sh.sid]
        if self._active is sh:
            self._active = None
        if count:
            self.stats["shards_deleted"] += 1
        if self.fsync:
            self._fsync_dir()

    def _writeall(self, fd: int, bufs: list[Any]) -> None:
        views = [memoryview(b).cast("B") if not isinstance(b, bytes) else memoryview(b) for b in bufs]
        views = [v for v in views if len(v)]
        iov_max = 512
        while views:
            n = os.writev(fd, views[:iov_max])
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    # ------------------------------------------------------------------------------------ put / get
    def put(self, traj: Trajectory) -> int:
        """Spill one trajectory.

        Args:
            traj: The trajectory (its id must not be held already).

        Returns:
            The bytes it takes on disk.

        Raises:
            ValidationError: If the id is already held, or is not a safe shard key.
            StoreFull: If it would take the store past ``max_bytes`` (nothing is written).
        """
        t0 = tracing.now_us() if tracing.tracer is not None else 0.0
        sample = encode_sample(traj, checksum=self.checksum)  # outside the lock: pure
        mtime = int(time.time())
        bufs: list[Any] = []
        layout: list[tuple[str, int, int]] = []  # suffix, offset of data relative to sample start, size
        pos = 0
        for suffix, parts, size in sample.members:
            hdr = _ustar_header(f"{sample.key}.{suffix}", size, mtime)
            bufs.append(hdr)
            pos += len(hdr)
            layout.append((suffix, pos, size))
            bufs.extend(parts)
            pos += size
            if _pad(size):
                bufs.append(bytes(_pad(size)))
                pos += _pad(size)
        length = layout[-1][1] + layout[-1][2]
        with self._lock:
            self._check_open()
            if sample.key in self._index:
                raise ValidationError("already held by the spill store; release it first", trajectory_id=sample.key)
            sh = self._active
            rotate = sh is not None and sh.size >= self.shard_maxsize
            # this sample + the old shard's end marker if it rotates + the end marker kept in reserve for
            # the shard it lands in (so sealing never passes max_bytes)
            need = pos + (_EOA if rotate else 0) + _EOA
            if self._used + need > self.max_bytes:
                raise StoreFull(
                    f"spill store {self.directory!r} holds {self._used} of its {self.max_bytes} bytes on disk; "
                    f"trajectory {sample.key!r} needs {need} more: release trajectories or raise max_bytes"
                )
            if rotate:
                assert sh is not None
                self._seal(sh)
                if not sh.live:
                    self._drop_shard(sh)
                sh = None
            if sh is None:
                sh = self._active = self._new_shard()
            start = sh.size
            try:
                self._writeall(sh.fd, bufs)
                if self.fsync:
                    os.fsync(sh.fd)
            except OSError as e:
                os.ftruncate(sh.fd, start)  # nothing half-written stays behind
                raise StoreFull(f"spill store {self.directory!r}: writing {sample.key!r} failed: {e}") from e
            sh.size += pos
            self._used += pos
            sh.live.add(sample.key)
            self._index[sample.key] = _Entry(sh.sid, start, length, {s: (o, n) for s, o, n in layout})
            self.stats["puts"] += 1
            self.stats["put_bytes"] += pos
        if tracing.tracer is not None:
            tracing.tracer.span("spill", "storage", t0, tracing.now_us(),
                                {"trajectory": sample.key, "bytes": pos, "store": os.path.basename(self.directory)})
        return pos

    def _read(self, tid: str) -> tuple[_Entry, bytearray]:
        with self._lock:
            self._check_open()
            e = self._index.get(tid)
            if e is None:
                raise KeyError(f"trajectory {tid!r} is not in the spill store {self.directory!r}")
            fd = self._shards[e.shard].fd
            buf = bytearray(e.length)
            mv = memoryview(buf)
            got = 0
            while got < e.length:
                n = os.preadv(fd, [mv[got:]], e.start + got)
                if n == 0:
                    raise CodecError(
                        f"spill shard {self._shards[e.shard].path!r}, sample {tid!r}: file ends after "
                        f"{e.start + got} bytes (truncated)"
                    )
                got += n
            self.stats["gets"] += 1
            self.stats["get_bytes"] += e.length
        return e, buf

    def get(self, tid: str) -> Trajectory:
        """Load a spilled trajectory (one positional read, zero-copy decode). It stays in the store.

        Raises:
            KeyError: If the id is not held.
            CodecError: If its bytes on disk are corrupted (checksum) or truncated.
        """
        e, buf = self._read(tid)
        mv = memoryview(buf)
        members = {s: mv[o : o + n] for s, (o, n) in e.members.items()}
        path = self._shards_path(e.shard)
        # our own bytes of a trajectory validated when it was put (CRC-checked unless checksum=False):
        # no second validation pass
        traj, _h = decode_sample(tid, members, where=path, verify=self.checksum, validate=False)
        return traj

    def _shards_path(self, sid: int) -> str:
        return os.path.join(self.directory, f"spill-{sid:06d}.tar")

    def export(self, pattern: str, **kwargs: Any) -> list[str]:
        """Write the held trajectories, in spill order, to webdataset shards; see :func:`~knitdata.shards.write_shards`."""
        return write_shards((self.get(i) for i in self.ids()), pattern, **kwargs)

    def pop(self, tid: str) -> Trajectory:
        """:meth:`get` then :meth:`release` (the release happens only once the load succeeded)."""
        traj = self.get(tid)
        self.release(tid)
        return traj

    def release(self, tid: str) -> bool:
        """Forget a trajectory; its shard is deleted once all its samples are released.

        Returns:
            ``True`` if it was held, ``False`` if not (idempotent).
        """
        with self._lock:
            self._check_open()
            e = self._index.pop(tid, None)
            if e is None:
                return False
            sh = self._shards[e.shard]
            sh.live.discard(tid)
            if not sh.live:
                self._drop_shard(sh)  # every sample released: the file goes, tombstones are moot
            else:
                sh.dead.add((e.start, tid))
                self._log_release(sh.sid, e.start, tid)
            return True

    def delete(self, tid: str) -> None:
        """Like :meth:`release`, but raise ``KeyError`` if the id is not held."""
        if not self.release(tid):
            raise KeyError(f"trajectory {tid!r} is not in the spill store {self.directory!r}")

    # ------------------------------------------------------------------------------------ release log
    def _log_release(self, sid: int, offset: int, tid: str) -> None:
        if self._log_fd < 0:
            self._log_fd = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self._log_fd, f"{sid} {offset} {tid}\n".encode())
        self._log_lines += 1
        if self.fsync:
            os.fsync(self._log_fd)
        live_lines = sum(len(s.dead) for s in self._shards.values())
        if self._log_lines > 2 * live_lines + 4096:
            self._rewrite_log()

    def _rewrite_log(self) -> None:
        tmp = self._log_path + ".tmp"
        lines = [f"{s.sid} {o} {t}\n" for s in self._shards.values() for o, t in sorted(s.dead)]
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, self._log_path)
        if self._log_fd >= 0:
            os.close(self._log_fd)
        self._log_fd = os.open(self._log_path, os.O_WRONLY | os.O_APPEND)
        self._log_lines = len(lines)

    # ------------------------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise ValidationError(f"spill store {self.directory!r} is closed")

    def flush(self) -> None:
        """``fsync`` the active shard and the release log."""
        with self._lock:
            if self._active is not None:
                os.fsync(self._active.fd)
            if self._log_fd >= 0:
                os.fsync(self._log_fd)

    def close(self) -> None:
        """Close the files (shards stay on disk for :meth:`open`)."""
        with self._lock:
            if self._closed:
                return
            for sh in list(self._shards.values()):
                os.close(sh.fd)
            if self._log_fd >= 0:
                os.close(self._log_fd)
            self._closed = True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter shutdown
            pass

    def __enter__(self) -> SpillStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ recovery
    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        shard_maxsize: int = 256 * 1024**2,
        fsync: bool = False,
        checksum: bool = True,
        verify: bool = True,
        repair: bool = True,
    ) -> SpillStore:
        """Rebuild a store from the shards in ``directory`` (e.g. after its process or node died).

        Samples released before the crash (``released.log``) are not brought back. An incomplete or corrupted
        sample is skipped with a warning (intact ones are recovered); with ``repair``, a torn tail is cut off
        the shard so it is a clean tar again. New puts go to a new shard.

        Args:
            directory: The spill directory.
            max_bytes: Disk bound from now on; default: the larger of what is on disk and 1 GiB.
            shard_maxsize: See :class:`SpillStore`.
            fsync: See :class:`SpillStore`.
            checksum: See :class:`SpillStore`.
            verify: Read every sample and check its CRC32s (else only tar headers and JSON headers are read).
            repair: Truncate torn tails and complete shards' end markers.

        Returns:
            The recovered store.
        """
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise ConfigError(f"spill directory {directory!r} does not exist")
        names = sorted((int(m.group(1)), n) for n in os.listdir(directory) if (m := _SHARD_RE.match(n)))
        on_disk = sum(os.path.getsize(os.path.join(directory, n)) for _, n in names)
        store = cls(
            directory,
            max_bytes=max_bytes if max_bytes is not None else max(on_disk + _EOA, 1024**3),
            shard_maxsize=shard_maxsize,
            fsync=fsync,
            checksum=checksum,
            _recovering=True,
        )
        released: set[tuple[int, int, str]] = set()
        log_path = os.path.join(directory, _LOG)
        if os.path.exists(log_path):
            with open(log_path, encoding="utf-8", errors="surrogateescape") as f:
                for line in f:
                    parts = line.rstrip("\n").split(" ", 2)
                    if len(parts) == 3 and _DIGITS.match(parts[0]) and _DIGITS.match(parts[1]):
                        released.add((int(parts[0]), int(parts[1]), parts[2]))
        for sid, name in names:
            store._recover_shard(sid, os.path.join(directory, name), released, verify=verify, repair=repair)
            store._next_sid = max(store._next_sid, sid + 1)
        for sh in list(store._shards.values()):
            if not sh.live:  # nothing left to recover in it
                store._drop_shard(sh, count=False)
        store._rewrite_log()
        return store

    def _recover_shard(
        self, sid: int, path: str, released: set[tuple[int, int, str]], *, verify: bool, repair: bool
    ) -> None:
        samples, _end, problem = _scan(path)
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
        size = os.fstat(fd).st_size
        sh = _Shard(sid, path, fd, size, sealed=True)
        self._shards[sid] = sh
        self._used += size
        kept_end = 0
        for key, start, members in samples:
            length = max(o + n for o, n in members.values())
            entry = _Entry(sid, start, length, members)
            if (sid, start, key) in released:
                sh.dead.add((start, key))
                kept_end = start + length
                continue
            try:
                if verify:
                    mv = memoryview(_pread(fd, start, length))
                    decode_sample(key, {s: mv[o : o + n] for s, (o, n) in members.items()}, where=path, verify=True)
                else:
                    _check_manifest(key, members, fd, start, path)
            except CodecError as e:
                warnings.warn(f"spill recovery: skipping sample {key!r} of {path!r}: {e}", RuntimeWarning, stacklevel=3)
                problem = problem or str(e)
                continue
            kept_end = start + length
            old = self._index.get(key)
            if old is not None:  # a later copy wins (re-put after a release whose log line was lost)
                self._shards[old.shard].live.discard(key)
                self._shards[old.shard].dead.add((old.start, key))
            self._index[key] = entry
            sh.live.add(key)
        if problem is not None:
            warnings.warn(f"spill recovery: {path!r}: {problem}", RuntimeWarning, stacklevel=3)
            if repair:
                end = kept_end + _pad(kept_end)
                os.ftruncate(fd, end)
                os.write(fd, bytes(_EOA))
                self._used += end + _EOA - size
                sh.size = end + _EOA


def _pread(fd: int, start: int, length: int) -> bytearray:
    buf = bytearray(length)
    mv = memoryview(buf)
    got = 0
    while got < length:
        n = os.preadv(fd, [mv[got:]], start + got)
        if n == 0:
            raise CodecError(f"file ends at byte {start + got}, sample needs {start + length}")
        got += n
    return buf


def _check_manifest(key: str, members: dict[str, tuple[int, int]], fd: int, start: int, path: str) -> None:
    """Check a sample is complete from its JSON manifest (reads only the JSON member)."""
    import json

    if "json" not in members:
        raise CodecError(f"shard {path!r}, sample {key!r}: no JSON header member")
    o, n = members["json"]
    if n > MAX_JSON_BYTES:
        raise CodecError(f"shard {path!r}, sample {key!r}: JSON header of {n} bytes exceeds {MAX_JSON_BYTES}")
    try:
        header = json.loads(bytes(_pread(fd, start + o, n)).decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError
        raise CodecError(f"shard {path!r}, sample {key!r}: bad JSON header: {e}") from e
    manifest = header.get("members") if isinstance(header, dict) else None
    if not isinstance(manifest, dict) or not all(
        isinstance(spec, list) and len(spec) == 2 and type(spec[0]) is int for spec in manifest.values()
    ):
        raise CodecError(f"shard {path!r}, sample {key!r}: bad JSON header: no valid member manifest")
    bad = [m for m, spec in manifest.items() if m not in members or members[m][1] != spec[0]]
    if bad or header.get("id") != key:
        raise CodecError(f"shard {path!r}, sample {key!r}: incomplete sample, missing or short members {bad}")


def _scan(path: str) -> tuple[list[tuple[str, int, dict[str, tuple[int, int]]]], int | None, str | None]:
    """Read tar headers of one shard: ``(samples, end of the last complete member, problem or None)``.

    Each sample is ``(key, start, {suffix: (offset relative to start, size)})``.
    """
    out: list[tuple[str, int, dict[str, tuple[int, int]]]] = []
    problem: str | None = None
    end: int | None = 0
    fsize = os.path.getsize(path)
    with open(path, "rb") as f:
        try:
            tf = tarfile.open(fileobj=f, mode="r:")
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            return [], 0, f"not a readable tar: {e}"
        key: str | None = None
        start = 0
        cur: dict[str, tuple[int, int]] = {}
        while True:
            try:
                ti = tf.next()
            except (tarfile.TarError, OSError, EOFError, ValueError) as e:  # ValueError: defence in depth
                problem = f"broken after byte {end}: {e}"
                break
            tf.members = []  # type: ignore[attr-defined]  # typeshed omits TarFile.members
            if ti is None:
                break
            if ti.offset_data + ti.size > fsize:
                problem = f"member {ti.name!r} is truncated ({fsize - ti.offset_data} of {ti.size} bytes)"
                break
            name = os.path.basename(ti.name)
            k, dot, suffix = name.partition(".")
            if not ti.isreg() or not dot:
                continue
            if k != key:
                if key is not None:
                    out.append((key, start, cur))
                key, start, cur = k, ti.offset, {}
            cur[suffix] = (ti.offset_data - start, ti.size)
            end = ti.offset_data + ti.size
        if key is not None:
            out.append((key, start, cur))
        if problem is None and end is not None:
            rest = fsize - (end + _pad(end))
            f.seek(end + _pad(end))
            tail = f.read(rest) if rest <= 1 << 20 else f.read(1 << 20) + b"x"
            if tail.count(0) != len(tail):
                problem = f"unreadable bytes after byte {end} (torn write?)"
    return out, end, problem


def recover(directory: str | os.PathLike[str], **kwargs: Any) -> SpillStore:
    """Rebuild a :class:`SpillStore` from the shards in ``directory``; see :meth:`SpillStore.open`."""
    return SpillStore.open(directory, **kwargs)
