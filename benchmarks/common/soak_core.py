"""The soak benchmark in one process: its configuration, payloads that check themselves, the ledger of
accepted / committed / rolled-back trajectories, memory sampling, consumers that crash and restore, and the
in-process run (:func:`run_soak`); see :mod:`benchmarks.soak`."""

from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from knitdata.admission import BatchSpec
from knitdata.errors import ConfigError
from knitdata.record import Trajectory

__all__ = [
    "CRASH_POINTS",
    "RSS_SLACK_BYTES",
    "MAX_RESPONSE",
    "TIMELINE_POINTS",
    "SoakConfig",
    "make_soak_traj",
    "check_soak_payload",
    "CheckingCollate",
    "Ledger",
    "RssSampler",
    "consume_with_restarts",
    "judged",
    "pace",
    "run_soak",
]


#: Where a consumer crash is injected: after it saved the state of its finished step (``between_steps``),
#: or after it received a micro-batch and before it finished that step (``mid_step``: the restore must then
#: deliver that micro-batch again).
CRASH_POINTS: tuple[str, ...] = ("between_steps", "mid_step")
#: Slack of the resident-memory bound on top of the store capacity (issue "Reliability").
RSS_SLACK_BYTES = 64 * 1024 * 1024
MAX_RESPONSE = 24
TIMELINE_POINTS = 300


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
    pad = max(0, traj_bytes - 8 * (2 + MAX_RESPONSE))  # one shape in every trajectory (collate stacks it)
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


class CheckingCollate:
    """Wraps the default collate: verifies every payload, keeps only ids (the soak does not train)."""

    def __init__(self, bad: list[str], lock: threading.Lock) -> None:
        from knitdata.consumer.collate import TokenCollator

        self._inner = TokenCollator()
        self._bad = bad
        self._lock = lock

    def __call__(self, trajs: Any, info: Any = None) -> Any:
        for t in trajs:
            if not check_soak_payload(t):
                with self._lock:
                    self._bad.append(t.id)
        return self._inner(trajs, info)


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
            t = make_soak_traj(i, s, grp, traj_bytes=cfg.traj_bytes, response_len=rng.randint(4, MAX_RESPONSE), gen_version=b)
            pipe.put(t, timeout=None)
            ledger.accept(t.id)
            produced[0] += 1
            if interval:
                next_t = pace(next_t, interval)
        pipe.report_version(b + 1)
        b += 1


def judged(out: dict[str, Any]) -> dict[str, Any]:
    """Add the verdicts of a soak result: within its store and RSS bounds, and ``ok`` (nothing lost, duplicated,
    unexpected or corrupt, no error, within bounds)."""
    out["within_store_bound"] = out["store_high_water_bytes"] <= out["store_bound_bytes"]
    out["within_rss_bound"] = out["rss_growth_bytes"] <= out["rss_bound_bytes"]
    out["ok"] = (out["lost"] == 0 and out["duplicated"] == 0 and out["unexpected"] == 0 and out["corrupt"] == 0
                 and not out["errors"] and out["within_store_bound"] and out["within_rss_bound"])
    return out


def pace(next_t: float, interval: float) -> float:
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
    largest = make_soak_traj(0, "s0", "g", traj_bytes=cfg.traj_bytes, response_len=MAX_RESPONSE).nbytes
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

        from knitdata.engines.ray.connect import NAMESPACE
        from knitdata.engines.ray.engine import coordinator_name

        actor = ray.get_actor(coordinator_name(engine_options["name"]), namespace=NAMESPACE)
        while not killer_stop.wait(kill_coordinator_every_s):
            ray.kill(actor, no_restart=False)
            restarts[0] += 1
    ledger = Ledger()
    collate = CheckingCollate(ledger.corrupt, ledger.lock)
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
        if len(timeline) > 2 * TIMELINE_POINTS:  # bounded: keep every other point
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
    return judged(out)
