"""``bench soak --reshape``: kill the whole job at random points, restore it from its last checkpoint.

A *job* is one process (``python -m benchmarks.common.soak_reshape job DIR ...``) running an embedded-engine
pipeline: a producer thread starts prompts in order (``pipe.ledger.started``), puts each prompt's group and
reports it finished; one thread per rank consumes, "trains" (a sleep) and takes its state at every step
boundary; a checkpoint thread, every ``checkpoint_every_s``, copies the ranks' latest states and calls
``pipe.checkpoint`` (into a new directory), then writes ``job.json`` pointing at it (write and rename). Every
event goes to the job's JSON-lines log, flushed per line, so a SIGKILL loses nothing written.

The driver (:func:`run_soak_reshape`) starts a job, SIGKILLs it at a random point, and starts the next one,
which restores from the last ``job.json`` (``Pipeline.restore``; every other round onto one node, then two; and
the number of ranks cycles through ``ranks``, ``2 * ranks``, ``ranks + 1`` (:func:`ranks_of`), so every restore
changes it: the restore gets the old ranks' states, ``rank_states=``, and every new rank loads
``restore_report.merged_state``), loads the ranks' states, reissues ``restore_report.reissue`` (only the missing
members) and continues from ``ledger.num_finished() + len(in_flight)``. The last job runs to the end.

Accounting from the logs: a micro-batch a rank consumed counts if it lies below the position that rank resumed
from in the next job (else the trainer rolled it back). ``lost`` = prompts with fewer than ``group_size``
trajectories counted; ``duplicated`` = trajectories counted more than once plus prompts with more;
``reissue_mismatch`` = restores whose reissued prompts differ from the prompts started and not finished at the
cut (the job logs both around each checkpoint).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

from benchmarks.common.soak_processes import write_json_atomic

__all__ = ["run_soak_reshape", "job_main", "ranks_of"]

GROUP = 2


def ranks_of(ranks: int, inc: int) -> int:
    """The number of ranks of job ``inc``: ``ranks``, ``2 * ranks``, ``ranks + 1``, then again."""
    return (ranks, 2 * ranks, ranks + 1)[inc % 3]


def _traj(tid: str, prompt: int, nbytes: int) -> Any:
    import torch

    from knitdata import Trajectory

    return Trajectory(id=tid, source="math" if prompt % 2 == 0 else "code", group=f"p{prompt}",
                      prompt_ids=torch.tensor([prompt, 1]), response_ids=torch.arange(4 + prompt % 5),
                      scalars={"reward": float(prompt % 7)},
                      tensors={"pad": torch.full((nbytes,), prompt % 251, dtype=torch.uint8)})


def job_main(d: str, inc: int, prompts: int, ranks: int, nodes: int, consume_ms: float, ckpt_every_s: float,
             traj_bytes: int, rollout_ms: float) -> None:
    """One job (incarnation ``inc``): fresh (``inc == 0``) or restored from ``d/job.json``."""
    import torch

    from knitdata import BatchSpec, ConsumerLayout, Pipeline
    from knitdata.control.rankstates import MERGED_FORMAT

    torch.set_num_threads(1)
    log = open(os.path.join(d, f"log-{inc}.jsonl"), "a", buffering=1, encoding="utf-8")
    lock = threading.Lock()

    def emit(**ev: Any) -> None:
        with lock:
            log.write(json.dumps(ev) + "\n")

    layout = ConsumerLayout([f"n{r % nodes}" for r in range(ranks)])
    spec = BatchSpec({"math": 4, "code": 4}, num_minibatches=2, group_size=GROUP)
    job_path = os.path.join(d, "job.json")
    if inc == 0:
        pipe = Pipeline(spec, layout=layout, token_budget=64, capacity_bytes=64 << 20)
        states: list[Any] = [None] * ranks
        counts = [0] * ranks
        reissue: list[dict[str, Any]] = []
        nxt = 0
    else:
        with open(job_path, encoding="utf-8") as f:
            job = json.load(f)
        old = len(job["states"])
        # another number of ranks: the old ranks' states go to the restore, every new rank loads the merged one
        pipe = Pipeline.restore(job["ckpt"], layout=layout, capacity_bytes=64 << 20,
                                rank_states=job["states"] if old != ranks else None)
        rep = pipe.restore_report
        assert rep is not None
        if rep.merged_state is not None:
            states, counts = [rep.merged_state] * ranks, [0] * ranks
        else:
            states, counts = job["states"], job["counts"]
        reissue = rep.reissue
        nxt = pipe.ledger.num_finished() + len(pipe.ledger.in_flight())
        emit(ev="restored", counts=job["counts"], reissue=[r["prompt_id"] for r in reissue], next=nxt,
             ckpt=job["ckpt"], nodes=nodes, ranks=ranks, ranks_before=old, unit_map=rep.unit_map,
             replanned=None if rep.reshaped is None else rep.reshaped["replanned"])
    taken: list[Any] = list(states)
    taken_counts = list(counts)
    state_lock = threading.Lock()

    def producer() -> None:
        try:
            _producer()
        except BaseException as e:
            emit(ev="error", where="producer", error=repr(e)[:500])
            raise

    def _producer() -> None:
        try:
            for r in reissue:
                p = int(r["prompt_id"][1:])
                fresh = [_traj(f"p{p}-i{inc}-{k}", p, traj_bytes) for k in range(r["missing"])]
                if fresh:
                    pipe.put_many(fresh)
                emit(ev="put", ids=[t.id for t in fresh], prompt=p)
                pipe.ledger.finished(r["prompt_id"])
                emit(ev="fin", prompt=p)
            for p in range(nxt, prompts):
                emit(ev="start", prompt=p)
                pipe.ledger.started(f"p{p}")
                for k in range(GROUP):  # members finish one by one: a cut may find half a group
                    time.sleep(rollout_ms / GROUP / 1000)
                    t = _traj(f"p{p}-i{inc}-{k}", p, traj_bytes)
                    pipe.put(t)
                    emit(ev="put", ids=[t.id], prompt=p)
                pipe.ledger.finished(f"p{p}")
                emit(ev="fin", prompt=p)
        finally:
            pipe.close()

    def rank(r: int) -> None:
        try:
            _rank(r)
        except BaseException as e:
            emit(ev="error", where=f"rank {r}", error=repr(e)[:500])
            raise

    def _rank(r: int) -> None:
        ds = pipe.dataset(r, timeout=120)
        if states[r] is not None:
            ds.load_state_dict(states[r])
            if states[r].get("format") == MERGED_FORMAT:  # a state of this rank's own, to save until its first step
                with state_lock:
                    taken[r] = ds.state_dict()
        else:
            with state_lock:
                taken[r] = ds.state_dict()
        k = counts[r]
        for mb in ds:
            info = mb.info
            assert info is not None  # the default collate sets it
            emit(ev="mb", r=r, k=k, ids=list(info.trajectory_ids))
            k += 1
            time.sleep(consume_ms / 1000)
            if info.is_last:
                with state_lock:
                    taken[r] = ds.state_dict()
                    taken_counts[r] = k
        emit(ev="rank_done", r=r, k=k)

    stop = threading.Event()

    def checkpointer() -> None:
        seq = 0
        while not stop.wait(ckpt_every_s):
            seq += 1
            path = os.path.join(d, f"ckpt-{inc}-{seq}")
            with state_lock:  # the ranks' latest states, then the cut: nothing after them is released yet
                st, cn = list(taken), list(taken_counts)
                emit(ev="ckpt_begin", seq=seq)
                info = pipe.checkpoint(path)
            write_json_atomic(job_path, {"ckpt": path, "states": st, "counts": cn, "inc": inc, "seq": seq})
            emit(ev="ckpt", seq=seq, path=path, pause_ms=info.pause_ms, write_s=info.write_s,
                 trajectories=info.trajectories)

    ck = threading.Thread(target=checkpointer, daemon=True)
    ck.start()
    threads = [threading.Thread(target=producer, daemon=True)]
    threads += [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    ck.join()
    emit(ev="done")
    log.close()


def _read_log(d: str, inc: int) -> list[dict[str, Any]]:
    out = []
    try:
        with open(os.path.join(d, f"log-{inc}.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:  # the line the kill cut short
                    break
    except FileNotFoundError:
        pass
    return out


def run_soak_reshape(d: str, *, rounds: int = 4, prompts: int = 240, ranks: int = 2, consume_ms: float = 15.0,
                     rollout_ms: float = 12.0, ckpt_every_s: float = 0.4, traj_bytes: int = 4096, kill_after_s: tuple[float, float] = (0.0, 2.5),
                     seed: int = 0, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run a job ``rounds`` times killed at a random point and once to the end; account for every prompt.

    Returns:
        The result (JSON-serializable): ``lost``, ``duplicated``, ``reissued``, ``reissue_mismatch``, per-round
        details (kill time, checkpoint restored, nodes, pause of the checkpoints) and ``ok``.
    """
    rng = random.Random(seed)
    os.makedirs(d, exist_ok=True)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    rounds_out: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    inc = 0
    errors: list[str] = []
    while True:
        last = inc >= rounds
        nodes = 1 + (inc % 2)  # every other job restores onto another topology: one node, then two
        job_ranks = ranks_of(ranks, inc)  # and every job onto another number of ranks
        if inc > 0 and not os.path.exists(os.path.join(d, "job.json")):
            errors.append(f"round {inc}: the killed job wrote no checkpoint; start it again from scratch")
            break
        cmd = [sys.executable, "-m", "benchmarks.common.soak_reshape", "job", d, str(inc), str(prompts), str(job_ranks),
               str(nodes), str(consume_ms), str(ckpt_every_s), str(traj_bytes), str(rollout_ms)]
        p = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        t0 = time.perf_counter()
        killed = False
        try:
            if not last:  # kill at a random point after the job's first checkpoint of this round
                while p.poll() is None and not any(e["ev"] == "ckpt" for e in _read_log(d, inc)):
                    if time.perf_counter() - t0 > timeout_s:
                        raise subprocess.TimeoutExpired(cmd, timeout_s)
                    time.sleep(0.05)
                time.sleep(rng.uniform(*kill_after_s))
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    killed = True
            out, err = p.communicate(timeout=timeout_s)
            if not killed and p.returncode != 0:
                errors.append(f"round {inc}: job failed (rc {p.returncode}): {err[-2000:]}")
                break
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            errors.append(f"round {inc}: the job did not finish (or checkpoint) within {timeout_s} s")
            break
        ev = _read_log(d, inc)
        if killed and any(e["ev"] == "done" for e in ev):
            killed = False  # it had finished (killed while it exited): the run is complete
        ck = [e for e in ev if e["ev"] == "ckpt"]
        rounds_out.append({"round": inc, "nodes": nodes, "ranks": job_ranks, "killed": killed, "ran_s": time.perf_counter() - t0,
                           "checkpoints": len(ck), "pause_ms_max": max((e["pause_ms"] for e in ck), default=None),
                           "write_s_max": max((e["write_s"] for e in ck), default=None)})
        if not killed:  # the last round, or a job that finished before its kill
            break
        inc += 1
    return _account(d, inc, prompts, rounds_out, errors, time.perf_counter() - t_start, ranks=ranks, seed=seed,
                    consume_ms=consume_ms, rollout_ms=rollout_ms, ckpt_every_s=ckpt_every_s)


