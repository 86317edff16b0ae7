"""SharedEncoding under DDP and FSDP2 with two gloo ranks on 127.0.0.1 (one spawn, hard timeout).

Each rank computes the naive duplicated gradients of its own micro-batches with plain copies of the modules,
averages them over the ranks by hand (what DDP/FSDP do) and compares with the gradients the wrapped modules
got through SharedEncoding. Rank 1's mini-batch has no media in the ``*_nomedia`` scenarios (dummy encode).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _multimodal_helpers import SCENARIOS, dist_worker  # noqa: E402

TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("dist")
    ctx = mp.start_processes(dist_worker, args=(2, _free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"distributed SharedEncoding run did not finish within {TIMEOUT_S}s (hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("name", [s[0] for s in SCENARIOS])
def test_distributed_gradients_equal_naive(dist_results, name):
    for rank, res in enumerate(dist_results):
        assert name in res, f"rank {rank} did not reach {name}: {res}"
        r = res[name]
        assert "error" not in r, r.get("error")
        assert r["rel_err"] < 1e-10, (rank, r)
        assert r["same_on_ranks"], (rank, r)
        assert r["encoder_grad_max"] > 0, (rank, r)
