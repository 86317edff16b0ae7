"""Render every benchmark figure in README.md and benchmarks/README.md from ``benchmarks/results/*.json``.

``python benchmarks/report.py`` rewrites the generated blocks in place; ``python benchmarks/report.py --check``
exits 1 with a unified diff when a committed block differs from what the JSON gives (0 otherwise).

A generated block sits between two markers in a Markdown file::

    <!-- report:NAME -->
    ... generated text, never edited by hand ...
    <!-- /report:NAME -->

and ``BLOCKS[NAME]`` names the result file(s) it reads and the function that renders it. To add one: write a
renderer ``def render_x(d: dict) -> str`` (``d`` maps each result file name to its parsed JSON, or ``None``
when the file is not committed), register it with ``@block("x", "x.json", ...)``, and put the two markers where
the text belongs. Renderers use only what the JSON holds and tolerate missing optional keys (a ``-`` in the
cell), so the lead can rerun this after merging new results. Standard library only.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BLOCKS",
    "FILES",
    "MARKER",
    "RESULTS",
    "SCENARIOS",
    "Block",
    "block",
    "load_text",
    "main",
    "render_all",
    "render_block",
    "render_text",
]

#: Markdown files holding generated blocks, relative to the repository root.
FILES = ("README.md", "benchmarks/README.md")
#: Where the committed results live, relative to the repository root.
RESULTS = "benchmarks/results"

MARKER = re.compile(r"<!-- report:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /report:(?P=name) -->", re.DOTALL)

Renderer = Callable[[dict], str]


@dataclass(frozen=True)
class Block:
    """One generated block: the result files it reads (``optional`` ones may be absent) and its renderer."""

    name: str
    files: tuple[str, ...]
    render: Renderer
    optional: tuple[str, ...] = ()


#: Registry of generated blocks, keyed by marker name.
BLOCKS: dict[str, Block] = {}


def block(name: str, *files: str, optional: tuple[str, ...] = ()) -> Callable[[Renderer], Renderer]:
    """Register ``fn`` as the renderer of block ``name``, reading ``files`` (and ``optional`` ones if present)."""

    def deco(fn: Renderer) -> Renderer:
        BLOCKS[name] = Block(name, tuple(files), fn, tuple(optional))
        return fn

    return deco


# ----------------------------------------------------------------------------------------------- formatting


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)) and math.isfinite(x):
        return float(x)
    return None


def f(x: Any, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    """Format a number (``-`` for a missing or non-numeric value)."""
    v = _num(x)
    if v is None:
        return "-"
    return format(v * scale, spec) + suffix


def pct(x: Any, spec: str = ".1f") -> str:
    """Format a fraction as a percentage."""
    return f(x, spec, 100.0, "%")


def g(d: Any, *path: Any, default: Any = None) -> Any:
    """``d[path[0]][path[1]]...`` or ``default`` where any step is missing."""
    for p in path:
        if isinstance(d, dict):
            d = d.get(p, d.get(str(p)) if not isinstance(p, str) else None)
        elif isinstance(d, list) and isinstance(p, int) and -len(d) <= p < len(d):
            d = d[p]
        else:
            return default
        if d is None:
            return default
    return d


def _dict(x: Any) -> dict[str, Any]:
    """``x`` if it is a dict, else an empty one (a JSON value that may be missing or of another type)."""
    return x if isinstance(x, dict) else {}


def _choice(flag: Any, yes: str, no: str, missing: str) -> str:
    """``yes`` / ``no`` for a JSON boolean, ``missing`` for anything else."""
    if isinstance(flag, (bool, int, float)) and flag in (True, False):
        return yes if flag else no
    return missing


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A Markdown table; ``align`` is one character per column, ``l`` or ``r`` (default: first l, rest r)."""
    align = align or ("l" + "r" * (len(header) - 1))
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _loads3(v: Any) -> str | None:
    if isinstance(v, list) and v and all(_num(x) is not None for x in v):
        return " / ".join(f"{x:.2f}" for x in v)
    if _num(v) is not None:
        return f"{v:.2f}"
    return None


def load_text(d: dict) -> str:
    """The machine's load average as the result records it (1 / 5 / 15 min), at start and end; '' if absent."""
    places = [d, _dict(d.get("machine"))]
    start = end = during = None
    for p in places:
        for k, v in p.items():
            if not k.lower().startswith("load"):
                continue
            s = _loads3(v)
            if s is None:
                continue
            kl = k.lower()
            if "start" in kl or "before" in kl:
                start = start or s
            elif "end" in kl or "after" in kl:
                end = end or s
            else:
                during = during or s
    parts = []
    if start:
        parts.append(f"{start} at start")
    if end:
        parts.append(f"{end} at end")
    elif during:
        parts.append(f"{during} at the end of the run" if start else during)
    return ("load average " + ", ".join(parts) + " (1 / 5 / 15 min)") if parts else ""


def run_text(d: dict, wall_key: str | None = None) -> str:
    """One line on how a result was produced: command and date if recorded, wall time, load, CPUs."""
    bits = []
    cmd = d.get("command")
    if isinstance(cmd, str) and cmd:
        bits.append(f"command `{cmd}`")
    for k in ("date", "date_utc", "started_utc", "started_at", "timestamp"):
        if isinstance(d.get(k), str):
            bits.append(str(d[k]))
            break
    wall = None
    for k in ([wall_key] if wall_key else []) + ["total_s", "wall_s"]:
        if _num(d.get(k)) is not None:
            wall = d[k]
            break
    if wall is not None:
        bits.append(f"{wall:.0f} s wall")
    lt = load_text(d)
    if lt:
        bits.append(lt)
    cpus = g(d, "machine", "cpus")
    if _num(cpus) is not None:
        bits.append(f"{int(cpus)} CPUs")
    if g(d, "machine", "cuda") is True or g(d, "device") == "cuda":
        bits.append("CUDA")
    return ("Recorded in the result: " + "; ".join(bits) + ".") if bits else ""


def missing(name: str) -> str:
    """The text of a block whose result file is not committed."""
    return f"_No committed result yet (`{RESULTS}/{name}`)._"


def _join(*parts: str) -> str:
    return "\n\n".join(p for p in parts if p)


def _ms(entry: Any) -> float | None:
    """Exposed ms of a result entry (``exposed_ms`` or ``exposed_latency_s``)."""
    if not isinstance(entry, dict):
        return _num(entry)
    for k, s in (("exposed_ms", 1.0), ("exposed_latency_ms", 1.0), ("exposed_latency_s", 1000.0), ("exposed_s", 1000.0)):
        v = _num(entry.get(k))
        if v is not None:
            return v * s
    return None


MiB = float(1 << 20)

# ----------------------------------------------------------------------------------------------- README.md


def _x(v: Any, spec: str = ".1f") -> str:
    """A ratio as ``N.Nx`` (``-`` when missing)."""
    return f(v, spec, suffix="x")


def _headline_transfer(tr: Any, seed: Any) -> list[str]:
    """The transfer lines of the README headline: the accel mode (compute as a calibrated wait), each system
    alone; the omni workload at the seed's size when committed."""
    if not isinstance(tr, dict) or not isinstance(tr.get("accel"), dict):
        return ["- Transfer, the data path (`knitdata bench transfer --compute accel`: each consumer's compute is a "
                "wait of its calibrated CPU cost, so the host CPU is free as on a GPU node): "
                + missing("transfer_accel.json") + " The CPU-compute figures, which on this 2-core machine mostly "
                "measure CPU contention, are in benchmarks/README.md."]
    acc = tr["accel"]
    it = g(acc, "alone", "iter") or {}
    best, sync = g(acc, "alone", "transferqueue_best") or {}, g(acc, "alone", "transferqueue") or {}
    r = acc.get("ratios") or {}
    e2e = acc.get("end_to_end_alone") or {}
    out = [
        f"- Transfer, the data path (image workload; each consumer's compute is a wait of its calibrated CPU cost, so "
        f"the host CPU is free as on a GPU node; each system alone): knitdata `iter` exposes {f(it.get('exposed_ms'))} "
        f"ms per step in all its data calls (`next()` waiting for data {f(it.get('wait_ms'))} ms, its own work "
        f"{f(it.get('own_ms'))} ms, `state_dict()` {f(it.get('state_dict_ms'), '.3f')} ms, `commit()` "
        f"{f(it.get('commit_ms'), '.3f')} ms) against {f(best.get('exposed_ms'))} ms for transferqueue at its best "
        f"(transferqueue / iter {_x(r.get('exposed_transferqueue_best_over_iter'))}) and {f(sync.get('exposed_ms'))} "
        f"ms driven synchronously ({_x(r.get('exposed_transferqueue_over_iter'), '.0f')}). Step time iter / "
        f"transferqueue at its best: {f(g(e2e, 'iter_dup', 'step_s'), '.3f')} / {f(g(e2e, 'tq_dup', 'step_s'), '.3f')} s "
        f"(duplicated encoding), {f(g(e2e, 'iter_shared', 'step_s'), '.3f')} / {f(g(e2e, 'tq_shared', 'step_s'), '.3f')} "
        "s (shared encoding)." + _floor_sentence(acc)
    ]
    if isinstance(seed, dict) and isinstance(seed.get("accel"), dict):
        rs = g(seed, "accel", "ratios") or {}
        es = g(seed, "accel", "end_to_end_alone") or {}
        w = seed.get("workload") or {}
        out.append(
            f"- Transfer plus training, omni workload at the seed's size ({w.get('video_frames', '-')} frames at "
            f"{w.get('frame_px', '-')} px and {f(w.get('audio_seconds'), '.0f')} s of audio per prompt; same method): "
            f"knitdata `iter` with shared encoding takes {f(g(es, 'iter_shared', 'step_s'), '.3f')} s per step against "
            f"{f(g(es, 'tq_sync_dup', 'step_s'), '.3f')} s for transferqueue driven synchronously with duplicated "
            f"encoding ({_x(rs.get('end_to_end_transferqueue_dup_over_iter_shared'), '.2f')}; the seed claims up to "
            f"5.8x) and {f(g(es, 'tq_dup', 'step_s'), '.3f')} s for transferqueue at its best with duplicated encoding "
            f"({_x(rs.get('end_to_end_transferqueue_best_dup_over_iter_shared'), '.2f')})."
        )
    return out




def _floor_sentence(acc: dict) -> str:
    """The floor of the same run (no data system), when it ran: what any design could expose on this machine."""
    fl = g(acc, "alone", "floor") or {}
    if not isinstance(fl.get("exposed_ms"), (int, float)):
        return ""
    r = acc.get("ratios") or {}
    return (f" With no data system at all (`floor`: a queue pop per micro-batch, a small state and an enqueued "
            f"commit, the micro-batches built ahead by a thread from memory) the same run exposes "
            f"{f(fl.get('exposed_ms'))} ms per step: transferqueue at its best / floor is "
            f"{_x(r.get('exposed_transferqueue_best_over_floor'))}, the most any design could lead by here, and "
            f"iter / floor {_x(r.get('exposed_iter_over_floor'))}.")


@block("headline", "admission_skewed.json", "encode.json",
       optional=("transfer_accel.json", "transfer_omni_seed_accel.json", "transfer_omni_seed_dedup_accel.json",
                 "agent.json"))
