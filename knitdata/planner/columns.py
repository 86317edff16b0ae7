"""Passes over a mini-batch's trajectories for the planner: numpy columns, group layout, unit order and shares.

Every function here returns what a linear, per-trajectory pass would (the planner's choices do not depend on
whether a mini-batch is vectorized); see :mod:`knitdata.planner` for when each path runs.
"""

from __future__ import annotations

import operator
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any

import numpy as np

from knitdata.errors import ValidationError
from knitdata.record import PACKED_META, TrajectoryMeta, metas_by_group

__all__ = [
    "LayoutIndex",
    "MAX_EXACT",
    "MAX_EXACT_COUNT",
    "group_starts",
    "regroup",
    "mixed_home",
    "mixed_homes",
    "int_column",
    "packed_columns",
    "duplicate_id",
    "pair_key",
    "unit_order",
    "unit_shares",
    "split_shares",
]

#: Field readers of :class:`~knitdata.record.TrajectoryMeta` (C-level, for ``map``), shared with the planner.
GET_GROUP = operator.attrgetter("group")
GET_TOKENS = operator.attrgetter("num_tokens")
GET_NBYTES = operator.attrgetter("nbytes")
GET_SEQ = operator.attrgetter("seq")
GET_SEQ_ID = operator.attrgetter("seq", "id")
GET_ID = operator.attrgetter("id")
GET_LOCATION = operator.attrgetter("location")
_PACKED = operator.attrgetter("packed")


def group_starts(metas: Sequence[TrajectoryMeta], group_sizes: Sequence[int]) -> Any:
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
        firsts = list(map(GET_GROUP, operator.itemgetter(*starts.tolist())(metas)))
        lasts = list(map(GET_GROUP, operator.itemgetter(*(ends - 1).tolist())(metas)))
    if firsts != lasts or len(set(firsts)) != len(firsts):
        bad = next((a for a, b in zip(firsts, lasts) if a != b), None)
        if bad is None:
            bad = next(k for k, n in Counter(firsts).items() if n > 1)
        raise ValidationError(f"group {bad!r} is not one run of the size given for it", field="group_sizes")
    return starts


def regroup(metas: Sequence[TrajectoryMeta]) -> tuple[tuple[TrajectoryMeta, ...], list[int]]:
    """The trajectories laid out group after group (groups in order of first appearance, members in order),
    and where each group starts."""
    by_group = metas_by_group(metas)
    lay = tuple(chain.from_iterable(by_group.values()))
    return lay, list(accumulate(map(len, by_group.values()), initial=0))[:-1]



def mixed_home(unit_nodes: list[str | None], nbytes: list[int], node_pos: dict[str, int]) -> str | None:
    """The node holding most of a unit's bytes (ties: the earliest node of the layout, then the first seen)."""
    by_node: dict[str, int] = {}
    for node, b in zip(unit_nodes, nbytes):
        if node is not None:
            by_node[node] = by_node.get(node, 0) + (b if b > 1 else 1)
    if not by_node:
        return None
    return max(by_node, key=lambda k: (by_node[k], -node_pos[k] if k in node_pos else 0))


def mixed_homes(unit: Any, code: Any, nbytes: Any, n_layout: int) -> tuple[Any, Any]:
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
class LayoutIndex:
    """What assignment reads of a layout, computed once per layout."""

    nodes: tuple[str, ...]  # the layout's nodes
    node_of: list[str]  # node of each rank
    node_pos: dict[str, int]  # position of each node in the layout (its code)
    node_code: Any  # code of each rank's node (int64 array)
    node_heaps: tuple[list[int], ...]  # the ranks of each node, ascending (its initial heap), in layout order


#: Largest magnitude (exclusive) of ``num_tokens``, ``nbytes`` and ``seq``, and most trajectories, for the
#: numpy passes (sums over a mini-batch stay exact in int64); other mini-batches use Python arithmetic.
MAX_EXACT = 1 << 40
MAX_EXACT_COUNT = 1 << 22
_INT64_SAFE = 1 << 62  # sort keys below this fit in int64


def int_column(metas: Sequence[TrajectoryMeta], get: Callable[[TrajectoryMeta], int]) -> Any:
    """An integer field of every trajectory as an int64 array, or ``None`` unless all are integers of magnitude
    below 2**40 (read through float64, exact below 2**53)."""
    try:
        values = np.fromiter(map(get, metas), dtype=np.float64, count=len(metas))
    except (TypeError, ValueError):
        return None
    with np.errstate(invalid="ignore"):  # NaN or infinity: not equal below
        ints = values.astype(np.int64)
    if not (ints == values).all() or float(np.abs(values).max()) >= MAX_EXACT:
        return None
    return ints


