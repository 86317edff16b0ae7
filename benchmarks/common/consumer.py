"""The consumer side of the transfer benchmark: a step loop over one delivery source, the trainers (the tiny
model on the CPU, or a wait of its calibrated cost), compute calibration, step records, and knitdata's
consumers (``TrajectoryDataset``) as step sources."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common.models import TinyVLM, VLMConfig, preprocess
from benchmarks.common.workload import COMPUTE_MODES, ENCODINGS, TransferWorkload, make_group
from knitdata.errors import ConfigError
from knitdata.record import Trajectory

__all__ = [
    "StepItem",
    "ConsumerStepRecord",
    "tq_patience",
    "pin_threads",
    "make_trainer",
    "calibrate_compute",
    "StepSource",
    "consume",
    "consume_interleaved",
    "dataset_kwargs",
    "step_item",
    "WAIT_SOURCES",
    "metrics_wait_key",
    "knitdata_source",
    "batch_spec",
    "pipeline_kwargs",
]


@dataclass
class StepItem:
    """One delivered micro-batch, as the training loop sees it."""

    ids: tuple[str, ...]
    input_ids: torch.Tensor
    inputs: dict[str, torch.Tensor] | None  # dup: per kind, every trajectory's own encoder inputs (copies included)
    media: Any  # shared: the MultimodalBatch of the consumer's share of the mini-batch
    index: int
    num_microbatches: int
    is_last: bool
    nbytes: int
    moved: int = 0  # payload bytes this fetch moved out of storage, when the source knows it


@dataclass
class ConsumerStepRecord:
    """What one consumer measured in one step (JSON-serializable via ``dataclasses.asdict``).

    Attributes:
        step: Step index (warm-up steps first).
        exposed_s: Wall time inside ``next()`` summed over the step's micro-batches (no H2D wait on CPU).
        compute_s: Wall time of encoding, forward, backward and the optimizer step.
        step_s: Wall time from the step's start (all consumers released together) to its optimizer step.
        microbatches: Micro-batches of the step.
        bytes: Bytes of the tensors handed to the trainer (the media table once per step in ``shared``).
        moved: Payload bytes moved out of storage for the step, when the source reports it per item.
        ids: Trajectory ids delivered in the step.
        waits: Seconds inside ``next()`` per micro-batch.
        commit_s: Seconds of the step's other data calls after the optimizer step (knitdata: ``state_dict()``
            and ``commit()``); included in ``exposed_s``.
        data_wait_s: Seconds of the step's ``next()`` calls spent blocked waiting for a micro-batch to be ready
            (``None`` when the source does not say); the rest of ``next()`` is the data system's own work.
        state_dict_s: Seconds inside ``state_dict()`` after the optimizer step (part of ``commit_s``).
        commit_call_s: Seconds inside ``commit()`` after the optimizer step (part of ``commit_s``).
    """

    step: int
    exposed_s: float
    compute_s: float
    step_s: float
    microbatches: int
    bytes: int
    moved: int
    ids: list[str]
    waits: list[float]
    commit_s: float = 0.0
    data_wait_s: float | None = None
    state_dict_s: float = 0.0
    commit_call_s: float = 0.0


def tq_patience() -> None:
    """Give transferqueue's client handshakes more patience than its default 3 tries a second apart: on a loaded
    2-core machine a fresh client (a streaming-loader worker) otherwise fails to reach the controller. Read by
    transferqueue when imported; inherited by spawned processes."""
    os.environ.setdefault("TQ_STORAGE_HANDSHAKE_MAX_RETRIES", "60")
    os.environ.setdefault("TQ_STORAGE_HANDSHAKE_TIMEOUT", "120")


def pin_threads() -> None:
    tq_patience()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["TQ_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


class _Trainer:
    """The tiny VLM of one consumer and its optimizer; ``dup`` or ``shared`` encoding."""

    def __init__(self, w: TransferWorkload, cfg: VLMConfig, encoding: str, device: str = "cpu"):
        if encoding not in ENCODINGS:
            raise ConfigError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        torch.manual_seed(w.seed)
        self.w = w
        self.device = torch.device(device)
        self.model = TinyVLM(cfg, w).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.encoding = encoding
        c, h, wd = w.item_shape
        n_patch = (h // cfg.patch) * (wd // cfg.patch)
        # per kind: (encoder input rows per item, items per trajectory)
        self.layout = {"image": (n_patch, w.image_items), "video": (n_patch * w.image_items, 1),
                       "audio": (w.audio_rows, 1)}
        self.kinds = self.model.kinds
        self.shared = None
        if encoding == "shared":
            from knitdata.media.encoder import SharedEncoding

            merge = {"image": cfg.merge, "video": cfg.merge, "audio": cfg.audio_merge}
            out_rows = None
            if any(merge[k] != 1 for k in self.kinds):
                def out_rows(table: Any) -> torch.Tensor:
                    return table.lengths // merge[table.kind]
            encs = self.model.encoders()
            self.shared = SharedEncoding(encs if len(encs) > 1 else next(iter(encs.values())), dummy=False,
                                         out_rows=out_rows)
        self._ctx: Any = None

    def microbatch(self, item: StepItem) -> None:
        """Encode, forward and backward one micro-batch (loss scaled by 1/K)."""
        scale = 1.0 / item.num_microbatches
        if item.input_ids.numel() == 0:
            return
        dev = self.device
        ids = item.input_ids.to(dev, non_blocking=True)
        if self.encoding == "dup":
            assert item.inputs is not None
            b = ids.shape[0]
            encs = self.model.encoders()
            rows = []
            for kind in self.kinds:
                per_item, n = self.layout[kind]
                offsets = torch.arange(b * n + 1, dtype=torch.long) * per_item
                rows.append(encs[kind](item.inputs[kind].to(dev, non_blocking=True), offsets))
            (self.model.backbone_loss(ids, rows) * scale).backward()
            return
        assert self.shared is not None
        if item.index == 0 or self._ctx is None:
            media = item.media if dev.type == "cpu" else item.media.to(dev, non_blocking=True)
            self._ctx = self.shared.minibatch(media)
            self._ctx.__enter__()
        multi = len(self.kinds) > 1
        rows = [self._ctx.rows(item.index, k) if multi else self._ctx.rows(item.index) for k in self.kinds]
        self._ctx.backward(self.model.backbone_loss(ids, rows) * scale)
        if item.is_last:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def optimizer_step(self) -> None:
        """Step the optimizer and clear the gradients (on CUDA: and wait for the step's kernels)."""
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _AccelTrainer:
    """``--compute accel``: each micro-batch's compute and the optimizer step are a sleep of their calibrated cost
    (see :func:`calibrate_compute`); the host CPU is free meanwhile, as on a GPU node."""

    def __init__(self, encoding: str, calibration: Mapping[str, Any]):
        if encoding not in calibration:
            raise ConfigError(f"no compute calibration for encoding {encoding!r} (have {sorted(calibration)})")
        c = calibration[encoding]
        self.encoding = encoding
        self.microbatch_s = [float(x) for x in c["microbatch_s"]]
        self.optimizer_step_s = float(c["optimizer_step_s"])
        if not self.microbatch_s:
            raise ConfigError(f"compute calibration of encoding {encoding!r} has no micro-batch")

    def microbatch(self, item: StepItem) -> None:
        """Wait what this micro-batch's encode, forward and backward cost alone (an empty one costs nothing)."""
        if item.input_ids.numel() == 0:
            return
        time.sleep(self.microbatch_s[min(item.index, len(self.microbatch_s) - 1)])

    def optimizer_step(self) -> None:
        """Wait what the optimizer step costs alone."""
        time.sleep(self.optimizer_step_s)


def make_trainer(w: TransferWorkload, cfg: VLMConfig, encoding: str, compute: str = "cpu",
                  calibration: Mapping[str, Any] | None = None, device: str = "cpu") -> Any:
    """The consumer's trainer: the tiny VLM (``cpu``) or its calibrated wait (``accel``)."""
    if compute == "cpu":
        return _Trainer(w, cfg, encoding, device)
    if compute == "accel":
        if calibration is None:
            raise ConfigError("compute 'accel' needs a calibration (calibrate_compute)")
        return _AccelTrainer(encoding, calibration)
    raise ConfigError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")


def _calibration_items(w: TransferWorkload, cfg: VLMConfig, encoding: str) -> list[StepItem]:
    """One consumer's micro-batches of step 0 (rank 0's share), collated as knitdata's dataset collates them."""
    groups = w.per_consumer_step // w.group_size
    trajs = [t for g in range(groups) for t in make_group(w, 0, g)]
    kw = dataset_kwargs(w, cfg, encoding)
    k, b = w.microbatches_per_step, w.microbatch_size
    mbs = [trajs[i * b:(i + 1) * b] for i in range(k)]
    media = kw["media_collator"](mbs) if "media_collator" in kw else None
    items = []
    for i, mb in enumerate(mbs):
        m = kw["collate"](mb)
        inputs = {kd: m.tensors[f"{kd}_inputs"] for kd in w.media_kinds} if encoding == "dup" else None
        items.append(StepItem(tuple(t.id for t in mb), m.input_ids, inputs, media, i, k, i == k - 1, 0))
    return items


def calibrate_compute(w: TransferWorkload, cfg: VLMConfig, encodings: Sequence[str] = ENCODINGS, *,
                      reps: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Time one consumer's training compute alone in this process (one torch thread), for ``--compute accel``.

    Runs the tiny VLM of :class:`_Trainer` on one consumer's micro-batches of step 0 (collated as knitdata's
    dataset collates them; the collation is not timed): ``reps`` timed steps per encoding, in two blocks per
    encoding in the order ``a b b a`` (so that a load drifting during the calibration weighs on each alike: the
    end-to-end figures compare ``dup`` with ``shared``), each block's steps back to back, as a consumer runs them,
    after ``warmup`` untimed ones.
    Every micro-batch of the workload has the same shape (``microbatch_size`` trajectories of ``tokens`` tokens
    and their media), but with ``shared`` encoding micro-batch 0 also encodes the step's unique media and the
    last one runs the encoder's backward, so the cost is kept per micro-batch index: the median over the timed
    steps of every micro-batch doing the same work (``classes``: with ``dup`` all of them; with ``shared`` the
    first, the middle ones, the last).

    Args:
        w: The workload.
        cfg: The model the consumers would train.
        encodings: Encodings to calibrate (subset of :data:`ENCODINGS`).
        reps: Timed steps per encoding (medians are kept).
        warmup: Untimed steps first.

    Returns:
        Per encoding ``{"microbatch_s": [median per micro-batch index], "optimizer_step_s", "step_s" (their
        sum), "classes": [work class per index], "samples": {...}}``, plus ``reps``, ``warmup``,
        ``torch_threads``, ``shape``, ``model`` and the load average before and after (``loadavg_before`` /
        ``loadavg_after``).

    Raises:
        ConfigError: Unknown encoding, or ``reps < 1``.
    """
    bad = [e for e in encodings if e not in ENCODINGS]
    if bad or not encodings:
        raise ConfigError(f"encodings must be a non-empty subset of {ENCODINGS}, got {list(encodings)}")
    if reps < 1 or warmup < 0:
        raise ConfigError(f"calibration needs reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"reps": reps, "warmup": warmup, "torch_threads": 1,
                           "shape": {"microbatches": w.microbatches_per_step, "trajectories": w.microbatch_size,
                                     "tokens": w.tokens, "media_kinds": list(w.media_kinds),
                                     "image_items": w.image_items, "item_shape": list(w.item_shape),
                                     "audio_rows": w.audio_rows},
                           "model": cfg.name}
    try:
        out["loadavg_before"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        prepared = {enc: (_calibration_items(w, cfg, enc), _Trainer(w, cfg, enc)) for enc in encodings}
        per: dict[str, list[list[float]]] = {enc: [[] for _ in prepared[enc][0]] for enc in encodings}
        opt: dict[str, list[float]] = {enc: [] for enc in encodings}
        # two blocks per encoding, in the order a b b a: a load drifting during the calibration weighs on each
        # alike (the end-to-end figures compare them); within a block the steps are back to back, as a consumer
        # runs them, the first ``warmup`` untimed
        first = (reps + 1) // 2
        blocks = [(enc, first) for enc in encodings] + [(enc, reps - first) for enc in reversed(encodings)]
        for enc, timed in blocks:
            if timed == 0:
                continue
            items, tr = prepared[enc]
            for r in range(warmup + timed):
                times = []
                for item in items:
                    t0 = time.perf_counter()
                    tr.microbatch(item)
                    times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                tr.optimizer_step()
                o = time.perf_counter() - t0
                if r >= warmup:
                    for i, x in enumerate(times):
                        per[enc][i].append(x)
                    opt[enc].append(o)
        for enc in encodings:
            classes = _work_classes(enc, len(per[enc]))
            pooled = {c: [x for i, v in enumerate(per[enc]) if classes[i] == c for x in v] for c in set(classes)}
            mb = [float(statistics.median(pooled[c])) for c in classes]
            o_s = float(statistics.median(opt[enc]))
            out[enc] = {"microbatch_s": mb, "optimizer_step_s": o_s, "step_s": sum(mb) + o_s, "classes": classes,
                        "samples": {"microbatch_s": per[enc], "optimizer_step_s": opt[enc]}}
    finally:
        torch.set_num_threads(threads)
    try:
        out["loadavg_after"] = list(os.getloadavg())
    except OSError:
        pass
    return out


def _work_classes(encoding: str, k: int) -> list[str]:
    """Which micro-batches of a step do the same compute: all of them with ``dup``; with ``shared`` the first
    (it also encodes the unique media), the middle ones, the last (it also runs the encoder's backward)."""
    if encoding == "dup":
        return ["microbatch"] * k
    if k == 1:
        return ["only"]
    return ["first"] + ["middle"] * (k - 2) + ["last"]


@dataclass
class StepSource:
    """One delivery source as the training loop drives it.

    ``next_item()`` returns the micro-batch, the seconds inside the system's ``next()`` and, when the source
    knows it, the part of them spent blocked waiting for the micro-batch to be ready (``None`` otherwise:
    ``wait_probe`` then gives the cumulative waiting seconds, read before and after each step).
    ``state_call()`` / ``commit_call(state)`` are the trainer's data calls after the optimizer step.
    """

    name: str
    trainer: Any
    next_item: Callable[[], tuple[StepItem, float, float | None]]
    state_call: Callable[[], Any] | None = None
    commit_call: Callable[[Any], Any] | None = None
    wait_probe: Callable[[], float] | None = None


def _run_step(step: int, src: StepSource) -> ConsumerStepRecord:
    """One optimizer step of one consumer: micro-batches until ``is_last``, then the optimizer step, then the
    data calls after it (``state_dict()`` and ``commit()``), each timed on the trainer's thread.

    Exposed latency: the seconds inside ``next()`` plus those of the calls after the optimizer step.
    """
    w0 = src.wait_probe() if src.wait_probe is not None else None
    trainer = src.trainer
    t0 = time.perf_counter()
    exposed = compute = 0.0
    ids: list[str] = []
    waits: list[float] = []
    nbytes = moved = n = 0
    reported = 0.0
    all_reported = True
    while True:
        item, next_s, wait_s = src.next_item()
        exposed += next_s
        waits.append(next_s)
        if wait_s is None:
            all_reported = False
        else:
            reported += wait_s
        t1 = time.perf_counter()
        trainer.microbatch(item)
        compute += time.perf_counter() - t1
        ids.extend(item.ids)
        nbytes += item.nbytes
        moved += item.moved
        n += 1
        if item.is_last:
            break
    t1 = time.perf_counter()
    trainer.optimizer_step()
    t2 = time.perf_counter()
    compute += t2 - t1
    state = src.state_call() if src.state_call is not None else None
    t3 = time.perf_counter()
    if src.commit_call is not None:
        src.commit_call(state)
    t4 = time.perf_counter()
    exposed += t4 - t2
    data_wait: float | None = None
    if all_reported:
        data_wait = reported
    elif w0 is not None and src.wait_probe is not None:
        data_wait = max(0.0, src.wait_probe() - w0)
    return ConsumerStepRecord(step, exposed, compute, t4 - t0, n, nbytes, moved, ids, waits, t4 - t2,
                              data_wait_s=data_wait, state_dict_s=t3 - t2, commit_call_s=t4 - t3)


def consume(
    w: TransferWorkload,
    src: StepSource,
    barrier_wait: Callable[[], object],
    on_step: Callable[[int], None] | None = None,
) -> list[ConsumerStepRecord]:
    """The training loop of one consumer over one source; consumers start each step together."""
    return consume_interleaved(w, [dataclasses.replace(src, name="only")], barrier_wait, on_step)["only"]


def consume_interleaved(
    w: TransferWorkload,
    sources: Sequence[StepSource],
    barrier_wait: Callable[[], object],
    on_step: Callable[[int], None] | None = None,
) -> dict[str, list[ConsumerStepRecord]]:
    """Steps of every source in turn (step 0 of each, then step 1 of each, ...): a side-by-side comparison on
    a machine whose load drifts. All consumers start each step together (a barrier, like an all-reduce)."""
    out: dict[str, list[ConsumerStepRecord]] = {src.name: [] for src in sources}
    k = 0
    for step in range(w.total_steps):
        for src in sources:
            barrier_wait()
            out[src.name].append(_run_step(step, src))
            if on_step is not None:
                on_step(k)
            k += 1
    barrier_wait()
    return out


class _DupCollator:
    """TokenCollator plus every trajectory's own copy of its media, processed per copy (what verl/slime hand
    over): per kind a tensor ``{kind}_inputs`` of the concatenated encoder inputs."""

    def __init__(self, w: TransferWorkload, cfg: VLMConfig):
        from knitdata.consumer.collate import TokenCollator
        from knitdata.media.process import MediaProcessor

        self.tokens = TokenCollator()
        self.proc = MediaProcessor(preprocess(w, cfg))
        self.kinds = w.media_kinds

    def __call__(self, trajs: Sequence[Trajectory], info: Any = None) -> Any:
        mb = self.tokens(trajs, info)
        if trajs:
            per: dict[str, list[torch.Tensor]] = {k: [] for k in self.kinds}
            for t in trajs:
                for i, item in enumerate(t.media):
                    per[item.kind].append(self.proc.process(item, trajectory_id=t.id, index=i).tensor)
            for k, v in per.items():
                mb.tensors[f"{k}_inputs"] = torch.cat(v)
        return mb


def dataset_kwargs(w: TransferWorkload, cfg: VLMConfig, encoding: str) -> dict[str, Any]:
    if encoding == "dup":
        return {"collate": _DupCollator(w, cfg)}
    from knitdata.consumer.collate import TokenCollator
    from knitdata.media.multimodal import MultimodalCollator

    return {"collate": TokenCollator(), "media_collator": MultimodalCollator(preprocess(w, cfg))}


def _knitdata_next(it: Iterator[Any], kinds: Sequence[str] = ("image",)
                   ) -> Callable[[], tuple[StepItem, float, float | None]]:
    """Adapt a TrajectoryDataset iterator: time ``next()`` only, then read the micro-batch (the waiting part of
    ``next()`` comes from the dataset's metrics: :func:`_data_wait_probe`)."""

    def nxt() -> tuple[StepItem, float, float | None]:
        t0 = time.perf_counter()
        mb = next(it)
        waited = time.perf_counter() - t0
        info = mb.info
        item = step_item(mb, tuple(info.trajectory_ids), info.microbatch, info.num_microbatches, info.is_last, kinds)
        return item, waited, None

    return nxt


def step_item(mb: Any, ids: tuple[str, ...], index: int, num_microbatches: int, is_last: bool,
              kinds: Sequence[str]) -> StepItem:
    """The trainer's view of knitdata micro-batch ``mb``: its tensors' bytes (the media table's once, with the first
    micro-batch of its share), the per-kind encoder inputs of duplicated encoding (``{kind}_inputs``), its media."""
    nbytes = sum(t.numel() * t.element_size() for t in mb.iter_tensors())
    if mb.media is not None and index == 0:
        nbytes += int(getattr(mb.media, "nbytes", 0))
    inputs = {k: mb.tensors[f"{k}_inputs"] for k in kinds if f"{k}_inputs" in mb.tensors} or None
    return StepItem(ids, mb.input_ids, inputs, mb.media, index, num_microbatches, is_last, nbytes)


#: Where a run's "waiting for data" (``wait_ms``) comes from: the code stored per run as ``wait_source``.
WAIT_SOURCES: dict[str, str] = {
    "data_wait_s_total": "knitdata's ConsumerMetrics data_wait_s_total: seconds next() spent blocked until the "
                         "micro-batch was ready",
    "wait_s_total": "knitdata's ConsumerMetrics wait_s_total (fallback for a library without data_wait_s_total): "
                    "the time inside the dataset's inner iterator -- the prefetch queue pop in iter, the fetch, "
                    "decode and collate in sample and eager",
    "unavailable": "not reported: counted as 0 (all of next() counted as own work)",
    "transferqueue": "all of next(): get_meta, get_data and the rows' processing run on the trainer's thread",
    "tq_async": "the time blocked on the prefetch thread's queue",
    "tq_loader": "the time inside the streaming loader's next()",
    "floor": "the time blocked on the floor's deque (no data system: see benchmarks/common/floor.py)",
}


def metrics_wait_key(d: Mapping[str, Any]) -> str:
    for k in ("data_wait_s_total", "wait_s_total"):
        if isinstance(d.get(k), (int, float)):
            return k
    return "unavailable"


def _data_wait_probe(ds: Any) -> Callable[[], float]:
    """Cumulative seconds the dataset's ``next()`` spent waiting for data (its ConsumerMetrics), read outside the
    timed calls; ``data_wait_s_total`` when the library reports it, else ``wait_s_total`` (see
    :data:`WAIT_SOURCES`)."""

    def probe() -> float:
        d = ds.metrics.to_dict()
        k = metrics_wait_key(d)
        return float(d[k]) if k in d else 0.0

    return probe


def knitdata_source(name: str, trainer: Any, ds: Any, it: Iterator[Any], kinds: Sequence[str]) -> StepSource:
    """A knitdata TrajectoryDataset as the trainer drives it: ``next()`` per micro-batch, then after each
    optimizer step ``state = ds.state_dict()`` and ``ds.commit(state)`` (both exposed)."""
    return StepSource(name, trainer, _knitdata_next(it, kinds), ds.state_dict, ds.commit,
                   _data_wait_probe(ds) if getattr(ds, "metrics", None) is not None else None)


def batch_spec(w: TransferWorkload) -> Any:
    from knitdata.admission import BatchSpec

    return BatchSpec({"mm": w.trajectories_per_step}, num_minibatches=1, group_size=w.group_size)


def pipeline_kwargs(w: TransferWorkload, media_dedup: bool = True) -> dict[str, Any]:
    """The knitdata ``Pipeline`` keywords of the workload (capacity for all of it with per-trajectory copies);
    ``media_dedup``: media stored once (``False``: per-trajectory copies, the baseline)."""
    total = w.total_steps * w.trajectories_per_step * (w.trajectory_bytes + 4096)
    return {
        "num_consumers": w.num_consumers,
        "token_budget": w.microbatch_size * w.tokens,
        "capacity_bytes": int(total * 1.25),
        "admission": "fifo",
        "media_dedup": bool(media_dedup),
    }
