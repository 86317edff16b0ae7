"""TrajectoryDataset (embedded engine) under the shared save/load check (tests/_state_harness.py).

Through the public API only, as a restarted trainer does it: a fresh pipeline fed the same puts, a fresh
dataset (alone or inside torchdata's ``StatefulDataLoader``), ``load_state_dict`` of the JSON state taken
after any micro-batch; what follows must be the rest of the uninterrupted run.
"""

from __future__ import annotations

import os
import random
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knitdata.pipeline import Pipeline
from knitdata.placement import ConsumerLayout

sys.path.insert(0, os.path.dirname(__file__))
from _ondemand_helpers import make_workload, micro_key, stateful_loader  # noqa: E402
from _state_harness import run_test_save_load_state  # noqa: E402


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), fetch=st.sampled_from(["sample", "eager", "iter"]), rank=st.integers(0, 2),
       use_loader=st.booleans(), data=st.data())
def test_trajectory_dataset_state_harness(seed, fetch, rank, use_loader, data):
    w = make_workload(random.Random(seed), num_sources=2, group_size=1, num_minibatches=3,
                      groups_per_minibatch_per_source=2, train_batches=1)

    def make():
        pipe = Pipeline(w.spec, layout=ConsumerLayout.uniform(num_nodes=3, ranks_per_node=1), token_budget=8)
        for t in w.trajs:
            pipe.put(t)
        pipe.close()
        ds = pipe.dataset(rank, fetch=fetch)
        return stateful_loader(ds) if use_loader else ds

    probe = make()
    n = len(list(probe))
    getattr(probe, "dataset", probe).close()
    mids = data.draw(st.lists(st.integers(0, n), min_size=1, max_size=3, unique=True))
    ref = run_test_save_load_state(make, mids, key=lambda mb: (micro_key(mb), mb.input_ids.tolist()),
                                   reads_back=not use_loader)
    assert len(ref[0]) == n
