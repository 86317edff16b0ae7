"""The soak benchmark across processes on the Ray engine (:func:`run_soak_processes`): producer and consumer
processes attached by name, real crashes (SIGKILL) restored from JSON state on disk, coordinator kills, and the
replay of every worker's event log into the :class:`~benchmarks.common.soak_core.Ledger`; see :mod:`benchmarks.soak`."""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from benchmarks.common.soak_core import (
    MAX_RESPONSE,
    RSS_SLACK_BYTES,
    TIMELINE_POINTS,
    CheckingCollate,
    Ledger,
    SoakConfig,
    judged,
    make_soak_traj,
    pace,
)
from knitdata.admission import BatchSpec
from knitdata.errors import ConfigError

__all__ = ["XPROC_START_TIMEOUT_S", "XPROC_DRAIN_TIMEOUT_S", "run_soak_processes", "write_json_atomic"]


#: Seconds the driver waits for the worker processes to attach (spawn, import, connect to Ray, find the pipeline).
XPROC_START_TIMEOUT_S = 240.0
#: Seconds the consumers may take to drain after the producers stopped (then the run is aborted as an error).
XPROC_DRAIN_TIMEOUT_S = 180.0


def _pss_bytes(pid: int) -> int:
    """Proportional set size of process ``pid`` (shared pages split among the processes mapping them); its RSS
    where ``smaps_rollup`` is missing; 0 when the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file and a rename (a kill leaves old or new)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)



class _EventLog:
    """Append-only JSON-lines file of one worker slot; each line is flushed, so a SIGKILL loses none written."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the worker process
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"k": kind, **fields})
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()


class _Tail:
    """Reads the complete lines appended to a JSON-lines file since the last call (the driver's side)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._rest = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        return [json.loads(ln) for ln in lines if ln.strip()]


def _xproc_job(conn: Any) -> dict[str, Any] | None:
    """Import what a worker needs (while the driver starts Ray), then wait for its job (a plain dict)."""
    torch.set_num_threads(1)
    import knitdata.engines.ray.engine  # noqa: F401 - imports Ray too
    import knitdata.pipeline  # noqa: F401

    try:
        job = conn.recv()
    except EOFError:  # the driver gave up before sending one
        return None
    finally:
        conn.close()
    return job if isinstance(job, dict) else None


def _xproc_start(conn: Any) -> tuple[dict[str, Any], _EventLog, SoakConfig] | None:
    """A worker's job (:func:`_xproc_job`), its event log and its soak configuration; ``None`` without a job."""
    job = _xproc_job(conn)
    if job is None:
        return None
    return job, _EventLog(job["events"]), SoakConfig(**job["config"])


def _xproc_attach(job: dict[str, Any]) -> Any:
    from knitdata.pipeline import Pipeline

    return Pipeline.attach(job["name"], address=job["address"], put_timeout=None)


def _xproc_consumer(conn: Any) -> None:
    """Consumer process of the cross-process soak (one incarnation of rank ``job["rank"]``).

    Restores the rank's dataset from the JSON state file when there is one, trains (sleeps), saves the state
    (write + rename), commits it, and logs each step's ids; at ``job["crash_after"]`` micro-batches it SIGKILLs
    itself at ``crash_point`` (the driver then spawns the next incarnation).
    """
    started = _xproc_start(conn)
    if started is None:
        return
    job, log, cfg = started
    try:
        rank = int(job["rank"])
        pipe = _xproc_attach(job)
        bad: list[str] = []
        lock = threading.Lock()
        ds = pipe.dataset(rank, fetch=cfg.fetch, collate=CheckingCollate(bad, lock), timeout=job["timeout_s"])
        restored = os.path.exists(job["state"])
        if restored:
            with open(job["state"], encoding="utf-8") as f:
                ds.load_state_dict(json.load(f))
        else:  # the step-0 checkpoint: a crash before the first saved step restores to the start
            write_json_atomic(job["state"], ds.state_dict())
        log.write("ready", pid=os.getpid(), restored=restored, t=time.time())
        crash_after = int(job["crash_after"])
        n = 0

        def report_corrupt() -> None:
            with lock:
                if bad:
                    log.write("corrupt", ids=list(bad))
                    bad.clear()

        for mb in ds:
            ids = list(mb.info.trajectory_ids)
            n += 1
            if n == 1:
                log.write("first", t=time.time())
            report_corrupt()
            crash_now = 0 < crash_after <= n
            if crash_now and cfg.crash_point == "mid_step":
                log.write("rollback", ids=ids)
                log.write("crash", point="mid_step", t=time.time())
                os.kill(os.getpid(), signal.SIGKILL)
            if cfg.consume_s and ids:
                time.sleep(cfg.consume_s * len(ids))
            state = ds.state_dict()
            write_json_atomic(job["state"], state)  # the checkpoint
            ds.commit(state)  # sent without waiting on the Ray engine, as a trainer would
            log.write("commit", ids=ids)
            if crash_now:
                log.write("crash", point="between_steps", t=time.time())
                os.kill(os.getpid(), signal.SIGKILL)
        report_corrupt()
        ds.commit(wait=True)
        log.write("done")
    except BaseException as e:  # noqa: BLE001 - reported to the driver through the log
        log.write("error", error=f"rank {job.get('rank')}: {type(e).__name__}: {e}")
        raise SystemExit(1) from None


