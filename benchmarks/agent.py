"""Agentic multimodal RL: multi-turn visual episodes, screenshots stored, moved and encoded once vs per-trajectory copies.

Workload. A GUI agent's episode: a prompt showing the first screenshot, then ``turns - 1`` observations each
showing a new screenshot, a model turn after each (:class:`~knitdata.rollout.MultiTurn` with
``placeholder_ids``). Episodes come in groups of ``group_size`` siblings (GRPO ``n``) that share their first
``shared`` screenshots (the same environment reset) and diverge after. Each screenshot is ``uint8 [3, side, side]``
random pixels (incompressible, like the real thing for the byte counts). One optimizer step's mini-batch holds
``groups`` groups. Two forms of the same episodes:

* ``episode``: one trajectory per episode, carrying its ``turns`` screenshots;
* ``turns``: one trajectory per model turn, as frameworks that train turn by turn build them
  (:meth:`~knitdata.rollout.MultiTurn.turn_trajectories`): turn ``k`` carries the history's ``k + 1`` screenshots,
  so a screenshot is in the sample of every later turn (``turns * (turns + 1) / 2`` occurrences per episode).

Each form runs through a real :class:`~knitdata.Pipeline` on the embedded engine, one consumer, ``fetch="eager"``,
a :class:`~knitdata.MultimodalCollator` (``key="digest"``, :func:`~knitdata.patchify` writing into the table) and a
tiny vision-language model trained on CPU (a per-patch MLP encoder, a residual-MLP language model), twice:

* ``knitdata``: ``media_dedup=True`` (one copy per screenshot digest per unit; the producer puts references for
  what it knows is held: the siblings' shared screenshots, in the ``turns`` form every earlier turn's), encoded
  with :class:`~knitdata.SharedEncoding` ``fold`` (each distinct screenshot once per mini-batch);
* ``copies``: ``media_dedup=False`` (every trajectory stores its own copy of its screenshots, as before content
  addressing), encoded with the duplicated forward (``mode="naive"``: every occurrence encoded). The collator
  processes each distinct screenshot once in both (by digest): the comparison isolates storage, transfer and
  encoding, and is conservative for the baseline.

Reported per form and run (medians over the timed steps): ``stored_bytes_per_step`` (what the step's puts added
to the units' ``used_bytes``), ``high_water_bytes`` (the units' ``high_water_bytes``), ``moved_bytes_per_step`` (what the
units handed out to the consumer, their ``bytes_fetched``), ``media_items_stored``, ``processed``,
``encoded`` and ``distinct`` / ``occurrences`` screenshots per mini-batch, ``table_copied_bytes`` (bytes copied
into the media table after preprocessing; ``table_copied_bytes_before``: the same share packed by a preprocessing
callable that cannot write into the table, as every one did before: the whole table copied once more),
``step_s`` (wall time of the consumer's step: fetch, collate, forward,
backward, optimizer) and ``put_s``; ``max_rel_grad_diff`` (the first step's gradients, ``fold`` vs the duplicated
forward on the same batch: ``max |g - g_naive| / max |g_naive|`` over parameters); ratios copies / knitdata; the load
average before and after. ``--smoke`` is a tiny preset for the tests.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/agent.py``: import the ``benchmarks`` package of this checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import copy
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.common.models import MlpPatchEncoder, MlpVLM
from benchmarks.common.output import command_line, pyplot, write_json

__all__ = ["AgentConfig", "FORMS", "RUNS", "episodes", "run_bench", "format_table", "plot", "add_arguments", "run"]

#: The two forms of the episodes and the two storage/encoding runs.
FORMS: tuple[str, ...] = ("episode", "turns")
RUNS: tuple[str, ...] = ("knitdata", "copies")

IMG = 3  # the image placeholder token
VOCAB = 64


@dataclass
class AgentConfig:
    """Workload of the agent benchmark.

    Attributes:
        turns: Model turns per episode (one screenshot before each).
        side: Screenshot side in pixels (``uint8 [3, side, side]``).
        patch: Patch side of the preprocessing (:func:`~knitdata.patchify`).
        groups: Groups (tasks) per mini-batch.
        group_size: Sibling episodes per group.
        shared: Leading screenshots the siblings share (the same environment reset).
        response_tokens: Tokens of each model turn.
        dim: Width of the toy model.
        microbatches: Micro-batches per mini-batch (the token budget is sized for it).
        steps: Timed steps per run (after one warm-up step).
        forms: Forms to run (:data:`FORMS`).
        seed: Seed of the pixels and the model.
    """

    turns: int = 6
    side: int = 448
    patch: int = 14
    groups: int = 2
    group_size: int = 8
    shared: int = 1
    response_tokens: int = 16
    dim: int = 64
    microbatches: int = 4
    steps: int = 5
    forms: tuple[str, ...] = FORMS
    seed: int = 0

    @classmethod
    def smoke(cls) -> AgentConfig:
        """A tiny workload that runs in seconds (for tests)."""
        return cls(turns=3, side=28, patch=7, groups=2, group_size=4, response_tokens=4, dim=16, microbatches=2,
                   steps=2)

    @property
    def shot_bytes(self) -> int:
        """Bytes of one screenshot."""
        return 3 * self.side * self.side


def _shot(cfg: AgentConfig, *key: int) -> Any:
    from knitdata import MediaItem

    g = torch.Generator().manual_seed(hash((cfg.seed, *key)) & 0x7FFF_FFFF)
    return MediaItem("image", tensor=torch.randint(0, 256, (3, cfg.side, cfg.side), dtype=torch.uint8, generator=g))


def episodes(cfg: AgentConfig, step: int, form: str, dedup: bool) -> list[Any]:
    """The trajectories of one mini-batch: ``groups`` groups of ``group_size`` sibling episodes, in ``form``.

    With ``dedup`` the producer puts references for what it knows is held: the shared screenshots of siblings
    ``1..n-1`` (put by sibling 0 first) and, in the ``turns`` form, the screenshots of earlier turns.
    """
    from knitdata.rollout import MultiTurn, RolloutSample

    out = []
    expand = cfg.side // cfg.patch * (cfg.side // cfg.patch)  # the engine's tokens per screenshot
    for g in range(cfg.groups):
        rid = f"s{step}-task{g}"
        shared = [_shot(cfg, step, g, -1, k) for k in range(min(cfg.shared, cfg.turns))]
        for e in range(cfg.group_size):
            shots = shared + [_shot(cfg, step, g, e, k) for k in range(len(shared), cfg.turns)]
            gen = torch.Generator().manual_seed(hash((cfg.seed, step, g, e)) & 0x7FFF_FFFF)
            ep = MultiTurn(rid, [1, *[IMG] * expand, 2], index=e, media=[shots[0]], placeholder_ids={"image": IMG})
            for k in range(cfg.turns):
                if k:
                    ep.add_observation([4, *[IMG] * expand, 5], media=[shots[k]])
                engine_prompt = [t for c in ep.context for t in ([IMG] * expand if c == IMG else [c])]
                resp = torch.randint(8, VOCAB, (cfg.response_tokens,), generator=gen).tolist()
                ep.add_model(RolloutSample(rid, e, prompt_ids=engine_prompt, response_ids=resp,
                                           logprobs=[-1.0] * len(resp), version=max(step, 0)))
            refer = {m.digest for m in shared} if dedup and e else set()
            if form == "episode":
                out.append(ep.sample(refer=refer).to_trajectory("gui", scalars={"reward": float(e % 2)}))
            else:
                out.extend(ep.turn_trajectories("gui", scalars={"reward": float(e % 2)}, refer=refer,
                                                refer_repeats=dedup))
    return out


class _Model(nn.Module):
    """Per-patch MLP encoder; each trajectory's screenshots mean-pooled and summed into its tokens' embedding."""

    def __init__(self, patch_dim: int, dim: int):
        super().__init__()
        self.encoder = MlpPatchEncoder(patch_dim, dim)
        self.lm = MlpVLM(VOCAB, dim, layers=2, hidden=4 * dim)

    def loss(self, mb: Any, rows: torch.Tensor, lengths: torch.Tensor, traj: torch.Tensor) -> torch.Tensor:
        n = lengths.numel()
        seg = torch.repeat_interleave(torch.arange(n), lengths)
        pooled = torch.zeros(n, rows.shape[-1]).index_add(0, seg, rows) / lengths[:, None].to(rows.dtype)
        feat = torch.zeros(mb.input_ids.shape[0], rows.shape[-1]).index_add(0, traj, pooled)
        logits = self.lm(mb.input_ids, feat)[:, :-1]
        mask = mb.loss_mask[:, 1:]
        ce = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), mb.input_ids[:, 1:].reshape(-1), reduction="none")
        return (ce * mask.reshape(-1)).sum() / mask.sum().clamp(min=1)


def _train(model: _Model, mbs: list[Any], mm: Any, mode: str) -> None:
    """Forward and backward of one mini-batch's micro-batches (``mode``: a SharedEncoding mode)."""
    from knitdata import SharedEncoding

    enc = SharedEncoding(model.encoder, mode=mode, kind="image", dummy=False)
    table = mm.tables["image"]
    with enc.minibatch(mm) as shared:
        for i, mb in enumerate(mbs):
            occ = mm.for_microbatch(i)["image"]
            loss = model.loss(mb, shared.rows(i), table.lengths[occ.index], occ.trajectory) / len(mbs)
            shared.backward(loss)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for n, g in b.items():
        scale = float(g.abs().max())
        worst = max(worst, float((a[n] - g).abs().max()) / scale if scale else float((a[n] - g).abs().max()))
    return worst


