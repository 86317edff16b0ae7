"""``python -m benchmarks demo`` (``make demo``): the whole path on the embedded engine, end to end, in about half a minute.

Simulated rollout (C slots, three sources with skewed log-normal durations, partial-rollout-free,
weights synced after every optimizer step, a one-step pipeline that dispatches train batch b+1 once
batch b is fully admitted) puts real trajectories, each group sharing one PNG image.
:class:`~knitdata.admission.ConstraintPreservingAdmission` admits mini-batches, the planner assigns them
to two consumers, and each consumer (a thread) trains a replica of a tiny vision-language model on its
micro-batches in ``iter`` mode, encoding each unique image once per mini-batch with
:class:`~knitdata.media.encoder.SharedEncoding`. The replicas' gradients are summed at every optimizer step
(an in-process all-reduce), so they stay identical.

The report gives architectural staleness (measured in this run, and replayed on this run's arrival
times against train-batch admission), exposed data latency per consumer, and the encoder work saved.
A timeline PNG shows, per consumer, admission, data delivery and computation (like the seed paper's
Figure 1).
"""

from __future__ import annotations

import argparse
import functools
import heapq
import io
import json
import math
import operator
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from benchmarks.common.models import MlpPatchEncoder, MlpVLM
from knitdata.admission import AdmittedMiniBatch, BatchSpec, make_policy
from knitdata.record import MediaItem, Trajectory, TrajectoryMeta
from knitdata.staleness import staleness_reduction, summarize

__all__ = [
    "DemoConfig",
    "DemoReport",
    "run_demo",
    "replay_staleness",
    "format_report",
    "add_arguments",
    "run",
]


@dataclass(frozen=True)
class DemoConfig:
    """Parameters of the demo run (all reported with its figures).

    Attributes:
        train_batches: Train batches to run.
        sources: Per source ``(mean duration s, log-normal sigma)`` of one rollout.
        quota: Trajectories per source per train batch.
        group_size: Responses per prompt (GRPO ``n``); a group shares one image.
        num_minibatches: ``M`` mini-batches (optimizer steps) per train batch.
        rollout_slots: ``C`` concurrent rollouts.
        consumers: Data-parallel consumers (threads).
        token_budget: Most tokens per micro-batch.
        image_size: Side of the square RGB images.
        patch: Patch side of the image preprocessing.
        seed: Seed of everything random.
    """

    train_batches: int = 3
    sources: tuple[tuple[str, float, float], ...] = (("math", 0.2, 0.3), ("vision", 0.4, 0.6), ("code", 0.8, 0.8))
    quota: int = 16
    group_size: int = 4
    num_minibatches: int = 4
    rollout_slots: int = 24
    consumers: int = 2
    token_budget: int = 96
    image_size: int = 64
    patch: int = 16
    seed: int = 0

    @property
    def spec(self) -> BatchSpec:
        """The batch specification."""
        return BatchSpec({s: self.quota for s, _, _ in self.sources}, self.num_minibatches, self.group_size)


@dataclass
class DemoReport:
    """What the demo measured.

    Attributes:
        config: The parameters.
        wall_s: Wall time of the run (set-up excluded).
        trajectories: Trajectories delivered (each exactly once, checked).
        minibatches: Optimizer steps taken.
        staleness: ``measured`` (this run), ``replay_constraint_preserving`` and ``replay_train_batch``
            summaries of architectural and raw staleness.
        reduction_vs_train_batch: ``1 - arch(CP) / arch(train batch)`` on the replay.
        exposed_latency: Per consumer, median/total seconds blocked waiting for data.
        encoder: Encoder rows (patches) a naive trainer would encode, rows encoded, and the ratio.
        losses: Mean loss per optimizer step (rank 0).
        timeline_png: Path of the timeline picture, if written.
    """

    config: dict[str, Any]
    wall_s: float
    trajectories: int
    minibatches: int
    staleness: dict[str, Any]
    reduction_vs_train_batch: float | None
    exposed_latency: dict[str, Any]
    encoder: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    timeline_png: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return dict(self.__dict__)