def render_headline(d: dict) -> str:
    """The headline figures for README.md (the transfer ones from the accel mode), each pointing at its table."""
    out = []
    adm = d.get("admission_skewed.json")
    if adm:
        cp, tb = g(adm, "policies", "constraint_preserving"), g(adm, "policies", "train_batch")
        out.append(
            f"- Admission (simulated `skewed` scenario, M = {g(adm, 'params', 'num_minibatches')}): constraint-preserving "
            f"admission cuts the positive part of architectural staleness by "
            f"{pct(g(cp, 'reduction_positive_vs_train_batch'))} against train-batch admission "
            f"({f(g(cp, 'arch_staleness_positive_mean'), '.3f')} vs {f(g(tb, 'arch_staleness_positive_mean'), '.2f')} "
            f"optimizer steps), with {g(cp, 'quota_violations', default='-')} quota violations."
        )
    out += _headline_transfer(d.get("transfer_accel.json"), d.get("transfer_omni_seed_accel.json"))
    out += _headline_media(d.get("transfer_omni_seed_dedup_accel.json"), d.get("agent.json"))
    enc = d.get("encode.json")
    if enc:
        rows = [r for r in enc.get("results", []) if r.get("mode") == "fold" and r.get("group_size") == 8]
        if rows:
            r = rows[0]
            out.append(
                f"- Shared encoding (CPU, group size 8): {f(r.get('speedup'))}x per training step, against an Amdahl "
                f"bound of {f(r.get('amdahl_bound'))}x, with exact gradients."
            )
    return "\n".join(out) + "\n\nAll figures, with their commands and the machine's load: [benchmarks/README.md](benchmarks/README.md)."


# ----------------------------------------------------------------------------------------------- machine


@block("machine", optional=("transfer_accel.json", "transfer.json", "loader.json"))
def render_machine(d: dict) -> str:
    """The software and CPU count recorded by the transfer (accel, else CPU) or loader result."""
    name, m = next(((n, _dict(g(d, n, "machine"))) for n in ("transfer_accel.json", "transfer.json", "loader.json")
                    if g(d, n, "machine")), ("transfer.json", {}))
    parts = []
    if _num(m.get("cpus")) is not None:
        parts.append(f"{int(m['cpus'])} CPUs")
    if m.get("platform"):
        parts.append(f"platform `{m['platform']}`")
    for k in ("python", "torch", "ray", "transferqueue"):
        if m.get(k):
            parts.append(f"{k} {m[k]}")
    parts.append("CUDA" if m.get("cuda") else "no GPU")
    return f"As recorded in `results/{name}`: " + ", ".join(parts) + "."


# ----------------------------------------------------------------------------------------------- transfer


def _mode_rows(tr: dict) -> list[tuple[str, dict]]:
    rows = []
    for name, e in (tr.get("modes") or {}).items():
        if not isinstance(e, dict):
            continue
        rows.append((name, e))
        if isinstance(e.get("shared"), dict):
            rows.append((name, e["shared"]))
    return rows


def _engine_label(e: dict) -> str:
    via = e.get("via")
    if via:
        return str(via)
    eng = str(e.get("engine") or "-")
    return eng.split(" ")[0]


def _transfer_modes_table(tr: dict) -> str:
    rows = []
    split = any(isinstance(e.get("breakdown_ms"), dict) for _, e in _mode_rows(tr))
    for name, e in _mode_rows(tr):
        label = f"**{f(_ms(e))}**" if name == g(tr, "iter_reference_mode", default="iter") and e.get("encoding") == "dup" else f(_ms(e))
        variant = e.get("variant") or e.get("best_of") or ""
        rows.append([
            f"{name} ({variant})" if variant else name,
            str(e.get("encoding", "-")),
            _engine_label(e),
            label,
            *([f(g(e, "breakdown_ms", k), ".3f" if k in ("state_dict_ms", "commit_ms") else ".2f")
               for k in ("wait_ms", "own_ms", "state_dict_ms", "commit_ms")] if split else []),
            f(e.get("exposed_latency_max_s"), ".2f", 1000.0),
            f(e.get("step_s"), ".3f"),
            f(e.get("compute_s"), ".3f"),
            f(e.get("bytes_moved_per_step"), ".1f", 1 / MiB),
            f(e.get("bytes_to_trainer_per_step"), ".1f", 1 / MiB),
            str(e.get("delivered", "-")),
            str(e.get("lost", "-")),
            str(e.get("duplicated", "-")),
            _choice(e.get("interleaved"), "yes", "no", "-"),
        ])
    return table(
        ["mode", "encoding", "engine", "exposed ms/step",
         *(["wait ms", "own ms", "state_dict ms", "commit ms"] if split else []), "max ms", "step s", "compute s",
         "moved MiB/step", "to trainer MiB/step", "delivered", "lost", "dup", "interleaved"],
        rows, "lllr" + ("rrrr" if split else "") + "rrrrrrrrl",
    )


def _transfer_delivery(tr: dict) -> str:
    rows = _mode_rows(tr)
    if not rows:
        return ""
    bad = [f"{n}/{e.get('encoding', '-')}" for n, e in rows if e.get("exactly_once") is False]
    expected = {e.get("expected") for _, e in rows}
    n = next(iter(expected)) if len(expected) == 1 else None
    if bad:
        return f"**Not exactly once:** {', '.join(bad)}."
    return (f"Every run delivered each of the {n} trajectories exactly once." if n is not None
            else "Every run delivered each trajectory exactly once.")


def _transfer_ratios(tr: dict) -> str:
    it = g(tr, "iter_reference_mode", default="iter")
    out = []
    r = _num(tr.get("latency_ratio_transferqueue_vs_iter"))
    if r is not None:
        out.append(
            f"Exposed latency, transferqueue driven synchronously over knitdata `{it}`: {r:.1f}x "
            f"(`{it}` at {pct(tr.get('iter_latency_fraction_of_transferqueue'), '.2f')} of transferqueue; "
            f"acceptance <= 1%: {'met' if tr.get('acceptance_iter_latency_le_1pct') else 'not met'})."
        )
    rb = _num(tr.get("latency_ratio_transferqueue_best_vs_iter"))
    ra = _num(tr.get("latency_ratio_transferqueue_best_vs_iter_alone"))
    if rb is not None:
        out.append(f"Against transferqueue at its best (`transferqueue_best` over `{it}`): {rb:.2f}x interleaved"
                   + (f", {ra:.2f}x with each run alone (the fair comparison: interleaved, a prefetching source works "
                      "ahead during the other sources' steps)." if ra is not None else "."))
    return " ".join(out)


def _transfer_2x2(tr: dict) -> str:
    return _join(*(_transfer_2x2_one(tr, key) for key in ("end_to_end", "end_to_end_alone")))


def _transfer_2x2_one(tr: dict, key: str) -> str:
    e2e = tr.get(key)
    if not isinstance(e2e, dict) or not e2e:
        return ""

    def cell(key: str) -> str:
        c = e2e.get(key)
        if not isinstance(c, dict):
            return "-"
        return f"{f(c.get('step_s'), '.3f')} s ({f(_ms(c))} ms exposed)"

    rows = [["transferqueue (best)", cell("tq_dup"), cell("tq_shared")],
            ["knitdata iter", cell("iter_dup"), cell("iter_shared")]]
    extra = []
    eff = e2e["effects"] if isinstance(e2e.get("effects"), dict) else e2e
    for k, label in (("transfer_dup", "transfer effect with dup"), ("transfer_shared", "transfer effect with shared"),
                     ("encoding_tq", "encoding effect on transferqueue"), ("encoding_iter", "encoding effect on iter"),
                     ("both", "both (tq dup over iter shared)"), ("speedup_transfer", "transfer alone (dup)"),
                     ("speedup_encoding", "encoding alone (iter)"), ("speedup_end_to_end", "both (tq dup vs iter shared)")):
        v = eff.get(k)
        if _num(v) is not None:
            extra.append(f"{label} {v:.2f}x")
    what = "each system run alone" if key == "end_to_end_alone" else "interleaved"
    s = f"Step time, transfer x encoding (`{key}`, {what}):\n\n" + table(["system", "dup", "shared"], rows, "lrr")
    if extra:
        s += "\n\nStep-time ratios from this table: " + ", ".join(extra) + "."
    return s


def _transfer_controls(tr: dict) -> str:
    ctl = tr.get("controls")
    if not isinstance(ctl, dict) or not ctl:
        return ""
    modes = tr.get("modes") or {}
    rows = []
    entries = []
    for name, c in ctl.items():
        if isinstance(c, dict):
            entries.append((name, c))
            if isinstance(c.get("shared"), dict):
                entries.append((name, {"encoding": "shared", **c["shared"]}))
    for name, c in entries:
        inter = modes.get(name)
        if isinstance(inter, dict) and c.get("encoding") == "shared":
            inter = inter.get("shared")
        rows.append([name, str(c.get("encoding", "-")), f(_ms(c)), f(_ms(inter) if isinstance(inter, dict) else None),
                     f(c.get("step_s"), ".3f"), _choice(c.get("exactly_once"), "yes", "no", "-")])
    return "Each mode alone (`controls`, not interleaved) beside its interleaved figure:\n\n" + table(
        ["mode", "encoding", "alone exposed ms/step", "interleaved exposed ms/step", "alone step s", "exactly once"],
        rows, "llrrrl")


def _workload_text(tr: dict) -> str:
    w = _dict(tr.get("workload"))
    desc = ", ".join(f"{k} = {'x'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in w.items()
                     if (isinstance(v, (int, float, str)) and not isinstance(v, bool))
                     or (isinstance(v, list) and all(isinstance(x, int) for x in v)))
    return f"Workload (from the JSON): {desc}." if desc else ""


def _measures_text(tr: dict) -> str:
    m = tr.get("compute_measures")
    return f"Compute `{tr.get('compute')}`; what this run measures (from the JSON): {m}." if isinstance(m, str) and m else ""


def render_transfer_result(tr: dict) -> str:
    """Run line, modes table, delivery, latency ratios, the 2x2 table and the alone controls where present."""
    return _join(run_text(tr), _measures_text(tr), _workload_text(tr), _transfer_modes_table(tr),
                 _transfer_delivery(tr) + " " + _transfer_ratios(tr), _transfer_2x2(tr), _transfer_controls(tr))


# The accel mode (``--compute accel``): the summary under the JSON's ``accel`` key.
_ACCEL_MODES = ("transferqueue", "transferqueue_best", "sample", "eager", "iter", "iter_embedded", "floor")


def _accel_table(section: Any) -> str:
    if not isinstance(section, dict) or not section:
        return ""
    rows = []
    for m in _ACCEL_MODES:
        e = section.get(m)
        if not isinstance(e, dict):
            continue
        for enc, x in (("dup", e), ("shared", e.get("shared"))):
            if not isinstance(x, dict):
                continue
            name = f"{m} ({x['variant']})" if x.get("variant") else m
            ex = f(x.get("exposed_ms"), ".3f")
            rows.append([f"**{name}**" if m == "iter" else name, enc, f"**{ex}**" if m == "iter" else ex,
                         f(x.get("wait_ms"), ".3f"), f(x.get("own_ms"), ".3f"), f(x.get("state_dict_ms"), ".3f"),
                         f(x.get("commit_ms"), ".3f"), f(x.get("step_s"), ".3f"), f(x.get("compute_s"), ".3f"),
                         _choice(x.get("exactly_once"), "yes", "**no**", "-")])
    return table(["mode", "encoding", "exposed ms/step", "next: waiting ms", "next: own ms", "state_dict ms",
                  "commit ms", "step s", "compute s", "exactly once"], rows, "llrrrrrrrl")