def packed_columns(metas: Sequence[TrajectoryMeta]) -> tuple[Any, Any, Any, Any]:
    """``num_tokens``, ``nbytes``, ``seq`` and the id's hash of every trajectory as int64 arrays: ``None`` for a
    count whose values are not all integers of magnitude below 2**40, and for the hashes when read field by field.

    One join of the trajectories' :attr:`~knitdata.record.TrajectoryMeta.packed` fields read as one buffer;
    field by field (:func:`int_column`) when some trajectory has none.
    """
    try:
        packed = b"".join(map(_PACKED, metas))
    except (TypeError, AttributeError):  # a count that does not fit int64, or not a TrajectoryMeta
        return int_column(metas, GET_TOKENS), int_column(metas, GET_NBYTES), int_column(metas, GET_SEQ), None
    if len(packed) != PACKED_META.size * len(metas):  # pragma: no cover - PACKED_META and the bytes disagree
        raise AssertionError("packed metadata of the wrong size")
    columns = np.frombuffer(packed, dtype="<i8").reshape(len(metas), 4).T.copy()
    counts = columns[:3]
    if len(metas):  # (no np.abs: it overflows at -2**63)
        fits = (counts.max(axis=1) < MAX_EXACT) & (counts.min(axis=1) > -MAX_EXACT)
    else:
        fits = np.ones(3, dtype=bool)
    tokens, nbytes, seqs, id_hash = columns
    return (tokens if fits[0] else None, nbytes if fits[1] else None, seqs if fits[2] else None, id_hash)


def duplicate_id(metas: Sequence[TrajectoryMeta], id_hash: Any) -> str | None:
    """An id that appears twice in ``metas``, or ``None``. With the ids' hashes (``id_hash``, int64), all distinct
    settles it in one numpy sort; otherwise (or without them) the ids themselves are compared."""
    if id_hash is not None:
        h = np.sort(id_hash)
        if not (h[1:] == h[:-1]).any():  # distinct hashes: distinct ids
            return None
    ids = list(map(GET_ID, metas))
    if len(set(ids)) == len(ids):
        return None
    counts = Counter(ids)
    return next(i for i in ids if counts[i] > 1)


def pair_key(major: Any, majors: int, minor: Any) -> Any:
    """The int64 key ``major * span + (minor - min(minor))`` that sorts as the pairs ``(major, minor)`` do, for
    ``0 <= major < majors``; ``None`` when it would not fit int64."""
    low = int(minor.min())
    span = int(minor.max()) - low + 1
    if majors * span >= _INT64_SAFE:
        return None
    return major * span + (minor - low)


def unit_order(weights: Any, first_seqs: Any, lay: Sequence[TrajectoryMeta], starts: Any) -> Any:
    """Unit indices (an array) in ``(-weight, seq, id, index)`` order (``seq`` and ``id`` of the first trajectory).

    One numpy sort of the integer key ``(max weight - weight, seq)`` when those pairs are distinct (the
    common case, ``seq`` being unique in a pipeline); the full tuple sort otherwise.
    """
    n_units = len(weights)
    if n_units < 2:
        return np.arange(n_units)
    w_max = int(weights.max())
    key = pair_key(w_max - weights, w_max - int(weights.min()) + 1, first_seqs)
    if key is not None:
        perm = np.argsort(key)
        ks = key[perm]
        if not (ks[1:] == ks[:-1]).any():
            return perm
    first = starts.tolist()
    first_ids = map(GET_ID, map(lay.__getitem__, first))
    keyed = sorted(zip((-weights).tolist(), first_seqs.tolist(), first_ids, range(n_units)))
    return np.array([k[3] for k in keyed], dtype=np.int64)


def unit_shares(lay: tuple[TrajectoryMeta, ...], seqs: Any, starts: Any, sizes: Any, unit_rank: Any,
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
    key = pair_key(unit_rank, n, first)
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
        shares[rank] = tuple(sorted(merged, key=GET_SEQ_ID) if rank in interleaved else merged)
    return shares


def split_shares(lay: Sequence[TrajectoryMeta], seqs: Any, traj_rank: Any, n: int) -> list[Sequence[TrajectoryMeta]]:
    """Each rank's trajectories (tuples) in ``(seq, id)`` order, given the rank of each trajectory of ``lay``.

    One numpy sort of all trajectories by ``(rank, seq)``; equal ``seq`` s on one rank (rare) then by id.
    """
    key = pair_key(traj_rank, n, seqs)
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
            shares[r] = tuple(sorted(shares[r], key=GET_SEQ_ID))
    return shares
