"""Engine conformance scenarios: the same code runs on the embedded engine and on the Ray engine.

Each scenario takes ``engine`` (``"embedded"`` or ``"ray"``) and returns JSON. The embedded engine runs them in
the pytest process; the Ray engine runs them in a driver subprocess attached to a local multi-node
``ray.cluster_utils.Cluster`` (``tests/_ray_helpers.py``), so the pytest process never imports Ray::

    python tests/_conformance.py NAME --address ADDR --args JSON

Everything goes through the public API that every engine shares: ``Pipeline(spec, engine=..., ...)``,
``put``/``close``/``withdraw``, ``dataset(rank, fetch=...)`` and its ``state_dict``/``load_state_dict``/
``stateful_loader``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # pragma: no cover - subprocess entry
    sys.path.insert(0, str(HERE.parent))

__all__ = ["SCENARIOS", "run", "workload"]

SCENARIOS: dict[str, Callable[..., Any]] = {}
_COUNTER = [0]


def scenario(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register a scenario."""
    SCENARIOS[fn.__name__] = fn
    return fn


def _ray_nodes() -> list[str]:
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    return [n["NodeID"] for n in sorted(alive, key=lambda n: next(int(k[7:]) for k in n["Resources"]
                                                                     if k.startswith("kd_node")))]


def make_traj(i: int, *, group: str, source: str, tokens: int, extra: int = 256, fields: str = "base") -> Any:
    """A small deterministic trajectory."""
    import torch

    from knitdata.record import Trajectory

    g = torch.Generator().manual_seed(i)
    p = 8
    scalars = {"reward": float(i)} if fields == "base" else {"reward": float(i), "bonus": 1.0}
    return Trajectory(
        id=f"t{i}", source=source, group=group, gen_version=0,
        prompt_ids=torch.randint(0, 1000, (p,), generator=g),
        response_ids=torch.randint(0, 1000, (tokens - p,), generator=g),
        scalars=scalars, tensors={"blob": torch.rand(extra, generator=g)},
    )


def workload(n_groups: int, group_size: int = 2, extra: int = 256) -> list[Any]:
    """``n_groups`` groups over two sources, varied lengths (deterministic)."""
    out = []
    for g in range(n_groups):
        for k in range(group_size):
            i = g * group_size + k
            out.append(make_traj(i, group=f"g{g}", source=("math", "code")[g % 2], tokens=24 + 8 * ((i * 7) % 5),
                                 extra=extra))
    return out


def spec_for(n_groups: int, group_size: int = 2, m: int = 2, train_batches: int = 2) -> Any:
    from knitdata.admission import BatchSpec

    per_source = n_groups * group_size // (2 * train_batches)
    return BatchSpec({"math": per_source, "code": per_source}, num_minibatches=m, group_size=group_size)


def make_pipeline(engine: str, spec: Any, *, nodes: int = 1, ranks_per_node: int = 1, **kw: Any) -> Any:
    """A pipeline on ``engine`` with ``nodes`` x ``ranks_per_node`` consumers."""
    from knitdata import Pipeline
    from knitdata.placement import ConsumerLayout

    layout = ConsumerLayout([f"node{n}" for n in range(nodes) for _ in range(ranks_per_node)])
    kw.setdefault("token_budget", 96)
    kw.setdefault("capacity_bytes", 256 << 20)
    if engine == "embedded":
        return Pipeline(spec, layout=layout, **kw)
    _COUNTER[0] += 1
    opts = {"cross_process": True, "name": f"cf-{os.getpid()}-{_COUNTER[0]}", "nodes": _ray_nodes()[:nodes]}
    return Pipeline(spec, layout=layout, engine="ray", engine_options=opts, **kw)