def _accel_calibration(tr: dict) -> str:
    cal = g(tr, "accel", "calibration")
    if not isinstance(cal, dict):
        return ""
    parts = []
    for enc in ("dup", "shared"):
        c = cal.get(enc)
        if isinstance(c, dict) and isinstance(c.get("microbatch_s"), list):
            mbs = " + ".join(f(x, ".1f", 1000.0) for x in c["microbatch_s"])
            parts.append(f"`{enc}` {mbs} ms per micro-batch and {f(c.get('optimizer_step_s'), '.1f', 1000.0)} ms for "
                         f"the optimizer step ({f(c.get('step_s'), '.3f')} s per step)")
    if not parts:
        return ""
    la = cal.get("loadavg_before")
    return (f"Calibrated compute (model `{cal.get('model', '-')}` alone in the driver, {cal.get('torch_threads', '-')} "
            f"torch thread, median of {cal.get('reps', '-')} steps" + (f", load average {_loads3(la)} before" if _loads3(la) else "")
            + "): " + "; ".join(parts) + ".")


def _accel_2x2(tr: dict) -> str:
    e = g(tr, "accel", "end_to_end_alone")
    if not isinstance(e, dict):
        return ""

    def cell(k: str) -> str:
        c = e.get(k)
        if not isinstance(c, dict):
            return "-"
        return f"{f(c.get('step_s'), '.3f')} s ({f(c.get('exposed_ms'), '.2f')} ms exposed)"

    rows = [["transferqueue synchronous", cell("tq_sync_dup"), "-"],
            ["transferqueue at its best", cell("tq_dup"), cell("tq_shared")],
            ["knitdata iter (Ray engine)", cell("iter_dup"), cell("iter_shared")]]
    return "Step time, transfer x encoding (`accel.end_to_end_alone`, each system alone):\n\n" + table(
        ["system", "dup", "shared"], rows, "lrr")


def _accel_ratios(tr: dict) -> str:
    r = g(tr, "accel", "ratios")
    if not isinstance(r, dict):
        return ""
    meaning = g(tr, "accel", "ratio_meaning") or {}
    rows = [[f"`{k}`", str(meaning.get(k, "")), _x(v, ".2f")] for k, v in r.items()]
    return "Ratios (`accel.ratios`, from the runs alone):\n\n" + table(["ratio", "of", "value"], rows, "llr")


def _accel_acceptance(tr: dict) -> str:
    a = g(tr, "accel", "acceptance")
    if not isinstance(a, dict):
        return ""
    items = []
    for k, v in a.items():
        if not isinstance(v, dict) or not v.get("applies"):
            continue
        verdict = _choice(v.get("met"), "met", "**not met**", "not measured")
        items.append(f"`{k}` ({f(v.get('value'), '.3f')} {v.get('op', '')} {f(v.get('threshold'), 'g')}): {verdict}")
    if not items:
        return ""
    return (f"Acceptance targets judged on this workload (`{g(tr, 'accel', 'workload_kind', default='-')}`): "
            + "; ".join(items) + ".")


def _accel_delivery(tr: dict) -> str:
    bad = []
    for sec in ("alone", "interleaved"):
        for m, e in (g(tr, "accel", sec) or {}).items():
            for enc, x in (("dup", e), ("shared", (e or {}).get("shared"))):
                if isinstance(x, dict) and x.get("exactly_once") is False:
                    bad.append(f"{m}/{enc} ({sec})")
    if bad:
        return f"**Not exactly once:** {', '.join(bad)}."
    if tr.get("exactly_once_all_runs") is True:
        return ("Every run, interleaved and alone, delivered each trajectory exactly once."
                if tr.get("interleaved_run", True) else "Every run (each alone) delivered each trajectory exactly once.")
    return ""


def render_transfer_accel_result(tr: dict) -> str:
    """The accel mode of the transfer benchmark: what it measures, the calibration, each system alone and
    interleaved broken down by call, the 2x2 step times, the ratios and the acceptance verdicts."""
    if not isinstance(tr.get("accel"), dict):
        return _join(run_text(tr), "_This result has no `accel` section (run with `--compute accel`)._")
    acc = tr["accel"]
    parts = [run_text(tr), _measures_text(tr), _workload_text(tr), _accel_calibration(tr)]
    alone = _accel_table(acc.get("alone"))
    if alone:
        parts.append("Each system alone (`accel.alone`; exposed = every data call per step, broken down by call; "
                     "medians over steps):\n\n" + alone)
    inter = _accel_table(acc.get("interleaved"))
    if inter:
        parts.append("Interleaved step by step in the same consumer processes (`accel.interleaved`; a prefetching "
                     "source works ahead during the other sources' steps):\n\n" + inter)
    parts += [_accel_delivery(tr), _accel_2x2(tr), _accel_ratios(tr), _accel_acceptance(tr)]
    return _join(*parts)


@block("transfer-accel", optional=("transfer_accel.json",))
def render_transfer_accel(d: dict) -> str:
    """The image workload, accel mode."""
    tr = d.get("transfer_accel.json")
    return render_transfer_accel_result(tr) if tr else missing("transfer_accel.json")


@block("transfer-accel-omni", optional=("transfer_omni_accel.json",))
def render_transfer_accel_omni(d: dict) -> str:
    """The omni workload (CPU-sized default), accel mode."""
    tr = d.get("transfer_omni_accel.json")
    return render_transfer_accel_result(tr) if tr else missing("transfer_omni_accel.json")


@block("transfer-omni-seed-media", optional=("transfer_omni_seed_dedup_accel.json",))
def render_transfer_omni_seed_media(d: dict) -> str:
    """Omni at the seed's size with media stored once (issue 43) against per-trajectory copies, per mode."""
    tr = d.get("transfer_omni_seed_dedup_accel.json")
    if not tr:
        return missing("transfer_omni_seed_dedup_accel.json")
    rows = []
    for mode, e in _dict(_dict(tr.get("media")).get("by_mode")).items():
        for run in ("dedup", "copies"):
            r = _dict(e).get(run)
            if not r:
                continue
            rows.append([f"`{mode}`", "media stored once" if run == "dedup" else "per-trajectory copies",
                         f(r.get("bytes_stored_per_group"), ".2f", 1e-6), f(r.get("bytes_moved_per_step"), ".1f", 1e-6),
                         f(r.get("storage_high_water_bytes"), ".2f", 1e-9), f(r.get("step_s"), ".3f"),
                         f(r.get("wait_ms"), ".1f")])
    lt = load_text(tr)
    head = (f"Recorded in the result: command `{tr.get('command', '-')}`; {f(tr.get('total_s'), '.0f')} s wall"
            + (f"; {lt}" if lt else "") + ". Copies are the same run's controls with `media_dedup=False` "
            "(each mode alone, in the same processes).")
    parts = [head, table(["mode", "storage", "stored MB/group", "moved MB/step", "high-water GB", "step s",
                          "wait ms"], rows, "llrrrrr")]
    for mode, e in _dict(_dict(tr.get("media")).get("by_mode")).items():
        q = _dict(_dict(e).get("ratios_copies_over_dedup"))
        if q:
            parts.append(f"`{mode}`, copies / stored once: bytes stored per group "
                         f"{f(q.get('bytes_stored_per_group'), '.2f', suffix='x')}, moved per step "
                         f"{f(q.get('bytes_moved_per_step'), '.2f', suffix='x')}, storage high-water "
                         f"{f(q.get('storage_high_water_bytes'), '.2f', suffix='x')}, step time "
                         f"{f(q.get('step_s'), '.3f', suffix='x')}.")
    return _join(*parts)


def _headline_media(tr: dict | None, agent: dict | None) -> list[str]:
    """The README headline line for media stored once (omni at the seed's size; the agent workload)."""
    e = _dict(_dict(_dict(tr).get("media")).get("by_mode")).get("iter/shared") if tr else None
    out = []
    if e and e.get("dedup") and e.get("copies"):
        a, b, q = _dict(e["dedup"]), _dict(e["copies"]), _dict(e.get("ratios_copies_over_dedup"))
        turns = _dict(_dict(_dict(agent).get("ratios")).get("turns")) if agent else {}
        out.append(
            f"- Media stored and moved once (omni at the seed's size, groups of 8, `iter` + shared encoding): "
            f"{f(a.get('bytes_stored_per_group'), '.1f', 1e-6)} MB stored per group against "
            f"{f(b.get('bytes_stored_per_group'), '.1f', 1e-6)} MB with per-trajectory copies "
            f"({f(q.get('bytes_stored_per_group'), '.2f', suffix='x')}), "
            f"{f(a.get('bytes_moved_per_step'), '.1f', 1e-6)} vs {f(b.get('bytes_moved_per_step'), '.1f', 1e-6)} MB "
            f"moved per step ({f(q.get('bytes_moved_per_step'), '.2f', suffix='x')}), storage high-water "
            f"{f(a.get('storage_high_water_bytes'), '.2f', 1e-9)} vs {f(b.get('storage_high_water_bytes'), '.2f', 1e-9)} GB, "
            f"step time {f(a.get('step_s'), '.3f')} vs {f(b.get('step_s'), '.3f')} s"
            + (f"; multi-turn agent episodes as per-turn samples: {f(turns.get('moved'), '.2f', suffix='x')} fewer "
               f"bytes moved, {f(turns.get('step_speedup'), '.2f', suffix='x')} per step" if turns else "") + ".")
    return out


@block("transfer-accel-omni-seed", optional=("transfer_omni_seed_accel.json",))
def render_transfer_accel_omni_seed(d: dict) -> str:
    """The omni workload at the seed's size, accel mode."""
    tr = d.get("transfer_omni_seed_accel.json")
    return render_transfer_accel_result(tr) if tr else missing("transfer_omni_seed_accel.json")


