"""Cutting one consumer's share into micro-batches under a token budget: first-fit decreasing, or
longest-processing-time into ``k`` bins when every consumer must run ``k`` micro-batches."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from knitdata.planner.columns import GET_TOKENS
from knitdata.record import TrajectoryMeta

__all__ = ["first_fit", "cut"]


def first_fit(share: Sequence[TrajectoryMeta], budget: int) -> tuple[list[int], list[int], list[list[int]]]:
    """First-fit decreasing of one share (in ``(seq, id)`` order): ``(tokens, order, bins of positions)``.

    Works on positions in the share: a stable sort by decreasing tokens of a share in ``(seq, id)`` order
    is the ``(-tokens, seq, id)`` order (``reverse=True`` keeps equal keys in their original order).
    """
    tok = list(map(GET_TOKENS, share))
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


def cut(
    share: Sequence[TrajectoryMeta], k: int, ffd: tuple[list[int], list[int], list[list[int]]], budget: int
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
        if max(size for size, _b in heap) <= max(budget, max(tok)):
            bins = [b for b in lpt if b]
    if len(bins) == 1:
        return [share] + [() for _ in range(k - 1)]
    for b in bins:
        b.sort()  # positions: back to (seq, id) order
    bins.sort()  # by first position: micro-batches in (seq, id) order of their first trajectory
    return [[share[j] for j in b] for b in bins] + [() for _ in range(k - len(bins))]
