"""A trace of any run: Chrome trace-event JSON (opens in Perfetto), one part file per process, merged on one clock.

Turn it on with ``Pipeline(..., trace=path)`` or the environment variable ``KNITDATA_TRACE=path``. Each process of
the run (the pipeline's process; on the Ray engine also the coordinator, every storage unit and every process that
attaches) appends its events to its own part file ``path.<role>.<host>-<pid>.json``; :func:`merge` (``knitdata trace
PATH``) joins the parts into ``path``, one valid trace (``{"traceEvents": [...]}``) on the coordinator's clock:
each process measures its offset to the coordinator when it attaches (a round trip, the midpoint; ``0`` on the
embedded engine). The process that created the pipeline merges by itself when the pipeline shuts down (or its
``with`` block ends) and when its tracing ends (:func:`stop`, or the process's exit). :func:`plot` (``knitdata
trace PATH --plot out.png``) draws admission, delivery and compute per rank over time from any trace.

Recorded: puts (``put``, producer; a burst of puts of one thread, each within :data:`BURST_GAP_US` of the previous
one, is one event with ``calls`` and ``busy_us`` in its args), admissions (``admit``: the mini-batch, its
trajectories per source and ``held_by``, the source whose quota filled last and so held it), plans (``plan``),
fetches per rank (``fetch``), trainer waits (``wait``: time blocked in ``next()``) and compute (``compute``: time
between ``next()`` calls), hand-outs (``handout``), commits (``commit``), releases (``release``), spills
(``spill``), the trainer's version (a counter), the staleness split of each report of hand-outs (a counter
``staleness``: mean versions generating and queued, mean seconds queued) and journal replays (``restart``).

Cost: with tracing off each recording point is one ``if``; on, one ``deque.append`` of a tuple. A background
thread of each process writes what was recorded every :data:`FLUSH_S` seconds (and at exit) in a compact form,
one JSON array of raw records per flush (:data:`PART_FORMAT`; a single encoder call, no per-event formatting);
:func:`merge` turns the records into trace events.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "run.json")
    >>> t = start(path, "example")
    >>> t0 = now_us()
    >>> t.span("work", "example", t0, now_us(), {"n": 1})
    >>> stop()
    >>> summary = merge(path)
    >>> summary["processes"], summary["events"] > 0
    (1, True)
"""

from __future__ import annotations

import atexit
import collections
import glob
import json
import multiprocessing.util
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from knitdata.errors import CodecError, ConfigError

__all__ = ["Tracer", "tracer", "start", "stop", "from_env", "now_us", "part_path", "parts", "read_part", "merge",
           "part_sizes", "parts_missing_from", "write_parts", "HOST",
           "load", "timeline", "plot", "plot_timeline", "ENV", "FLUSH_S", "BURST_GAP_US", "BURST_MAX_US",
           "PART_FORMAT"]

#: The environment variable that turns tracing on (its value: the trace's path).
ENV = "KNITDATA_TRACE"
#: Seconds between the background flushes of a process's events to its part file.
FLUSH_S = 1.0
#: A put that starts within this many microseconds of the end of the previous put of its thread joins its burst.
BURST_GAP_US = 1000.0
#: The longest burst of puts recorded as one event, in microseconds (the resolution of the puts on the timeline).
BURST_MAX_US = 10_000.0
#: The format of the part files: a first line ``{"knitdata_trace_part": 2, "pid": ..., "role": ...}``, then per
#: flush one line, a JSON array of records ``[ph, name, cat, ts_us, dur_us, tid, args]`` (local clock; ``args``
#: an object or ``null``). Format 1, an array of trace events (one per line), is still read.
PART_FORMAT = 2