# ----------------------------------------------------------------------------------------------- model
def _sequence_features(rows: torch.Tensor | None, lengths: torch.Tensor, traj_index: torch.Tensor, batch: int, dim: int) -> torch.Tensor:
    """Mean patch feature per occurrence, summed per sequence of the micro-batch."""
    out = torch.zeros(batch, dim)
    if rows is None or lengths.numel() == 0:
        return out
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    per_item = torch.zeros(lengths.numel(), dim).index_add(0, seg, rows) / lengths[:, None].clamp(min=1)
    return out.index_add(0, traj_index, per_item)


# ----------------------------------------------------------------------------------------------- rollout
def _png(seed: int, size: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((size, size), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class _Rollout(threading.Thread):
    """C rollout slots on a real clock; dispatches train batch b+1 once batch b is fully admitted."""

    def __init__(self, pipe: Any, cfg: DemoConfig, batch_admitted: list[threading.Event], vocab: int):
        super().__init__(name="knitdata-demo-rollout", daemon=True)
        self.pipe, self.cfg, self.batch_admitted, self.vocab = pipe, cfg, batch_admitted, vocab
        self.rng = np.random.default_rng(cfg.seed)
        self.arrivals: list[tuple[float, float, TrajectoryMeta]] = []  # (start, finish, meta)
        self.error: BaseException | None = None
        self.t0 = 0.0

    def _prompts(self, b: int) -> list[tuple[str, str, float, float]]:
        out = []
        for s, mean, sigma in self.cfg.sources:
            for g in range(self.cfg.quota // self.cfg.group_size):
                out.extend([(s, f"b{b}-{s}-g{g}", mean, sigma)] * self.cfg.group_size)
        order = self.rng.permutation(len(out))
        return [out[i] for i in order]

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # reported by run_demo
            self.error = e

    def _run(self) -> None:
        cfg, rng = self.cfg, self.rng
        images = {}
        rewards: dict[str, np.ndarray] = {}
        member: dict[str, int] = {}
        running: list[tuple[float, int, tuple]] = []
        tick = 0
        for b in range(cfg.train_batches):
            if b > 0:
                while not self.batch_admitted[b - 1].wait(0.05):
                    if self.pipe.closed:
                        return
            pending = self._prompts(b)
            while pending or running:
                now = time.perf_counter()
                while pending and len(running) < cfg.rollout_slots:
                    s, gid, mean, sigma = pending.pop()
                    mu = math.log(mean) - sigma**2 / 2
                    dur = float(rng.lognormal(mu, sigma))
                    heapq.heappush(running, (now + dur, tick, (s, gid, now, self.pipe.version)))
                    tick += 1
                if not running:
                    break
                finish, _, (s, gid, start, version) = running[0]
                delay = finish - time.perf_counter()
                if delay > 0:
                    time.sleep(min(delay, 0.02))
                    continue
                heapq.heappop(running)
                if gid not in images:
                    images[gid] = _png(zlib.crc32(gid.encode()) + cfg.seed, cfg.image_size)
                    rewards[gid] = rng.random(cfg.group_size)
                j = member.get(gid, 0)
                member[gid] = j + 1
                r = rewards[gid]
                adv = float(r[j] - r.mean())
                n_prompt, n_resp = int(rng.integers(8, 17)), int(rng.integers(6, 25))
                traj = Trajectory(
                    id=f"{gid}-r{j}",
                    source=s,
                    group=gid,
                    prompt_ids=torch.from_numpy(rng.integers(1, self.vocab, n_prompt)),
                    response_ids=torch.from_numpy(rng.integers(1, self.vocab, n_resp)),
                    gen_version=version,
                    scalars={"reward": float(r[j]), "advantage": adv},
                    media=[MediaItem("image", data=images[gid])],
                )
                meta = self.pipe.put(traj)
                self.arrivals.append((start - self.t0, time.perf_counter() - self.t0, meta))


# ----------------------------------------------------------------------------------------------- replay
def replay_staleness(
    arrivals: Sequence[tuple[float, float, TrajectoryMeta]],
    spec: BatchSpec,
    policy: str,
    train_s: float,
) -> dict[str, Any]:
    """Replay arrival times through an admission policy with a modeled trainer; return staleness summaries.

    The trainer trains admitted mini-batches one after another, ``train_s`` seconds each; the policy
    version is the number of optimizer steps finished. A trajectory's generation version is the version
    when it *started* under this policy's timeline, so only admission differs between policies (the
    rollout start/finish times are those of the measured run).

    Args:
        arrivals: ``(start time, finish time, meta)`` per trajectory.
        spec: The batch specification.
        policy: Admission policy name.
        train_s: Seconds of training per mini-batch.

    Returns:
        ``{"arch": summary, "raw": summary, "admit_delay": summary}``.
    """
    pol = make_policy(policy, spec)
    started = {m.id: st for st, _, m in arrivals}
    ends: list[float] = []
    arch: list[float] = []
    raw: list[float] = []
    delays: list[float] = []
    finish_of = {m.id: fin for _, fin, m in arrivals}

    def version_at(t: float) -> int:
        return sum(1 for e in ends if e <= t)

    for _, fin, meta in sorted(arrivals, key=lambda a: a[1]):
        pol.offer([meta])
        for mb in pol.poll(fin):
            start = max(fin, ends[-1] if ends else 0.0)
            v = len(ends)  # steps finished before this mini-batch's gradient
            ends.append(start + train_s)
            for m in mb.trajectories:
                gen = version_at(started[m.id])
                raw.append(v - gen)
                arch.append(v - gen - mb.index)
                delays.append(fin - finish_of[m.id])
    return {"arch": summarize(arch), "raw": summarize(raw), "admit_delay": summarize(delays)}


# ----------------------------------------------------------------------------------------------- demo
class _AllReduce:
    """Sum gradients of the consumer threads' replicas at each optimizer step."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.slots: list[list[torch.Tensor] | None] = [None] * n

    def __call__(self, rank: int, model: nn.Module) -> None:
        params = [p for p in model.parameters()]
        self.slots[rank] = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        self.barrier.wait()
        slots = [s for s in self.slots if s is not None]
        total = [functools.reduce(operator.add, (s[i] for s in slots)) for i in range(len(params))]
        self.barrier.wait()
        for p, g in zip(params, total):
            p.grad = g


def run_demo(
    cfg: DemoConfig | None = None,
    *,
    out_dir: str | Path | None = "out/demo",
    plot: bool = True,
    progress: bool = True,
) -> DemoReport:
    """Run the end-to-end demo on the embedded engine.

    Args:
        cfg: Parameters (defaults: 3 train batches of 48 trajectories, 3 skewed sources, 2 consumers).
        out_dir: Where ``demo_report.json`` and ``demo_timeline.png`` go (``None``: write nothing).
        plot: Write the timeline picture (needs matplotlib).
        progress: Show a progress bar.

    Returns:
        The :class:`DemoReport`.
    """
    from tqdm.auto import tqdm

    from knitdata.consumer.collate import TokenCollator
    from knitdata.media.encoder import SharedEncoding
    from knitdata.media.multimodal import MultimodalCollator
    from knitdata.media.process import patchify
    from knitdata.pipeline import Pipeline

    cfg = cfg or DemoConfig()
    torch.manual_seed(cfg.seed)
    vocab, dim = 64, 256
    spec = cfg.spec
    # the first optimizer built in a process imports torch's compiler stack (seconds): do it before the clock
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    admitted_events = [threading.Event() for _ in range(cfg.train_batches)]
    admissions: list[tuple[float, int, int]] = []  # (time, train batch, k)
    admitted_at: dict[int, float] = {}  # global mini-batch step -> admission time
    t0 = time.perf_counter()

    def on_plan(mb: AdmittedMiniBatch, plan: Any) -> None:
        admissions.append((time.perf_counter() - t0, mb.train_batch, mb.index))
        admitted_at[mb.step] = admissions[-1][0]
        if mb.index == spec.num_minibatches - 1 and mb.train_batch < len(admitted_events):
            admitted_events[mb.train_batch].set()

    pipe = Pipeline(
        spec,
        admission="constraint_preserving",
        num_consumers=cfg.consumers,
        token_budget=cfg.token_budget,
        capacity_bytes=64 << 20,
        on_plan=on_plan,
    )
    total_steps = cfg.train_batches * spec.num_minibatches
    base_encoder = MlpPatchEncoder(3 * cfg.patch * cfg.patch, dim)
    base_model = MlpVLM(vocab, dim)
    reduce = _AllReduce(cfg.consumers)
    timeline: list[list[tuple[str, float, float]]] = [[] for _ in range(cfg.consumers)]
    delivered: list[list[str]] = [[] for _ in range(cfg.consumers)]
    measured_arch: list[float] = []
    measured_raw: list[float] = []
    enc_rows = {"naive_rows": 0, "encoded_rows": 0, "occurrences": 0, "unique": 0}
    losses: list[float] = []
    errors: list[BaseException] = []
    bar = tqdm(total=total_steps, desc="knitdata demo: optimizer steps", disable=not progress, leave=False)
    lock = threading.Lock()

    def consumer(rank: int) -> None:
        try:
            encoder = MlpPatchEncoder(3 * cfg.patch * cfg.patch, dim)
            model = MlpVLM(vocab, dim)
            encoder.load_state_dict(base_encoder.state_dict())
            model.load_state_dict(base_model.state_dict())
            both = nn.ModuleList([encoder, model])
            opt = torch.optim.SGD(both.parameters(), lr=0.5)
            shared_enc = SharedEncoding(encoder, mode="fold", kind="image")
            ds = pipe.dataset(
                rank,
                fetch="iter",
                collate=TokenCollator(),
                media_collator=MultimodalCollator({"image": patchify(cfg.patch)}),
                max_minibatches=total_steps,
            )
            it = iter(ds)
            shared = None
            step_loss = 0.0
            while True:
                tw = time.perf_counter()
                try:
                    mb = next(it)
                except StopIteration:
                    break
                tc = time.perf_counter()
                info = mb.info
                assert info is not None  # the dataset always attaches planner metadata
                # time in next() before the mini-batch was admitted waits for rollout, not for data transfer
                ta = max(tw - t0, admitted_at.get(info.minibatch, 0.0))
                timeline[rank].append(("admission", tw - t0, min(ta, tc - t0)))
                timeline[rank].append(("wait", min(ta, tc - t0), tc - t0))
                delivered[rank].extend(info.trajectory_ids)
                if info.microbatch == 0:
                    opt.zero_grad(set_to_none=True)
                    version = pipe.version
                    shared = shared_enc.minibatch(mb.media)
                    shared.__enter__()
                    with lock:
                        for occ in mb.media.occurrences:
                            for o in occ.values():
                                enc_rows["naive_rows"] += int(mb.media.tables["image"].lengths[o.index].sum())
                        for t in mb.media.tables.values():
                            enc_rows["encoded_rows"] += int(t.lengths.sum())
                        enc_rows["occurrences"] += mb.media.num_occurrences
                        enc_rows["unique"] += mb.media.num_unique
                    step_loss = 0.0
                with lock:
                    for g in info.gen_versions:
                        measured_raw.append(version - g)
                        measured_arch.append(version - g - info.minibatch_in_batch)
                assert shared is not None
                if mb.is_empty:
                    loss = cast(torch.Tensor, sum(p.sum() * 0.0 for p in both.parameters()))
                    if shared.batch.num_unique:
                        rows = shared.rows(info.microbatch)
                        if rows is not None:
                            loss = loss + rows.sum() * 0.0
                else:
                    rows = shared.rows(info.microbatch)
                    occ = mb.media.for_microbatch(info.microbatch).get("image")
                    lengths = shared.lengths(info.microbatch)
                    tix = occ.trajectory if occ is not None else torch.zeros(0, dtype=torch.long)
                    feats = _sequence_features(rows, lengths, tix, mb.num_sequences, dim)
                    logits = model(mb.input_ids, feats)
                    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, mb.input_ids[:, 1:, None])[..., 0]
                    mask = mb.loss_mask[:, 1:]
                    adv = mb.scalars["advantage"][:, None]
                    loss = -(logp * adv * mask).sum() / max(1, info.global_loss_tokens)
                shared.backward(loss)
                step_loss += float(loss.detach())
                if info.is_last:
                    shared.__exit__(None, None, None)
                    shared = None
                    reduce(rank, both)
                    opt.step()
                    if rank == 0:
                        losses.append(step_loss)
                        pipe.report_version(pipe.version + 1)
                        bar.update(1)
                    reduce.barrier.wait()  # every replica steps before the next mini-batch reads the version
                timeline[rank].append(("compute", tc - t0, time.perf_counter() - t0))
        except BaseException as e:
            errors.append(e)
            reduce.barrier.abort()
            pipe.close()

    rollout = _Rollout(pipe, cfg, admitted_events, vocab)
    rollout.t0 = t0
    threads = [threading.Thread(target=consumer, args=(r,), name=f"knitdata-demo-consumer{r}") for r in range(cfg.consumers)]
    rollout.start()
    for th in threads:
        th.start()
    rollout.join()
    for th in threads:
        th.join()
    pipe.close()
    bar.close()
    wall = time.perf_counter() - t0
    if rollout.error is not None:
        raise rollout.error
    if errors:
        raise errors[0]

    ids = [i for d in delivered for i in d]
    assert len(ids) == len(set(ids)) == total_steps * spec.minibatch_size, "delivery was not exactly-once"
    computes = [e - s for r in timeline for k, s, e in r if k == "compute"]
    train_s = float(np.median(computes)) * 2 if computes else 0.05  # K micro-batches per consumer step, roughly
    rep_cp = replay_staleness(rollout.arrivals, spec, "constraint_preserving", train_s)
    rep_tb = replay_staleness(rollout.arrivals, spec, "train_batch", train_s)
    # the headline is the positive part: negative values (late starters on newer weights) cancel in the mean
    reduction = staleness_reduction(rep_cp["arch"]["positive_mean"], rep_tb["arch"]["positive_mean"])
    exposed = {}
    for r in range(cfg.consumers):
        m = pipe.metrics(r)
        waits = m.wait_per_step_s
        transfer = [e - s for k, s, e in timeline[r] if k == "wait"]
        exposed[f"consumer{r}"] = {
            "transfer_median_per_microbatch_s": float(np.median(transfer)) if transfer else 0.0,
            "transfer_total_s": float(sum(transfer)),
            "next_median_per_step_s": float(np.median(waits)) if waits else 0.0,
            "admission_wait_total_s": float(sum(e - s for k, s, e in timeline[r] if k == "admission")),
            "bytes_fetched": m.to_dict().get("bytes_fetched"),
        }
    enc: dict[str, float] = dict(enc_rows)
    enc["work_ratio"] = enc["naive_rows"] / max(1, enc["encoded_rows"])
    report = DemoReport(
        config={**cfg.__dict__, "sources": [list(s) for s in cfg.sources], "batch_size": spec.batch_size},
        wall_s=wall,
        trajectories=len(ids),
        minibatches=len(losses),
        staleness={
            "measured": {"arch": summarize(measured_arch), "raw": summarize(measured_raw)},
            "replay_constraint_preserving": rep_cp,
            "replay_train_batch": rep_tb,
            "replay_train_s": train_s,
        },
        reduction_vs_train_batch=reduction,
        exposed_latency=exposed,
        encoder=enc,
        losses=losses,
    )
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if plot:
            report.timeline_png = str(out / "demo_timeline.png")
            _plot_timeline(report.timeline_png, admissions, timeline, rollout.arrivals, cfg, wall)
        (out / "demo_report.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
    return report


def _plot_timeline(
    path: str,
    admissions: list[tuple[float, int, int]],
    timeline: list[list[tuple[str, float, float]]],
    arrivals: list[tuple[float, float, TrajectoryMeta]],
    cfg: DemoConfig,
    wall: float,
) -> None:
    """Figure 1 of the demo, drawn by :func:`knitdata.observe.trace.plot_timeline` (the code ``knitdata trace --plot`` uses)."""
    from knitdata.observe.trace import plot_timeline

    plot_timeline(
        path, admissions, timeline, [(fin, m.source) for _, fin, m in arrivals], [s for s, _, _ in cfg.sources], wall,
        title=f"knitdata demo: constraint-preserving admission, iter fetch, shared encoding "
              f"(B={cfg.quota * len(cfg.sources)}, M={cfg.num_minibatches}, C={cfg.rollout_slots})",
    )


def _arch(summary: dict[str, float]) -> str:
    return (f"{summary['positive_mean']:.2f} / {summary['mean']:.2f} / {summary['p95']:.2f} / "
            f"{100 * summary['share_negative']:.0f}%")


def format_report(rep: DemoReport) -> str:
    """A short human-readable report."""
    st = rep.staleness
    lines = [
        f"knitdata demo: {rep.trajectories} trajectories delivered exactly once to {rep.config['consumers']} "
        f"consumers in {rep.minibatches} optimizer steps, {rep.wall_s:.1f} s",
        f"  scenario: sources {', '.join(f'{s} (mean {m}s, sigma {g})' for s, m, g in rep.config['sources'])}; "
        f"B={rep.config['batch_size']}, M={rep.config['num_minibatches']}, group={rep.config['group_size']}, "
        f"C={rep.config['rollout_slots']}",
        "  architectural staleness (mean of the positive part / signed mean / p95 / share negative, optimizer steps):",
        f"    measured, constraint-preserving:     {_arch(st['measured']['arch'])}"
        f"  (raw {st['measured']['raw']['mean']:.2f})",
        f"    replay, constraint-preserving:       {_arch(st['replay_constraint_preserving']['arch'])}",
        f"    replay, train-batch admission:       {_arch(st['replay_train_batch']['arch'])}",
        "    reduction vs train-batch admission (positive part):  "
        + ("n/a" if rep.reduction_vs_train_batch is None else f"{100 * rep.reduction_vs_train_batch:.0f}%"),
        "  exposed data-delivery latency per micro-batch (median; time in next() after admission): "
        + ", ".join(f"{k} {v['transfer_median_per_microbatch_s'] * 1e3:.3f} ms" for k, v in rep.exposed_latency.items()),
        "  idle waiting for admission (rollout-bound): "
        + ", ".join(f"{k} {v['admission_wait_total_s']:.1f} s" for k, v in rep.exposed_latency.items()),
        f"  encoder work: {rep.encoder['naive_rows']} patch rows naive, {rep.encoder['encoded_rows']} encoded "
        f"({rep.encoder['occurrences']} image occurrences, {rep.encoder['unique']} unique): "
        f"{rep.encoder['work_ratio']:.1f}x less",
    ]
    if rep.losses:
        lines.append(f"  loss: first step {rep.losses[0]:+.4f}, last step {rep.losses[-1]:+.4f}")
    if rep.timeline_png:
        lines.append(f"  timeline: {rep.timeline_png}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m benchmarks demo``."""
    p.add_argument("--train-batches", type=int, default=DemoConfig.train_batches, help="train batches to run")
    p.add_argument("--consumers", type=int, default=DemoConfig.consumers, help="consumer threads (ranks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/demo", help="folder for demo_report.json and demo_timeline.png")
    p.add_argument("--no-plot", action="store_true", help="do not write the timeline PNG")


def run(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks demo``."""
    torch.set_num_threads(1)
    plot = not args.no_plot
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("matplotlib is not installed (pip install 'knitdata[plot]'): skipping the timeline picture")
            plot = False
    cfg = DemoConfig(train_batches=args.train_batches, consumers=args.consumers, seed=args.seed)
    rep = run_demo(cfg, out_dir=args.out, plot=plot)
    print(format_report(rep))
    return 0
