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

Cost. The least-loaded searches run on heaps of integer keys ``load * consumers + rank`` (one over all
consumers, one per node, each holding one entry per rank that is raised to the rank's key when found
stale), so a unit costs O(log consumers), and the search over all consumers runs only when its answer can
change the choice. Everything else is numpy or C-level passes over the trajectories laid out unit after
unit: their counts read as one buffer (:attr:`~knitdata.record.TrajectoryMeta.packed`), unit sums, the unit
order, where units are, the bytes that stay local, and the shares: slices of whole units when each unit's
trajectories arrived in order (as admission lists a group), else one sort by ``(rank, seq)``. Plans are
:class:`PlannedMicroBatch` named tuples built in bulk. The choices, tie-breaking included (least load, then
lowest rank), are those of a linear search (see ``benchmarks/planner_before_after.py`` and ``knitdata bench
control --scale`` for the cost).

Mini-batches below :attr:`Planner.vectorize_from` trajectories (or of ``2**22`` or more), or whose
``num_tokens``, ``nbytes`` or ``seq`` are not all integers of magnitude below ``2**40``, are assigned with
Python lists instead (the same choices: numpy's per-call cost dominates small mini-batches, and int64 must
hold the sums).
"""

from __future__ import annotations

import gc
import heapq
import math
import operator
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, compress, repeat
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from knitdata.errors import ConfigError, ValidationError
from knitdata.placement import ConsumerLayout
from knitdata.record import PACKED_META, TrajectoryMeta, metas_by_group

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
_PACKED = operator.attrgetter("packed")


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


class PlannedMicroBatch(NamedTuple):
    """One consumer's micro-batch in a plan (metadata only): an immutable record.

    A :class:`~typing.NamedTuple` rather than a dataclass: a plan at cluster scale builds one per consumer
    and micro-batch (8,000 ranks: 8,000 per mini-batch), and a tuple is the cheapest immutable record
    Python builds in bulk. Read it by attribute; equality and hashing are those of its fields.

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

    Attributes:
        vectorize_from: Mini-batches of at least this many trajectories are assigned with numpy passes,
            smaller ones with Python lists (numpy's per-call cost would dominate); the plans are the same.
    """

    vectorize_from: int = 2048

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

    def _layout_index(self) -> _LayoutIndex:
        """Node positions, node per rank and the initial heaps of the layout (cached: the layout is immutable)."""
        cached = self.__dict__.get("_layout_cache")
        if cached is None or cached[0] is not self.layout:
            n = self.layout.num_consumers
            nodes = list(self.layout.nodes)
            node_pos = {node: i for i, node in enumerate(nodes)}
            index = _LayoutIndex(
                nodes=tuple(nodes),
                node_of=[self.layout.node_of(r) for r in range(n)],
                node_pos=node_pos,
                node_code=np.array([node_pos[self.layout.node_of(r)] for r in range(n)], dtype=np.int64),
                node_heaps=tuple(sorted(self.layout.ranks_on(node)) for node in nodes),
            )
            cached = (self.layout, index)
            self.__dict__["_layout_cache"] = cached
        return cached[1]

    # ------------------------------------------------------------------ shares
    def _vectorized(self, total_n: int) -> bool:
        """Whether a mini-batch of ``total_n`` trajectories is assigned with numpy passes (see the module docstring)."""
        return self.vectorize_from <= total_n < _MAX_EXACT_COUNT

    def assign(self, metas: Sequence[TrajectoryMeta]) -> list[list[TrajectoryMeta]]:
        """Split ``metas`` into one share per consumer (locality first, then token balance)."""
        return [list(s) for s in self._assign(tuple(metas))[0]]

    def _assign(
        self, metas: tuple[TrajectoryMeta, ...], group_sizes: tuple[int, ...] = (), columns: Any = None
    ) -> tuple[list[Sequence[TrajectoryMeta]], list[int], int, int, int, int]:
        """Shares (each in ``(seq, id)`` order), consumer loads, local and remote payload bytes, and the total
        and least trajectory tokens. ``group_sizes``: see :class:`AdmittedLike` (empty: scan the group ids);
        ``columns``: :func:`_packed_columns` of ``metas``, if already read.

        Units go largest first to the least-loaded consumer on their home node, or overall (see the module
        docstring). The least-loaded searches use heaps of the keys ``load * n + rank``, one over all ranks and
        one per node, each with one entry per rank at most the rank's key (loads only grow; a stale entry on top
        is raised to the key),
        so each unit costs O(log ranks) instead of O(ranks), with the same choices and tie-breaking (least
        load, then lowest rank) as a linear search; the overall search runs only when its answer can matter.
        Everything else is done by numpy over the trajectories laid out unit after unit (unit sums, the unit
        order, where units are, the bytes that stay local) and the shares are cut from one sort of all
        trajectories by ``(rank, seq)``.
        """
        n = self.layout.num_consumers
        total_n = len(metas)
        if total_n == 0:
            return [() for _ in range(n)], [0] * n, 0, 0, 0, 0
        if not self._vectorized(total_n):
            return self._assign_small(metas, group_sizes)
        index = self._layout_index()
        # lay the trajectories out unit after unit: units are the slices [starts[i], stops[i]) of `lay`
        lay: tuple[TrajectoryMeta, ...] = metas
        if self.allow_split_groups:
            starts = np.arange(total_n)
        elif group_sizes:
            starts = _group_starts(metas, group_sizes)
        else:
            groups = np.fromiter(map(_GROUP, metas), dtype=object, count=total_n)
            starts = np.concatenate(([0], np.flatnonzero(groups[1:] != groups[:-1]) + 1))
            if len(set(groups[starts].tolist())) != len(starts):  # a group in more than one run
                lay, run_starts = _regroup(metas)
                starts = np.array(run_starts, dtype=np.int64)
        n_units = len(starts)
        sizes = np.diff(starts, append=total_n)
        tokens, nbytes, seqs, _hash = columns if columns is not None and lay is metas else _packed_columns(lay)
        if tokens is None or nbytes is None or seqs is None:  # not int64-safe integers: exact Python arithmetic
            return self._assign_small(metas, group_sizes)
        locs = np.fromiter(map(_LOCATION, lay), dtype=object, count=total_n)
        # per unit: weight (tokens, at least 1) and the node of its first trajectory
        weights = np.maximum(np.add.reduceat(tokens, starts), 1)
        node_pos = index.node_pos
        n_layout = len(node_pos)
        # node codes: a layout node's position; above: nodes without consumers; -1: no node
        codes: dict[str | None, int] = {}  # node -> code
        loc_code: dict[str | None, int] = {}  # location -> code of its node

        def code_of(locations: list[str | None]) -> list[int]:
            for loc in [loc for loc in dict.fromkeys(locations) if loc not in loc_code]:
                node = self._node(loc)
                if node not in codes:
                    codes[node] = node_pos.get(node, n_layout + len(codes)) if node is not None else -1
                loc_code[loc] = codes[node]
            return list(map(loc_code.__getitem__, locations))

        first_code = np.array(code_of(locs[starts].tolist()), dtype=np.int64)
        home = first_code.copy()  # where a unit goes for locality
        # units on several locations: a change of location inside the unit
        change = np.flatnonzero(locs[1:] != locs[:-1]) + 1
        unit_of_change = np.searchsorted(starts, change, side="right") - 1
        mixed = np.unique(unit_of_change[starts[unit_of_change] != change])
        mixed_members: Any = None
        if mixed.size:
            in_mixed = np.zeros(n_units, dtype=bool)
            in_mixed[mixed] = True
            mixed_members = np.flatnonzero(np.repeat(in_mixed, sizes))
            member_codes = code_of(locs[mixed_members].tolist())
            if self.locality:  # home: the node holding most of the unit's bytes
                home[mixed] = -1  # no node, unless one holds some of its trajectories
                unit_home, node = _mixed_homes(np.repeat(mixed, sizes[mixed]), np.array(member_codes, dtype=np.int64),
                                               nbytes[mixed_members], n_layout)
                home[unit_home] = node
        order = _unit_order(weights, seqs[starts], lay, starts)
        # the main loop: one unit at a time, largest first
        # heaps hold the key `load * n + rank` of consumers (least load, then lowest rank, first): one entry per
        # rank in `heap_all` and one in its node's heap, each at most the rank's key in `keys` (loads only grow);
        # an assignment updates the entry it found on top, and a stale entry found on top is raised to the key
        local_heaps: list[list[int] | None]
        heaps = list(map(list.copy, index.node_heaps))
        local_heaps = heaps + [None] * (len(codes) + 1) if self.locality else [None] * (n_layout + len(codes) + 1)
        keys = list(range(n))
        heap_all = keys.copy()  # ascending: already a heap
        cap = (1.0 + self.balance_tolerance) * int(weights.sum()) / n
        # load + w > cap (integers against a float) <=> (load + w) * n + rank >= over, for 0 <= rank < n
        over = (math.floor(cap) + 1) * n
        unit_rank = [0] * n_units
        replace = heapq.heapreplace
        w_sorted = weights[order].tolist()
        for i, wn, h in zip(order.tolist(), map(operator.mul, w_sorted, repeat(n)), home[order].tolist()):
            heap = local_heaps[h]
            e = r = 0
            if heap is not None:  # the least-loaded consumer on the unit's home node
                e = heap[0]
                r = e % n
                while keys[r] != e:  # stale (below the rank's key): raise it to the key
                    replace(heap, keys[r])
                    e = heap[0]
                    r = e % n
            # the overall least-loaded consumer only matters without a local one, or when the local one is
            # loaded and would go over the cap
            if heap is None or (e + wn >= over and e >= n):
                ea = heap_all[0]
                ra = ea % n
                while keys[ra] != ea:
                    replace(heap_all, keys[ra])
                    ea = heap_all[0]
                    ra = ea % n
                if heap is None or ea < e - r:  # less loaded: to the least-loaded consumer overall
                    heap, e, r = heap_all, ea, ra
            e += wn
            keys[r] = e
            unit_rank[i] = r
            replace(heap, e)  # the chosen rank's entry is that heap's top
        loads = list(map(operator.floordiv, keys, repeat(n)))
        ranks = np.array(unit_rank, dtype=np.int64)
        unit_node = index.node_code[ranks]
        # bytes on the consumer's node: whole units at home, and the members of units on several nodes
        unit_bytes = np.add.reduceat(nbytes, starts)
        at_home = first_code == unit_node
        if mixed_members is not None:
            at_home[mixed] = False
            local = int(unit_bytes[at_home].sum())
            on = np.array(member_codes, dtype=np.int64) == np.repeat(unit_node[mixed], sizes[mixed])
            local += int(nbytes[mixed_members][on].sum())
        else:
            local = int(unit_bytes[at_home].sum())
        remote = int(nbytes.sum()) - local
        shares = None if self.allow_split_groups else _unit_shares(lay, seqs, starts, sizes, ranks, n)
        if shares is None:
            shares = _shares(lay, seqs, ranks if self.allow_split_groups else np.repeat(ranks, sizes), n)
        return shares, loads, local, remote, int(tokens.sum()), int(tokens.min())

    def _assign_small(
        self, metas: tuple[TrajectoryMeta, ...], group_sizes: tuple[int, ...] = ()
    ) -> tuple[list[Sequence[TrajectoryMeta]], list[int], int, int, int, int]:
        """:meth:`_assign` for small mini-batches: the same choices with Python lists and tuple heaps (no numpy).

        Below :attr:`vectorize_from` trajectories numpy's per-call cost outweighs what it saves; and it is
        exact for any numbers (int64 is not).
        """
        n = self.layout.num_consumers
        total_n = len(metas)
        index = self._layout_index()
        node_pos, node_of_rank = index.node_pos, index.node_of
        # lay the trajectories out unit after unit: units are the slices [starts[i], stops[i]) of `lay`
        if self.allow_split_groups:
            lay: Sequence[TrajectoryMeta] = metas
            starts: Sequence[int] = range(total_n)
        elif group_sizes:
            lay = metas
            starts = _group_starts(metas, group_sizes).tolist()
        else:
            groups = list(map(_GROUP, metas))
            starts = [0, *compress(range(1, total_n), map(operator.ne, groups, groups[1:]))] if total_n else []
            if len(starts) == len(set(groups)):  # every group is one contiguous run (as admission emits them)
                lay = metas
            else:
                lay, starts = _regroup(metas)
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
        node_heaps = {node: [(0, r) for r in rs] for node, rs in zip(index.nodes, index.node_heaps)}
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
        return shares, loads, local, remote, sum(tokens), min(tokens, default=0)

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
        columns = _packed_columns(metas) if self._vectorized(len(metas)) else None
        dup = _duplicate_id(metas, columns[3] if columns is not None else None)
        if dup is not None:
            raise ValidationError("appears twice in one admitted mini-batch", trajectory_id=dup, field="id")
        hint = getattr(admitted, "group_sizes", None)
        shares, loads, local, remote, global_tokens, least_tokens = self._assign(metas, tuple(hint or ()), columns)
        # K: the most first-fit-decreasing bins over consumers. A share whose load (tokens, each unit
        # counted at least 1) fits the budget needs one bin; only the others run first-fit decreasing.
        budget = self.token_budget
        if least_tokens < 0:  # not token counts: no shortcut
            budget = -1
        k = 1
        ffds: dict[int, tuple[list[int], list[int], list[list[int]]]] = {}
        for rank in compress(range(len(loads)), map(operator.lt, repeat(budget), loads)):
            if len(shares[rank]) > 1:
                ffd = self._first_fit(shares[rank])
                if len(ffd[2]) > 1:
                    ffds[rank] = ffd
                    k = max(k, len(ffd[2]))
        global_loss = sum(map(int, map(loss_tokens.get, map(_ID, metas), repeat(0)))) if loss_tokens else 0
        common = {
            "train_batch": admitted.train_batch,
            "minibatch": admitted.step,
            "minibatch_in_batch": admitted.index,
            "num_microbatches": k,
            "global_tokens": global_tokens,
            "global_trajectories": len(metas),
            "global_loss_tokens": global_loss,
        }
        rows: list[tuple[PlannedMicroBatch, ...]]
        if k == 1:
            rows = list(zip(_single_microbatches(common, shares)))
        else:
            make = _microbatch_factory(common)
            rows = []
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


def _group_starts(metas: Sequence[TrajectoryMeta], group_sizes: Sequence[int]) -> Any:
    """Where each group starts, from the sizes of the consecutive whole groups ``metas`` is made of.

    Checked without reading every trajectory: the sizes add up, and each group's first and last trajectory
    name the same group, a different one from every other group's.

    Raises:
        ValidationError: ``group_sizes`` does not describe ``metas`` (field ``group_sizes``; names the group).
    """
    sizes = np.asarray(group_sizes)
    if sizes.ndim != 1 or sizes.dtype.kind not in "iu" or (sizes < 1).any() or int(sizes.sum()) != len(metas):
        raise ValidationError(f"{len(sizes)} group sizes adding up to {int(np.sum(sizes))} do not describe "
                              f"{len(metas)} trajectories in whole groups", field="group_sizes")
    ends = np.cumsum(sizes)
    starts = ends - sizes
    if len(sizes) == 1:
        firsts, lasts = [metas[0].group], [metas[-1].group]
    else:
        firsts = list(map(_GROUP, operator.itemgetter(*starts.tolist())(metas)))
        lasts = list(map(_GROUP, operator.itemgetter(*(ends - 1).tolist())(metas)))
    if firsts != lasts or len(set(firsts)) != len(firsts):
        bad = next((a for a, b in zip(firsts, lasts) if a != b), None)
        if bad is None:
            bad = next(k for k, n in Counter(firsts).items() if n > 1)
        raise ValidationError(f"group {bad!r} is not one run of the size given for it", field="group_sizes")
    return starts


def _regroup(metas: Sequence[TrajectoryMeta]) -> tuple[tuple[TrajectoryMeta, ...], list[int]]:
    """The trajectories laid out group after group (groups in order of first appearance, members in order),
    and where each group starts."""
    by_group = metas_by_group(metas)
    lay = tuple(chain.from_iterable(by_group.values()))
    return lay, list(accumulate(map(len, by_group.values()), initial=0))[:-1]


def _single_microbatches(common: dict[str, Any], shares: list[Sequence[TrajectoryMeta]]) -> list[PlannedMicroBatch]:
    """Micro-batch 0 of every consumer (``shares[rank]``), sharing ``common`` fields, in bulk (one C-level
    pass of ``tuple.__new__``)."""
    c = common
    fields = zip(range(len(shares)), repeat(c["train_batch"]), repeat(c["minibatch"]), repeat(c["minibatch_in_batch"]),
                 repeat(0), repeat(c["num_microbatches"]), repeat(c["global_tokens"]),
                 repeat(c["global_trajectories"]), repeat(c["global_loss_tokens"]), map(tuple, shares))
    return list(map(tuple.__new__, repeat(PlannedMicroBatch), fields))


def _microbatch_factory(common: dict[str, Any]) -> Callable[[int, int, Sequence[TrajectoryMeta]], PlannedMicroBatch]:
    """A constructor of :class:`PlannedMicroBatch` es sharing ``common`` fields (positional, no keyword parsing)."""
    c = common
    head = (c["train_batch"], c["minibatch"], c["minibatch_in_batch"])
    tail = (c["num_microbatches"], c["global_tokens"], c["global_trajectories"], c["global_loss_tokens"])
    new = tuple.__new__
    cls = PlannedMicroBatch

    def make(consumer: int, microbatch: int, trajectories: Sequence[TrajectoryMeta]) -> PlannedMicroBatch:
        return new(cls, (consumer, *head, microbatch, *tail, tuple(trajectories)))

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


def _mixed_homes(unit: Any, code: Any, nbytes: Any, n_layout: int) -> tuple[Any, Any]:
    """Home of each unit on several nodes: the node holding most of its bytes (each trajectory counted at least 1).

    Args:
        unit: Unit of each trajectory (ascending, each unit's trajectories in order).
        code: Node code of each trajectory (``-1``: no node; below ``n_layout``: the node's position in the
            layout; above: a node without consumers).
        nbytes: Bytes of each trajectory.
        n_layout: Nodes of the layout.

    Returns:
        ``(units, codes)``: the units with a trajectory on a node, ascending, and their home's code. Ties go
        to the earliest node of the layout (a node without consumers ranks with the first), then to the
        node seen first in the unit.
    """
    known = np.flatnonzero(code >= 0)  # positions, in order
    if not known.size:
        return known, known
    pair = unit[known] * (int(code.max()) + 1) + code[known]
    by_pair = np.argsort(pair, kind="stable")  # stable: each pair's first position first
    sorted_pair = pair[by_pair]
    run = np.flatnonzero(np.concatenate(([True], sorted_pair[1:] != sorted_pair[:-1])))
    total = np.add.reduceat(np.maximum(nbytes[known][by_pair], 1), run)
    first = known[by_pair[run]]
    u = unit[known][by_pair[run]]
    c = code[known][by_pair[run]]
    tie = np.where(c < n_layout, -c, 0)
    best = np.lexsort((-first, tie, total, u))  # ascending: each unit's best last
    last = best[np.concatenate((u[best][1:] != u[best][:-1], [True]))]
    return u[last], c[last]


@dataclass(frozen=True)
class _LayoutIndex:
    """What assignment reads of a layout, computed once per layout."""

    nodes: tuple[str, ...]  # the layout's nodes
    node_of: list[str]  # node of each rank
    node_pos: dict[str, int]  # position of each node in the layout (its code)
    node_code: Any  # code of each rank's node (int64 array)
    node_heaps: tuple[list[int], ...]  # the ranks of each node, ascending (its initial heap), in layout order


#: Largest magnitude (exclusive) of ``num_tokens``, ``nbytes`` and ``seq``, and most trajectories, for the
#: numpy passes (sums over a mini-batch stay exact in int64); other mini-batches use Python arithmetic.
_MAX_EXACT = 1 << 40
_MAX_EXACT_COUNT = 1 << 22
_INT64_SAFE = 1 << 62  # sort keys below this fit in int64


def _int_column(metas: Sequence[TrajectoryMeta], get: Callable[[TrajectoryMeta], int]) -> Any:
    """An integer field of every trajectory as an int64 array, or ``None`` unless all are integers of magnitude
    below 2**40 (read through float64, exact below 2**53)."""
    try:
        values = np.fromiter(map(get, metas), dtype=np.float64, count=len(metas))
    except (TypeError, ValueError):
        return None
    with np.errstate(invalid="ignore"):  # NaN or infinity: not equal below
        ints = values.astype(np.int64)
    if not (ints == values).all() or float(np.abs(values).max()) >= _MAX_EXACT:
        return None
    return ints


def _packed_columns(metas: Sequence[TrajectoryMeta]) -> tuple[Any, Any, Any, Any]:
    """``num_tokens``, ``nbytes``, ``seq`` and the id's hash of every trajectory as int64 arrays: ``None`` for a
    count whose values are not all integers of magnitude below 2**40, and for the hashes when read field by field.

    One join of the trajectories' :attr:`~knitdata.record.TrajectoryMeta.packed` fields read as one buffer;
    field by field (:func:`_int_column`) when some trajectory has none.
    """
    try:
        packed = b"".join(map(_PACKED, metas))
    except (TypeError, AttributeError):  # a count that does not fit int64, or not a TrajectoryMeta
        return _int_column(metas, _TOKENS), _int_column(metas, _NBYTES), _int_column(metas, _SEQ), None
    if len(packed) != PACKED_META.size * len(metas):  # pragma: no cover - PACKED_META and the bytes disagree
        raise AssertionError("packed metadata of the wrong size")
    columns = np.frombuffer(packed, dtype="<i8").reshape(len(metas), 4).T.copy()
    counts = columns[:3]
    if len(metas):  # (no np.abs: it overflows at -2**63)
        fits = (counts.max(axis=1) < _MAX_EXACT) & (counts.min(axis=1) > -_MAX_EXACT)
    else:
        fits = np.ones(3, dtype=bool)
    tokens, nbytes, seqs, id_hash = columns
    return (tokens if fits[0] else None, nbytes if fits[1] else None, seqs if fits[2] else None, id_hash)


def _duplicate_id(metas: Sequence[TrajectoryMeta], id_hash: Any) -> str | None:
    """An id that appears twice in ``metas``, or ``None``. With the ids' hashes (``id_hash``, int64), all distinct
    settles it in one numpy sort; otherwise (or without them) the ids themselves are compared."""
    if id_hash is not None:
        h = np.sort(id_hash)
        if not (h[1:] == h[:-1]).any():  # distinct hashes: distinct ids
            return None
    ids = list(map(_ID, metas))
    if len(set(ids)) == len(ids):
        return None
    counts = Counter(ids)
    return next(i for i in ids if counts[i] > 1)


def _pair_key(major: Any, majors: int, minor: Any) -> Any:
    """The int64 key ``major * span + (minor - min(minor))`` that sorts as the pairs ``(major, minor)`` do, for
    ``0 <= major < majors``; ``None`` when it would not fit int64."""
    low = int(minor.min())
    span = int(minor.max()) - low + 1
    if majors * span >= _INT64_SAFE:
        return None
    return major * span + (minor - low)


def _unit_order(weights: Any, first_seqs: Any, lay: Sequence[TrajectoryMeta], starts: Any) -> Any:
    """Unit indices (an array) in ``(-weight, seq, id, index)`` order (``seq`` and ``id`` of the first trajectory).

    One numpy sort of the integer key ``(max weight - weight, seq)`` when those pairs are distinct (the
    common case, ``seq`` being unique in a pipeline); the full tuple sort otherwise.
    """
    n_units = len(weights)
    if n_units < 2:
        return np.arange(n_units)
    w_max = int(weights.max())
    key = _pair_key(w_max - weights, w_max - int(weights.min()) + 1, first_seqs)
    if key is not None:
        perm = np.argsort(key)
        ks = key[perm]
        if not (ks[1:] == ks[:-1]).any():
            return perm
    first = starts.tolist()
    first_ids = map(_ID, map(lay.__getitem__, first))
    keyed = sorted(zip((-weights).tolist(), first_seqs.tolist(), first_ids, range(n_units)))
    return np.array([k[3] for k in keyed], dtype=np.int64)


def _unit_shares(lay: tuple[TrajectoryMeta, ...], seqs: Any, starts: Any, sizes: Any, unit_rank: Any,
                 n: int) -> list[Sequence[TrajectoryMeta]] | None:
    """:func:`_shares` from whole units: ``None`` unless every unit's trajectories are in ascending ``seq`` order
    (as admission emits them: a group's members in arrival order).

    A rank's share is then its units' slices of ``lay`` in order of their first ``seq``: a rank with one unit
    gets a slice of ``lay``, one whose units follow each other in ``seq`` their concatenation, and only one
    whose units interleave (concurrent groups) a sort of its own trajectories by ``(seq, id)``.
    """
    ascending = seqs[1:] > seqs[:-1]
    ascending[starts[1:] - 1] = True  # across a unit boundary: no constraint
    if not ascending.all():
        return None
    first = seqs[starts]
    last = seqs[starts + sizes - 1]
    key = _pair_key(unit_rank, n, first)
    if key is None:  # pragma: no cover - seqs span more than 2**62 / ranks
        return None
    by_rank = np.argsort(key)  # units by (rank, first seq)
    r = unit_rank[by_rank]
    same = r[1:] == r[:-1]
    interleaved = set(r[1:][same & (last[by_rank[:-1]] >= first[by_rank[1:]])].tolist())
    a = starts[by_rank]
    b = a + sizes[by_rank]
    shares: list[Sequence[TrajectoryMeta]] = [()] * n
    run = np.flatnonzero(np.concatenate(([True], ~same)))  # each rank's first unit, in by_rank order
    counts = np.diff(run, append=len(r))
    alone = run[counts == 1]  # ranks with one unit: a slice of lay each
    cuts = map(lay.__getitem__, map(slice, a[alone].tolist(), b[alone].tolist()))
    deque(map(shares.__setitem__, r[alone].tolist(), cuts), 0)
    a_list, b_list = a.tolist(), b.tolist()
    for rank, i, k in zip(r[run[counts > 1]].tolist(), run[counts > 1].tolist(), counts[counts > 1].tolist()):
        merged = chain.from_iterable(lay[a_list[u] : b_list[u]] for u in range(i, i + k))
        shares[rank] = tuple(sorted(merged, key=_SEQ_ID) if rank in interleaved else merged)
    return shares


def _shares(lay: Sequence[TrajectoryMeta], seqs: Any, traj_rank: Any, n: int) -> list[Sequence[TrajectoryMeta]]:
    """Each rank's trajectories (tuples) in ``(seq, id)`` order, given the rank of each trajectory of ``lay``.

    One numpy sort of all trajectories by ``(rank, seq)``; equal ``seq`` s on one rank (rare) then by id.
    """
    key = _pair_key(traj_rank, n, seqs)
    if key is not None:
        perm = np.argsort(key)
        ks = key[perm]
        ties = np.flatnonzero(ks[1:] == ks[:-1])
    else:  # pragma: no cover - seqs span more than 2**62 / ranks
        perm = np.lexsort((seqs, traj_rank))
        sr, rr = seqs[perm], traj_rank[perm]
        ties = np.flatnonzero((sr[1:] == sr[:-1]) & (rr[1:] == rr[:-1]))
    flat = operator.itemgetter(*perm.tolist())(lay) if len(lay) > 1 else tuple(lay)
    counts = np.bincount(traj_rank, minlength=n)
    held = np.flatnonzero(counts)  # ranks with trajectories (at cluster scale, many may have none)
    shares: list[Sequence[TrajectoryMeta]]
    if 2 * len(held) < n:  # mostly empty: slice only the ranks that hold some
        ends = np.cumsum(counts[held])
        shares = [()] * n
        cuts = map(flat.__getitem__, map(slice, (ends - counts[held]).tolist(), ends.tolist()))
        deque(map(shares.__setitem__, held.tolist(), cuts), 0)
    else:
        bounds = [0, *accumulate(counts.tolist())]
        shares = list(map(flat.__getitem__, map(slice, bounds, bounds[1:])))
    if ties.size:  # equal seqs on one rank: by id
        for r in set(traj_rank[perm[ties]].tolist()):
            shares[r] = tuple(sorted(shares[r], key=_SEQ_ID))
    return shares