_ENCODE = json.JSONEncoder(default=str, check_circular=False, separators=(",", ":")).encode
#: This process's tracer (``None``: tracing is off). Recording points test it: ``if trace.tracer is not None``.
tracer: Tracer | None = None
_lock = threading.Lock()
_INF = float("inf")
#: Each thread's native id, cached (``threading.get_native_id()`` is a system call on Linux).
_tls = threading.local()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker started by fork, ``os.fork``) traces into a part of its own.

    The parent's tracer, copied into the child with the events it had not written yet, writes nothing here (the
    parent writes those). If the parent traced, the child starts a tracer of its own on the same path, role
    ``<role>-fork``, with the parent's clock offset (one host, one clock), flushed at the child's exit: ``atexit``,
    or the exit of a ``multiprocessing`` child, which skips ``atexit``.
    """
    global tracer, _lock
    _tls.__dict__.clear()  # the child's thread has a new native id
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    parent, tracer = tracer, None
    if parent is None:
        return
    # no file and no thread yet: a child that runs exec next (subprocess with preexec_fn) must not start threads;
    # a multiprocessing child starts them (_MpChildExit), any other one writes its events at exit
    child = Tracer(parent.path, f"{parent.role}-fork", flush_s=parent.flush_s, start=False)
    child.offset_us = parent.offset_us
    child._buf.append(("M", "knitdata_clock", "", 0.0, 0.0, 0, {"offset_us": parent.offset_us, "role": child.role,
                                                                 "forked_from": parent.pid}))
    tracer = child
    atexit.register(child.close)


class _MpChildExit:
    """A ``multiprocessing`` child (started by fork) leaves through its finalizers, not ``atexit``: register
    :func:`stop` there (after ``multiprocessing`` cleared the finalizers it copied from the parent)."""

    @staticmethod
    def after_fork(_self: _MpChildExit) -> None:
        if tracer is not None:
            tracer.activate()  # its part file and background thread (the at-fork handler made it without)
            multiprocessing.util.Finalize(None, stop, exitpriority=100)


_mp_child_exit = _MpChildExit()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
    multiprocessing.util.register_after_fork(_mp_child_exit, _MpChildExit.after_fork)
#: What the last merge of each trace (in this process) read: the parts and their sizes.
_merged: dict[str, list[tuple[str, int]]] = {}


def now_us() -> float:
    """This process's trace clock in microseconds: ``time.perf_counter()`` (a monotonic clock shared by every
    process of a host on Linux, macOS and Windows), so a ``perf_counter()`` stamp ``t`` is ``t * 1e6`` here."""
    return time.perf_counter_ns() / 1000.0


def _name_part(text: str, default: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in text) or default


def _host_part(host: str) -> str:
    return _name_part(host, "host").replace("_", "-")


#: This host's name as part file names hold it (process ids repeat across hosts, and containers).
HOST = _host_part(socket.gethostname())


def part_path(path: str | os.PathLike[str], role: str, pid: int | None = None, host: str | None = None) -> str:
    """The part file of a process: ``path.<role>.<host>-<pid>.json`` (this host, this process by default)."""
    return (f"{os.fspath(path)}.{_name_part(role, 'process')}."
            f"{HOST if host is None else _host_part(host)}-"
            f"{os.getpid() if pid is None else pid}.json")


def parts(path: str | os.PathLike[str]) -> list[str]:
    """The part files of the trace ``path`` (written by each process of the run), sorted."""
    return sorted(p for p in glob.glob(glob.escape(os.fspath(path)) + ".*.*.json"))


def _burst_record(tid: int, b: list[Any]) -> tuple[Any, ...]:
    name, cat, t0, t1, calls, busy, by_source = b[:7]
    return ("X", name, cat, t0, t1 - t0, tid, {"calls": calls, "busy_us": busy,
                                                "trajectories": sum(by_source.values()), "by_source": by_source})


def _join_bursts(taken: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The records of ``taken`` with each thread's put spans (``"P"``, :meth:`Tracer.burst`) joined into bursts.

    Each thread's records are in the order it recorded them, so a put joins the thread's open burst (same name,
    within :data:`BURST_GAP_US` of its end and :data:`BURST_MAX_US` of its start) only if no other span of the
    thread that starts before the put was recorded since the burst's last put. The bursts still open at the end
    are written too (a put of the next flush starts a new one).
    """
    out: list[tuple[Any, ...]] = []
    #: Each thread's open burst: [name, cat, t0, t1, calls, busy, by_source, earliest start of another span of the
    #: thread recorded since the burst's last put]
    open_: dict[int, list[Any]] = {}
    for rec in taken:
        ph = rec[0]
        if ph == "P":
            _ph, name, cat, t0_us, t1_us, tid, by_source = rec
            b = open_.get(tid)
            if b is not None:
                if b[0] == name and t0_us - b[3] <= BURST_GAP_US and t1_us - b[2] <= BURST_MAX_US and b[7] >= t0_us:
                    b[3] = t1_us
                    b[4] += 1
                    b[5] += t1_us - t0_us
                    bs = b[6]
                    if isinstance(by_source, str):
                        bs[by_source] = bs.get(by_source, 0) + 1
                    else:
                        for k, m in by_source.items():
                            bs[k] = bs.get(k, 0) + m
                    b[7] = _INF
                    continue
                out.append(_burst_record(tid, b))
            open_[tid] = [name, cat, t0_us, t1_us, 1, t1_us - t0_us,
                          {by_source: 1} if isinstance(by_source, str) else dict(by_source), _INF]
            continue
        if ph == "X" and open_:  # a later put of this thread joins its burst only if the burst still nests
            b = open_.get(rec[5])
            if b is not None and rec[3] < b[7]:
                b[7] = rec[3]
        out.append(rec)
    for tid, b in open_.items():
        out.append(_burst_record(tid, b))
    return out


