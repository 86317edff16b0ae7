"""Planning: an admitted mini-batch becomes per-consumer shares cut into micro-batches (DESIGN.md §4).

Works on :class:`~knitdata.record.TrajectoryMeta` only (no payloads, no storage). The plan is a pure,
deterministic function of the admitted mini-batch, the layout and the options: a freshly built pipeline
fed the same puts plans the same micro-batches, which exact resume relies on.

Assignment (shares). The assignment units are groups (kept whole unless ``allow_split_groups``), taken
largest first (by tokens). Each unit's *home* is the node holding most of its bytes. With ``locality`` on,
a unit goes to the least-loaded consumer on its home node, unless that consumer would exceed
``(1 + balance_tolerance) * total_tokens / num_consumers`` while another consumer is less loaded: then it
goes to the least-loaded consumer overall (token balance). Without ``locality`` it is plain
longest-processing-time balancing.

Micro-batches. Each share is cut under ``token_budget`` (tokens = prompt + response, before padding) with
first-fit decreasing. ``K`` is the largest count over consumers (at least 1); a share that needs fewer is
rebalanced into ``K`` bins when that stays within the budget, and padded with explicit empty
micro-batches otherwise, so every consumer runs exactly ``K`` micro-batches per mini-batch. A single
trajectory larger than the budget gets a micro-batch of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from knitdata.errors import ConfigError, ValidationError
from knitdata.placement import ConsumerLayout
from knitdata.record import TrajectoryMeta

if TYPE_CHECKING:  # pragma: no cover
    from knitdata.collate import MicroBatchInfo

__all__ = ["AdmittedLike", "PlannedMicroBatch", "MiniBatchPlan", "Planner"]


class AdmittedLike(Protocol):
    """What the planner reads of an admitted mini-batch (:class:`knitdata.admission.AdmittedMiniBatch`)."""

    train_batch: int
    index: int
    step: int
    trajectories: tuple[TrajectoryMeta, ...]


@dataclass(frozen=True)
class PlannedMicroBatch:
    """One consumer's micro-batch in a plan (metadata only).

    Attributes:
        consumer: Rank.
        train_batch: Train batch ``b``.
        minibatch: Global mini-batch step.
        minibatch_in_batch: ``k`` within the train batch.
        microbatch: ``i`` within this consumer's share.
        num_microbatches: ``K``, the same on every consumer.
        global_tokens: Tokens of the whole mini-batch.
        global_trajectories: Trajectories of the whole mini-batch.
        global_loss_tokens: Loss tokens of the whole mini-batch (0 if unknown).
        trajectories: Its trajectories, in row order (empty for a padding micro-batch).
    """

    consumer: int
    train_batch: int
    minibatch: int
    minibatch_in_batch: int
    microbatch: int
    num_microbatches: int
    global_tokens: int
    global_trajectories: int
    global_loss_tokens: int
    trajectories: tuple[TrajectoryMeta, ...]

    @property
    def is_last(self) -> bool:
        """Whether it is the consumer's last micro-batch of the mini-batch."""
        return self.microbatch == self.num_microbatches - 1

    @property
    def trajectory_ids(self) -> tuple[str, ...]:
        """Ids in row order."""
        return tuple(m.id for m in self.trajectories)

    @property
    def num_tokens(self) -> int:
        """Tokens of this micro-batch."""
        return sum(m.num_tokens for m in self.trajectories)

    @property
    def nbytes(self) -> int:
        """Payload bytes of this micro-batch."""
        return sum(m.nbytes for m in self.trajectories)

    def to_info(self) -> MicroBatchInfo:
        """The :class:`knitdata.collate.MicroBatchInfo` handed to the trainer with the micro-batch."""
        from knitdata.collate import MicroBatchInfo

        return MicroBatchInfo(
            consumer=self.consumer,
            train_batch=self.train_batch,
            minibatch=self.minibatch,
            minibatch_in_batch=self.minibatch_in_batch,
            microbatch=self.microbatch,
            num_microbatches=self.num_microbatches,
            is_last=self.is_last,
            global_tokens=self.global_tokens,
            global_trajectories=self.global_trajectories,
            global_loss_tokens=self.global_loss_tokens,
            trajectory_ids=self.trajectory_ids,
            gen_versions=tuple(m.gen_version for m in self.trajectories),
        )


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
            "ids": [[list(mb.trajectory_ids) for mb in row] for row in self.microbatches],
            "local_bytes": self.local_bytes,
            "remote_bytes": self.remote_bytes,
        }


