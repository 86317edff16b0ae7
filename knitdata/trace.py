"""A trace of any run: Chrome trace-event JSON (opens in Perfetto), one part file per process, merged on one clock.

Turn it on with ``Pipeline(..., trace=path)`` or the environment variable ``KNITDATA_TRACE=path``. Each process of
the run (the pipeline's process; on the Ray engine also the coordinator, every storage unit and every process that
attaches) appends its events to its own part file ``path.<role>.<pid>.json``; :func:`merge` (``knitdata trace
PATH``) joins the parts into ``path``, one valid trace (``{"traceEvents": [...]}``) on the coordinator's clock:
each process measures its offset to the coordinator when it attaches (a round trip, the midpoint; ``0`` on the
embedded engine). :func:`plot` (``knitdata trace PATH --plot out.png``) draws admission, delivery and compute per
rank over time from any trace.

Recorded: puts (``put``, producer), admissions (``admit``: the mini-batch, its trajectories per source and
``held_by``, the source whose quota filled last and so held it), plans (``plan``), fetches per rank (``fetch``),
trainer waits (``wait``: time blocked in ``next()``) and compute (``compute``: time between ``next()`` calls),
hand-outs (``handout``), commits (``commit``), releases (``release``), spills (``spill``), the trainer's version
(a counter) and coordinator restarts (``restart``).

Cost: with tracing off each recording point is one ``if``; on, one ``deque.append`` of a tuple; a background
thread of each process turns them into JSON lines every :data:`FLUSH_S` seconds (and at exit).

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
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from knitdata.errors import ConfigError

__all__ = ["Tracer", "tracer", "start", "stop", "from_env", "now_us", "part_path", "parts", "merge", "load",
           "timeline", "plot", "plot_timeline", "ENV", "FLUSH_S"]

#: The environment variable that turns tracing on (its value: the trace's path).
ENV = "KNITDATA_TRACE"
#: Seconds between the background flushes of a process's events to its part file.
FLUSH_S = 1.0

_ARGS = json.JSONEncoder(default=str)
#: This process's tracer (``None``: tracing is off). Recording points test it: ``if trace.tracer is not None``.
tracer: Tracer | None = None
_lock = threading.Lock()


def now_us() -> float:
    """This process's trace clock in microseconds: ``time.perf_counter()`` (a monotonic clock shared by every
    process of a host on Linux, macOS and Windows), so a ``perf_counter()`` stamp ``t`` is ``t * 1e6`` here."""
    return time.perf_counter_ns() / 1000.0


def part_path(path: str | os.PathLike[str], role: str, pid: int | None = None) -> str:
    """The part file of a process: ``path.<role>.<pid>.json``."""
    role = "".join(c if c.isalnum() or c in "-_" else "-" for c in role) or "process"
    return f"{os.fspath(path)}.{role}.{os.getpid() if pid is None else pid}.json"


def parts(path: str | os.PathLike[str]) -> list[str]:
    """The part files of the trace ``path`` (written by each process of the run), sorted."""
    return sorted(p for p in glob.glob(glob.escape(os.fspath(path)) + ".*.*.json"))


class Tracer:
    """Records one process's events and appends them to its part file (thread-safe, buffered).

    Args:
        path: The trace's path (the part file is :func:`part_path` of it).
        role: What this process is (``"driver"``, ``"coordinator"``, ``"unit-node0"``, ``"trainer"``...).
        flush_s: Seconds between background flushes.
    """

    def __init__(self, path: str | os.PathLike[str], role: str, *, flush_s: float = FLUSH_S) -> None:
        self.path = os.fspath(path)
        self.role = role
        self.pid = os.getpid()
        self.file = part_path(path, role, self.pid)
        os.makedirs(os.path.dirname(os.path.abspath(self.file)), exist_ok=True)
        self._buf: collections.deque[tuple[Any, ...]] = collections.deque()
        self._named: set[int] = set()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.offset_us = 0.0
        with open(self.file, "w", encoding="utf-8") as f:
            f.write("[\n")  # the JSON array format: a reader tolerates the missing "]" of a killed process
            for ev in ({"ph": "M", "name": "process_name", "pid": self.pid, "tid": 0, "ts": 0,
                        "args": {"name": f"knitdata {role} ({self.pid})"}},
                       {"ph": "M", "name": "knitdata_clock", "pid": self.pid, "tid": 0, "ts": 0,
                        "args": {"offset_us": 0.0, "role": role}}):
                f.write(json.dumps(ev) + ",\n")
        self._thread = threading.Thread(target=self._run, args=(flush_s,), name="knitdata-trace", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ recording (any thread)
    def span(self, name: str, cat: str, t0_us: float, t1_us: float, args: Mapping[str, Any] | None = None) -> None:
        """A complete event (``ph: X``) from ``t0_us`` to ``t1_us`` (:func:`now_us`) on the calling thread."""
        self._buf.append(("X", name, cat, t0_us, t1_us - t0_us, threading.get_native_id(), args))

    def instant(self, name: str, cat: str, args: Mapping[str, Any] | None = None, ts_us: float | None = None) -> None:
        """An instant event (``ph: i``) now (or at ``ts_us``) on the calling thread."""
        self._buf.append(("i", name, cat, now_us() if ts_us is None else ts_us, 0.0, threading.get_native_id(), args))

    def counter(self, name: str, values: Mapping[str, float]) -> None:
        """A counter event (``ph: C``): ``values`` by series name, now."""
        self._buf.append(("C", name, "counter", now_us(), 0.0, threading.get_native_id(), values))

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
        """Append the events recorded so far to the part file."""
        with self._flush_lock:
            buf, lines = self._buf, []
            pid = self.pid
            tids: set[int] = set()
            dumps = _ARGS.encode
            while True:
                try:
                    ph, name, cat, ts, dur, tid, args = buf.popleft()
                except IndexError:
                    break
                # formatted by hand (names, categories and phases are knitdata's own identifiers): the cost per
                # event is mostly its args' encoding
                head = f'{{"ph": "{ph}", "name": "{name}", "cat": "{cat}", "pid": {pid}, "tid": {tid}, "ts": {ts:.3f}'
                if ph == "X":
                    head += f', "dur": {max(dur, 0.0):.3f}'
                elif ph == "i":
                    head += ', "s": "t"'
                if args is not None:
                    head += ', "args": ' + dumps(args)
                tids.add(tid)
                lines.append(head + "}")
            new = tids - self._named
            if new:
                names = {t.native_id: t.name for t in threading.enumerate()}
                for tid in sorted(new):
                    lines.append(json.dumps({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                                             "args": {"name": names.get(tid, f"thread {tid}")}}))
                self._named |= new
            if lines:
                with open(self.file, "a", encoding="utf-8") as f:
                    f.write(",\n".join(lines) + ",\n")

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
        """Flush and stop the background thread (idempotent)."""
        self._stop.set()
        self._wake.set()
        self.flush()


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
    """Flush and stop this process's tracer (no-op when off)."""
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


# ---------------------------------------------------------------------------------------------- merge
def _read_part(file: str) -> list[dict[str, Any]]:
    with open(file, encoding="utf-8") as f:
        text = f.read().strip()
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


def merge(path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Join the part files of ``path`` into one trace on the coordinator's clock, written to ``out`` (default
    ``path``). Timestamps start at 0 (the run's first event).

    Returns:
        ``{"path", "parts", "processes", "events", "span_us"}``.

    Raises:
        ConfigError: No part file of ``path``.
    """
    files = parts(path)
    if not files:
        raise ConfigError(f"no trace parts at {os.fspath(path)}.<role>.<pid>.json: run with trace={os.fspath(path)!r} "
                          f"or {ENV}={os.fspath(path)} first")
    events: list[dict[str, Any]] = []
    pids: set[int] = set()
    for file in files:
        evs = _read_part(file)
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
    meta = [e for e in events if e["ph"] == "M"]
    timed.sort(key=lambda e: (e["ts"], e["pid"], e["tid"]))
    target = os.fspath(out if out is not None else path)
    tmp = target + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": meta + timed, "displayTimeUnit": "ms",
                   "otherData": {"knitdata_parts": [os.path.basename(p) for p in files]}}, f)
    os.replace(tmp, target)
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