class Tracer:
    """Records one process's events and appends them to its part file (thread-safe, buffered).

    Args:
        path: The trace's path (the part file is :func:`part_path` of it).
        role: What this process is (``"driver"``, ``"coordinator"``, ``"unit-node0"``, ``"trainer"``...).
        flush_s: Seconds between background flushes.
        start: Write the part file's first lines and start the background thread now; ``False``: at
            :meth:`activate`, or the part file at the first flush (what a forked child's tracer does).

    Attributes:
        merge_on_close: Merge the trace (:func:`merge`) when this tracer closes (:func:`stop`, the process's
            exit), if any part changed since this process last merged it. Set by the pipeline that started it.
        recorded: Events recorded and flushed so far (each put counts, before bursts are joined).
        written: Records written to the part file so far (bursts joined, metadata included).
        write_cpu_s: CPU seconds spent writing (the flushes, on whichever thread ran them).
        flush_s: Seconds between background flushes.

    A process forked while it traces (a DataLoader worker started by fork) gets a tracer of its own, role
    ``<role>-fork``; the copy of the parent's writes nothing in the child.
    """

    def __init__(self, path: str | os.PathLike[str], role: str, *, flush_s: float = FLUSH_S, start: bool = True) -> None:
        self.path = os.fspath(path)
        self.role = role
        self.pid = os.getpid()
        self.flush_s = flush_s
        self.file = part_path(path, role, self.pid)
        self.merge_on_close = False
        os.makedirs(os.path.dirname(os.path.abspath(self.file)), exist_ok=True)
        self._buf: collections.deque[tuple[Any, ...]] = collections.deque()
        self._named: set[int] = set()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._closed = False
        self.offset_us = 0.0
        self.recorded = 0
        self.written = 0
        self.write_cpu_s = 0.0
        self._header = False  # the part file is written (its first lines) at construction or first flush
        self._thread: threading.Thread | None = None
        if start:
            self.activate()

    def activate(self) -> None:
        """Write the part file's first lines and start the background thread (idempotent; done at construction
        unless ``start=False``)."""
        self._write_header()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(self.flush_s,), name="knitdata-trace", daemon=True)
            self._thread.start()

    def _write_header(self) -> None:
        if self._header:
            return
        self._header = True
        with open(self.file, "w", encoding="utf-8") as f:
            f.write(json.dumps({"knitdata_trace_part": PART_FORMAT, "pid": self.pid, "role": self.role}) + "\n")
            f.write(_ENCODE([("M", "process_name", "", 0, 0, 0, {"name": f"knitdata {self.role} ({self.pid})"}),
                             ("M", "knitdata_clock", "", 0, 0, 0, {"offset_us": 0.0, "role": self.role})]) + "\n")

    # ------------------------------------------------------------------ recording (any thread)
    def span(self, name: str, cat: str, t0_us: float, t1_us: float, args: Mapping[str, Any] | None = None) -> None:
        """A complete event (``ph: X``) from ``t0_us`` to ``t1_us`` (:func:`now_us`) on the calling thread."""
        try:
            tid = _tls.tid
        except AttributeError:
            tid = _tls.tid = threading.get_native_id()
        self._buf.append(("X", name, cat, t0_us, t1_us - t0_us, tid, args))

    def burst(self, name: str, cat: str, t0_us: float, t1_us: float, by_source: Mapping[str, int] | str) -> None:
        """A span (``ph: X``) that joins the calling thread's open burst of ``name``: one event per burst of puts.

        A span joins when it starts within :data:`BURST_GAP_US` of the burst's end, the burst stays within
        :data:`BURST_MAX_US`, and no other span of the thread started in between (the joined span must still nest
        with the thread's other spans). The event's args: ``calls`` (spans joined), ``busy_us`` (their summed
        length), ``trajectories`` and ``by_source`` (the summed ``by_source``; a string: one of that source). The
        calling thread only appends the span (no lock; do not change ``by_source`` after): the flush joins each
        thread's spans in the order the thread recorded them, and writes the bursts still open at its end.
        """
        try:
            tid = _tls.tid
        except AttributeError:
            tid = _tls.tid = threading.get_native_id()
        self._buf.append(("P", name, cat, t0_us, t1_us, tid, by_source))

    def instant(self, name: str, cat: str, args: Mapping[str, Any] | None = None, ts_us: float | None = None) -> None:
        """An instant event (``ph: i``) now (or at ``ts_us``) on the calling thread."""
        try:
            tid = _tls.tid
        except AttributeError:
            tid = _tls.tid = threading.get_native_id()
        self._buf.append(("i", name, cat, now_us() if ts_us is None else ts_us, 0.0, tid, args))

    def counter(self, name: str, values: Mapping[str, float]) -> None:
        """A counter event (``ph: C``): ``values`` by series name, now."""
        try:
            tid = _tls.tid
        except AttributeError:
            tid = _tls.tid = threading.get_native_id()
        self._buf.append(("C", name, "counter", now_us(), 0.0, tid, values))

    # ------------------------------------------------------------------ clock and files
    def sync(self, clock: Callable[[], float], rounds: int = 3) -> float:
        """Measure this process's offset to a reference clock (the coordinator's) and record it.

        Args:
            clock: Returns the reference clock's :func:`now_us` (a round trip to the coordinator).
            rounds: Round trips; the one with the shortest round trip counts (its midpoint).

        Returns:
            The offset in microseconds (reference minus local).
        """
        best: tuple[float, float] | None = None
        for _ in range(rounds):
            t0 = now_us()
            ref = float(clock())
            t1 = now_us()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, ref - (t0 + t1) / 2)
        assert best is not None
        self.offset_us = best[1]
        self._buf.append(("M", "knitdata_clock", "", 0.0, 0.0, 0, {"offset_us": self.offset_us, "role": self.role,
                                                                      "rtt_us": best[0]}))
        return self.offset_us

    def flush(self) -> None:
        """Append the events recorded so far to the part file (one line: the records, :data:`PART_FORMAT`)."""
        if os.getpid() != self.pid:  # the parent's tracer in a forked child: the parent writes these events
            self._buf.clear()
            return
        with self._flush_lock:
            c0 = time.thread_time()
            buf = self._buf
            taken = [buf.popleft() for _ in range(len(buf))]  # others may append meanwhile: those wait
            if not taken:
                return
            self._write_header()  # a tracer made with start=False (a forked child) writes its file now
            n = len(taken)  # each put joined into a burst counts
            records = _join_bursts(taken)
            new = {it[5] for it in records} - self._named - {0}
            if new:
                names = {t.native_id: t.name for t in threading.enumerate()}
                records += [("M", "thread_name", "", 0, 0, t, {"name": names.get(t, f"thread {t}")}) for t in sorted(new)]
                self._named |= new
            line = _ENCODE(records) + "\n"
            with open(self.file, "a", encoding="utf-8") as f:
                f.write(line)
            self.recorded += n
            self.written += len(records)
            self.write_cpu_s += time.thread_time() - c0

    def wake(self) -> None:
        """Have the background thread flush now (the caller does not wait: e.g. a rank's pass ended)."""
        self._wake.set()

    def _run(self, flush_s: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(flush_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.flush()
            except OSError:  # pragma: no cover - a full disk: the run goes on untraced
                return

    def close(self) -> None:
        """Flush and stop the background thread (idempotent); merge the trace when :attr:`merge_on_close`."""
        if os.getpid() != self.pid:  # the parent's tracer in a forked child (its thread is not here)
            self._buf.clear()
            return
        self._stop.set()
        self._wake.set()
        self.flush()
        if self.merge_on_close and not self._closed and os.getpid() == self.pid:  # not in a forked child
            self._closed = True
            try:
                if _merged.get(self.path) != _signature(parts(self.path)):
                    merge(self.path)
            except (OSError, ValueError) as e:  # at exit: say what to run, do not fail the process's exit
                print(f"knitdata: the trace {self.path!r} was not merged ({type(e).__name__}: {e}); run "
                      f"`knitdata trace {self.path}`", file=sys.stderr)
        self._closed = True


def start(path: str | os.PathLike[str], role: str, *, flush_s: float = FLUSH_S) -> Tracer:
    """Trace this process into ``path`` (its part file); returns the process's tracer (the running one if the
    process already traces into ``path``).

    Raises:
        ConfigError: This process already traces into another path.
    """
    global tracer
    with _lock:
        if tracer is not None:
            if tracer.path != os.fspath(path):
                raise ConfigError(f"this process already traces into {tracer.path!r}; one trace per process "
                                  f"(asked for {os.fspath(path)!r})")
            return tracer
        tracer = Tracer(path, role, flush_s=flush_s)
        atexit.register(tracer.close)
        return tracer


def stop() -> None:
    """Flush and stop this process's tracer (no-op when off); the pipeline that started it has it merge the trace
    (:attr:`Tracer.merge_on_close`)."""
    global tracer
    with _lock:
        t, tracer = tracer, None
    if t is not None:
        t.close()


def from_env(role: str) -> Tracer | None:
    """Start tracing when :data:`ENV` names a path (the running tracer if any; ``None`` when off)."""
    if tracer is not None:
        return tracer
    path = os.environ.get(ENV)
    return start(path, role) if path else None


# ---------------------------------------------------------------------------------------------- other hosts
def part_sizes(path: str | os.PathLike[str]) -> dict[str, int]:
    """The part files of ``path`` visible here, ``{file name: size in bytes}``."""
    return {os.path.basename(p): n for p, n in _signature(parts(path)) if n >= 0}  # -1: removed meanwhile


def parts_missing_from(path: str | os.PathLike[str], known: Mapping[str, int]) -> dict[str, bytes]:
    """The part files of ``path`` on this host that ``known`` (another host's :func:`part_sizes`) lacks or holds
    shorter, ``{file name: content}``: run where the parts were written (on the Ray engine, by each node's storage
    unit), then :func:`write_parts` on the host that merges."""
    out = {}
    for p, n in _signature(parts(path)):
        name = os.path.basename(p)
        if n > known.get(name, -1):
            try:
                with open(p, "rb") as f:
                    out[name] = f.read()
            except OSError:  # removed meanwhile
                continue
    return out


def write_parts(path: str | os.PathLike[str], found: Mapping[str, bytes]) -> list[str]:
    """Write part files of ``path`` gathered on other hosts (:func:`parts_missing_from`) next to ``path``, each
    unless a file here is as long already (atomic: a temporary file renamed); returns the files written.

    Raises:
        CodecError: A name that is not a part file of ``path`` (``<name of path>.<role>.<host>-<pid>.json``).
    """
    base = os.path.basename(os.fspath(path))
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    written = []
    for name, data in sorted(found.items()):
        if os.path.basename(name) != name or not name.startswith(base + ".") or not name.endswith(".json"):
            raise CodecError(f"{name!r} is not a part file of the trace {os.fspath(path)!r}")
        dest = os.path.join(folder, name)
        try:
            if os.path.getsize(dest) >= len(data):
                continue
        except OSError:
            pass
        tmp = f"{dest}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)
        written.append(dest)
    return written


# ---------------------------------------------------------------------------------------------- merge
def _signature(files: Sequence[str]) -> list[tuple[str, int]]:
    out = []
    for p in files:
        try:
            out.append((p, os.path.getsize(p)))
        except OSError:
            out.append((p, -1))
    return out


def _read_legacy(text: str) -> list[dict[str, Any]]:
    """Format 1: a JSON array of trace events, one per line (the ``]`` of a killed process missing)."""
    text = text.strip()
    if text.endswith(","):
        text = text[:-1]
    if not text.endswith("]"):
        text += "]"
    try:
        return list(json.loads(text))
    except json.JSONDecodeError:  # a torn last line (a process killed while writing): keep the complete ones
        out = []
        for line in text.lstrip("[").splitlines():
            line = line.strip().rstrip(",").rstrip("]")
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


def _salvage(line: str) -> list[Any]:
    """The complete records at the start of a torn line (a process killed while writing its last flush)."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i = 1 if line.startswith("[") else len(line)
    while i < len(line):
        while i < len(line) and line[i] in ", \t":
            i += 1
        try:
            rec, i = dec.raw_decode(line, i)
        except json.JSONDecodeError:
            break
        out.append(rec)
    return out


def read_part(file: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The trace events of one part file, on its process's own clock (its ``knitdata_clock`` metadata event holds
    the offset to the coordinator's). A torn last line (a process killed while writing) gives what is complete.

    Raises:
        CodecError: A damaged part (a line other than the last one is not records of :data:`PART_FORMAT`).
    """
    file = os.fspath(file)
    with open(file, encoding="utf-8") as f:
        text = f.read()
    if not text.lstrip().startswith("{"):
        return _read_legacy(text)
    lines = text.split("\n")
    try:
        header = json.loads(lines[0])
        pid = int(header["pid"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CodecError(f"trace part {file!r}: the first line is not a part header ({e})") from e
    if header.get("knitdata_trace_part") != PART_FORMAT:
        raise CodecError(f"trace part {file!r} has format {header.get('knitdata_trace_part')!r}; this version reads "
                         f"{PART_FORMAT} (merge it with the knitdata version that wrote it)")
    last = max((k for k, line in enumerate(lines) if line.strip()), default=0)
    out: list[dict[str, Any]] = []
    for k in range(1, last + 1):
        line = lines[k].strip()
        if not line:
            continue
        try:
            records = json.loads(line)
        except json.JSONDecodeError as e:
            if k < last:
                raise CodecError(f"trace part {file!r} line {k + 1} is damaged ({e})") from e
            records = _salvage(line)
        for rec in records:
            try:
                ph, name, cat, ts, dur, tid, args = rec
                ev: dict[str, Any] = {"ph": str(ph), "name": str(name), "pid": pid, "tid": int(tid),
                                      "ts": float(ts)}
            except (TypeError, ValueError) as e:
                raise CodecError(f"trace part {file!r} line {k + 1}: {str(rec)[:120]} is not a record "
                                 "[ph, name, cat, ts, dur, tid, args]") from e
            if cat:
                ev["cat"] = cat
            if ph == "X":
                ev["dur"] = max(float(dur), 0.0)
            elif ph == "i":
                ev["s"] = "t"
            elif ph == "M":
                ev["ts"] = 0
            if args is not None:
                ev["args"] = args
            out.append(ev)
    return out


def merge(path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Join the part files of ``path`` into one trace on the coordinator's clock, written to ``out`` (default
    ``path``). Timestamps start at 0 (the run's first event). A part that records the trainer's waits (``wait``)
    but no hand-outs gets a ``handout`` at the end of each wait (what a hand-out is), with the wait's args.

    Returns:
        ``{"path", "parts", "processes", "events", "span_us"}``.

    Raises:
        ConfigError: No part file of ``path``.
        CodecError: A damaged part file (:func:`read_part`).
    """
    files = parts(path)
    if not files:
        raise ConfigError(f"no trace parts at {os.fspath(path)}.<role>.<host>-<pid>.json: run with trace={os.fspath(path)!r} "
                          f"or {ENV}={os.fspath(path)} first")
    signature = _signature(files)
    events: list[dict[str, Any]] = []
    pids: set[int] = set()
    for file in files:
        evs = read_part(file)
        if not any(e.get("name") == "handout" for e in evs):  # a hand-out is the end of its wait: derived here
            evs += [{"ph": "i", "name": "handout", "cat": "trainer", "pid": e["pid"], "tid": e["tid"],
                     "ts": float(e["ts"]) + float(e.get("dur", 0.0)), "s": "t", "args": e.get("args") or {}}
                    for e in evs if e.get("name") == "wait" and e.get("ph") == "X"]
        offset = 0.0
        for ev in evs:
            if ev.get("ph") == "M" and ev.get("name") == "knitdata_clock":
                offset = float(ev["args"]["offset_us"])
        for ev in evs:
            if ev.get("ph") == "M" and ev.get("name") == "knitdata_clock":
                continue
            if ev.get("ph") != "M":
                ev["ts"] = float(ev["ts"]) + offset
            pids.add(int(ev["pid"]))
            events.append(ev)
    timed = [e for e in events if e["ph"] != "M"]
    base = min((e["ts"] for e in timed), default=0.0)
    end = max((e["ts"] + e.get("dur", 0.0) for e in timed), default=base)
    for e in timed:
        e["ts"] = round(e["ts"] - base, 3)
        if "dur" in e:
            e["dur"] = round(e["dur"], 3)
    meta = [e for e in events if e["ph"] == "M"]
    timed.sort(key=lambda e: (e["ts"], e["pid"], e["tid"]))
    target = os.fspath(out if out is not None else path)
    tmp = target + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": meta + timed, "displayTimeUnit": "ms",
                   "otherData": {"knitdata_parts": [os.path.basename(p) for p in files]}}, f)
    os.replace(tmp, target)
    if out is None:
        _merged[os.fspath(path)] = signature
    return {"path": target, "parts": len(files), "processes": len(pids), "events": len(timed), "span_us": end - base}


def load(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a merged trace (``{"traceEvents": [...]}`` or a bare array)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return list(data["traceEvents"] if isinstance(data, dict) else data)


# ---------------------------------------------------------------------------------------------- Figure 1
def timeline(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """What :func:`plot_timeline` draws, from trace events (seconds from the trace's start).

    Returns:
        ``{"admissions": [(t, train_batch, index)], "ranks": {rank: [(kind, start, end)]}, "arrivals":
        [(t, source)], "sources": [...], "wall": seconds}``; kinds: ``"admission"`` (waiting for the mini-batch
        to be admitted), ``"wait"`` (exposed delivery), ``"compute"``.
    """
    evs = [e for e in events if e.get("ph") != "M"]
    admitted: dict[int, float] = {}
    admissions: list[tuple[float, int, int]] = []
    arrivals: list[tuple[float, str]] = []
    ranks: dict[int, list[tuple[str, float, float]]] = {}
    wall = 0.0
    for e in evs:
        t = float(e["ts"]) / 1e6
        wall = max(wall, t + float(e.get("dur", 0.0)) / 1e6)
        a = e.get("args") or {}
        if e["name"] == "admit":
            admitted.setdefault(int(a["step"]), t)
            admissions.append((t, int(a.get("train_batch", 0)), int(a.get("index", 0))))
        elif e["name"] == "put":
            for s, n in (a.get("by_source") or {}).items():
                arrivals += [(t + float(e.get("dur", 0.0)) / 1e6, str(s))] * int(n)
    for e in evs:
        if e["name"] not in ("wait", "compute") or e.get("ph") != "X":
            continue
        a = e.get("args") or {}
        rank = int(a.get("rank", 0))
        s, end = float(e["ts"]) / 1e6, (float(e["ts"]) + float(e["dur"])) / 1e6
        rows = ranks.setdefault(rank, [])
        if e["name"] == "compute":
            rows.append(("compute", s, end))
            continue
        ta = min(max(s, admitted.get(int(a.get("step", -1)), s)), end)
        if ta > s:
            rows.append(("admission", s, ta))
        rows.append(("wait", ta, end))
    sources = sorted({s for _t, s in arrivals})
    return {"admissions": sorted(admissions), "ranks": dict(sorted(ranks.items())), "arrivals": arrivals,
            "sources": sources, "wall": wall}


def plot_timeline(out: str | os.PathLike[str], admissions: Sequence[tuple[float, int, int]],
                  ranks: Sequence[Sequence[tuple[str, float, float]]], arrivals: Sequence[tuple[float, str]],
                  sources: Sequence[str], wall: float, title: str = "knitdata run") -> None:
    """Draw the seed's Figure 1: rollout finishes per source, admissions, and per rank the time waiting for
    admission, the exposed delivery and the compute (needs matplotlib: ``pip install 'knitdata[plot]'``).

    Args:
        out: The PNG to write.
        admissions: ``(time, train batch, index)`` of each admitted mini-batch.
        ranks: Per rank, ``(kind, start, end)`` with kind ``"admission"``, ``"wait"`` or ``"compute"``.
        arrivals: ``(time, source)`` of each finished trajectory.
        sources: The sources, in the order of their rows.
        wall: The run's length in seconds (the x axis).
        title: The figure's title.

    Raises:
        OptionalDependencyError: matplotlib is not installed.
    """
    from knitdata.errors import OptionalDependencyError

    try:
        import matplotlib
    except ImportError as e:
        raise OptionalDependencyError("matplotlib", "plot", "the timeline plot") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10")
    n = len(ranks)
    fig, ax = plt.subplots(figsize=(12, 2.2 + 0.9 * n))
    src_y = {s: i for i, s in enumerate(sources)}
    # row n+1: rollout finishes per source; row n: admissions; rows 0..n-1: consumers
    for fin, s in arrivals:
        k = src_y.get(s, 0)
        ax.plot(fin, n + 1 + 0.25 * (k - 1), "|", color=colors(3 + k), ms=6)
    for t, b, k in admissions:
        ax.plot([t, t], [n - 0.35, n + 0.35], color=colors(b % 10), lw=2)
        ax.text(t, n + 0.4, f"{b}.{k}", fontsize=6, ha="center")
    for r, events in enumerate(ranks):
        y = n - 1 - r
        adm = [(s, e - s) for k, s, e in events if k == "admission" and e - s > 1e-4]
        waits = [(s, max(e - s, wall / 5000)) for k, s, e in events if k == "wait"]
        comps = [(s, e - s) for k, s, e in events if k == "compute"]
        ax.broken_barh(adm, (y - 0.3, 0.6), color="#BBBBBB", label="idle: next mini-batch not admitted" if r == 0 else None)
        ax.broken_barh(comps, (y - 0.3, 0.6), color="#4C72B0", label="computation" if r == 0 else None)
        ax.broken_barh(waits, (y - 0.3, 0.6), color="#DD8452", label="data delivery (exposed)" if r == 0 else None)
    ax.set_yticks(list(range(n + 2)), [f"consumer {n - 1 - i}" for i in range(n)]
                  + ["admission (b.k)", "rollout finishes\n(" + "/".join(src_y) + ")"])
    ax.set_xlim(0, max(wall, 1e-3))
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=9)
    if n:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)  # beside the rows, never over them
    fig.tight_layout()
    fig.savefig(os.fspath(out), dpi=120)
    plt.close(fig)


def plot(trace_path: str | os.PathLike[str], out: str | os.PathLike[str], title: str | None = None) -> dict[str, Any]:
    """Draw Figure 1 (:func:`plot_timeline`) from the merged trace at ``trace_path`` into ``out``.

    Returns:
        The :func:`timeline` drawn.
    """
    tl = timeline(load(trace_path))
    ranks = [tl["ranks"].get(r, []) for r in range(max(tl["ranks"], default=-1) + 1)]
    plot_timeline(out, tl["admissions"], ranks, tl["arrivals"], tl["sources"], tl["wall"],
                  title or f"knitdata trace {os.path.basename(os.fspath(trace_path))}: admission, delivery and "
                           "compute per rank")
    return tl