def render_transfer_speedups_result(tr: dict) -> str:
    """Step-time ratios (measured on CPU) and the GPU projection with its stated assumptions."""
    p = _dict(tr.get("speedup_end_to_end_projected_gpu"))
    pm = _dict(p.get("model"))
    rows = []
    for key, label, compared, pkey in (
        ("speedup_transfer", "transfer alone", "transferqueue vs iter, both `dup`", "speedup_transfer"),
        ("speedup_encoding", "encoding alone", "iter `dup` vs iter `shared`", "speedup_encoding"),
        ("speedup_end_to_end_cpu", "both together", "transferqueue + `dup` vs iter + `shared`", "speedup"),
    ):
        if _num(tr.get(key)) is None and _num(pm.get(pkey)) is None:
            continue
        rows.append([label, compared, f(tr.get(key), ".2f", suffix="x"), f(pm.get(pkey), ".2f", suffix="x")])
    parts = []
    if rows:
        parts.append(table(["speedup", "compared", "CPU, measured", "GPU, projected"], rows, "llrr"))
    if pm:
        cfg = _dict(pm.get("config"))
        tiny = _dict(p.get("tiny_model"))
        parts.append(
            f"GPU projection (`speedup_end_to_end_projected_gpu`; a projection, not a measurement): compute = FLOPs "
            f"counted for one consumer's step of the model `{cfg.get('name', '-')}` ({f(pm.get('params'), '.1f', 1e-9)}B "
            f"parameters) at a stated {f(p.get('rate_tflops'), '.0f')} TFLOP/s, {p.get('precision', '-')}: "
            f"{f(pm.get('compute_s_dup'))} s (`dup`) / {f(pm.get('compute_s_shared'))} s (`shared`) per step, plus the "
            f"exposed latencies measured here. That gives {f(pm.get('speedup'))}x end to end, against the seed's "
            f"{f(p.get('seed_speedup'), '.1f')}x; the seed's figure would need transferqueue to expose "
            f"{f(pm.get('break_even_transferqueue_latency_s_for_seed'), '.1f')} s per step. With the tiny CPU model's "
            f"FLOPs the same formula gives {f(tiny.get('speedup'), '.0f')}x (the step is then pure transfer)."
        )
        arch = ", ".join(f"{k} = {v}" for k, v in cfg.items() if k != "name" and _num(v) is not None)
        step = _num(pm.get("step_s_transferqueue_dup"))
        tq = _ms(g(tr, "modes", "transferqueue"))
        cd, cs = _num(pm.get("compute_s_dup")), _num(pm.get("compute_s_shared"))
        share = []
        if step and tq is not None:
            share.append(f"transferqueue's exposed latency is {tq / 1000 / step * 100:.1f}% of the projected step")
        if step and cd is not None and cs is not None:
            share.append(f"deduplicating the image encoder saves {(cd - cs) / step * 100:.1f}% of it")
        if arch:
            parts.append(f"Projected model (from the JSON): {arch}." + (" On this workload " + " and ".join(share) + "."
                                                                        if share else ""))
        if p.get("assumption"):
            parts.append(f"Assumption recorded in the JSON: {p['assumption']}.")
    return _join(*parts)


@block("transfer", "transfer.json")
def render_transfer(d: dict) -> str:
    """The image workload of the transfer benchmark."""
    return render_transfer_result(d["transfer.json"])


@block("transfer-speedups", "transfer.json")
def render_transfer_speedups(d: dict) -> str:
    """Speedups of the image workload, measured and projected."""
    return render_transfer_speedups_result(d["transfer.json"])


@block("transfer-omni", optional=("transfer_omni.json",))
def render_transfer_omni(d: dict) -> str:
    """The omni workload (video + audio) of the transfer benchmark, when committed."""
    tr = d.get("transfer_omni.json")
    if not tr:
        return missing("transfer_omni.json")
    return _join(render_transfer_result(tr), render_transfer_speedups_result(tr))


@block("transfer-gpu", optional=("transfer_gpu.json",))
def render_transfer_gpu(d: dict) -> str:
    """The knitdata modes of the transfer benchmark trained on CUDA (``--gpu``), when committed."""
    tr = d.get("transfer_gpu.json")
    if not tr:
        return missing("transfer_gpu.json")
    return _join(render_transfer_result(tr), render_transfer_speedups_result(tr))


# ----------------------------------------------------------------------------------------------- admission

SCENARIOS = ("skewed", "balanced", "codeagent", "oversampled")


def _scenario_desc(p: dict) -> str:
    src = p.get("sources") or []
    durs = ", ".join(
        f"{s.get('name')} ({s.get('mean')}, {s.get('sigma')})" + (f" drop {s.get('drop')}" if s.get("drop") else "")
        for s in src if isinstance(s, dict))
    quotas = "/".join(str(s.get("quota")) for s in src if isinstance(s, dict))
    extra = []
    if p.get("continuous"):
        extra.append("continuous stream")
    if isinstance(p.get("bounds"), dict):
        b = {tuple(v) for v in p["bounds"].values() if isinstance(v, list)}
        extra.append("bounds " + ", ".join(f"{lo}..{hi}" for lo, hi in sorted(b)))
    return f"{p.get('name', '?')}: {durs}, q = {quotas}" + ("; " + ", ".join(extra) if extra else "")


@block("admission", *(f"admission_{s}.json" for s in SCENARIOS))
def render_admission(d: dict) -> str:
    """Architectural staleness per policy and scenario: positive-part headline, signed mean, p95, share negative."""
    rows = []
    params = None
    for s in SCENARIOS:
        r = d.get(f"admission_{s}.json")
        if not r:
            continue
        params = params or r.get("params")
        pol = r.get("policies") or {}
        tb, lt, fi, cp = (pol.get(k) or {} for k in ("train_batch", "linear_target", "fifo", "constraint_preserving"))
        rows.append([
            _scenario_desc(r.get("params") or {}),
            f(tb.get("arch_staleness_positive_mean")),
            f"{f(lt.get('arch_staleness_positive_mean'), '.3f')} ({pct(lt.get('reduction_positive_vs_train_batch'))})",
            f"{f(fi.get('arch_staleness_positive_mean'), '.3f')}, {fi.get('quota_violations', '-')}",
            f"**{f(cp.get('arch_staleness_positive_mean'), '.3f')} ({pct(cp.get('reduction_positive_vs_train_batch'))})**, "
            f"{f(cp.get('arch_staleness_mean'), '.3f')}, {f(cp.get('arch_staleness_p95'), '.1f')}, "
            f"{pct(cp.get('share_negative'))}, {cp.get('quota_violations', '-')}",
        ])
    head = ""
    if params:
        head = (f"Parameters (from the JSON): B = {params.get('B')} trajectories in groups of {params.get('group_size')}, "
                f"M = {params.get('num_minibatches')} mini-batches, C = {params.get('slots')} rollout slots, "
                f"{params.get('train_time')} time units of training per mini-batch, sync every `{params.get('sync')}`, "
                f"partial rollout {'on' if params.get('partial') else 'off'}, {params.get('num_batches')} train batches; "
                f"medians over seeds {', '.join(map(str, g(d, 'admission_skewed.json', 'seeds', default=[])))}. "
                f"Durations per source: (log-normal mean, sigma) in time units.")
    return _join(head, table(
        ["scenario", "train_batch arch+", "linear_target arch+ (red.)", "fifo arch+, quota viol.",
         "constraint_preserving arch+ (red.), signed mean, p95, share negative, quota viol."], rows, "lrrrr"))


@block("admission-sweep", "admission_sweep_m.json")
def render_admission_sweep(d: dict) -> str:
    """The M sweep on `skewed` and the admission cost per trajectory (``scaling``)."""
    r = d["admission_sweep_m.json"]
    parts = []
    sweep = r.get("M") or {}
    items = []
    for m in sorted(sweep, key=lambda k: int(k)):
        cp = g(sweep, m, "policies", "constraint_preserving") or {}
        items.append(f"M = {m}: {pct(cp.get('reduction_vs_train_batch'))} signed "
                     f"({pct(1 - 1 / int(m))} by 1 - 1/M), {pct(cp.get('reduction_positive_vs_train_batch'))} positive part")
    if items:
        parts.append(f"M sweep on `{r.get('scenario', 'skewed')}`, constraint-preserving reduction against train-batch "
                     "admission: " + "; ".join(items) + ".")
    sc = r.get("scaling") or {}
    rows = []
    for mode, label in (("fixed_M", "M = {M}"), ("fixed_m", "m = {m}")):
        for pol, e in (sc.get(mode) or {}).items():
            rr = (e or {}).get("rows") or []
            if not rr:
                continue
            lo, hi = rr[0], rr[-1]
            lab = label.format(M=lo.get("num_minibatches"), m=lo.get("minibatch_size"))
            rows.append([f"{pol}, {lab}", f(lo.get("us_per_trajectory")), f(hi.get("us_per_trajectory")),
                         f(e.get("ratio_largest_vs_smallest")),
                         f"{lo.get('batch_size')} .. {hi.get('batch_size')}"])
    if rows:
        parts.append("Admission cost (`scaling` in the JSON), microseconds of thread CPU time per trajectory for "
                     "`offer` + `poll`, min of the repeats, at the smallest and the largest train batch B:\n\n"
                     + table(["policy, mode", "smallest B", "largest B", "ratio", "B"], rows, "lrrrr"))
    return _join(*parts)


# ----------------------------------------------------------------------------------------------- encode


@block("encode", "encode.json")
def render_encode(d: dict) -> str:
    """Duplicated vs deduplicated encoding per group size: speedup, Amdahl bound, encoder FLOP ratio."""
    r = d["encode.json"]
    by_n: dict[int, dict[str, dict]] = {}
    for e in r.get("results") or []:
        by_n.setdefault(e.get("group_size"), {})[e.get("mode")] = e
    modes = ("fold", "leaf", "recompute")
    rows = []
    shares = []
    for n in sorted(k for k in by_n if k is not None):
        es = [by_n[n].get(m) or {} for m in modes]
        bound = next((e.get("amdahl_bound") for e in es if _num(e.get("amdahl_bound")) is not None), None)
        shares += [e["encoder_share"] for e in es if _num(e.get("encoder_share")) is not None]
        over = " / ".join(f(e.get("speedup_over_bound")) for e in es) if (_num(bound) or 0) > 1.0 else "-"
        rows.append([str(n), " / ".join(modes), " / ".join(f(e.get("speedup")) for e in es), f(bound), over,
                     " / ".join(f(e.get("encoder_flop_ratio"), ".3g") for e in es)])
    parts = [table(["n", "mode", "speedup", "Amdahl bound", "speedup / bound", "encoder FLOP ratio"], rows, "rlrrrr")]
    f8 = by_n.get(8, {}).get("fold") or {}
    if _num(f8.get("speedup_over_bound")) is not None:
        parts.append(f"At n = 8, fold reaches {f8['speedup_over_bound']:.2f} of its Amdahl bound (the target is 0.85) "
                     f"and cuts encoder FLOPs {f(f8.get('encoder_flop_ratio'), '.3g')}-fold.")
    if shares:
        parts.append(f"The encoder's share of the duplicated step: f = {min(shares):.2f}-{max(shares):.2f}. "
                     f"Clock: {r.get('config', {}).get('clock', '-')} time, {r.get('threads', '-')} torch thread(s), "
                     f"median of {g(r, 'config', 'repeats', default='-')} repeats.")
    return _join(*parts)


def _paired(e: dict) -> float | None:
    a, b = e.get("dup_step_s_all") or [], e.get("dedup_step_s_all") or []
    rat = [x / y for x, y in zip(a, b) if _num(x) and _num(y)]
    if _num(e.get("speedup_paired")) is not None:
        return float(e["speedup_paired"])
    return statistics.median(rat) if rat else None


