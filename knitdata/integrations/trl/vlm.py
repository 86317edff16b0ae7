"""Shared encoding for vision-language models in TRL's synchronous ``GRPOTrainer`` (TRL ``>=1.16,<1.17``).

In TRL's VLM GRPO every prompt row is repeated ``num_generations`` times, and with it the prompt's image: the
image processor runs on every copy, and the two no-grad log-prob passes (old policy, reference model) and the
gradient pass each run the vision tower on every copy. :class:`SharedEncodingGRPOTrainer` is a drop-in
``GRPOTrainer`` that does that work once per distinct image:

* **processing**: while TRL generates and scores a batch, the processor's image processor is wrapped in a
  :class:`DedupImageProcessor`, which processes each distinct image (equal pixels) once and repeats its rows,
  so TRL's own plumbing (its ``pixel_values`` per row, shuffle and split) is unchanged;
* **no-grad passes**: each pass encodes the generation batch's distinct images once with the pass's model (the
  policy, or the reference model) and hands every row its image's rows through the model's own hook for
  precomputed encoder outputs (Qwen2.5-VL / Qwen3-VL ``mm_encoder_outputs``);
* **gradient pass**: the micro-batches of one optimizer step share one
  :class:`~knitdata.media.encoder.SharedEncoding` mini-batch: the distinct images are encoded once with autograd,
  every micro-batch gets its occurrences' rows, and the encoder gradient of every micro-batch is applied once
  (``fold``: with the last micro-batch's backward, so DDP reduces it with the rest). Loss and gradients are those
  of TRL alone (to rounding: the vision tower treats images independently).

The family glue (tower call, rows per image, forward with precomputed rows) is
:func:`knitdata.integrations.transformers.adapter_for`'s: Qwen2.5-VL and Qwen3-VL.

Private TRL names this needs (TRL has no public hook for any of it; see docs/trl.md): it overrides
``GRPOTrainer._generate_and_score_completions`` (to wrap the image processor for the call and tag each row with
its distinct images) and ``GRPOTrainer._get_per_token_logps_and_entropies`` (the only place TRL calls the model
with images: the override runs the same chunked fused-head forward with precomputed rows, and calls TRL's own
for anything else). ``training_step`` and ``compute_loss`` are public ``Trainer`` methods.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
from torch import nn

from knitdata.errors import ConfigError, OptionalDependencyError, StateError
from knitdata.integrations.hf_adapter import HFMultimodalAdapter
from knitdata.integrations.transformers import adapter_for
from knitdata.media.encoder import MODES, SharedMiniBatch
from knitdata.media.multimodal import MediaOccurrences, MediaTable, MultimodalBatch, segment_rows
from knitdata.record import tensor_digest

try:
    from accelerate.utils import DistributedType
    from transformers import BatchFeature, ProcessorMixin
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise OptionalDependencyError("trl", "trl", "knitdata.integrations.trl") from e

__all__ = ["DedupImageProcessor", "SharedEncodingGRPOTrainer", "SharedEncodingStats", "ITEMS_KEY", "GENERATION_KEY"]

#: Per-row key the trainer adds to TRL's batch: ``int64 [B, M]``, each row's distinct image per image slot (-1: none).
ITEMS_KEY = "knitdata_image_items"
#: Per-row key: ``int64 [B]``, the generation batch (its serial) whose distinct images ``ITEMS_KEY`` indexes.
GENERATION_KEY = "knitdata_generation"

_UNSUPPORTED = ("token_type_ids", "pixel_attention_mask", "spatial_shapes", "num_tiles", "image_sizes",
                "image_position_ids")


@dataclass
class SharedEncodingStats:
    """What the trainer's image work amounted to, cumulated over its life (copies = what TRL alone would do).

    Attributes:
        images_in: Images handed to the image processor (every copy).
        images_processed: Images the image processor actually processed (distinct ones per call).
        encoded_nograd: Images the vision tower encoded in the no-grad log-prob passes.
        occurrences_nograd: Image copies those passes consumed (what TRL alone encodes there).
        encoded_grad: Images the vision tower encoded with autograd (the gradient passes).
        occurrences_grad: Image copies the gradient passes consumed.
        segments: Shared mini-batches opened for gradient passes (one per optimizer step, or per part of a step
            when TRL regenerates inside it).
        fallbacks: Calls with images that went through TRL's own (duplicated) path.
    """

    images_in: int = 0
    images_processed: int = 0
    encoded_nograd: int = 0
    occurrences_nograd: int = 0
    encoded_grad: int = 0
    occurrences_grad: int = 0
    segments: int = 0
    fallbacks: int = 0


def _image_key(img: Any) -> Any:
    """Equal keys for images with equal pixels (a PIL image of any file type, an array or a tensor)."""
    if isinstance(img, torch.Tensor):
        return ("tensor", tensor_digest(img))
    tobytes = getattr(img, "tobytes", None)
    if tobytes is None:
        return ("object", id(img))
    h = hashlib.blake2b(tobytes(), digest_size=16).hexdigest()
    if hasattr(img, "mode"):  # PIL: a decoded PngImageFile and its .copy() (an Image) are the same pixels
        return ("pil", img.mode, tuple(img.size), h)
    return ("array", str(getattr(img, "dtype", "")), tuple(getattr(img, "shape", ())), h)


def _flat_images(images: Any) -> list[Any] | None:
    """The images of a (nested) list, in order; ``None`` when it holds something else than images."""
    if not isinstance(images, (list, tuple)):
        return None if images is None else [images]
    out: list[Any] = []
    for x in images:
        sub = _flat_images(x) if isinstance(x, (list, tuple)) else ([x] if x is not None else None)
        if sub is None:
            return None
        out += sub
    return out


class DedupImageProcessor:
    """Wrap a Qwen2-VL-style image processor: each call processes every distinct image once.

    The output equals the wrapped processor's on the whole list (``pixel_values`` rows repeated per copy,
    ``image_grid_thw`` per copy), since such processors treat images one by one. The last call's distinct images are
    kept as a :class:`~knitdata.media.multimodal.MediaTable` (:attr:`last_table`) with each copy's item
    (:attr:`last_index`). Anything else is the wrapped processor's (attributes are forwarded).

    Args:
        inner: The image processor (``processor.image_processor``).
        stats: Where to count images in and processed (default: a new :class:`SharedEncodingStats`).
    """

    def __init__(self, inner: Any, stats: SharedEncodingStats | None = None):
        self.inner = inner
        self.stats = stats if stats is not None else SharedEncodingStats()
        self.last_table: MediaTable | None = None
        self.last_index: torch.Tensor | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    def __call__(self, images: Any = None, *args: Any, **kwargs: Any) -> Any:
        flat = _flat_images(images)
        self.last_table = self.last_index = None
        if not flat or args or kwargs.get("return_tensors") != "pt":
            return self.inner(images, *args, **kwargs)
        keys: dict[Any, int] = {}
        by_id: dict[int, Any] = {}
        unique: list[Any] = []
        index = []
        for img in flat:
            k = by_id.get(id(img))
            if k is None:
                k = by_id[id(img)] = _image_key(img)
            if k not in keys:
                keys[k] = len(unique)
                unique.append(img)
            index.append(keys[k])
        out = self.inner(unique, **kwargs)
        self.stats.images_in += len(flat)
        self.stats.images_processed += len(unique)
        pv, grid = out.get("pixel_values"), out.get("image_grid_thw")
        if not isinstance(pv, torch.Tensor) or not isinstance(grid, torch.Tensor) or set(out.keys()) != {
            "pixel_values", "image_grid_thw"
        }:
            return self.inner(images, *args, **kwargs)  # not a Qwen2-VL-style output: the plain call
        idx = torch.tensor(index, dtype=torch.long)
        lengths = grid.prod(-1).to(torch.long)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        self.last_table = MediaTable("image", pv, offsets, tuple(keys), meta={"image_grid_thw": grid.to(torch.long)})
        self.last_index = idx
        rows = segment_rows(offsets, idx)
        return BatchFeature({"pixel_values": pv[rows], "image_grid_thw": grid[idx]}, tensor_type="pt")


@dataclass
class _Segment:
    """One shared mini-batch of the gradient pass: ``k`` consecutive micro-batches of one optimizer step."""

    shared: SharedMiniBatch
    batch: MultimodalBatch
    serial: int
    k: int
    i: int = 0  # next micro-batch
    rows_given: int = 0  # micro-batches handed their rows (i <= rows_given <= i + 1)


class _State:
    """The trainer's shared-encoding state (kept off the trainer's own namespace)."""

    def __init__(self, mode: str, stats: SharedEncodingStats):
        self.mode = mode
        self.stats = stats
        self.adapters: dict[int, HFMultimodalAdapter] = {}
        self.dedup: DedupImageProcessor | None = None
        self.in_generation = False
        self.tables: dict[int, MediaTable] = {}  # per generation serial, its distinct images (latest train / eval)
        self.latest: dict[bool, int] = {}  # training? -> serial of its latest generation batch
        self.serial = 0
        self.pos_in_step = 0  # micro-batches done in the current optimizer step
        self.pos_in_gen = 0  # micro-batches done since the last generation (train mode)
        self.segment: _Segment | None = None
        self.provided: tuple[Any, torch.Tensor] | None = None  # (rows, rows per occurrence) for the next forward
        self.warned = False


def _slice_rows(rows: Any, a: int, b: int) -> Any:
    if isinstance(rows, (tuple, list)):
        return type(rows)(r[a:b] for r in rows)
    return rows[a:b]


def _occurrences(items: torch.Tensor) -> MediaOccurrences:
    """Occurrences (trajectory order, then slot order) of a ``[B, M]`` item table (-1: no image)."""
    items = items.detach().cpu().to(torch.long)
    traj, slot = (items >= 0).nonzero(as_tuple=True)
    return MediaOccurrences(items[traj, slot], traj, slot)


class SharedEncodingGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose vision-language image work runs once per distinct image per step.

    Takes every ``GRPOTrainer`` argument; ``processing_class`` must be the model's processor (a
    ``ProcessorMixin`` with an ``image_processor``) and the model (and reference model) a family of
    :func:`~knitdata.integrations.transformers.adapter_for` that consumes images (Qwen2.5-VL, Qwen3-VL).

    Args:
        *args: ``GRPOTrainer``'s positional arguments.
        shared_encoding: ``"fold"`` (default), ``"leaf"`` or ``"recompute"``: the
            :class:`~knitdata.media.encoder.SharedEncoding` mode of the gradient pass (``leaf``/``recompute`` need the
            vision tower wrapped on its own under DDP); ``"naive"``: TRL's own path everywhere (for A/B checks).
        **kwargs: ``GRPOTrainer``'s keyword arguments.

    Attributes:
        shared_encoding_stats: :class:`SharedEncodingStats` (images in, processed and encoded).

    Raises:
        ConfigError: Unknown mode, a processing class without an image processor, a model family without an
            image adapter, or an Accelerate setup whose backward this cannot route (DeepSpeed, FSDP,
            Megatron-LM, XLA, LOMO optimizers).
    """

    def __init__(self, *args: Any, shared_encoding: str = "fold", **kwargs: Any):
        if shared_encoding not in MODES:
            raise ConfigError(f"shared_encoding must be one of {MODES}, got {shared_encoding!r}")
        super().__init__(*args, **kwargs)
        self.shared_encoding_stats = SharedEncodingStats()
        self._knit = _State(shared_encoding, self.shared_encoding_stats)
        if shared_encoding == "naive":
            return
        proc = self.processing_class
        if not isinstance(proc, ProcessorMixin) or getattr(proc, "image_processor", None) is None:
            raise ConfigError(
                f"shared encoding is for vision-language models: processing_class is a {type(proc).__name__}, "
                "pass the model's processor (with an image_processor), or use trl.GRPOTrainer"
            )
        model = self.model
        assert isinstance(model, nn.Module)  # GRPOTrainer built it (from a path or the module given)
        adapter = adapter_for(model, proc.image_processor)
        if adapter.kind != "image" or len(adapter.placeholders) != 1:
            raise ConfigError(f"model family {adapter.family!r} is not an image-only model; use trl.GRPOTrainer")
        self._knit.adapters[id(model)] = adapter
        bad = {DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA}
        if self.accelerator.distributed_type in bad:
            raise ConfigError(
                f"shared encoding routes the backward of the gradient pass itself; Accelerate's "
                f"{self.accelerator.distributed_type} backward is not supported: use trl.GRPOTrainer "
                "(or shared_encoding='naive')"
            )
        if "lomo" in str(self.args.optim).lower():
            raise ConfigError("LOMO optimizers fuse the optimizer step into the backward: use trl.GRPOTrainer")
        # a shallow copy whose image processor is swapped only while TRL generates and scores a batch: the user's
        # processor is never modified and checkpoints save the real image processor
        self.processing_class = copy.copy(proc)
        self._knit.dedup = DedupImageProcessor(proc.image_processor, self.shared_encoding_stats)

    # ------------------------------------------------------------------ family glue
    def _knit_adapter(self, model: nn.Module) -> HFMultimodalAdapter:
        ad = self._knit.adapters.get(id(model))
        if ad is None or ad.model is not model:
            dedup = self._knit.dedup
            ad = self._knit.adapters[id(model)] = adapter_for(model, dedup.inner if dedup is not None else None)
        return ad

    @contextlib.contextmanager
    def _knit_dedup_processing(self) -> Iterator[None]:
        proc, dedup = self.processing_class, self._knit.dedup
        assert dedup is not None
        proc.image_processor = dedup  # type: ignore[union-attr]
        try:
            yield
        finally:
            proc.image_processor = dedup.inner  # type: ignore[union-attr]

    # ------------------------------------------------------------------ TRL private override 1
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation and scoring, with each distinct image processed once and each row tagged with its
        distinct images (``ITEMS_KEY``, ``GENERATION_KEY``); the no-grad passes inside encode each image once."""
        k = self._knit
        if k.mode == "naive":
            return super()._generate_and_score_completions(inputs)
        training = bool(getattr(self.model, "training", False))
        if training and k.segment is not None:
            raise StateError(
                f"TRL generated a new batch while the shared encoding of micro-batches {k.segment.i}.."
                f"{k.segment.k - 1} of an optimizer step was open (internal: the step's micro-batches were miscounted)"
            )
        assert k.dedup is not None
        k.dedup.last_table = k.dedup.last_index = None
        k.in_generation = True
        try:
            with self._knit_dedup_processing():
                output = super()._generate_and_score_completions(inputs)
        finally:
            k.in_generation = False
        if training:
            k.pos_in_gen = 0
        k.serial += 1
        k.tables.pop(k.latest.get(training, -1), None)
        k.latest[training] = k.serial
        table, index = k.dedup.last_table, k.dedup.last_index
        num_images = output.get("num_images")
        grid = output.get("image_grid_thw")
        if table is None or index is None or num_images is None or grid is None or "pixel_values" not in output:
            return output
        if not torch.equal(grid.detach().cpu().to(torch.long), table.meta["image_grid_thw"][index]):
            return output  # the images were not the last processed ones: TRL's own path for this batch
        items = torch.full((len(num_images), max(max(num_images), 1)), -1, dtype=torch.long)
        start = 0
        for row, n in enumerate(num_images):
            items[row, :n] = index[start : start + n]
            start += n
        k.tables[k.serial] = table
        output[ITEMS_KEY] = items.to(grid.device)
        output[GENERATION_KEY] = torch.full((len(num_images),), k.serial, dtype=torch.long, device=grid.device)
        return output

    # ------------------------------------------------------------------ TRL private override 2
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, pixel_values=None,
                                           image_grid_thw=None, num_images=None, **kwargs):
        """TRL's chunked fused-head log-probs, with precomputed encoder rows instead of ``pixel_values``."""
        k = self._knit
        plan = None
        if k.mode != "naive" and pixel_values is not None and image_grid_thw is not None and num_images is not None \
                and not any(kwargs.get(name) is not None for name in _UNSUPPORTED):
            plan = k.provided
            k.provided = None
            if plan is None and k.in_generation:
                plan = self._knit_encode_generation(model, image_grid_thw)
        if plan is None:
            if pixel_values is not None and k.mode != "naive":
                k.stats.fallbacks += 1
                if not k.warned:
                    k.warned = True
                    warnings.warn(
                        "a log-prob pass with images went through TRL's own path (each copy encoded): its images were "
                        "not the last ones the trainer processed, or the model takes inputs other than Qwen-VL's",
                        stacklevel=2,
                    )
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, pixel_values=pixel_values,
                image_grid_thw=image_grid_thw, num_images=num_images, **kwargs)
        rows, occ_rows = plan
        adapter = self._knit_adapter(model)
        mm_token_type_ids = kwargs.get("mm_token_type_ids")
        batch_size = batch_size or input_ids.size(0)
        cum_imgs = [0, *accumulate(num_images)]
        cum_rows = [0, *accumulate(occ_rows.tolist())]
        logps, entropies, aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            a, b = cum_imgs[start], cum_imgs[end]
            fwd: dict[str, Any] = {"input_ids": input_ids[start:end], "attention_mask": attention_mask[start:end]}
            if mm_token_type_ids is not None:
                fwd["mm_token_type_ids"] = mm_token_type_ids[start:end]
            chunk = None
            if b > a:
                fwd["image_grid_thw"] = image_grid_thw[a:b]
                chunk = _slice_rows(rows, cum_rows[a], cum_rows[b])
            labels = fwd["input_ids"].masked_fill(fwd["attention_mask"] == 0, -100)
            labels[:, :-logits_to_keep] = -100
            extra = {"output_router_logits": True} if compute_aux_loss else {}
            with self.accelerator.autocast():
                out = adapter.forward(fwd, chunk, labels=labels, fused_lm_head=True, **extra)
            logps.append(out.log_probs[:, -logits_to_keep:])
            if compute_entropy:
                entropies.append(out.entropy[:, -logits_to_keep:])
            if compute_aux_loss:
                aux.append(out.aux_loss)
        return (torch.cat(logps, 0), torch.cat(entropies, 0) if compute_entropy else None,
                torch.stack(aux).mean() if compute_aux_loss else None)

    def _knit_encode_generation(self, model: nn.Module, image_grid_thw: torch.Tensor) -> tuple[Any, torch.Tensor] | None:
        """A no-grad pass over the generation batch: its distinct images encoded once with ``model``'s tower."""
        k = self._knit
        assert k.dedup is not None
        table, index = k.dedup.last_table, k.dedup.last_index
        if table is None or index is None or not torch.equal(
            image_grid_thw.detach().cpu().to(torch.long), table.meta["image_grid_thw"][index]
        ):
            return None
        adapter = self._knit_adapter(model)
        dev = image_grid_thw.device
        occ = MediaOccurrences(index, torch.zeros_like(index), torch.zeros_like(index))
        batch = MultimodalBatch({"image": table}, [{"image": occ}]).to(dev)
        enc = adapter.shared_encoding(mode="fold", dummy=False)
        with torch.no_grad(), self.accelerator.autocast(), enc.minibatch(batch) as shared:
            rows = adapter.rows(shared, 0)
        k.stats.encoded_nograd += table.num_items
        k.stats.occurrences_nograd += len(index)
        return rows, adapter.out_rows(table).cpu()[index]

    # ------------------------------------------------------------------ public Trainer hooks
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, the micro-batch's image rows taken from the step's shared encoding."""
        k = self._knit
        items = inputs.get(ITEMS_KEY)
        if k.mode == "naive" or items is None or not len(items):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        serials = sorted(set(inputs[GENERATION_KEY].tolist()))
        table = k.tables.get(serials[0])
        if len(serials) != 1 or table is None:
            raise StateError(
                f"a micro-batch of generation batch(es) {serials} reached the loss after a later generation batch "
                f"replaced their images (latest: {k.latest})"
            )
        occ = _occurrences(items)
        adapter = self._knit_adapter(model)
        training = torch.is_grad_enabled() and model.training
        if training and serials[0] != k.latest.get(True):
            raise StateError(f"a micro-batch of generation batch {serials[0]} is not of the latest training batch")
        if training:
            rows = self._knit_step_rows(model, table, occ)
        else:  # evaluation: the micro-batch's distinct images encoded once, without autograd
            uniq, inv = torch.unique(occ.index, return_inverse=True)
            sub = table.gather(uniq)
            batch = MultimodalBatch({"image": sub}, [{"image": MediaOccurrences(inv, occ.trajectory, occ.item)}])
            enc = adapter.shared_encoding(mode="fold", dummy=False)
            with torch.no_grad(), self.accelerator.autocast(), enc.minibatch(batch.to(items.device)) as shared:
                rows = adapter.rows(shared, 0) if len(occ) else None
            k.stats.encoded_nograd += sub.num_items
            k.stats.occurrences_nograd += len(occ)
        k.provided = (rows, adapter.out_rows(table).cpu()[occ.index]) if len(occ) else None
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            k.provided = None

    def _knit_step_rows(self, model: nn.Module, table: MediaTable, occ: MediaOccurrences) -> Any:
        """Micro-batch rows from the optimizer step's shared mini-batch (opened at its first micro-batch)."""
        k = self._knit
        seg = k.segment
        if seg is None:
            config: Any = self.args  # a GRPOConfig (Trainer annotates TrainingArguments)
            generate_every = config.steps_per_generation * self.num_iterations
            left_in_step = self.current_gradient_accumulation_steps - k.pos_in_step
            left_in_gen = generate_every - k.pos_in_gen
            n = min(left_in_step, left_in_gen)
            if n < 1:
                raise StateError(
                    f"no micro-batch left in the optimizer step ({left_in_step}) or generation ({left_in_gen}): "
                    "the trainer's micro-batches were miscounted (training_step called outside Trainer.train?)"
                )
            adapter = self._knit_adapter(model)
            dev = next(iter(p.device for p in model.parameters()))
            batch = MultimodalBatch({"image": table}, [{} for _ in range(n)]).to(dev)
            shared = adapter.shared_encoding(mode=k.mode).minibatch(batch)
            with self.accelerator.autocast():
                shared.__enter__()  # encodes the distinct images once, with autograd; closed after the last backward
            seg = k.segment = _Segment(shared, batch, k.serial, n)
            k.stats.segments += 1
            k.stats.encoded_grad += table.num_items
        if seg.rows_given != seg.i:
            raise StateError(f"micro-batch {seg.i}'s rows were asked twice before its backward")
        if len(occ):
            dev = seg.batch.tables["image"].values.device
            seg.batch.occurrences[seg.i] = {
                "image": MediaOccurrences(occ.index.to(dev), occ.trajectory.to(dev), occ.item.to(dev))
            }
        k.stats.occurrences_grad += len(occ)
        seg.rows_given += 1
        return self._knit_adapter(model).rows(seg.shared, seg.i)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """``Trainer.training_step`` with Accelerate's backward routed through the step's shared encoding."""
        k = self._knit
        if k.mode == "naive":
            return super().training_step(model, inputs, num_items_in_batch)
        accel = self.accelerator
        own = accel.__dict__.get("backward")
        original = accel.backward

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            seg = k.segment
            if seg is None or seg.rows_given != seg.i + 1:
                return original(loss, **kwargs)
            loss = loss / accel.gradient_accumulation_steps  # what Accelerator.backward does before its backward
            if accel.scaler is not None:
                loss = accel.scaler.scale(loss)
            seg.shared.backward(loss)  # the last micro-batch's backward also applies the encoder gradient
            seg.i += 1

        accel.backward = backward  # type: ignore[method-assign]
        try:
            out = super().training_step(model, inputs, num_items_in_batch)
        finally:
            if own is None:
                del accel.backward
            else:
                accel.backward = own  # type: ignore[method-assign]
        self._knit_after_microbatch()
        return out

    def _knit_after_microbatch(self) -> None:
        k = self._knit
        seg = k.segment
        last_of_step = bool(self.accelerator.sync_gradients)
        k.pos_in_gen += 1
        k.pos_in_step = 0 if last_of_step else k.pos_in_step + 1
        if seg is None:
            return
        if seg.i != seg.rows_given:
            seg.shared.__exit__(None, None, None)
            k.segment = None
            raise StateError(f"micro-batch {seg.i} of the shared encoding was handed rows but never backwarded")
        if seg.i == seg.k:
            seg.shared.__exit__(None, None, None)
            k.segment = None
        elif last_of_step:
            seg.shared.__exit__(None, None, None)
            k.segment = None
            raise StateError(
                f"the optimizer step ended after {seg.i} of the {seg.k} micro-batches its shared encoding expected: "
                "the encoder gradient was not applied (internal: the step's micro-batches were miscounted)"
            )

