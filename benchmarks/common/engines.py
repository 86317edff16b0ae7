"""knitdata's engines as the transfer benchmark drives them: the embedded run (consumers as threads) and one
local Ray cluster per run (on loopback) with datasets attached in consumer processes."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks.common.consumer import (
    ConsumerStepRecord,
    batch_spec,
    consume,
    dataset_kwargs,
    knitdata_source,
    make_trainer,
    metrics_wait_key,
    pipeline_kwargs,
)
from benchmarks.common.models import VLMConfig
from benchmarks.common.workload import TransferWorkload, make_step_groups
from knitdata.errors import EngineError, KnitdataError
from knitdata.record import Trajectory

__all__ = ["LoopbackError", "run_embedded", "PROCESS_MODES_ENGINE", "attach_dataset", "RayCluster"]


class LoopbackError(KnitdataError, RuntimeError):
    """A server of the benchmark listens on an address other than loopback; the benchmark refuses to run."""


def _fill_pipeline(pipe: Any, w: TransferWorkload) -> set[str]:
    ids: set[str] = set()
    for step in range(w.total_steps):
        for group in make_step_groups(w, step):
            for t in group:
                pipe.put(t)
                ids.add(t.id)
    pipe.close()
    return ids


def run_embedded(w: TransferWorkload, cfg: VLMConfig, fetch: str, encoding: str, timeout_s: float,
                  progress: Any = None, device: str = "cpu", compute: str = "cpu",
                  calibration: Mapping[str, Any] | None = None, media_dedup: bool = True,
                  ) -> tuple[list[list[ConsumerStepRecord]], list[dict], set[str], dict]:
    """``fetch`` on the embedded engine: one process, consumers are threads (one torch thread each), training on
    ``device`` (``compute="accel"``: waiting the calibrated compute instead); ``media_dedup``: see
    :func:`~benchmarks.common.consumer.pipeline_kwargs`."""
    from knitdata.pipeline import Pipeline

    pipe = Pipeline(batch_spec(w), engine="embedded", **pipeline_kwargs(w, media_dedup))
    t0 = time.perf_counter()
    expected = _fill_pipeline(pipe, w)
    fill_s = time.perf_counter() - t0
    filled = storage_report(pipe, w)
    n = w.num_consumers
    barrier = threading.Barrier(n)
    trainers = [make_trainer(w, cfg, encoding, compute, calibration, device) for _ in range(n)]
    out: list[Any] = [None] * n
    errs: list[BaseException | None] = [None] * n

    def consumer(rank: int) -> None:
        ds = pipe.dataset(rank, fetch=fetch, **dataset_kwargs(w, cfg, encoding))
        it = iter(ds)
        try:
            out[rank] = consume(w, knitdata_source("only", trainers[rank], ds, it, w.media_kinds),
                                 lambda: barrier.wait(timeout_s),
                                 (lambda s: progress.update(1)) if (rank == 0 and progress is not None) else None)
        except BaseException as e:
            errs[rank] = e
            barrier.abort()
        finally:
            getattr(it, "close", lambda: None)()

    threads = [threading.Thread(target=consumer, args=(r,), name=f"bench-consumer-{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        raise EngineError(f"embedded consumers did not finish within {timeout_s:.0f} s")
    for e in errs:
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise e
    extras: list[dict[str, Any]] = [{"metrics": pipe.metrics(r).to_dict()} for r in range(n)]
    for x in extras:
        x["wait_source"] = metrics_wait_key(x["metrics"])
    return out, extras, expected, {"fill_s": fill_s, "storage": storage_report(pipe, w, filled)}


def storage_report(pipe: Any, w: TransferWorkload, filled: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the pipeline's storage units hold and held, from their stats (:class:`~knitdata.storage.base.StorageStats`).

    Keys: ``media_dedup``, ``groups``, ``bytes_stored`` (used bytes), ``bytes_stored_per_group``,
    ``media_items``, ``media_bytes``, ``media_refs``, ``media_bytes_saved`` (what per-trajectory copies would hold
    beyond ``media_bytes``), ``high_water_bytes`` (the units' storage high-water marks, summed), ``bytes_fetched``
    (handed out by the units: records and media), ``bytes_stored_after_run``. With ``filled`` (the report right
    after the whole workload was put, before any read) the holdings are those of ``filled`` and the high-water
    mark, bytes fetched and ``bytes_stored_after_run`` are now's.
    """
    units = pipe.stats().get("units", {}) or {}
    tot = {k: int(sum(int((u or {}).get(k, 0) or 0) for u in units.values()))
           for k in ("used_bytes", "high_water_bytes", "media_items", "media_bytes", "media_refs", "media_bytes_saved",
                     "bytes_fetched", "num_items")}
    groups = w.total_steps * w.groups_per_step
    now = {"media_dedup": bool(pipe.internals.config.get("media_dedup", True)), "groups": groups,
           "bytes_stored": tot["used_bytes"], "bytes_stored_per_group": tot["used_bytes"] / groups if groups else None,
           "trajectories_held": tot["num_items"], "media_items": tot["media_items"], "media_bytes": tot["media_bytes"],
           "media_refs": tot["media_refs"], "media_bytes_saved": tot["media_bytes_saved"]}
    out = dict(filled) if filled is not None else now
    out.update(high_water_bytes=tot["high_water_bytes"], bytes_fetched=tot["bytes_fetched"],
               bytes_stored_after_run=tot["used_bytes"])
    return out


