"""A durable, append-only journal of the control plane's decisions (JSON lines with a CRC32 each; no pickle).

The control plane is deterministic: the same sequence of calls (puts admitted, withdrawals,
versions, commits, hand-outs) gives the same admissions, the same plans and the same positions. So the
journal records the calls that change its state, in the order they were applied, and a restarted
coordinator replays them into a fresh :class:`~knitdata.control.ControlPlane` to get its state back.

Format: one record per line, ``<json>\\t<crc32 of the json, 8 hex digits>\\n``; the JSON is
``{"op": <method name>, "args": [...]}`` (the plane replays the names of
:data:`knitdata.control.plane.JOURNALED_OPS`, derived from the control surface). Lines are flushed to the
operating system as they are written (a killed process loses nothing it acknowledged) and ``fsync``-ed every ``fsync_every_s`` seconds and on close
(a machine crash loses at most that much). A torn last line (a crash inside a write) is detected by its CRC
and dropped on replay, as is anything after it, and cut off when the journal is opened again (so that new
records never follow a torn one); any other malformed line is a :class:`~knitdata.errors.CodecError`.

Compaction. The journal is a sequence of *segments*; the file holds the current one, which starts with a
header line ``{"segment": k, "run": <run id>}`` (a journal written before segments existed has no header
and is segment 0 of an unnamed run). :meth:`Journal.compact` writes the plane's state as a *snapshot* next
to the journal (``<path>.snapshot``: one checksummed JSON line recording the run, the segment and how many
of its records it covers; written to a temporary file, ``fsync``-ed and renamed) and then starts segment
``k + 1`` (its header written to a temporary file, ``fsync``-ed and renamed over the journal). A crash
between the two steps leaves segment ``k`` in place: recovery then skips the records the snapshot covers.
:func:`recovery_plan` says which snapshot to load and how many records to skip.

Example:
    >>> import tempfile, os
    >>> j = Journal(os.path.join(tempfile.mkdtemp(), "run.journal"))
    >>> j.append("report_version", [3])
    >>> list(Journal.read(j.path))
    [('report_version', [3])]
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from knitdata.errors import CodecError, ConfigError

__all__ = ["Journal", "SNAPSHOT_SUFFIX", "RecoveryPlan", "recovery_plan", "read_snapshot",
           "write_snapshot", "dumps_strict", "loads_strict"]

#: The snapshot of a journal at ``path`` is ``path + SNAPSHOT_SUFFIX``.
SNAPSHOT_SUFFIX = ".snapshot"
_MAX_LINE = 64 << 20
_MAX_SNAPSHOT = 4 << 30


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number knitdata writes")


def loads_strict(data: bytes | str) -> Any:
    """``json.loads`` that refuses ``NaN``/``Infinity`` and over-deep nesting with ``ValueError``."""
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except RecursionError as e:
        raise ValueError("nested too deeply") from e


def dumps_strict(obj: Any) -> bytes:
    """Compact JSON bytes; ``NaN``/``Infinity`` raise ``ValueError``."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _frame(body: bytes) -> bytes:
    return body + b"\t" + f"{zlib.crc32(body) & 0xFFFFFFFF:08x}".encode() + b"\n"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path)


def _is_header(rec: Any) -> bool:
    return isinstance(rec, dict) and "segment" in rec and "op" not in rec


def _check_header(rec: dict[str, Any], path: str) -> tuple[str | None, int]:
    seg, run = rec.get("segment"), rec.get("run")
    if (set(rec) != {"segment", "run"} or isinstance(seg, bool) or not isinstance(seg, int) or seg < 0
            or not isinstance(run, str) or not run):
        raise CodecError(f"journal {path!r}: malformed segment header {str(rec)[:200]}; the journal is damaged")
    return run, seg


