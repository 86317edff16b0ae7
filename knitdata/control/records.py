"""The records that travel inside one process between the control plane and its callers, typed.

The control plane queues a :class:`PlanEntry` per micro-batch of a rank, whose payloads are :class:`ItemRef` s; a
consumer process reports :class:`LeaseNews` (with the :class:`HandOut` s of each live iterator) and
:class:`ProducerNews`, and hears back which iterators are :class:`Fenced`; a refused put comes back as a
:class:`Refusal`, which rebuilds its exception (:meth:`Refusal.to_exception`) from :func:`knitdata.errors.error_class`.
The one-round-trip put answers :class:`Admitted` (the plane's answer) inside :class:`Stored` (the unit's); a
producer's replica of the placement starts from a :class:`PlacementView`.

They become JSON only at the journal and the snapshot (the Ray hop pickles them as they are: module-level
classes). The row-like ones are
:class:`~typing.NamedTuple` s: typed for mypy, as cheap as a tuple to build and read, and ``json.dumps`` writes
each as the same array the journal and the snapshots always held, so old journals replay and snapshots stay
byte for byte. :class:`PlanEntry` is a slotted record with :meth:`PlanEntry.to_json` / :meth:`PlanEntry.from_json`
for the snapshot. :class:`Admitted` and :class:`Stored` are slotted records that are never JSON (a journal records
the put's arguments, not its answer); a :class:`~knitdata.record.TrajectoryMeta` they carry across Ray is rebuilt
where it is loaded, with that process's hash in ``packed``.

Example:
    >>> import json
    >>> json.dumps(HandOut(4, 1, 0, 4, 7))
    '[4, 1, 0, 4, 7]'
    >>> Refusal("t1", "ValidationError", "trajectory 't1': field 'reward': not finite", "reward").to_exception()
    ValidationError("trajectory 't1': field 'reward': not finite")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Any, NamedTuple

from knitdata.errors import FieldTypeError, KnitdataError, ValidationError, error_class
from knitdata.planner.records import MicroBatchInfo
from knitdata.record import TrajectoryMeta

__all__ = ["ItemRef", "HandOut", "PlanEntry", "LeaseNews", "ProducerNews", "Fenced", "ConsumerId", "StartPoint", "LeaseGrant",
           "NextEntries", "Refusal", "PlacementView", "Admitted", "Stored", "item_refs"]


class ItemRef(NamedTuple):
    """One trajectory of a plan entry: where its payload is (JSON: ``[id, unit, nbytes]``).

    Attributes:
        id: The trajectory id.
        unit: The storage unit holding its payload.
        nbytes: Its payload bytes.
    """

    id: str
    unit: str
    nbytes: int


_new_ref = partial(tuple.__new__, ItemRef)
_ref_fields = attrgetter("id", "location", "nbytes")


def item_refs(metas: Sequence[TrajectoryMeta]) -> list[ItemRef]:
    """The :class:`ItemRef` of each trajectory of ``metas``, in order (C-level maps: no Python call per
    trajectory; the control plane makes them for every micro-batch it plans)."""
    return list(map(_new_ref, map(_ref_fields, metas)))


class HandOut(NamedTuple):
    """One micro-batch a consumer's iterator handed out (JSON: ``[j, minibatch, microbatch, auto_upto, version]``).

    Attributes:
        j: The rank's entry index.
        minibatch: Its global mini-batch step.
        microbatch: Its index within the rank's share of the mini-batch.
        auto_upto: With ``release="step"``, release the rank's entries below ``min(j, auto_upto)`` when ``j`` starts
            a mini-batch (``0``: release nothing).
        version: The trainer's policy version when it took the micro-batch (``-1``: the version last reported).
    """

    j: int
    minibatch: int
    microbatch: int
    auto_upto: int
    version: int = -1


class ConsumerId(NamedTuple):
    """One consumer iterator's place: ``(rank, DataLoader worker, tensor/pipeline-parallel replica)``."""

    rank: int
    worker: int
    replica: int = 0


