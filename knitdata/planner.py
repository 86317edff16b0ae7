"""Planning: an admitted mini-batch becomes per-consumer shares cut into micro-batches.

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

Cost. The least-loaded searches run on heaps (one over all consumers, one per node, lazily invalidated),
so a unit costs O(log consumers), and per-trajectory work is done in C-level passes: one mini-batch of
64,000 trajectories over 8,000 consumers plans in about 150 ms on a shared 2-core machine (``knitdata bench control
--scale``). The choices, tie-breaking included (least load, then lowest rank), are those of a linear search.
"""

from __future__ import annotations

import gc
import heapq
import operator
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, compress
from typing import TYPE_CHECKING, Any, Protocol

from knitdata.errors import ConfigError, ValidationError
from knitdata.placement import ConsumerLayout
from knitdata.record import TrajectoryMeta

if TYPE_CHECKING:  # pragma: no cover
    from knitdata.collate import MicroBatchInfo

__all__ = ["AdmittedLike", "PlannedMicroBatch", "MiniBatchPlan", "Planner"]

_GROUP = operator.attrgetter("group")
_TOKENS = operator.attrgetter("num_tokens")
_NBYTES = operator.attrgetter("nbytes")
_SEQ = operator.attrgetter("seq")
_SEQ_ID = operator.attrgetter("seq", "id")
_ID = operator.attrgetter("id")
_LOCATION = operator.attrgetter("location")