@block("encode-n8", "encode_n8_run1.json", "encode_n8_run2.json")
def render_encode_n8(d: dict) -> str:
    """Two runs at n = 8 with the measured bound (encoder scaling), SharedEncoding's overhead and paired ratios."""
    parts = []
    scal, notes = [], []
    for i, fn in enumerate(("encode_n8_run1.json", "encode_n8_run2.json"), 1):
        r = d.get(fn)
        if not r:
            continue
        rows = []
        for e in r.get("results") or []:
            p = _paired(e)
            bound = _num(e.get("amdahl_bound"))
            rows.append([e.get("mode", "-"), f(e.get("dup_step_s"), ".4f"), f(e.get("dedup_step_s"), ".4f"),
                         f(e.get("speedup")), f(e.get("encoder_share")), f(e.get("amdahl_bound")),
                         f(e.get("speedup_over_bound")), f(e.get("encoder_flop_ratio")), f(e.get("encoder_scaling")),
                         f(e.get("measured_bound")), f(e.get("speedup_over_measured_bound")),
                         f(e.get("overhead_s"), ".2f", 1000.0), f(p), f(p / bound if p and bound else None)])
            if _num(e.get("encoder_scaling")) is not None:
                scal.append(e["encoder_scaling"])
            if e.get("mode") == "fold":
                dd = [x for x in e.get("dedup_step_s_all") or [] if _num(x) is not None]
                pr = [x / y for x, y in zip(e.get("dup_step_s_all") or [], e.get("dedup_step_s_all") or [])
                      if _num(x) and _num(y)]
                if dd and pr:
                    notes.append(f"run {i}: fold step {min(dd):.3f}-{max(dd):.3f} s, per-repetition ratios "
                                 f"dup/fold {min(pr):.2f}-{max(pr):.2f}, fold/bound "
                                 f"{f(e.get('speedup_over_bound'))}, paired median/bound "
                                 f"{f(p / bound if p and bound else None)}")
        parts.append(f"Run {i} (`results/{fn}`, {g(r, 'config', 'repeats', default='-')} repeats, "
                     f"{g(r, 'config', 'clock', default='-')} clock):\n\n" + table(
                         ["mode", "dup s", "dedup s", "speedup", "f", "bound", "sp/bnd", "encFLOP x", "enc scal",
                          "m.bound", "sp/mbd", "ovh ms", "paired sp", "paired/bnd"], rows, "l" + "r" * 13))
    if scal:
        parts.append(f"Encoding the unique images once costs {min(scal):.2f}-{max(scal):.2f} times `1/n` of encoding "
                     f"every copy (`enc scal`). " + ("; ".join(notes) + "." if notes else ""))
    return _join(*parts)


# ----------------------------------------------------------------------------------------------- loader


_PHASES = ("start", "first", "per_microbatch", "end", "total")


@block("loader", "loader.json")
def render_loader(d: dict) -> str:
    """Loader overhead vs a plain DataLoader, bandwidth, and exposed latency per fetch mode."""
    r = d["loader.json"]
    ov = r.get("overhead") or {}
    med, rat, cpu = ov.get("median_s") or {}, ov.get("ratio_vs_torch") or {}, ov.get("cpu_ratio_vs_torch") or {}
    rows = [["torch DataLoader (num_workers=0, same micro-batches, same collate)", f(med.get("torch"), ".4f"), "1.000", "1.000"],
            ["knitdata eager (`overhead_ratio_vs_torch`)", f(med.get("eager"), ".4f"), f"**{f(rat.get('eager'), '.3f')}**",
             f(cpu.get("eager"), ".3f")],
            ["knitdata iter (`overhead_ratio_vs_torch_iter`)", f(med.get("iter"), ".4f"), f"**{f(rat.get('iter'), '.3f')}**",
             f(cpu.get("iter"), ".3f")]]
    tgt = g(r, "targets", "overhead_ratio_vs_torch_max")
    parts = [run_text(r),
             f"{ov.get('trajectories', '-')} trajectories, {ov.get('microbatches', '-')} micro-batches, "
             f"{ov.get('repeats', '-')} interleaved repeats"
             + (f" in each of {ov['processes']} fresh processes (medians across them)" if ov.get("processes") else "")
             + (f"; target ratio <= {tgt}" if tgt is not None else "") + ":",
             table(["loader", "median s", "ratio", "cpu ratio"], rows, "lrrr")
             + ("\n\nThe ratio across the processes (first quartile / median / third quartile): " + "; ".join(
                 f"{m} {' / '.join(f(x, '.3f') for x in q)}" for m, q in ov["ratio_quartiles"].items()) + "."
                if ov.get("ratio_quartiles") else ""),
             f"Bandwidth over {f(r.get('bandwidth_bytes'), '.0f', 1 / MiB)} MiB of 1 MiB payloads: memcpy "
             f"{f(r.get('memcpy_GBps'))} GB/s, local fetch (one copy per byte) {f(r.get('local_fetch_GBps'))} GB/s"
             + (f" ({f(r.get('local_fetch_over_memcpy'), '.0f', 100)}% of memcpy; the same copying collate without "
                f"knitdata {f(r.get('plain_collate_GBps'))} GB/s, interleaved)." if r.get('plain_collate_GBps') is not None
                else ".")]
    ph = r.get("overhead_phases")
    if isinstance(ph, dict) and isinstance(g(ph, "token", "phases_us"), dict):
        prow = []
        for cname, what in (("token", "token collate"), ("none", "a collate that does nothing")):
            tab, over = g(ph, cname, "phases_us") or {}, g(ph, cname, "overhead_us") or {}
            prow.append([f"torch DataLoader, {what}"] + [f(g(tab, "torch", k), ".1f") for k in _PHASES])
            prow += [[f"knitdata {side} minus torch, {what}"] + [f(g(over, side, k), ".1f") for k in _PHASES]
                     for side in ("eager", "iter")]
        share = ph.get("fixed_share") or {}
        parts.append(
            f"Where a pass goes (medians over {ph.get('repeats', '-')} interleaved repeats, microseconds): `iter()`, the "
            "first `next()`, each later micro-batch, the `next()` that ends the pass, and the pass. Of knitdata's "
            "overhead (token collate), the part paid once per pass: "
            + ", ".join(f"{k} {f(v, '.0f', 100)}%" for k, v in share.items()) + ".\n\n"
            + table(["", "start", "first", "per micro-batch", "end", "pass"], prow, "lrrrrr"))
    mp = g(r, "modes", "params") or {}
    mrows = []
    eager = _num(g(r, "modes", "eager", "exposed_latency_s"))
    for m in ("sample", "eager", "iter"):
        e = g(r, "modes", m)
        if not isinstance(e, dict):
            continue
        x = _num(e.get("exposed_latency_s"))
        vs = f"{x / eager:.3f}" if x is not None and eager else "-"
        mrows.append([m, f(x, ".2f", 1000.0), f(e.get("exposed_latency_p95_s"), ".2f", 1000.0),
                      f(e.get("step_time_s"), ".1f", 1000.0), f"**{vs}**" if m == "iter" else vs])
    if mrows:
        tgt2 = g(r, "targets", "iter_exposed_over_eager_max")
        parts.append(
            f"Exposed latency per step, K = {mp.get('microbatches_per_step', '-')} micro-batches of "
            f"{mp.get('trajectories_per_microbatch', '-')} trajectories: a fetch (decode + collate) takes "
            f"{f(mp.get('fetch_s_per_microbatch'), '.1f', 1000.0)} ms per micro-batch and compute (a one-thread matmul) "
            f"{f(mp.get('compute_s_per_microbatch'), '.1f', 1000.0)} ms; {mp.get('rounds', '-')} rounds of "
            f"{mp.get('steps', '-')} steps after {mp.get('warmup_steps', '-')} warm-up steps, modes interleaved"
            + (f"; target iter/eager <= {tgt2}" if tgt2 is not None else "") + ":\n\n"
            + table(["mode", "exposed ms/step", "p95 ms", "step ms", "vs eager"], mrows, "lrrrr"))
    return _join(*parts)


# ----------------------------------------------------------------------------------------------- placement


@block("placement", "placement.json")
def render_placement(d: dict) -> str:
    """Bytes read across nodes and per-consumer throughput, consumer-aware vs ``index % units``."""
    r = d["placement.json"]
    pl = r.get("placements") or {}
    rows, agree = [], []
    for key, label in (("consumer_aware", "consumer-aware"), ("index_mod", "`index % units`")):
        e = pl.get(key)
        if not isinstance(e, dict):
            continue
        tp = [x for x in e.get("throughput_MBps_per_consumer") or [] if _num(x) is not None]
        rng = f"{min(tp):.1f}-{max(tp):.1f}" if tp else "-"
        rows.append([label, f(e.get("read_cross_bytes"), ".2f", 1e-6, " MB"), pct(e.get("read_cross_fraction")),
                     f(e.get("throughput_MBps_median"), ".1f", suffix=" MB/s"), rng,
                     _choice(e.get("exactly_once"), "yes", "no", "-")])
        a, b = _num(e.get("read_cross_bytes")), _num(e.get("planned_remote_bytes"))
        if a and b:
            agree.append(abs(a - b) / a)
    ft = r.get("fetch_throughput") or {}
    parts = [
        f"{r.get('nodes', '-')} nodes, {r.get('trajectories', '-')} trajectories "
        f"({f(r.get('payload_bytes'), '.1f', 1e-6)} MB), `{r.get('fetch', '-')}` fetch.",
        table(["placement", "read across nodes", "share of reads", "throughput per consumer (median)",
               "per consumer MB/s", "exactly once"], rows, "lrrrrl"),
        f"Consumer-aware placement reads {pct(r.get('cross_bytes_reduction'))} fewer bytes across nodes"
        + (f"; the read counters agree with the planner's expected remote bytes to within {max(agree) * 100:.1f}%"
           if agree else "") + ".",
    ]
    if ft:
        parts.append(f"Single fetches of {f(ft.get('record_bytes'), '.0f', 1 / MiB)} MiB records: local "
                     f"{f(ft.get('local_MBps'), '.0f')} MB/s, across nodes {f(ft.get('cross_MBps'), '.0f')} MB/s, memcpy "
                     f"{f(ft.get('memcpy_MBps'), '.0f')} MB/s.")
    return _join(*parts)


# ----------------------------------------------------------------------------------------------- soak


def _soak_runs(r: dict | None) -> list[dict]:
    if not isinstance(r, dict):
        return []
    if isinstance(r.get("runs"), list):
        mode = r.get("mode")
        return [({"mode": mode, **x} if mode and "mode" not in x else x) for x in r["runs"] if isinstance(x, dict)]
    return [r]


def _soak_label(run: dict) -> str:
    if run.get("mode") == "cross_process" and isinstance(run.get("label"), str):
        return run["label"]  # e.g. "ray (processes, no faults)" beside "ray (processes)"
    eng = str(run.get("engine") or g(run, "config", "engine") or "?")
    mode = run.get("mode") or g(run, "config", "mode")
    return f"{eng} ({str(mode).replace('_', '-')})" if mode else eng


def _soak_table(runs: list[dict]) -> str:
    def col(fn: Callable[[dict], str]) -> list[str]:
        return [fn(x) for x in runs]

    cap = {x.get("capacity_bytes") for x in runs}
    cap_s = f(next(iter(cap)), ".1f", 1 / MiB, " MiB") if len(cap) == 1 else "per run"
    rows = [
        ["throughput (trajectories/s)"] + col(lambda x: f(x.get("throughput_per_s"), ".1f")),
        ["seconds"] + col(lambda x: f(x.get("seconds"), ".1f")),
        ["trajectories"] + col(lambda x: str(x.get("trajectories", "-"))),
        ["lost / duplicated"] + col(lambda x: f"{x.get('lost', '-')} / {x.get('duplicated', '-')}"),
        ["consumer restarts"] + col(lambda x: str(x.get("restarts", "-"))),
        [f"store high-water (capacity {cap_s})"] + col(lambda x: f(x.get("store_high_water_bytes"), ".1f", 1 / MiB, " MiB")),
        ["RSS growth after warm-up (bound: capacity + 64 MiB)"] + col(
            lambda x: f(x.get("rss_growth_bytes"), ".1f", 1 / MiB, " MiB")),
        ["within bounds, ok"] + col(lambda x: "yes" if x.get("ok") else "no"),
    ]
    if any("coordinator_restarts" in x for x in runs):
        rows.append(["coordinator restarts"] + col(lambda x: str(x.get("coordinator_restarts", "-"))))
    return table([""] + [_soak_label(x) for x in runs], rows)