class Planner:
    """Turns admitted mini-batches into :class:`MiniBatchPlan` s.

    Args:
        layout: Consumers by node.
        token_budget: Most tokens (prompt + response, before padding) per micro-batch.
        allow_split_groups: Let a group's members go to different consumers.
        locality: Prefer consumers on the node that holds a payload (consumer-aware placement).
        balance_tolerance: How far above the mean share (fraction) a local consumer may go before work
            moves to a less-loaded remote consumer.
        unit_nodes: Node of each storage-unit id (default: the unit id is the node name).
    """

    def __init__(
        self,
        layout: ConsumerLayout,
        token_budget: int,
        *,
        allow_split_groups: bool = False,
        locality: bool = True,
        balance_tolerance: float = 0.1,
        unit_nodes: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget <= 0:
            raise ConfigError(f"token_budget must be a positive int, got {token_budget!r}")
        if balance_tolerance < 0:
            raise ConfigError(f"balance_tolerance must be >= 0, got {balance_tolerance!r}")
        self.layout = layout
        self.token_budget = token_budget
        self.allow_split_groups = allow_split_groups
        self.locality = locality
        self.balance_tolerance = float(balance_tolerance)
        self.unit_nodes = dict(unit_nodes) if unit_nodes is not None else None

    def _node(self, location: str | None) -> str | None:
        if location is None:
            return None
        if self.unit_nodes is None:
            return location
        return self.unit_nodes.get(location)

    # ------------------------------------------------------------------ shares
    def assign(self, metas: Sequence[TrajectoryMeta]) -> list[list[TrajectoryMeta]]:
        """Split ``metas`` into one share per consumer (locality first, then token balance)."""
        n = self.layout.num_consumers
        if self.allow_split_groups:
            units = [[m] for m in metas]
        else:
            by_group: dict[str, list[TrajectoryMeta]] = {}
            for m in metas:
                by_group.setdefault(m.group, []).append(m)
            units = list(by_group.values())
        weights = [max(1, sum(m.num_tokens for m in u)) for u in units]
        total = sum(weights)
        cap = (1.0 + self.balance_tolerance) * total / n
        order = sorted(range(len(units)), key=lambda i: (-weights[i], units[i][0].seq, units[i][0].id))
        loads = [0] * n
        shares: list[list[TrajectoryMeta]] = [[] for _ in range(n)]
        all_ranks = range(n)
        for i in order:
            w = weights[i]
            best_all = min(all_ranks, key=lambda r: (loads[r], r))
            choice = best_all
            if self.locality:
                home = self._home(units[i])
                local = self.layout.ranks_on(home) if home is not None else ()
                if local:
                    best_local = min(local, key=lambda r: (loads[r], r))
                    choice = best_local
                    if loads[best_local] + w > cap and loads[best_all] < loads[best_local]:
                        choice = best_all
            loads[choice] += w
            shares[choice].extend(units[i])
        for s in shares:
            s.sort(key=lambda m: (m.seq, m.id))
        return shares

    def _home(self, unit: Sequence[TrajectoryMeta]) -> str | None:
        by_node: dict[str, int] = {}
        for m in unit:
            node = self._node(m.location)
            if node is not None:
                by_node[node] = by_node.get(node, 0) + max(1, m.nbytes)
        if not by_node:
            return None
        return max(by_node, key=lambda k: (by_node[k], -self.layout.nodes.index(k) if k in self.layout.nodes else 0))

    # ------------------------------------------------------------------ micro-batches
    def _ffd(self, share: Sequence[TrajectoryMeta]) -> list[list[TrajectoryMeta]]:
        bins: list[list[TrajectoryMeta]] = []
        sizes: list[int] = []
        for m in sorted(share, key=lambda m: (-m.num_tokens, m.seq, m.id)):
            for b, s in enumerate(sizes):
                if s + m.num_tokens <= self.token_budget:
                    bins[b].append(m)
                    sizes[b] += m.num_tokens
                    break
            else:
                bins.append([m])
                sizes.append(m.num_tokens)
        return bins

    def _lpt(self, share: Sequence[TrajectoryMeta], k: int) -> list[list[TrajectoryMeta]]:
        bins: list[list[TrajectoryMeta]] = [[] for _ in range(k)]
        sizes = [0] * k
        for m in sorted(share, key=lambda m: (-m.num_tokens, m.seq, m.id)):
            b = min(range(k), key=lambda j: (sizes[j], j))
            bins[b].append(m)
            sizes[b] += m.num_tokens
        return [b for b in bins if b]

    def _cut(self, share: Sequence[TrajectoryMeta], k: int, ffd: list[list[TrajectoryMeta]]) -> list[list[TrajectoryMeta]]:
        bins = ffd
        if len(ffd) < k and len(share) > len(ffd):
            lpt = self._lpt(share, min(k, len(share)))
            biggest = max(m.num_tokens for m in share)
            if max(sum(m.num_tokens for m in b) for b in lpt) <= max(self.token_budget, biggest):
                bins = lpt
        for b in bins:
            b.sort(key=lambda m: (m.seq, m.id))
        bins.sort(key=lambda b: (b[0].seq, b[0].id))
        return bins + [[] for _ in range(k - len(bins))]

    def plan(self, admitted: AdmittedLike, loss_tokens: Mapping[str, int] | None = None) -> MiniBatchPlan:
        """Plan one admitted mini-batch.

        Args:
            admitted: The admitted mini-batch (its ``trajectories`` carry ``location`` and ``seq``).
            loss_tokens: Loss-mask tokens per trajectory id, for ``global_loss_tokens`` (0 if absent).

        Raises:
            ValidationError: If the mini-batch holds a trajectory id twice.
        """
        metas = tuple(admitted.trajectories)
        ids = [m.id for m in metas]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValidationError("appears twice in one admitted mini-batch", trajectory_id=dup, field="id")
        shares = self.assign(metas)
        ffds = [self._ffd(s) for s in shares]
        k = max(1, max(len(f) for f in ffds))
        global_tokens = sum(m.num_tokens for m in metas)
        global_loss = sum(int(loss_tokens.get(m.id, 0)) for m in metas) if loss_tokens else 0
        rows: list[tuple[PlannedMicroBatch, ...]] = []
        local = remote = 0
        for rank, (share, ffd) in enumerate(zip(shares, ffds)):
            node = self.layout.node_of(rank)
            for m in share:
                if self._node(m.location) == node:
                    local += m.nbytes
                else:
                    remote += m.nbytes
            bins = self._cut(share, k, ffd) if share else [[] for _ in range(k)]
            rows.append(
                tuple(
                    PlannedMicroBatch(
                        consumer=rank,
                        train_batch=admitted.train_batch,
                        minibatch=admitted.step,
                        minibatch_in_batch=admitted.index,
                        microbatch=i,
                        num_microbatches=k,
                        global_tokens=global_tokens,
                        global_trajectories=len(metas),
                        global_loss_tokens=global_loss,
                        trajectories=tuple(b),
                    )
                    for i, b in enumerate(bins)
                )
            )
        return MiniBatchPlan(
            train_batch=admitted.train_batch,
            minibatch=admitted.step,
            minibatch_in_batch=admitted.index,
            num_microbatches=k,
            microbatches=tuple(rows),
            local_bytes=local,
            remote_bytes=remote,
        )
