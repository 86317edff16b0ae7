"""Leases and fencing: one live iterator per (rank, worker), the entries it may take, and its process's reports.

With tensor/pipeline-parallel replicas (:meth:`~knitdata.control.positions.Positions.register_replicas`) the lease
is per (rank, replica, worker): the replicas of a rank each take all of its entries, and a newer iterator of one
replica fences only the older iterator of that replica.

A newer iterator of a rank asks the older one to let go (:meth:`Leases.lease`); the older one sees it in its next
report (:meth:`Leases.report`) and stops, or its lease expires :data:`~knitdata.control.state.LEASE_TTL_S` after
its last renewal. Its later calls raise :class:`~knitdata.errors.FencedError`. Leases are not journaled: after a
restart, the first call of a live iterator holds its lease again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from knitdata.control.positions import Positions
from knitdata.control.records import ConsumerId, Fenced, LeaseGrant, LeaseNews, NextEntries, PlanEntry, ProducerNews
from knitdata.control.reporting import incomplete_message, producers_gone
from knitdata.control.state import LEASE_TTL_S, Lease, PlaneState, fenced_message
from knitdata.control.surface import Part, control_call, control_part
from knitdata.errors import EngineError, FencedError, IncompleteStreamError, StateError

__all__ = ["Leases"]

_END = NextEntries(end=True)  # closed and drained
_WAIT = NextEntries()  # nothing within the wait


def _short_refill(s: PlaneState, rank: int) -> str | None:
    """The message when the closed stream planned fewer micro-batches of ``rank`` than the position of the state it
    loaded (a new job refilled with fewer puts than the run that saved it, or closed early), else ``None``."""
    pending = s.replay.verify_at[rank]
    saved = max(s.committed[rank], 0 if pending is None else pending[0])
    if saved <= s.planned[rank]:
        return None
    where = f" ({pending[2]})" if pending is not None and pending[2] else ""
    return (f"rank {rank}: the stream ended after {s.planned[rank]} micro-batches of this rank, before the position "
            f"{saved} of the state it loaded{where}: the refill put fewer trajectories than the run that saved the "
            "state (or closed early), so the micro-batches after it cannot be told apart from others. Put the same "
            "trajectories in the same order as that run, or start without loading the state")


@control_part("leasing")
class Leases(Part):
    """The consumer side of one plane: leases, the entries a rank's iterator takes, and consumer reports.

    Args:
        s: The plane's shared state.
        positions: The plane's positions (a report applies hand-outs, commits and the version there).
    """

    def __init__(self, s: PlaneState, positions: Positions) -> None:
        super().__init__(s)
        self.positions = positions

    @control_call(waits="wait_s")
    def lease(self, rank: int, worker: int, token: str, wait_s: float = 0.0, holder: str = "",
              replica: int = 0) -> LeaseGrant:
        """Make ``token`` the one live iterator of ``(rank, worker)`` (of ``replica``), fencing an older one.

        A live older holder is asked to give the lease up: it stops handing out, sends its last hand-out records
        and lets go (within its heartbeat), or its lease expires :data:`LEASE_TTL_S` after its last renewal (its
        renewals are refused once asked). Its later calls raise :class:`~knitdata.errors.FencedError`.

        Args:
            rank: The consumer.
            worker: The DataLoader worker (0 without workers).
            token: The new iterator's token.
            wait_s: How long to wait for the older holder to let go or expire.
            holder: Who asks (for messages), e.g. ``"host:pid"``.
            replica: The rank's tensor/pipeline-parallel replica (0 without replicas).

        Returns:
            The lease epoch, its time to live (:data:`LEASE_TTL_S`), where the rank's (replica's) new iterator starts
            (after the last micro-batch handed out) and the fingerprint of the micro-batches before it (or None).

        Raises:
            EngineError: The older holder neither let go nor expired within ``wait_s``.
        """
        s = self.s
        self.positions.check_replica(rank, replica)
        key = ConsumerId(rank, worker, replica)
        deadline = time.monotonic() + wait_s
        with s.cond:
            while True:
                cur = s.lease_book.leases.get(key)
                now = time.monotonic()
                if cur is None or cur.token == token or now - cur.renewed > LEASE_TTL_S:
                    if cur is None or cur.token != token:
                        cur = s.lease_book.take(key, token, holder, now)
                    else:
                        cur.renewed = now
                    p = s.start(rank, replica)
                    return LeaseGrant(cur.epoch, LEASE_TTL_S, p, s.fp(rank, p))
                if cur.fence_by is None:
                    cur.fence_by = f"{holder or token[:8]} (lease epoch {s.lease_book.epochs.get(key, 0) + 1})"
                    s.cond.notify_all()
                if now >= deadline:
                    who = f"rank {rank}" + (f" replica {replica}" if replica else "")
                    raise EngineError(
                        f"{who} (worker {worker}) is held by a live iterator ({cur.holder}, lease epoch "
                        f"{cur.epoch}) that did not give it up within {wait_s:.0f} s; each rank (replica) has one "
                        "consumer: finish or close() the other dataset/iterator first, or give tensor/pipeline-"
                        "parallel peers their own replica (pipe.dataset(rank, replica=..., num_replicas=...))")
                s.cond.wait(min(0.05, deadline - now))

    @control_call()
    def report(self, leases: Sequence[LeaseNews], commits: Sequence[Sequence[int]] = (),
               version: int | None = None, producers: Sequence[ProducerNews] = ()) -> dict[str, Any]:
        """One consumer process's news, sent off the trainer's thread: hand-outs, lease renewals, commits, version.

        Args:
            leases: :class:`~knitdata.control.records.LeaseNews` per live iterator of the process (a row without
                its replica is replica 0): its ``records`` are the
                :class:`~knitdata.control.records.HandOut` s of the micro-batches it handed out since its last report
                (applied as :meth:`~knitdata.control.positions.Positions.handed_many` while ``token`` holds the
                lease, ignored otherwise), then the lease is renewed, or ended when ``release`` is true.
            commits: ``[rank, upto(, replica)]`` (as :meth:`~knitdata.control.positions.Positions.commit`).
            version: The trainer's new policy version (as
                :meth:`~knitdata.control.positions.Positions.report_version`), applied last.
            producers: :class:`~knitdata.control.records.ProducerNews` of the producers in the process: ``alive``
                is false once every thread that put through it ended (see ``producer_timeout_s``).

        Returns:
            ``{"fenced": [Fenced(rank, worker, token, newer holder), ...]}``: the iterators that must stop (a newer one
            asked for their lease: they let go with ``release``; or it was taken over).
        """
        s = self.s
        fenced: list[Fenced] = []
        with s.cond:
            now = time.monotonic()
            for pid, holder, alive in producers or ():
                prev = s.lease_book.producers.get(str(pid))
                ended = None if alive else (prev[3] if prev is not None and prev[3] is not None else now)
                s.lease_book.producers[str(pid)] = [str(holder), now, bool(alive), ended]
            for rank, worker, token, records, release, *more in leases:
                replica = int(more[0]) if more else 0
                self.positions.check_replica(rank, replica)
                key = ConsumerId(rank, worker, replica)
                cur = s.lease_book.leases.get(key)
                if cur is None and not release:  # the plane restarted (leases are not journaled): held again
                    cur = s.lease_book.take(key, str(token), "", now)
                if cur is None or cur.token != token:
                    by = "a newer iterator" if cur is None else f"{cur.holder} (lease epoch {cur.epoch})"
                    fenced.append(Fenced(rank, worker, token, by))
                    continue
                if records:
                    self.positions.handed_many(rank, records, replica)
                if release:
                    del s.lease_book.leases[key]
                    s.cond.notify_all()
                elif cur.fence_by is not None:
                    fenced.append(Fenced(rank, worker, token, cur.fence_by))
                else:
                    cur.renewed = now
            for rank, upto, *more in commits or ():
                if more and more[0]:
                    self.positions.commit(rank, upto, int(more[0]))
                else:
                    self.positions.commit(rank, upto)
            if version is not None:
                self.positions.report_version(version)
        return {"fenced": fenced}

    @control_call(waits="timeout_s")
    def next_entries(self, rank: int, j: int, timeout_s: float, token: str | None = None,
                     worker: int = 0, replica: int = 0) -> NextEntries:
        """Entries ``j..`` up to the end of ``j``'s mini-batch, waiting up to ``timeout_s`` (the same for every
        replica of ``rank``; ``token`` must hold the lease of ``(rank, worker)`` of ``replica``).

        Returns:
            The entries; none and ``end`` when the stream is closed and drained; none and not ``end`` when nothing
            came within ``timeout_s``.

        Raises:
            StateError: Entry ``j`` was committed and released, or the stream ended before the position of a
                state the rank loaded (a refill shorter than the run that saved it). IncompleteStreamError: The
                stream ended with trajectories that were never admitted. FencedError: ``token`` no longer holds the
                lease of ``(rank, worker)``. The admission error that stopped the pipeline.
        """
        s = self.s
        self.positions.check_replica(rank, replica)
        deadline = time.monotonic() + timeout_s
        with s.cond:
            while True:
                if token is not None:
                    self._hold(rank, worker, token, replica)
                if s.error is not None:
                    raise s.error
                if j < s.planned[rank]:
                    return NextEntries(self._entries(rank, j))
                if s.closed:
                    rep = s.close_report or {}
                    if rep.get("dropped_trajectories"):
                        raise IncompleteStreamError(incomplete_message(rep))
                    short = _short_refill(s, rank)
                    if short is not None:
                        raise StateError(short)
                    return _END
                gone = producers_gone(s)
                if gone is not None:
                    raise IncompleteStreamError(gone)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return _WAIT
                s.cond.wait(remaining)

    def _hold(self, rank: int, worker: int, token: str, replica: int = 0) -> Lease:
        """Renew ``token``'s lease of ``(rank, worker)`` (taken again after a restart), or raise FencedError."""
        s = self.s
        key = ConsumerId(rank, worker, replica)
        cur = s.lease_book.leases.get(key)
        if cur is None:  # the plane restarted (leases are not journaled): held again
            cur = s.lease_book.take(key, token, "", time.monotonic())
        if cur.token != token or cur.fence_by is not None:
            by = (cur.fence_by if cur.token == token and cur.fence_by is not None
                  else f"{cur.holder} (lease epoch {cur.epoch})")
            raise FencedError(fenced_message(rank, worker, by, replica))
        cur.renewed = time.monotonic()
        return cur

    def _entries(self, rank: int, j: int) -> list[PlanEntry]:
        """The queued entries ``j..`` of ``rank`` up to the end of ``j``'s mini-batch."""
        s = self.s
        q = s.queues[rank]
        if j not in q:
            raise StateError(
                f"micro-batch {j} of rank {rank} was already committed and released (rank {rank} committed "
                f"up to {s.committed[rank]}); resume from the last committed state or a later one")
        first = q[j]
        out = [first]
        k = j + 1
        while k in q and q[k].minibatch == first.minibatch:
            out.append(q[k])
            k += 1
        return out
