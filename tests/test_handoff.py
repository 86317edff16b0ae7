"""knitdata.consumer.handoff: where a relayed report is made (inline for a control plane in this process, else by the
sender's thread) and that a report that fails inline loses nothing."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest

from knitdata.consumer.handoff import ControlSender
from knitdata.control.records import LeaseGrant, PlanEntry
from knitdata.planner import MicroBatchInfo

sys.path.insert(0, os.path.dirname(__file__))
from _reliability_helpers import wait_until  # noqa: E402


class FakeControl:
    """The control calls a :class:`ControlSender` makes, recording each report's records and calling thread."""

    def __init__(self, fail_first: int = 0) -> None:
        self.reports: list[tuple[int, list[list[int]]]] = []  # (thread ident, records of rank 0)
        self.fail_first = fail_first
        self.lock = threading.Lock()

    def lease(self, rank: int, worker: int, token: str, wait_s: float, holder: str, *more: Any) -> LeaseGrant:
        return LeaseGrant(1, 3.0, 0, None)

    def report(self, leases: list[list[Any]], commits: list[list[int]], version: int | None,
               producers: list[list[Any]]) -> dict[str, Any]:
        with self.lock:
            if self.fail_first > 0:
                self.fail_first -= 1
                raise ConnectionError("control plane unreachable (test)")
            recs = [r for lease in leases for r in lease[3]]
            if recs:
                self.reports.append((threading.get_ident(), recs))
        return {"fenced": []}

    def records(self) -> list[list[int]]:
        with self.lock:
            return [r for _t, recs in self.reports for r in recs]


def _hand_out(sender: ControlSender, n: int) -> Any:
    """A lease of rank 0 that hands out ``n`` micro-batches of one mini-batch, then asks for a report."""
    lease, _ = sender.acquire(0, 0, "tok", wait_s=1.0)
    for j in range(n):
        lease.take_out(_entry(j, 0, j), time.perf_counter())
    sender.request()
    return lease


def test_an_inline_sender_makes_the_relayed_report_on_the_calling_thread():
    control = FakeControl()
    sender = ControlSender(control, heartbeat_s=30.0, inline=True)
    lease = _hand_out(sender, 3)
    assert sender.due
    sender.relay()
    assert not sender.due
    assert [(t, [r[0] for r in recs]) for t, recs in control.reports] == [(threading.get_ident(), [0, 1, 2])]
    lease.end()  # the lease goes (the idle sender thread ends by itself)


@pytest.mark.parametrize("inline", [False, True])
def test_a_relay_that_must_not_report_on_this_thread_wakes_the_sender(inline):
    """Without ``inline`` (a control plane elsewhere), or when the caller asks for a wake only (the trainer about to
    wait for data), the sender's thread makes the report."""
    control = FakeControl()
    sender = ControlSender(control, heartbeat_s=30.0, inline=inline)
    lease = _hand_out(sender, 2)
    sender.relay(inline=False) if inline else sender.relay()
    wait_until(lambda: len(control.records()) == 2, what="the sender thread's report")
    assert all(t != threading.get_ident() for t, _recs in control.reports)
    lease.end()


def test_a_report_that_fails_inline_is_sent_again_by_the_thread_in_order():
    control = FakeControl(fail_first=1)
    sender = ControlSender(control, heartbeat_s=30.0, inline=True)
    lease = _hand_out(sender, 4)
    sender.relay()  # fails here: no error on the producing thread, the records queued again
    wait_until(lambda: len(control.records()) == 4, what="the report sent again by the sender thread")
    assert [r[0] for r in control.records()] == [0, 1, 2, 3]  # each once, in hand-out order
    assert all(t != threading.get_ident() for t, _recs in control.reports)
    lease.end()


def _entry(j: int, minibatch: int, microbatch: int) -> PlanEntry:
    info = MicroBatchInfo(0, 0, minibatch, 0, microbatch, microbatch + 1, True, 0, 0)
    return PlanEntry(j, minibatch, microbatch, info)


