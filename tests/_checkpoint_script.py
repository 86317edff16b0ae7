"""A user's job on the embedded engine, checkpointed by one process and restored by another (tests/test_checkpoint.py).

``python tests/_checkpoint_script.py save DIR``: a producer puts prompts (groups of 2) reporting them to the
rollout ledger, two rank threads consume two mini-batches, save their states (JSON) and consume a little more
(rolled back later); three prompts are left in flight (one half put, one not put, one put but not reported
finished); then ``pipe.checkpoint(DIR/ckpt)`` and the process exits without closing anything.

``python tests/_checkpoint_script.py restore DIR``: ``Pipeline.restore(DIR/ckpt)``, the producer reissues what the
restore report says and puts the remaining prompts, the ranks load their states and consume to the end. Each
command prints one JSON line.

``save DIR RANKS stagger`` saves with ``RANKS`` ranks, the odd ones saving their states one mini-batch later than
the even ones (a mini-batch some ranks had started at the states); ``restore DIR RANKS`` restores onto ``RANKS``
ranks on one node, passing the old ranks' states (``rank_states=``) when their number differs, and every new rank
loads ``restore_report.merged_state``.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch

from knitdata import BatchSpec, ConsumerLayout, Pipeline, Trajectory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ckpt_helpers import reissue_missing  # noqa: E402

PROMPTS = 24  # 6 train batches of 4 groups (2 math, 2 code) of 2
DONE = 12  # prompts put and finished before the checkpoint
RANKS = 2


def traj(tid: str, prompt: int) -> Trajectory:
    g = torch.Generator().manual_seed(abs(hash(tid)) % (1 << 31))
    return Trajectory(id=tid, source="math" if prompt % 2 == 0 else "code", group=f"p{prompt}",
                      prompt_ids=torch.randint(0, 100, (4,), generator=g),
                      response_ids=torch.randint(0, 100, (4 + prompt % 5,), generator=g), scalars={"reward": 1.0})


def save(d: str, ranks: int = RANKS, stagger: bool = False) -> None:
    pipe = Pipeline(BatchSpec({"math": 4, "code": 4}, num_minibatches=2, group_size=2), num_consumers=ranks,
                    token_budget=64)
    put: list[str] = []
    for p in range(DONE):
        pipe.ledger.started(f"p{p}")
        pipe.put_many([traj(f"p{p}-{k}", p) for k in range(2)])
        put += [f"p{p}-{k}" for k in range(2)]
        pipe.ledger.finished(f"p{p}")
    pipe.ledger.started([f"p{DONE}", f"p{DONE + 1}", f"p{DONE + 2}"])
    pipe.put(traj(f"p{DONE}-0", DONE))  # half of a group
    pipe.put_many([traj(f"p{DONE + 2}-{k}", DONE + 2) for k in range(2)])  # whole, not reported finished
    put += [f"p{DONE}-0", f"p{DONE + 2}-0", f"p{DONE + 2}-1"]
    states: dict[int, dict] = {}
    before: dict[int, list[str]] = {}

    def rank(r: int) -> None:
        ds = pipe.dataset(r, timeout=30)
        seen: list[str] = []
        after = 0
        for mb in ds:
            if r in states:
                after += 1  # consumed after the saved state: rolled back by the restore
                if after == 2:
                    break
                continue
            seen += mb.info.trajectory_ids
            if mb.info.is_last and mb.info.minibatch == 1 + (r % 2 if stagger else 0):
                states[r] = ds.state_dict()
                before[r] = list(seen)
        ds.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = pipe.checkpoint(os.path.join(d, "ckpt"))
    with open(os.path.join(d, "job.json"), "w") as f:
        json.dump({"states": {str(r): s for r, s in states.items()}, "before": {str(r): b for r, b in before.items()},
                   "put": put}, f)
    print(json.dumps({"info": info.to_dict(), "in_flight": pipe.ledger.in_flight()}), flush=True)
    os._exit(0)  # no close, no shutdown: the job is gone


def restore(d: str, ranks: int | None = None) -> None:
    with open(os.path.join(d, "job.json")) as f:
        job = json.load(f)
    old = len(job["states"])
    ranks = old if ranks is None else ranks
    if ranks == old:
        pipe = Pipeline.restore(os.path.join(d, "ckpt"))
    else:  # the states of every old rank (read back from the job's checkpoint) let the new ranks continue
        pipe = Pipeline.restore(os.path.join(d, "ckpt"), layout=ConsumerLayout.single_node(ranks),
                                rank_states=[job["states"][str(r)] for r in range(old)])
    report = pipe.restore_report
    assert report is not None
    put: list[str] = []

    def producer() -> None:
        try:
            reissue_missing(pipe, traj, put)
            for p in range(DONE + 3, PROMPTS):
                pipe.ledger.started(f"p{p}")
                pipe.put_many([traj(f"p{p}-{k}", p) for k in range(2)])
                put.extend(f"p{p}-{k}" for k in range(2))
                pipe.ledger.finished(f"p{p}")
        finally:
            pipe.close()

    got: dict[int, list[str]] = {}

    def rank(r: int) -> None:
        ds = pipe.dataset(r, timeout=30)
        ds.load_state_dict(report.merged_state if report.merged_state is not None else job["states"][str(r)])
        got[r] = [t for mb in ds for t in mb.info.trajectory_ids]

    threads = [threading.Thread(target=producer)] + [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"report": report.to_dict(), "after": {str(r): g for r, g in got.items()}, "put": put,
                      "in_flight": pipe.ledger.in_flight()}), flush=True)
    # ends like a user's script, without pipe.shutdown(): knitdata.threads.stop_all (atexit) must stop the control
    # sender before finalization (it used to abort here: "terminate called without an active exception")


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2], *(int(sys.argv[3]), sys.argv[4:] == ["stagger"]) if len(sys.argv) > 3 else ())
    else:
        restore(sys.argv[2], *(int(x) for x in sys.argv[3:4]))
