"""Tracing on vs off, side by side in one run: the ``--trace`` comparison of ``bench loader`` and ``bench control``.

:func:`compare` runs one measurement function alternately with this process's tracer off and on (a fresh trace
file per run, :mod:`knitdata.trace`), interleaved in alternating order, and reports the median of the per-repeat
ratios of wall time (on over off), and of process CPU time (every thread, the trace's writer included; steadier on
a shared machine), with the load average at start and end.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from knitdata import trace as tracing

__all__ = ["compare", "format_line"]


def compare(measure: Callable[[], Any], repeats: int = 7, what: str = "") -> dict[str, Any]:
    """Time ``measure()`` with tracing off and on, ``repeats`` interleaved pairs after one warm-up pair.

    Returns:
        ``{"what", "repeats", "off_s", "on_s", "ratio_per_repeat", "median_ratio", "events", "load_average_start",
        "load_average_end", "median_cpu_ratio", ...}`` (``median_ratio``: median of on/off per pair).
    """
    tracing.stop()
    tmp = tempfile.mkdtemp(prefix="knitdata-trace-ab-")
    load0 = list(os.getloadavg())
    off: list[float] = []
    on: list[float] = []
    cpu: dict[bool, list[float]] = {False: [], True: []}
    events = 0
    try:
        for r in range(repeats + 1):
            for traced in ((False, True) if r % 2 == 0 else (True, False)):
                path = os.path.join(tmp, f"r{r}.json")
                if traced:
                    tracing.start(path, "bench")
                gc.collect()
                c0, t0 = time.process_time(), time.perf_counter()
                measure()
                if traced:
                    tracing.stop()  # the last flush counts
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if traced:
                    events += tracing.merge(path)["events"]
                if r:  # the first pair warms up
                    (on if traced else off).append(dt)
                    cpu[traced].append(dc)
    finally:
        tracing.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = [a / b for a, b in zip(on, off)]
    cpu_ratios = [a / b for a, b in zip(cpu[True], cpu[False]) if b > 0]
    return {"what": what, "repeats": repeats, "off_s": off, "on_s": on, "ratio_per_repeat": ratios,
            "median_ratio": statistics.median(ratios),
            "ratio_of_medians": statistics.median(on) / statistics.median(off), "cpu_off_s": cpu[False], "cpu_on_s": cpu[True],
            "median_cpu_ratio": statistics.median(cpu_ratios), "events_per_traced_run": events / (repeats + 1),
            "load_average_start": load0, "load_average_end": list(os.getloadavg())}


def format_line(doc: dict[str, Any]) -> str:
    """One line: the median ratio, the spread, the events per run and the load."""
    r = doc["ratio_per_repeat"]
    return (f"tracing on/off ({doc['what']}): median ratio {doc['median_ratio']:.3f} over {doc['repeats']} pairs "
            f"(min {min(r):.3f}, max {max(r):.3f}; ratio of the medians {doc['ratio_of_medians']:.3f}), CPU time {doc['median_cpu_ratio']:.3f}; median off {statistics.median(doc['off_s']) * 1e3:.1f} ms; "
            f"{doc['events_per_traced_run']:.0f} events per traced run; load average "
            f"{doc['load_average_start'][0]:.2f} -> {doc['load_average_end'][0]:.2f}")
