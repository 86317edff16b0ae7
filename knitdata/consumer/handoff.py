"""What a consumer process tells the control plane, sent off the trainer's thread; and the lease that fences it.

The trainer's thread pays for a queue pop and nothing else: each micro-batch it takes is recorded in its
iterator's :class:`ConsumerLease` (a ``deque`` append, no lock), and a :class:`ControlSender` (one
background thread per engine handle and process) sends the records of every iterator of the process, the commits,
the versions, the producers' presence and the lease renewals in one control call
(:meth:`knitdata.control.leases.Leases.report`). It sends when something frees storage (a commit; the first
hand-out of a mini-batch with ``release="step"``; every hand-out with ``"handout"``), lingering 3 ms so that a
step's commit, its version and the next mini-batch's first hand-out go together; otherwise every
:data:`HEARTBEAT_S`, and when an iterator ends. On the Ray engine that is one or two actor calls per step instead
of one per micro-batch; on the embedded engine it keeps the trainer off the control plane's lock, which producers
hold while admission plans.

Producers: each :class:`~knitdata.pipeline.Pipeline` handle that puts reports its :class:`ProducerPresence` with
the heartbeat, so that consumers stop waiting once every producer stopped without ``close()``.

Fencing: each (rank, worker) iterator holds a lease. A newer iterator of the same rank asks the control plane for
it; the older one learns it at its next report (or fetch), stops handing out, sends its last records and lets go,
so the newer one starts right after the last micro-batch the older one handed out. An iterator hands nothing out
past its local deadline (its last renewal plus most of :data:`~knitdata.control.plane.LEASE_TTL_S`) without
renewing first, and the control plane refuses its renewals once a newer iterator asked: so a frozen process
(whose threads do not run) cannot hand out after the newer one started either.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from knitdata.control.leases import Leases
from knitdata.control.plane import fenced_message
from knitdata.control.records import Fenced, HandOut, LeaseGrant, LeaseNews, PlanEntry, ProducerNews
from knitdata.errors import EngineError, FencedError, KnitdataError
from knitdata.threads import Job, spawn

__all__ = ["ConsumerLease", "ControlSender", "ProducerPresence", "HEARTBEAT_S", "holder_name"]

#: Seconds between the lease renewals of a consumer process (its reports).
HEARTBEAT_S = 0.5
#: Part of the lease's time to live an iterator may hand out for after its last renewal, before renewing itself.
_LOCAL_SHARE = 0.7
#: Seconds the sender waits after being woken, so that a step's commit, its version and the next mini-batch's first
#: hand-out go in one call.
_LINGER_S = 0.003


def holder_name() -> str:
    """``host:pid`` of this process (how a lease names its holder in messages)."""
    return f"{socket.gethostname()}:{os.getpid()}"


class ConsumerLease:
    """The lease of one (rank, worker) iterator: the gate of every hand-out, and its hand-outs until they are sent.

    Build it with :meth:`ControlSender.acquire`. The trainer's thread records each micro-batch it takes: a check of
    :attr:`deadline` and a ``deque`` append (:meth:`take_out`, or :attr:`hand_out` once the check passed), no lock
    and no other call. Everything else is derived from the entries taken out, later and elsewhere: whether they free
    storage and a report is due (:meth:`relay`, by the stage that prepares the micro-batches), the records the
    control plane needs (when the sender sends), the position (when the dataset's position is read).

    Attributes:
        rank: The consumer.
        worker: The DataLoader worker.
        replica: The rank's tensor/pipeline-parallel replica (0 without replicas).
        token: The iterator's token.
        epoch: The lease's epoch (grows with each new holder of the rank and worker).
        fenced: Who took the lease over (``None`` while held).
        send_each: Send each hand-out at once (``release="handout"``: a hand-out frees storage), not per mini-batch.
        auto_step: ``release="step"`` with one iterator per rank: a mini-batch's first hand-out releases what is
            before it, up to :attr:`cap` at most.
        cap: The position of the last state taken or loaded, as of the last records made (``None``: none).
        taken: Entries taken out since the lease began.
        last: The last entry taken out (``None``: none yet).
        deadline: ``time.perf_counter()`` past which the next hand-out reports first (:meth:`take_out`): the last
            renewal plus most of the lease's time to live; ``-inf`` once fenced or after a failed report.
        hand_out: Record an entry taken out (a ``deque`` append; the trainer's thread, no lock), once ``now <=``
            :attr:`deadline` was checked: :meth:`take_out` without the check's call.
    """

    def __init__(self, sender: ControlSender, rank: int, worker: int, token: str, epoch: int, ttl_s: float,
                 sent_at: float, replica: int = 0) -> None:
        self.rank = rank
        self.worker = worker
        self.replica = replica
        self.token = token
        self.epoch = epoch
        self.fenced: str | None = None
        self.send_each = False
        self.auto_step = False
        self.cap: int | None = None
        self._version = sender.local_version
        self._pos: tuple[PlanEntry | None, int] = (None, 0)  # (last entry taken out, how many), as of _seal
        self._fence_message: str | None = None
        self._sender = sender
        #: The process's :class:`ControlSender` (the stage that prepares micro-batches relays its wakes).
        self.sender = sender
        self._ttl_s = ttl_s
        self._lock = threading.Lock()  # the records, the position and the deadline (never taken by a hand-out)
        # entries taken out (and cap/version changes), not yet turned into records: appended without a lock by the
        # trainer (hand_out) and by set_cap()/set_version(), popped under the lock by _seal (deque ops are atomic)
        self._out: collections.deque[Any] = collections.deque()
        self.hand_out: Callable[[PlanEntry], None] = self._out.append
        self._checked = 0  # the first entries of _out that relay() looked at (reset when _seal empties it)
        self._records: list[HandOut] = []
        self.deadline = time.perf_counter() + _LOCAL_SHARE * ttl_s - (time.monotonic() - sent_at)
        self._ended = False

    @property
    def taken(self) -> int:
        """Entries taken out since the lease began."""
        return self.position()[1]

    @property
    def last(self) -> PlanEntry | None:
        """The last entry taken out (``None``: none yet)."""
        return self.position()[0]

    def take_out(self, entry: PlanEntry, now: float) -> None:
        """Hand micro-batch ``entry`` out to the trainer (its thread; no control call, no lock).

        Args:
            entry: The plan entry.
            now: ``time.perf_counter()`` of the caller.

        Raises:
            FencedError: A newer iterator holds the rank: nothing is handed out.
            EngineError: This process could not report to the control plane (its last report failed again).
        """
        if now > self.deadline:  # one comparison while all is well (a fence or a failed report moves it to -inf)
            self._renew_now()
        self._out.append(entry)

    def relay(self, inline: bool = True) -> None:
        """Send a report if one is due (:meth:`ControlSender.relay`): the stage that prepares the micro-batches calls
        it before each one, and the trainer when it is about to wait for data.

        Hand-outs taken out since the last call are due when they free storage: each one with :attr:`send_each`, a
        mini-batch's first with :attr:`auto_step`. So the trainer's thread records a hand-out and nothing else.
        """
        if len(self._out) > self._checked and (self.send_each or self.auto_step):
            each = self.send_each
            with self._lock:  # nothing pops meanwhile; the trainer's appends only extend the right (no iterator:
                out = self._out  # a deque's iterator refuses a concurrent append, indexing does not)
                n = len(out)
                due = False
                for i in range(self._checked, n):
                    e = out[i]
                    if type(e) is not tuple and (each or e.microbatch == 0):
                        due = True
                        break
                self._checked = n
            if due:
                self._sender.request()
        sender = self._sender
        if sender.due:
            sender.relay(inline)

    def _seal(self) -> None:
        """Turn what was taken out into records, in order (the lock is held): a hand-out's auto-commit bound and
        version are those in force when it happened (cap and version changes are queued between hand-outs)."""
        out = self._out
        if not out:
            return
        version = self._version
        cap, auto = self.cap, self.auto_step
        recs = self._records
        last, taken = self._pos
        while out:
            e = out.popleft()
            if type(e) is tuple:  # a change queued by set_cap() or the sender's report_version()
                if e[0] == "cap":
                    cap = e[1]
                else:
                    version = e[1]
                continue
            j = e.j
            recs.append(HandOut(j, e.minibatch, e.microbatch, 0 if not auto else j if cap is None else min(j, cap),
                                version))
            last = e
            taken += 1
        self._checked = 0
        self.cap, self._version = cap, version
        self._pos = (last, taken)

    def position(self) -> tuple[PlanEntry | None, int]:
        """``(last entry taken out, how many)``: the hand-outs not yet sent are counted, not turned into records
        (that is the sender's work). The dataset's iterator keeps its own copy for ``state_dict()`` (no lock)."""
        with self._lock:  # nothing pops meanwhile; appends (the sender's set_version) only ever extend the right
            last, taken = self._pos
            out = self._out
            for i in range(len(out)):
                e = out[i]
                if type(e) is not tuple:
                    last = e
                    taken += 1
            return last, taken

    def set_cap(self, cap: int) -> None:
        """A state was taken at ``cap``: later hand-outs auto-commit (``release="step"``) up to it at most."""
        self._out.append(("cap", cap))

    def set_version(self, version: int) -> None:
        """The process reported ``version``: later hand-outs were taken under it."""
        self._out.append(("version", version))

    def _renew_now(self) -> None:
        """Past the local deadline (the sender did not renew in time), fenced, or the sender's last report failed:
        report synchronously (its error reaches the trainer), or raise."""
        if self.fenced is None:
            try:
                self._sender.flush()
            except KnitdataError:
                raise
            except Exception as e:  # noqa: BLE001 - named for the trainer
                raise EngineError(f"rank {self.rank} could not report its hand-outs to the control plane: "
                                  f"{type(e).__name__}: {e}") from e
        if self.fenced is not None:
            raise FencedError(self._message())

    def _message(self) -> str:
        return self._fence_message or fenced_message(self.rank, self.worker, str(self.fenced), self.replica)

    def fence(self, by: str, message: str | None = None) -> None:
        """A newer iterator took (or asked for) the rank: stop handing out; the sender lets the lease go.

        Args:
            by: The newer holder.
            message: The error's message, when the control plane already wrote it.
        """
        with self._lock:
            if self.fenced is None:
                self.fenced = by
                self._fence_message = message
            self.deadline = float("-inf")  # the next hand-out raises FencedError
        self._sender.wake()

    def give_back(self, records: list[HandOut]) -> None:
        """Records a failed report took: they are sent again first (called by the sender)."""
        with self._lock:
            self._records[:0] = records

    def take(self) -> tuple[list[HandOut], bool]:
        """The records to send and whether to let the lease go (called by the sender)."""
        with self._lock:
            self._seal()
            recs, self._records = self._records, []
            release = self._ended or self.fenced is not None
            return recs, release

    def renewed(self, sent_at: float) -> None:
        """The control plane renewed the lease in a report sent at ``sent_at`` (``time.perf_counter()``)."""
        with self._lock:
            if self.fenced is None:
                self.deadline = sent_at + _LOCAL_SHARE * self._ttl_s

    def expire(self) -> None:
        """A report failed: the next hand-out reports synchronously first (its error reaches the trainer)."""
        with self._lock:
            self.deadline = float("-inf")

    def end(self) -> None:
        """The iterator ended or was closed: send what it handed out, then let the lease go (waits for it).

        If the control plane cannot be reached (it is gone), the lease is dropped here.
        """
        with self._lock:
            self._ended = True
        try:
            self._sender.flush()
        except Exception:  # noqa: BLE001 - the control plane is gone (shutdown): nothing to tell
            self._sender.forget(self)

    @property
    def pending(self) -> int:
        """Hand-outs not yet sent."""
        with self._lock:
            return len(self._records) + len(self._out)


class ProducerPresence:
    """A producer's presence in a pipeline, reported by the process's :class:`ControlSender` with its heartbeat.

    Every thread that puts through one :class:`~knitdata.pipeline.Pipeline` handle is noted (weakly); the producer
    is alive while one of them is. A process that dies stops reporting; the control plane counts it gone after
    :data:`~knitdata.control.plane.PRODUCER_TTL_S`.

    Attributes:
        producer_id: Unique per handle.
        holder: ``host:pid``.
    """

    def __init__(self) -> None:
        self.producer_id = uuid.uuid4().hex
        self.holder = holder_name()
        self._threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._last: threading.Thread | None = None

    def note(self) -> None:
        """The calling thread puts (cheap when it is the same thread as last time)."""
        t = threading.current_thread()
        if t is not self._last:
            self._last = t
            self._threads.add(t)

    @property
    def alive(self) -> bool:
        """Whether a thread that put is still running."""
        return any(t.is_alive() for t in list(self._threads))


class ControlSender:
    """One background thread per engine handle and process that sends consumers' news to the control plane.

    Args:
        control: The control plane's leasing part (:class:`~knitdata.control.leases.Leases`, or its proxy on
            another process): its :meth:`~knitdata.control.leases.Leases.lease` and
            :meth:`~knitdata.control.leases.Leases.report`.
        heartbeat_s: Seconds between reports while an iterator is live.
        on_error: Called with an exception a report raised (it is retried at the next heartbeat).
        inline: :meth:`relay` sends on the calling thread instead of waking the sender's: for a control plane in
            this process, where a report is a function call. Handing it to another thread costs more than the
            call (a wake-up, the interpreter lock handed back and forth, the plane's state read from the other
            core's cache; see ``docs/concepts.md``). The thread still sends heartbeats and commits nobody relays,
            and retries a report that failed inline.
    """

    def __init__(self, control: Leases, *, heartbeat_s: float = HEARTBEAT_S,
                 on_error: Callable[[BaseException], None] | None = None, inline: bool = False) -> None:
        self._control = control
        self.inline = bool(inline)
        self.heartbeat_s = float(heartbeat_s)
        self._on_error = on_error
        self._leases: dict[str, ConsumerLease] = {}
        self._commits: dict[tuple[int, int], int] = {}  # (rank, replica) -> upto
        self._queued: collections.deque[tuple[int, int, int]] = collections.deque()  # commits not merged yet
        self._version: int | None = None
        self._producers: weakref.WeakValueDictionary[str, ProducerPresence] = weakref.WeakValueDictionary()
        self._gone: list[ProducerNews] = []  # producers whose handle was dropped: reported not alive once
        #: The last version this process reported (``-1``: none): hand-outs carry it, so that their staleness is
        #: measured against the version the trainer had, whenever their record arrives.
        self.local_version = -1
        self._lock = threading.Lock()  # the tables above
        self._send_lock = threading.Lock()  # one report at a time, in order
        self._wake = threading.Lock()  # held while nothing is due: wake() releases it, the thread takes it
        self._wake.acquire()
        self._thread: Job | None = None  # the sender's (see knitdata.threads)
        self._exiting = False  # the interpreter exits (knitdata.threads.stop_all): the thread ends, sends nothing
        #: Records were requested (:meth:`request`) and not relayed yet: the next :meth:`relay` wakes the thread.
        self.due = False
        self.reports = 0
        self.last_error: BaseException | None = None

    # ------------------------------------------------------------------ leases
    def acquire(self, rank: int, worker: int, token: str, *, wait_s: float,
                replica: int = 0) -> tuple[ConsumerLease, LeaseGrant]:
        """Take the lease of ``(rank, worker)`` (of ``replica``) for ``token`` (fencing an older holder); returns it
        and the plane's answer (``next``, ``fp``: where the rank's new iterator starts)."""
        t0 = time.monotonic()  # the lease's local deadline counts from the request
        ans = self._control.lease(rank, worker, token, wait_s, holder_name(), replica)
        lease = ConsumerLease(self, rank, worker, token, int(ans.epoch), float(ans.ttl_s), t0, replica)
        with self._lock:
            self._leases[token] = lease
        self._ensure_thread()
        return lease, ans

    def forget(self, lease: ConsumerLease) -> None:
        """Stop reporting for ``lease`` (its control plane is gone)."""
        with self._lock:
            self._leases.pop(lease.token, None)

    # ------------------------------------------------------------------ commits
    def commit(self, rank: int, upto: int, replica: int = 0, *, relayed: bool = False) -> None:
        """Queue a commit of ``rank`` (its ``replica``) up to ``upto`` (coalesced with others of it; sent soon).

        Args:
            rank: The consumer.
            upto: Its payloads before this micro-batch index are released.
            replica: The rank's replica.
            relayed: A live iterator of this process relays (:meth:`request`): do not wake the thread here.
        """
        if relayed and self._thread is not None:
            # the trainer's thread, once per step: a deque append (atomic; no lock, no system call), merged into the
            # table by the sender; sent soon (with the next mini-batch's first hand-out, or when the trainer waits)
            self._queued.append((rank, replica, upto))
            self.due = True
            return
        key = (rank, replica)
        with self._lock:
            commits = self._commits
            if upto > commits.get(key, 0) or key not in commits:
                commits[key] = max(upto, 0)
            running = self._thread is not None
        if not running:
            self._ensure_thread()
        self.wake()

    def add_producer(self, presence: ProducerPresence) -> None:
        """Report ``presence`` with every heartbeat while it lives (held weakly)."""
        with self._lock:
            self._producers[presence.producer_id] = presence
        weakref.finalize(presence, self._dropped, presence.producer_id, presence.holder)
        self._ensure_thread()
        self.wake()

    def remove_producer(self, presence: ProducerPresence) -> None:
        """Stop reporting ``presence`` (its pipeline was closed)."""
        with self._lock:
            self._producers.pop(presence.producer_id, None)

    def _dropped(self, producer_id: str, holder: str) -> None:
        with self._lock:
            self._gone.append(ProducerNews(producer_id, holder, False))

    def report_version(self, version: int) -> None:
        """Queue the trainer's new policy version (sent after the hand-outs queued before it)."""
        with self._lock:
            leases = list(self._leases.values())
            self._version = int(version)
            self.local_version = int(version)
        for lease in leases:  # hand-outs so far were under the previous version
            lease.set_version(int(version))
        self._ensure_thread()

    @property
    def version_pending(self) -> bool:
        """Whether a version this process reported (:meth:`report_version`) has not been sent yet."""
        return self._version is not None

    # ------------------------------------------------------------------ sending
    def request(self) -> None:
        """Records are due: the next :meth:`relay` sends them (a flag; no system call on the caller's thread).

        A lease requests when the stage that prepares its micro-batches finds hand-outs that free storage
        (:meth:`ConsumerLease.relay`); that stage relays (the prefetch thread in ``iter`` mode), and so does the
        trainer when it is about to wait for data. Waking a sleeping thread from the trainer's thread costs it a
        system call and an inter-processor interrupt (about 15 µs on a virtual machine); the trainer's commit only
        sets this flag too (:meth:`commit` with ``relayed``).
        """
        self.due = True

    def relay(self, inline: bool = True) -> None:
        """Send the records requested since the last relay: on this thread with :attr:`inline` (and ``inline``),
        else by waking the thread (any thread; callers check :attr:`due` first, so that nothing is called while
        nothing is due). A report that fails here is left to the thread (it retries and keeps the error)."""
        if self.due:
            self.due = False
            if inline and self.inline:
                try:
                    self._send()
                    return
                except Exception:  # noqa: BLE001 - the records are queued again; the thread retries and reports it
                    pass
            try:
                self._wake.release()
            except RuntimeError:  # already signalled
                pass

    def wake(self) -> None:
        """Send soon (records are due). Cheap: releases a lock the thread waits on."""
        try:
            self._wake.release()
        except RuntimeError:  # already signalled
            pass

    def flush(self) -> None:
        """Send everything queued now, on the calling thread, and wait for the answer.

        Raises:
            Exception: What the control call raised (the records stay queued and are sent again).
        """
        self._send()
        self.last_error = None

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._exiting = False
                self._thread = spawn(self._run, "knitdata-sender", stop=self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        """Called at interpreter exit (knitdata.threads.stop_all): the thread returns without another report, so
        that no daemon thread touches torch objects during finalization."""
        self._exiting = True
        self.wake()

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # however it ends, the next caller starts another (``_thread is None`` is all commit() checks)
            with self._lock:
                if self._thread is not None and self._thread.is_current():
                    self._thread = None

    def _loop(self) -> None:
        idle = 0
        while True:
            if self._exiting:
                return
            if self._wake.acquire(timeout=self.heartbeat_s):
                if self._exiting:
                    return
                time.sleep(_LINGER_S)  # hand-outs close together go in one call
            try:
                self._send()
                self.last_error = None
            except Exception as e:  # noqa: BLE001 - kept and retried; the caller sees it on flush()
                self.last_error = e
                with self._lock:
                    leases = list(self._leases.values())
                for lease in leases:  # their next hand-out reports on the trainer's thread and raises if it fails
                    lease.expire()
                if self._on_error is not None:
                    self._on_error(e)
            with self._lock:
                busy = bool(self._leases or self._commits or self._queued or self._version is not None
                            or self._producers or self._gone)
                idle = 0 if busy else idle + 1
                if idle >= 4:  # nothing to do for a few heartbeats: the thread ends (started again on demand)
                    self._thread = None
                    return

    def _send(self) -> None:
        """Send what is queued, in one control call (one at a time, in order)."""
        with self._send_lock:
            self._send_locked()

    def _merge_queued(self) -> None:
        """Merge the commits queued without the lock into the table (the lock is held)."""
        queued, commits = self._queued, self._commits
        while queued:
            rank, replica, upto = queued.popleft()
            key = (rank, replica)
            if upto > commits.get(key, 0) or key not in commits:
                commits[key] = max(upto, 0)

    def _send_locked(self) -> None:
        with self._lock:
            self._merge_queued()
            leases = list(self._leases.values())
            commits = sorted(self._commits.items())
            self._commits.clear()
            version, self._version = self._version, None
            producers = [ProducerNews(p.producer_id, p.holder, p.alive) for p in list(self._producers.values())]
            producers += self._gone
            self._gone = []
        batch = []
        taken = []
        for lease in leases:
            recs, release = lease.take()
            batch.append(LeaseNews(lease.rank, lease.worker, lease.token, recs, release, lease.replica))
            taken.append((lease, recs, release))
        if not batch and not commits and version is None and not producers:
            return
        sent_at = time.perf_counter()
        try:
            ans = self._control.report(batch, [[r, u, k] if k else [r, u] for (r, k), u in commits], version,
                                       producers)
        except BaseException:
            self._restore(taken, commits, version, producers)
            raise
        self.reports += 1
        fenced = {f.token: f.by for f in map(Fenced._make, ans.get("fenced", ()))}
        done = []
        for lease, _recs, release in taken:
            by = fenced.get(lease.token)
            if release:
                done.append(lease.token)
                if by is not None and lease.fenced is None:
                    lease.fence(by)
            elif by is not None:
                lease.fence(by)  # it lets go at the next report (right away: fence() wakes the thread)
            else:
                lease.renewed(sent_at)
        if done:
            with self._lock:
                for token in done:
                    self._leases.pop(token, None)

    def _restore(self, taken: list[tuple[ConsumerLease, list[HandOut], bool]],
                 commits: list[tuple[tuple[int, int], int]],
                 version: int | None, producers: list[ProducerNews]) -> None:
        """Put back what an unsent report took: sent again next time, in order."""
        for lease, recs, _release in taken:
            lease.give_back(recs)
        with self._lock:
            for key, upto in commits:
                self._commits[key] = max(upto, self._commits.get(key, 0))
            if self._version is None:
                self._version = version
            self._gone[:0] = [p for p in producers if not p.alive and p.pid not in self._producers]
