"""Consumer worker processes of the transfer benchmark: the worker pool (spawned once per run, each worker a
consumer rank pinned to one torch thread) and the jobs it runs (a mode's sources, interleaved or alone)."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import time
from collections.abc import Callable, Mapping
from typing import Any

from benchmarks.common.baselines import TQAsyncSource, TQLoaderSource, TQSource
from benchmarks.common.consumer import (
    ConsumerStepRecord,
    StepItem,
    StepSource,
    consume_interleaved,
    knitdata_source,
    make_trainer,
    metrics_wait_key,
    pin_threads,
)
from benchmarks.common.engines import attach_dataset
from benchmarks.common.floor import FloorSource
from benchmarks.common.models import VLMConfig
from benchmarks.common.workload import TransferWorkload
from knitdata.errors import ConfigError, EngineError

__all__ = ["job_base", "WorkerPool"]


def _workload_from_dict(d: Mapping[str, Any]) -> TransferWorkload:
    fields = {f.name for f in dataclasses.fields(TransferWorkload)}
    kw = {k: v for k, v in d.items() if k in fields}
    kw["image_shape"] = tuple(kw["image_shape"])
    return TransferWorkload(**kw)


def job_base(w: TransferWorkload, cfg: VLMConfig, encoding: str) -> dict[str, Any]:
    return {"workload": w.to_dict(), "model": cfg.to_dict(), "encoding": encoding}


def _run_worker_job(rank: int, job: Mapping[str, Any], barrier: Any, res_q: Any, barrier_timeout: float) -> dict:
    """Run every source of ``job`` interleaved step by step; one trainer per encoding."""
    w = _workload_from_dict(job["workload"])
    cfg = VLMConfig(**job["model"])
    trainers: dict[str, Any] = {}

    def wait() -> None:
        barrier.wait(barrier_timeout)

    def on_step(k: int) -> None:
        if rank == 0:
            res_q.put(("step", rank, k))

    extra: dict[str, dict[str, Any]] = {}
    closers: list[Callable[[], Any]] = []
    sources: list[StepSource] = []
    try:
        for spec in job["sources"]:
            enc = spec["encoding"]
            if enc not in trainers:
                trainers[enc] = make_trainer(w, cfg, enc, job.get("compute", "cpu"), job.get("calibration"))
            name = spec["name"]
            extra[name] = {}
            if spec["kind"] in ("transferqueue", "tq_async", "tq_loader"):
                if spec["kind"] == "transferqueue":
                    src: Any = TQSource(spec["conf"], rank, w, cfg, task=spec["task"])
                elif spec["kind"] == "tq_async":
                    src = TQAsyncSource(spec["conf"], rank, w, cfg, enc, spec["task"])
                else:
                    src = TQLoaderSource(spec["conf"], rank, w, cfg, enc, spec["task"],
                                          num_workers=spec.get("num_workers", 1),
                                          prefetch_factor=spec.get("prefetch_factor", 2))
                closers.append(src.close)

                def nxt(src: Any = src) -> tuple[StepItem, float, float | None]:
                    t0 = time.perf_counter()
                    item = src.fetch()
                    return item, time.perf_counter() - t0, src.last_wait

                # transferqueue's controller records consumption at get_meta: no per-step state call is needed
                sources.append(StepSource(name, trainers[enc], nxt))
                extra[name]["wait_source"] = spec["kind"]
            elif spec["kind"] == "floor":
                fl = FloorSource(rank, w, cfg, enc)
                closers.append(fl.close)

                def nxt_floor(fl: FloorSource = fl) -> tuple[StepItem, float, float | None]:
                    t0 = time.perf_counter()
                    item = fl.fetch()
                    return item, time.perf_counter() - t0, fl.last_wait

                # the least a prefetching design can do: a pop per micro-batch, a small state, an enqueued commit
                sources.append(StepSource(name, trainers[enc], nxt_floor, fl.state, fl.commit))
                extra[name]["wait_source"] = "floor"
            elif spec["kind"] == "knitdata":
                ds = attach_dataset(spec, rank, w, cfg)
                it = iter(ds)
                closers.append(getattr(it, "close", lambda: None))
                # every step: save the loader state and commit it (releases the step's payloads); both are
                # data calls of the trainer, counted as exposed latency
                sources.append(knitdata_source(name, trainers[enc], ds, it, w.media_kinds))
                if getattr(ds, "metrics", None) is not None:
                    extra[name]["_metrics_of"] = ds.metrics
            else:  # pragma: no cover - programming error
                raise ConfigError(f"unknown source kind {spec['kind']!r}")
        recs = consume_interleaved(w, sources, wait, on_step)
    finally:
        for close in closers:
            try:
                close()
            except Exception:
                pass
    for d in extra.values():
        m = d.pop("_metrics_of", None)
        if m is not None:
            d["metrics"] = m.to_dict()
            d["wait_source"] = metrics_wait_key(d["metrics"])
    return {"records": {n: [dataclasses.asdict(r) for r in v] for n, v in recs.items()}, "extra": extra}


def _worker_main(rank: int, cmd_q: Any, res_q: Any, barrier: Any, barrier_timeout: float,
                 driver_pid: int | None = None) -> None:
    """Entry of one consumer process: runs jobs until it receives ``None`` (or its driver process is gone)."""
    import traceback

    pin_threads()
    parent = os.getppid() if driver_pid is None else driver_pid
    _preimport()
    while True:
        try:
            job = cmd_q.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:  # the driver died (killed, timed out): no orphan stays behind
                return
            continue
        if job is None:
            return
        try:
            out = _run_worker_job(rank, job, barrier, res_q, barrier_timeout)
            res_q.put(("ok", rank, json.dumps(out)))
        except BaseException:  # report everything to the driver; never hang the others
            try:
                barrier.abort()
            except Exception:
                pass
            res_q.put(("error", rank, traceback.format_exc()))


def _preimport() -> None:
    """Import what the jobs need while the driver starts its servers (start-up, not measured)."""
    import importlib

    for mod in ("knitdata.consumer.collate", "knitdata.media.multimodal", "knitdata.media.encoder", "knitdata.consumer.dataset",
                "knitdata.consumer.prefetch", "transfer_queue", "knitdata.engines.ray.engine"):
        try:
            importlib.import_module(mod)
        except Exception:  # optional extras; the job reports what it really lacks
            pass


class WorkerPool:
    """``n`` consumer processes (spawned once per run) that run one job at a time, all ranks together."""

    def __init__(self, n: int, barrier_timeout: float = 300.0):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.n = n
        self.cmd = [ctx.Queue() for _ in range(n)]
        self.res = ctx.Queue()
        self.barrier = ctx.Barrier(n)
        env_before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TQ_NUM_THREADS")}
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["TQ_NUM_THREADS"] = "1"
        try:
            self.procs = [
                ctx.Process(target=_worker_main,
                            args=(r, self.cmd[r], self.res, self.barrier, barrier_timeout, os.getpid()),
                            name=f"knitdata-bench-consumer-{r}", daemon=False)
                for r in range(n)
            ]
            for p in self.procs:
                p.start()
        finally:
            for k, v in env_before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def run(self, job: Mapping[str, Any], timeout_s: float, progress: Any = None
            ) -> tuple[dict[str, list[list[ConsumerStepRecord]]], dict[str, list[dict]]]:
        """Run ``job`` on every rank; per source name, the records and extras of each rank."""
        for q in self.cmd:
            q.put(dict(job))
        done: dict[int, dict] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) + len(errors) < self.n:
            left = deadline - time.monotonic()
            try:
                kind, rank, payload = self.res.get(timeout=max(0.1, min(left, 5.0)))
            except queue.Empty:
                if time.monotonic() > deadline:
                    self.close(force=True)
                    raise EngineError(f"consumer processes did not finish within {timeout_s:.0f} s") from None
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    self.close(force=True)
                    raise EngineError(f"consumer processes died: {dead}") from None
                continue
            if kind == "step":
                if progress is not None:
                    progress.update(1)
            elif kind == "ok":
                done[rank] = json.loads(payload)
            else:
                errors[rank] = payload
        if errors:
            self.barrier.reset()
            primary = [r for r, e in errors.items() if "BrokenBarrierError" not in e.strip().splitlines()[-1]]
            first = min(primary or errors)
            raise EngineError(f"consumer {first} failed:\n{errors[first]}")
        names = list(done[0]["records"])
        recs = {n: [[ConsumerStepRecord(**d) for d in done[r]["records"][n]] for r in range(self.n)] for n in names}
        extras = {n: [done[r]["extra"].get(n, {}) for r in range(self.n)] for n in names}
        return recs, extras

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.cmd:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
