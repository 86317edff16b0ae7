"""How this folder was written: with knitdata at commit 946d369 first on the path (``git archive 946d369 knitdata |
tar -x -C /tmp/kd-main``, then ``PYTHONPATH=/tmp/kd-main python make_fixture.py <this folder>``). Not run by the
tests: they read what it wrote (tests/test_journal.py, the compatibility tests)."""

import json
import os
import sys

from knitdata.admission import BatchSpec
from knitdata.control import ControlPlane
from knitdata.control.journal import Journal
from knitdata.placement import ConsumerLayout


def main(out: str) -> None:
    spec = BatchSpec({"a": 4, "b": 4}, num_minibatches=2, group_size=2)
    cfg = {"spec": spec.to_dict(), "layout": ConsumerLayout.uniform(2, 1).to_dict(), "token_budget": 40}
    path = os.path.join(out, "run.journal")
    for f in (path, path + ".snapshot"):
        if os.path.exists(f):
            os.remove(f)
    plane = ControlPlane(cfg, {"node0": "node0", "node1": "node1"}, lambda u, ids, w: None,
                         journal=Journal(path, compact_every=0, fsync_every_s=0))

    def meta(i: int) -> dict:
        g = i // 2
        return {"id": f"t{i}", "source": "ab"[g % 2], "group": f"g{g}", "gen_version": i % 3,
                "num_tokens": 12 + i % 5, "nbytes": 100 + 7 * (i % 11), "fields": {"scalars": ["r"], "tensors": {}}}

    def puts(lo: int, hi: int) -> None:
        for i in range(lo, hi, 2):
            plane.admit_many(f"node{i // 2 % 2}", [[meta(i), 4 + i % 3, f"token-{i}"],
                                                   [meta(i + 1), 5, f"token-{i + 1}"]])

    def consume() -> None:
        for rank in range(2):
            got = plane.next_entries(rank, plane.start_position(rank), 0.0)
            for e in got.get("entries", []):
                plane.handed(rank, e["j"], e["minibatch"], e["microbatch"])

    puts(0, 16)
    plane.withdraw("g20")
    consume()
    plane.report_version(1)
    plane.commit(0, plane.position[0])
    plane.compact()  # the snapshot, and segment 1 of the journal
    puts(16, 30)
    consume()
    plane.seek(1, plane.position[1])
    plane.set_in_flight({"a": 2, "b": 2})
    plane.report_version(2)
    with open(os.path.join(out, "state.json"), "w") as f:
        json.dump(plane.snapshot(), f, sort_keys=True)  # the name of state_dict() at 946d369


if __name__ == "__main__":
    main(sys.argv[1])