class AdmittedLike(Protocol):
    """What the planner reads of an admitted mini-batch (:class:`knitdata.admission.AdmittedMiniBatch`)."""

    @property
    def train_batch(self) -> int: ...

    @property
    def index(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def trajectories(self) -> tuple[TrajectoryMeta, ...]: ...


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

    def _layout_index(self) -> tuple[dict[str, int], dict[str, tuple[int, ...]], list[str]]:
        """Node positions, ranks per node and node per rank of the layout (cached: the layout is immutable)."""
        cached = self.__dict__.get("_layout_cache")
        if cached is None or cached[0] is not self.layout:
            nodes = list(self.layout.nodes)
            node_pos = {node: i for i, node in enumerate(nodes)}
            ranks_on = {node: tuple(self.layout.ranks_on(node)) for node in nodes}
            node_of = [self.layout.node_of(r) for r in range(self.layout.num_consumers)]
            cached = (self.layout, (node_pos, ranks_on, node_of))
            self.__dict__["_layout_cache"] = cached
        return cached[1]

    # ------------------------------------------------------------------ shares
    def assign(self, metas: Sequence[TrajectoryMeta]) -> list[list[TrajectoryMeta]]:
        """Split ``metas`` into one share per consumer (locality first, then token balance)."""
        return [list(s) for s in self._assign(tuple(metas))[0]]

    def _assign(
        self, metas: tuple[TrajectoryMeta, ...]
    ) -> tuple[list[Sequence[TrajectoryMeta]], list[int], int, int, list[int]]:
        """Shares (each in ``(seq, id)`` order), consumer loads, local and remote payload bytes, and tokens.

        Units go largest first to the least-loaded consumer on their home node, or overall (see the module
        docstring). The least-loaded searches use heaps of ``(load, rank)`` with lazy invalidation (an entry
        is current when its load is the rank's load; loads only grow), one over all ranks and one per node,
        so each unit costs O(log ranks) instead of O(ranks), with the same choices and tie-breaking (least
        load, then lowest rank) as a linear search. Per-trajectory work is done by C-level passes (``map``,
        slices) over the trajectories laid out unit after unit.
        """
        n = self.layout.num_consumers
        total_n = len(metas)
        node_pos, ranks_on, node_of_rank = self._layout_index()
        # lay the trajectories out unit after unit: units are the slices [starts[i], stops[i]) of `lay`
        if self.allow_split_groups:
            lay: Sequence[TrajectoryMeta] = metas
            starts: Sequence[int] = range(total_n)
        else:
            groups = list(map(_GROUP, metas))
            starts = [0, *compress(range(1, total_n), map(operator.ne, groups, groups[1:]))] if total_n else []
            if len(starts) == len(set(groups)):  # every group is one contiguous run (as admission emits them)
                lay = metas
            else:
                by_group: dict[str, list[TrajectoryMeta]] = {}
                for m in metas:
                    u = by_group.get(m.group)
                    if u is None:
                        by_group[m.group] = [m]
                    else:
                        u.append(m)
                lay = tuple(chain.from_iterable(by_group.values()))
                starts = list(accumulate((len(u) for u in by_group.values()), initial=0))[:-1]
        stops = [*starts[1:], total_n]
        n_units = len(starts)
        tokens = list(map(_TOKENS, lay))
        nbytes = list(map(_NBYTES, lay))
        seqs = list(map(_SEQ, lay))
        locs = list(map(_LOCATION, lay))
        if self.unit_nodes is None:
            loc_node: list[str | None] = locs
        else:
            get = self.unit_nodes.get
            loc_node = [None if loc is None else get(loc) for loc in locs]
        if self.allow_split_groups:
            weights = [t if t > 1 else 1 for t in tokens]
            keyed = sorted(zip(map(operator.neg, weights), seqs, map(_ID, lay), range(n_units)))
        else:
            weights = [max(1, sum(tokens[a:b])) for a, b in zip(starts, stops)]
            keyed = sorted(
                zip(map(operator.neg, weights), [seqs[a] for a in starts], [lay[a].id for a in starts], range(n_units))
            )
        cap = (1.0 + self.balance_tolerance) * sum(weights) / n
        loads = [0] * n
        unit_rank = [0] * n_units
        heap_all = [(0, r) for r in range(n)]  # ascending: already a heap
        node_heaps = {node: [(0, r) for r in sorted(rs)] for node, rs in ranks_on.items() if rs}
        locality = self.locality
        push, pop = heapq.heappush, heapq.heappop
        local = remote = 0
        for _nw, _seq, _id, i in keyed:
            w = weights[i]
            a = starts[i]
            b = stops[i]
            if b - a == 1:
                mixed = None
                home = loc_node[a]
            else:
                mixed = loc_node[a:b]
                home = mixed[0]
                if mixed.count(home) == b - a:
                    mixed = None  # one node (or none) holds the whole unit
                elif locality:
                    home = _mixed_home(mixed, nbytes[a:b], node_pos)
            load, best_all = heap_all[0]
            while loads[best_all] != load:
                pop(heap_all)
                load, best_all = heap_all[0]
            choice = best_all
            if locality and home is not None:
                heap = node_heaps.get(home)
                if heap:
                    load_l, best_local = heap[0]
                    while loads[best_local] != load_l:
                        pop(heap)
                        load_l, best_local = heap[0]
                    choice = best_local
                    if load_l + w > cap and load < load_l:
                        choice = best_all
            new_load = loads[choice] + w
            loads[choice] = new_load
            unit_rank[i] = choice
            push(heap_all, (new_load, choice))
            node = node_of_rank[choice]
            push(node_heaps[node], (new_load, choice))
            if mixed is None:
                ub = nbytes[a] if b - a == 1 else sum(nbytes[a:b])
                if home == node:
                    local += ub
                else:
                    remote += ub
            else:
                for x, nb in zip(mixed, nbytes[a:b]):
                    if x == node:
                        local += nb
                    else:
                        remote += nb
        # shares in (seq, id) order
        units_of: list[list[int]] = [[] for _ in range(n)]
        for i, r in enumerate(unit_rank):
            units_of[r].append(i)
        presorted = all(map(operator.lt, seqs, seqs[1:]))  # laid out in (seq, id) order already
        key = _SEQ if presorted or len(set(seqs)) == total_n else _SEQ_ID
        shares: list[Sequence[TrajectoryMeta]] = []
        for us in units_of:
            if not us:
                shares.append(())
            elif len(us) == 1:
                a, b = starts[us[0]], stops[us[0]]
                shares.append(lay[a:b] if presorted else sorted(lay[a:b], key=key))
            else:
                shares.append(sorted(chain.from_iterable(lay[starts[i] : stops[i]] for i in us), key=key))
        return shares, loads, local, remote, tokens

    # ------------------------------------------------------------------ micro-batches
    def _first_fit(self, share: Sequence[TrajectoryMeta]) -> tuple[list[int], list[int], list[list[int]]]:
        """First-fit decreasing of one share (in ``(seq, id)`` order): ``(tokens, order, bins of positions)``.

        Works on positions in the share: a stable sort by decreasing tokens of a share in ``(seq, id)`` order
        is the ``(-tokens, seq, id)`` order (``reverse=True`` keeps equal keys in their original order).
        """
        budget = self.token_budget
        tok = list(map(_TOKENS, share))
        order = sorted(range(len(share)), key=tok.__getitem__, reverse=True)
        bins: list[list[int]] = []
        sizes: list[int] = []
        # bins before `lo` cannot take even the smallest trajectory: first fit never looks at them again
        least = tok[order[-1]] if order else 0
        lo = 0
        for j in order:
            t = tok[j]
            room = budget - t
            for b in range(lo, len(sizes)):
                if sizes[b] <= room:
                    bins[b].append(j)
                    sizes[b] += t
                    if b == lo:
                        while lo < len(sizes) and budget - sizes[lo] < least:
                            lo += 1
                    break
            else:
                bins.append([j])
                sizes.append(t)
                while lo < len(sizes) and budget - sizes[lo] < least:
                    lo += 1
        return tok, order, bins

    def _cut(
        self, share: Sequence[TrajectoryMeta], k: int, ffd: tuple[list[int], list[int], list[list[int]]]
    ) -> list[Sequence[TrajectoryMeta]]:
        """Micro-batches of one share: its first-fit bins, or LPT into ``k`` bins when that fits the budget."""
        tok, order, bins = ffd
        if len(bins) < k and len(share) > len(bins):
            kk = min(k, len(share))
            lpt: list[list[int]] = [[] for _ in range(kk)]
            heap = [(0, b) for b in range(kk)]  # (size, bin): least size, then lowest bin, as a linear min
            for j in order:
                size, bi = heap[0]
                lpt[bi].append(j)
                heapq.heapreplace(heap, (size + tok[j], bi))
            if max(size for size, _b in heap) <= max(self.token_budget, max(tok)):
                bins = [b for b in lpt if b]
        if len(bins) == 1:
            return [share] + [() for _ in range(k - 1)]
        for b in bins:
            b.sort()  # positions: back to (seq, id) order
        bins.sort()  # by first position: micro-batches in (seq, id) order of their first trajectory
        return [[share[j] for j in b] for b in bins] + [() for _ in range(k - len(bins))]

    def plan(self, admitted: AdmittedLike, loss_tokens: Mapping[str, int] | None = None) -> MiniBatchPlan:
        """Plan one admitted mini-batch.

        Args:
            admitted: The admitted mini-batch (its ``trajectories`` carry ``location`` and ``seq``).
            loss_tokens: Loss-mask tokens per trajectory id, for ``global_loss_tokens`` (0 if absent).

        Raises:
            ValidationError: If the mini-batch holds a trajectory id twice.
        """
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a plan allocates ~100k short-lived tuples: pausing the collector halves its cost
        try:
            return self._plan(admitted, loss_tokens)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _plan(self, admitted: AdmittedLike, loss_tokens: Mapping[str, int] | None) -> MiniBatchPlan:
        metas = tuple(admitted.trajectories)
        ids = list(map(_ID, metas))
        if len(set(ids)) != len(ids):
            counts = Counter(ids)
            dup = next(i for i in ids if counts[i] > 1)
            raise ValidationError("appears twice in one admitted mini-batch", trajectory_id=dup, field="id")
        shares, loads, local, remote, tokens = self._assign(metas)
        # K: the most first-fit-decreasing bins over consumers. A share whose load (tokens, each unit
        # counted at least 1) fits the budget needs one bin; only the others run first-fit decreasing.
        budget = self.token_budget
        if min(tokens, default=0) < 0:  # not token counts: no shortcut
            budget = -1
        k = 1
        ffds: dict[int, tuple[list[int], list[int], list[list[int]]]] = {}
        for rank, load in enumerate(loads):
            if load > budget and len(shares[rank]) > 1:
                ffd = self._first_fit(shares[rank])
                if len(ffd[2]) > 1:
                    ffds[rank] = ffd
                    k = max(k, len(ffd[2]))
        global_tokens = sum(tokens)
        global_loss = sum(int(loss_tokens.get(i, 0)) for i in ids) if loss_tokens else 0
        common = {
            "train_batch": admitted.train_batch,
            "minibatch": admitted.step,
            "minibatch_in_batch": admitted.index,
            "num_microbatches": k,
            "global_tokens": global_tokens,
            "global_trajectories": len(metas),
            "global_loss_tokens": global_loss,
        }
        make = _microbatch_factory(common)
        rows: list[tuple[PlannedMicroBatch, ...]] = []
        if k == 1:
            for rank, share in enumerate(shares):
                rows.append((make(rank, 0, share),))
        else:
            for rank, share in enumerate(shares):
                if not share:
                    rows.append(tuple(make(rank, i, ()) for i in range(k)))
                elif len(share) == 1:
                    rows.append((make(rank, 0, share), *(make(rank, i, ()) for i in range(1, k))))
                else:
                    ffd = ffds.get(rank) or self._first_fit(share)
                    rows.append(tuple(make(rank, i, b) for i, b in enumerate(self._cut(share, k, ffd))))
        return MiniBatchPlan(
            train_batch=admitted.train_batch,
            minibatch=admitted.step,
            minibatch_in_batch=admitted.index,
            num_microbatches=k,
            microbatches=tuple(rows),
            local_bytes=local,
            remote_bytes=remote,
        )


def _microbatch_factory(common: dict[str, Any]) -> Callable[[int, int, Sequence[TrajectoryMeta]], PlannedMicroBatch]:
    """A fast constructor of :class:`PlannedMicroBatch` es sharing ``common`` fields.

    The same fields and values as the dataclass constructor (so equality, hashing and ``repr`` are the
    same), without its per-field frozen ``__setattr__`` calls: a plan at cluster scale builds tens of
    thousands of them.
    """
    new = object.__new__
    setattr_ = object.__setattr__
    cls = PlannedMicroBatch

    def make(consumer: int, microbatch: int, trajectories: Sequence[TrajectoryMeta]) -> PlannedMicroBatch:
        obj = new(cls)
        d = dict(common)
        d["consumer"] = consumer
        d["microbatch"] = microbatch
        d["trajectories"] = tuple(trajectories)
        setattr_(obj, "__dict__", d)
        return obj

    return make


def _mixed_home(unit_nodes: list[str | None], nbytes: list[int], node_pos: dict[str, int]) -> str | None:
    """The node holding most of a unit's bytes (ties: the earliest node of the layout, then the first seen)."""
    by_node: dict[str, int] = {}
    for node, b in zip(unit_nodes, nbytes):
        if node is not None:
            by_node[node] = by_node.get(node, 0) + (b if b > 1 else 1)
    if not by_node:
        return None
    return max(by_node, key=lambda k: (by_node[k], -node_pos[k] if k in node_pos else 0))
