"""``SharedEncodingGRPOTrainer`` against TRL's own ``GRPOTrainer`` on a tiny random-init Qwen2.5-VL (CPU, offline).

One GRPO run of each on the same data and seeds: the no-grad passes' log-probs, every micro-batch's loss and every
parameter gradient of each optimizer step agree within 1e-5 relative; the vision tower encodes each distinct image
once per pass (counted on the towers themselves) and the image processor processes each distinct image once.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from benchmarks.common.trl_vlm import image_dataset, length_reward, tiny_model, tiny_processor  # noqa: E402
from knitdata.errors import ConfigError  # noqa: E402
from knitdata.integrations.trl.vlm import (  # noqa: E402
    GENERATION_KEY,
    ITEMS_KEY,
    DedupImageProcessor,
    SharedEncodingGRPOTrainer,
)

PROMPTS, GROUP = 4, 4


class _Record:
    """What one run saw: tower calls per phase, losses, gradients per optimizer step, the no-grad log-probs."""

    def __init__(self) -> None:
        self.tower = {"generate": [], "nograd": [], "grad": []}  # images per tower call
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.logps: list[dict[str, torch.Tensor]] = []
        self.phase = "other"


def _recording(base: type) -> type:
    class Recording(base):  # type: ignore[misc, valid-type]
        def _generate(self, prompts):
            self.rec.phase = "generate"
            try:
                return super()._generate(prompts)
            finally:
                self.rec.phase = "nograd"

        def _generate_and_score_completions(self, inputs):
            self.rec.phase = "nograd"
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                self.rec.phase = "other"
            self.rec.logps.append({k: out[k].detach().clone() for k in ("old_per_token_logps", "ref_per_token_logps")
                                   if out.get(k) is not None})
            return out

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.rec.losses.append(float(loss))
            return loss

    return Recording


class _Grads(TrainerCallback):
    def __init__(self, rec: _Record) -> None:
        self.rec, self.trainer = rec, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.rec.grads.append({n: p.grad.detach().clone() for n, p in self.trainer.model.named_parameters()
                               if p.grad is not None})


def _hook_tower(model, rec: _Record) -> None:
    def count(module, args, kwargs):
        grid = kwargs.get("grid_thw")
        phase = "grad" if torch.is_grad_enabled() else rec.phase
        rec.tower.setdefault(phase, []).append(int(grid.shape[0]))

    model.model.visual.register_forward_pre_hook(count, with_kwargs=True)


def _run(cls: type, tmp_path, tag: str, trainer_kwargs: dict | None = None, **config):
    rec = _Record()
    model = tiny_model(seed=0)
    path = tmp_path / f"model-{tag}"
    model.save_pretrained(path)
    model.config._name_or_path = str(path)  # TRL builds the reference model from it when beta != 0
    processor = tiny_processor()
    args = GRPOConfig(
        output_dir=str(tmp_path / f"out-{tag}"), per_device_train_batch_size=4, num_generations=GROUP,
        max_completion_length=6, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        seed=0, data_seed=0, bf16=False, **config,  # TRL defaults to bf16 autocast: rounding-level differences
    )
    grads = _Grads(rec)
    torch.manual_seed(0)
    trainer = _recording(cls)(model=model, reward_funcs=length_reward, args=args, callbacks=[grads],
                              train_dataset=image_dataset(PROMPTS, (24, 32)), processing_class=processor,
                              **(trainer_kwargs or {}))
    trainer.rec, grads.trainer = rec, trainer
    _hook_tower(trainer.model, rec)
    if trainer.ref_model is not None:
        _hook_tower(trainer.ref_model, rec)
    torch.manual_seed(0)
    trainer.train()
    return trainer, rec


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_one_generation_two_optimizer_steps_match_trl_with_each_image_encoded_once(tmp_path):
    # 4 prompts x 4 generations = 16 rows generated once, trained as 2 optimizer steps of 2 micro-batches of 4;
    # the old-policy pass runs (generation spans steps) and the reference pass too (beta > 0)
    # (SGD: Adam's first steps move every weight by about +-lr whatever its gradient's size, so rounding-level
    # gradient differences would become visible weight differences in the second step)
    config = dict(gradient_accumulation_steps=2, steps_per_generation=4, max_steps=2, beta=0.04, entropy_coef=0.05,
                  optim="sgd", learning_rate=0.05)
    trl_trainer, trl = _run(GRPOTrainer, tmp_path, "trl", **config)
    knit_trainer, knit = _run(SharedEncodingGRPOTrainer, tmp_path, "knit", **config)

    assert len(trl.logps) == len(knit.logps) == 1
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        assert _rel(knit.logps[0][key], trl.logps[0][key]) < 1e-5, key
    assert len(trl.losses) == len(knit.losses) == 4
    for a, b in zip(knit.losses, trl.losses):
        assert abs(a - b) <= 1e-5 * max(abs(b), 1e-3), (knit.losses, trl.losses)
    assert len(trl.grads) == len(knit.grads) == 2
    for step, (gk, gt) in enumerate(zip(knit.grads, trl.grads)):
        assert gk.keys() == gt.keys()
        assert any(n.startswith("model.visual") for n in gt)  # the tower is trained
        for name in gt:
            assert _rel(gk[name], gt[name]) < 1e-5, (step, name, _rel(gk[name], gt[name]))

    # TRL alone: every copy; old pass 16 images in 4 chunks, ref pass the same, 4 images per micro-batch
    rows = PROMPTS * GROUP
    assert sum(trl.tower["nograd"]) == 2 * rows
    assert trl.tower["grad"] == [4, 4, 4, 4]
    # shared: one tower call per pass with the 4 distinct images; one per optimizer step with autograd
    assert knit.tower["nograd"] == [PROMPTS, PROMPTS]
    assert knit.tower["grad"] == [PROMPTS, PROMPTS]
    stats = knit_trainer.shared_encoding_stats
    assert stats.fallbacks == 0 and stats.segments == 2
    assert stats.encoded_grad == 2 * PROMPTS and stats.occurrences_grad == rows  # each row trained once
    assert stats.encoded_nograd == 2 * PROMPTS and stats.occurrences_nograd == 2 * rows
    assert stats.images_processed * GROUP == stats.images_in  # generation's processing and scoring's: once each
    assert trl_trainer.processing_class.image_processor is not None


def test_default_config_trains_and_evaluates_with_one_encode_per_step(tmp_path):
    # TRL's defaults: one generation per optimizer step (steps_per_generation = gradient_accumulation_steps), beta 0
    trainer, rec = _run(SharedEncodingGRPOTrainer, tmp_path, "default", gradient_accumulation_steps=2, max_steps=2,
                        per_device_eval_batch_size=8)
    assert trainer.state.global_step == 2
    assert rec.tower["grad"] == [2, 2]  # 2 prompts per step (8 rows), each image encoded once with autograd
    assert rec.tower["nograd"] == []  # no old-policy or reference pass in this configuration
    stats = trainer.shared_encoding_stats
    assert stats.segments == 2 and stats.fallbacks == 0
    assert all(torch.isfinite(torch.tensor(x)) for x in rec.losses)
    assert not isinstance(trainer.processing_class.image_processor, DedupImageProcessor)  # swapped only while scoring

    # evaluation: each micro-batch's distinct images encoded once, without autograd (8 rows: 2 prompts x 4)
    before = stats.encoded_nograd
    metrics = trainer.evaluate(eval_dataset=image_dataset(2, 24, seed=5))
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    assert stats.fallbacks == 0 and stats.encoded_nograd - before == 2
    assert rec.tower["nograd"] == [] and rec.tower.get("other") == [2]  # no old/ref pass; the loss: one call


def test_naive_mode_is_trls_own_path(tmp_path):
    trainer, rec = _run(SharedEncodingGRPOTrainer, tmp_path, "naive", gradient_accumulation_steps=2, max_steps=1,
                        trainer_kwargs={"shared_encoding": "naive"})
    assert rec.tower["grad"] == [4, 4]  # every copy, per micro-batch, as TRL alone
    assert trainer.shared_encoding_stats == type(trainer.shared_encoding_stats)()


def test_dedup_image_processor_output_equals_the_processors():
    proc = tiny_processor()
    dedup = DedupImageProcessor(proc.image_processor)
    ds = image_dataset(2, (24, 32))
    a, b = ds[0]["image"], ds[1]["image"]
    imgs = [[a], [b], [a.copy()], [a]]  # equal pixels in another object count as the same image
    out = dedup(imgs, return_tensors="pt")
    ref = proc.image_processor(imgs, return_tensors="pt")
    assert torch.equal(out["pixel_values"], ref["pixel_values"])
    assert torch.equal(out["image_grid_thw"], ref["image_grid_thw"])
    assert dedup.last_table.num_items == 2 and dedup.last_index.tolist() == [0, 1, 0, 0]
    assert dedup.stats.images_in == 4 and dedup.stats.images_processed == 2
    assert dedup.merge_size == proc.image_processor.merge_size  # other attributes are the processor's
    plain = dedup(imgs)  # not return_tensors="pt": the processor's own call
    assert dedup.last_table is None and len(plain["image_grid_thw"]) == 4
    assert {ITEMS_KEY, GENERATION_KEY}.isdisjoint(out.keys())


def test_bad_configurations_are_refused(tmp_path):
    model = tiny_model(seed=0)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=GROUP,
                      report_to=[], use_cpu=True)
    with pytest.raises(ConfigError, match="shared_encoding must be one of"):
        SharedEncodingGRPOTrainer(model=model, reward_funcs=length_reward, args=args,
                                  train_dataset=image_dataset(4, 24), processing_class=tiny_processor(),
                                  shared_encoding="twice")
    with pytest.raises(ConfigError, match="vision-language"):
        SharedEncodingGRPOTrainer(model=model, reward_funcs=length_reward, args=args,
                                  train_dataset=image_dataset(4, 24), processing_class=tiny_processor().tokenizer)
