"""Soak benchmark: a fast producer against slow, crashing consumers; nothing may be lost or duplicated.

``knitdata bench soak --seconds N [--json PATH] [--engine embedded|ray]`` runs a producer that puts
trajectories ``--speed-ratio`` times faster than the consumers (threads) can train on them, for ``N``
seconds, into a :class:`~knitdata.pipeline.Pipeline` with a small store capacity, so producers block on a
full store most of the time. Every consumer checkpoints its dataset's JSON state after each finished step and
"crashes" every ``--restart-every`` micro-batches: its dataset is discarded mid-iteration (prefetched
micro-batches are dropped) and a freshly built dataset resumes from the saved state.

Accounting (a :class:`Ledger`): a trajectory is *accepted* once ``put`` returned, *committed* once a consumer
finished the step of its micro-batch and saved a state past it. A micro-batch received after the last saved
state of a consumer that then crashed is *rolled back* (the trainer would restore its model from the same
checkpoint); receiving it again after the restore is a *re-delivery*, not a duplicate. At the end:

* ``lost`` = accepted trajectories never committed (must be 0);
* ``duplicated`` = commits beyond the first of a trajectory (must be 0);
* ``store_high_water_bytes`` against ``capacity_bytes`` (bound: capacity plus one trajectory, per unit);
* ``rss_growth_bytes``: the process's resident memory high-water after warm-up minus its value at warm-up
  (bound: capacity plus 64 MiB);
* ``throughput_per_s``: committed trajectories per second of wall time.

Payloads are checked on delivery (each trajectory's bytes are a function of its index), so a corrupted or
misrouted payload counts as an error. Nothing here asserts timings: the numbers are measured and reported.

``--engine ray --processes`` (:func:`run_soak_processes`, ``"mode": "cross_process"`` in the results) runs the
cross-process Ray engine: the driver creates the pipeline by name on a new local Ray (loopback), ``--producers``
producer processes and one process per consumer rank (``spawn``) attach with ``Pipeline.attach(name,
address=...)``. A consumer's crash is real: at the crash point the process SIGKILLs itself, and the driver
spawns a new process that restores the rank's dataset from the JSON state the dead one saved to disk (write and
rename, then ``commit``). Every worker appends its puts, commits and roll-backs to its own JSON-lines file
(flushed per line, so a SIGKILL loses nothing written); the driver replays them into the same :class:`Ledger`.
With ``--kill-coordinator S`` the coordinator actor is SIGKILLed S seconds after it last came back (it
journals; Ray restarts it; ``coordinator_recovery_s`` is the time from a kill to its first answer). There,
``rss_growth_bytes`` is the growth of the summed proportional set size (PSS) of the driver and the worker
processes after warm-up (a process being replaced counts with its last value; Ray's processes and object
store are not counted; the store is ``store_high_water_bytes``), and ``rss_growth_driver_bytes`` the driver's.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/soak.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import gc
import json
import random
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from knitdata.admission import BatchSpec
from knitdata.errors import ConfigError, EngineError, OptionalDependencyError
from knitdata.record import Trajectory

__all__ = [
    "SoakConfig",
    "Ledger",
    "RssSampler",
    "make_soak_traj",
    "consume_with_restarts",
    "check_soak_payload",
    "run_soak",
    "run_soak_processes",
    "format_table",
    "summarize_runs",
    "plot_timeline",
    "add_arguments",
    "run",
    "CRASH_POINTS",
    "RSS_SLACK_BYTES",
]

#: Where a consumer crash is injected: after it saved the state of its finished step (``between_steps``),
#: or after it received a micro-batch and before it finished that step (``mid_step``: the restore must then
#: deliver that micro-batch again).
CRASH_POINTS: tuple[str, ...] = ("between_steps", "mid_step")
#: Slack of the resident-memory bound on top of the store capacity (issue "Reliability").
RSS_SLACK_BYTES = 64 * 1024 * 1024
_MAX_RESPONSE = 24
_TIMELINE_POINTS = 300


@dataclass
class SoakConfig:
    """Parameters of one soak run (all reported with the results).

    Attributes:
        seconds: How long the producer runs; consumers then drain what was admitted.
        engine: ``"embedded"`` or ``"ray"``.
        num_consumers: Consumer threads (ranks).
        num_sources: Sources; each has quota ``groups_per_minibatch * group_size * num_minibatches``.
        group_size: Trajectories per group (GRPO n).
        num_minibatches: Mini-batches per train batch (M).
        groups_per_minibatch: Groups per source per mini-batch.
        traj_bytes: Approximate payload bytes of one trajectory.
        capacity_bytes: Store capacity per unit; default ``capacity_trajectories * traj_bytes``.
        capacity_trajectories: Used when ``capacity_bytes`` is ``None``.
        consume_s: Seconds a consumer "trains" per trajectory of a micro-batch (a sleep: the consumers
            model a trainer whose compute does not compete for the CPU).
        speed_ratio: How much faster the producer offers trajectories than the consumers take them in total.
        restart_every: Each consumer crashes and restores after this many micro-batches (0: never).
        crash_point: One of :data:`CRASH_POINTS`.
        fetch: Fetch mode of the datasets.
        token_budget: Most tokens per micro-batch.
        warmup_s: Seconds after which the RSS baseline is taken.
        seed: Seed of the workload (response lengths).
    """

    seconds: float = 10.0
    engine: str = "embedded"
    num_consumers: int = 2
    num_sources: int = 2
    group_size: int = 2
    num_minibatches: int = 2
    groups_per_minibatch: int = 1
    traj_bytes: int = 64 * 1024
    capacity_bytes: int | None = None
    capacity_trajectories: int = 24
    consume_s: float = 0.002
    speed_ratio: float = 10.0
    restart_every: int = 25
    crash_point: str = "between_steps"
    fetch: str = "iter"
    token_budget: int = 64
    warmup_s: float | None = None
    seed: int = 0

    def validate(self) -> None:
        """Raise :class:`~knitdata.errors.ConfigError` on inconsistent parameters."""
        if self.seconds <= 0:
            raise ConfigError(f"seconds must be > 0, got {self.seconds}")
        if self.crash_point not in CRASH_POINTS:
            raise ConfigError(f"crash_point must be one of {CRASH_POINTS}, got {self.crash_point!r}")
        if self.speed_ratio <= 0 or self.consume_s < 0:
            raise ConfigError("speed_ratio must be > 0 and consume_s >= 0")
        if self.restart_every < 0:
            raise ConfigError(f"restart_every must be >= 0, got {self.restart_every}")
        for name in ("num_consumers", "num_sources", "group_size", "num_minibatches", "groups_per_minibatch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")

    @property
    def capacity(self) -> int:
        """Store capacity per unit in bytes."""
        return self.capacity_bytes if self.capacity_bytes is not None else self.capacity_trajectories * self.traj_bytes


# ------------------------------------------------------------------------------------------ payloads
def make_soak_traj(index: int, source: str, group: str, *, traj_bytes: int, response_len: int = 8,
                   gen_version: int = 0) -> Trajectory:
    """A trajectory whose every byte is a function of ``index`` (see :func:`check_soak_payload`).

    Args:
        index: Global index; the id is ``f"t{index}"`` and the first prompt token is ``index``.
        source: Source name.
        group: Group id.
        traj_bytes: Approximate payload size (a ``uint8`` tensor ``pad`` fills the rest).
        response_len: Response tokens.
        gen_version: Policy version.
    """
    prompt = torch.tensor([index, index % 1000 + 1], dtype=torch.int64)
    response = (torch.arange(response_len, dtype=torch.int64) + index) % 50_000 + 1
    pad = max(0, traj_bytes - 8 * (2 + _MAX_RESPONSE))  # one shape in every trajectory (collate stacks it)
    return Trajectory(
        id=f"t{index}",
        source=source,
        group=group,
        prompt_ids=prompt,
        response_ids=response,
        gen_version=gen_version,
        scalars={"reward": float(index % 13) / 13.0},
        tensors={"pad": torch.full((pad,), index % 251, dtype=torch.uint8)},
    )


def check_soak_payload(traj: Trajectory) -> bool:
    """Whether ``traj`` holds exactly what :func:`make_soak_traj` put under its id."""
    index = int(traj.id[1:])
    n = traj.response_ids.numel()
    want = (torch.arange(n, dtype=torch.int64) + index) % 50_000 + 1
    pad = traj.tensors.get("pad")
    return (
        int(traj.prompt_ids[0]) == index
        and bool(torch.equal(traj.response_ids, want))
        and pad is not None
        and (pad.numel() == 0 or bool((pad == index % 251).all()))
        and traj.scalars.get("reward") == float(index % 13) / 13.0
    )


class _CheckingCollate:
    """Wraps the default collate: verifies every payload, keeps only ids (the soak does not train)."""

    def __init__(self, bad: list[str], lock: threading.Lock) -> None:
        from knitdata.collate import TokenCollator

        self._inner = TokenCollator()
        self._bad = bad
        self._lock = lock

    def __call__(self, trajs: Any, info: Any = None) -> Any:
        for t in trajs:
            if not check_soak_payload(t):
                with self._lock:
                    self._bad.append(t.id)
        return self._inner(trajs, info)


# ------------------------------------------------------------------------------------------ accounting
@dataclass
class Ledger:
    """Exactly-once accounting of a run with consumer restarts (thread-safe).

    Attributes:
        accepted: Ids whose ``put`` returned.
        committed: Commits per id (a step finished and its state saved past it).
        rolled_back: Micro-batches received after a consumer's last saved state, before it crashed.
        redelivered: Rolled-back trajectories received again after a restore (expected, not duplicates).
        restarts: Consumer crashes followed by a restore.
        corrupt: Ids whose payload did not match what was put.
        errors: Errors raised in producer or consumer threads (``repr``).
    """

    accepted: set[str] = field(default_factory=set)
    committed: Counter = field(default_factory=Counter)
    rolled_back: int = 0
    redelivered: int = 0
    restarts: int = 0
    corrupt: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _pending_redelivery: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def accept(self, tid: str) -> None:
        """A put returned."""
        with self.lock:
            self.accepted.add(tid)

    def commit(self, ids: Any) -> None:
        """A consumer finished the step of these trajectories and saved a state past them."""
        with self.lock:
            for tid in ids:
                self.committed[tid] += 1
                if self._pending_redelivery[tid] > 0:
                    self._pending_redelivery[tid] -= 1
                    self.redelivered += 1

    def roll_back(self, ids: Any) -> None:
        """A consumer crashed after receiving these, before saving a state past them."""
        with self.lock:
            for tid in ids:
                self.rolled_back += 1
                self._pending_redelivery[tid] += 1

    def error(self, e: BaseException) -> None:
        """Record an error of a worker thread."""
        with self.lock:
            self.errors.append(f"{type(e).__name__}: {e}")

    @property
    def lost(self) -> int:
        """Accepted trajectories never committed."""
        with self.lock:
            return sum(1 for t in self.accepted if self.committed[t] == 0)

    @property
    def duplicated(self) -> int:
        """Commits beyond the first of each trajectory."""
        with self.lock:
            return sum(c - 1 for c in self.committed.values() if c > 1)

    @property
    def unexpected(self) -> int:
        """Committed ids that were never accepted."""
        with self.lock:
            return sum(1 for t in self.committed if t not in self.accepted)


    def summary(self) -> dict[str, Any]:
        """The counts a soak result reports: ``put``, ``trajectories`` (committed), ``lost``, ``duplicated``,
        ``unexpected``, ``corrupt``, ``restarts``, ``rolled_back``, ``redelivered_after_restore``, ``errors``."""
        committed = sum(1 for c in self.committed.values() if c > 0)
        return {"trajectories": committed, "put": len(self.accepted), "lost": self.lost, "duplicated": self.duplicated,
                "unexpected": self.unexpected, "corrupt": len(self.corrupt), "restarts": self.restarts,
                "rolled_back": self.rolled_back, "redelivered_after_restore": self.redelivered,
                "errors": list(self.errors)}

# ------------------------------------------------------------------------------------------ memory
def _rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class RssSampler:
    """Samples the process's RSS on a background thread; ``mark_baseline()`` ends warm-up.

    Attributes:
        baseline: RSS when warm-up ended (``None`` before).
        high_water: Highest RSS seen after warm-up.
    """

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.baseline: int | None = None
        self.high_water = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="knitdata-rss", daemon=True)

    def start(self) -> RssSampler:
        """Start sampling."""
        self._thread.start()
        return self

    def mark_baseline(self) -> None:
        """End of warm-up: growth is measured from the RSS now."""
        gc.collect()
        self.baseline = _rss_bytes()
        self.high_water = self.baseline

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.baseline is not None:
                self.high_water = max(self.high_water, _rss_bytes())
                self.samples += 1

    def stop(self) -> int:
        """Stop; return the growth after warm-up in bytes (0 without a baseline)."""
        self._stop.set()
        self._thread.join(5)
        if self.baseline is None:
            return 0
        self.high_water = max(self.high_water, _rss_bytes())
        return self.high_water - self.baseline


# ------------------------------------------------------------------------------------------ the run
def consume_with_restarts(pipe: Any, rank: int, cfg: SoakConfig, ledger: Ledger, collate: Any = None,
                          consumed: list[int] | None = None) -> None:
    """Run consumer ``rank`` to the end of the stream, crashing and restoring every ``cfg.restart_every``.

    After each micro-batch it "trains" (sleeps ``consume_s`` per trajectory), saves the dataset's state
    through JSON (the checkpoint) and commits the micro-batch in ``ledger``. A crash drops the dataset and its
    iterator mid-iteration (prefetched micro-batches are lost with them) and builds a fresh dataset from the
    pipeline, loading the last saved state. With ``crash_point="mid_step"`` the crash comes after a
    micro-batch was received and before its step finished: the restored dataset must deliver it again.

    Args:
        pipe: The pipeline (anything with ``dataset(rank, fetch=, collate=)``).
        rank: The consumer.
        cfg: ``restart_every``, ``crash_point``, ``consume_s`` and ``fetch`` are used.
        ledger: Where deliveries are accounted.
        collate: Collate function of the datasets (default: the dataset's).
        consumed: Optional per-rank counters of committed trajectories (progress display).
    """
    consumed = consumed if consumed is not None else [0] * (rank + 1)
    state: dict[str, Any] | None = None
    kw = {} if collate is None else {"collate": collate}
    ds = pipe.dataset(rank, fetch=cfg.fetch, **kw)
    since_restart = 0
    while True:
        crashed = False
        pending: list[tuple[str, ...]] = []
        it = iter(ds)
        for mb in it:
            ids = mb.info.trajectory_ids
            pending.append(ids)
            since_restart += 1
            crash_now = cfg.restart_every > 0 and since_restart >= cfg.restart_every
            if crash_now and cfg.crash_point == "mid_step":
                crashed = True
                break
            if cfg.consume_s and ids:
                time.sleep(cfg.consume_s * len(ids))
            state = json.loads(json.dumps(ds.state_dict()))  # the checkpoint, through JSON
            for p in pending:
                ledger.commit(p)
            consumed[rank] += sum(len(p) for p in pending)
            pending.clear()
            if crash_now:
                crashed = True
                break
        if not crashed:
            for p in pending:  # iteration ended normally after the last step was committed
                ledger.commit(p)
            return
        # the crash: the dataset and its iterator are dropped mid-iteration (prefetched items with them)
        for p in pending:
            ledger.roll_back(p)
        del it, ds, mb
        since_restart = 0
        with ledger.lock:
            ledger.restarts += 1
        ds = pipe.dataset(rank, fetch=cfg.fetch, **kw)
        if state is not None:
            ds.load_state_dict(state)


def _producer(pipe: Any, cfg: SoakConfig, ledger: Ledger, deadline: float, produced: list[int]) -> None:
    """Put whole train batches (groups shuffled within) at ``speed_ratio`` times the consumers' rate."""
    rng = random.Random(cfg.seed)
    sources = [f"s{i}" for i in range(cfg.num_sources)]
    groups_per_batch = cfg.groups_per_minibatch * cfg.num_minibatches
    interval = cfg.consume_s / (cfg.num_consumers * cfg.speed_ratio)
    idx = 0
    b = 0
    next_t = time.perf_counter()
    while time.perf_counter() < deadline:
        batch = []
        for s in sources:
            for g in range(groups_per_batch):
                for _ in range(cfg.group_size):
                    batch.append((idx, s, f"b{b}{s}g{g}"))
                    idx += 1
        rng.shuffle(batch)
        for i, s, grp in batch:  # a train batch is always completed so that everything put can be admitted
            t = make_soak_traj(i, s, grp, traj_bytes=cfg.traj_bytes, response_len=rng.randint(4, _MAX_RESPONSE), gen_version=b)
            pipe.put(t, timeout=None)
            ledger.accept(t.id)
            produced[0] += 1
            if interval:
                next_t = _pace(next_t, interval)
        pipe.report_version(b + 1)
        b += 1


def _judged(out: dict[str, Any]) -> dict[str, Any]:
    """Add the verdicts of a soak result: within its store and RSS bounds, and ``ok`` (nothing lost, duplicated,
    unexpected or corrupt, no error, within bounds)."""
    out["within_store_bound"] = out["store_high_water_bytes"] <= out["store_bound_bytes"]
    out["within_rss_bound"] = out["rss_growth_bytes"] <= out["rss_bound_bytes"]
    out["ok"] = (out["lost"] == 0 and out["duplicated"] == 0 and out["unexpected"] == 0 and out["corrupt"] == 0
                 and not out["errors"] and out["within_store_bound"] and out["within_rss_bound"])
    return out


def _pace(next_t: float, interval: float) -> float:
    """Wait until the next put is due, ``interval`` after the previous one; returns when that one was due (now,
    if the producer is behind)."""
    next_t += interval
    delay = next_t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
        return next_t
    return time.perf_counter()


def run_soak(cfg: SoakConfig, *, progress: bool = True, engine_options: dict[str, Any] | None = None,
             on_tick: Callable[[dict[str, Any]], None] | None = None,
             kill_coordinator_every_s: float | None = None) -> dict[str, Any]:
    """Run one soak and return its results (JSON-serializable).

    Args:
        cfg: The parameters.
        progress: Show a tqdm bar over the seconds.
        engine_options: Passed to the pipeline (Ray engine).
        on_tick: Called about every 0.2 s with a snapshot (tests use it to watch bounds).
        kill_coordinator_every_s: Ray engine: SIGKILL the coordinator actor this often while the run lasts (it
            journals to a temporary directory, Ray restarts it, it replays the journal); the result counts
            ``coordinator_restarts``.

    Returns:
        A dict with at least ``lost``, ``duplicated``, ``store_high_water_bytes``, ``rss_growth_bytes``,
        ``capacity_bytes``, ``throughput_per_s`` (see the module docstring), plus the bounds checked and
        the configuration.

    Raises:
        ConfigError: Bad parameters.
        EngineError / OptionalDependencyError: The engine is not available.
    """
    from knitdata.pipeline import Pipeline

    cfg.validate()
    q = cfg.groups_per_minibatch * cfg.group_size * cfg.num_minibatches
    spec = BatchSpec({f"s{i}": q for i in range(cfg.num_sources)}, num_minibatches=cfg.num_minibatches,
                     group_size=cfg.group_size)
    capacity = cfg.capacity
    largest = make_soak_traj(0, "s0", "g", traj_bytes=cfg.traj_bytes, response_len=_MAX_RESPONSE).nbytes
    engine_options = dict(engine_options or {})
    journal_tmp = None
    if kill_coordinator_every_s is not None:
        if cfg.engine != "ray":
            raise ConfigError("--kill-coordinator needs --engine ray (the embedded engine has no coordinator process)")
        import tempfile

        journal_tmp = tempfile.mkdtemp(prefix="knitdata-soak-journal-")
        engine_options.setdefault("journal_dir", journal_tmp)
        engine_options.setdefault("name", f"soak-{os.getpid()}")
    pipe = Pipeline(spec, num_consumers=cfg.num_consumers, engine=cfg.engine, capacity_bytes=capacity,
                    token_budget=cfg.token_budget, put_timeout=None, engine_options=engine_options or None)
    restarts = [0]
    killer_stop = threading.Event()

    def killer() -> None:
        import ray

        from knitdata.engines.ray import coordinator_name
        from knitdata.storage.ray_unit import NAMESPACE

        actor = ray.get_actor(coordinator_name(engine_options["name"]), namespace=NAMESPACE)
        while not killer_stop.wait(kill_coordinator_every_s):
            ray.kill(actor, no_restart=False)
            restarts[0] += 1
    ledger = Ledger()
    collate = _CheckingCollate(ledger.corrupt, ledger.lock)
    consumed = [0] * cfg.num_consumers
    produced = [0]
    rss = RssSampler().start()
    warmup = cfg.warmup_s if cfg.warmup_s is not None else min(2.0, 0.2 * cfg.seconds)

    def guard(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported in the results
            ledger.error(e)
            pipe.close()

    t0 = time.perf_counter()
    deadline = t0 + cfg.seconds

    def produce() -> None:
        try:
            _producer(pipe, cfg, ledger, deadline, produced)
        finally:
            pipe.close()  # end of stream: consumers drain what was admitted and stop

    threads = [threading.Thread(target=guard, args=(consume_with_restarts, pipe, r, cfg, ledger, collate, consumed),
                                name=f"soak-consumer-{r}", daemon=True) for r in range(cfg.num_consumers)]
    threads.append(threading.Thread(target=guard, args=(produce,), name="soak-producer", daemon=True))
    killer_thread = None
    if kill_coordinator_every_s is not None:
        killer_thread = threading.Thread(target=guard, args=(killer,), name="soak-coordinator-killer", daemon=True)
        killer_thread.start()
    for t in threads:
        t.start()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=round(cfg.seconds, 1), desc=f"soak {cfg.engine}", unit="s", leave=False)
    high = 0
    timeline: list[list[float]] = []
    baseline_marked = False
    ticks = 0
    while any(t.is_alive() for t in threads):
        time.sleep(0.2)
        now = time.perf_counter() - t0
        if not baseline_marked and now >= warmup:
            rss.mark_baseline()
            baseline_marked = True
        units = pipe.stats()["units"]
        high = max([high] + [u["high_water_bytes"] for u in units.values()])
        snap = {"t": now, "produced": produced[0], "consumed": sum(consumed), "high_water": high,
                "used": sum(u["used_bytes"] for u in units.values()), "restarts": ledger.restarts,
                "rss": _rss_bytes()}
        timeline.append([round(now, 2), snap["used"], snap["rss"], snap["produced"], snap["consumed"]])
        if len(timeline) > 2 * _TIMELINE_POINTS:  # bounded: keep every other point
            del timeline[::2]
        if on_tick is not None:
            on_tick(snap)
        if bar is not None:
            bar.n = round(min(now, cfg.seconds), 1)
            bar.set_postfix(put=produced[0], done=sum(consumed), restarts=ledger.restarts, refresh=False)
            bar.refresh()
        ticks += 1
        if now > cfg.seconds + 120:  # drain must not hang forever
            ledger.error(TimeoutError("consumers did not drain within 120 s after the producer stopped"))
            pipe.close()
            break
    for t in threads:
        t.join(10)
    killer_stop.set()
    if killer_thread is not None:
        killer_thread.join(10)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if not baseline_marked:
        rss.mark_baseline()
    growth = rss.stop()
    stats = pipe.stats()
    if cfg.engine == "ray":
        pipe.shutdown()
    if journal_tmp is not None:
        import shutil

        shutil.rmtree(journal_tmp, ignore_errors=True)
    high = max([high] + [u["high_water_bytes"] for u in stats["units"].values()])
    summary = ledger.summary()
    committed = summary["trajectories"]
    out = {
        "engine": cfg.engine,
        "mode": "threads",
        "seconds": round(elapsed, 3),
        **summary,
        "throughput_per_s": committed / elapsed if elapsed > 0 else 0.0,
        "capacity_bytes": capacity,
        "largest_trajectory_bytes": largest,
        "store_high_water_bytes": high,
        "store_bound_bytes": capacity + largest,
        "rss_baseline_bytes": rss.baseline,
        "rss_growth_bytes": growth,
        "rss_bound_bytes": capacity * len(stats["units"]) + RSS_SLACK_BYTES,
        "store_put_wait_s": sum(u["put_wait_s"] for u in stats["units"].values()),
        "held_at_end": stats["held_trajectories"],
        "coordinator_restarts": restarts[0],
        "loadavg": list(os.getloadavg()),
        "config": asdict(cfg),
        "timeline_columns": ["t_s", "store_used_bytes", "rss_bytes", "put", "committed"],
        "timeline": timeline,
    }
    return _judged(out)


# ------------------------------------------------------------------------------------------ cross-process (Ray)
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


def _write_json_atomic(path: str, obj: Any) -> None:
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
    import knitdata.engines.ray  # noqa: F401 - imports Ray too
    import knitdata.pipeline  # noqa: F401

    try:
        job = conn.recv()
    except EOFError:  # the driver gave up before sending one
        return None
    finally:
        conn.close()
    return job if isinstance(job, dict) else None


def _xproc_attach(job: dict[str, Any]) -> Any:
    from knitdata.pipeline import Pipeline

    return Pipeline.attach(job["name"], address=job["address"], put_timeout=None)


def _xproc_consumer(conn: Any) -> None:
    """Consumer process of the cross-process soak (one incarnation of rank ``job["rank"]``).

    Restores the rank's dataset from the JSON state file when there is one, trains (sleeps), saves the state
    (write + rename), commits it, and logs each step's ids; at ``job["crash_after"]`` micro-batches it SIGKILLs
    itself at ``crash_point`` (the driver then spawns the next incarnation).
    """
    job = _xproc_job(conn)
    if job is None:
        return
    log = _EventLog(job["events"])
    try:
        cfg = SoakConfig(**job["config"])
        rank = int(job["rank"])
        pipe = _xproc_attach(job)
        bad: list[str] = []
        lock = threading.Lock()
        ds = pipe.dataset(rank, fetch=cfg.fetch, collate=_CheckingCollate(bad, lock), timeout=job["timeout_s"])
        restored = os.path.exists(job["state"])
        if restored:
            with open(job["state"], encoding="utf-8") as f:
                ds.load_state_dict(json.load(f))
        else:  # the step-0 checkpoint: a crash before the first saved step restores to the start
            _write_json_atomic(job["state"], ds.state_dict())
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
            _write_json_atomic(job["state"], state)  # the checkpoint
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
    job = _xproc_job(conn)
    if job is None:
        return
    log = _EventLog(job["events"])
    try:
        cfg = SoakConfig(**job["config"])
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
                t = make_soak_traj(i, s, grp, traj_bytes=cfg.traj_bytes, response_len=rng.randint(4, _MAX_RESPONSE),
                                   gen_version=b)
                pipe.put(t, timeout=None)
                log.write("put", id=t.id)
                if interval:
                    next_t = _pace(next_t, interval)
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
    largest = make_soak_traj(0, "s0", "g", traj_bytes=cfg.traj_bytes, response_len=_MAX_RESPONSE).nbytes
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

        from knitdata.engines.ray import coordinator_name
        from knitdata.storage.ray_unit import NAMESPACE

        actor = ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
        while not killer_stop.wait(kill_coordinator_every_s):
            if max_coordinator_kills is not None and kills[0] >= max_coordinator_kills:
                return
            pid = pipe.control.call("info")["pid"]
            t = time.perf_counter()
            ray.kill(actor, no_restart=False)  # SIGKILL; Ray restarts it and it replays its journal
            kills[0] += 1
            while not killer_stop.is_set():  # the next interval counts from its recovery
                info = pipe.control.call("info")
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
            if len(timeline) > 2 * _TIMELINE_POINTS:
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
    return _judged(out)


class _XprocAbort(Exception):
    """Internal: a worker failed; the run stops and reports it."""


# ------------------------------------------------------------------------------------------ reporting
def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table of soak results, one column per engine."""
    rows = [
        ("seconds", lambda r: f"{r['seconds']:.1f}"),
        ("trajectories delivered", lambda r: str(r["trajectories"])),
        ("throughput (traj/s)", lambda r: f"{r['throughput_per_s']:.1f}"),
        ("lost", lambda r: str(r["lost"])),
        ("duplicated", lambda r: str(r["duplicated"])),
        ("corrupt payloads", lambda r: str(r["corrupt"])),
        ("consumer restarts", lambda r: str(r["restarts"])),
        ("re-delivered after restore", lambda r: str(r["redelivered_after_restore"])),
        ("store capacity", lambda r: _mib(r["capacity_bytes"])),
        ("store high-water", lambda r: _mib(r["store_high_water_bytes"])),
        ("  bound (cap + 1 traj)", lambda r: _mib(r["store_bound_bytes"])),
        ("RSS growth after warm-up", lambda r: _mib(r["rss_growth_bytes"])),
        ("  bound (cap + 64 MiB)", lambda r: _mib(r["rss_bound_bytes"])),
        ("producer blocked (s)", lambda r: f"{r['store_put_wait_s']:.1f}"),
        ("coordinator kills", lambda r: str(r.get("coordinator_restarts", 0))),
        ("errors", lambda r: str(len(r["errors"]))),
        ("ok", lambda r: "yes" if r["ok"] else "NO"),
    ]
    header = ["metric"] + [r.get("label", r["engine"]) for r in results]
    body = [[name] + [fmt(r) for r in results] for name, fmt in rows]
    widths = [max(len(str(x[i])) for x in [header] + body) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(header, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


def plot_timeline(results: list[dict[str, Any]], path: str) -> None:
    """Plot store use and RSS over time, one line per engine (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise OptionalDependencyError("matplotlib", "plot", "the soak plot (--plot)") from e
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        tl = r["timeline"]
        if not tl:
            continue
        t = [p[0] for p in tl]
        name = r.get("label", r["engine"])
        mem = "PSS growth (driver + workers)" if r.get("mode") == "cross_process" else "RSS growth"
        ax1.plot(t, [p[1] / 2**20 for p in tl], label=f"{name} store used")
        ax1.axhline(r["store_bound_bytes"] / 2**20, linestyle="--", linewidth=1, label=f"{name} bound")
        base = r["rss_baseline_bytes"] or tl[0][2]
        ax2.plot(t, [(p[2] - base) / 2**20 for p in tl], label=f"{name} {mem}")
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("MiB")
    ax1.set_title("store bytes held (capacity + 1 trajectory bound)")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("MiB since warm-up")
    ax2.set_title("memory growth after warm-up")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Command-line options of ``knitdata bench soak``."""
    d = SoakConfig()
    parser.add_argument("--seconds", type=float, default=d.seconds, help="how long the producer runs")
    parser.add_argument("--engine", choices=("embedded", "ray", "all"), default="embedded",
                        help="engine to soak; 'all' runs embedded and, when installed and available, ray")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="write a plot of store use and RSS over time here (matplotlib)")
    parser.add_argument("--consumers", type=int, default=d.num_consumers)
    parser.add_argument("--traj-kib", type=int, default=d.traj_bytes // 1024, help="payload KiB per trajectory")
    parser.add_argument("--capacity-mib", type=float, default=None,
                        help=f"store capacity per unit (default {d.capacity_trajectories} trajectories)")
    parser.add_argument("--consume-ms", type=float, default=d.consume_s * 1000,
                        help="consumer time per trajectory (ms)")
    parser.add_argument("--speed-ratio", type=float, default=d.speed_ratio,
                        help="producer rate over the consumers' total rate")
    parser.add_argument("--restart-every", type=int, default=d.restart_every,
                        help="each consumer crashes and restores from its saved state every N micro-batches (0: never)")
    parser.add_argument("--crash-point", choices=CRASH_POINTS, default=d.crash_point)
    parser.add_argument("--fetch", choices=("sample", "eager", "iter"), default=d.fetch)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    parser.add_argument("--kill-coordinator", type=float, nargs="?", const=3.0, default=None, metavar="SECONDS",
                        help="Ray engine: SIGKILL the coordinator every SECONDS (default 3) while the soak runs; it "
                        "journals, Ray restarts it and it replays the journal (reports coordinator_restarts); "
                        "with --processes the next kill comes SECONDS after the coordinator answered again")
    parser.add_argument("--processes", action="store_true",
                        help="Ray engine: producers and consumers in their own processes (Pipeline.attach); a consumer "
                        "restart SIGKILLs its process, and a new one restores from the JSON state saved on disk")
    parser.add_argument("--producers", type=int, default=1, help="producer processes (with --processes)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="most consumer process restarts per rank (with --processes; default: no limit)")
    parser.add_argument("--max-kills", type=int, default=None,
                        help="most coordinator kills (with --processes and --kill-coordinator; default: no limit)")
    parser.add_argument("--control", action="store_true",
                        help="with --processes: first run the same cross-process soak without faults (no consumer "
                        "restarts, no coordinator kills), reported side by side")


def _config(args: argparse.Namespace, engine: str) -> SoakConfig:
    return SoakConfig(
        seconds=args.seconds,
        engine=engine,
        num_consumers=args.consumers,
        traj_bytes=args.traj_kib * 1024,
        capacity_bytes=None if args.capacity_mib is None else int(args.capacity_mib * 2**20),
        consume_s=args.consume_ms / 1000,
        speed_ratio=args.speed_ratio,
        restart_every=args.restart_every,
        crash_point=args.crash_point,
        fetch=args.fetch,
        seed=args.seed,
    )


def summarize_runs(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON payload of one command: the run itself, or ``{"runs": [...]}`` with top-level keys summing up.

    The summary keys: ``lost``, ``duplicated``, ``unexpected``, ``coordinator_restarts`` (sums),
    ``store_high_water_bytes``, ``rss_growth_bytes``, ``capacity_bytes`` (maxima), ``throughput_per_s`` (the
    minimum), ``mode`` when every run has the same, and for cross-process runs ``producer_processes``,
    ``consumer_processes`` (maxima) and ``consumer_process_restarts`` (sum).
    """
    if len(results) == 1:
        return dict(results[0])
    payload: dict[str, Any] = {"runs": results}
    payload.update({
        "lost": sum(r["lost"] for r in results),
        "duplicated": sum(r["duplicated"] for r in results),
        "unexpected": sum(r["unexpected"] for r in results),
        "coordinator_restarts": sum(r.get("coordinator_restarts", 0) for r in results),
        "store_high_water_bytes": max(r["store_high_water_bytes"] for r in results),
        "rss_growth_bytes": max(r["rss_growth_bytes"] for r in results),
        "capacity_bytes": max(r["capacity_bytes"] for r in results),
        "throughput_per_s": min(r["throughput_per_s"] for r in results),
    })
    modes = {r.get("mode") for r in results}
    if len(modes) == 1:
        payload["mode"] = next(iter(modes))
    xp = [r for r in results if r.get("mode") == "cross_process"]
    if xp:
        payload.update({
            "producer_processes": max(r["producer_processes"] for r in xp),
            "consumer_processes": max(r["consumer_processes"] for r in xp),
            "consumer_process_restarts": sum(r["consumer_process_restarts"] for r in xp),
        })
    return payload


def run(args: argparse.Namespace) -> int:
    """Run the soak(s), print a table, write JSON; exit 1 if anything was lost, duplicated or unbounded."""
    torch.set_num_threads(1)
    engines = ["embedded", "ray"] if args.engine == "all" else [args.engine]
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    processes = getattr(args, "processes", False)
    if processes and args.engine != "ray":
        raise ConfigError(f"--processes runs the Ray engine across processes: use --engine ray, not {args.engine!r}")
    for engine in engines:
        try:
            if processes and getattr(args, "control", False):
                quiet = _config(args, engine)
                quiet.restart_every = 0
                results.append(run_soak_processes(quiet, num_producers=args.producers, progress=not args.no_progress,
                                                  label="ray (processes, no faults)"))
            if processes:
                results.append(run_soak_processes(
                    _config(args, engine), num_producers=args.producers, progress=not args.no_progress,
                    kill_coordinator_every_s=args.kill_coordinator, max_coordinator_kills=args.max_kills,
                    max_consumer_restarts=args.max_restarts))
                continue
            results.append(run_soak(_config(args, engine), progress=not args.no_progress,
                                    kill_coordinator_every_s=args.kill_coordinator if engine == "ray" else None))
        except (EngineError, OptionalDependencyError) as e:
            if args.engine != "all":
                raise
            skipped[engine] = str(e)
    print(format_table(results))
    for r in results:
        if r.get("mode") == "cross_process":
            rec, back = r["coordinator_recovery_median_s"], r["consumer_restore_median_s"]
            print(f"{r['label']}: {r['producer_processes']} producer and {r['consumer_processes']} consumer processes "
                  f"({r['consumer_process_restarts']} consumer process restarts, SIGKILL to the new process's first "
                  f"micro-batch median {'-' if back is None else f'{back:.2f} s'}), start-up {r['startup_s']:.1f} s, "
                  f"coordinator recovery median {'-' if rec is None else f'{rec:.2f} s'}; memory growth = "
                  f"{r['rss_measure']}; driver alone {_mib(r['rss_growth_driver_bytes'])}; "
                  f"load average {', '.join(f'{x:.2f}' for x in r['loadavg'])}")
    for engine, why in skipped.items():
        print(f"{engine}: skipped ({why})")
    for r in results:
        for err in r["errors"][:5]:
            print(f"{r.get('label', r['engine'])} error: {err}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        payload = summarize_runs(results)
        payload["skipped"] = skipped
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")
    if getattr(args, "plot", None) and results:
        plot_timeline(results, args.plot)
        print(f"wrote {args.plot}")
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("soak"))
