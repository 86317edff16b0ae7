"""benchmarks/common/floor.py: the floor of ``bench transfer`` (no data system) delivers each trajectory once, in the
rank's order, with the shape the other sources give the trainer."""

from __future__ import annotations

import pytest

from benchmarks.common import models, workload
from benchmarks.common.floor import FloorSource, floor_ids
from knitdata.errors import EngineError

W = workload.TransferWorkload(group_size=2, prompt_tokens=8, response_tokens=8, image_shape=(3, 28, 28),
                              num_consumers=2, microbatch_size=2, microbatches_per_step=2, warmup_steps=1, steps=2)
CFG = models.SMOKE_VLM


@pytest.mark.parametrize("encoding", ["dup", "shared"])
def test_every_trajectory_once_in_rank_order(encoding):
    got: list[str] = []
    for rank in range(W.num_consumers):
        src = FloorSource(rank, W, CFG, encoding)
        try:
            mine: list[str] = []
            for i in range(W.total_steps * W.microbatches_per_step):
                item = src.fetch()
                assert item.index == i % W.microbatches_per_step and item.is_last == (item.index == 1)
                assert item.input_ids.shape == (W.microbatch_size, W.prompt_tokens + W.response_tokens)
                assert (item.inputs is not None) == (encoding == "dup") and (item.media is not None) == (encoding == "shared")
                assert item.nbytes > 0
                mine += item.ids
                if item.is_last:
                    state = src.state()
                    assert state == {"taken": i + 1, "step": (i + 1) // W.microbatches_per_step}
                    src.commit(state)
            # the rank's groups of each step, in order (each group's trajectories together)
            per_rank = W.per_consumer_step // W.group_size
            want = [workload.group_id(s, g) for s in range(W.total_steps)
                    for g in range(rank * per_rank, (rank + 1) * per_rank)]
            assert [i.rsplit("t", 1)[0] for i in mine[::W.group_size]] == want
            got += mine
        finally:
            src.close()
    assert sorted(got) == sorted(floor_ids(W)) and len(set(got)) == len(got)


def test_a_stopped_thread_is_an_error_not_a_hang():
    src = FloorSource(0, W, CFG, "dup")
    try:
        src.fetch()
        src.close()  # the thread stops: the next wait for a micro-batch says so instead of waiting forever
        src.items.clear()
        src.timeout_s = 0.5
        with pytest.raises(EngineError, match="delivered nothing"):
            src.fetch()
    finally:
        src.close()