def _account(d: str, last: int, prompts: int, rounds: list[dict[str, Any]], errors: list[str], wall_s: float,
             **params: Any) -> dict[str, Any]:
    logs = [_read_log(d, i) for i in range(last + 1)]
    errors = errors + [f"job {i}, {e['where']}: {e['error']}" for i, ev in enumerate(logs) for e in ev
                       if e["ev"] == "error"]
    # where each rank resumed in job i + 1: the micro-batches of job i at or past it were rolled back
    resumed = [next((e["counts"] for e in logs[i + 1] if e["ev"] == "restored"), None) for i in range(last)]
    counted: Counter[str] = Counter()
    rolled_back = 0
    for i, ev in enumerate(logs):
        top = resumed[i] if i < last else None
        for e in ev:
            if e["ev"] != "mb":
                continue
            if top is not None and e["k"] >= top[e["r"]]:
                rolled_back += 1
                continue
            counted.update(e["ids"])
    per_prompt: Counter[int] = Counter()
    for tid in counted:
        per_prompt[int(tid.split("-")[0][1:])] += 1
    lost = sum(max(0, GROUP - per_prompt.get(p, 0)) for p in range(prompts))
    duplicated = sum(n - 1 for n in counted.values() if n > 1) + sum(max(0, n - GROUP) for n in per_prompt.values())
    # reissue check: what job i + 1 reissued == prompts started and not finished at the cut it restored
    restored = [None] + [next((e for e in logs[i] if e["ev"] == "restored"), None) for i in range(1, last + 1)]

    def cut(e: dict[str, Any]) -> tuple[int, int]:
        src, seq = e["ckpt"].rsplit("-", 2)[1:]
        return int(src), int(seq)

    def index(src: int, seq: int, kind: str) -> int:
        return next(k for k, e in enumerate(logs[src]) if e["ev"] == kind and e["seq"] == seq)

    def history(i: int, upto: int, kind: str) -> list[dict[str, Any]]:
        """The events that led to job ``i``'s event ``upto``: its restore chain cut at each checkpoint's ``kind``."""
        r = restored[i]
        if r is None:
            return logs[i][:upto]
        src, seq = cut(r)
        return history(src, index(src, seq, kind), kind) + logs[i][:upto]

    def in_flight(h: list[dict[str, Any]], fin_from: list[dict[str, Any]]) -> set[int]:
        started = {e["prompt"] for e in h if e["ev"] == "start"}
        started |= {int(p[1:]) for e in h if e["ev"] == "restored" for p in e["reissue"]}
        return started - {e["prompt"] for e in fin_from if e["ev"] == "fin"}

    mismatch = []
    reissued = 0
    for i in range(1, last + 1):
        r = restored[i]
        if r is None:
            continue
        src, seq = cut(r)
        lo = history(src, index(src, seq, "ckpt_begin"), "ckpt_begin")  # surely before the cut
        hi = history(src, index(src, seq, "ckpt"), "ckpt")  # up to the end of the checkpoint
        got = {int(p[1:]) for p in r["reissue"]}
        reissued += len(got)
        sure, maybe = in_flight(lo, hi), in_flight(hi, lo)
        if not (sure <= got <= maybe):
            mismatch.append({"round": i, "reissued": sorted(got), "sure": sorted(sure), "maybe": sorted(maybe)})
    pauses = [r["pause_ms_max"] for r in rounds if r["pause_ms_max"] is not None]
    return {
        "benchmark": "soak", "mode": "reshape", "engine": "embedded", "prompts": prompts, "group_size": GROUP,
        "jobs": len(rounds), "kills": sum(r["killed"] for r in rounds), "rounds": rounds,
        "restores_other_topology": sum(1 for r in rounds[1:] if r["nodes"] != rounds[r["round"] - 1]["nodes"]),
        "restores_other_ranks": sum(1 for r in rounds[1:] if r["ranks"] != rounds[r["round"] - 1]["ranks"]),
        "trajectories_counted": sum(counted.values()), "rolled_back_microbatches": rolled_back,
        "lost": lost, "duplicated": duplicated, "reissued": reissued, "reissue_mismatch": mismatch,
        "checkpoint_pause_ms_max": max(pauses, default=None), "wall_s": wall_s, "errors": errors,
        "params": params, "ok": not errors and lost == 0 and duplicated == 0 and not mismatch,
    }


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "job":
    a = sys.argv[2:]
    job_main(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), float(a[5]), float(a[6]), int(a[7]), float(a[8]))
