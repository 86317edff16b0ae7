"""Stops on a micro-batch's path through ``TrajectoryDataset.__iter__``, counted with ``sys.setprofile``.

A *stop* is a knitdata function frame entered on the way from ``next(it)`` to the engine's ``read`` returning the
micro-batch. Every Python thread is profiled (``sys.setprofile`` and ``threading.setprofile``):

* on the thread that calls the engine's ``read`` (the trainer's thread in ``sample``/``eager`` mode, the prefetch
  thread in ``iter`` mode, or the trainer's thread when the prefetcher runs a source step inline), a micro-batch's
  path starts where that thread (re)entered the outermost frame still active at the read after the previous
  read returned (``_ConsumerIterator.__next__``; in ``iter`` mode the prefetcher's pull of its next item), and
  ends when ``read`` returns; every knitdata frame entered in between is a stop, ``read`` included; a generator
  resumed counts as entered (the profiler reports it so);
* a frame in ``knitdata/engines/`` or ``knitdata/control/`` entered from outside them is one stop (the engine's
  business: the Ray forwarder's or the control plane's own frames are not counted), so that both engines are
  measured on the same footing;
* the lease's relay (``ConsumerLease.relay``, after the plan stage: it looks at the hand-outs since its last call
  and, once per mini-batch, has the sender report them) is one stop too: for a control plane in this process the
  report is made there (the hand-outs and commit since the last: a function call of the plane's, cheaper than
  waking the sender's thread), which is the control plane's business, as above;
* ``trainer``: the frames entered by each ``next(it)`` on the trainer's thread when it did not read (``iter``:
  popping the prefetched item and recording its hand-out), counted apart; ``trainer_waited``: those of them that
  found nothing prepared at their first look and so went through the prefetcher's ``next()`` (most wait there: its
  ``on_wait`` relays the hand-outs before it blocks; on a busy machine the item may arrive before it blocks).

Run as a script (``python tests/_path_helpers.py ray``) it measures the Ray engine in a fresh process (a local Ray
on loopback) and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import knitdata  # noqa: E402
from knitdata.threads import release_parked  # noqa: E402

PKG = os.path.dirname(os.path.abspath(knitdata.__file__)) + os.sep
BOUNDARY = (PKG + "engines" + os.sep, PKG + "control" + os.sep)
#: The relay of a report (one stop, its callees not counted): the lease's, and the sender's when the trainer calls it.
_RELAYS = ("ConsumerLease.relay", "ControlSender.relay")


def _key(code: Any, frame: Any = None) -> str:
    rel = code.co_filename[len(PKG):].replace(os.sep, "/")
    name = getattr(code, "co_qualname", code.co_name)
    if rel == "engines/ray/control.py" and name.startswith("RayControl.bind.") and frame is not None:
        # a control call made through the Ray proxy: named as the part's method it stands for
        return f"control.{frame.f_locals.get('name', code.co_name)}"
    if code.co_filename.startswith(BOUNDARY):
        # the engine's own class is engine-specific: compare by method name
        return f"engine.{code.co_name}" if rel.startswith("engines/") else f"control.{code.co_name}"
    return f"{rel}:{name}"


def _full_key(code: Any) -> str:
    return f"{code.co_filename[len(PKG):].replace(os.sep, '/')}:{getattr(code, 'co_qualname', code.co_name)}"


#: Rooms that serve a walk rather than lead it: entering one is a stop, what it calls inside is not (decoding a
#: record: the codec's and the record's checks; counting: the metrics).
SERVICES = tuple(PKG + s for s in ("codec.py", "record.py", "observe" + os.sep))


def _walk_stop(frame: Any) -> bool:
    """Whether a function entered inside the engine or the control plane is a stop of the walk: not a comprehension's
    frame (Python 3.11 gives them their own), not called from inside a service room."""
    code = frame.f_code
    if code.co_name.startswith("<"):
        return False
    back = frame.f_back
    while back is not None and not back.f_code.co_filename.startswith(PKG):  # a dataclass's generated __init__
        back = back.f_back
    return back is None or not back.f_code.co_filename.startswith(SERVICES)


class StopCounter:
    """Profiles every thread while active; :meth:`paths` splits the events into micro-batch paths.

    Besides the stops (an engine or control-plane call counted once), it records the *walk*: every distinct knitdata
    function a micro-batch's path enters, the engine's and the control plane's own frames included (in this process),
    and the *rooms*: the modules of those functions. A function entered many times (a record decoded per trajectory)
    is one stop of the walk, and so is a room that serves it (:data:`SERVICES`) with what it calls inside."""

    def __init__(self) -> None:
        self.events: dict[int, list[tuple[str, str, int]]] = {}  # thread -> (event, key, frame id)
        self.inner: dict[tuple[int, int], list[str]] = {}  # (thread, index of a boundary call) -> functions inside
        self._inner_of: dict[int, list[str]] = {}  # thread -> the list its current boundary frame fills
        self.main = threading.get_ident()
        self.next_marks: list[tuple[int, int]] = []  # (start, end) event indices of each next(it) on the trainer
        self._skip: dict[int, int] = {}  # thread -> id of the boundary frame whose inner frames are not counted

    def _prof(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if not code.co_filename.startswith(PKG):
            return
        tid = threading.get_ident()
        skip = self._skip.get(tid)
        if skip is not None:
            if event == "return" and id(frame) == skip:
                del self._skip[tid]
                self._inner_of.pop(tid, None)
                self.events.setdefault(tid, []).append(("return", _key(code, frame), id(frame)))
            elif event == "call" and tid in self._inner_of and _walk_stop(frame):
                self._inner_of[tid].append(_full_key(code))
            return
        evs = self.events.setdefault(tid, [])
        if event == "call" and (code.co_filename.startswith(BOUNDARY) or code.co_qualname in _RELAYS):
            self._skip[tid] = id(frame)
            if code.co_qualname not in _RELAYS:  # the relay's report is no step of the micro-batch's walk
                self._inner_of[tid] = self.inner.setdefault((tid, len(evs)), [_full_key(code)])
        evs.append((event, _key(code, frame), id(frame)))

    def __enter__(self) -> StopCounter:
        threading.setprofile(self._prof)
        sys.setprofile(self._prof)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def next(self, it: Any) -> Any:
        """``next(it)``, marking its events on the trainer's thread."""
        start = len(self.events.get(self.main, []))
        item = next(it)  # the end of the stream (StopIteration) is no micro-batch's path
        self.next_marks.append((start, len(self.events.get(self.main, []))))
        return item

    def paths(self) -> dict[str, Any]:
        """``{"paths": [stops of each read], "walks": [functions of each read], "trainer": [...], "trainer_waited":
        [...]}``: the stops of each ``next(it)`` without a read, split by whether it waited for the prefetcher."""
        paths: list[list[str]] = []
        walks: list[list[str]] = []
        for tid, evs in self.events.items():
            # another thread's first frames are its loop: the pooled thread's (knitdata.threads), then the prefetcher's
            base = 0 if tid == self.main else 1 + sum(1 for ev, key, _f in evs[:8] if ev == "call" and key.startswith("threads.py:"))
            stack: list[tuple[int, int]] = []  # (frame id, index of its last (re)entry)
            prev_ret = -1
            for i, (ev, key, fid) in enumerate(evs):
                if ev == "call":
                    stack.append((fid, i))
                    continue
                while stack and stack[-1][0] != fid:  # frames left by an exception
                    stack.pop()
                if stack:
                    stack.pop()
                if key != "engine.read":
                    continue
                start = next((pos for _f, pos in stack[base:] if pos > prev_ret), None)
                read_call = max((k for k in range(prev_ret + 1, i) if evs[k][0] == "call" and evs[k][2] == fid),
                                default=i)
                start = read_call if start is None else min(start, read_call)
                paths.append([k for e, k, _f in evs[start:read_call + 1] if e == "call"])
                walk: list[str] = []
                for k in range(start, read_call + 1):
                    if evs[k][0] != "call" or evs[k][1].endswith(_RELAYS):
                        continue
                    walk.extend(self.inner.get((tid, k), [evs[k][1]]))
                walks.append(list(dict.fromkeys(walk)))
                prev_ret = i
        main = self.events.get(self.main, [])
        trainer = []  # in iter mode: the trainer pops prefetched micro-batches
        waited = []  # ... or waits for the next one
        for a, b in self.next_marks:
            keys = [k for e, k, _f in main[a:b] if e == "call"]
            # it only handed out (a next() that made its item inline ran the production stages: not a trainer stop)
            if not any(k.endswith("Production.__next__") or k == "engine.read" for k in keys):
                slow = any(k.endswith(_RELAYS) or k == "consumer/prefetch.py:Prefetcher.__next__" for k in keys)
                (waited if slow else trainer).append(keys)
        return {"paths": paths, "walks": walks, "trainer": trainer, "trainer_waited": waited}