class Journal:
    """Append-only journal file of one pipeline's control plane (thread-safe).

    Args:
        path: The journal file (created with its directory if missing; appended to if it exists, after
            cutting off a torn last line).
        fsync_every_s: Longest time between ``fsync`` calls (``0``: after every record).
        compact_every: Records of a segment after which :attr:`compaction_due` turns true (the control plane
            then compacts: :meth:`compact`); ``0``: never automatically.

    Attributes:
        run: The run id in the segment headers (``None`` for a journal without one, until it is compacted).
        segment: The current segment's number.
        records: Records in the current segment.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync_every_s: float = 1.0,
                 compact_every: int = 10_000) -> None:
        self.path = os.fspath(path)
        if not self.path:
            raise ConfigError("the journal needs a file path")
        if isinstance(compact_every, bool) or not isinstance(compact_every, int) or compact_every < 0:
            raise ConfigError(f"compact_every must be a non-negative int, got {compact_every!r}")
        self.compact_every = compact_every
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.run, self.segment, self.records = self._open_existing()
        if self.run is None and self.records == 0:  # a new journal (or one torn inside its header)
            self.run = uuid.uuid4().hex
            _write_atomic(self.path, _frame(dumps_strict({"segment": 0, "run": self.run})))
        self._f = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()
        self._fsync_every = float(fsync_every_s)
        self._last_sync = time.monotonic()
        self._next_compaction = compact_every

    def _open_existing(self) -> tuple[str | None, int, int]:
        """Read the header and count the records of an existing journal; cut off a torn last line."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None, 0, 0
        lines = data.split(b"\n")
        last = len(lines) - 1  # the last non-empty line: torn if it does not parse (a crash inside its write)
        while last >= 0 and not lines[last]:
            last -= 1
        if last >= 0:
            try:
                torn = _parse_line(lines[last], last + 1, self.path, torn_ok=True) is None
            except CodecError:  # intact but malformed: damage, which reading reports
                torn = False
            if torn:
                with open(self.path, "r+b") as f:
                    f.truncate(sum(len(x) + 1 for x in lines[:last]))
                    f.flush()
                    os.fsync(f.fileno())
                lines = lines[:last]
            elif not data.endswith(b"\n"):
                with open(self.path, "ab") as f:
                    f.write(b"\n")
        run: str | None = None
        seg = 0
        n = sum(1 for x in lines if x)
        if lines and lines[0]:
            try:
                rec = _parse_line(lines[0], 1, self.path, torn_ok=False)
            except CodecError:  # reading reports it
                rec = None
            if rec is not None and rec[0] == "":
                run, seg = rec[1]
                n -= 1
        return run, seg, n

    @property
    def compaction_due(self) -> bool:
        """Whether the current segment holds ``compact_every`` records or more (automatic compaction)."""
        return self.compact_every > 0 and self.records >= self._next_compaction

    def append(self, op: str, args: Sequence[Any]) -> None:
        """Write one record (a call of ``op`` with JSON-serializable ``args``)."""
        line = _frame(dumps_strict({"op": op, "args": list(args)}))
        with self._lock:
            self._f.write(line)
            self._f.flush()
            self.records += 1
            now = time.monotonic()
            if now - self._last_sync >= self._fsync_every:
                os.fsync(self._f.fileno())
                self._last_sync = now

    def compact(self, state: Mapping[str, Any]) -> None:
        """Write ``state`` (covering every record so far) as the snapshot and start the next segment.

        The caller holds off new records meanwhile (the control plane calls it under its lock). On an
        ``OSError`` the journal stays as it was (the snapshot may be written; it covers the records so far
        and recovery skips them) and the next automatic attempt is ``compact_every`` records later.
        """
        with self._lock:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
                if self.run is None:
                    self.run = uuid.uuid4().hex
                write_snapshot(self.path + SNAPSHOT_SUFFIX, state, run=self.run, segment=self.segment,
                               records=self.records)
                tmp = f"{self.path}.tmp"
                with open(tmp, "wb") as f:
                    f.write(_frame(dumps_strict({"segment": self.segment + 1, "run": self.run})))
                    f.flush()
                    os.fsync(f.fileno())
                self._f.close()
                os.replace(tmp, self.path)
                _fsync_dir(self.path)
            except OSError:
                self._next_compaction = self.records + max(self.compact_every, 1)
                if self._f.closed:
                    self._f = open(self.path, "ab")  # noqa: SIM115 - closed by close()
                raise
            self._f = open(self.path, "ab")  # noqa: SIM115 - closed by close()
            self.segment += 1
            self.records = 0
            self._next_compaction = self.compact_every
            self._last_sync = time.monotonic()

    def close(self) -> None:
        """Flush, ``fsync`` and close (idempotent)."""
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                os.fsync(self._f.fileno())
                self._f.close()

    @staticmethod
    def read_header(path: str | os.PathLike[str]) -> tuple[str | None, int]:
        """``(run id, segment)`` of the journal at ``path``: ``(None, 0)`` without a header (or a file).

        Raises:
            CodecError: A damaged header.
        """
        try:
            with open(path, "rb") as f:
                first = f.readline(_MAX_LINE + 1)
        except FileNotFoundError:
            return None, 0
        raw = first.rstrip(b"\n")
        if not raw:
            return None, 0
        rec = _parse_line(raw, 1, os.fspath(path), torn_ok=not first.endswith(b"\n"))
        if rec is not None and rec[0] == "":
            return rec[1]  # type: ignore[return-value]
        return None, 0

    @staticmethod
    def read(path: str | os.PathLike[str]) -> Iterator[tuple[str, list[Any]]]:
        """The records of a journal's current segment, in order: ``(op, args)``. A torn last line is dropped.

        Raises:
            CodecError: A malformed record that is not the last line (the file was damaged, not torn).
        """
        try:
            with open(path, "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:
            return
        p = os.fspath(path)
        final = len(lines) - 1  # the last non-empty line (only it may be torn)
        while final >= 0 and not lines[final]:
            final -= 1
        for n, raw in enumerate(lines):
            if not raw:
                continue
            rec = _parse_line(raw, n + 1, p, torn_ok=n == final)
            if rec is None:
                return
            if rec[0] == "":
                if n != 0:
                    raise CodecError(f"journal {p!r} line {n + 1}: a segment header inside the segment; the journal "
                                     "is damaged")
                continue
            yield rec  # type: ignore[misc]


def _parse_line(raw: bytes, lineno: int, path: str, *, torn_ok: bool) -> tuple[str, Any] | None:
    """``(op, args)``, or ``("", (run, segment))`` for a segment header, or ``None`` for a torn line."""
    def bad(why: str) -> None:
        if not torn_ok:
            raise CodecError(f"journal {path!r} line {lineno}: {why}; the journal is damaged")

    if len(raw) > _MAX_LINE:
        bad(f"a record of {len(raw)} bytes (at most {_MAX_LINE})")
        return None
    body, sep, crc = raw.rpartition(b"\t")
    if not sep or len(crc) != 8:
        bad("no checksum")
        return None
    try:
        want = int(crc, 16)
    except ValueError:
        bad("the checksum is not hexadecimal")
        return None
    if zlib.crc32(body) & 0xFFFFFFFF != want:
        bad("checksum mismatch")
        return None
    try:
        rec = loads_strict(body)
    except (ValueError, UnicodeDecodeError):
        bad("not JSON (or NaN/Infinity)")
        return None
    if _is_header(rec):
        if lineno != 1:
            raise CodecError(f"journal {path!r} line {lineno}: a segment header inside the segment; the journal "
                             "is damaged")
        return "", _check_header(rec, path)
    if not isinstance(rec, dict) or not isinstance(rec.get("op"), str) or not isinstance(rec.get("args"), list):
        raise CodecError(f"journal {path!r} line {lineno}: a record must be {{'op': str, 'args': list}}, got "
                         f"{str(rec)[:100]}")
    if not rec["op"].isidentifier():
        raise CodecError(f"journal {path!r} line {lineno}: operation {rec['op'][:100]!r} is not a method name")
    return rec["op"], rec["args"]


# ---------------------------------------------------------------------------------------------- snapshots
def write_snapshot(path: str | os.PathLike[str], state: Mapping[str, Any], *, run: str, segment: int,
                   records: int) -> None:
    """Write a snapshot atomically (temporary file, ``fsync``, rename): one checksummed JSON line."""
    body = dumps_strict({"snapshot": 1, "run": run, "segment": int(segment), "records": int(records),
                         "state": dict(state)})
    _write_atomic(os.fspath(path), _frame(body))


def read_snapshot(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The snapshot at ``path`` (``{"run", "segment", "records", "state"}``), or ``None`` if there is none.

    Raises:
        CodecError: A damaged snapshot (framing, checksum, JSON, structure of the envelope); the state itself
            is checked by whoever loads it.
    """
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            data = f.read(_MAX_SNAPSHOT + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CodecError(f"snapshot {p!r} cannot be read: {e}") from e
    if len(data) > _MAX_SNAPSHOT:
        raise CodecError(f"snapshot {p!r} is larger than {_MAX_SNAPSHOT} bytes; it is damaged")
    if not data.endswith(b"\n") or b"\n" in data[:-1]:
        raise CodecError(f"snapshot {p!r} is not one complete line; it is damaged (truncated?)")
    body, sep, crc = data[:-1].rpartition(b"\t")
    try:
        want = int(crc, 16) if sep and len(crc) == 8 else None
    except ValueError:
        want = None
    if want is None or zlib.crc32(body) & 0xFFFFFFFF != want:
        raise CodecError(f"snapshot {p!r}: checksum missing or mismatched; it is damaged")
    try:
        snap = loads_strict(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise CodecError(f"snapshot {p!r} is not JSON ({e}); it is damaged") from e
    ok = (isinstance(snap, dict) and set(snap) == {"snapshot", "run", "segment", "records", "state"}
          and snap["snapshot"] == 1 and isinstance(snap["run"], str) and bool(snap["run"])
          and all(isinstance(snap[k], int) and not isinstance(snap[k], bool) and snap[k] >= 0
                  for k in ("segment", "records"))
          and isinstance(snap["state"], dict))
    if not ok:
        raise CodecError(f"snapshot {p!r}: not a knitdata journal snapshot (version 1): {str(snap)[:200]}")
    return snap


@dataclass(frozen=True)
class RecoveryPlan:
    """What recovering a journal takes: the snapshot state to load (or ``None``) and the records to skip.

    Attributes:
        state: The snapshot's state, or ``None`` for a full replay of the journal.
        skip: Records at the start of the journal's segment that the snapshot covers already.
    """

    state: dict[str, Any] | None
    skip: int


def recovery_plan(path: str | os.PathLike[str]) -> RecoveryPlan:
    """Decide how to recover the journal at ``path`` from its snapshot (``path + SNAPSHOT_SUFFIX``).

    Segment 0 needs no snapshot: one of the same run covering part of it is used (a crash between the
    snapshot and the rotation), any other (a deleted journal's, a damaged one) is ignored. A later segment
    needs the snapshot of its run taken at the end of the previous segment (or within this one).

    Raises:
        CodecError: The journal depends on a snapshot that is missing, damaged or of another run or segment.
    """
    p = os.fspath(path)
    run, seg = Journal.read_header(p)
    spath = p + SNAPSHOT_SUFFIX
    try:
        snap = read_snapshot(spath)
        err: CodecError | None = None
    except CodecError as e:
        snap, err = None, e
    if seg == 0:
        if snap is not None and run is not None and snap["run"] == run and snap["segment"] == 0:
            return RecoveryPlan(snap["state"], snap["records"])
        return RecoveryPlan(None, 0)
    where = f"journal {p!r} (segment {seg} of run {run})"
    if err is not None:
        raise CodecError(f"{where} continues from its snapshot, which is damaged: {err}") from err
    if snap is None:
        raise CodecError(f"{where} continues from a snapshot at {spath!r}, which is missing; the records before "
                         "this segment are gone, so the state cannot be rebuilt")
    if snap["run"] != run:
        raise CodecError(f"{where} continues from a snapshot, but {spath!r} belongs to run {snap['run']}")
    if snap["segment"] == seg:
        return RecoveryPlan(snap["state"], snap["records"])
    if snap["segment"] == seg - 1:
        return RecoveryPlan(snap["state"], 0)
    raise CodecError(f"{where} continues from the snapshot of segment {seg - 1}, but {spath!r} is of segment "
                     f"{snap['segment']}")