class StartPoint(NamedTuple):
    """Where a new iterator of a rank (replica) starts: after the last micro-batch handed out to it.

    Attributes:
        next: The rank's entry index to start at.
        fp: The replay fingerprint of the rank's micro-batches before it (``None``: unknown).
    """

    next: int
    fp: str | None


class LeaseGrant(NamedTuple):
    """A lease taken (:meth:`~knitdata.control.leases.Leases.lease`): its epoch and time to live, and where the
    rank's (replica's) new iterator starts (as :class:`StartPoint`).

    Attributes:
        epoch: The lease epoch.
        ttl_s: Seconds the lease lives without a renewal.
        next: The rank's entry index to start at.
        fp: The replay fingerprint of the rank's micro-batches before it (``None``: unknown).
    """

    epoch: int
    ttl_s: float
    next: int
    fp: str | None


class LeaseNews(NamedTuple):
    """A live iterator's part of a consumer process's report (JSON: ``[rank, worker, token, records, release,
    replica]``; a row without ``replica``, as older processes sent, is replica 0).

    Attributes:
        rank: The consumer.
        worker: The DataLoader worker.
        token: The iterator's lease token.
        records: What it handed out since its last report, in order.
        release: The iterator ended: its lease goes.
        replica: The rank's replica.
    """

    rank: int
    worker: int
    token: str
    records: Sequence[HandOut]
    release: bool
    replica: int = 0


class NextEntries(NamedTuple):
    """The answer of :meth:`~knitdata.control.leases.Leases.next_entries`: the queued entries from the one asked for
    to the end of its mini-batch; none and ``end`` once the stream is closed and drained; none and not ``end`` when
    nothing came within the wait (ask again)."""

    entries: Sequence[PlanEntry] = ()
    end: bool = False


class ProducerNews(NamedTuple):
    """A producer of a process, in its report (JSON: ``[producer id, holder, alive]``).

    Attributes:
        pid: The producer id.
        holder: Who holds it (``"host:pid"``).
        alive: False once every thread that put through it ended.
    """

    pid: str
    holder: str
    alive: bool


class Fenced(NamedTuple):
    """An iterator that must stop, in a report's answer (JSON: ``[rank, worker, token, newer holder]``).

    Attributes:
        rank: The consumer.
        worker: The DataLoader worker.
        token: The fenced iterator's token.
        by: Who holds the lease now, for messages.
    """

    rank: int
    worker: int
    token: str
    by: str


class Refusal(NamedTuple):
    """A trajectory a put refused (JSON: ``[trajectory id, error class name, message, field]``).

    Attributes:
        trajectory_id: The refused trajectory.
        error: The name of the :class:`~knitdata.errors.KnitdataError` subclass (:func:`~knitdata.errors.error_class`).
        message: The error's message.
        field: The offending field, or ``None``.
    """

    trajectory_id: str
    error: str
    message: str
    field: str | None = None

    @classmethod
    def of(cls, trajectory_id: str, err: BaseException) -> Refusal:
        """The refusal of ``trajectory_id`` by ``err`` (its ``field`` when it names one)."""
        return cls(str(trajectory_id), type(err).__name__, str(err), getattr(err, "field", None))

    def to_exception(self, more: str = "") -> KnitdataError:
        """The exception to raise in the producer, naming the trajectory and field as the control plane did
        (``more``: appended to the message, e.g. how many more were refused). An unknown class name (a newer
        control plane) gives a :class:`~knitdata.errors.KnitdataError`."""
        cls = error_class(self.error)
        if cls is ValidationError or cls is FieldTypeError:
            tid, fld = self.trajectory_id, self.field
            prefix = f"trajectory {tid!r}: " + (f"field {fld!r}: " if fld is not None else "")
            return cls(self.message.removeprefix(prefix) + more, trajectory_id=tid, field=fld)
        return cls(self.message + more)