@pytest.mark.parametrize("mode", ["auto_step", "send_each", "neither"])
def test_the_relay_derives_from_the_hand_outs_whether_a_report_is_due(mode):
    """The trainer's thread only appends; the relay (the stage that prepares the next micro-batch) finds whether a
    hand-out frees storage: with ``auto_step`` a mini-batch's first, with ``send_each`` any, else none."""
    control = FakeControl()
    sender = ControlSender(control, heartbeat_s=30.0, inline=True)
    lease, _ = sender.acquire(0, 0, "tok", wait_s=1.0)
    lease.auto_step = mode == "auto_step"
    lease.send_each = mode == "send_each"
    sent = []
    for j, (mb, mbi) in enumerate([(0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]):
        lease.hand_out(_entry(j, mb, mbi))
        assert not sender.due  # a hand-out alone asks for nothing
        lease.relay()
        sent.append(len(control.records()))
    if mode == "auto_step":  # nothing until the next mini-batch's first micro-batch, then everything so far
        assert sent == [0, 0, 0, 4, 4]
    elif mode == "send_each":
        assert sent == [1, 2, 3, 4, 5]
    else:
        assert sent == [0, 0, 0, 0, 0]
    lease.relay()  # nothing new: no second report
    assert len(control.reports) == {"auto_step": 1, "send_each": 5, "neither": 0}[mode]
    lease.end()
    assert [r[0] for r in control.records()] == [0, 1, 2, 3, 4]  # each once, in order


def test_the_position_counts_hand_outs_not_yet_reported():
    control = FakeControl()
    sender = ControlSender(control, heartbeat_s=30.0, inline=True)
    lease, _ = sender.acquire(0, 0, "tok", wait_s=1.0)
    assert lease.position() == (None, 0) and lease.taken == 0 and lease.last is None
    entries = [_entry(j, 0, j) for j in range(3)]
    for e in entries:
        lease.hand_out(e)
    assert lease.taken == 3 and lease.last is entries[-1]
    assert control.records() == []  # read without a report
    lease.hand_out(_entry(3, 1, 0))
    assert lease.position() == (_entry(3, 1, 0), 4)
    lease.end()
    assert [r[0] for r in control.records()] == [0, 1, 2, 3]


def test_reading_the_position_between_a_hand_out_and_the_relay_changes_nothing_sent():
    """``state_dict()`` reads the position between a hand-out and the next relay: it counts, makes no records, and
    the relay still finds the hand-out that frees storage."""
    control = FakeControl()
    sender = ControlSender(control, heartbeat_s=30.0, inline=True)
    lease, _ = sender.acquire(0, 0, "tok", wait_s=1.0)
    lease.auto_step = True
    lease.hand_out(_entry(0, 0, 0))
    assert lease.taken == 1 and lease.pending == 1 and control.records() == []  # counted, not sent
    lease.relay()
    assert [r[0] for r in control.records()] == [0]
    assert lease.taken == 1
    lease.end()


def test_auto_commit_bounds_follow_the_cap_in_force_at_each_hand_out():
    control = FakeControl()
    sender = ControlSender(control, heartbeat_s=30.0, inline=True)
    lease, _ = sender.acquire(0, 0, "tok", wait_s=1.0)
    lease.auto_step = True
    lease.hand_out(_entry(0, 0, 0))  # no state taken: up to itself
    lease.set_cap(1)  # a state at 1: later hand-outs auto-commit up to 1 at most
    lease.hand_out(_entry(1, 0, 1))
    lease.hand_out(_entry(2, 0, 2))
    lease.set_cap(2)
    lease.hand_out(_entry(3, 1, 0))
    lease.end()
    assert [(r[0], r[3]) for r in control.records()] == [(0, 0), (1, 1), (2, 1), (3, 2)]


def test_a_fenced_lease_refuses_the_next_hand_out():
    from knitdata.errors import FencedError

    control = FakeControl()
    sender = ControlSender(control, heartbeat_s=30.0, inline=True)
    lease, _ = sender.acquire(0, 0, "tok", wait_s=1.0)
    lease.take_out(_entry(0, 0, 0), time.perf_counter())
    assert lease.deadline > time.perf_counter()  # the trainer's check passes: a plain append
    lease.fence("host:1234:newer")
    assert lease.deadline == float("-inf")
    with pytest.raises(FencedError, match="rank 0"):
        lease.take_out(_entry(1, 0, 1), time.perf_counter())
    assert lease.taken == 1  # nothing handed out past the fence
    lease.end()


def test_the_relay_reads_hand_outs_while_the_trainer_appends():
    """The trainer appends without a lock while the producing stage relays and the position is read: nothing
    raises, and each hand-out is reported once, in order."""
    control = FakeControl()
    sender = ControlSender(control, heartbeat_s=30.0, inline=True)
    lease, _ = sender.acquire(0, 0, "tok", wait_s=1.0)
    lease.send_each = True
    n = 20_000
    done = threading.Event()

    def trainer() -> None:
        for j in range(n):
            lease.hand_out(_entry(j, j // 4, j % 4))
        done.set()

    t = threading.Thread(target=trainer)
    t.start()
    while not done.is_set():
        lease.relay()
        lease.position()
    t.join()
    lease.relay()
    lease.end()
    assert [r[0] for r in control.records()] == list(range(n))