def measure(pipe: Any, fetch: str, n: int = 12) -> dict[str, Any]:
    """Stops of the micro-batches of rank 0 (``n`` at most) of a filled and closed ``pipe``."""
    ds = pipe.dataset(0, fetch=fetch)
    got = 0
    release_parked()  # a parked thread started before the profiler would run the prefetch job unseen
    with StopCounter() as sc:
        it = iter(ds)  # the prefetch thread starts here: profiled from its start
        for _ in range(n):
            try:
                sc.next(it)
            except StopIteration:
                break
            got += 1
            time.sleep(0.002)  # the trainer computes: the prefetcher runs on its thread
    close = getattr(it, "close", None)
    if close is not None:
        close()
    out = sc.paths()
    out["microbatches"] = got
    out["max_stops"] = max((len(p) for p in out["paths"]), default=0)
    out["max_walk"] = max((len(w) for w in out["walks"]), default=0)
    out["max_rooms"] = max((len({k.split(":")[0] for k in w}) for w in out["walks"]), default=0)
    out["files"] = sorted({k.split(":")[0] for p in out["paths"] for k in p})
    out["max_trainer_stops"] = max((len(p) for p in out["trainer"]), default=0)
    out["max_trainer_waited_stops"] = max((len(p) for p in out["trainer_waited"]), default=0)
    return out


def filled(engine: str, **kw: Any) -> Any:
    """A closed pipeline of two mini-batches, two micro-batches each for rank 0 of 2 (placement by index)."""
    import random

    from _ondemand_helpers import make_workload

    from knitdata.pipeline import Pipeline

    wl = make_workload(random.Random(3), num_sources=2, group_size=2, num_minibatches=2,
                       groups_per_minibatch_per_source=2, train_batches=2)
    pipe = Pipeline(wl.spec, num_consumers=2, token_budget=12, engine=engine, **kw)
    for t in wl.trajs:
        pipe.put(t)
    pipe.close()
    return pipe


def _main(engine: str) -> None:
    out = {}
    for fetch in ("sample", "eager", "iter"):
        pipe = filled(engine, engine_options={"name": f"stops-{fetch}"} if engine == "ray" else None)
        try:
            out[fetch] = measure(pipe, fetch)
        finally:
            pipe.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    _main(sys.argv[1] if len(sys.argv) > 1 else "embedded")
