"""What a plan is: :class:`MicroBatchInfo` (the trainer's record of a micro-batch), the plan's rows
(:class:`PlannedMicroBatch`) and :class:`MiniBatchPlan`, and what the planner reads of an admitted mini-batch.

:class:`MicroBatchInfo` is produced here, with the plan's rows (:func:`planned_rows`; a row's
:meth:`PlannedMicroBatch.to_info`); the control plane stores it as JSON and the datasets hand it to the trainer
with every micro-batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, compress, repeat
from typing import Any, NamedTuple, Protocol

from knitdata.errors import ValidationError
from knitdata.record import TrajectoryMeta

__all__ = [
    "AdmittedLike",
    "MicroBatchInfo",
    "PlannedMicroBatch",
    "MiniBatchPlan",
    "planned_rows",
]


class AdmittedLike(Protocol):
    """What the planner reads of an admitted mini-batch (:class:`knitdata.admission.AdmittedMiniBatch`).

    An optional ``group_sizes`` attribute (the sizes of the consecutive whole groups ``trajectories`` is made
    of, as admission emits them) spares the planner a scan of every trajectory's group id; it is checked
    against the groups of each group's first and last trajectory.
    """

    @property
    def train_batch(self) -> int: ...

    @property
    def index(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def trajectories(self) -> tuple[TrajectoryMeta, ...]: ...


@dataclass(frozen=True)
class MicroBatchInfo:
    """Planner metadata of one micro-batch. Immutable and JSON-serializable.

    Attributes:
        consumer: Rank of the consumer that receives it.
        train_batch: Train batch index ``b`` (0-based).
        minibatch: Global mini-batch step (``b * M + k``).
        minibatch_in_batch: Index ``k`` of the mini-batch within its train batch.
        microbatch: Index ``i`` of this micro-batch within this consumer's share of the mini-batch.
        num_microbatches: Micro-batches of the mini-batch per consumer (the same on every consumer).
        is_last: ``i == num_microbatches - 1``: sync gradients / step the optimizer after it.
        global_tokens: Tokens of the whole mini-batch over all consumers (loss scaling).
        global_trajectories: Trajectories of the whole mini-batch over all consumers.
        global_loss_tokens: Loss-mask tokens of the whole mini-batch (0 if unknown).
        trajectory_ids: Ids of the trajectories in this micro-batch, in row order.
        gen_versions: Their ``gen_version``, in the same order.
    """

    consumer: int
    train_batch: int
    minibatch: int
    minibatch_in_batch: int
    microbatch: int
    num_microbatches: int
    is_last: bool
    global_tokens: int
    global_trajectories: int
    global_loss_tokens: int = 0
    trajectory_ids: tuple[str, ...] = ()
    gen_versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "trajectory_ids", tuple(self.trajectory_ids))
        object.__setattr__(self, "gen_versions", tuple(self.gen_versions))
        if self.num_microbatches < 1:
            raise ValidationError(f"must be >= 1, got {self.num_microbatches}", field="num_microbatches")
        if not 0 <= self.microbatch < self.num_microbatches:
            raise ValidationError(
                f"must be in [0, {self.num_microbatches}), got {self.microbatch}", field="microbatch"
            )
        if bool(self.is_last) != (self.microbatch == self.num_microbatches - 1):
            raise ValidationError(
                f"is_last={self.is_last} contradicts microbatch={self.microbatch} of {self.num_microbatches}",
                field="is_last",
            )
        if len(self.trajectory_ids) != len(self.gen_versions):
            raise ValidationError(
                f"{len(self.trajectory_ids)} trajectory ids but {len(self.gen_versions)} gen_versions",
                field="gen_versions",
            )

    @property
    def is_empty(self) -> bool:
        """True when the micro-batch holds no trajectory (a padding step so every rank steps alike)."""
        return not self.trajectory_ids

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serializable dict (inverse: :meth:`from_dict`)."""
        d = dict(self.__dict__)  # the fields, in their order
        d["trajectory_ids"] = list(self.trajectory_ids)
        d["gen_versions"] = list(self.gen_versions)
        return d

    @classmethod
    def from_plan_entry(cls, d: Mapping[str, Any]) -> MicroBatchInfo:
        """Build from the ``info`` of a control plane's queue entry (:meth:`to_dict` output written by knitdata).

        Unlike :meth:`from_dict` nothing is converted or checked (the plane wrote the fields from an info that
        was): this runs once per micro-batch on the data path.

        Example:
            >>> info = MicroBatchInfo(0, 0, 0, 0, 0, 1, True, 10, 1, trajectory_ids=("t0",), gen_versions=(3,))
            >>> MicroBatchInfo.from_plan_entry(info.to_dict()) == info
            True
        """
        info = object.__new__(cls)
        fields = info.__dict__
        fields["global_loss_tokens"] = 0  # the defaults, for an entry of a plane that left them out
        fields.update(d)
        fields["trajectory_ids"] = tuple(fields.get("trajectory_ids", ()))
        fields["gen_versions"] = tuple(fields.get("gen_versions", ()))
        return info

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MicroBatchInfo:
        """Build from :meth:`to_dict` output.

        Raises:
            ValidationError: A key is missing or a value has the wrong type.
        """
        try:
            return cls(
                consumer=int(d["consumer"]),
                train_batch=int(d["train_batch"]),
                minibatch=int(d["minibatch"]),
                minibatch_in_batch=int(d["minibatch_in_batch"]),
                microbatch=int(d["microbatch"]),
                num_microbatches=int(d["num_microbatches"]),
                is_last=bool(d["is_last"]),
                global_tokens=int(d["global_tokens"]),
                global_trajectories=int(d["global_trajectories"]),
                global_loss_tokens=int(d.get("global_loss_tokens", 0)),
                trajectory_ids=tuple(str(x) for x in d.get("trajectory_ids", ())),
                gen_versions=tuple(int(x) for x in d.get("gen_versions", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ValidationError):
                raise
            raise ValidationError(f"bad micro-batch info {dict(d)!r}: {e!r}", field="info") from e


class PlannedMicroBatch(NamedTuple):
    """One consumer's micro-batch in a plan: its :class:`MicroBatchInfo` and its trajectories' metadata.

    The plan's row, and where :class:`MicroBatchInfo` is produced: the info is what the trainer gets (ids and
    versions only, JSON), the row adds the full :class:`~knitdata.record.TrajectoryMeta` of each trajectory
    that placement and the control plane need. The info's fields read through (``row.consumer``,
    ``row.minibatch``, ...). A :class:`~typing.NamedTuple`: a plan at cluster scale builds one per consumer and
    micro-batch (8,000 ranks: 8,000 per mini-batch), and a tuple is the cheapest immutable record.

    Attributes:
        info: The micro-batch's :class:`MicroBatchInfo`.
        trajectories: Its trajectories, in row order (empty for a padding micro-batch).
    """

    info: MicroBatchInfo
    trajectories: tuple[TrajectoryMeta, ...]

    def __getattr__(self, name: str) -> Any:
        # the info's fields read through: consumer, train_batch, minibatch, microbatch, num_microbatches, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.info, name)

    @property
    def num_tokens(self) -> int:
        """Tokens of this micro-batch."""
        return sum(m.num_tokens for m in self.trajectories)

    @property
    def nbytes(self) -> int:
        """Payload bytes of this micro-batch."""
        return sum(m.nbytes for m in self.trajectories)

    def to_info(self) -> MicroBatchInfo:
        """The :class:`MicroBatchInfo` handed to the trainer with the micro-batch."""
        return self.info


@dataclass(frozen=True)
class MiniBatchPlan:
    """The assignment of one admitted mini-batch.

    Attributes:
        train_batch: Train batch ``b``.
        minibatch: Global mini-batch step.
        minibatch_in_batch: ``k``.
        num_microbatches: ``K`` per consumer.
        microbatches: ``microbatches[rank]`` is that consumer's ``K`` micro-batches in order.
        local_bytes: Payload bytes whose consumer is on the node that holds them.
        remote_bytes: Payload bytes that cross nodes.
    """

    train_batch: int
    minibatch: int
    minibatch_in_batch: int
    num_microbatches: int
    microbatches: tuple[tuple[PlannedMicroBatch, ...], ...]
    local_bytes: int
    remote_bytes: int

    @property
    def num_consumers(self) -> int:
        """Number of consumers."""
        return len(self.microbatches)

    def share(self, rank: int) -> tuple[TrajectoryMeta, ...]:
        """All trajectories of ``rank`` in plan order."""
        return tuple(m for mb in self.microbatches[rank] for m in mb.trajectories)

    def share_tokens(self) -> list[int]:
        """Tokens per consumer."""
        return [sum(mb.num_tokens for mb in row) for row in self.microbatches]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable summary (ids per micro-batch)."""
        return {
            "train_batch": self.train_batch,
            "minibatch": self.minibatch,
            "minibatch_in_batch": self.minibatch_in_batch,
            "num_microbatches": self.num_microbatches,
            "ids": [[list(mb.info.trajectory_ids) for mb in row] for row in self.microbatches],
            "local_bytes": self.local_bytes,
            "remote_bytes": self.remote_bytes,
        }


def planned_rows(common: Mapping[str, Any], k: int,
                 bins: Sequence[Sequence[TrajectoryMeta]]) -> list[tuple[PlannedMicroBatch, ...]]:
    """The plan's rows: ``bins`` holds each consumer's ``k`` micro-batches in turn (rank 0's, then rank 1's, ...).

    ``common``: the mini-batch's fields of :class:`MicroBatchInfo` (``train_batch``, ``minibatch``,
    ``minibatch_in_batch``, ``global_tokens``, ``global_trajectories``, ``global_loss_tokens``).

    Built in one pass per field rather than one record at a time (8,000 ranks: 8,000 rows per mini-batch): each
    info's fields are a copy of its micro-batch index's template (a checked :class:`MicroBatchInfo`'s) with its
    consumer set, and for the micro-batches that hold trajectories their ids and versions, read once for all
    and sliced per micro-batch; C-level ``map`` s, no Python call per row. The copies are not re-validated: the
    planner's rows hold the template's invariants by construction.
    """
    n_mb = len(bins)
    if k < 1 or n_mb % k:
        raise ValidationError(f"{n_mb} micro-batches are not {k} per consumer", field="num_microbatches")
    # each micro-batch index's fields: a checked info's (in field order; a split dict, whose copies share its keys)
    templates = [MicroBatchInfo(0, common["train_batch"], common["minibatch"], common["minibatch_in_batch"], i, k,
                                i == k - 1, common["global_tokens"], common["global_trajectories"],
                                common["global_loss_tokens"]).__dict__ for i in range(k)]
    n_rows = n_mb // k
    values = list(map(dict.copy, chain.from_iterable(repeat(templates, n_rows)) if k > 1 else repeat(templates[0], n_mb)))
    consumers = range(n_mb) if k == 1 else chain.from_iterable(map(repeat, range(n_rows), repeat(k)))
    set_item = dict.__setitem__
    deque(map(set_item, values, repeat("consumer"), consumers), 0)
    # the micro-batches with trajectories (the others keep the templates' ()): their metas, ids and versions read
    # in one go while each one's metas are in cache (a pass over all trajectories per field misses it each time)
    metas: list[tuple[TrajectoryMeta, ...]] = [()] * n_mb
    for i in compress(range(n_mb), bins):
        held = metas[i] = tuple(bins[i])
        v = values[i]
        v["trajectory_ids"] = tuple([m.id for m in held])
        v["gen_versions"] = tuple([m.gen_version for m in held])
    infos = list(map(object.__new__, repeat(MicroBatchInfo, n_mb)))
    deque(map(_SET_FIELDS, infos, values), 0)
    rows = list(map(tuple.__new__, repeat(PlannedMicroBatch, n_mb), zip(infos, metas)))
    return list(zip(*[iter(rows)] * k))


def _bounds(parts: Sequence[Sequence[Any]]) -> tuple[list[int], list[int]]:
    """Starts and stops of consecutive ``parts`` laid end to end."""
    stops = list(accumulate(map(len, parts)))
    return [0, *stops[:-1]], stops


#: Sets an instance's ``__dict__`` (the dataclass is frozen: its own ``__setattr__`` refuses).
_SET_FIELDS = MicroBatchInfo.__dict__["__dict__"].__set__
