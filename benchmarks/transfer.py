"""Transfer benchmark: exposed transfer latency and step time, transferqueue vs knitdata sample/eager/iter.

One fixed multimodal RL workload (the seed's Figures 8 and 11a-c): groups of ``n = 8`` trajectories of 2,048
tokens that share one ``3x448x448`` uint8 image per group, 4 consumer processes, micro-batches of 4
trajectories, 4 micro-batches per step, one torch thread per process, warm-up steps excluded, start-up
excluded. ``--workload omni`` gives each group a short video (an MP4 container made with PyAV, decoded and
sampled by the consumers with ``knitdata.media.video``; ``--omni-video frames`` stores its frames as image items
instead; 4 frames at 224 px by default on this 2-core machine; the seed's 16 at 448 px with ``--omni-seed-size``, which also defaults to 1 + 4
steps and each mode alone) and a 30 s 16 kHz audio clip stored as FLAC bytes and decoded with soundfile; the model
gets an audio encoder. It is delivered by

* ``transferqueue`` -- the real ``transferqueue`` package as verl drives it (controller + SimpleStorage units as
  Ray actors, started once per run on loopback only; one partition per consumer rank; the trainer calls
  ``get_meta``/``get_data`` synchronously per micro-batch),
* ``transferqueue_best`` -- transferqueue at its best, the better (lower exposed latency, per encoding) of
  (a) ``async``: its ``AsyncTransferQueueClient`` in a background thread fetching and processing two
  micro-batches ahead, and (b) ``loader``: its own ``StreamingDataset`` + ``StreamingDataLoader`` (worker
  processes, ``prefetch_factor``) as its documentation recommends; both sub-figures are kept,
* ``sample`` / ``eager`` / ``iter`` -- knitdata's fetch modes with consumers as separate processes: the Ray
  engine (:mod:`knitdata.engines.ray.engine`); with ``shared`` encoding the rank's
  :class:`~knitdata.consumer.dataset.TrajectoryDataset` takes a ``media_collator``,
* ``iter_embedded`` -- ``iter`` on the embedded engine (consumers are threads of one process), a reference,
* ``floor`` -- no data system: each consumer's share of the trajectories in its own memory, its micro-batches built
  ahead by a thread with knitdata's collators, the trainer's calls a ``deque`` pop, a two-key state and an enqueued
  commit (:mod:`benchmarks.common.floor`): the least any prefetching design exposes on this machine under this load.

The process-mode sources are prepared first, then run interleaved step by step in the same 4 consumer
processes (step ``s`` of every source, then step ``s + 1``), so the drifting load of a shared machine hits
them alike. Since prefetching sources work ahead while the others' steps run, each process mode then runs
alone in the same processes as a control (``controls``); ``iter_embedded`` runs afterwards in the driver.

Every consumer trains a tiny vision-language model (a patch-MLP vision encoder, an audio encoder for omni, and an
MLP backbone) on each micro-batch (``--compute cpu``), or waits exactly what that training costs alone on this
machine (``--compute accel``, the default: each consumer's compute is a sleep of its cost calibrated before the run,
per micro-batch and encoding, so the host CPU is free during compute as on a GPU node, while fetch, decode, collate
and every data call stay real; see :data:`COMPUTE_MEASURES`), with the media encoded per copy (``dup``: what verl
and slime do) or once per mini-batch with :class:`~knitdata.media.encoder.SharedEncoding` (``shared``; on transferqueue
too, so the 2x2 table ``end_to_end`` separates transfer and encoding effects). Exposed latency: per step, the wall
time of every data call of the trainer -- ``next()`` for every system, plus knitdata's ``state_dict()`` and
``commit()`` after the optimizer step -- median over the measured steps, broken down by call: ``next()`` waiting for
data (``wait_ms``), ``next()``'s own work (``own_ms``), ``state_dict()`` and ``commit()``. The GPU projection
(``gpu_projection``, labelled ``projected`` with its assumptions) replaces this CPU's compute time with the FLOPs of
a 7B-class model at a stated rate and keeps the transfer times measured here; ``--gpu`` measures knitdata's modes on
CUDA instead.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/transfer.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common.baselines import TQServer
from benchmarks.common.consumer import calibrate_compute, tq_patience
from benchmarks.common.engines import PROCESS_MODES_ENGINE, RayCluster, run_embedded
from benchmarks.common.floor import floor_ids
from benchmarks.common.harness import WorkerPool, job_base
from benchmarks.common.models import DEFAULT_GPU_TFLOPS, OMNI_SMOKE_VLM, OMNI_VLM, SMOKE_VLM, TINY_VLM, VLMConfig
from benchmarks.common.output import command_line, write_json
from benchmarks.common.summary import (
    add_speedups,
    bytes_moved_from_metrics,
    compute_summary,
    count_flops,
    format_table,
    machine_info,
    media_summary,
    pick_tq_best,
    plot_result,
    summarize_mode,
    two_by_two,
)
from benchmarks.common.workload import (
    COMPUTE_MEASURES,
    COMPUTE_MODES,
    ENCODINGS,
    MODES,
    SEED_OMNI_FRAMES,
    SEED_OMNI_PX,
    TQ_BEST_VARIANTS,
    WORKLOADS,
    TransferWorkload,
    omni_workload,
)
from knitdata.errors import ConfigError

__all__ = [
    "run_transfer_benchmark",
    "GpuPreset",
    "GPU_PRESET_VLM",
    "gpu_config",
    "require_cuda",
    "run_gpu_benchmark",
    "add_arguments",
    "run",
    "stem_of",
    "main",
]


def run_transfer_benchmark(
    w: TransferWorkload | None = None,
    modes: Sequence[str] = MODES,
    *,
    shared_modes: Sequence[str] = ("transferqueue_best", "iter", "iter_embedded"),
    controls: Sequence[str] | None = None,
    control_encodings: Sequence[str] = ENCODINGS,
    tq_best_variants: Sequence[str] = TQ_BEST_VARIANTS,
    loader_workers: int = 1,
    cfg: VLMConfig = TINY_VLM,
    gpu_tflops: float = DEFAULT_GPU_TFLOPS,
    tq_units: int = 2,
    timeout_s: float = 900.0,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    compute: str = "accel",
    calibration_reps: int = 5,
    interleave: bool = True,
    media_dedup: bool = True,
    copies_controls: Sequence[str] = (),
) -> dict[str, Any]:
    """Run every requested mode side by side on one workload and return the JSON-serializable result.

    With ``compute="accel"`` the consumers' compute is first calibrated alone in this process
    (:func:`calibrate_compute`, before any server or consumer process starts), then every consumer waits that
    long instead of computing; ``compute="cpu"`` trains the tiny model on the CPU (:data:`COMPUTE_MEASURES` says
    what each measures). The result holds, beside the per-run tables, a summary under the key named by
    ``compute`` (:func:`compute_summary`).

    Args:
        w: The workload (default: the fixed image one).
        modes: Subset of :data:`MODES` (run in that order).
        shared_modes: Modes also run with :class:`~knitdata.media.encoder.SharedEncoding`.
        controls: Process modes (``transferqueue``, ``transferqueue_best``, ``sample``, ``eager``, ``iter``,
            ``floor``) also run alone afterwards, each with the encodings it ran with (default: every process mode
            that ran).
        control_encodings: The encodings the controls run with (when the mode ran with them).
        tq_best_variants: How ``transferqueue_best`` drives transferqueue (subset of :data:`TQ_BEST_VARIANTS`);
            the variant with the lower exposed latency is reported per encoding.
        loader_workers: ``num_workers`` of transferqueue's streaming loader (variant ``loader``).
        cfg: The model the consumers train.
        gpu_tflops: Effective GPU rate for the projection.
        tq_units: transferqueue SimpleStorage units.
        timeout_s: Limit per run (consumers that do not finish raise :class:`~knitdata.errors.EngineError`).
        progress: Show tqdm bars.
        log: Where to print notes (default: stderr).
        compute: ``"accel"`` (compute as a calibrated wait) or ``"cpu"`` (compute on the CPU).
        calibration_reps: Timed steps per encoding of the calibration (``accel``).
        interleave: Run the process modes interleaved step by step before running each alone; ``False``: each
            alone only (what fits in memory at the seed's omni size).
        media_dedup: knitdata stores each media item once per unit and a consumer's share fetches each once
            (``False``: per-trajectory copies, as before issue 43).
        copies_controls: knitdata process modes (``sample``, ``eager``, ``iter``) also run alone with
            per-trajectory copies (``media_dedup=False``), with each encoding they ran with, for the comparison
            (``result["media_copies"]``; ``result["media"]`` compares bytes stored, moved and the high-water mark).

    Raises:
        ConfigError: Unknown modes, variants or compute mode.
        LoopbackError: transferqueue or Ray listens on a non-loopback address.
        EngineError: Consumers failed or timed out.
    """
    from tqdm import tqdm

    w = w or TransferWorkload()
    if compute not in COMPUTE_MODES:
        raise ConfigError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")
    if "ray" not in sys.modules:
        # Keeps Ray (and transferqueue's servers) on 127.0.0.1 on this kind of machine.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    tq_patience()
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"unknown modes {bad}; choose from {MODES}")
    bad = [v for v in tq_best_variants if v not in TQ_BEST_VARIANTS]
    if bad or not tq_best_variants:
        raise ConfigError(f"tq_best_variants must be a non-empty subset of {TQ_BEST_VARIANTS}, got {list(tq_best_variants)}")
    modes = [m for m in MODES if m in modes]
    process_modes = ("transferqueue", "transferqueue_best", "sample", "eager", "iter", "floor")
    controls = [m for m in (controls if controls is not None else process_modes) if m in modes]
    bad = [m for m in controls if m not in process_modes]
    if bad:
        raise ConfigError(f"controls must be process modes {process_modes}, got {bad}")
    bad = [m for m in copies_controls if m not in ("sample", "eager", "iter")]
    if bad:
        raise ConfigError(f"copies_controls must be knitdata process modes (sample, eager, iter), got {bad}")
    if not interleave:  # every process mode runs alone, with every encoding it runs with
        controls = [m for m in process_modes if m in modes]
        control_encodings = ENCODINGS
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    machine = machine_info()  # the load average before anything of the benchmark runs
    runs: list[tuple[str, str]] = [(m, "dup") for m in modes] + [(m, "shared") for m in modes if m in shared_modes]
    calibration: dict[str, Any] | None = None
    if compute == "accel":
        # Alone, before any server, consumer process or FLOP count starts: what the compute costs on this machine.
        encs = [e for e in ENCODINGS if any(r[1] == e for r in runs)]
        say(f"calibrating the compute ({', '.join(encs)}; {calibration_reps} timed steps each, one torch thread)")
        calibration = calibrate_compute(w, cfg, encs, reps=calibration_reps)
        say("calibrated compute per step: " + ", ".join(f"{e} {calibration[e]['step_s']:.3f} s" for e in encs))
    result: dict[str, Any] = {
        "benchmark": "transfer",
        "compute": compute,
        "compute_measures": COMPUTE_MEASURES[compute],
        "interleaved_run": interleave,
        "media_dedup": bool(media_dedup),
        "workload": w.to_dict(),
        "model": cfg.to_dict(),
        "machine": machine,
        "modes": {},
        "controls": {},
        "media_copies": {},
        "runs": [],
        "control_runs": [],
        "notes": [],
        "startup_s": {},
        "exposed_latency_counts": (
            "every data call the trainer makes per step: knitdata: next() per micro-batch, then state_dict() and "
            "commit() after the optimizer step; transferqueue: its get_meta + get_data (sync), or next() of its "
            "prefetching client or streaming loader (its controller records consumption at get_meta: no state "
            "call per step)"),
        "transferqueue_best_variants": {
            "async": "AsyncTransferQueueClient in a background thread of each consumer, fetching and processing "
                     "2 micro-batches ahead (shared encoding: one step ahead, the step's media batch built there)",
            "loader": f"transferqueue's StreamingDataset + StreamingDataLoader (num_workers={loader_workers}, "
                      "prefetch_factor=2, spawn), batch = the rank's share of a step, rows processed in its "
                      "collate_fn",
        },
    }
    if calibration is not None:
        result["calibration"] = calibration
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        result["notes"].append("ray is not installed: transferqueue, sample, eager and iter (consumer processes) "
                               "skipped; install the 'ray' and 'baseline' extras")
        say(result["notes"][-1])
        runs = [r for r in runs if r[0] == "iter_embedded"]
    pool: WorkerPool | None = None

    def bar(label: str) -> Any:
        return tqdm(total=w.total_steps, desc=f"{label:<22}", disable=not progress, leave=False, file=sys.stderr)

    def record(mode: str, encoding: str, recs: Any, extras: Any, expected: set[str] | None, engine: str,
               control: bool = False, variant: str | None = None, section: str | None = None, **extra: Any) -> None:
        s = summarize_mode(recs, w, expected)
        s["run_wall_s"] = sum(max(r[i].step_s for r in recs) for i in range(w.total_steps))
        if s["bytes_moved_per_step"] is None:
            s["bytes_moved_per_step"] = bytes_moved_from_metrics(extras, w)
        s.update(mode=mode, encoding=encoding, engine=engine, **extra)
        srcs = sorted({str(e.get("wait_source")) for e in extras if e.get("wait_source")})
        s["wait_source"] = ",".join(srcs) if srcs else "unavailable"
        if variant is not None:
            s["variant"] = variant
        result["control_runs" if control else "runs"].append(s)
        top = result[section or ("controls" if control else "modes")].setdefault(mode, {})
        if variant is not None:
            top = top.setdefault("variants", {}).setdefault(variant, {})
        if encoding == "dup":
            top.update(s)
        else:
            top["shared"] = s

    t_mark = time.perf_counter()

    def mark(label: str) -> None:
        nonlocal t_mark
        now = time.perf_counter()
        result["timeline_s"].append([label, round(now - t_mark, 3)])
        t_mark = now

    result["timeline_s"] = []
    cluster = RayCluster(_object_store_bytes(w, interleave, sum(1 for m, _ in runs if m in ("sample", "eager", "iter"))))
    result["ray_object_store_bytes"] = cluster.object_store_bytes
    # FLOPs are counted (meta device) while servers start, never while a run is measured.
    from concurrent.futures import ThreadPoolExecutor

    flops_pool = ThreadPoolExecutor(1, thread_name_prefix="knitdata-bench-flops")
    flops_job = flops_pool.submit(count_flops, w, cfg)

    def before_measuring() -> None:
        if not flops_job.done():
            flops_job.result()
            mark("flop counts (waited)")

    def tq_sources(mode: str, enc: str, prefix: str) -> list[dict[str, Any]]:
        assert server is not None
        if mode == "transferqueue":
            return [{"name": f"transferqueue/{enc}", "kind": "transferqueue", "conf": server.conf, "encoding": enc,
                     "task": f"{prefix}sync_{enc}", "mode": mode}]
        return [{"name": f"tq_{v}/{enc}", "kind": f"tq_{v}", "conf": server.conf, "encoding": enc,
                 "task": f"{prefix}{v}_{enc}", "mode": mode, "variant": v, "num_workers": loader_workers}
                for v in tq_best_variants]

    def floor_source(enc: str) -> dict[str, Any]:
        return {"name": f"floor/{enc}", "kind": "floor", "encoding": enc, "mode": "floor"}

    def run_sources(sources: list[dict[str, Any]], label: str, control: bool) -> None:
        assert pool is not None
        before_measuring()
        job = {"sources": sources, **job_base(w, cfg, "dup"), "compute": compute, "calibration": calibration}
        say(f"{label}: " + ", ".join(x["name"] for x in sources))
        with tqdm(total=w.total_steps * len(sources), desc=label[:22], disable=not progress, leave=False,
                  file=sys.stderr) as pb:
            recs, extras = pool.run(job, timeout_s * len(sources), pb)
        for x in sources:
            name = x["name"]
            enc = x["encoding"]
            ex = extras[name]
            if x["kind"] == "knitdata":
                moved = cluster.engine_bytes_fetched(x["pipeline"])
                if moved is not None:
                    ex = [{"metrics": {"bytes_fetched": moved if r == 0 else 0}} for r in range(len(ex))]
                copies = x.get("media_dedup") is False
                record(x["fetch"], enc, recs[name], ex, expected_of[x["fetch"]], "ray (consumer processes; "
                       "knitdata.engines.ray.engine)", control=control, interleaved=not control, via="ray_engine",
                       prepare_s=x.get("prepare_s"), storage=cluster.engine_storage(x["pipeline"], w),
                       section="media_copies" if copies else None)
            elif x["kind"] == "floor":
                record("floor", enc, recs[name], ex, floor_ids(w), "none (a thread and a deque in each consumer "
                       "process: benchmarks/common/floor.py)", control=control, interleaved=not control)
            else:
                record(x["mode"], enc, recs[name], ex, expected_of["transferqueue"],
                       "transferqueue (Ray actors, ZMQ on loopback)", control=control, variant=x.get("variant"),
                       interleaved=not control)

    expected_of: dict[str, set[str]] = {}
    server: TQServer | None = None
    try:
        need_pool = any(m in process_modes for m, _ in runs)
        if need_pool:
            t0 = time.perf_counter()
            pool = WorkerPool(w.num_consumers)
            result["startup_s"]["consumer_processes_spawned"] = time.perf_counter() - t0
        # Sources of the process modes, all prepared first (start-up, not measured), then run interleaved step by
        # step in the same consumer processes: transferqueue (sync; best: async client and streaming loader), then
        # knitdata sample/eager/iter. Then each control alone.
        sources: list[dict[str, Any]] = []
        try:
            tq_runs = [r for r in runs if r[0] in ("transferqueue", "transferqueue_best")]
            if tq_runs:
                try:
                    import tensordict  # noqa: F401
                    import transfer_queue  # noqa: F401
                except ImportError as e:
                    result["notes"].append(f"transferqueue is not installed ({e}); its modes are skipped. "
                                           "Install the 'baseline' extra: pip install 'knitdata[baseline]'")
                    say(result["notes"][-1])
                    runs = [r for r in runs if r not in tq_runs]
                    tq_runs = []
                else:
                    server = TQServer(w, tq_units)
                    server.start(cluster)
                    mark("ray + transferqueue start")
                    result["transferqueue"] = {"addresses": server.addresses, "storage_units": tq_units,
                                               "startup_s": server.startup_s,
                                               "partitions": "one per consumer rank (its share of every step, "
                                                             "in order); each source reads under its own task_name"}
                    say(f"transferqueue up in {server.startup_s:.1f} s on {server.addresses}")
                    expected_of["transferqueue"] = server.put_all()
                    mark("transferqueue put")
                    result["transferqueue"]["put_s"] = server.put_s
                    result["startup_s"]["transferqueue"] = server.startup_s + server.put_s
                    if interleave:
                        for mode, enc in tq_runs:
                            sources += tq_sources(mode, enc, "")
            ray_runs = [r for r in runs if r[0] in ("sample", "eager", "iter")] if interleave else []
            if ray_runs:
                result["process_modes_via"] = {"ray_engine": PROCESS_MODES_ENGINE}
                cluster.start()
                for mode, enc in ray_runs:
                    job, expected, prep_s = cluster.prepare_engine(w, media_dedup)
                    sources.append({**job, "name": f"{mode}/{enc}", "fetch": mode, "encoding": enc,
                                    "prepare_s": prep_s})
                    expected_of[mode] = expected
                    mark(f"prepare {mode}/{enc} (ray_engine)")
            if interleave:
                sources += [floor_source(enc) for m, enc in runs if m == "floor"]
            if sources:
                run_sources(sources, "interleaved", control=False)
                mark("run process modes (interleaved)")
            cluster.finish_runs()  # frees the object store before the controls
            # Controls: each process mode alone (same consumer processes, nothing interleaved); transferqueue's
            # first, then its servers stop (their memory back) before knitdata's pipelines fill; the floor last.
            ctl = [r for r in runs if r[0] in controls and r[1] in control_encodings]
            ctl.sort(key=lambda r: (r[0] not in ("transferqueue", "transferqueue_best"), r[0] == "floor"))
            if ctl:
                result["controls_note"] = (
                    ("each mode alone in the same consumer processes after the interleaved run" if interleave else
                     "each mode alone in the same consumer processes (no interleaved run)")
                    + " (a fresh knitdata pipeline; transferqueue re-read under new task names)")
            for mode, enc in ctl:
                if mode in ("transferqueue", "transferqueue_best"):
                    srcs = tq_sources(mode, enc, "ctl_")
                elif mode == "floor":
                    srcs = [floor_source(enc)]
                else:
                    if server is not None:
                        server.close()
                        server = None
                        mark("transferqueue stop")
                    cluster.start()  # not started yet without an interleaved run (--no-interleave)
                    job, expected, prep_s = cluster.prepare_engine(w, media_dedup)
                    srcs = [{**job, "name": f"{mode}/{enc}", "fetch": mode, "encoding": enc, "prepare_s": prep_s}]
                    expected_of[mode] = expected
                for src in srcs:  # the variants of transferqueue_best also run one at a time
                    run_sources([src], f"alone {src['name']}", control=True)
                    mark(f"control {src['name']}")
                cluster.finish_runs()
            # per-trajectory copies (media_dedup=False), each alone, for the bytes and times they cost
            for mode, enc in [r for r in runs if r[0] in copies_controls and r[1] in control_encodings]:
                if server is not None:
                    server.close()
                    server = None
                    mark("transferqueue stop")
                cluster.start()
                job, expected, prep_s = cluster.prepare_engine(w, False)
                expected_of[mode] = expected
                src = {**job, "name": f"{mode}/{enc}/copies", "fetch": mode, "encoding": enc, "prepare_s": prep_s,
                       "media_dedup": False}
                run_sources([src], f"alone {src['name']}", control=True)
                mark(f"copies {src['name']}")
                cluster.finish_runs()
        finally:
            if server is not None:
                server.close()
            cluster.finish_runs()
        result["startup_s"]["ray"] = cluster.startup_s
        cluster.close()
        if pool is not None:
            pool.close()
            pool = None
        mark("ray shutdown")
        # iter on the embedded engine (always alone).
        for mode, enc in [r for r in runs if r[0] == "iter_embedded"]:
            before_measuring()
            with bar(f"{mode}/{enc}") as pb:
                e_recs, e_extras, expected, info = run_embedded(w, cfg, "iter", enc, timeout_s, pb, compute=compute,
                                                                 calibration=calibration, media_dedup=media_dedup)
            handed = (info.get("storage") or {}).get("bytes_fetched")
            if handed is not None:  # what the units handed out (each distinct media item once per request)
                e_extras = [{**x, "metrics": {**x.get("metrics", {}), "bytes_fetched": handed if r == 0 else 0}}
                            for r, x in enumerate(e_extras)]
            record(mode, enc, e_recs, e_extras, expected, "embedded (consumer threads)", **info)
            mark(f"run {mode}/{enc}")
    finally:
        cluster.close()
        if pool is not None:
            pool.close()
        torch.set_num_threads(threads_before)

    pick_tq_best(result["modes"])
    pick_tq_best(result["controls"])
    add_speedups(result, flops_job.result(), gpu_tflops)
    flops_pool.shutdown()
    try:
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    result[compute] = compute_summary(result)
    result["media"] = media_summary(result)
    result["total_s"] = time.perf_counter() - t_start
    return result


def _object_store_bytes(w: TransferWorkload, interleave: bool, knitdata_runs: int) -> int:
    """Ray's object store for the run: 4 GiB, or what the knitdata pipelines held at once need (all of them when
    interleaved, one when each runs alone) plus a quarter, at most half of this machine's memory."""
    held = (knitdata_runs if interleave else 1) * w.total_steps * w.trajectories_per_step * w.trajectory_bytes
    want = max(4 << 30, int(held * 1.25))
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return want
    return int(min(want, max(4 << 30, phys // 2)))


@dataclass(frozen=True)
class GpuPreset:
    """The ``--gpu`` preset: knitdata's fetch modes on the embedded engine (no Ray), training on CUDA.

    Sized to finish within 5 minutes on one H200. Estimate (FLOPs counted by :func:`count_step_flops`, ``dup``,
    all 4 consumers): image, 6 runs x 13 steps x 9.3e13 FLOPs; omni (16 frames at 448 px), 6 runs x 7 steps x
    5.8e14 FLOPs; at an effective 100-200 TFLOP/s (TF32 matmuls) that is about 40-80 s (image) and 120-245 s
    (omni) of compute, plus filling the pipeline once per run. Not yet run on a GPU.

    Attributes:
        workload: The workload (the image workload's shapes by default).
        model: The model each consumer trains on the GPU.
        fetches: knitdata fetch modes, each on the embedded engine (recorded as ``<fetch>_embedded``).
        encodings: Encodings each fetch mode runs with.
        device: The torch device.
        budget_s: The wall-time budget the preset is sized for.
    """

    workload: TransferWorkload
    model: VLMConfig
    fetches: tuple[str, ...] = ("sample", "eager", "iter")
    encodings: tuple[str, ...] = ENCODINGS
    device: str = "cuda"
    budget_s: float = 300.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable fields."""
        return {"workload": self.workload.to_dict(), "model": self.model.to_dict(), "fetches": list(self.fetches),
                "encodings": list(self.encodings), "device": self.device, "budget_s": self.budget_s}


#: The model of the ``--gpu`` preset: a 0.16B-parameter VLM (attention in both towers, 2x2 patch merger).
GPU_PRESET_VLM = VLMConfig(name="0.16B-class VLM (GPU preset)", d_model=1024, layers=4, heads=16, mlp_ratio=4,
                           vocab=32768, patch=14, d_vision=768, vision_layers=6, vision_heads=12, vision_mlp_ratio=4,
                           merge=4)


def gpu_config(workload: str = "image", steps: int | None = None, warmup: int | None = None) -> GpuPreset:
    """The ``--gpu`` preset for ``workload`` (``"image"``: 3 + 10 steps; ``"omni"``: 16 frames at 448 px, 2 + 5 steps).

    Raises:
        ConfigError: Unknown workload, or non-positive steps.
    """
    if workload not in WORKLOADS:
        raise ConfigError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    omni = workload == "omni"
    kw: dict[str, Any] = {"steps": (5 if omni else 10) if steps is None else steps,
                          "warmup_steps": (2 if omni else 3) if warmup is None else warmup}
    if workload == "omni":
        w = omni_workload(16, 448, cfg=GPU_PRESET_VLM, **kw)
    else:
        w = TransferWorkload(**kw)
    return GpuPreset(workload=w, model=GPU_PRESET_VLM)


def require_cuda() -> None:
    """Raise unless torch sees a CUDA device.

    Raises:
        ConfigError: No CUDA device (CPU-only torch, or no GPU visible).
    """
    if not torch.cuda.is_available():
        raise ConfigError(
            f"--gpu trains on CUDA, but torch {torch.__version__} sees no CUDA device "
            f"(torch.cuda.is_available() is False; built with CUDA {torch.version.cuda}). Run it on a machine "
            "with a GPU and a CUDA build of torch, or drop --gpu for the CPU benchmark."
        )


def run_gpu_benchmark(preset: GpuPreset, *, timeout_s: float = 600.0, progress: bool = True,
                      log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """knitdata's fetch modes on the embedded engine, training on CUDA (measured, not projected).

    Raises:
        ConfigError: No CUDA device.
    """
    from tqdm import tqdm

    require_cuda()
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    w, cfg = preset.workload, preset.model
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "transfer", "gpu": True, "preset": preset.to_dict(), "workload": w.to_dict(),
        "model": cfg.to_dict(), "machine": {**machine_info(), "gpu_name": torch.cuda.get_device_name()},
        "modes": {}, "controls": {}, "runs": [], "notes": ["measured on CUDA (not a projection); knitdata modes only, "
                                                         "embedded engine (consumer threads), no Ray"],
        "exposed_latency_counts": "next() per micro-batch plus state_dict() and commit() after the optimizer step",
    }
    for fetch in preset.fetches:
        for enc in preset.encodings:
            say(f"gpu: {fetch}_embedded/{enc}")
            with tqdm(total=w.total_steps, desc=f"{fetch}/{enc}", disable=not progress, leave=False,
                      file=sys.stderr) as pb:
                recs, extras, expected, info = run_embedded(w, cfg, fetch, enc, timeout_s, pb, device=preset.device)
            s = summarize_mode(recs, w, expected)
            s.update(mode=f"{fetch}_embedded", encoding=enc, engine="embedded (consumer threads), CUDA", **info)
            result["runs"].append(s)
            top = result["modes"].setdefault(f"{fetch}_embedded", {})
            if enc == "dup":
                top.update(s)
            else:
                top["shared"] = s
    for d in result["modes"].values():
        for x in (d, d.get("shared")):
            if x:
                x["exposed_ms"] = x["exposed_latency_s"] * 1e3
    m = result["modes"]
    result["end_to_end"] = two_by_two(m, "iter_embedded")
    result["exactly_once_all_runs"] = all(r["exactly_once"] for r in result["runs"])
    result["total_s"] = time.perf_counter() - t_start
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m benchmarks transfer``."""
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot")
    parser.add_argument("--workload", choices=WORKLOADS, default="image",
                        help="image: one 3x448x448 image per group; omni: a video (frames) and a 30 s 16 kHz "
                             "FLAC audio clip per group")
    parser.add_argument("--omni-frames", type=int, default=None,
                        help="omni: video frames (default 4; smoke 2; the seed's setting is 16)")
    parser.add_argument("--omni-px", type=int, default=None,
                        help="omni: frame side in px (default 224; smoke 112; the seed's setting is 448)")
    parser.add_argument("--omni-video", choices=("container", "frames"), default="container",
                        help="omni: the video as one MP4 container decoded by the consumers with PyAV (default; "
                             "the video extra) or as its frames stored as image items")
    parser.add_argument("--omni-seed-size", action="store_true",
                        help=f"the omni workload at the seed's size: {SEED_OMNI_FRAMES} frames at {SEED_OMNI_PX} px and "
                             "30 s of 16 kHz audio per group (implies --workload omni; default 1 + 4 steps and "
                             "each mode alone, --no-interleave, so that one run's payloads fit in memory)")
    parser.add_argument("--compute", choices=COMPUTE_MODES, default="accel",
                        help="accel (default): each consumer's compute is a wait of its cost calibrated alone before "
                             "the run, so the host CPU is free as on a GPU node and the data path is what is "
                             "measured; cpu: the tiny model trains on the CPU beside the data path (on 2 cores this "
                             "mostly measures CPU contention)")
    parser.add_argument("--calibration-reps", type=int, default=None,
                        help="accel: timed steps per encoding when calibrating the compute, in blocks ordered dup, "
                             "shared, shared, dup (default 5; smoke 1)")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="run the process modes interleaved step by step before each alone (default: yes; "
                             "--omni-seed-size: no)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 10; smoke 1)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; smoke 1)")
    parser.add_argument("--smoke", action="store_true", help="a short run of every mode (CI; 2 consumers; < 240 s on 2 cores)")
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU preset: knitdata's modes on the embedded engine (no Ray) training on CUDA, "
                             "sized for < 5 min on one H200; fails clearly without CUDA")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run")
    parser.add_argument("--shared-modes", nargs="*", choices=MODES, default=None,
                        help="modes also run with SharedEncoding (default: transferqueue_best, iter, iter_embedded)")
    parser.add_argument("--controls", nargs="*", default=None,
                        choices=("transferqueue", "transferqueue_best", "sample", "eager", "iter", "floor"),
                        help="process modes also run alone (default: all that ran; smoke: transferqueue, "
                             "transferqueue_best, iter and floor, dup encoding)")
    parser.add_argument("--tq-best-variants", nargs="+", choices=TQ_BEST_VARIANTS, default=list(TQ_BEST_VARIANTS),
                        help="how transferqueue_best drives transferqueue (the better is reported)")
    parser.add_argument("--loader-workers", type=int, default=None,
                        help="num_workers of transferqueue's streaming loader (variant 'loader'; default 1; smoke 0: "
                             "the loader runs in the consumer process, no worker start-up)")
    parser.add_argument("--gpu-tflops", type=float, default=DEFAULT_GPU_TFLOPS,
                        help="effective GPU rate for the projection (TFLOP/s)")
    parser.add_argument("--tq-units", type=int, default=2, help="transferqueue SimpleStorage units")
    parser.add_argument("--media-dedup", action=argparse.BooleanOptionalAction, default=True,
                        help="knitdata stores each media item once per unit and moves it once per consumer share "
                             "(default); --no-media-dedup: per-trajectory copies, as before issue 43")
    parser.add_argument("--copies-controls", nargs="*", choices=("sample", "eager", "iter"), default=[],
                        help="knitdata modes also run alone with per-trajectory copies (media_dedup=False) for the "
                             "bytes stored / moved comparison")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run before giving up")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _workload_of(args: argparse.Namespace, steps: int, warmup: int) -> tuple[TransferWorkload, VLMConfig]:
    seed = getattr(args, "omni_seed_size", False)
    if args.workload == "omni" or seed:
        cfg = OMNI_SMOKE_VLM if args.smoke else OMNI_VLM
        frames = args.omni_frames if args.omni_frames is not None else (
            SEED_OMNI_FRAMES if seed else (2 if args.smoke else 4))
        px = args.omni_px if args.omni_px is not None else (SEED_OMNI_PX if seed else (112 if args.smoke else 224))
        container = getattr(args, "omni_video", "container") == "container"
        return omni_workload(frames, px, cfg=cfg, steps=steps, warmup_steps=warmup, video_container=container), cfg
    if args.smoke:  # 2 consumer processes (ranks) instead of 4: half the processes to start, still several ranks
        return TransferWorkload(steps=steps, warmup_steps=warmup, num_consumers=2), SMOKE_VLM
    return TransferWorkload(steps=steps, warmup_steps=warmup), TINY_VLM


def run(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks transfer``; prints the table, writes JSON/plot. Returns 0, or 1 if a run was not
    exactly-once."""
    if getattr(args, "gpu", False):
        try:
            require_cuda()
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        preset = gpu_config(args.workload, args.steps, args.warmup)
        result = run_gpu_benchmark(preset, timeout_s=args.timeout or 600.0, progress=not args.no_progress)
    else:
        seed = bool(getattr(args, "omni_seed_size", False))
        if seed and args.workload != "omni":
            args.workload = "omni"
        compute = getattr(args, "compute", "accel")
        steps = args.steps if args.steps is not None else (1 if args.smoke else (4 if seed else 10))
        warmup = args.warmup if args.warmup is not None else (1 if args.smoke or seed else 3)
        shared = args.shared_modes if args.shared_modes is not None else ["transferqueue_best", "iter",
                                                                          "iter_embedded"]
        # smoke: the alone runs the ratios need (transferqueue sync and at its best, knitdata iter), dup only
        smoke_controls = (["transferqueue", "transferqueue_best", "iter", "floor"] if compute == "accel"
                          else ["iter"])
        controls = args.controls if args.controls is not None else (smoke_controls if args.smoke else None)
        interleave = getattr(args, "interleave", None)
        interleave = (not seed) if interleave is None else bool(interleave)
        reps = getattr(args, "calibration_reps", None)
        reps = reps if reps is not None else (1 if args.smoke else 5)
        w, cfg = _workload_of(args, steps, warmup)
        timeout = args.timeout if args.timeout is not None else (150.0 if args.smoke else 900.0)
        workers = args.loader_workers if args.loader_workers is not None else (0 if args.smoke else 1)
        result = run_transfer_benchmark(w, args.modes, shared_modes=shared, controls=controls,
                                        control_encodings=("dup",) if args.smoke else ENCODINGS,
                                        tq_best_variants=args.tq_best_variants, loader_workers=workers,
                                        cfg=cfg, gpu_tflops=args.gpu_tflops, tq_units=args.tq_units,
                                        timeout_s=timeout, progress=not args.no_progress, compute=compute,
                                        calibration_reps=reps, interleave=interleave,
                                        media_dedup=bool(getattr(args, "media_dedup", True)),
                                        copies_controls=list(getattr(args, "copies_controls", None) or []))
    result["command"] = command_line()
    result["smoke"] = bool(args.smoke)
    print(format_table(result))
    if args.json:
        write_json(args.json, result, indent=1, strict=True)
    if args.plot:
        plot_result(result, args.plot)
        print(f"wrote {args.plot}")
    return 0 if result["exactly_once_all_runs"] else 1


def stem_of(args: argparse.Namespace) -> str:
    """The result files' name without extension, from the benchmark's arguments (``python benchmarks/transfer.py``).

    ``transfer``, then ``_omni`` with ``--workload omni`` (``_omni_seed`` with ``--omni-seed-size``), ``_accel`` with
    ``--compute accel`` (``_gpu`` with ``--gpu`` instead), ``_smoke`` with ``--smoke``.
    """
    seed = bool(getattr(args, "omni_seed_size", False))
    stem = "transfer" + ("_omni" if args.workload == "omni" or seed else "") + ("_seed" if seed else "")
    if args.gpu:
        stem += "_gpu"
    elif getattr(args, "compute", "accel") == "accel":
        stem += "_accel"
    return stem + ("_smoke" if args.smoke else "")


def main(argv: Sequence[str] | None = None) -> int:
    """``python benchmarks/transfer.py``: run the benchmark, writing ``benchmarks/results/<stem>.json`` and
    ``.png`` (:func:`stem_of`) unless ``--json`` / ``--plot`` say otherwise.

    Args:
        argv: Arguments (default: the command line).

    Returns:
        The benchmark's exit code.
    """
    from benchmarks.common.cli import RESULTS

    parser = argparse.ArgumentParser(description="Transfer benchmark: transferqueue vs knitdata sample / eager / iter.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    stem = stem_of(args)
    if args.json is None:
        args.json = os.path.join(RESULTS, f"{stem}.json")
    if args.plot is None:
        try:
            import matplotlib  # noqa: F401

            args.plot = os.path.join(RESULTS, f"{stem}.png")
        except ImportError:
            pass
    return run(args)


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("transfer"))
