"""KnitdataSampler on a real TransferQueue (tests/test_integrations_verl.py, slow): ``python tests/_verl_real_tq.py``.

Starts Ray on loopback (8 logical CPUs: TransferQueue's actors hang on fewer) and ``tq.init()``, writes what verl
0.9.1's trainer and agent loop write (prompt keys tagged pending with their global step, ``rollout.n`` trajectories
per prompt via ``kv_batch_put`` with ``list_of_dict_to_tensordict`` fields, the status tag moved by ``kv_put``), and
runs the sampler for three global steps of two mini-batches: a stale group, a failed group and a refill on the way.
Prints one JSON line: the sources of each delivered mini-batch, the metrics, and what is left in the store.
"""

from __future__ import annotations

import json
import os
import time

import torch

SOURCES = {"math": 3, "code": 1}  # prompt groups per train batch; the dataloader below repeats this mix


def main() -> None:
    t0 = time.perf_counter()
    os.environ["TQ_NUM_THREADS"] = "1"
    import ray

    ray.init(address="local", num_cpus=8, object_store_memory=128 << 20, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, logging_level="ERROR")
    import transfer_queue as tq
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from knitdata.integrations.verl import KnitdataSampler

    tq.init({"controller": {"polling_mode": True}, "backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    startup = time.perf_counter() - t0
    mix = [s for s, n in SOURCES.items() for _ in range(n)]
    source: dict[str, str] = {}
    state = {"next": 0, "g": 1}

    def dispatch(n: int) -> list[str]:
        uids = [f"p{state['next'] + i:04d}" for i in range(n)]
        state["next"] += n
        for u in uids:
            source[u] = mix[int(u[1:]) % len(mix)]
        tags = [{"is_prompt": True, "status": "pending", "global_steps": state["g"]} for _ in uids]
        tq.kv_batch_put(keys=uids, partition_id="train", tags=tags)
        return uids

    def finish(uid: str, status: str = "finished") -> None:
        tq.kv_put(key=uid, partition_id="train", tag={"status": "running"})
        keys = [f"{uid}_{i}_0" for i in range(2)]
        fields = [{"data_source": source[uid], "prompts": torch.arange(3), "responses": torch.arange(5)} for _ in keys]
        tags = [{"status": "success", "prompt_len": 3, "response_len": 5, "seq_len": 8, "global_steps": state["g"],
                 "min_global_steps": state["g"], "max_global_steps": state["g"]} for _ in keys]
        tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields), tags=tags)
        tq.kv_put(key=uid, partition_id="train", tag={"status": status})

    refills: list[int] = []

    def refill(n: int) -> int:
        refills.append(n)
        uids = dispatch(n)
        for u in uids:
            finish(u)
        return n

    sampler = KnitdataSampler("separate_async", {"parameter_sync_step": 2}, 1, "drop",
                              {"quotas": SOURCES, "poll_interval": 0.05, "timeout_s": 60, "refill_multiple": 1},
                              refill_fn=refill)
    steps: list[list[list[str]]] = []
    metrics: list[dict] = []
    extra = dispatch(1)  # a group of step 1 that finishes only in step 2: past the bound (T = 1)
    for g in (1, 2, 3):
        state["g"] = g
        uids = dispatch(len(mix))
        if g == 2:
            finish(extra[0])
            finish(uids[0], "failure")
            uids = uids[1:]
        for u in uids:
            finish(u)
        step = []
        for _ in range(2):
            batch, m = sampler.sample(g, "train", 2)
            assert type(batch).__name__ == "KVBatchMeta" and batch.partition_id == "train"
            groups = list(dict.fromkeys(k.split("_")[0] for k in batch.keys))
            got = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["data_source"])
            assert list(got["data_source"]) == [source[k.split("_")[0]] for k in batch.keys]
            step.append([source[u] for u in groups])
            metrics.append({k: v for k, v in m.items() if isinstance(v, (int, float))})
            tq.kv_clear(keys=batch.keys, partition_id="train")  # the trainer, after the step
        steps.append(step)
    left = sorted(tq.kv_list("train").get("train", {}))
    tq.close()
    ray.shutdown()
    print(json.dumps({"steps": steps, "metrics": metrics, "refills": refills, "left": left,
                      "startup_s": round(startup, 2), "total_s": round(time.perf_counter() - t0, 2)}), flush=True)


if __name__ == "__main__":
    main()