def _xproc_producer(conn: Any, go: Any, stop_at: Any, progress: Any, lock: Any) -> None:
    """Producer process ``job["index"]`` of ``job["count"]``: puts its share (whole groups) of every train batch.

    Train batch ``b`` holds the same trajectories whatever the number of producers (ids ``t{index}`` numbered
    per batch); producer ``p`` puts the groups whose index in the batch is ``p`` modulo the producer count. It
    starts batch ``b`` only while ``b < stop_at`` (set by the driver at the deadline to one past the last batch
    any producer started), so every batch started is completed by all producers and can be admitted.
    """
    started = _xproc_start(conn)
    if started is None:
        return
    job, log, cfg = started
    try:
        p, count = int(job["index"]), int(job["count"])
        pipe = _xproc_attach(job)
        log.write("ready", pid=os.getpid())
        go.wait()
        sources = [f"s{i}" for i in range(cfg.num_sources)]
        groups_per_batch = cfg.groups_per_minibatch * cfg.num_minibatches
        per_batch = len(sources) * groups_per_batch * cfg.group_size
        interval = cfg.consume_s / (cfg.num_consumers * cfg.speed_ratio) * count
        next_t = time.perf_counter()
        b = 0
        while True:
            with lock:
                if b >= stop_at.value:
                    break
                progress[p] = b
            batch = []
            idx = b * per_batch
            for si, s in enumerate(sources):
                for g in range(groups_per_batch):
                    for _ in range(cfg.group_size):
                        if (si * groups_per_batch + g) % count == p:
                            batch.append((idx, s, f"b{b}{s}g{g}"))
                        idx += 1
            rng = random.Random(cfg.seed * 1_000_003 + b * 101 + p)
            rng.shuffle(batch)
            for i, s, grp in batch:
                t = make_soak_traj(i, s, grp, traj_bytes=cfg.traj_bytes, response_len=rng.randint(4, MAX_RESPONSE),
                                   gen_version=b)
                pipe.put(t, timeout=None)
                log.write("put", id=t.id)
                if interval:
                    next_t = pace(next_t, interval)
            if p == 0:
                pipe.report_version(b + 1)
            b += 1
        log.write("done", batches=b)
    except BaseException as e:  # noqa: BLE001 - reported to the driver through the log
        log.write("error", error=f"producer {job.get('index')}: {type(e).__name__}: {e}")
        raise SystemExit(1) from None


@dataclass
class _Slot:
    """One worker of the cross-process soak as the driver sees it (a producer, or a consumer rank)."""

    kind: str
    index: int
    events: str
    proc: Any = None
    incarnation: int = 0
    ready: bool = False
    done: bool = False
    crash_logged: bool = False
    log: list[dict[str, Any]] = field(default_factory=list)
    tail: Any = None
    mem: int = 0