@block("soak", "soak.json", optional=("soak_ray_xproc.json",))
def render_soak(d: dict) -> str:
    """Sustained load per engine; a cross-process Ray run (``soak_ray_xproc.json``) as one more column when present."""
    runs = _soak_runs(d.get("soak.json")) + _soak_runs(d.get("soak_ray_xproc.json"))
    loads = [load_text(r) for r in [d.get("soak.json"), d.get("soak_ray_xproc.json")] + runs if r and load_text(r)]
    parts = [_soak_table(runs)]
    if loads:
        parts.append(loads[0][0].upper() + loads[0][1:] + ".")
    if d.get("soak_ray_xproc.json") is None:
        parts.append("No cross-process Ray soak is committed yet (`results/soak_ray_xproc.json`).")
    return _join(*parts)


@block("soak-kill-coordinator", "soak_kill_coordinator.json")
def render_soak_kill(d: dict) -> str:
    """The soak with the coordinator SIGKILLed periodically."""
    r = d["soak_kill_coordinator.json"]
    lt = load_text(r)
    return (f"{r.get('coordinator_restarts', '-')} coordinator restarts in {f(r.get('seconds'), '.1f')} s, "
            f"{r.get('trajectories', '-')} trajectories, {r.get('restarts', '-')} consumer restarts from saved states: "
            f"**{r.get('lost', '-')} lost, {r.get('duplicated', '-')} duplicated**, store high-water "
            f"{f(r.get('store_high_water_bytes'), '.1f', 1 / MiB)} MiB of {f(r.get('capacity_bytes'), '.1f', 1 / MiB)} MiB, "
            f"{f(r.get('throughput_per_s'), '.0f')} trajectories/s" + (f"; {lt}" if lt else "") + ".")


# ----------------------------------------------------------------------------------------------- vlm


@block("vlm", "vlm.json")
def render_vlm(d: dict) -> str:
    """SharedEncoding on Qwen2.5-VL, Qwen2-Audio, Qwen2.5-Omni and Qwen3-VL configs: step time, speedup, peak
    memory, gradient difference."""
    r = d["vlm.json"]
    rows = []
    spread = []
    for e in r.get("results") or []:
        rows.append([str(e.get("family", "-")), str(e.get("size", "-")), str(e.get("mode", "-")), f(e.get("step_s"), ".4f"),
                     f(e.get("speedup")), f(e.get("peak_mem_bytes"), ".1f", 1 / MiB, "M"),
                     f(e.get("max_rel_grad_diff"), ".2e")])
        xs = [x for x in e.get("step_s_all") or [] if _num(x)]
        if xs:
            spread.append(max(xs) / min(xs) - 1)
    info = [f"transformers {r['transformers']}" if r.get("transformers") else "",
            f"clock: {r['clock']}" if r.get("clock") else "", f"device: {r['device']}" if r.get("device") else "",
            f"median of {g(r, 'config', 'repeats')} repeats" if g(r, "config", "repeats") else "", load_text(r)]
    parts = ["Recorded in the result: " + "; ".join(x for x in info if x) + ".",
             table(["family", "size", "mode", "step s", "speedup", "peak mem", "grad diff"], rows, "lllrrrr")]
    if spread:
        parts.append(f"Per-repetition step times of one mode vary by up to {max(spread) * 100:.0f}% (`step_s_all`).")
    decodes = {(e.get("family"), e.get("size")): e.get("video_decodes") for e in r.get("results") or []
               if e.get("video_decodes")}
    for (fam, size), dec in decodes.items():
        parts.append(f"{fam} {size}: {len(dec)} unique videos per mini-batch, each container decoded "
                     f"{'/'.join(str(x) for x in dec)} time(s) (`video_decodes`).")
    return _join(*parts)


# ----------------------------------------------------------------------------------------------- control


def _coord(c: Any) -> Any:
    return g(c, "coordinator_cpu_ms_per_traj") if g(c, "coordinator_cpu_ms_per_traj") is not None else g(c, "coord_cpu_ms")


@block("control", "control.json")
def render_control(d: dict) -> str:
    """Put throughput and latency per engine, producer count and size; coordinator CPU; trainer data time."""
    r = d["control.json"]
    rows = []
    for eng, ee in (r.get("engines") or {}).items():
        for prod, pe in (g(ee, "producers") or {}).items():
            for size, se in (pe or {}).items():
                for call, c in (se or {}).items():
                    if not isinstance(c, dict):
                        continue
                    rows.append([eng, str(prod), size, call, f(c.get("traj_per_s"), ".0f"), f(c.get("p50_ms")),
                                 f(c.get("p99_ms")), f(_coord(c), ".3f"), f(c.get("coordinator_admit_cpu_ms_per_traj"), ".3f"),
                                 f(g(c, "group_commit", "puts_per_call"), ".1f")])
    parts = [run_text(r), table(["engine", "producers", "size", "call", "traj/s", "p50 ms", "p99 ms", "coord CPU ms/traj",
                                 "of it in admission", "puts per coordinator call"], rows, "lrllrrrrrr")]
    td = r.get("trainer_data") or {}
    lines = []
    for eng, t in td.items():
        if isinstance(t, dict):
            lines.append(f"{eng}: {f(t.get('ms_per_step'))} ms (next {f(t.get('next_ms_median'))}, commit "
                         f"{f(t.get('commit_ms_median'), '.3f')}, state_dict {f(t.get('state_ms_median'), '.3f')} ms medians, "
                         f"{t.get('steps', '-')} steps)")
    if lines:
        parts.append("Trainer data time per step: " + "; ".join(lines) + ".")
    # Goals from the control-plane issue, checked against the figures above.
    ray16 = g(r, "engines", "ray", "producers", "16", "1KiB") or {}
    goals = []
    pm, pu = g(ray16, "put_many_32", "traj_per_s"), g(ray16, "put", "traj_per_s")
    best = max([x for x in (pm, pu) if _num(x) is not None], default=None)
    if best is not None:
        goals.append(f"Ray at 16 producers and 1 KiB reaches at least 2,000 trajectories/s: "
                     f"**{'met' if best >= 2000 else 'not met'}** ({f(pm, '.0f')} with `put_many`, {f(pu, '.0f')} with `put`)")
    cm, cp = _coord(ray16.get("put_many_32")), _coord(ray16.get("put"))
    if _num(cm) is not None or _num(cp) is not None:
        goals.append(f"at most 0.25 ms of coordinator CPU per trajectory at 16 producers: `put_many` "
                     f"{f(cm, '.3f')} ({'met' if (_num(cm) or 9) <= 0.25 else 'not met'}), `put` {f(cp, '.3f')} "
                     f"({'met' if (_num(cp) or 9) <= 0.25 else 'not met'})")
    rc = g(td, "ray", "commit_ms_median")
    if _num(rc) is not None:
        goals.append(f"the trainer's commit under 1 ms per step on Ray: {'met' if rc < 1 else 'not met'} ({rc:.3f} ms)")
    if goals:
        parts.append("Goals: " + "; ".join(goals) + ".")
    return _join(*parts)


@block("journal", "journal.json")
def render_journal(d: dict) -> str:
    """The coordinator's journal with and without compaction: size, restart time, put rate."""
    r = d["journal.json"]
    rows = []
    for key, e in sorted((r.get("settings") or {}).items(), key=lambda kv: int(kv[0])):
        rows.append([str(e.get("compact_every", key)), f(e.get("put_per_s"), ".0f"), f(e.get("journal_bytes"), ".2f", 1e-6),
                     f(e.get("snapshot_bytes"), ".3f", 1e-6), str(e.get("journal_records", "-")),
                     str(e.get("compactions", "-")), f(e.get("compact_ms_median"), ".1f"), f(e.get("restart_s"), ".3f"),
                     str(e.get("replayed", "-")), str(e.get("equal", "-"))])
    head = (f"{r.get('trajectories', '-')} trajectories (one `admit_many` call each), {r.get('ranks', '-')} ranks, groups of "
            f"{r.get('group_size', '-')}; restart = open + recover, median of {r.get('repeats', '-')}")
    lt = load_text(r)
    parts = [head + (f"; {lt}" if lt else "") + ".",
             table(["compact_every", "put/s", "journal MB", "snapshot MB", "records", "compactions", "compact ms",
                    "restart s", "replayed", "same state"], rows)]
    st = r.get("settings") or {}
    a, b = st.get("0"), st.get("10000")
    if isinstance(a, dict) and isinstance(b, dict) and _num(a.get("journal_bytes")) and _num(a.get("restart_s")):
        parts.append(f"Compaction every 10,000 records against none: journal bytes x{b['journal_bytes'] / a['journal_bytes']:.3f}, "
                     f"restart time x{b['restart_s'] / a['restart_s']:.3f}.")
    return _join(*parts)


@block("control-scale", "control_scale.json")
def render_control_scale(d: dict) -> str:
    """``Planner.plan`` time at cluster scale, with token balance and cross-node fraction."""
    r = d["control_scale.json"]
    rows = []
    for ranks, re_ in (r.get("scale") or {}).items():
        for n, e in (re_ or {}).items():
            rows.append([str(ranks), str(n), f(e.get("plan_ms"), ".1f"), f(e.get("plan_ms_min"), ".1f"),
                         str(e.get("microbatches_per_rank", "-")), f(e.get("max_over_mean_tokens"), ".3f"),
                         f(e.get("cross_node_bytes_fraction"), ".3f")])
    cfg = _dict(r.get("config"))
    goals = []
    big = str(int(cfg["nodes"]) * int(cfg["ranks_per_node"])) if cfg.get("nodes") and cfg.get("ranks_per_node") else None
    tr = cfg.get("trajectories") or []
    for n, goal in zip(tr, (10.0, 50.0)):
        v = _num(g(r, "scale", big, str(n), "plan_ms")) if big else None
        if v is not None:
            goals.append(f"{n} trajectories at {big} ranks: {v:.1f} ms against a goal of {goal:.0f} ms "
                         f"({'met' if v <= goal else 'not met'})")
    parts = [run_text(r),
             f"Median of {cfg.get('repeats', '-')} plans, token budget {cfg.get('token_budget', '-')}, groups of "
             f"{cfg.get('group_size', '-')}, {cfg.get('nodes', '-')} nodes x {cfg.get('ranks_per_node', '-')} ranks "
             f"and {cfg.get('ref_ranks', '-')} ranks as a reference:",
             table(["ranks", "trajectories", "plan_ms", "min_ms", "K", "max/mean tok", "cross-node"], rows, "rrrrrrr")]
    if goals:
        parts.append("Goals: " + "; ".join(goals) + ".")
    ref = r.get("machine_reference") or {}
    if _num(ref.get("ms_median")) is not None:
        parts.append(f"Machine speed between the plans ({ref.get('work', 'a fixed Python loop')}): "
                     f"{ref['ms_median']:.1f} ms median ({f(ref.get('ms_min'), '.1f')}-{f(ref.get('ms_max'), '.1f')}). "
                     "On this shared host that loop's time changes from run to run even at a low load average, and "
                     "plan times change with it.")
    return _join(*parts)


