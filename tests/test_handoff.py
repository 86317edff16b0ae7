"""knitdata.handoff: where a relayed report is made (inline for a control plane in this process, else by the
sender's thread) and that a report that fails inline loses nothing."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest

from knitdata.handoff import ControlSender

sys.path.insert(0, os.path.dirname(__file__))
from _reliability_helpers import wait_until  # noqa: E402


class FakeControl:
    """The control calls a :class:`ControlSender` makes, recording each report's records and calling thread."""

    def __init__(self, fail_first: int = 0) -> None:
        self.reports: list[tuple[int, list[list[int]]]] = []  # (thread ident, records of rank 0)
        self.fail_first = fail_first
        self.lock = threading.Lock()

    def lease(self, rank: int, worker: int, token: str, wait_s: float, holder: str, *more: Any) -> dict[str, Any]:
        return {"epoch": 1, "ttl_s": 3.0, "next": 0, "fp": None}

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
        lease.take_out({"j": j, "minibatch": 0, "microbatch": j}, time.perf_counter())
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
