"""Background threads kept parked between jobs: a new iterator does not wait for a thread to start.

``threading.Thread.start()`` returns once the new thread runs: about 0.7 ms on a loaded 2-core machine, more
than a short pass over a dataset costs (``python -m benchmarks loader``). :func:`spawn` hands the function to a
parked daemon thread (one lock release, no wait) and starts a thread only when none is parked. A thread parked
for :data:`IDLE_S` exits, so an idle process keeps none. The prefetcher and the control sender run on these.

A thread running a job carries the job's name (``threading.enumerate()`` shows it); a parked one is named
:data:`PARKED_NAME`. Thread-local state that a job leaves set (torch's grad mode, a CUDA device) stays with the
thread for its next job: jobs here set what they need themselves.

Example:
    >>> import threading
    >>> out = []
    >>> job = spawn(lambda: out.append(threading.current_thread().name), "knitdata-example")
    >>> job.join(5.0), out
    (True, ['knitdata-example'])
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["IDLE_S", "PARKED_NAME", "EXIT_JOIN_S", "Job", "spawn", "release_parked", "stop_all"]

#: Seconds a thread whose job ended stays parked for the next one before it exits.
IDLE_S = 10.0
#: The name of a parked thread.
PARKED_NAME = "knitdata-parked"
#: Seconds :func:`stop_all` (run at interpreter exit) waits, in all, for the running jobs to end.
EXIT_JOIN_S = 2.0


class Job:
    """A function run once on a pooled thread (:func:`spawn`).

    Attributes:
        name: The running thread's name.
        thread: The thread that runs it (``None`` until it starts).
        done: Set once the function returned or raised.
    """

    def __init__(self, fn: Callable[[], object], name: str, stop: Callable[[], object] | None = None) -> None:
        self.fn: Callable[[], object] | None = fn
        self.name = name
        self.stop = stop
        self.thread: threading.Thread | None = None
        self.done = threading.Event()

    def is_alive(self) -> bool:
        """Whether the function has not finished yet (queued or running)."""
        return not self.done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the function finished (at most ``timeout`` seconds); returns whether it did."""
        return self.done.wait(timeout)

    def is_current(self) -> bool:
        """Whether the calling thread is the one running this job."""
        return self.thread is threading.current_thread()

    def __repr__(self) -> str:
        return f"Job({self.name!r}, {'running' if self.is_alive() else 'done'})"


class _Worker:
    def __init__(self, job: Job) -> None:
        self.job: Job | None = job
        self.go = threading.Lock()  # a binary semaphore: released with a job for a parked worker
        self.go.acquire()
        self.thread = threading.Thread(target=self._run, name=job.name, daemon=True)

    def _run(self) -> None:
        while True:
            job = self.job
            if job is None:  # released without a job (release_parked): it ends
                return
            self.job = None
            self._do(job)
            del job
            if not self.go.acquire(timeout=IDLE_S):
                with _LOCK:
                    if self in _PARKED:  # nobody took it: it ends
                        _PARKED.remove(self)
                        return
                self.go.acquire()  # taken between the timeout and the lock: its job is on the way

    def _do(self, job: Job) -> None:
        job.thread = self.thread
        fn, job.fn = job.fn, None
        try:
            if fn is not None:
                fn()
        except BaseException:  # noqa: BLE001 - reported as an uncaught exception of a plain thread would be
            exc_type, exc, tb = sys.exc_info()
            threading.excepthook(threading.ExceptHookArgs((exc_type, exc, tb, self.thread)))  # type: ignore[arg-type]
            del exc, tb
        finally:
            del fn
            self.thread.name = PARKED_NAME
            with _LOCK:  # parked before the job is done: a join() that returned finds it parked
                _RUNNING.discard(job)
                _PARKED.append(self)
            job.done.set()


_PARKED: list[_Worker] = []  # the last parked on top (its stack and caches are the warmest)
_RUNNING: set[Job] = set()  # queued or running jobs (for stop_all)
_LOCK = threading.Lock()


def _after_fork() -> None:  # a forked child has none of the parent's threads
    global _LOCK
    _PARKED.clear()
    _RUNNING.clear()
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def spawn(fn: Callable[[], object], name: str, stop: Callable[[], object] | None = None) -> Job:
    """Run ``fn()`` on a daemon thread named ``name``: a parked one, or a new one when none is parked.

    An exception ``fn`` raises goes to :func:`threading.excepthook`, as from a plain thread.

    Args:
        fn: What to run (it should catch what it means to keep).
        name: The thread's name while it runs ``fn``.
        stop: Asks ``fn`` to return soon (any thread may call it): :func:`stop_all` calls it at interpreter exit.

    Returns:
        The :class:`Job`: ``join()`` waits for ``fn`` to finish.
    """
    job = Job(fn, str(name), stop)
    with _LOCK:
        _RUNNING.add(job)
        worker = _PARKED.pop() if _PARKED else None
    if worker is not None:
        worker.thread.name = job.name
        worker.job = job
        worker.go.release()
        return job
    worker = _Worker(job)
    worker.thread.start()
    return job


def release_parked() -> int:
    """End the parked threads now (running jobs go on); returns how many. The next :func:`spawn` starts a new
    thread: for a tool that must see every thread start (``threading.setprofile``), or a process about to idle.

    Example:
        >>> spawn(lambda: None, "knitdata-example").join(5.0)
        True
        >>> release_parked() >= 1  # the thread that ran it was parked
        True
    """
    with _LOCK:
        workers = list(_PARKED)
        _PARKED.clear()
    for w in workers:
        w.job = None
        w.go.release()
    return len(workers)


def stop_all(timeout: float = EXIT_JOIN_S) -> int:
    """Ask the running jobs to stop (their ``stop``), end the parked threads, and wait up to ``timeout`` seconds in
    all for the jobs to end; returns how many are still running.

    Registered with :mod:`atexit`: a script that ends without closing its pipelines (no ``shutdown()``) would
    otherwise leave daemon threads running into interpreter finalization, where a thread that frees a tensor
    (torch releases and retakes the GIL in its deallocator) is ended by ``pthread_exit`` inside a ``noexcept``
    C++ frame: "terminate called without an active exception" and SIGABRT after all the work was done.
    A job without ``stop`` is only waited for. Calling it earlier is harmless to a job that restarts on demand (the
    control sender does); tests/test_threads.py runs it in a child process.
    """
    with _LOCK:
        jobs = list(_RUNNING)
    for job in jobs:
        if job.stop is not None:
            try:
                job.stop()
            except Exception:  # noqa: BLE001 - a stop that fails leaves that job to the bounded wait
                pass
    release_parked()
    deadline = time.monotonic() + timeout
    left = 0
    for job in jobs:
        if job.thread is threading.current_thread():
            continue
        if not job.join(max(deadline - time.monotonic(), 0.0)):
            left += 1
    return left


atexit.register(stop_all)
