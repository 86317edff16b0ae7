"""See a run: flat per-step metrics for a trainer's logger, and a compact status table of a pipeline.

Both read the JSON of :meth:`knitdata.Pipeline.stats` (or a dataset's view of it), so they work the same on every
engine and in any process that can reach the pipeline:

* :func:`flat_metrics` turns it into one flat ``{"knitdata/...": number}`` dict, what ``accelerator.log``,
  TensorBoard's ``add_scalar`` or ``wandb.log`` take: staleness (mean, p95, worst) overall, per source and of the
  rank, the rank's exposed data wait in its last step, bytes read locally and across nodes, seconds from put to
  admission, store fill and spills, and what a staleness bound dropped. Every value is a finite ``int`` or
  ``float`` (a series with no value yet reads 0, with its ``count`` at 0).
* :func:`status_table` renders a few lines of text: per source trajectories put ("finished"), admitted and the
  quota; per rank the position, the micro-batches planned ahead of it, its data wait and staleness; store fill;
  the coordinator's journal. ``knitdata status`` prints it for a running Ray pipeline
  (:func:`knitdata.cli.status_main`).

Example:
    >>> from knitdata.observe.monitor import flat_metrics
    >>> m = flat_metrics({"staleness": {"count": 2, "mean": 0.5, "p50": 0.5, "p95": 1.0, "max": 1.0}})
    >>> m["knitdata/staleness/max"]
    1.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PREFIX", "flat_metrics", "status_table", "status_rows"]

#: Prefix of every key of :func:`flat_metrics`.
PREFIX = "knitdata/"


def _num(x: Any) -> float | int:
    """A finite number (``0`` for ``None``, NaN or a non-number)."""
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else 0.0
    return 0


def _summary(out: dict[str, float | int], key: str, summ: Any) -> None:
    """``key/mean``, ``key/p95``, ``key/max`` and ``key/count`` of a :func:`knitdata.observe.metrics.summarize` dict."""
    if not isinstance(summ, Mapping):
        return
    for f in ("mean", "p95", "max", "count"):
        if f in summ:
            out[f"{key}/{f}"] = _num(summ[f])


def _units(stats: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [u for u in (stats.get("units") or {}).values() if isinstance(u, Mapping)]


def flat_metrics(stats: Mapping[str, Any], *, rank: int | None = None, consumer: Mapping[str, Any] | None = None,
                 prefix: str = PREFIX) -> dict[str, float | int]:
    """One flat dict of numbers from :meth:`knitdata.Pipeline.stats` (or the part of it present).

    Keys (each under ``prefix``; per-source keys name the source; ``{s}`` is ``mean``, ``p95``, ``max``, ``count``):

    * ``staleness/{s}``, ``staleness/<source>/{s}``: policy versions between generation and training, of the
      trajectories handed out (the last 10,000; per source likewise); ``max`` is the worst.
    * ``staleness_generating/{mean,max}``, ``staleness_queued/{mean,max}``, ``staleness_queued_s/{mean,max}``,
      ``staleness_split/count``: staleness split into the versions that passed while a trajectory was generated
      (its oldest token's version to its put) and the versions and seconds it then waited in the pipeline (put to
      hand-out); the two version parts add up to its staleness (:class:`knitdata.staleness.StalenessSplit`).
    * ``rank_staleness/{s}`` (with ``rank``): of the micro-batches handed out to that rank (the last 1,000).
    * ``data_wait_s`` (with ``rank`` or ``consumer``): seconds the rank's last step was blocked until its
      micro-batches were ready (exposed data wait); ``wait_s``: its whole time in ``next()``; ``data_wait_s_total``,
      ``steps``; ``bytes_local`` / ``bytes_remote``: bytes the rank fetched from its node's units / from others.
    * ``bytes_read_local`` / ``bytes_read_remote``: every process's reads as reported (the transfer meter).
    * ``admission_delay_s/{s}``: seconds from a trajectory's put to its admission in a mini-batch.
    * ``store/used_bytes``, ``store/capacity_bytes``, ``store/fill`` (used / capacity, 0..1),
      ``store/high_water_bytes``, ``store/items``, ``store/spilled_items``, ``store/spilled_bytes``,
      ``store/spill_puts``, ``store/put_wait_s``, ``store/media_items``, ``store/media_bytes``, ``store/media_refs``,
      ``store/media_bytes_saved`` (media stored once per digest; summed over the units).
    * ``puts``, ``admitted_trajectories``, ``admitted_minibatches``, ``held_trajectories``, ``version``,
      ``sources/<source>/puts`` and ``/admitted``.
    * ``stale_dropped/<counter>`` and ``stale_dropped/<counter>/<source>`` (with a staleness bound): the groups,
      trajectories and tokens the bound dropped.
    * ``starved/<source>`` (1 or 0), ``starved_sources`` and ``drop_streak/<source>`` (with a staleness bound that
      reports starvation): whether the source is starved (its groups dropped in a row while its quota waited for
      them: its quota cannot be met within the bound), how many sources are, and its current streak of drops.

    Args:
        stats: A stats dict (missing parts are skipped).
        rank: The rank whose consumer metrics and staleness to report (``stats["consumers"][rank]``).
        consumer: The rank's :meth:`knitdata.observe.metrics.ConsumerMetrics.to_dict`, overriding ``stats``'s.
        prefix: Put before every key.

    Returns:
        ``{key: int | float}``, every value finite.
    """
    out: dict[str, float | int] = {}
    _summary(out, "staleness", stats.get("staleness"))
    for src, summ in (stats.get("staleness_by_source") or {}).items():
        _summary(out, f"staleness/{src}", summ)
    split = stats.get("staleness_split")
    if isinstance(split, Mapping):
        out["staleness_split/count"] = _num(split.get("count"))
        for part in ("generating", "queued", "queued_s"):
            for f in ("mean", "max"):
                out[f"staleness_{part}/{f}"] = _num(split.get(f"{part}_{f}"))
    by_rank = stats.get("staleness_by_rank") or []
    if rank is not None and 0 <= rank < len(by_rank):
        _summary(out, "rank_staleness", by_rank[rank])
    if consumer is None and rank is not None:
        consumers = stats.get("consumers") or []
        consumer = consumers[rank] if 0 <= rank < len(consumers) and isinstance(consumers[rank], Mapping) else None
    if consumer is not None:
        out["data_wait_s"] = _num(consumer.get("last_step_data_wait_s"))
        out["wait_s"] = _num(consumer.get("last_step_wait_s"))
        out["data_wait_s_total"] = _num(consumer.get("data_wait_s_total"))
        out["steps"] = _num(consumer.get("steps"))
        out["bytes_local"] = _num(consumer.get("local_bytes"))
        out["bytes_remote"] = _num(consumer.get("remote_bytes"))
    transfer = stats.get("transfer")
    if isinstance(transfer, Mapping):
        reads = [r for r in (transfer.get("read") or {}).values() if isinstance(r, Mapping)]
        out["bytes_read_local"] = sum(_num(r.get("local_bytes")) for r in reads)
        out["bytes_read_remote"] = sum(_num(r.get("cross_bytes")) for r in reads)
    _summary(out, "admission_delay_s", stats.get("admission_delay_s"))
    units = _units(stats)
    if units:
        for key, field in (("used_bytes", "used_bytes"), ("capacity_bytes", "capacity_bytes"),
                           ("high_water_bytes", "high_water_bytes"), ("items", "num_items"),
                           ("spilled_items", "spilled_items"), ("spilled_bytes", "spilled_bytes"),
                           ("spill_puts", "spill_puts"), ("put_wait_s", "put_wait_s"),
                           ("media_items", "media_items"), ("media_bytes", "media_bytes"),
                           ("media_refs", "media_refs"), ("media_bytes_saved", "media_bytes_saved")):
            out[f"store/{key}"] = sum(_num(u.get(field)) for u in units)
        cap = out["store/capacity_bytes"]
        out["store/fill"] = float(out["store/used_bytes"]) / cap if cap else 0.0
    for key in ("puts", "admitted_trajectories", "admitted_minibatches", "held_trajectories", "version"):
        if key in stats:
            out[key] = _num(stats[key])
    for src, row in (stats.get("sources") or {}).items():
        if isinstance(row, Mapping):
            out[f"sources/{src}/puts"] = _num(row.get("puts"))
            out[f"sources/{src}/admitted"] = _num(row.get("admitted"))
    bound = stats.get("staleness_bound")
    if isinstance(bound, Mapping):
        _bound_metrics(out, bound)
    return {prefix + k: v for k, v in out.items()}


def _bound_metrics(out: dict[str, float | int], bound: Mapping[str, Any]) -> None:
    """``stale_dropped/...``, ``starved/...`` and ``drop_streak/...`` of a staleness bound's stats."""
    for counter in ("dropped_groups", "dropped_trajectories", "dropped_tokens"):
        per = bound.get(counter)
        if isinstance(per, Mapping):
            out[f"stale_dropped/{counter}"] = sum(_num(v) for v in per.values())
            for src, v in per.items():
                out[f"stale_dropped/{counter}/{src}"] = _num(v)
    starved = bound.get("starved")
    if isinstance(starved, Mapping):
        out["starved_sources"] = sum(1 for v in starved.values() if v)
        for src, v in starved.items():
            out[f"starved/{src}"] = int(bool(v))
    streak = bound.get("drop_streak")
    if isinstance(streak, Mapping):
        for src, v in streak.items():
            out[f"drop_streak/{src}"] = _num(v)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def status_rows(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The figures :func:`status_table` shows, as JSON (what ``knitdata status --json`` prints).

    Returns:
        ``{"name", "engine", "closed", "version", "train_batch", "sources": [...], "ranks": [...], "store": {...},
        "journal": {...} | None}``; a source row has ``source``, ``finished`` (trajectories put), ``admitted``,
        ``ready`` (waiting for admission), ``quota`` (per train batch); a rank row ``rank``, ``position`` (micro-batches
        handed out), ``planned``, ``ahead`` (planned, not handed out yet), ``committed``, ``waiting`` (nothing
        planned ahead of it while the pipeline is open: the rank waits for admission), ``data_wait_s`` (total),
        ``staleness_mean`` and ``staleness_max``; ``"staleness_split"`` (when ``stats`` has one): ``count``, and the
        mean and max of versions generating and queued and of seconds queued (``generating_mean``, ...); ``"bound"``
        (with a staleness bound): ``max_staleness``, ``on_stale``, ``dropped_groups`` (total), ``starved`` (the
        sources starved, sorted; ``None`` if the bound does not report it) and ``drop_streak`` (per source).
    """
    sources = [{"source": src, "finished": int(_num(row.get("puts"))), "admitted": int(_num(row.get("admitted"))),
                "ready": int(_num(row.get("ready"))), "quota": int(_num(row.get("quota")))}
               for src, row in (stats.get("sources") or {}).items() if isinstance(row, Mapping)]
    positions = list(stats.get("positions") or [])
    planned = list(stats.get("planned") or [])
    committed = list(stats.get("committed") or [])
    consumers = list(stats.get("consumers") or [])
    by_rank = list(stats.get("staleness_by_rank") or [])
    closed = bool(stats.get("closed"))
    ranks = []
    for r, pos in enumerate(positions):
        plan = int(planned[r]) if r < len(planned) else 0
        cons = consumers[r] if r < len(consumers) and isinstance(consumers[r], Mapping) else {}
        st = by_rank[r] if r < len(by_rank) and isinstance(by_rank[r], Mapping) else {}
        ranks.append({"rank": r, "position": int(pos), "planned": plan, "ahead": max(0, plan - int(pos)),
                      "committed": int(committed[r]) if r < len(committed) else 0,
                      "waiting": not closed and plan <= int(pos),
                      "data_wait_s": float(_num(cons.get("data_wait_s_total"))),
                      "staleness_mean": float(_num(st.get("mean"))), "staleness_max": float(_num(st.get("max")))})
    units = _units(stats)
    used = sum(_num(u.get("used_bytes")) for u in units)
    cap = sum(_num(u.get("capacity_bytes")) for u in units)
    store = {"units": len(units), "used_bytes": used, "capacity_bytes": cap, "fill": used / cap if cap else 0.0,
             "items": sum(_num(u.get("num_items")) for u in units),
             "spilled_items": sum(_num(u.get("spilled_items")) for u in units),
             "held_trajectories": int(_num(stats.get("held_trajectories")))}
    out: dict[str, Any] = {
        "name": stats.get("name"), "engine": stats.get("engine"), "closed": closed,
        "version": int(_num(stats.get("version"))), "train_batch": int(_num(stats.get("train_batch"))),
        "sources": sources, "ranks": ranks, "store": store, "journal": stats.get("journal")}
    bound = stats.get("staleness_bound")
    if isinstance(bound, Mapping):
        raw_starved, raw_streak, raw_dropped = (bound.get(k) for k in ("starved", "drop_streak", "dropped_groups"))
        starved: Mapping[str, Any] | None = raw_starved if isinstance(raw_starved, Mapping) else None
        streak: Mapping[str, Any] = raw_streak if isinstance(raw_streak, Mapping) else {}
        dropped: Mapping[str, Any] = raw_dropped if isinstance(raw_dropped, Mapping) else {}
        out["bound"] = {"max_staleness": bound.get("max_staleness"), "on_stale": bound.get("on_stale"),
                        "dropped_groups": sum((_num(v) for v in dropped.values()), 0),
                        "starved": None if starved is None else sorted(str(k) for k, v in starved.items() if v),
                        "drop_streak": {str(k): int(_num(v)) for k, v in streak.items()}}
    split = stats.get("staleness_split")
    if isinstance(split, Mapping):
        out["staleness_split"] = {k: _num(split.get(k)) for k in (
            "count", "generating_mean", "generating_max", "queued_mean", "queued_max", "queued_s_mean", "queued_s_max")}
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[str(h) for h in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in cells]


def status_table(stats: Mapping[str, Any]) -> str:
    """A compact text table of a pipeline from its :meth:`~knitdata.Pipeline.stats` (see :func:`status_rows`).

    Example:
        >>> print(status_table({"engine": "embedded", "version": 3, "positions": [4], "planned": [6],
        ...                     "sources": {"math": {"quota": 8, "puts": 20, "admitted": 16, "ready": 4}}}))
        pipeline embedded: version 3, train batch 0, open
        source  finished  admitted  ready  quota
        math          20        16      4      8
        rank  position  ahead  committed  waiting  data_wait_s  staleness mean/max
        0            4      2          0       no        0.000  0.00/0
        store: 0 units, 0 B of 0 B (0.0%), 0 items, 0 spilled; 0 trajectories held
        journal: none
    """
    d = status_rows(stats)
    what = f"pipeline {d['name']!r} ({d['engine']})" if d["name"] else f"pipeline {d['engine']}"
    lines = [f"{what}: version {d['version']}, train batch {d['train_batch']}, {'closed' if d['closed'] else 'open'}"]
    lines += _table(["source", "finished", "admitted", "ready", "quota"],
                    [[s["source"], s["finished"], s["admitted"], s["ready"], s["quota"]] for s in d["sources"]])
    lines += _table(["rank", "position", "ahead", "committed", "waiting", "data_wait_s", "staleness mean/max"],
                    [[r["rank"], r["position"], r["ahead"], r["committed"], "yes" if r["waiting"] else "no",
                      f"{r['data_wait_s']:.3f}", f"{r['staleness_mean']:.2f}/{r['staleness_max']:.0f}"]
                     for r in d["ranks"]])
    sp = d.get("staleness_split")
    if sp is not None:
        lines.append(f"staleness split (mean/max, {sp['count']} trajectories): generating {sp['generating_mean']:.2f}/"
                     f"{sp['generating_max']:.0f}, queued {sp['queued_mean']:.2f}/{sp['queued_max']:.0f} versions, "
                     f"{sp['queued_s_mean']:.3f}/{sp['queued_s_max']:.3f} s")
    b = d.get("bound")
    if b is not None:
        line = (f"staleness bound: max_staleness {b['max_staleness']} ({b['on_stale']}), "
                f"{b['dropped_groups']:.0f} groups dropped")
        if b["starved"] is not None:
            line += "; starved: " + (", ".join(f"{s} ({b['drop_streak'].get(s, 0)} dropped in a row)"
                                               for s in b["starved"]) or "none")
        lines.append(line)
    st = d["store"]
    lines.append(f"store: {st['units']} units, {_fmt_bytes(st['used_bytes'])} of {_fmt_bytes(st['capacity_bytes'])} "
                 f"({100 * st['fill']:.1f}%), {st['items']} items, {st['spilled_items']} spilled; "
                 f"{st['held_trajectories']} trajectories held")
    j = d["journal"]
    lines.append("journal: none" if not isinstance(j, Mapping) else
                 f"journal: {j.get('records')} records in segment {j.get('segment')}, {_fmt_bytes(_num(j.get('bytes')))}")
    return "\n".join(lines)
