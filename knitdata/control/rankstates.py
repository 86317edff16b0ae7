"""Rank states of a whole run, merged into one (pure, JSON in and out): the input of an elastic resume.

See :mod:`knitdata.control.reshape` for what a merged state makes the control plane do.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from knitdata.control.fingerprints import FP_EMPTY
from knitdata.errors import KnitdataError, StateError
from knitdata.placement import ConsumerLayout

__all__ = ["MERGED_FORMAT", "RANK_STATE_FORMAT", "PLANNING_KEYS", "CUT_KEYS", "merge_rank_states", "check_merged",
           "collect_states", "layout_runs", "layout_from_runs", "canon", "planning_of", "planning_mismatch",
           "planning_guard"]

#: ``format`` of a merged state (:func:`merge_rank_states`).
MERGED_FORMAT = "knitdata.MergedRankStates"
#: ``format`` of the rank states it merges (:class:`knitdata.consumer.dataset.TrajectoryDataset` states).
RANK_STATE_FORMAT = "knitdata.TrajectoryDataset"
_MERGED_VERSION = 1
#: The pipeline options that decide how admitted trajectories are cut into micro-batches: a rank state carries them
#: (``"planning"``), since a position saved under other values means other trajectories.
PLANNING_KEYS = ("spec", "token_budget", "admission", "admission_options", "placement", "allow_split_groups",
                 "balance_tolerance")
#: Those of :data:`PLANNING_KEYS` under which other values always give other micro-batches (the others, such as a
#: staleness bound in ``admission_options``, may leave a run's plans as they were).
CUT_KEYS = ("spec", "token_budget")


def planning_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`PLANNING_KEYS` of a pipeline's configuration (JSON)."""
    return {k: config.get(k) for k in PLANNING_KEYS}


def planning_mismatch(saved: Any, mine: Any, keys: tuple[str, ...] = PLANNING_KEYS) -> tuple[str, str] | None:
    """What differs in ``keys`` between two ``"planning"`` dicts: ``("token_budget=24", "token_budget=32")`` (the
    saved values, then the others), or ``None`` when they agree or either is missing (a state saved before states
    carried it)."""
    if not isinstance(saved, Mapping) or not isinstance(mine, Mapping):
        return None
    diff = [k for k in keys if k in saved and k in mine and canon(saved[k]) != canon(mine[k])]
    if not diff:
        return None
    return ", ".join(f"{k}={saved[k]!r}" for k in diff), ", ".join(f"{k}={mine[k]!r}" for k in diff)


@contextlib.contextmanager
def planning_guard(state: Any, engine: Any, rank: int) -> Iterator[None]:
    """Around the checks of a rank state loaded by ``engine``'s rank ``rank``: name the real cause of a refusal when
    the state was saved by a pipeline that cuts micro-batches differently (another ``token_budget``, spec,
    admission...; see :data:`PLANNING_KEYS`).

    On a pipeline that has planned nothing yet (a new job loading its states before the refill, as documented)
    a state saved under other :data:`CUT_KEYS` is refused at once. Otherwise the fingerprints decide (a pipeline
    restored from a checkpoint with another configuration keeps the checkpoint's plans, which the states match;
    another staleness bound may leave the plans as they were), and a :class:`~knitdata.errors.StateError` raised
    inside the block is replaced by one naming what differs in the planning.

    Raises:
        StateError: ``"rank R: the state was saved by a pipeline planning with token_budget=24; this pipeline has
            token_budget=32: ..."``.
    """
    saved = state.get("planning") if isinstance(state, Mapping) else None
    mine = planning_of(engine.config)
    differs = planning_mismatch(saved, mine)
    err = None if differs is None else StateError(
        f"rank {rank}: the state was saved by a pipeline planning with {differs[0]}; this pipeline has {differs[1]}: "
        "it plans other micro-batches, so the saved position would mean other trajectories here. Create the "
        f"pipeline with {differs[0]} to resume from this state (or start without it)")
    if err is not None and planning_mismatch(saved, mine, CUT_KEYS) is not None and \
            not any(engine.control.reporting.stats().get("planned") or ()):
        raise err
    try:
        yield
    except StateError as e:
        if err is None:
            raise
        raise err from e