@dataclass(slots=True)
class PlanEntry:
    """The ``j``-th micro-batch of a rank, as the control plane queues it and the consumer takes it.

    Built by the control plane when it plans (:meth:`~knitdata.control.state.PlaneState.queue_row`) and read by
    attribute on the consumer side; JSON only in a snapshot (:meth:`to_json`, :meth:`from_json`).

    Attributes:
        j: The rank's entry index (counts across mini-batches).
        minibatch: The global mini-batch step.
        microbatch: The index within the rank's share of the mini-batch.
        info: What the trainer gets with the micro-batch.
        items: Its trajectories, in row order (empty: a padding micro-batch).
        fp: The replay fingerprint of the rank's micro-batches up to and with this one (``None``: unknown).
    """

    j: int
    minibatch: int
    microbatch: int
    info: MicroBatchInfo
    items: list[ItemRef] = field(default_factory=list)
    fp: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The snapshot's form: ``{"j", "minibatch", "microbatch", "info", "items", "fp"}`` (as it always was)."""
        return {"j": self.j, "minibatch": self.minibatch, "microbatch": self.microbatch, "info": self.info.to_dict(),
                "items": [list(it) for it in self.items], "fp": self.fp}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PlanEntry:
        """Build from :meth:`to_json` output (an entry without ``fp``, of a format-1 snapshot: ``None``).

        Raises:
            ValidationError: A key is missing or a value has the wrong type.
        """
        try:
            items = [ItemRef(str(i), u, int(n)) for i, u, n in d["items"]]
            return cls(int(d["j"]), int(d["minibatch"]), int(d["microbatch"]), MicroBatchInfo.from_dict(d["info"]),
                       items, d.get("fp"))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ValidationError):
                raise
            raise ValidationError(f"bad plan entry {dict(d)!r}: {e!r}", field="entry") from e


class PlacementView(NamedTuple):
    """The placement as a producer's replica follows it (:meth:`~knitdata.control.admit.Admission.placement_view`).

    Attributes:
        placement: The placement's view (:meth:`~knitdata.placement.Placement.view`).
        seq: The next arrival index.
    """

    placement: dict[str, Any]
    seq: int


@dataclass(slots=True)
class Admitted:
    """The answer of the one-round-trip put (:meth:`~knitdata.control.admit.Admission.admit_many`).

    Attributes:
        accepted: Per item of the call, in order: its metadata as the plane holds it (``seq`` and ``location``
            set), or ``None`` when refused (the plane does not hold it: the unit drops its payload).
        errors: The refusals, the error that stopped admission first.
        placement: The placement's view after the call (:meth:`~knitdata.placement.Placement.view`), for the
            producer's replica.
        seq: The next arrival index.
        exception: In process only: an exception that is no :class:`~knitdata.errors.KnitdataError` (an ``on_plan``
            hook's), which the producer re-raises after taking the answer.

    Example:
        >>> meta = TrajectoryMeta("t1", "math", "g1", num_tokens=9, nbytes=64, location="node0", seq=0)
        >>> ans = Admitted([meta, None], [Refusal("t2", "ValidationError", "trajectory 't2': field 'id': taken", "id")],
        ...                {"load": {"node0": 64}}, 1)
        >>> [m.id for m in ans.accepted if m is not None], ans.errors[0].to_exception()
        (['t1'], ValidationError("trajectory 't2': field 'id': taken"))
    """

    accepted: list[TrajectoryMeta | None]
    errors: list[Refusal]
    placement: dict[str, Any]
    seq: int
    exception: BaseException | None = None


@dataclass(slots=True)
class Stored:
    """The answer of a storage unit's one-round-trip put
    (:meth:`~knitdata.storage.base.StorageUnit.put_admit`).

    Attributes:
        stored: The first ``stored`` payloads were stored and offered; the rest were not stored (the unit was full).
        admit: The plane's answer for them, ``None`` when nothing was stored.
        status: How storing ended: ``"ok"`` (all stored) or ``"full"``; a Ray unit's actor also answers ``"dup"``,
            ``"closed"``, ``"missing:<i>"`` or ``"kind:<i>"``, after which nothing of the batch is kept.
        index: The position of the first payload not stored.
    """

    stored: int
    admit: Admitted | None
    status: str = "ok"
    index: int = 0