def _units(pipe: Any) -> list[Any]:
    return [u.stats() for u in pipe.internals.units.values()]


def _minibatch(it: Iterator[Any]) -> list[Any]:
    mbs = []
    while True:
        mb = next(it)
        mbs.append(mb)
        if mb.info.is_last:
            return mbs


def run_one(cfg: AgentConfig, form: str, name: str) -> dict[str, Any]:
    """One form and run (``knitdata`` or ``copies``): steps through a Pipeline, measured."""
    from knitdata import BatchSpec, MultimodalCollator, Pipeline, patchify

    dedup = name == "knitdata"
    per_group = cfg.group_size * (cfg.turns if form == "turns" else 1)
    probe = episodes(cfg, -1, form, False)
    tokens = sum(t.prompt_ids.numel() + t.response_ids.numel() for t in probe)
    longest = max(t.prompt_ids.numel() + t.response_ids.numel() for t in probe)
    budget = max(longest, -(-tokens // cfg.microbatches))
    pipe = Pipeline(BatchSpec({"gui": cfg.groups * per_group}, num_minibatches=1, group_size=per_group),
                    media_dedup=dedup, token_budget=int(budget), capacity_bytes=8 << 30)
    torch.manual_seed(cfg.seed)
    model = _Model(3 * cfg.patch * cfg.patch, cfg.dim)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    collate = MultimodalCollator({"image": patchify(cfg.patch, size=(cfg.side, cfg.side))}, key="digest")
    it = iter(pipe.dataset(0, fetch="eager", media_collator=collate, timeout=120.0))
    rows: list[dict[str, Any]] = []
    grad_diff = None
    try:
        for step in range(cfg.steps + 1):
            trajs = episodes(cfg, step, form, dedup)
            before = _units(pipe)  # the previous step's payloads may still be held: count this step's puts
            fetched0 = sum(s.bytes_fetched for s in before)
            t0 = time.perf_counter()
            pipe.put_many(trajs)
            put_s = time.perf_counter() - t0
            held = _units(pipe)
            t0 = time.perf_counter()
            mbs = _minibatch(it)
            mm = mbs[0].media
            if step == 0 and dedup:  # the exactness check: fold vs the duplicated forward on this very batch
                twin = copy.deepcopy(model)
                _train(twin, mbs, mm, "naive")
                _train(model, mbs, mm, "fold")
                grad_diff = _rel_diff(_grads(model), _grads(twin))
            else:
                _train(model, mbs, mm, "fold" if dedup else "naive")
            opt.step()
            opt.zero_grad(set_to_none=True)
            step_s = time.perf_counter() - t0
            after = _units(pipe)
            copied_before = None
            if step == cfg.steps:  # the same share packed as before this issue: a callable without ``out`` (untimed)
                fn = patchify(cfg.patch, size=(cfg.side, cfg.side))
                plain = MultimodalCollator({"image": lambda px, fn=fn: fn(px)}, key="digest")
                copied_before = plain([episodes(cfg, step, form, False)]).pack_stats["copied_bytes"]
            occ = sum(len(t.media) for t in trajs)
            distinct = len({m.digest for t in trajs for m in t.media})
            rows.append({
                "step": step, "put_s": put_s, "step_s": step_s,
                "stored_bytes": sum(s.used_bytes for s in held) - sum(s.used_bytes for s in before),
                "media_items_stored": (sum(s.media_items for s in held) - sum(s.media_items for s in before)
                                       if dedup else occ),
                "moved_bytes": sum(s.bytes_fetched for s in after) - fetched0,
                "distinct": distinct, "occurrences": occ, "microbatches": len(mbs),
                "processed": mm.pack_stats["processed_items"],
                "encoded": mm.num_unique if dedup else mm.num_occurrences,
                "table_copied_bytes": mm.pack_stats["copied_bytes"], "table_bytes": mm.pack_stats["table_bytes"],
                "table_copied_bytes_before": copied_before,
            })
        high_water = sum(s.high_water_bytes for s in _units(pipe))
    finally:
        pipe.close()
        pipe.shutdown()
    timed = rows[1:]
    med = {k: statistics.median(r[k] for r in timed) for k in ("put_s", "step_s")}
    last = timed[-1]
    token_bytes = last["moved_bytes"] - last["occurrences" if not dedup else "distinct"] * cfg.shot_bytes
    return {
        "form": form, "run": name, "media_dedup": dedup, "encoding": "fold" if dedup else "naive",
        "trajectories_per_step": len(probe), **med,
        "step_s_all": [r["step_s"] for r in timed],
        "stored_bytes_per_step": statistics.median(r["stored_bytes"] for r in timed),
        "moved_bytes_per_step": statistics.median(r["moved_bytes"] for r in timed),
        "high_water_bytes": high_water,
        "token_bytes_per_step": token_bytes,
        "screenshot_bytes": cfg.shot_bytes,
        "per_step": rows,
        **{k: last[k] for k in ("distinct", "occurrences", "media_items_stored", "processed", "encoded",
                                "microbatches", "table_copied_bytes", "table_bytes", "table_copied_bytes_before")},
        "max_rel_grad_diff": grad_diff,
    }


def run_bench(cfg: AgentConfig, progress: bool = True) -> dict[str, Any]:
    """Run every form with and without content addressing; return the JSON-serializable report."""
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    results = []
    for form in cfg.forms:
        for name in RUNS:
            r = run_one(cfg, form, name)
            results.append(r)
            if progress:
                print(f"  {form:8s} {name:8s} step {r['step_s'] * 1e3:8.1f} ms  moved {r['moved_bytes_per_step'] / 2**20:8.2f}"
                      f" MiB  stored {r['stored_bytes_per_step'] / 2**20:8.2f} MiB", flush=True)
    ratios = {}
    for form in cfg.forms:
        k = next(r for r in results if r["form"] == form and r["run"] == "knitdata")
        c = next(r for r in results if r["form"] == form and r["run"] == "copies")
        ratios[form] = {
            "moved": c["moved_bytes_per_step"] / k["moved_bytes_per_step"],
            "stored": c["stored_bytes_per_step"] / k["stored_bytes_per_step"],
            "high_water": c["high_water_bytes"] / k["high_water_bytes"],
            "encoded": c["encoded"] / k["encoded"],
            "step_speedup": c["step_s"] / k["step_s"],
        }
    return {
        "benchmark": "agent",
        "command": command_line(),
        "config": asdict(cfg),
        "screenshot": f"uint8 [3, {cfg.side}, {cfg.side}] ({cfg.shot_bytes} bytes)",
        "results": results,
        "ratios": ratios,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }


def format_table(report: dict[str, Any]) -> str:
    """The report as a table with the ratios and the load average."""
    mib = 2.0**20
    lines = [f"agent episodes, screenshots {report['screenshot']}",
             f"{'form':8s} {'run':8s} {'traj':>5s} {'distinct':>8s} {'occur':>6s} {'stored':>7s} {'encoded':>7s} "
             f"{'stored MiB':>10s} {'moved MiB':>10s} {'highw MiB':>10s} {'step ms':>8s} {'grad diff':>9s}"]
    for r in report["results"]:
        gd = "-" if r["max_rel_grad_diff"] is None else f"{r['max_rel_grad_diff']:.1e}"
        lines.append(
            f"{r['form']:8s} {r['run']:8s} {r['trajectories_per_step']:>5d} {r['distinct']:>8d} {r['occurrences']:>6d} "
            f"{r['media_items_stored']:>7d} {r['encoded']:>7d} {r['stored_bytes_per_step'] / mib:>10.2f} "
            f"{r['moved_bytes_per_step'] / mib:>10.2f} {r['high_water_bytes'] / mib:>10.2f} {r['step_s'] * 1e3:>8.1f} "
            f"{gd:>9s}")
    for form, q in report["ratios"].items():
        lines.append(f"{form}: copies / knitdata: moved {q['moved']:.2f}x, stored {q['stored']:.2f}x, high-water "
                     f"{q['high_water']:.2f}x, encoded {q['encoded']:.2f}x, step time {q['step_speedup']:.2f}x")
    for r in report["results"]:
        if r["run"] == "knitdata" and r.get("table_copied_bytes_before") is not None:
            lines.append(f"{r['form']}: media table {r['table_bytes'] / mib:.2f} MiB, copied after preprocessing "
                         f"{r['table_copied_bytes'] / mib:.2f} MiB (a callable without out=: "
                         f"{r['table_copied_bytes_before'] / mib:.2f} MiB)")
    la, lb = report["loadavg_before"], report["loadavg_after"]
    lines.append(f"load average before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}, after {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Bytes moved and stored per step and step time, knitdata vs per-trajectory copies, per form."""
    plt = pyplot()
    forms = [f for f in FORMS if f in report["ratios"]]
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.38
    for j, (key, label, scale) in enumerate((("moved_bytes_per_step", "MiB moved per step", 2.0**20),
                                              ("stored_bytes_per_step", "MiB stored per step", 2.0**20),
                                              ("step_s", "step time (ms)", 1e-3))):
        for i, name in enumerate(RUNS):
            vals = [next(r[key] for r in report["results"] if r["form"] == f and r["run"] == name) / scale
                    for f in forms]
            ax[j].bar([x + (i - 0.5) * width for x in range(len(forms))], vals, width,
                      label=name if name == "knitdata" else "per-trajectory copies")
        ax[j].set_xticks(range(len(forms)), [f"{f} form" for f in forms])
        ax[j].set(ylabel=label)
        ax[j].grid(alpha=0.3, axis="y")
        ax[j].legend()
    la = report["loadavg_before"]
    fig.suptitle(f"agent episodes ({report['config']['turns']} turns, groups of {report['config']['group_size']}, "
                 f"screenshots {report['screenshot']}); load {la[0]:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m benchmarks agent``."""
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a plot (needs matplotlib)")
    parser.add_argument("--smoke", action="store_true", help="tiny workload (seconds; for tests)")
    parser.add_argument("--side", type=int, default=None, help="screenshot side in pixels (default 448)")
    parser.add_argument("--turns", type=int, default=None, help="model turns per episode (default 6)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 5)")


def run(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks agent``; print the table, write JSON and the plot."""
    cfg = AgentConfig.smoke() if args.smoke else AgentConfig()
    for k in ("side", "turns", "steps"):
        if getattr(args, k, None):
            setattr(cfg, k, getattr(args, k))
    report = run_bench(cfg)
    print(format_table(report))
    if args.json:
        write_json(args.json, report, indent=1)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("agent"))
