"""A durable, append-only journal of the control plane's decisions (JSON lines with a CRC32 each; no pickle).

The control plane is deterministic: the same sequence of calls (puts reserved and offered, withdrawals,
versions, commits, hand-outs) gives the same admissions, the same plans and the same positions. So the
journal records the calls that change its state, in the order they were applied, and a restarted
coordinator replays them into a fresh :class:`~knitdata.control.ControlPlane` to get its state back.

Format: one record per line, ``<json>\\t<crc32 of the json, 8 hex digits>\\n``; the JSON is
``{"op": <method name>, "args": [...]}``. Lines are flushed to the operating system as they are written (a
killed process loses nothing it acknowledged) and ``fsync``-ed every ``fsync_every_s`` seconds and on close
(a machine crash loses at most that much). A torn last line (a crash inside a write) is detected by its CRC
and dropped on replay, as is anything after it; any other malformed line is a :class:`~knitdata.errors.CodecError`.

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
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from knitdata.errors import CodecError, ConfigError

__all__ = ["Journal", "JOURNALED_OPS"]

#: The control-plane methods whose calls are journaled (every call that can change its state).
JOURNALED_OPS: frozenset[str] = frozenset({
    "admit_many", "admit_batches", "reserve", "reserve_many", "unreserve", "offer", "offer_many", "set_in_flight", "withdraw", "report_version",
    "close", "handed", "commit", "seek",
})
_MAX_LINE = 64 << 20


class Journal:
    """Append-only journal file of one pipeline's control plane (thread-safe).

    Args:
        path: The journal file (created with its directory if missing; appended to if it exists).
        fsync_every_s: Longest time between ``fsync`` calls (``0``: after every record).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync_every_s: float = 1.0) -> None:
        self.path = os.fspath(path)
        if not self.path:
            raise ConfigError("the journal needs a file path")
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._f = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()
        self._fsync_every = float(fsync_every_s)
        self._last_sync = time.monotonic()
        self.records = 0

    def append(self, op: str, args: Sequence[Any]) -> None:
        """Write one record (a call of ``op`` with JSON-serializable ``args``)."""
        body = json.dumps({"op": op, "args": list(args)}, separators=(",", ":"), allow_nan=False).encode()
        line = body + b"\t" + f"{zlib.crc32(body) & 0xFFFFFFFF:08x}".encode() + b"\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()
            self.records += 1
            now = time.monotonic()
            if now - self._last_sync >= self._fsync_every:
                os.fsync(self._f.fileno())
                self._last_sync = now

    def close(self) -> None:
        """Flush, ``fsync`` and close (idempotent)."""
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                os.fsync(self._f.fileno())
                self._f.close()

    @staticmethod
    def read(path: str | os.PathLike[str]) -> Iterator[tuple[str, list[Any]]]:
        """The records of a journal, in order: ``(op, args)``. A torn last line is dropped.

        Raises:
            CodecError: A malformed record that is not the last line (the file was damaged, not torn).
        """
        try:
            with open(path, "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:
            return
        for n, raw in enumerate(lines):
            if not raw:
                continue
            last = all(not x for x in lines[n + 1:])
            rec = _parse(raw, n + 1, os.fspath(path), torn_ok=last)
            if rec is None:
                return
            yield rec


def _parse(raw: bytes, lineno: int, path: str, *, torn_ok: bool) -> tuple[str, list[Any]] | None:
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
        rec = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        bad("not JSON")
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("op"), str) or not isinstance(rec.get("args"), list):
        raise CodecError(f"journal {path!r} line {lineno}: a record must be {{'op': str, 'args': list}}, got "
                         f"{str(rec)[:100]}")
    if rec["op"] not in JOURNALED_OPS:
        raise CodecError(f"journal {path!r} line {lineno}: unknown operation {rec['op']!r}")
    return rec["op"], rec["args"]