def layout_runs(layout: ConsumerLayout) -> list[list[Any]]:
    """``layout`` as runs ``[[node, ranks], ...]`` (a rank state carries it: a few strings for any rank count)."""
    runs: list[list[Any]] = []
    for r in range(layout.num_consumers):
        node = layout.node_of(r)
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        else:
            runs.append([node, 1])
    return runs


def layout_from_runs(runs: Any) -> ConsumerLayout:
    """Inverse of :func:`layout_runs`.

    Raises:
        StateError: Malformed runs.
    """
    try:
        return ConsumerLayout([str(node) for node, k in runs for _ in range(int(k))])
    except (TypeError, ValueError, KnitdataError) as e:
        raise StateError(f"bad layout in the state: {runs!r:.200} ({e})") from e


def _bad(msg: str) -> StateError:
    return StateError(f"cannot merge rank states: {msg}")


def _nonneg(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _bad(f"{what} must be a non-negative int, got {v!r:.80}")
    return v


def collect_states(obj: Any, formats: tuple[str, ...] = (RANK_STATE_FORMAT, MERGED_FORMAT),
                   out: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every state of one of ``formats`` nested in ``obj`` (itself, or a ``StatefulDataLoader`` state holding one
    per worker, or lists and dicts of those), in order."""
    out = [] if out is None else out
    if isinstance(obj, Mapping):
        if obj.get("format") in formats:
            out.append(dict(obj))
        else:
            for v in obj.values():
                collect_states(v, formats, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            collect_states(v, formats, out)
    return out


def canon(x: Any) -> str:
    """``x`` as canonical JSON text (for equality of JSON values)."""
    return json.dumps(x, sort_keys=True, separators=(",", ":"))


def _rank_position(rank: int, workers: dict[int, dict[str, Any]], nw: int) -> int:
    """The handed-out prefix of one rank from its workers' states (DataLoader round robin: worker ``w`` takes
    entries ``j % nw == w``, handed out in order)."""
    nexts = {w: _nonneg(st.get("next"), f"rank {rank} worker {w}: 'next'") for w, st in workers.items()}
    p = min(nexts.values())
    for w, nx in nexts.items():
        if nx != p + ((w - p) % nw):
            raise _bad(f"rank {rank}: the states of its {nw} DataLoader workers (next micro-batch "
                       f"{dict(sorted(nexts.items()))}) are not one prefix handed out in round robin; save the "
                       "StatefulDataLoader's state_dict() of each rank at one moment")
    return p


def _group(flat: list[dict[str, Any]]) -> tuple[int, dict[int, dict[int, dict[str, Any]]], dict[int, int]]:
    """The rank states by rank and worker, checked to be one complete set of one run: ``(N, states, workers)``."""
    first = flat[0]
    n = first.get("num_consumers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise _bad(f"'num_consumers' must be a positive int, got {n!r:.40}")
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    nws: dict[int, int] = {}
    for st in flat:
        if st.get("version") not in (2, 3):
            raise _bad(f"unsupported state version {st.get('version')!r} (rank {st.get('rank')!r})")
        r = st.get("rank")
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
            raise _bad(f"rank {r!r:.40} is not one of the {n} ranks of the first state")
        if st.get("num_consumers") != n:
            raise _bad(f"rank {r} was saved with {st.get('num_consumers')!r} ranks, rank {first.get('rank')} with {n}: "
                       "states of different runs or layouts")
        if st.get("pipeline") != first.get("pipeline"):
            raise _bad(f"rank {r} comes from pipeline {st.get('pipeline')!r}, rank {first.get('rank')} from "
                       f"{first.get('pipeline')!r}: states of different runs")
        if first.get("run") is not None and st.get("run") is not None and st["run"] != first["run"]:
            raise _bad(f"rank {first.get('rank')} is of the run marked {first['run']} and rank {r} of the run marked "
                       f"{st['run']} (their first micro-batches differ: other puts or planning): states of different "
                       "runs")
        differs = planning_mismatch(first.get("planning"), st.get("planning"))
        if differs is not None:
            raise _bad(f"rank {first.get('rank')} was saved by a pipeline planning with {differs[0]} and rank {r} by "
                       f"one with {differs[1]}: states of different runs")
        if canon(st.get("layout")) != canon(first.get("layout")):
            raise _bad(f"ranks {first.get('rank')} and {r} were saved with different layouts (nodes of the ranks)")
        if canon(st.get("layout_history")) != canon(first.get("layout_history")):
            raise _bad(f"ranks {first.get('rank')} and {r} carry different layout histories: states of different "
                       "runs, or taken before and after a reshape")
        w, nw = _nonneg(st.get("worker"), f"rank {r}: 'worker'"), _nonneg(st.get("num_workers"), f"rank {r}: 'num_workers'")
        if not w < nw:
            raise _bad(f"rank {r}: worker {w} of {nw}")
        if nws.setdefault(r, nw) != nw:
            raise _bad(f"rank {r}: states of {nws[r]} and of {nw} DataLoader workers")
        have = by_rank.setdefault(r, {}).get(w)
        if have is not None:
            if have.get("replica", 0) == st.get("replica", 0):
                raise _bad(f"rank {r} (worker {w}) is given twice: give each rank's state once")
            if have.get("next") != st.get("next"):  # tensor/pipeline-parallel replicas of one rank: one stream
                raise _bad(f"rank {r} (worker {w}): its replicas {have.get('replica', 0)} and {st.get('replica', 0)} "
                           f"stand at different positions ({have.get('next')} and {st.get('next')}); save every "
                           "replica at the same optimizer step before resuming onto another number of ranks")
            continue
        by_rank[r][w] = st
    missing = [r for r in range(n) if r not in by_rank]
    if missing:
        raise _bad(f"the states of ranks {missing} are missing (the run had {n} ranks; give every rank's state)")
    for r, ws in sorted(by_rank.items()):
        lost = [w for w in range(nws[r]) if w not in ws]
        if lost:
            raise _bad(f"rank {r}: the states of DataLoader workers {lost} of {nws[r]} are missing")
    return n, by_rank, nws


def merge_rank_states(states: Iterable[Any]) -> dict[str, Any]:
    """Merge the loader states of every rank of a run into one state that any number of ranks can load.

    Pure: JSON in, JSON out. Each element may be a :meth:`~knitdata.TrajectoryDataset.state_dict`, a
    ``StatefulDataLoader`` state holding one per worker, or a merged state (then all must be the same merged
    state, which is returned).

    Every new rank loads the result (``ds.load_state_dict(merged)``, before iterating): the pipeline takes
    the first, checks that the others are equal, never delivers again what was handed out before the states
    were saved, re-plans the unconsumed remainder of every started mini-batch for its own number of ranks and
    plans the later mini-batches for it from the start (see :mod:`knitdata.control.reshape`).

    Args:
        states: The states of all ranks of one run (with DataLoader workers: every worker of every rank; with
            tensor/pipeline-parallel replicas: those of every replica, or of one replica per rank).

    Returns:
        The merged state (format :data:`MERGED_FORMAT`).

    Raises:
        StateError: No state, a missing rank or worker, one given twice, states of different runs (another
            run mark: their first micro-batches differ; another pipeline name; another planning: ``token_budget``,
            spec, admission... of :data:`PLANNING_KEYS`), layouts or layout histories, mixed fingerprinted and
            unfingerprinted states, or a malformed state. The message names the ranks concerned and what differs.
            (A state taken before its run's first micro-batch was planned has no mark; the pipeline that loads
            the merged state still checks every rank's fingerprint.)

    Example:
        >>> from knitdata import merge_rank_states
        >>> s = {"format": "knitdata.TrajectoryDataset", "version": 3, "pipeline": None, "num_consumers": 2,
        ...      "worker": 0, "num_workers": 1, "next": 3, "minibatch": 2, "microbatch": 1, "epoch": 0,
        ...      "fingerprint": None, "fingerprint_length": None}
        >>> merge_rank_states([{**s, "rank": 0}, {**s, "rank": 1, "next": 2}])["positions"] == [3, 2]
        True
    """
    flat = collect_states(list(states))
    if not flat:
        raise _bad("no knitdata dataset state among the inputs")
    merged = [s for s in flat if s.get("format") == MERGED_FORMAT]
    if merged:
        if len(merged) != len(flat) or any(canon(m) != canon(merged[0]) for m in merged):
            raise _bad("a merged state can only be given alone (or with identical copies of itself)")
        check_merged(merged[0])
        return dict(merged[0])
    first = flat[0]
    n, by_rank, nws = _group(flat)
    with_fp = sorted({r for r, ws in by_rank.items() for st in ws.values() if st.get("fingerprint") is not None})
    if with_fp and len(with_fp) != n:
        without = sorted(set(range(n)) - set(with_fp))
        raise _bad(f"mixed fingerprints: ranks {with_fp} carry replay fingerprints and ranks {without} do not "
                   "(states of different knitdata versions or runs)")
    positions: list[int] = []
    fingerprints: list[list[Any] | None] = []
    remainders: list[list[Any] | None] = []
    for r in range(n):
        ws = by_rank[r]
        p = _rank_position(r, ws, nws[r])
        positions.append(p)
        best: list[Any] | None = None
        for st in ws.values():
            fp, ln = st.get("fingerprint"), st.get("fingerprint_length")
            if fp is None:
                continue
            ln = _nonneg(ln, f"rank {r}: 'fingerprint_length'")
            if not isinstance(fp, str) or ln > p + nws[r]:
                raise _bad(f"rank {r}: bad fingerprint {fp!r:.40} of length {ln!r}")
            if ln <= p and (best is None or ln > best[0]):
                best = [ln, fp]
        fingerprints.append(best)
        rem = [st.get("layout_remainder") for st in ws.values()]
        remainders.append(next((x for x in rem if x is not None), None))
    hist = first.get("layout_history")
    remainder = None
    if hist is None:  # never reshaped: one segment from the start, no remainders
        remainder = [0, 0, [FP_EMPTY] * n]
    elif all(x is not None for x in remainders):
        fw, rr = remainders[0][0], remainders[0][1]  # type: ignore[index]
        if any(x[0] != fw or x[1] != rr for x in remainders):  # type: ignore[index]
            raise _bad(f"ranks disagree on where the segment's remainders end: {remainders}")
        remainder = [fw, rr, [x[2] for x in remainders]]  # type: ignore[index]
    return {
        "format": MERGED_FORMAT, "version": _MERGED_VERSION, "pipeline": first.get("pipeline"),
        "num_consumers": n, "layout": first.get("layout"), "num_workers": [nws[r] for r in range(n)], "positions": positions,
        "fingerprints": fingerprints, "history": hist, "remainder": remainder,
        "epoch": max(int(st.get("epoch") or 0) for st in flat),
        **({"planning": first["planning"]} if "planning" in first else {}),
        **({"run": run} if (run := next((st["run"] for st in flat if st.get("run") is not None), None)) else {}),
    }


def check_merged(m: Any) -> None:
    """Check the structure of a merged state.

    Raises:
        StateError: Not a merged state of this version, or malformed.
    """
    if not isinstance(m, Mapping) or m.get("format") != MERGED_FORMAT:
        raise StateError(f"not a {MERGED_FORMAT} state: {m!r:.200}")
    if m.get("version") != _MERGED_VERSION:
        raise StateError(f"unsupported merged state version {m.get('version')!r}; expected {_MERGED_VERSION}")
    n = m.get("num_consumers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise StateError(f"bad merged state: num_consumers {n!r:.40}")
    pos = m.get("positions")
    if not isinstance(pos, list) or len(pos) != n or any(isinstance(p, bool) or not isinstance(p, int) or p < 0
                                                          for p in pos):
        raise StateError(f"bad merged state: positions must be {n} non-negative ints, got {pos!r:.200}")
    fps = m.get("fingerprints")
    if not isinstance(fps, list) or len(fps) != n:
        raise StateError(f"bad merged state: fingerprints must be one per rank ({n}), got {fps!r:.200}")
    for r, f in enumerate(fps):
        if f is not None and not (isinstance(f, list) and len(f) == 2 and isinstance(f[0], int)
                                  and not isinstance(f[0], bool) and 0 <= f[0] <= pos[r] and isinstance(f[1], str)):
            raise StateError(f"bad merged state: fingerprint of rank {r}: {f!r:.80}")
    rem = m.get("remainder")
    if rem is not None and not (isinstance(rem, list) and len(rem) == 3 and isinstance(rem[2], list)
                                and len(rem[2]) == n):
        raise StateError(f"bad merged state: remainder {rem!r:.200}")
    h = m.get("history")
    if h is not None and not (isinstance(h, Mapping) and isinstance(h.get("closed"), list)
                              and isinstance(h.get("current"), Mapping)):
        raise StateError(f"bad merged state: layout history {h!r:.200}")