# ----------------------------------------------------------------------------------------------- learning


def _steps(e: dict) -> str:
    v = _num(e.get("steps_to_0_8"))
    return f"{v:.0f}" if v is not None else "not reached"


def render_learning_result(r: dict) -> str:
    """Held-out reward AUC, final reward, steps to the threshold and the staleness received, per regime."""
    p = r.get("params") or {}
    thr = r.get("threshold", 0.8)
    seeds = p.get("seeds") or []
    rows = []
    for name, e in (r.get("regimes") or {}).items():
        rows.append([name, f(e.get("auc"), ".3f"), f(e.get("auc_std"), ".3f"), pct(e.get("wasted_token_share")),
                     f(e.get("final_reward"), ".3f"),
                     f(e.get("final_reward_std"), ".3f"), f(e.get("steps_to_0_8"), ".0f"),
                     f"{e.get('reached_0_8', '-')}/{len(seeds) or '-'}", f(e.get("arch_staleness_positive_mean")),
                     f(e.get("arch_staleness_mean")), f(e.get("arch_staleness_p95"), ".1f"),
                     f(e.get("arch_staleness_negative_share")), f(e.get("raw_staleness_mean"))])
    head = (f"B = {p.get('B', '-')} ({p.get('prompts_per_batch', '-')} prompts x {p.get('group_size', '-')}), "
            f"M = {p.get('num_minibatches', '-')}, m = {p.get('m', '-')}, {p.get('steps', '-')} steps, rollout slots "
            f"C = {p.get('slots', '-')} groups, policy {p.get('policy_parameters', '-')} parameters, seeds "
            f"{', '.join(map(str, seeds))}, held-out {p.get('eval_prompts', '-')} prompts every "
            f"{p.get('eval_every', '-')} steps")
    rt = run_text(r)
    parts = [head + "." + (" " + rt if rt else ""),
             table(["regime", "AUC", "+-", "discarded", "final", "+-", f"steps->{thr}", "reached", "arch+", "arch",
                    "arch p95", "neg", "raw"], rows)]
    reg = r.get("regimes") or {}
    co, tb, cp = (reg.get(k) or {} for k in ("colocated", "train_batch", "constraint_preserving"))
    if _num(co.get("auc")) and _num(tb.get("auc")) is not None:
        parts.append(
            f"Train-batch admission received {f(tb.get('arch_staleness_positive_mean'))} steps of positive "
            f"architectural staleness (p95 {f(tb.get('arch_staleness_p95'), '.0f')}), and its AUC is "
            f"{(1 - tb['auc'] / co['auc']) * 100:.0f}% below colocated's. Steps to {thr} reward (median over the "
            f"seeds that reached it): train-batch {_steps(tb)}, colocated {_steps(co)}, constraint-preserving "
            f"{_steps(cp)}; constraint-preserving admission received {f(cp.get('arch_staleness_positive_mean'))} "
            f"steps of positive architectural staleness.")
    gc = r.get("gap_closed") or {}
    if gc:
        per = ", ".join(f"{k}: {v:.2f}" for k, v in (gc.get("per_seed") or {}).items() if _num(v) is not None)
        parts.append(f"AUC gap train_batch -> colocated closed by constraint_preserving: median over seeds "
                     f"{f(gc.get('median'))} (per seed {per}; of the mean AUCs {f(gc.get('of_mean_auc'))}).")
    return _join(*parts)


def render_learning_bound(r: dict) -> str:
    """The staleness-bound regimes of a learning result and the two-speed comparison (issue 26)."""
    reg = _dict(r.get("regimes"))
    co = _dict(reg.get("colocated"))
    seeds = _dict(r.get("params")).get("seeds") or []
    rows = []
    for name, e in reg.items():
        if not (name == "colocated" or name.startswith("bound_")):
            continue
        e = _dict(e)
        vs = (e["auc"] / co["auc"] - 1) if _num(e.get("auc")) is not None and _num(co.get("auc")) else None
        rows.append([name, f(e.get("auc"), ".3f"), pct(e.get("wasted_token_share")), pct(vs, "+.1f"),
                     f(e.get("final_reward"), ".3f"), f"{e.get('reached_0_8', '-')}/{len(seeds) or '-'}",
                     f(e.get("worst_staleness"), ".0f"), f(e.get("raw_staleness_mean")),
                     f(e.get("staleness_generating_mean")), f(e.get("staleness_queued_mean")),
                     f(e.get("virtual_time"), ".0f")])
    if len(rows) <= 1:
        return "_No bound regimes in this result._"
    parts = [table(["regime", "AUC", "discarded tokens", "vs colocated", "final", "reached 0.8", "worst staleness",
                    "mean staleness", "generating", "queued", "virtual time"], rows)]
    upd = _dict(r.get("updated"))
    if upd:
        parts.append("Re-run on newer code into this result (`--update`): " + ", ".join(
            f"{k} ({_dict(v).get('date_utc') or '?'}, {f(_dict(v).get('wall_s'), '.0f')} s)" for k, v in upd.items())
            + "; the other regimes are from the run above.")
    two = _dict(r.get("two_speed"))
    med, share = _dict(two.get("auc_hard_median")), _dict(two.get("hard_share"))
    if med:
        per = ", ".join(f"{k}: {v:+.3f}" for k, v in _dict(two.get("cp_minus_fifo_per_seed")).items()
                        if _num(v) is not None)
        parts.append(
            f"Two sources (`easy`: digits 0-2, 0.5 time units per group; `hard`: digits 0-9, 3 time units), held-out "
            f"reward on the hard task, bound 2 with drop: constraint-preserving admission median AUC "
            f"{f(med.get('bound_2_drop'), '.3f')} against {f(med.get('fifo_bound_2_drop'), '.3f')} for a FIFO "
            f"mini-batch stream with the same bound (per seed, difference {per}); the hard source is "
            f"{pct(share.get('bound_2_drop'), '.0f')} of what constraint-preserving admission trained and "
            f"{pct(share.get('fifo_bound_2_drop'), '.0f')} of what FIFO trained. "
            + _choice(two.get("cp_beats_fifo"), "Constraint-preserving admission wins.",
                      "Constraint-preserving admission does not win here.", ""))
    return _join(*parts)


@block("learning-eta2", "learning_eta2_seeds.json")
def render_learning_eta2(d: dict) -> str:
    """Colocated against the wait-mode bound at eta = 2 over more seeds, paired per seed (issue 45)."""
    r = d["learning_eta2_seeds.json"]
    reg = _dict(r.get("regimes"))
    co, w = _dict(reg.get("colocated")), _dict(reg.get("bound_2_wait"))
    pc, pw = _dict(co.get("per_seed")), _dict(w.get("per_seed"))
    seeds = [s for s in pc if s in pw]
    diffs = [_dict(pw[s]).get("auc", 0.0) / _dict(pc[s]).get("auc", 1.0) - 1 for s in seeds]
    if not diffs:
        return "_No paired seeds in this result._"
    mean = sum(diffs) / len(diffs)
    sd = (sum((x - mean) ** 2 for x in diffs) / max(1, len(diffs) - 1)) ** 0.5
    rows = [[s, f(_dict(pc[s]).get("auc"), ".3f"), f(_dict(pw[s]).get("auc"), ".3f"), pct(x, "+.1f"),
             pct(_dict(pw[s]).get("wasted_token_share"))] for s, x in zip(seeds, diffs)]
    rt = run_text(r)
    ratio = w["auc"] / co["auc"] - 1 if _num(w.get("auc")) is not None and _num(co.get("auc")) else None
    head = (f"{len(seeds)} seeds, the default preset otherwise: AUC of `bound_2_wait` against `colocated`. Mean AUCs "
            f"{f(w.get('auc'), '.3f')} and {f(co.get('auc'), '.3f')} ({pct(ratio, '+.1f')}); per-seed ratios: mean "
            f"{pct(mean, '+.1f')}, standard error {pct(sd / len(diffs) ** 0.5, '.1f')}; reward 0.8 reached in "
            f"{w.get('reached_0_8', '-')} and {co.get('reached_0_8', '-')} of {len(seeds)} seeds; discarded tokens "
            f"{pct(w.get('wasted_token_share'))}." + (" " + rt if rt else ""))
    return _join(head, table(["seed", "colocated AUC", "bound_2_wait AUC", "ratio - 1", "discarded"], rows))


@block("learning-bound", "learning.json")
def render_learning_bound_block(d: dict) -> str:
    """The staleness-bound regimes of the default learning preset."""
    return render_learning_bound(d["learning.json"])


@block("admission-bound", "admission_bound.json")
def render_admission_bound(d: dict) -> str:
    """Simulated throughput and staleness per staleness bound (``bench admission --bound``)."""
    r = d["admission_bound.json"]
    rows = []
    for name, e in _dict(r.get("regimes")).items():
        e = _dict(e)
        rows.append([name, f(e.get("throughput")), f(e.get("makespan"), ".0f"), f(e.get("raw_staleness_mean")),
                     f(e.get("worst_staleness"), ".0f"), pct(e.get("wasted_token_share")),
                     f(e.get("dropped_groups"), ".0f"), f(e.get("quota_violations"), ".0f")])
    head = (f"Scenario `{r.get('scenario', '-')}`, `{r.get('policy', '-')}` admission, medians over seeds "
            f"{', '.join(map(str, r.get('seeds') or []))}; throughput = trained trajectories per time unit.")
    return _join(head, table(["regime", "throughput", "makespan", "mean staleness", "worst", "wasted tokens",
                              "dropped groups", "quota violations"], rows))


@block("planner-before-after", "planner_before_after.json")
def render_planner_before_after(d: dict) -> str:
    """Planners of earlier revisions beside the working tree's, alternating call by call in one run."""
    r = d["planner_before_after.json"]
    before = g(r, "config", "before", default=[])
    revs = [before] if isinstance(before, str) else list(before)
    rows = []
    for ranks, pts in (r.get("points") or {}).items():
        for n, p in (pts or {}).items():
            if revs and isinstance(p.get(revs[0]), dict):  # several revisions, plan and plan-with-infos times
                cells = [f"{f(g(p, k, 'plan_ms'), '.1f')} / {f(g(p, k, 'plan_info_ms'), '.1f')}" for k in [*revs, "now"]]
            else:  # one revision: "before" and "after"
                cells = [f(g(p, "before", "plan_ms"), ".1f"), f(g(p, "after", "plan_ms"), ".1f")]
            rows.append([str(ranks), str(n), *cells, str(p.get("identical_plans", "-"))])
    lt = load_text(r)
    if revs and rows and " / " in rows[0][2]:
        now = g(r, "config", "now", default="the working tree")
        head = (f"Planners of git {', '.join(f'`{v}`' for v in revs)} beside this one (`{now}`), alternating call "
                f"by call, median of {g(r, 'config', 'repeats', default='-')} plans: `plan` alone / `plan` and every "
                "micro-batch's `MicroBatchInfo` (`to_info()`), in ms" + (f"; {lt}" if lt else "") + ".")
        return _join(head, table(["ranks", "trajectories", *revs, "now", "identical plans"], rows,
                                 "rr" + "r" * (len(revs) + 2)))
    head = (f"Old planner (git `{revs[0] if revs else '?'}`) beside the new one, alternating call by call, "
            f"median of {g(r, 'config', 'repeats', default='-')} plans" + (f"; {lt}" if lt else "") + ".")
    return _join(head, table(["ranks", "trajectories", "before ms", "after ms", "identical plans"], rows))


