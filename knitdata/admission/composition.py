"""The exact feasibility check of constraint-preserving admission: pure functions, in group units."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["completion_exists", "even_completion", "composition_limits"]


def completion_exists(
    remaining: Mapping[str, int], num_left: int, size: int, bounds: Mapping[str, tuple[int, int]]
) -> bool:
    """Whether an integral ``S x K`` matrix exists with row sums ``remaining``, column sums ``size`` and
    entries of row ``s`` within ``bounds[s]`` (``K = num_left``).

    Exact: it exists iff ``sum(remaining) == K * size`` and ``K*lo_s <= remaining_s <= K*hi_s`` for every
    ``s`` (necessity is immediate; :func:`even_completion` constructs the matrix, proving sufficiency).
    """
    if num_left == 0:
        return all(r == 0 for r in remaining.values())
    if sum(remaining.values()) != num_left * size:
        return False
    return all(num_left * bounds[s][0] <= r <= num_left * bounds[s][1] for s, r in remaining.items())


def even_completion(remaining: Mapping[str, int], num_left: int) -> list[dict[str, int]]:
    """Construct the completion of :func:`completion_exists`: each row split as evenly as possible.

    Row ``s`` gets ``floor(r_s / K)`` in every column plus one extra in ``r_s mod K`` columns, chosen
    cyclically with one pointer shared by all rows (sources in sorted order). The cyclic fill hands out
    the ``E = sum_s (r_s mod K)`` extras round-robin, so when ``E`` is a multiple of ``K`` (true whenever
    ``sum(remaining) == K * size``) every column gets exactly ``E / K`` extras and sums to ``size``; each
    entry is ``floor(r_s/K)`` or ``ceil(r_s/K)``, hence within ``[lo_s, hi_s]`` whenever
    ``K*lo_s <= r_s <= K*hi_s``.

    Args:
        remaining: Row sums per source.
        num_left: ``K``, the number of columns.

    Returns:
        ``K`` dicts ``{source: entry}``.
    """
    cols: list[dict[str, int]] = [{} for _ in range(num_left)]
    ptr = 0
    for s in sorted(remaining):
        base, extra = divmod(remaining[s], num_left)
        for c in range(num_left):
            cols[c][s] = base
        for j in range(extra):
            cols[(ptr + j) % num_left][s] += 1
        ptr = (ptr + extra) % num_left
    return cols


def composition_limits(
    remaining: Mapping[str, int],
    ready: Mapping[str, int],
    num_left: int,
    size: int,
    bounds: Mapping[str, tuple[int, int]],
) -> tuple[dict[str, int], dict[str, int]] | None:
    """Per-source ``[lo'_s, hi'_s]`` for the next mini-batch such that the rest stays completable.

    In group units. With ``R_s = remaining[s]`` (quota still to admit in this train batch), ``K =
    num_left`` mini-batches after this one, bounds ``[L_s, H_s]`` and ``r_s = ready[s]``, a composition
    ``x`` (``sum x = size``) is admissible iff ``lo'_s <= x_s <= hi'_s`` for every ``s`` where
    ``lo'_s = max(L_s, R_s - K*H_s)`` and ``hi'_s = min(H_s, R_s - K*L_s, r_s)``: by
    :func:`completion_exists` the rest is completable iff ``K*L_s <= R_s - x_s <= K*H_s`` for every
    ``s`` (the column-sum condition ``sum(R - x) = K*size`` holds by construction). An integral ``x``
    with fixed sum in a box exists iff ``sum lo' <= size <= sum hi'`` and ``lo' <= hi'`` row-wise.

    Returns:
        ``(lo', hi')`` when some composition exists now, else ``None`` (wait for more ready groups).
    """
    lo: dict[str, int] = {}
    hi: dict[str, int] = {}
    lo_sum = hi_sum = 0
    for s, R in remaining.items():
        L, H = bounds[s]
        a = max(L, R - num_left * H)
        b = min(H, R - num_left * L, ready.get(s, 0))
        if a > b:
            return None
        lo[s], hi[s] = a, b
        lo_sum += a
        hi_sum += b
    if not lo_sum <= size <= hi_sum:
        return None
    return lo, hi