#: How the process modes reach knitdata (stated in the JSON and the README).
PROCESS_MODES_ENGINE = (
    "knitdata Pipeline(engine='ray') (coordinator actor: the control plane; one "
    "storage-unit actor; Ray object store on loopback) fed by the driver, and a TrajectoryDataset per rank in "
    "each of the 4 consumer processes"
)


def attach_dataset(job: Mapping[str, Any], rank: int, w: TransferWorkload, cfg: VLMConfig) -> Any:
    """The :class:`~knitdata.consumer.dataset.TrajectoryDataset` of ``rank`` in a consumer process (Ray engine).

    Attaches to the driver's Ray cluster (loopback only) and to the pipeline's coordinator by name.
    """
    from knitdata.engines.ray import connect as ray_connect

    ray_connect.connect(job["ray_address"], loopback_only=True)
    from knitdata.pipeline import Pipeline

    kw = dataset_kwargs(w, cfg, job["encoding"])
    return Pipeline.attach(job["pipeline"], address=job["ray_address"]).dataset(rank, fetch=job["fetch"], **kw)


def _parallel_put(put: Callable[[Trajectory], Any], trajs: Sequence[Trajectory], threads: int = 4) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="knitdata-bench-put") as ex:
        for f in [ex.submit(put, t) for t in trajs]:
            f.result()


class RayCluster:
    """One local Ray per benchmark run, on loopback (address='local'): transferqueue's actors, then knitdata's."""

    def __init__(self, object_store_bytes: int = 4 << 30) -> None:
        self.object_store_bytes = int(object_store_bytes)
        self.address: str | None = None
        self.node: str | None = None
        self.startup_s = 0.0
        self._runs = 0
        self._pipes: dict[str, Any] = {}
        self._filled: dict[str, dict[str, Any]] = {}  # pipeline name -> its storage report once filled

    def start(self) -> None:
        """Start Ray (once; later calls return at once)."""
        if self.address is not None:
            return
        t0 = time.perf_counter()
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        from knitdata.engines.ray import connect as ray_connect

        if ray.is_initialized():
            raise EngineError("Ray is already initialized in this process; the transfer benchmark starts its own")
        for attempt in range(3):  # on an overloaded machine the raylet can miss Ray's fixed 30 s start-up wait
            try:
                ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                         logging_level="ERROR",  # type: ignore[arg-type]  # ray annotates int; takes names too
                         _node_ip_address=ray_connect.LOOPBACK, object_store_memory=self.object_store_bytes,
                         runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                                   "TQ_NUM_THREADS": "1"}})
                break
            except Exception as e:
                if "timed out during startup" not in str(e) or attempt == 2:
                    raise
                ray.shutdown()
                time.sleep(5)
        try:
            ray_connect.check_loopback()
        except EngineError as e:
            ray.shutdown()
            raise LoopbackError(str(e)) from e
        self.address = ray.get_runtime_context().gcs_address
        self.node = ray_connect.current_node()
        self.startup_s = time.perf_counter() - t0

    def prepare_engine(self, w: TransferWorkload, media_dedup: bool = True) -> tuple[dict[str, Any], set[str], float]:
        """A fresh Ray-engine :class:`~knitdata.pipeline.Pipeline` holding the whole workload (closed); its storage
        report once filled is kept (:meth:`engine_storage`). ``media_dedup``: media stored once (``False``:
        per-trajectory copies)."""
        from knitdata.pipeline import Pipeline

        t0 = time.perf_counter()
        self._runs += 1
        name = f"knitdata_bench_{os.getpid()}_{self._runs}"
        kw = pipeline_kwargs(w, media_dedup)
        pipe = Pipeline(batch_spec(w), admission=kw["admission"], num_consumers=w.num_consumers, engine="ray",
                        capacity_bytes=kw["capacity_bytes"], token_budget=kw["token_budget"], release="commit",
                        media_dedup=kw["media_dedup"], engine_options={"name": name, "address": self.address})
        self._pipes[name] = pipe
        ids: set[str] = set()
        for step in range(w.total_steps):
            trajs = [t for group in make_step_groups(w, step) for t in group]
            _parallel_put(pipe.put, trajs)  # a step's puts overlap (start-up, not measured)
            ids.update(t.id for t in trajs)
        pipe.close()
        self._filled[name] = storage_report(pipe, w)
        job = {"kind": "knitdata", "engine": "ray_engine", "ray_address": self.address, "pipeline": name}
        return job, ids, time.perf_counter() - t0

    def engine_storage(self, name: str, w: TransferWorkload) -> dict[str, Any] | None:
        """The storage report of pipeline ``name`` now (after its run), ``bytes_stored_per_group`` as filled
        (:func:`storage_report`), or ``None``."""
        pipe = self._pipes.get(name)
        if pipe is None:
            return None
        try:
            return storage_report(pipe, w, self._filled.get(name))
        except Exception:  # stats are a report, not the measurement
            return None

    def engine_bytes_fetched(self, name: str) -> int | None:
        """Bytes the storage units of pipeline ``name`` handed out (its stats), if known."""
        pipe = self._pipes.get(name)
        if pipe is None:
            return None
        try:
            units = pipe.stats().get("units", {})
            return int(sum((u or {}).get("bytes_fetched", 0) for u in units.values()))
        except Exception:  # stats are a report, not the measurement
            return None

    def finish_runs(self) -> None:
        """Stop every pipeline (coordinator and storage units) created for the runs."""
        for pipe in self._pipes.values():
            pipe.shutdown()
        self._pipes = {}

    def close(self) -> None:
        if self.address is None:
            return
        import ray

        try:
            self.finish_runs()
        finally:
            ray.shutdown()
            self.address = None