@block("learning", "learning.json")
def render_learning(d: dict) -> str:
    """The default learning preset."""
    return render_learning_result(d["learning.json"])


@block("learning-full", "learning_full.json")
def render_learning_full(d: dict) -> str:
    """The ``--full`` learning preset."""
    return render_learning_result(d["learning_full.json"])


# ----------------------------------------------------------------------------------------------- trl


def _trl_speed_rows(r: dict) -> list[list[str]]:
    rows = []
    for e in r.get("speed") or []:
        ts, gs = _dict(e.get("train_side_s")), _dict(e.get("generate_s"))
        rows.append([str(e.get("group", "-")), f"{e.get('resolution', '-')} px", str(e.get("rows_per_step", "-")),
                     pct(e.get("vision_flop_share"), ".0f"), f(ts.get("trl"), ".3f"), f(ts.get("knitdata"), ".3f"),
                     f(e.get("speedup"), ".2f", suffix="x"), f(gs.get("trl"), ".3f"), f(gs.get("knitdata"), ".3f"),
                     f(e.get("max_rel_grad_diff"), ".1e")])
    return rows


def _trl_learning(r: dict) -> str:
    lr = _dict(r.get("learning"))
    runs = _dict(lr.get("runs"))
    if not runs:
        return str(lr.get("note") or "")
    rows = []
    for name, e in runs.items():
        e = _dict(e)
        shares = _dict(e.get("share_range"))
        label = "TRL alone" if name == "trl" else "TRL on knitdata" if name == "knitdata" else name
        rows.append([label, str(len(e.get("steps") or [])), f(e.get("reward_first"), ".3f"), f(e.get("reward_last"), ".3f"),
                     ", ".join(f"{s} {f(_dict(v).get('min'), '.2f')}-{f(_dict(v).get('max'), '.2f')}"
                               for s, v in sorted(shares.items())) or "-",
                     f(e.get("worst_staleness"), ".0f")])
    head = str(lr.get("what") or "")
    return _join("Learning. " + head, table(["run", "steps", "reward (first 3 steps)", "reward (last 3 steps)",
                                             "source share per step (min-max)", "worst staleness"], rows, "lrrrll"))


@block("trl", "trl.json")
def render_trl(d: dict) -> str:
    """TRL's VLM GRPO training side per optimizer step, TRL alone vs knitdata's shared encoding (and learning)."""
    r = d["trl.json"]
    model = _dict(g(r, "config", "model"))
    real = _dict(g(r, "config", "qwen2_5_vl_3b_vision_flop_share"))
    head = (f"Recorded in the result: {r.get('timer', '-')}; {load_text(r)}; {f(r.get('elapsed_s'), '.0f')} s. Model: "
            f"vision {model.get('vision_depth', '-')} x {model.get('vision_hidden', '-')}, text "
            f"{model.get('text_layers', '-')} x {model.get('text_hidden', '-')} (vision share of a row's forward "
            f"FLOPs in the table; Qwen2.5-VL-3B: "
            + ", ".join(f"{pct(v, '.0f')} at {k} px" for k, v in real.items()) + "). Per optimizer step: "
            f"{g(r, 'config', 'prompts', default='-')} prompt(s) x the group size, 2 micro-batches, one generation "
            "per two steps (old-policy pass), `beta` "
            f"{g(r, 'config', 'beta', default='-')} (reference pass); medians over the a b b a runs.")
    parts = [head, table(["group", "images", "rows/step", "vision FLOPs", "TRL s/step", "knitdata s/step", "speedup",
                          "generation TRL s", "generation knitdata s", "grad diff"], _trl_speed_rows(r), "llrrrrrrrr"),
             "`s/step`: the training side of an optimizer step; `generation`: TRL's generation of one batch (every "
             "two steps), beside it; `grad diff`: the largest per-parameter `max |g - g_trl| / max |g_trl|` at the "
             "first step (float32)."]
    a = _dict(r.get("acceptance"))
    if _num(a.get("speedup")) is not None:
        parts.append(f"Acceptance (group {a.get('group')}, {a.get('resolution')} px): {a['speedup']:.2f}x per optimizer "
                     f"step, gradients within {f(a.get('max_rel_grad_diff'), '.1e')} relative: "
                     + _choice(a.get("passes"), "met (>= 2x, <= 1e-5).", "not met (>= 2x, <= 1e-5).", "-"))
    parts.append(_trl_learning(r))
    return _join(*parts)


@block("trl-headline", "trl.json")
def render_trl_headline(d: dict) -> str:
    """One sentence for the README: the acceptance configuration of ``bench trl``."""
    r = d["trl.json"]
    a = _dict(r.get("acceptance"))
    row: dict[str, Any] = next((e for e in r.get("speed") or [] if e.get("group") == a.get("group")
                                and e.get("resolution") == a.get("resolution")), {})
    ts = _dict(row.get("train_side_s"))
    return (f"- TRL's VLM GRPO (`trl.GRPOTrainer`, random-init Qwen2.5-VL on the CPU, group size {a.get('group', '-')}, "
            f"{a.get('resolution', '-')} px images): with `SharedEncodingGRPOTrainer` the training side of an optimizer "
            f"step (image processing, old-policy and reference passes, gradient pass) takes {f(ts.get('knitdata'), '.2f')} s "
            f"against {f(ts.get('trl'), '.2f')} s for TRL alone ({f(a.get('speedup'), '.2f', suffix='x')}), gradients "
            f"within {f(a.get('max_rel_grad_diff'), '.0e')} relative.")


@block("agent", "agent.json")
def render_agent(d: dict) -> str:
    """``bench agent``: multi-turn visual episodes, knitdata (media stored once, fold) vs per-trajectory copies."""
    r = d["agent.json"]
    c = _dict(r.get("config"))
    rows = []
    for e in r.get("results") or []:
        rows.append([f"{e.get('form', '-')}", "knitdata" if e.get("run") == "knitdata" else "per-trajectory copies",
                     str(e.get("trajectories_per_step", "-")), str(e.get("distinct", "-")), str(e.get("occurrences", "-")),
                     str(e.get("media_items_stored", "-")), str(e.get("encoded", "-")),
                     f(e.get("stored_bytes_per_step"), ".2f", 2.0**-20), f(e.get("moved_bytes_per_step"), ".2f", 2.0**-20),
                     f(e.get("high_water_bytes"), ".2f", 2.0**-20), f(e.get("step_s"), ".1f", 1e3),
                     f(e.get("max_rel_grad_diff"), ".1e")])
    lt = load_text(r)
    head = (f"{c.get('turns', '-')} turns per episode, a screenshot {r.get('screenshot', '-')} per observation, "
            f"{c.get('groups', '-')} groups of {c.get('group_size', '-')} sibling episodes sharing their first "
            f"{c.get('shared', '-')} screenshot(s) per mini-batch, {c.get('microbatches', '-')} micro-batches, medians "
            f"of {c.get('steps', '-')} steps" + (f"; {lt}" if lt else "") + ".")
    parts = [head, table(["form", "run", "traj", "distinct", "occurrences", "stored", "encoded", "stored MiB/step",
                          "moved MiB/step", "high-water MiB", "step ms", "grad diff"], rows, "ll" + "r" * 10)]
    for form, q in (_dict(r.get("ratios"))).items():
        q = _dict(q)
        parts.append(f"{form} form, per-trajectory copies / knitdata: bytes moved {f(q.get('moved'), '.2f', suffix='x')}, "
                     f"stored {f(q.get('stored'), '.2f', suffix='x')}, high-water {f(q.get('high_water'), '.2f', suffix='x')}, "
                     f"screenshots encoded {f(q.get('encoded'), '.2f', suffix='x')}, step time "
                     f"{f(q.get('step_speedup'), '.2f', suffix='x')}.")
    k: dict[str, Any] = next((e for e in r.get("results") or [] if e.get("run") == "knitdata"), {})
    if k.get("table_copied_bytes_before") is not None:
        parts.append(f"Media table: {f(k.get('table_bytes'), '.2f', 2.0**-20)} MiB, copied after preprocessing "
                     f"{f(k.get('table_copied_bytes'), '.2f', 2.0**-20)} MiB (patchify writes into it); with a "
                     f"preprocessing that cannot, {f(k.get('table_copied_bytes_before'), '.2f', 2.0**-20)} MiB.")
    return _join(*parts)


# ----------------------------------------------------------------------------------------------- driver


def _load(root: str, name: str) -> Any:
    path = os.path.join(root, RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def render_block(b: Block, root: str) -> str:
    """Render one block from the result files under ``root`` (a note where a required file is missing)."""
    data = {n: _load(root, n) for n in b.files + b.optional}
    absent = [n for n in b.files if data[n] is None]
    if absent:
        return missing(absent[0])
    return b.render(data).strip()


def render_text(text: str, root: str, path: str = "") -> str:
    """``text`` with every generated block replaced by its rendering; unknown block names raise ``KeyError``."""

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise KeyError(f"{path}: unknown report block {name!r} (known: {', '.join(sorted(BLOCKS))})")
        return f"<!-- report:{name} -->\n{render_block(BLOCKS[name], root)}\n<!-- /report:{name} -->"

    return MARKER.sub(sub, text)


def render_all(root: str) -> dict[str, tuple[str, str]]:
    """``{relative path: (current text, rendered text)}`` for every Markdown file with generated blocks."""
    out = {}
    for rel in FILES:
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        out[rel] = (text, render_text(text, root, rel))
    return out


def _warnings(root: str, files: dict[str, tuple[str, str]]) -> list[str]:
    used = {m.group("name") for text, _ in files.values() for m in MARKER.finditer(text)}
    warn = [f"block {n!r} is registered but has no markers in {', '.join(FILES)}" for n in sorted(set(BLOCKS) - used)]
    read = {n for b in BLOCKS.values() if b.name in used for n in b.files + b.optional}
    rdir = os.path.join(root, RESULTS)
    if os.path.isdir(rdir):
        for n in sorted(os.listdir(rdir)):
            if n.endswith(".json") and n not in read and "smoke" not in n:
                warn.append(f"{RESULTS}/{n} is rendered by no block")
    return warn


def main(argv: list[str] | None = None) -> int:
    """Rewrite the generated blocks, or with ``--check`` report (diff, exit 1) where they differ."""
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff if a committed block is stale")
    parser.add_argument("--root", default=os.path.dirname(here), help="repository root (default: this script's ..)")
    args = parser.parse_args(argv)
    files = render_all(args.root)
    for w in _warnings(args.root, files):
        print(f"report.py: note: {w}", file=sys.stderr)
    stale = [rel for rel, (old, new) in files.items() if old != new]
    if args.check:
        for rel in stale:
            old, new = files[rel]
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       f"a/{rel} (committed)", f"b/{rel} (from {RESULTS})"))
        if stale:
            print(f"report.py --check: {len(stale)} file(s) differ from {RESULTS}; run `python benchmarks/report.py`",
                  file=sys.stderr)
            return 1
        return 0
    for rel in stale:
        with open(os.path.join(args.root, rel), "w", encoding="utf-8") as fh:
            fh.write(files[rel][1])
        print(f"report.py: rewrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