def run_soak_processes(cfg: SoakConfig, *, num_producers: int = 1, progress: bool = True,
                       engine_options: dict[str, Any] | None = None,
                       on_tick: Callable[[dict[str, Any]], None] | None = None,
                       kill_coordinator_every_s: float | None = None,
                       max_coordinator_kills: int | None = None,
                       max_consumer_restarts: int | None = None,
                       label: str = "ray (processes)") -> dict[str, Any]:
    """Run one soak of the Ray engine with producers and consumers in their own processes.

    The driver creates ``Pipeline(engine="ray", engine_options={"name": ...})`` on a new local Ray (loopback),
    spawns ``num_producers`` producer processes and one process per consumer rank; each attaches with
    ``Pipeline.attach(name, address=...)``. A consumer process saves its dataset's state as JSON to disk after
    every step, commits it, and every ``cfg.restart_every`` micro-batches SIGKILLs itself at ``cfg.crash_point``;
    the driver spawns a new process for the rank, which restores from the state file. Every worker logs its
    puts / commits / roll-backs to its own JSON-lines file, which the driver replays into a :class:`Ledger`.

    Args:
        cfg: The parameters (``engine`` must be ``"ray"``).
        num_producers: Producer processes (each puts whole groups of every train batch).
        progress: Show a tqdm bar over the seconds.
        engine_options: Extra Ray engine options of the pipeline (``name`` is chosen here unless given).
        on_tick: Called about every 0.2 s with a snapshot.
        kill_coordinator_every_s: SIGKILL the coordinator actor again this many seconds after it came back from
            the last kill (it journals to a temporary directory; Ray restarts it and it replays the journal).
        max_coordinator_kills: Most coordinator kills (``None``: no limit).
        max_consumer_restarts: Most process restarts per rank (``None``: no limit).
        label: The run's name in the table and the plot.

    Returns:
        The keys of :func:`run_soak` plus ``mode="cross_process"``, ``producer_processes``,
        ``consumer_processes``, ``consumer_process_restarts``, ``coordinator_recovery_s``, ``startup_s``,
        ``consumer_restore_s`` (a consumer's SIGKILL to its new process's first micro-batch) and
        ``consumer_restore_attached_s`` (to the new process attached, its state loaded, before it iterates).
        ``rss_growth_bytes`` here is the growth of the summed proportional set size (PSS) of the driver and
        every producer and consumer process after warm-up (sampled every 0.2 s, a consumer being replaced counted
        with its dead process's last value; Ray's own processes and the object store are not counted, the store's
        bytes are ``store_high_water_bytes``).

    Raises:
        ConfigError: Bad parameters, or an engine other than Ray.
        EngineError / OptionalDependencyError: Ray is not available.
    """
    import multiprocessing
    import shutil
    import sys
    import tempfile

    cfg.validate()
    if cfg.engine != "ray":
        raise ConfigError(f"the cross-process soak (--processes) needs --engine ray, got {cfg.engine!r}")
    if num_producers < 1:
        raise ConfigError(f"num_producers must be >= 1, got {num_producers}")
    if max_coordinator_kills is not None and max_coordinator_kills < 0:
        raise ConfigError(f"max_coordinator_kills must be >= 0 or None, got {max_coordinator_kills}")
    if kill_coordinator_every_s is not None and kill_coordinator_every_s <= 0:
        raise ConfigError(f"kill_coordinator_every_s must be > 0, got {kill_coordinator_every_s}")
    if max_consumer_restarts is not None and max_consumer_restarts < 0:
        raise ConfigError(f"max_consumer_restarts must be >= 0 or None, got {max_consumer_restarts}")
    if "ray" not in sys.modules:
        # every Ray address on loopback (authentication: attaching processes find this user's token themselves)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from knitdata.pipeline import Pipeline

    q = cfg.groups_per_minibatch * cfg.group_size * cfg.num_minibatches
    spec = BatchSpec({f"s{i}": q for i in range(cfg.num_sources)}, num_minibatches=cfg.num_minibatches,
                     group_size=cfg.group_size)
    capacity = cfg.capacity
    largest = make_soak_traj(0, "s0", "g", traj_bytes=cfg.traj_bytes, response_len=MAX_RESPONSE).nbytes
    workdir = tempfile.mkdtemp(prefix="knitdata-soak-xproc-")
    name = f"soak-xproc-{os.getpid()}-{int(time.time())}"
    options = {"name": name, **(engine_options or {})}
    if kill_coordinator_every_s is not None:
        options.setdefault("journal_dir", workdir)
    t_setup = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    lock = ctx.Lock()
    stop_at = ctx.Value("q", 2**62, lock=False)
    progress_of = ctx.Array("q", [-1] * num_producers, lock=False)
    producers = [_Slot("producer", p, os.path.join(workdir, f"producer{p}.jsonl")) for p in range(num_producers)]
    consumers = [_Slot("consumer", r, os.path.join(workdir, f"consumer{r}.jsonl")) for r in range(cfg.num_consumers)]
    for s in producers + consumers:
        s.tail = _Tail(s.events)
    restarts = [0] * cfg.num_consumers
    errors: list[str] = []
    base_job: dict[str, Any] = {"name": name, "config": asdict(cfg)}

    def consumer_job(r: int) -> dict[str, Any]:
        crash = cfg.restart_every if max_consumer_restarts is None or restarts[r] < max_consumer_restarts else 0
        return {**base_job, "rank": r, "events": consumers[r].events, "crash_after": crash,
                "state": os.path.join(workdir, f"state{r}.json"), "timeout_s": XPROC_DRAIN_TIMEOUT_S + cfg.seconds}

    def spawn(s: _Slot, target: Callable[..., None], *extra: Any) -> Any:
        """Start a worker process now (it imports while the driver works); returns the end to send its job on."""
        ours, theirs = ctx.Pipe()
        s.incarnation += 1
        s.ready = s.crash_logged = False
        s.proc = ctx.Process(target=target, args=(theirs, *extra), name=f"soak-{s.kind}{s.index}-{s.incarnation}")
        s.proc.start()
        theirs.close()
        return ours

    def start_consumer(r: int) -> None:
        conn = spawn(consumers[r], _xproc_consumer)
        conn.send(consumer_job(r))
        conn.close()

    # the first workers start importing while Ray and the pipeline start
    conns = [spawn(s, _xproc_producer, go, stop_at, progress_of, lock) for s in producers]
    conns += [spawn(s, _xproc_consumer) for s in consumers]
    try:
        pipe = Pipeline(spec, num_consumers=cfg.num_consumers, engine="ray", capacity_bytes=capacity,
                        token_budget=cfg.token_budget, put_timeout=None, engine_options=options)
    except BaseException:
        for c in conns:
            c.close()  # the workers see no job and exit
        for s in producers + consumers:
            s.proc.join(30)
            if s.proc.exitcode is None:
                s.proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    name = str(pipe.name)
    pipeline_start_s = time.perf_counter() - t_setup
    base_job.update(name=name, address=pipe.address)
    for p, (s, c) in enumerate(zip(producers, conns)):
        c.send({**base_job, "index": p, "count": num_producers, "events": s.events})
    for r, c in enumerate(conns[num_producers:]):
        c.send(consumer_job(r))
    for c in conns:
        c.close()

    killer_stop = threading.Event()
    kills = [0]
    recovery_s: list[float] = []

    def killer() -> None:
        import ray

        from knitdata.engines.ray.connect import NAMESPACE
        from knitdata.engines.ray.control import RayControl
        from knitdata.engines.ray.engine import coordinator_name

        actor = ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
        control = pipe.internals.control
        assert isinstance(control, RayControl)
        while not killer_stop.wait(kill_coordinator_every_s):
            if max_coordinator_kills is not None and kills[0] >= max_coordinator_kills:
                return
            pid = control.plumbing.info()["pid"]
            t = time.perf_counter()
            ray.kill(actor, no_restart=False)  # SIGKILL; Ray restarts it and it replays its journal
            kills[0] += 1
            while not killer_stop.is_set():  # the next interval counts from its recovery
                info = control.plumbing.info()
                if info["pid"] != pid and info["restarted"]:
                    recovery_s.append(time.perf_counter() - t)
                    break
                time.sleep(0.05)

    tally = {"put": 0, "commit": 0}

    def drain_events() -> None:
        for s in producers + consumers:
            for ev in s.tail.read():
                s.log.append(ev)
                k = ev["k"]
                if k == "put":
                    tally["put"] += 1
                elif k == "commit":
                    tally["commit"] += len(ev["ids"])
                elif k == "ready":
                    s.ready = True
                elif k == "done":
                    s.done = True
                elif k == "crash":
                    s.crash_logged = True
                elif k == "error":
                    errors.append(ev["error"])

    bar = None
    timeline: list[list[float]] = []
    high = 0
    baseline: int | None = None
    baseline_driver: int | None = None
    rss_high = 0
    rss_high_driver = 0
    closed = stopped = aborted = False
    killer_thread = None
    elapsed = startup_s = 0.0
    t0 = time.perf_counter()
    try:
        start_deadline = time.perf_counter() + XPROC_START_TIMEOUT_S
        while not all(s.ready for s in producers + consumers):
            time.sleep(0.2)
            drain_events()
            dead = [s for s in producers + consumers if s.proc.exitcode is not None and not s.ready]
            if errors or dead or time.perf_counter() > start_deadline:
                errors.append(f"worker processes did not attach: {[(s.kind, s.index, s.proc.exitcode) for s in dead]}"
                              if dead or not errors else "a worker process failed while attaching")
                raise _XprocAbort
        startup_s = time.perf_counter() - t_setup
        if kill_coordinator_every_s is not None:
            killer_thread = threading.Thread(target=killer, name="soak-coordinator-killer", daemon=True)
            killer_thread.start()
        warmup = cfg.warmup_s if cfg.warmup_s is not None else min(2.0, 0.2 * cfg.seconds)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=round(cfg.seconds, 1), desc=f"soak {label}", unit="s", leave=False)
        t0 = time.perf_counter()
        go.set()
        while True:
            time.sleep(0.2)
            now = time.perf_counter() - t0
            drain_events()
            if errors:
                raise _XprocAbort
            for r, s in enumerate(consumers):
                if s.done or s.proc.exitcode is None:
                    continue
                s.proc.join()
                drain_events()  # its last lines (written before it died)
                if s.proc.exitcode == -signal.SIGKILL and s.crash_logged:
                    restarts[r] += 1
                    start_consumer(r)  # restores from the rank's state file
                else:
                    if not s.done:
                        errors.append(f"consumer rank {r} (process {s.incarnation}) exited with code "
                                      f"{s.proc.exitcode} before the end of the stream")
                        raise _XprocAbort
            if not stopped and now >= cfg.seconds:
                with lock:  # no producer starts a batch after this that another would not finish
                    stop_at.value = max(progress_of[:]) + 1
                stopped = True
            if not closed and all(s.proc.exitcode is not None for s in producers):
                drain_events()
                if not all(s.done for s in producers):
                    errors.append(f"producer processes exited with codes {[s.proc.exitcode for s in producers]}")
                    raise _XprocAbort
                pipe.close()  # end of stream: the consumers drain what was admitted and stop
                closed = True
            if all(s.done for s in consumers):
                break
            if now > cfg.seconds + XPROC_DRAIN_TIMEOUT_S:
                errors.append(f"consumers did not drain within {XPROC_DRAIN_TIMEOUT_S:.0f} s after the producers stopped")
                raise _XprocAbort
            units = pipe.stats()["units"]
            high = max([high] + [u["high_water_bytes"] for u in units.values() if u])
            for s in producers + consumers:  # a slot whose process is being replaced keeps its last value
                if s.ready and s.proc.exitcode is None:
                    s.mem = _pss_bytes(s.proc.pid) or s.mem
            driver_mem = _pss_bytes(os.getpid())
            total_mem = driver_mem + sum(s.mem for s in producers + consumers)
            if baseline is None and now >= warmup and all(s.mem for s in producers + consumers):
                gc.collect()
                baseline, baseline_driver = total_mem, driver_mem
            if baseline is not None:
                rss_high = max(rss_high, total_mem)
                rss_high_driver = max(rss_high_driver, driver_mem)
            put_n, done_n = tally["put"], tally["commit"]
            timeline.append([round(now, 2), sum(u["used_bytes"] for u in units.values() if u), total_mem, put_n, done_n])
            if len(timeline) > 2 * TIMELINE_POINTS:
                del timeline[::2]
            if on_tick is not None:
                on_tick({"t": now, "produced": put_n, "consumed": done_n, "high_water": high,
                         "restarts": sum(restarts), "coordinator_restarts": kills[0], "rss": total_mem})
            if bar is not None:
                bar.n = round(min(now, cfg.seconds), 1)
                bar.set_postfix(put=put_n, done=done_n, restarts=sum(restarts), kills=kills[0], refresh=False)
                bar.refresh()
        elapsed = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a failed run is reported, never hangs the driver
        if not isinstance(e, _XprocAbort):
            errors.append(f"driver: {type(e).__name__}: {e}")
        aborted = True
        elapsed = time.perf_counter() - t0
    finally:
        killer_stop.set()
        if killer_thread is not None:
            killer_thread.join(60)
        if bar is not None:
            bar.close()
        for s in producers + consumers:
            if s.proc is not None and s.proc.exitcode is None:
                if not aborted:
                    s.proc.join(30)
                if s.proc.exitcode is None:
                    s.proc.kill()
                    s.proc.join(10)
        drain_events()
    try:
        stats = pipe.stats()
    except Exception as e:  # noqa: BLE001 - reported
        errors.append(f"stats at the end: {type(e).__name__}: {e}")
        stats = {"units": {}, "held_trajectories": None}
    pipe.shutdown()
    shutil.rmtree(workdir, ignore_errors=True)
    ledger = Ledger()
    for s in producers:
        for ev in s.log:
            if ev["k"] == "put":
                ledger.accept(ev["id"])
    for s in consumers:
        for ev in s.log:
            if ev["k"] == "commit":
                ledger.commit(ev["ids"])
            elif ev["k"] == "rollback":
                ledger.roll_back(ev["ids"])
            elif ev["k"] == "corrupt":
                ledger.corrupt.extend(ev["ids"])
    ledger.restarts = sum(restarts)
    ledger.errors = errors
    restore_s: list[float] = []  # a consumer's SIGKILL to its new process's first micro-batch
    ready_s: list[float] = []  # ... to the new process attached with its state loaded (before iterating)
    for s in consumers:
        crash_t = None
        for ev in s.log:
            if ev["k"] == "crash":
                crash_t = ev["t"]
            elif ev["k"] == "ready" and crash_t is not None:
                ready_s.append(ev["t"] - crash_t)
            elif ev["k"] == "first" and crash_t is not None:
                restore_s.append(ev["t"] - crash_t)
                crash_t = None
    units = [u for u in stats["units"].values() if u]
    high = max([high] + [u["high_water_bytes"] for u in units])
    summary = ledger.summary()
    committed = summary["trajectories"]
    out = {
        "engine": "ray",
        "mode": "cross_process",
        "label": label,
        "seconds": round(elapsed, 3),
        "startup_s": round(startup_s, 3),
        "pipeline_start_s": round(pipeline_start_s, 3),
        **summary,
        "consumer_process_restarts": ledger.restarts,
        "consumer_process_restarts_per_rank": restarts,
        "producer_processes": num_producers,
        "consumer_processes": cfg.num_consumers,
        "consumer_processes_started": sum(s.incarnation for s in consumers),
        "consumer_restore_s": [round(x, 3) for x in restore_s],
        "consumer_restore_median_s": round(statistics.median(restore_s), 3) if restore_s else None,
        "consumer_restore_attached_s": [round(x, 3) for x in ready_s],
        "throughput_per_s": committed / elapsed if elapsed > 0 else 0.0,
        "capacity_bytes": capacity,
        "largest_trajectory_bytes": largest,
        "store_high_water_bytes": high,
        "store_bound_bytes": capacity + largest,
        "rss_measure": ("summed PSS of the driver, producer and consumer processes (/proc/PID/smaps_rollup; a consumer "
                        "being replaced counts with its last value)"),
        "rss_baseline_bytes": baseline,
        "rss_growth_bytes": (rss_high - baseline) if baseline is not None else 0,
        "rss_growth_driver_bytes": (rss_high_driver - baseline_driver) if baseline_driver is not None else 0,
        "rss_bound_bytes": capacity * max(1, len(stats["units"])) + RSS_SLACK_BYTES,
        "store_put_wait_s": sum(u.get("put_wait_s", 0.0) for u in units),
        "held_at_end": stats["held_trajectories"],
        "coordinator_restarts": kills[0],
        "coordinator_recovery_s": [round(x, 3) for x in recovery_s],
        "coordinator_recovery_median_s": round(statistics.median(recovery_s), 3) if recovery_s else None,
        "kill_coordinator_every_s": kill_coordinator_every_s,
        "loadavg": list(os.getloadavg()),
        "config": asdict(cfg),
        "timeline_columns": ["t_s", "store_used_bytes", "pss_bytes", "put", "committed"],
        "timeline": timeline,
    }
    return judged(out)


class _XprocAbort(Exception):
    """Internal: a worker failed; the run stops and reports it."""
