"""A model check of the control-plane protocol (issue 25.5): a hypothesis state machine drives one embedded
:class:`~knitdata.control.ControlPlane` (in this process, with a journal) through puts, hand-outs, commits, saved
states, crashes restored from the journal and its snapshot (the process dies; what it wrote stays: no fsync), rollbacks to a saved state, and reshapes onto other
numbers of ranks (of the live plane, and of a fresh plane refilled with the same puts). After every step it checks:

* exactly once: the micro-batches the consumers have taken (what a trainer keeps after its rollbacks) hold no
  trajectory twice, and none of them is still queued at or after a rank's position (it would come again);
* exact quotas: every admitted train batch holds exactly the batch spec's trajectories per source;

and at the end, after the stream is closed and drained, that every trajectory put was taken once or reported
dropped (an incomplete train batch at close).
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from knitdata import merge_rank_states
from knitdata.admission import BatchSpec
from knitdata.control import ControlPlane, fields_of
from knitdata.control.journal import Journal
from knitdata.errors import IncompleteStreamError
from knitdata.placement import ConsumerLayout

SPEC = BatchSpec({"a": 4, "b": 4}, num_minibatches=2, group_size=2)
UNITS = {"node0": "node0"}
RANKS = st.sampled_from([1, 2, 3, 4])


def _config(n: int) -> dict[str, Any]:
    return {"spec": SPEC.to_dict(), "layout": ConsumerLayout.single_node(n).to_dict(), "token_budget": 32}


class ControlPlaneMachine(RuleBasedStateMachine):
    """The model: the puts so far (in order), what the consumers took since the last saved states, the saved
    states and what had been taken when they were saved."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kd-sm-"))
        self.incarnation = 0
        self.puts: list[list[Any]] = []  # [meta, loss, token] in put order
        self.groups = 0
        self.taken: list[str] = []  # trajectory ids taken by the consumers, in order (after rollbacks)
        self.saved: dict[str, Any] | None = None  # {"states", "taken", "segment"}
        self.segment = 0  # bumped at each reshape: states of another segment need a reshape to load
        self.admitted: dict[int, Counter[str]] = {}

    # ------------------------------------------------------------------------------------ helpers
    def _new_plane(self, n: int) -> ControlPlane:
        self.incarnation += 1
        self.path = str(self.dir / f"p{self.incarnation}.journal")
        self.n = n
        self.plane = ControlPlane(_config(n), UNITS, lambda u, ids, wait: None, on_plan=self._on_plan,
                                  journal=Journal(self.path, compact_every=0, fsync_every_s=3600))
        return self.plane

    def _on_plan(self, mb: Any, plan: Any) -> None:
        self.admitted[mb.step] = Counter(t.source for t in mb.trajectories)

    def _states(self) -> list[dict[str, Any]]:
        p = self.plane
        out = []
        for r in range(self.n):
            pos = p.state.position[r]
            lh = p.reshaping.layout_history(r)
            fp = p.state.fp(r, pos)
            st_ = {"format": "knitdata.TrajectoryDataset", "version": 3, "pipeline": None, "rank": r,
                   "num_consumers": self.n, "worker": 0, "num_workers": 1, "next": pos, "minibatch": None,
                   "microbatch": None, "epoch": 0, "fingerprint": fp, "fingerprint_length": None if fp is None else pos,
                   "layout": lh["layout"]}
            if lh["history"] is not None:
                st_["layout_history"], st_["layout_remainder"] = lh["history"], lh["remainder"]
            out.append(st_)
        return out

    def _cap(self, r: int) -> int:
        """release="step" never releases past the last state taken (or loaded) of the rank."""
        if self.saved is None or self.saved["segment"] != self.segment:
            return 0
        return int(self.saved["states"][r]["next"])

    # ------------------------------------------------------------------------------------ rules
    @initialize(n=RANKS)
    def start(self, n: int) -> None:
        self._new_plane(n)

    @rule(sources=st.lists(st.sampled_from("ab"), min_size=1, max_size=8), lengths=st.integers(0, 1000))
    def put(self, sources: list[str], lengths: int) -> None:
        """Whole groups of two, one admit_many per group."""
        for s in sources:
            g = self.groups
            self.groups += 1
            items = []
            for k in range(2):
                i = 2 * g + k
                meta = {"id": f"t{i}", "source": s, "group": f"g{g}", "gen_version": 0,
                        "num_tokens": 4 + (i * 7 + lengths) % 28, "nbytes": 16, "fields": fields_of(["r"], {})}
                items.append([meta, 0, f"tok{i}"])
            ans = self.plane.admission.admit_many("node0", items)
            self.puts += [it for it, ok in zip(items, ans.accepted) if ok is not None]
            assert not ans.errors, ans.errors

    @rule(rank=st.integers(0, 7), count=st.integers(1, 6))
    def hand_out(self, rank: int, count: int) -> None:
        """A consumer takes its next micro-batches (and reports them, as its sender does)."""
        r = rank % self.n
        p = self.plane
        for _ in range(count):
            j = p.state.position[r]
            ans = p.leasing.next_entries(r, j, 0.0)
            if not ans.entries:
                return
            e = ans.entries[0]
            assert e.j == j
            self.taken += [x[0] for x in e.items]
            p.positions.handed_many(r, [[j, e.minibatch, e.microbatch, self._cap(r), -1]])

    @rule()
    def save(self) -> None:
        """Every rank saves its state (at once: the trainers agree on a step)."""
        self.saved = {"states": self._states(), "taken": list(self.taken), "segment": self.segment}

    @precondition(lambda self: self.saved is not None)
    @rule(rank=st.integers(0, 7))
    def commit(self, rank: int) -> None:
        """A rank commits its last saved state (no restore goes back before it)."""
        assert self.saved is not None
        r = rank % self.n
        if self.saved["segment"] == self.segment:
            self.plane.positions.commit(r, int(self.saved["states"][r]["next"]))

    @rule(compact=st.booleans())
    def crash_and_recover(self, compact: bool) -> None:
        """The plane's process dies; a new plane recovers from the journal (and its snapshot)."""
        if compact:
            self.plane.compact()
        cfg = _config(self.n) if self.plane.state.replay.segments is None else {**_config(1), "layout": self.plane.state.base_layout}
        plane = ControlPlane(cfg, UNITS, lambda u, ids, wait: None, on_plan=self._on_plan,
                             journal=Journal(self.path, compact_every=0, fsync_every_s=3600))
        plane.recover(self.path)
        assert list(plane.state.position) == list(self.plane.state.position)
        assert [sorted(q) for q in plane.state.queues] == [sorted(q) for q in self.plane.state.queues]
        self.plane = plane

    @precondition(lambda self: self.saved is not None)
    @rule()
    def rollback(self) -> None:
        """The trainers restore the last saved states (in this layout: seek; else a reshape onto this layout)."""
        assert self.saved is not None
        if self.saved["segment"] == self.segment:
            for r, s in enumerate(self.saved["states"]):
                if s["fingerprint"] is not None:
                    self.plane.positions.verify(r, s["fingerprint_length"], s["fingerprint"], "")
                self.plane.positions.seek(r, int(s["next"]))
                self.plane.state.position[r] = int(s["next"])
            self.taken = list(self.saved["taken"])
        else:
            self._reshape_fresh(self.n)

    @rule(n=RANKS)
    def reshape_live(self, n: int) -> None:
        """The ranks stop and save; the live plane continues on ``n`` ranks."""
        self.save()
        assert self.saved is not None
        merged = merge_rank_states(self.saved["states"])
        self.plane.reshaping.reshape(merged, ConsumerLayout.single_node(n).to_dict())
        self.n = n
        self.segment += 1
        self.saved = {"states": self._states(), "taken": list(self.taken), "segment": self.segment}

    @precondition(lambda self: self.saved is not None)
    @rule(n=RANKS)
    def reshape_fresh(self, n: int) -> None:
        """A new job on ``n`` ranks: a fresh plane loads the merged last states, then the same puts again."""
        self._reshape_fresh(n)

    def _reshape_fresh(self, n: int) -> None:
        assert self.saved is not None
        merged = merge_rank_states(self.saved["states"])
        plane = self._new_plane(n)
        plane.reshaping.reshape(merged)
        for k in range(0, len(self.puts), 2):
            ans = plane.admission.admit_many("node0", [[m, loss, f"again{self.incarnation}-{tok}"]
                                             for m, loss, tok in self.puts[k:k + 2]])
            assert not ans.errors, ans.errors
        self.taken = list(self.saved["taken"])
        self.segment += 1
        self.saved = {"states": self._states(), "taken": list(self.taken), "segment": self.segment}

    # ------------------------------------------------------------------------------------ invariants
    @invariant()
    def exactly_once(self) -> None:
        if not hasattr(self, "plane"):
            return
        assert self.plane.state.error is None, f"the plane stopped: {self.plane.state.error}"
        dup = [i for i, c in Counter(self.taken).items() if c > 1]
        assert not dup, f"taken twice: {dup}"
        taken = set(self.taken)
        for r, q in enumerate(self.plane.state.queues):
            for j, e in q.items():
                if j >= self.plane.state.position[r]:
                    again = [x[0] for x in e.items if x[0] in taken]
                    assert not again, f"rank {r} entry {j} would deliver {again} again"

    @invariant()
    def exact_quotas(self) -> None:
        by_batch: dict[int, Counter[str]] = {}
        for step, c in self.admitted.items():
            by_batch.setdefault(step // SPEC.num_minibatches, Counter()).update(c)
        for b, c in by_batch.items():
            steps = [s for s in self.admitted if s // SPEC.num_minibatches == b]
            if len(steps) == SPEC.num_minibatches:
                assert dict(c) == dict(SPEC.quotas), f"train batch {b}: {dict(c)}"
            else:
                assert all(c[s] <= q for s, q in SPEC.quotas.items()), f"train batch {b}: {dict(c)}"

    def teardown(self) -> None:
        try:
            if hasattr(self, "plane"):
                rep = self.plane.admission.close()
                for r in range(self.n):
                    while True:
                        try:
                            ans = self.plane.leasing.next_entries(r, self.plane.state.position[r], 0.0)
                        except IncompleteStreamError:  # drained; the close report names what was dropped
                            break
                        if not ans.entries:
                            break
                        e = ans.entries[0]
                        self.taken += [x[0] for x in e.items]
                        self.plane.positions.handed_many(r, [[e.j, e.minibatch, e.microbatch, 0, -1]])
                dropped = {m.id for m in self.plane.state.pending.values()}
                assert rep["dropped_trajectories"] == len(dropped)
                assert len(self.taken) == len(set(self.taken)), "a trajectory was taken twice"
                assert set(self.taken) | dropped == {m["id"] for m, _l, _t in self.puts}, "a trajectory was lost"
                assert not set(self.taken) & dropped
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


_SHORT = settings(max_examples=20, stateful_step_count=30, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
_LONG = settings(max_examples=300, stateful_step_count=50, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestControlPlaneProtocol = ControlPlaneMachine.TestCase
TestControlPlaneProtocol.settings = _SHORT


class _Long(ControlPlaneMachine):
    pass


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_control_plane_protocol_long() -> None:
    """The same machine, many more and longer runs (``make test-slow``)."""
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(_Long, settings=_LONG)