def _shutdown(pipe: Any) -> None:
    for name in ("shutdown", "close"):
        fn = getattr(pipe, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort
                pass
            return


def _row(mb: Any) -> list[Any]:
    return [list(mb.info.trajectory_ids), [mb.info.minibatch, mb.info.microbatch]]


def _take(it: Any, n: int) -> list[Any]:
    out = []
    for _ in range(n):
        try:
            out.append(_row(next(it)))
        except StopIteration:
            break
    return out


def _close_iter(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


# ---------------------------------------------------------------------------------------------- resume
@scenario
def resume(engine: str, fetch: str = "iter", cases: list[list[Any]] | None = None, n_groups: int = 16,
           save_points: list[int] | None = None) -> dict[str, Any]:
    """Exactly-once at every save point: consume s micro-batches per rank, save, restore, finish.

    Each case is ``[nodes, restore, loader]``. ``restore="same"``: a new dataset of the same pipeline loads the
    state. ``restore="fresh"``: a new pipeline, whose consumers load their states before the producer refills
    it with the same puts (as after a restart). ``loader="stateful"``: through ``StatefulDataLoader``.
    Returns ``{"ref": {nodes: streams}, "cases": {"nodes/restore/loader": {save point: {"taken", "rest"}}}}``.
    """
    spec = spec_for(n_groups)
    trajs = workload(n_groups)
    cases = cases or [[1, "same", "plain"], [1, "fresh", "plain"], [2, "same", "plain"], [2, "fresh", "plain"]]

    def fill(pipe: Any) -> None:
        for t in trajs:
            pipe.put(t)
        pipe.close()

    refs: dict[int, list[Any]] = {}
    for nodes in sorted({int(c[0]) for c in cases}):
        ref_pipe = make_pipeline(engine, spec, nodes=nodes)
        fill(ref_pipe)
        refs[nodes] = [[_row(mb) for mb in ref_pipe.dataset(r, fetch=fetch)] for r in range(nodes)]
        _shutdown(ref_pipe)
    out: dict[str, Any] = {"ref": {str(k): v for k, v in refs.items()}, "cases": {}}
    for nodes, restore, loader in cases:
        world = int(nodes)
        total = max(len(x) for x in refs[world])
        points = save_points if save_points is not None else list(range(total + 1))
        res: dict[str, Any] = {}

        def loader_of(ds: Any, loader: str = loader) -> Any:
            return ds.stateful_loader() if loader == "stateful" else ds

        for s in points:
            pipe = make_pipeline(engine, spec, nodes=world)
            fill(pipe)
            taken, states, iters = [], [], []
            for r in range(world):
                ds = pipe.dataset(r, fetch=fetch)
                ld = loader_of(ds)
                it = iter(ld)
                taken.append(_take(it, s))
                states.append(json.loads(json.dumps(ld.state_dict())))
                iters.append((ds, it))
            for ds, it in iters:
                _close_iter(it)
                getattr(ds, "close", lambda: None)()
            del iters
            if restore == "fresh":
                _shutdown(pipe)
                pipe = make_pipeline(engine, spec, nodes=world)
            lds = []
            for r in range(world):
                ld = loader_of(pipe.dataset(r, fetch=fetch))
                ld.load_state_dict(states[r])
                lds.append(ld)
            if restore == "fresh":
                fill(pipe)
            rest = [[_row(mb) for mb in ld] for ld in lds]
            _shutdown(pipe)
            res[str(s)] = {"taken": taken, "rest": rest}
        out["cases"][f"{nodes}/{restore}/{loader}"] = res
    return out


# ------------------------------------------------------------------------------------------ schema race
@scenario
def schema_race(engine: str, rounds: int = 6) -> dict[str, Any]:
    """Two concurrent first puts with different fields: at most one field set is ever accepted."""
    from knitdata.errors import KnitdataError

    spec = spec_for(4, group_size=1, m=1, train_batches=1)
    results = []
    for r in range(rounds):
        pipe = make_pipeline(engine, spec)
        a = make_traj(1000 + 2 * r, group=f"a{r}", source="math", tokens=32, extra=400_000)
        b = make_traj(1001 + 2 * r, group=f"b{r}", source="math", tokens=32, extra=400_000, fields="bonus")
        outcome: dict[str, str] = {}
        barrier = threading.Barrier(2)

        def put(t: Any, key: str, pipe: Any = pipe, outcome: dict[str, str] = outcome,
                barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                pipe.put(t)
                outcome[key] = "ok"
            except KnitdataError as e:
                outcome[key] = type(e).__name__

        threads = [threading.Thread(target=put, args=(a, "a")), threading.Thread(target=put, args=(b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.append(outcome)
        _shutdown(pipe)
    return {"results": results}


# ------------------------------------------------------------------------------------------ same errors
def _err(fn: Callable[[], Any]) -> list[Any]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported
        return [type(e).__name__, getattr(e, "trajectory_id", None), getattr(e, "field", None), str(e)[:300]]
    return ["no error", None, None, ""]


@scenario
def errors(engine: str) -> dict[str, Any]:
    """The same faults give the same error types (and name the same trajectory and field) on every engine."""
    spec = spec_for(8)
    out: dict[str, Any] = {}
    pipe = make_pipeline(engine, spec)
    good = workload(8)
    pipe.put(good[0])
    out["duplicate_id"] = _err(lambda: pipe.put(good[0]))
    out["unknown_source"] = _err(lambda: pipe.put(make_traj(500, group="gx", source="nope", tokens=32)))
    out["schema"] = _err(lambda: pipe.put(make_traj(501, group="gy", source="math", tokens=32, fields="bonus")))
    pipe.withdraw("gw")
    out["withdrawn"] = _err(lambda: pipe.put(make_traj(502, group="gw", source="math", tokens=32)))
    out["not_a_trajectory"] = _err(lambda: pipe.put({"id": "x"}))
    out["bad_rank"] = _err(lambda: iter(pipe.dataset(5)))
    out["bad_fetch"] = _err(lambda: pipe.dataset(0, fetch="lazy"))
    ds = pipe.dataset(0)
    out["foreign_state"] = _err(lambda: ds.load_state_dict({"format": "something else"}))
    pipe.close()
    out["put_after_close"] = _err(lambda: pipe.put(good[1]))
    _shutdown(pipe)
    # a full store: put_timeout=0 fails at once with StoreFull
    from knitdata.admission import BatchSpec

    one = [make_traj(700 + i, group=f"s{i}", source="math", tokens=32) for i in range(3)]
    small = make_pipeline(engine, BatchSpec({"math": 2}, num_minibatches=1, group_size=1),
                          capacity_bytes=2 * one[0].nbytes)
    small.put(one[0], timeout=0)
    small.put(one[1], timeout=0)  # a mini-batch planned for rank 0, not consumed: it holds the store
    out["store_full"] = _err(lambda: small.put(one[2], timeout=0))
    _shutdown(small)
    return out


# ----------------------------------------------------------------------------------------- bounded waits
@scenario
def bounded_waits(engine: str) -> dict[str, Any]:
    """A consumer never waits forever: a dataset timeout, and a close with an incomplete train batch."""
    spec = spec_for(8, m=2, train_batches=1)
    out: dict[str, Any] = {}
    pipe = make_pipeline(engine, spec)
    trajs = workload(8)
    for t in trajs[:4]:  # math g0, code g1: not enough for a mini-batch of 8
        pipe.put(t)
    t0 = time.monotonic()
    out["timeout"] = _err(lambda: [None for _ in pipe.dataset(0, timeout=1.0)])
    out["timeout_s"] = time.monotonic() - t0
    _shutdown(pipe)
    pipe = make_pipeline(engine, spec)
    for t in trajs[:6]:
        pipe.put(t)
    closed = threading.Timer(0.5, pipe.close)
    closed.start()
    t0 = time.monotonic()
    out["incomplete"] = _err(lambda: [None for _ in pipe.dataset(0, timeout=30.0)])
    out["incomplete_s"] = time.monotonic() - t0
    closed.join()
    _shutdown(pipe)
    return out


# ------------------------------------------------------------------------------------------ ray workers
@scenario
def workers(engine: str, num_workers: int = 2, n_groups: int = 16, stop_after: int = 5, fetch: str = "iter") -> dict[str, Any]:
    """DataLoader worker processes split a rank's micro-batches in plan order; resume from the loader state."""
    spec = spec_for(n_groups)
    pipe = make_pipeline(engine, spec)
    for t in workload(n_groups):
        pipe.put(t)
    pipe.close()
    ref = [_row(mb) for mb in pipe.dataset(0, fetch=fetch)] if engine == "embedded" else None
    ds = pipe.dataset(0, fetch=fetch)
    try:
        loader = ds.stateful_loader(num_workers=num_workers)
        it = iter(loader)
    except Exception as e:  # noqa: BLE001 - the embedded engine refuses worker processes
        _shutdown(pipe)
        return {"refused": [type(e).__name__, str(e)[:300]], "ref": ref}
    before = _take(it, stop_after)
    state = json.loads(json.dumps(loader.state_dict()))
    _take(it, 2)  # consumed after the checkpoint: comes again after the "crash"
    del it, loader
    ds2 = pipe.dataset(0, fetch=fetch)
    loader2 = ds2.stateful_loader(num_workers=num_workers)
    loader2.load_state_dict(state)
    after = [_row(mb) for mb in loader2]
    _shutdown(pipe)
    return {"before": before, "after": after}


# --------------------------------------------------------------------------------------------- fencing
@scenario
def drain(engine: str, name: str, rank: int = 0, fetch: str = "iter") -> dict[str, Any]:
    """Attach to the Ray pipeline ``name`` (from this process) and take every micro-batch of ``rank``."""
    from knitdata import Pipeline

    assert engine == "ray", "drain attaches by name (Ray engine)"
    pipe = Pipeline.attach(name)
    t0 = time.monotonic()
    it = iter(pipe.dataset(rank, fetch=fetch))  # takes the rank over from a live older iterator
    rows = _take(it, 1)
    first_s = time.monotonic() - t0
    rows += [_row(mb) for mb in it]
    return {"rows": rows, "first_s": first_s}


@scenario
def fencing(engine: str, n_groups: int = 16, fetch: str = "iter") -> dict[str, Any]:
    """A replaced-but-alive consumer is fenced: A takes one micro-batch of rank 0 and stalls; B (another process
    on Ray, another dataset in this process on the embedded engine) takes rank 0 over and drains it; A's next
    ``next()`` raises. Nothing is delivered twice or dropped."""
    spec = spec_for(n_groups)
    pipe = make_pipeline(engine, spec)
    for t in workload(n_groups):
        pipe.put(t)
    pipe.close()
    ref = None
    if engine == "embedded":
        ref_pipe = make_pipeline(engine, spec)
        for t in workload(n_groups):
            ref_pipe.put(t)
        ref_pipe.close()
        ref = [_row(mb) for mb in ref_pipe.dataset(0, fetch=fetch)]
    a_it = iter(pipe.dataset(0, fetch=fetch))
    a_taken = _take(a_it, 1)
    time.sleep(0.5)  # A stalls (its threads stay alive)
    t0 = time.monotonic()
    if engine == "ray":
        import subprocess

        from knitdata import ray_address

        cmd = [sys.executable, str(Path(__file__).resolve()), "drain", "--address", ray_address(), "--args",
               json.dumps({"name": pipe.name, "fetch": fetch})]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"B failed (rc {p.returncode}): {p.stderr[-3000:]}")
        b = json.loads(lines[-1])
    else:
        b = {"rows": []}

        def consume_b() -> None:
            def take_all() -> None:
                t1 = time.monotonic()
                it = iter(pipe.dataset(0, fetch=fetch))
                b["rows"].extend(_take(it, 1))
                b["first_s"] = time.monotonic() - t1
                b["rows"].extend(_row(mb) for mb in it)

            b["error"] = _err(take_all)

        th = threading.Thread(target=consume_b)
        th.start()
        th.join(120)
    b_s = time.monotonic() - t0
    a_after: list[Any] = []
    a_error = _err(lambda: a_after.extend(_row(mb) for mb in a_it))
    _shutdown(pipe)
    return {"a_taken": a_taken, "a_after": a_after, "a_error": a_error, "b": b, "b_s": b_s, "ref": ref}


# ---------------------------------------------------------------------------------------------- replays
@scenario
def replay(engine: str, n_groups: int = 16, save_after: int = 3, reorder: bool = True,
           fetch: str = "iter", short: int | None = None) -> dict[str, Any]:
    """A new job refilled with the puts of one train batch in another order than the run that saved the
    state: refused with an error that names the rank; the same order resumes as before (control). ``short``: the
    refill puts only the first ``short`` trajectories (then closes)."""
    spec = spec_for(n_groups)
    trajs = workload(n_groups)
    pipe = make_pipeline(engine, spec)
    for t in trajs:
        pipe.put(t)
    pipe.close()
    ds = pipe.dataset(0, fetch=fetch)
    it = iter(ds)
    taken = _take(it, save_after)
    state = json.loads(json.dumps(ds.state_dict()))
    _close_iter(it)
    ds.close()
    _shutdown(pipe)
    per_batch = len(trajs) // 2
    refill = list(trajs)
    if reorder:  # the first train batch's groups in reverse order (members stay in order)
        gs = spec.group_size
        first = [refill[i:i + gs] for i in range(0, per_batch, gs)]
        refill[:per_batch] = [t for grp in reversed(first) for t in grp]
    if short is not None:
        refill = refill[:short]
    pipe2 = make_pipeline(engine, spec)
    ds2 = pipe2.dataset(0, fetch=fetch)
    ds2.load_state_dict(state)

    def fill() -> None:
        for t in refill:
            pipe2.put(t)
        pipe2.close()

    rest: list[Any] = []
    put_error = _err(fill)
    error = _err(lambda: rest.extend(_row(mb) for mb in ds2))
    _shutdown(pipe2)
    return {"taken": taken, "rest": rest, "error": error, "put_error": put_error}


# --------------------------------------------------------------------------------------------- rollback
@scenario
def rollback(engine: str, every: int = 3, crash_after: int = 8, fetch: str = "iter") -> dict[str, Any]:
    """The documented loop with the default release: save (and commit) every ``every`` optimizer steps, crash
    after ``crash_after`` steps, restore the last saved state in the running pipeline and finish, reporting
    ``info.minibatch + 1`` as the version after each step."""
    spec = spec_for(48, m=4, train_batches=3)
    pipe = make_pipeline(engine, spec)
    for t in workload(48):
        pipe.put(t)
    pipe.close()
    ds = pipe.dataset(0, fetch=fetch)
    taken: list[Any] = []
    saved: dict[str, Any] | None = None
    saved_at = 0
    steps = 0
    for mb in ds:
        taken.append(_row(mb))
        if mb.info.is_last:
            steps += 1
            pipe.report_version(mb.info.minibatch + 1)
            if steps % every == 0:
                saved = json.loads(json.dumps(ds.state_dict()))
                ds.commit(saved)
                saved_at = len(taken)
            if steps == crash_after:
                break
    ds.close()  # the crash: the iterator is gone
    assert saved is not None
    ds2 = pipe.dataset(0, fetch=fetch)
    ds2.load_state_dict(saved)
    rest: list[Any] = []

    def finish() -> None:
        for mb in ds2:
            rest.append(_row(mb))
            if mb.info.is_last:
                pipe.report_version(mb.info.minibatch + 1)

    error = _err(finish)
    ref_pipe = make_pipeline(engine, spec)
    for t in workload(48):
        ref_pipe.put(t)
    ref_pipe.close()
    ref = [_row(mb) for mb in ref_pipe.dataset(0, fetch=fetch)]
    _shutdown(ref_pipe)
    _shutdown(pipe)
    return {"taken": taken, "saved_at": saved_at, "rest": rest, "error": error, "ref": ref}


# ------------------------------------------------------------------------------------- producers gone
@scenario
def put_and_die(engine: str, name: str, n_groups: int = 3) -> dict[str, Any]:
    """Attach to the Ray pipeline ``name``, put the first ``n_groups`` groups, and die without close()."""
    from knitdata import Pipeline

    assert engine == "ray", "put_and_die attaches by name (Ray engine)"
    pipe = Pipeline.attach(name)
    for t in workload(n_groups):
        pipe.put(t)
    os._exit(0)


@scenario
def producer_dies(engine: str, n_groups: int = 3) -> dict[str, Any]:
    """A producer that stops without close() (its thread ends; on Ray, its process exits) while admission still
    waits: consumers get IncompleteStreamError within the producer timeout, not the dataset's 1,800 s."""
    spec = spec_for(8)
    pipe = make_pipeline(engine, spec, producer_timeout_s=1.0)
    t0 = time.monotonic()
    if engine == "ray":
        import subprocess

        from knitdata import ray_address

        cmd = [sys.executable, str(Path(__file__).resolve()), "put_and_die", "--address", ray_address(), "--args",
               json.dumps({"name": pipe.name, "n_groups": n_groups})]
        subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    else:
        def put_and_fail() -> None:
            for t in workload(n_groups):
                pipe.put(t)
            raise RuntimeError("the producer dies without close()")

        th = threading.Thread(target=lambda: _err(put_and_fail))
        th.start()
        th.join()
    died = time.monotonic()
    out = {"error": _err(lambda: [None for _ in pipe.dataset(0, timeout=300)])}
    out["after_s"] = time.monotonic() - died
    out["total_s"] = time.monotonic() - t0
    _shutdown(pipe)
    return out


# --- replica ---
def _replica_row(mb: Any) -> list[Any]:
    """A micro-batch as ids, position and a digest of its bytes (every tensor of it, in field order)."""
    import hashlib

    h = hashlib.sha256()
    for t in (mb.input_ids, mb.position_ids, mb.loss_mask, *mb.scalars.values(), *mb.tensors.values()):
        h.update(t.contiguous().numpy().tobytes())
    return [*_row(mb), h.hexdigest()[:16]]


@scenario
def replicas(engine: str, n_groups: int = 8, dp: int = 2, num_replicas: int = 2, stop_after: int = 2,
             fetch: str = "iter", num_workers: int = 0) -> dict[str, Any]:
    """Tensor/pipeline-parallel replicas: ``dp`` ranks x ``num_replicas`` replicas, one consumer thread each.

    Replica 1 of rank 0 takes ``stop_after`` micro-batches, saves its state, commits it and stops (a crash); the
    other replicas drain their ranks; then a new dataset of that replica loads the state and finishes. Returns
    each replica's stream (ids, position, byte digest), what the control plane held and released meanwhile, the
    reference streams of a pipeline without replicas, and the error a dataset with another ``num_replicas`` gets.
    With ``num_workers``, each replica iterates through ``StatefulDataLoader`` worker processes (Ray engine).
    Every replica commits its last state when it is done (with workers only explicit commits release).
    """
    from knitdata.consumer.dataset import find_states

    spec = spec_for(n_groups)
    trajs = workload(n_groups)
    ref_pipe = make_pipeline(engine, spec, nodes=1, ranks_per_node=dp)
    for t in trajs:
        ref_pipe.put(t)
    ref_pipe.close()
    ref = [[_replica_row(mb) for mb in ref_pipe.dataset(r, fetch=fetch)] for r in range(dp)]
    _shutdown(ref_pipe)

    pipe = make_pipeline(engine, spec, nodes=1, ranks_per_node=dp)
    for t in trajs:
        pipe.put(t)
    pipe.close()
    streams: dict[str, list[Any]] = {}
    errs: dict[str, Any] = {}
    state: dict[str, Any] = {}

    def loader(rank: int, replica: int) -> tuple[Any, Any]:
        ds = pipe.dataset(rank, replica=replica, num_replicas=num_replicas, fetch=fetch)
        return ds, (ds.stateful_loader(num_workers=num_workers) if num_workers else ds)

    def consume(rank: int, replica: int) -> None:
        def go() -> None:
            ds, ld = loader(rank, replica)
            rows = streams.setdefault(f"{rank}/{replica}", [])
            if (rank, replica) == (0, 1):  # the replica that crashes after saving
                it = iter(ld)
                rows.extend(_replica_row(next(it)) for _ in range(stop_after))
                state.update(json.loads(json.dumps(ld.state_dict())))
                ds.commit(state, wait=True)
                del it
                ds.close()
                return
            rows.extend(_replica_row(mb) for mb in ld)
            ds.commit(ld.state_dict(), wait=True)

        errs[f"{rank}/{replica}"] = _err(go)

    threads = [threading.Thread(target=consume, args=(r, k)) for r in range(dp) for k in range(num_replicas)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(240)
    held = pipe.stats_light()  # sends this process's queued hand-outs and commits first
    resumed, ld = loader(0, 1)
    ld.load_state_dict(state)
    rest = [_replica_row(mb) for mb in ld]
    resumed.commit(ld.state_dict(), wait=True)  # past the loaded state: released once a later one is committed
    after = pipe.stats_light()
    bad_r = _err(lambda: pipe.dataset(1, replica=0, num_replicas=num_replicas + 1))
    _shutdown(pipe)
    keys = ("committed", "held_microbatches", "held_trajectories", "released")
    return {"streams": streams, "rest": rest, "errors": errs,
            "state_next": min(x["next"] for x in find_states(state)),
            "held": {k: held[k] for k in keys}, "after": {k: after[k] for k in keys}, "ref": ref,
            "bad_num_replicas": bad_r, "puts": len(trajs)}


# --- stale ---
@scenario
def staleness_bound(engine: str, seeds: list[int] | None = None, eta: int = 1, batches: int = 3) -> dict[str, Any]:
    """A hard staleness bound on the engine: for each mode (``drop``, ``wait``) and seed, a producer puts groups in a
    seeded random order (drop: versions up to ``eta + 2`` behind the trainer; wait: ``acquire_rollout`` first, fresh
    versions), regenerates what :meth:`Pipeline.dropped` lists, and one consumer trains ``batches`` train batches,
    reporting its version after each mini-batch. Returns, per run, each trained trajectory's
    ``[train batch, source, trainer version, gen_version]``, the dropped groups and the pipeline's bound stats."""
    import random

    import torch

    from knitdata.admission import BatchSpec
    from knitdata.record import Trajectory

    spec = BatchSpec({"math": 4, "code": 4}, num_minibatches=2, group_size=2)
    out: dict[str, Any] = {}
    for mode in ("drop", "wait"):
        for seed in seeds or [0, 1]:
            rng = random.Random(seed)
            pipe = make_pipeline(engine, spec, max_staleness=eta, on_stale=mode)
            it = iter(pipe.dataset(0, fetch="iter", timeout=60))
            version, trained, dropped = 0, [], []
            flying: list[list[Any]] = []
            source_of: dict[str, str] = {}

            def start(source: str, v: int, version: int, flying: list[list[Any]] = flying,
                      source_of: dict[str, str] = source_of, seed: int = seed) -> None:
                members = []
                gid = f"s{seed}g{len(source_of)}"
                for k in range(2):
                    tv = torch.full((6,), v, dtype=torch.int64)
                    if k and v < version:  # a partial rollout: its second half under the newer weights
                        tv[3:] = v + 1
                    members.append(Trajectory(id=f"{gid}m{k}", source=source, group=gid, prompt_ids=torch.arange(4),
                                              response_ids=torch.arange(6), gen_version=v, token_versions=tv))
                for t in members:
                    source_of[t.id] = source
                flying.append(members)

            for _round in range(1000):
                if version >= batches * spec.num_minibatches:
                    break
                for _ in range(rng.randint(1, 3)):  # start a few prompts
                    src = rng.choice(["math", "code"])
                    if mode == "wait":
                        if pipe.rollout_capacity(version)[src] < 1:
                            continue
                        pipe.acquire_rollout(src, 1, version=version, timeout=5)
                        start(src, version, version)
                    else:
                        start(src, max(0, version - rng.randint(0, eta + 2)), version)
                rng.shuffle(flying)
                for _ in range(rng.randint(1, max(1, len(flying)))):  # deliver some, in random order
                    if flying:
                        for t in flying.pop(0):
                            pipe.put(t)
                for d in pipe.dropped():
                    dropped.append(d)
                    start(d["source"], version, version)
                while version < batches * spec.num_minibatches and \
                        pipe.stats_light()["admitted_minibatches"] > version:  # train what is admitted
                    while True:
                        mb = next(it)
                        trained.extend([mb.info.minibatch // 2, source_of[i], version, gv]
                                       for i, gv in zip(mb.info.trajectory_ids, mb.info.gen_versions))
                        if mb.info.is_last:
                            break
                    version += 1
                    pipe.report_version(version)
            stats = pipe.stats()
            _close_iter(it)
            _shutdown(pipe)
            out[f"{mode}/{seed}"] = {"trained": trained, "dropped": dropped, "bound": stats["staleness_bound"],
                                     "token_staleness": stats["token_staleness"]}
    return out


# --- reshape ---
def _consume(pipe: Any, rank: int, workers: int, take: int | None, state: Any = None,
             fetch: str = "sample") -> tuple[list[str], Any]:
    """Rank ``rank`` takes ``take`` micro-batches (``None``: all) through ``workers`` DataLoader workers (0: the
    dataset itself), after loading ``state``; returns the trajectory ids taken and the state saved there."""
    ds = pipe.dataset(rank, fetch=fetch, timeout=60)
    if state is not None:
        ds.load_state_dict(state)
    src = ds.stateful_loader(num_workers=workers) if workers else ds
    it = iter(src)
    ids: list[str] = []
    k = 0
    while take is None or k < take:
        try:
            mb = next(it)
        except StopIteration:
            break
        ids.extend(mb.info.trajectory_ids)
        k += 1
    saved = json.loads(json.dumps(src.state_dict()))
    if workers:
        del it, src
    else:
        ds.close()
    return ids, saved


@scenario
def reshape(engine: str, cases: list[list[Any]], n_groups: int = 24, mode: str = "fresh") -> dict[str, Any]:
    """Elastic resume: ``N`` ranks (``W`` workers) take different numbers of micro-batches and save their states;
    ``N'`` ranks (``W'``) continue from the merged states, in a fresh pipeline refilled with the same puts
    (``mode="fresh"``, case 3) or in the same live pipeline (``"live"``, case 2). A case
    ``[N, W, N', W', point]`` may add ``N''``: the ``N'`` ranks stop part way too and ``N''`` ranks continue
    (per-rank states when ``N'' == N'``). Returns the trajectory ids handed out in each phase, and every id put."""
    from knitdata import merge_rank_states

    spec = spec_for(n_groups)
    out: dict[str, Any] = {"all": [t.id for t in workload(n_groups)], "cases": {}}

    def fill(pipe: Any) -> None:
        for t in workload(n_groups):
            pipe.put(t)
        pipe.close()

    for case in cases:
        n, w, n2, w2, point = case[:5]
        n3 = case[5] if len(case) > 5 else None
        phases: list[list[str]] = []
        pipe = make_pipeline(engine, spec, ranks_per_node=n)
        fill(pipe)
        taken, states = [], []
        for r in range(n):
            ids, st = _consume(pipe, r, w, (point + 3 * r) % 7)
            taken += ids
            states.append(st)
        phases.append(taken)
        merged = merge_rank_states(states)
        if mode == "live":
            merged = pipe.reshape(states, n2)
            pipe2 = pipe
        else:
            _shutdown(pipe)
            pipe2 = make_pipeline(engine, spec, ranks_per_node=n2)
            dss = [pipe2.dataset(r) for r in range(n2)]
            for ds in dss:  # every new rank loads the merged state before the refill
                ds.load_state_dict(merged)
            fill(pipe2)
        taken, states2 = [], []
        for r in range(n2):
            ids, st = _consume(pipe2, r, w2, None if n3 is None else (point + r) % 5, merged)
            taken += ids
            states2.append(st)
        phases.append(taken)
        if n3 is not None:
            _shutdown(pipe2)
            pipe3 = make_pipeline(engine, spec, ranks_per_node=n3)
            loads = states2 if n3 == n2 and not w2 else [merge_rank_states(states2)] * n3
            dss = [pipe3.dataset(r) for r in range(n3)]
            for ds, st in zip(dss, loads):
                ds.load_state_dict(st)
            fill(pipe3)
            phases.append([i for r in range(n3) for i in _consume(pipe3, r, 0, None, None)[0]])
            _shutdown(pipe3)
        else:
            _shutdown(pipe2)
        out["cases"]["/".join(map(str, case))] = phases
    return out


# ------------------------------------------------------------------------------------------ media counts
def _consume_all(pipe: Any, ranks: int, states: list[Any] | None = None) -> list[str]:
    ids: list[str] = []
    for r in range(ranks):
        ids += _consume(pipe, r, 0, None, None if states is None else states[r])[0]
    return ids


@scenario
def media_counts(engine: str, n_groups: int = 8, group_size: int = 4, nodes: int = 2,
                 ckpt_dir: str | None = None) -> dict[str, Any]:
    """Media stored once, counted exactly (issue 43): the media workload of ``tests/_media_checks.py`` (a group's
    image put once, then referenced; a screenshot every trajectory shares, resolved across units) through put,
    a refused reference, a withdrawal, consumption, a live reshape and a whole-pipeline checkpoint and restore.
    Returns :func:`_media_checks.media_report` after every step (the test checks them with ``check_media_exact``)
    and what each step saw."""
    import tempfile

    from _media_checks import media_report, media_workload

    from knitdata import Pipeline
    from knitdata.record import MediaItem

    spec = spec_for(n_groups, group_size=group_size, train_batches=1)
    out: dict[str, Any] = {"reports": {}, "seen": {}}
    rep = out["reports"]

    # put, a refused reference, a withdrawal, consumption
    pipe = make_pipeline(engine, spec, nodes=nodes)
    trajs = media_workload(n_groups, group_size)
    for t in trajs:
        pipe.put(t)
    rep["put"] = media_report(pipe)
    bad = media_workload(1, 1, first=900)[0]
    bad.media = [MediaItem.ref("image", "0" * 32)]
    out["seen"]["bad_ref"] = _err(lambda: pipe.put(bad))
    out["seen"]["rejected_media"] = pipe.internals.control.reporting.stats()["rejected_by_cause"].get("media", 0)
    rep["bad_ref"] = media_report(pipe)
    part = media_workload(1, group_size, first=500)[: group_size - 1]  # an incomplete group, then withdrawn
    for t in part:
        pipe.put(t)
    rep["partial"] = media_report(pipe)
    pipe.withdraw(part[0].group)
    rep["withdrawn"] = media_report(pipe)
    pipe.close()
    ids = _consume_all(pipe, nodes)
    out["seen"]["consumed"] = len(ids)
    rep["consumed"] = media_report(pipe)
    _shutdown(pipe)

    # a live reshape: 2 ranks take part, 1 rank continues
    pipe = make_pipeline(engine, spec, nodes=1, ranks_per_node=2)
    for t in media_workload(n_groups, group_size):
        pipe.put(t)
    pipe.close()
    taken, states = [], []
    for r in range(2):
        got, st = _consume(pipe, r, 0, 1)
        taken += got
        states.append(st)
    rep["before_reshape"] = media_report(pipe)
    merged = pipe.reshape(states, 1)
    rep["reshaped"] = media_report(pipe)
    taken += _consume(pipe, 0, 0, None, merged)[0]
    out["seen"]["reshape_taken"] = len(taken)
    rep["reshape_done"] = media_report(pipe)
    _shutdown(pipe)

    # a whole-pipeline checkpoint and restore
    tmp = ckpt_dir or tempfile.mkdtemp(prefix="kd-media-")
    path = os.path.join(tmp, "ckpt")
    pipe = make_pipeline(engine, spec, nodes=nodes)
    for t in media_workload(n_groups, group_size):
        pipe.put(t)
    rep["before_checkpoint"] = media_report(pipe)
    info = pipe.checkpoint(path)
    out["seen"]["checkpoint_bytes"] = info.bytes
    _shutdown(pipe)
    opts: dict[str, Any] = {}
    if engine != "embedded":
        _COUNTER[0] += 1
        opts["engine_options"] = {"name": f"cf-{os.getpid()}-{_COUNTER[0]}", "nodes": _ray_nodes()[:nodes]}
    pipe = Pipeline.restore(path, **opts)
    rep["restored"] = media_report(pipe)
    pipe.close()
    out["seen"]["restored_consumed"] = len(_consume_all(pipe, nodes))
    rep["restored_consumed"] = media_report(pipe)
    _shutdown(pipe)
    return out


# ----------------------------------------------------------------------------------------------- main
def run(name: str, **kwargs: Any) -> Any:
    """Run scenario ``name`` here (the embedded engine)."""
    return json.loads(json.dumps(SCENARIOS[name](**kwargs)))


def main(argv: list[str]) -> int:
    """Subprocess entry: attach to the cluster at ``--address`` and run one scenario on the Ray engine."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--address", required=True)
    ap.add_argument("--args", default="{}")
    a = ap.parse_args(argv)
    import ray

    from knitdata.engines.ray.connect import connect

    connect(a.address)
    try:
        result = SCENARIOS[a.name](engine="ray", **json.loads(a.args))
    finally:
        ray.shutdown()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
