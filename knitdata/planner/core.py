"""The :class:`Planner`: assignment of an admitted mini-batch to consumers, and the cut into micro-batches.

See :mod:`knitdata.planner` for the rules and their cost.
"""

from __future__ import annotations

import gc
import heapq
import math
import operator
from collections.abc import Mapping, Sequence
from itertools import chain, compress, repeat
from typing import Any

import numpy as np

from knitdata.errors import ConfigError, ValidationError
from knitdata.placement import ConsumerLayout
from knitdata.planner.columns import (
    GET_GROUP,
    GET_ID,
    GET_LOCATION,
    GET_NBYTES,
    GET_SEQ,
    GET_SEQ_ID,
    GET_TOKENS,
    MAX_EXACT_COUNT,
    LayoutIndex,
    duplicate_id,
    group_starts,
    mixed_home,
    mixed_homes,
    packed_columns,
    regroup,
    split_shares,
    unit_order,
    unit_shares,
)
from knitdata.planner.microbatches import cut, first_fit
from knitdata.planner.records import (
    AdmittedLike,
    MiniBatchPlan,
    planned_rows,
)
from knitdata.record import TrajectoryMeta

__all__ = ["Planner"]



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

    def _layout_index(self) -> LayoutIndex:
        """Node positions, node per rank and the initial heaps of the layout (cached: the layout is immutable)."""
        cached = self.__dict__.get("_layout_cache")
        if cached is None or cached[0] is not self.layout:
            n = self.layout.num_consumers
            nodes = list(self.layout.nodes)
            node_pos = {node: i for i, node in enumerate(nodes)}
            index = LayoutIndex(
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
        return self.vectorize_from <= total_n < MAX_EXACT_COUNT

    def assign(self, metas: Sequence[TrajectoryMeta]) -> list[list[TrajectoryMeta]]:
        """Split ``metas`` into one share per consumer (locality first, then token balance)."""
        return [list(s) for s in self._assign(tuple(metas))[0]]

    def _assign(
        self, metas: tuple[TrajectoryMeta, ...], group_sizes: tuple[int, ...] = (), columns: Any = None
    ) -> tuple[list[Sequence[TrajectoryMeta]], list[int], int, int, int, int]:
        """Shares (each in ``(seq, id)`` order), consumer loads, local and remote payload bytes, and the total
        and least trajectory tokens. ``group_sizes``: see :class:`AdmittedLike` (empty: scan the group ids);
        ``columns``: :func:`packed_columns` of ``metas``, if already read.

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
            starts = group_starts(metas, group_sizes)
        else:
            groups = np.fromiter(map(GET_GROUP, metas), dtype=object, count=total_n)
            starts = np.concatenate(([0], np.flatnonzero(groups[1:] != groups[:-1]) + 1))
            if len(set(groups[starts].tolist())) != len(starts):  # a group in more than one run
                lay, run_starts = regroup(metas)
                starts = np.array(run_starts, dtype=np.int64)
        n_units = len(starts)
        sizes = np.diff(starts, append=total_n)
        tokens, nbytes, seqs, _hash = columns if columns is not None and lay is metas else packed_columns(lay)
        if tokens is None or nbytes is None or seqs is None:  # not int64-safe integers: exact Python arithmetic
            return self._assign_small(metas, group_sizes)
        locs = np.fromiter(map(GET_LOCATION, lay), dtype=object, count=total_n)
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
                unit_home, node = mixed_homes(np.repeat(mixed, sizes[mixed]), np.array(member_codes, dtype=np.int64),
                                               nbytes[mixed_members], n_layout)
                home[unit_home] = node
        order = unit_order(weights, seqs[starts], lay, starts)
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
        shares = None if self.allow_split_groups else unit_shares(lay, seqs, starts, sizes, ranks, n)
        if shares is None:
            shares = split_shares(lay, seqs, ranks if self.allow_split_groups else np.repeat(ranks, sizes), n)
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
            starts = group_starts(metas, group_sizes).tolist()
        else:
            groups = list(map(GET_GROUP, metas))
            starts = [0, *compress(range(1, total_n), map(operator.ne, groups, groups[1:]))] if total_n else []
            if len(starts) == len(set(groups)):  # every group is one contiguous run (as admission emits them)
                lay = metas
            else:
                lay, starts = regroup(metas)
        stops = [*starts[1:], total_n]
        n_units = len(starts)
        tokens = list(map(GET_TOKENS, lay))
        nbytes = list(map(GET_NBYTES, lay))
        seqs = list(map(GET_SEQ, lay))
        locs = list(map(GET_LOCATION, lay))
        if self.unit_nodes is None:
            loc_node: list[str | None] = locs
        else:
            get = self.unit_nodes.get
            loc_node = [None if loc is None else get(loc) for loc in locs]
        if self.allow_split_groups:
            weights = [t if t > 1 else 1 for t in tokens]
            keyed = sorted(zip(map(operator.neg, weights), seqs, map(GET_ID, lay), range(n_units)))
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
                    home = mixed_home(mixed, nbytes[a:b], node_pos)
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
        key = GET_SEQ if presorted or len(set(seqs)) == total_n else GET_SEQ_ID
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
        columns = packed_columns(metas) if self._vectorized(len(metas)) else None
        dup = duplicate_id(metas, columns[3] if columns is not None else None)
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
                ffd = first_fit(shares[rank], self.token_budget)
                if len(ffd[2]) > 1:
                    ffds[rank] = ffd
                    k = max(k, len(ffd[2]))
        global_loss = sum(map(int, map(loss_tokens.get, map(GET_ID, metas), repeat(0)))) if loss_tokens else 0
        common = {
            "train_batch": admitted.train_batch,
            "minibatch": admitted.step,
            "minibatch_in_batch": admitted.index,
            "num_microbatches": k,
            "global_tokens": global_tokens,
            "global_trajectories": len(metas),
            "global_loss_tokens": global_loss,
        }
        bins: list[Sequence[TrajectoryMeta]]  # each rank's k micro-batches in turn
        if k == 1:
            bins = shares
        else:
            bins = []
            pad = [()] * (k - 1)
            for rank, share in enumerate(shares):
                if len(share) < 2:
                    bins += (share, *pad)  # (an empty share: k empty micro-batches)
                else:
                    ffd = ffds.get(rank) or first_fit(share, self.token_budget)
                    bins += cut(share, k, ffd, self.token_budget)
        rows = planned_rows(common, k, bins)
        return MiniBatchPlan(
            train_batch=admitted.train_batch,
            minibatch=admitted.step,
            minibatch_in_batch=admitted.index,
            num_microbatches=k,
            microbatches=tuple(rows),
            local_bytes=local,
            remote_bytes=remote,
        )
