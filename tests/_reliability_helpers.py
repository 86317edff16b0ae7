"""Helpers of the reliability tests: small pipelines, fault injection, consumers, child processes.

Fault injection wraps methods of one pipeline's own objects (its placement, its storage units, its admission
policy) or module functions through ``monkeypatch``; the injected failure is :class:`ProducerKilled`, a
``BaseException`` (like ``KeyboardInterrupt``/``SystemExit``: an ``except Exception`` cannot swallow it).
"""

from __future__ import annotations

import ctypes
import io
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

from knitdata.admission import BatchSpec
from knitdata.pipeline import Pipeline
from knitdata.record import MediaItem, Trajectory

__all__ = [
    "ProducerKilled",
    "traj",
    "png_bytes",
    "drain",
    "assert_store_empty",
    "held_consistent",
    "kill_thread",
    "run_child",
    "spec_for",
    "wait_until",
]


class ProducerKilled(BaseException):
    """Raised into a producer to model its death mid-put."""


def traj(i: int, source: str = "a", group: str | None = None, *, nbytes: int = 0, image: bytes | None = None,
         gen_version: int = 0) -> Trajectory:
    """A valid trajectory ``t{i}`` whose first prompt token is ``i``; optional padding and PNG image."""
    media = [MediaItem("image", data=image)] if image is not None else []
    return Trajectory(
        id=f"t{i}",
        source=source,
        group=group if group is not None else f"g{i}",
        prompt_ids=torch.tensor([i, 7], dtype=torch.int64),
        response_ids=torch.arange(1, 4 + i % 5, dtype=torch.int64),
        gen_version=gen_version,
        scalars={"reward": float(i % 3)},
        tensors={"pad": torch.full((nbytes,), i % 251, dtype=torch.uint8)},
        media=media,
    )


def png_bytes(seed: int = 0, size: int = 8) -> bytes:
    """A small valid PNG."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy()
    bio = io.BytesIO()
    Image.fromarray(arr).save(bio, format="PNG")
    return bio.getvalue()


def spec_for(n: int, num_minibatches: int = 1) -> BatchSpec:
    """One source ``a`` with quota ``n`` (one train batch of ``n`` single-trajectory groups)."""
    return BatchSpec({"a": n}, num_minibatches=num_minibatches)


def drain(pipe: Pipeline, *, fetch: str = "sample", timeout: float = 30.0, **ds_kw: Any) -> Counter:
    """Close ``pipe`` and read every admitted micro-batch of every rank (threads); return delivery counts.

    Raises:
        TimeoutError: A consumer did not finish (e.g. admission waits for a trajectory that never comes).
        BaseException: The first error a consumer raised.
    """
    pipe.close()
    got: Counter = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def consume(rank: int) -> None:
        try:
            for mb in pipe.dataset(rank, fetch=fetch, **ds_kw):
                with lock:
                    got.update(mb.info.trajectory_ids)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(r,), daemon=True) for r in range(pipe.num_consumers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("a consumer did not finish draining the pipeline")
    if errors:
        raise errors[0]
    return got


def assert_store_empty(pipe: Pipeline) -> None:
    """Every payload left the storage units (nothing half-stored or orphaned stays behind)."""
    for uid, unit in pipe.units.items():
        s = unit.stats()
        assert s.num_items == 0 and s.used_bytes == 0, f"unit {uid} still holds {s.num_items} payloads ({s.used_bytes} B)"


def held_consistent(pipe: Pipeline) -> None:
    """The pipeline's count of held trajectories equals what its storage units hold."""
    st = pipe.stats()
    in_units = sum(u["num_items"] for u in st["units"].values())
    assert st["held_trajectories"] == in_units, f"pipeline holds {st['held_trajectories']}, units {in_units}"


def kill_thread(thread: threading.Thread, exc: type[BaseException] = ProducerKilled) -> None:
    """Raise ``exc`` asynchronously in ``thread`` (delivered when it next runs Python bytecode)."""
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))
    assert n == 1, f"PyThreadState_SetAsyncExc affected {n} threads"


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``pred`` until true (no timing is asserted; the timeout only prevents hangs)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


def run_child(code: str, *, args: Iterable[str] = (), timeout: float = 60.0,
              on_line: Callable[[str, subprocess.Popen], None] | None = None) -> tuple[int, list[str]]:
    """Run ``code`` in a fresh Python process; stream its stdout lines to ``on_line``.

    Returns:
        ``(returncode, lines)``; a SIGKILLed child returns ``-9``.
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if on_line is not None:
                on_line(line, proc)
        proc.wait()
    finally:
        timer.cancel()
    if proc.returncode not in (0, -9):
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}")
    return proc.returncode, lines
