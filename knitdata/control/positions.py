"""Consumer positions and release: hand-outs, commits, restores (seek), replay fingerprints, the policy version.

Plans are queued per rank as *entries*: the ``j``-th micro-batch of a rank over the whole run (``j`` counts
across mini-batches). A consumer positioned past an entry (:meth:`Positions.seek`) only releases it, so a
pipeline fed the same puts plans the same entries whenever consumers restore, and on either engine.

Release (``release``): ``"step"`` commits a rank's entries before a mini-batch when the rank's single
iterator hands out that mini-batch's first micro-batch; ``"commit"`` releases only on explicit
:meth:`Positions.commit`; ``"handout"`` releases each entry as it is handed out. A rank restored from a
committed-or-later position receives exactly the entries after it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from knitdata.control.records import HandOut, PlanEntry, StartPoint
from knitdata.control.state import FP_KEEP, PlaneState, Replicas
from knitdata.control.surface import Part, control_call, control_part
from knitdata.errors import ConfigError, StateError, ValidationError
from knitdata.observe import trace as tracing

__all__ = ["Positions", "check_verifications", "mismatch_message"]


def mismatch_message(s: PlaneState, rank: int, length: int, where: str) -> str:
    """The message when a saved state's fingerprint of ``rank``'s first ``length`` micro-batches differs."""
    e = s.queues[rank].get(length - 1)
    last = ""
    if e is not None:
        ids = [x.id for x in e.items]
        last = (f"; this pipeline planned mini-batch {e.minibatch} micro-batch {e.microbatch} there with "
                f"trajectories {ids[:8]}" + (" ..." if len(ids) > 8 else ""))
    return (f"rank {rank}: the saved state ({where or f'after {length} micro-batches'}) was taken in a run whose "
            f"first {length} micro-batches of rank {rank} differ from this pipeline's (other trajectory ids, "
            f"sources or groups, or another order of puts){last}. A new job must be refilled with the same puts "
            "in the same order as the run that saved the states; otherwise start it without loading them")


def check_verifications(s: PlaneState) -> None:
    """Run the pending fingerprint checks whose micro-batches are planned now; a mismatch stops the pipeline.

    Raises:
        StateError: A mismatch (the pipeline stops with it).
    """
    pending = s.replay.verify_at
    for rank, v in enumerate(pending):
        if v is None or v[0] > s.planned[rank]:
            continue
        pending[rank] = None
        have = s.fp(rank, v[0])
        if have is not None and have != v[1]:
            err = StateError(mismatch_message(s, rank, v[0], v[2]))
            s.fail(err)
            raise err


@control_part("positions")
class Positions(Part):
    """Where each rank's consumer stands: hand-outs, commits, restores and their checks, the trainer's version."""

    @control_call(journaled=True)
    def register_replicas(self, num_replicas: int) -> int:
        """Every rank has ``num_replicas`` tensor/pipeline-parallel replicas (the first dataset of a replica says so).

        Each replica of a rank receives all of the rank's micro-batches and counts as part of one consumer: an entry
        is released once every replica is past it. Replicas registered after some entries were released start at
        the rank's committed position; replica 0 keeps the rank's hand-out position (a dataset built without a
        replica is replica 0).

        Args:
            num_replicas: Replicas per data-parallel rank (the same for every rank and every replica's dataset).

        Returns:
            ``num_replicas``.

        Raises:
            ConfigError: Not a positive int, or another number of replicas was registered before.
        """
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ConfigError(f"num_replicas must be a positive int, got {num_replicas!r}")
        s = self.s
        with s.cond:
            if s.replicas is not None:
                if s.replicas.num != num_replicas:
                    raise ConfigError(
                        f"num_replicas={num_replicas} disagrees with the {s.replicas.num} replicas per rank this "
                        "pipeline registered first: every replica of every data-parallel rank must pass the same "
                        "num_replicas (the size of its tensor/pipeline-parallel group)")
                return num_replicas
            n = s.layout.num_consumers
            s.replicas = Replicas(
                num_replicas, [[s.committed[r]] * num_replicas for r in range(n)],
                [[s.start(r)] + [s.committed[r]] * (num_replicas - 1) for r in range(n)], [{} for _ in range(n)])
            return num_replicas

    def check_replica(self, rank: int, replica: int) -> None:
        """Raise :class:`~knitdata.errors.ConfigError` unless ``replica`` is a replica of ``rank`` registered here."""
        self.s.check_rank(rank)
        if replica == 0 and not isinstance(replica, bool):
            return
        num = 1 if self.s.replicas is None else self.s.replicas.num
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < num:
            raise ConfigError(f"rank {rank}: replica must be an int in 0..{num - 1} (num_replicas={num}"
                              f"{'' if self.s.replicas is not None else ', none registered'}), got {replica!r}")

    def _advance(self, rank: int, replica: int, upto: int) -> int:
        """Commit ``rank``'s ``replica`` up to ``upto``; release what every replica is past. Returns the count."""
        s = self.s
        r = s.replicas
        if r is None:
            return s.commit_upto(rank, upto)
        row = r.committed[rank]
        if upto > row[replica]:
            row[replica] = upto
        n = s.commit_upto(rank, min(row))
        return n + self._sweep(rank)

    def _sweep(self, rank: int) -> int:
        """``release="handout"`` with replicas: release the entries every replica handed out or committed past."""
        s = self.s
        r = s.replicas
        assert r is not None
        handed, row, full = r.handed[rank], r.committed[rank], (1 << r.num) - 1
        n = 0
        for j, mask in list(handed.items()):
            for k, c in enumerate(row):
                if c > j:
                    mask |= 1 << k
            if mask == full or j < s.committed[rank]:
                del handed[j]
                n += j in s.queues[rank]
                s.drop_entry(rank, j)
            else:
                handed[j] = mask
        return n

    @control_call(journaled=True, fire_and_forget=True)
    def handed(self, rank: int, j: int, minibatch: int, microbatch: int, auto_commit: bool = True) -> None:
        """Entry ``j`` of ``rank`` was handed out to the trainer (staleness; release per ``release``: with
        ``"step"`` and ``auto_commit`` the entries before a mini-batch's first micro-batch are released)."""
        self.s.check_rank(rank)
        pending: list[tuple[PlanEntry, int]] = []
        with self.s.cond:
            self.s.policy.note_handed(rank, j)
            self._handed(rank, j, microbatch, j if auto_commit else 0, -1, 0, pending)
            self.s.record_handouts(rank, pending)

    @control_call(journaled=True)
    def handed_many(self, rank: int, records: Sequence[HandOut], replica: int = 0) -> None:
        """:meth:`handed` for the :class:`~knitdata.control.records.HandOut` records of ``rank``, in order (a journal
        replays them as their JSON arrays ``[j, minibatch, microbatch, auto_upto(, version)]``: read by position).

        ``auto_upto``: with ``release="step"``, when ``j`` starts a mini-batch, release the rank's entries below
        ``min(j, auto_upto)`` (the consumer's last saved position caps it; ``0``: release nothing). ``version``: the
        trainer's policy version when it took the micro-batch, as its process last reported it (``-1`` or absent:
        the version last reported here); staleness is measured against it. ``replica``: the rank's replica that
        handed them out (see :meth:`register_replicas`).
        """
        self.check_replica(rank, replica)
        s = self.s
        pending: list[tuple[PlanEntry, int]] = []  # hand-outs whose staleness is not recorded yet
        with s.cond:
            for rec in records:  # by position: a HandOut, or its array replayed from a journal
                j, microbatch, auto_upto = int(rec[0]), int(rec[2]), int(rec[3])
                v = int(rec[4]) if len(rec) > 4 else -1
                msg = s.policy.note_handed(rank, j, v)  # the bound learns the trainer's versions from it
                if msg is not None:
                    s.fail(ConfigError(msg))
                self._handed(rank, j, microbatch, min(j, auto_upto), v, replica, pending)
            s.record_handouts(rank, pending)

    def _handed(self, rank: int, j: int, microbatch: int, auto_upto: int, version: int, replica: int,
                pending: list[tuple[PlanEntry, int]]) -> None:
        """Apply one hand-out. Its staleness joins ``pending``, recorded together before the next release (which
        forgets the trajectories released) or by the caller at the end."""
        s = self.s
        reps = s.replicas
        e = s.queues[rank].get(j)
        if e is not None and (reps is None or replica == 0):  # staleness counts each micro-batch once
            pending.append((e, version if version >= 0 else s.version))
        auto = s.release_mode == "step" and auto_upto > 0 and microbatch == 0
        if reps is not None:
            if s.release_mode == "handout" and j >= s.committed[rank]:
                reps.handed[rank][j] = reps.handed[rank].get(j, 0) | (1 << replica)
                self._record(rank, pending)
                self._sweep(rank)
            elif auto:
                self._record(rank, pending)
                self._advance(rank, replica, auto_upto)
        elif s.release_mode == "handout":
            self._record(rank, pending)
            s.drop_entry(rank, j)
        elif auto:
            self._record(rank, pending)
            s.commit_upto(rank, auto_upto)
        if reps is not None and j + 1 > reps.position[rank][replica]:
            reps.position[rank][replica] = j + 1
        if j + 1 > s.position[rank]:
            s.position[rank] = j + 1

    def _record(self, rank: int, pending: list[tuple[PlanEntry, int]]) -> None:
        """Record the staleness of the ``pending`` hand-outs now (a release follows) and empty it."""
        self.s.record_handouts(rank, pending)
        pending.clear()

    @control_call(journaled=True)
    def commit(self, rank: int, upto: int, replica: int = 0) -> int:
        """Release ``rank``'s entries below ``upto``; returns how many micro-batches were released.

        With replicas (:meth:`register_replicas`) this commits ``replica``'s position; entries are released once
        every replica of the rank committed past them.
        """
        self.check_replica(rank, replica)
        with self.s.cond:
            return self._advance(rank, replica, int(upto))

    @control_call(journaled=True)
    def seek(self, rank: int, j: int, replica: int = 0) -> None:
        """``rank`` (its ``replica``) restored at entry ``j``: everything below is committed (released now or when
        planned, once every replica is past it)."""
        self.check_replica(rank, replica)
        with self.s.cond:
            self._advance(rank, replica, int(j))
            reps = self.s.replicas
            if reps is None:
                self.s.position[rank] = int(j)
            else:
                reps.position[rank][replica] = int(j)
                self.s.position[rank] = max(reps.position[rank])

    @control_call(journaled=True)
    def resumed_at(self, rank: int, minibatch: int) -> None:
        """``rank`` loaded a state saved before or inside mini-batch ``minibatch``: its trainer finished the
        mini-batches before it in the run that saved the state. Until the trainer's first :meth:`report_version`,
        the staleness bound counts them as finished (a new job refilled with the same puts reports its restored
        version before the refill planned them again: the bound learns the offset ``version - minibatch``)."""
        self.s.check_rank(rank)
        if isinstance(minibatch, bool) or not isinstance(minibatch, int) or minibatch < 0:
            raise ValidationError(f"minibatch must be a non-negative int, got {minibatch!r}", field="minibatch")
        with self.s.cond:
            self.s.policy.note_resumed(rank, minibatch)

    @control_call(journaled=True)
    def verify(self, rank: int, length: int, fp: str, where: str = "") -> None:
        """Check that ``rank``'s first ``length`` micro-batches have the fingerprint ``fp`` (of a saved state).

        Checked now when they are planned, else as soon as they are (a new job refilled after its consumers
        loaded their states). A mismatch (the refill put other trajectories, sources or groups, or in another
        order) raises :class:`~knitdata.errors.StateError` now, or stops the pipeline with it when found later,
        so that nothing is delivered twice or skipped silently.

        Args:
            rank: The consumer.
            length: How many of its micro-batches the fingerprint covers.
            fp: The fingerprint, as in the state (:meth:`start_point`, the entries' ``fp``).
            where: The state's position, for the message.

        Raises:
            StateError: The fingerprint differs, or it is older than what this plane keeps.
        """
        s = self.s
        s.check_rank(rank)
        length = int(length)
        with s.cond:
            if length > s.planned[rank]:
                s.replay.verify_at[rank] = (length, str(fp), str(where))
                return
            have = s.fp(rank, length)
            if have is None:
                if s.replay.chain[rank] is None or length < s.committed[rank] - FP_KEEP:
                    return  # unknown here (an old snapshot, or far below the committed position): not checkable
                raise StateError(f"rank {rank}: no fingerprint of its first {length} micro-batches")
            if have != fp:
                raise StateError(mismatch_message(s, rank, length, where))

    @control_call()
    def start_point(self, rank: int, replica: int = 0) -> StartPoint:
        """Where a new dataset of ``rank`` (its ``replica``) starts, after the last micro-batch handed out to it, and
        the fingerprint of the micro-batches before it (``None``: unknown).

        A consumer that crashed restores its saved state instead (:meth:`seek`), which may go back to the rank's
        committed position.
        """
        self.check_replica(rank, replica)
        with self.s.cond:
            p = self.s.start(rank, replica)
            return StartPoint(p, self.s.fp(rank, p))

    @control_call(journaled=True)
    def report_version(self, version: int) -> None:
        """The trainer's new policy version (staleness of what is handed out afterwards is measured against it).

        Report the version before the first step (the version step 0 is trained with) or after each optimizer step
        (the version of the next). A version lower than the last one is a rollback (a job restored from a
        checkpoint): accepted and counted (``version_rollbacks`` in :meth:`~knitdata.control.reporting.Reporting.stats`).
        Admission hears it too (:meth:`~knitdata.admission.AdmissionPolicy.note_version`): later puts of a newer
        ``gen_version`` are refused, and the first report sets the staleness bound's offset (the steps the trainer
        finished are counted from the ranks' hand-outs taken before their process reported a version). When a
        mini-batch admitted before that report turns out staler than the bound, the pipeline stops with a
        :class:`~knitdata.errors.ConfigError` that says which ``version_offset`` to pass.

        Raises:
            ValidationError: Not a non-negative int.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValidationError(f"version must be a non-negative int, got {version!r}", field="version")
        s = self.s
        with s.cond:
            if version < s.version:
                s.counts["version_rollbacks"] += 1  # a job restored from a checkpoint reports its version again
            s.version = version
            s.observed.version_times.append(time.monotonic())
            if tracing.tracer is not None:
                tracing.tracer.counter("version", {"version": version})
            lo, hi = s.policy.done_before_report(len(s.position))  # steps finished before any report
            msg = s.policy.note_version(version, lo, hi)
            if msg is not None:
                s.fail(ConfigError(msg))
                s.cond.notify_all()
                return
            if s.admission_poll is not None and s.error is None and not s.closed:
                s.admission_poll()  # admission may have held for this report
