"""TRL's VLM GRPO, training side per optimizer step: ``trl.GRPOTrainer`` alone vs knitdata's shared encoding.

Both variants run TRL's own training loop (``trainer.train()``) on a random-init Qwen2.5-VL built from a config
(nothing downloaded) with an in-memory dataset of prompts, each with its own random image; TRL generates
``group`` completions per prompt with the model's own ``generate``:

* ``trl``: ``trl.GRPOTrainer``: the image processor runs on every copy of a prompt's image, and the old-policy
  pass, the reference pass (``beta > 0``) and the gradient pass run the vision tower on every copy;
* ``knitdata``: :class:`knitdata.integrations.trl.SharedEncodingGRPOTrainer` (one line changed): each distinct
  image processed once per processor call, encoded once per no-grad pass and once per optimizer step with
  autograd (``fold``).

One generation batch spans two optimizer steps (``steps_per_generation = 2 x gradient_accumulation_steps``), so
TRL computes the old-policy log-probs; each optimizer step trains ``prompts`` prompts x ``group`` completions in two
micro-batches. Measured per generation cycle (two optimizer steps) with callbacks and the process CPU time (one
torch thread: robust on shared cores):

* ``generate_s``: TRL's generation (its ``_generate``, the processor's generation-side call included), reported
  beside the training side, not inside it;
* ``train_side_s``: the rest of the cycle per optimizer step: image processing for scoring, the no-grad passes,
  rewards and advantages, the gradient passes and the optimizer step;
* ``speedup``: ``trl`` over ``knitdata`` ``train_side_s`` (medians over the cycles of the a b b a runs);
* ``max_rel_grad_diff``: the largest per-parameter ``max |g - g_trl| / max |g_trl|`` at the first optimizer
  step (the two variants start from the same weights and seeds and train on the same completions).

The model (``config`` in the JSON) keeps the vision tower's share of the work close to a real VLM's, on the low
side: by a dense-layer FLOP count Qwen2.5-VL-3B spends about 55% (448 px) to 57% (896 px) of a row's forward in
its tower, the benchmark's model 38% (224 px) and 46% (448 px) (``vision_flop_share`` in the JSON).

Learning (``learning`` in the JSON; ``--no-learning`` skips it): a two-source task (``even`` rewards the share of
even tokens of a completion, ``low`` of tokens below half the vocabulary) on a random-init two-layer Qwen2, the same
weights and seeds, trained by ``trl.GRPOTrainer`` alone (one dataset mixing the sources in the quotas' proportions,
synchronous: staleness 0) and by ``AsyncGRPOTrainer`` with :class:`knitdata.integrations.trl.KnitdataRolloutWorker`
(each optimizer step holds exactly the quotas, within a staleness bound of 1 in TRL's versions): the mean reward of
every step, each source's share of every step, the worst staleness trained.

Presets: the default CPU run (groups 4, 8, 16 at 224 and 448 px; 40 learning steps), ``--smoke`` (seconds, for the
tests) and ``--gpu`` (Qwen2.5-VL-3B's widths and depths in bfloat16 on one CUDA device, 448 and 896 px).
"""

from __future__ import annotations

import os
import sys

if not __package__:  # ``python benchmarks/trl.py``: import the ``benchmarks`` package of this checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.common.output import write_json
from benchmarks.common.trl_vlm import (
    CPU_SHAPE,
    GPU_SHAPE,
    VLMShape,
    image_dataset,
    length_reward,
    tiny_model,
    tiny_processor,
)

__all__ = ["SpeedConfig", "vision_flop_share", "run_speed", "format_table", "add_arguments", "run"]

VARIANTS = ("trl", "knitdata")


@dataclass
class SpeedConfig:
    """What ``bench trl`` measures."""

    groups: tuple[int, ...] = (4, 8, 16)
    resolutions: tuple[int, ...] = (224, 448)
    prompts: int = 1  # prompts per optimizer step
    cycles: int = 1  # measured generation cycles (2 optimizer steps each) per run, after one warm-up cycle
    completion_tokens: int = 8
    beta: float = 0.04
    shape: VLMShape = CPU_SHAPE
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1

    @classmethod
    def smoke(cls) -> SpeedConfig:
        from benchmarks.common.trl_vlm import TEST_SHAPE

        return cls(groups=(4,), resolutions=(32,), cycles=1, completion_tokens=4, shape=TEST_SHAPE)

    @classmethod
    def gpu(cls) -> SpeedConfig:
        return cls(groups=(4, 8, 16), resolutions=(448, 896), prompts=2, cycles=2, completion_tokens=32,
                   shape=GPU_SHAPE, device="cuda", dtype="bfloat16", threads=4)


def vision_flop_share(shape: VLMShape, side: int, text_tokens: int = 40) -> float:
    """Estimated share of one row's forward FLOPs spent in the vision tower (dense layers, 12 d^2 per token and
    layer; the language model over the image's merged tokens plus ``text_tokens``)."""
    patches = (side // shape.patch) ** 2
    vision = shape.vision_depth * patches * 12 * shape.vision_hidden ** 2
    tokens = patches // shape.merge ** 2 + text_tokens
    text = shape.text_layers * tokens * 12 * shape.text_hidden ** 2
    return vision / (vision + text)


#: Qwen2.5-VL-3B (vision 32 x 1280, text 36 x 2048), for comparison in the JSON.
QWEN_3B = VLMShape(vision_depth=32, vision_hidden=1280, vision_heads=16, text_hidden=2048, text_layers=36,
                   text_heads=16, text_kv_heads=2)


class _Clock:
    """Process CPU time (CPU runs) or synchronized wall time (CUDA)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()


def _timed(base: type, clock: _Clock) -> tuple[type, type]:
    from transformers import TrainerCallback

    class Timed(base):  # type: ignore[misc, valid-type]
        """The trainer with its generation timed (TRL's private ``_generate``, timing only)."""

        def _generate(self, prompts):
            t = clock()
            try:
                return super()._generate(prompts)
            finally:
                self.bench["gen"] += clock() - t

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None

        def on_step_begin(self, args, state, control, **kwargs):
            b = self.trainer.bench
            if state.global_step % 2 == 0:
                b["t0"], b["gen"] = clock(), 0.0

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            b = self.trainer.bench
            if state.global_step == 0 and b.get("grads") is None:
                b["grads"] = {n: p.grad.detach().float().cpu().clone()
                              for n, p in self.trainer.model.named_parameters() if p.grad is not None}

        def on_step_end(self, args, state, control, **kwargs):
            b = self.trainer.bench
            if state.global_step % 2 == 0:
                total = clock() - b["t0"]
                b["cycles"].append({"cycle_s": total, "generate_s": b["gen"], "train_side_s": (total - b["gen"]) / 2})

    return Timed, Steps


def _quiet(trainer: Any) -> None:
    """No per-step log lines (Trainer prints its logs when the progress bar is off)."""
    from transformers.trainer_callback import PrinterCallback

    for cb in list(trainer.callback_handler.callbacks):
        if isinstance(cb, PrinterCallback):
            trainer.remove_callback(cb)


def _one_run(cfg: SpeedConfig, variant: str, group: int, side: int, workdir: str) -> dict[str, Any]:
    from trl import GRPOConfig, GRPOTrainer

    from knitdata.integrations.trl import SharedEncodingGRPOTrainer

    dtype = getattr(torch, cfg.dtype)
    clock = _Clock(cfg.device)
    model = tiny_model(cfg.shape, seed=0, dtype=dtype)
    path = os.path.join(workdir, "model")
    if not os.path.isdir(path):
        model.save_pretrained(path)
    model.config._name_or_path = path  # TRL builds the reference model from it (beta > 0)
    rows = cfg.prompts * group
    ga = 2
    n_prompts = cfg.prompts * 2 * (1 + cfg.cycles)  # a warm-up cycle, then the measured ones
    args = GRPOConfig(
        output_dir=os.path.join(workdir, f"out-{variant}"), per_device_train_batch_size=rows // ga,
        gradient_accumulation_steps=ga, steps_per_generation=2 * ga, num_generations=group,
        max_completion_length=cfg.completion_tokens, max_steps=2 * (1 + cfg.cycles), beta=cfg.beta,
        learning_rate=1e-6, max_grad_norm=0.0, logging_steps=10**6, report_to=[], save_strategy="no", seed=0,
        data_seed=0, bf16=cfg.dtype == "bfloat16", use_cpu=cfg.device == "cpu", shuffle_dataset=False,
        disable_tqdm=True,
    )
    base = GRPOTrainer if variant == "trl" else SharedEncodingGRPOTrainer
    timed, steps_cb = _timed(base, clock)
    steps = steps_cb()
    torch.manual_seed(0)
    trainer = timed(model=model, reward_funcs=length_reward, args=args, callbacks=[steps],
                    train_dataset=image_dataset(n_prompts, side, seed=1),
                    processing_class=tiny_processor(cfg.shape, max_pixels=side * side))
    _quiet(trainer)
    trainer.bench = {"cycles": [], "gen": 0.0}
    steps.trainer = trainer
    torch.manual_seed(0)
    trainer.train()
    cycles = trainer.bench["cycles"][1:]  # the first cycle warms up
    out: dict[str, Any] = {
        "variant": variant, "group": group, "resolution": side, "rows_per_step": rows, "cycles": cycles,
        "grads": trainer.bench.get("grads"),
    }
    if variant == "knitdata":
        out["shared_encoding_stats"] = asdict(trainer.shared_encoding_stats)
    return out


def _rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b)


def run_speed(cfg: SpeedConfig, progress: bool = True) -> dict[str, Any]:
    """Run every (group, resolution) in a b b a order (a = ``trl``, b = ``knitdata``) and summarize."""
    torch.set_num_threads(cfg.threads)
    load_before = list(os.getloadavg())
    results = []
    t_start = time.perf_counter()
    for side in cfg.resolutions:
        for group in cfg.groups:
            with tempfile.TemporaryDirectory() as workdir:
                runs = [_one_run(cfg, v, group, side, workdir) for v in ("trl", "knitdata", "knitdata", "trl")]
            per: dict[str, dict[str, list[float]]] = {v: {"train_side_s": [], "generate_s": []} for v in VARIANTS}
            for r in runs:
                for c in r["cycles"]:
                    per[r["variant"]]["train_side_s"].append(c["train_side_s"])
                    per[r["variant"]]["generate_s"].append(c["generate_s"])
            med = {v: {k: statistics.median(x) for k, x in d.items()} for v, d in per.items()}
            row = {
                "group": group, "resolution": side, "rows_per_step": runs[0]["rows_per_step"],
                "vision_flop_share": round(vision_flop_share(cfg.shape, side), 3),
                "train_side_s": {v: med[v]["train_side_s"] for v in VARIANTS},
                "generate_s": {v: med[v]["generate_s"] for v in VARIANTS},
                "samples": {v: per[v]["train_side_s"] for v in VARIANTS},
                "speedup": med["trl"]["train_side_s"] / med["knitdata"]["train_side_s"],
                "max_rel_grad_diff": _rel_diff(runs[1]["grads"], runs[0]["grads"]),
                "shared_encoding_stats": runs[1]["shared_encoding_stats"],
            }
            results.append(row)
            if progress:
                print(f"  group {group:2d} at {side} px: trl {row['train_side_s']['trl']:.3f} s, knitdata "
                      f"{row['train_side_s']['knitdata']:.3f} s per step ({row['speedup']:.2f}x), grad diff "
                      f"{row['max_rel_grad_diff']:.1e}", flush=True)
    accept = [r for r in results if r["group"] == 8 and r["resolution"] == max(cfg.resolutions)]
    return {
        "benchmark": "trl",
        "what": "TRL VLM GRPO training side per optimizer step (image processing, old-policy and reference "
                "passes, gradient pass, optimizer step; generation beside): trl.GRPOTrainer vs "
                "knitdata.integrations.trl.SharedEncodingGRPOTrainer",
        "timer": "process CPU time, one torch thread" if cfg.device == "cpu" else "wall time, cuda synchronized",
        "config": {**{k: v for k, v in asdict(cfg).items() if k != "shape"}, "model": cfg.shape.as_dict(),
                   "qwen2_5_vl_3b_vision_flop_share": {str(s): round(vision_flop_share(QWEN_3B, s), 3)
                                                       for s in (448, 896)}},
        "speed": results,
        "acceptance": {
            "group": 8, "resolution": max(cfg.resolutions),
            "speedup": accept[0]["speedup"] if accept else None,
            "max_rel_grad_diff": accept[0]["max_rel_grad_diff"] if accept else None,
            "passes": bool(accept) and accept[0]["speedup"] >= 2.0 and accept[0]["max_rel_grad_diff"] <= 1e-5,
        },
        "elapsed_s": time.perf_counter() - t_start,
        "loadavg_before": load_before,
        "loadavg_after": list(os.getloadavg()),
    }


# ------------------------------------------------------------------------------------------------ learning

LEARN_VOCAB, LEARN_SOURCES = 48, ("even", "low")


def _text_model(path: str) -> Any:
    """Save a random-init two-layer Qwen2 (hidden 32) and a word-level tokenizer to ``path``; return the tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, LEARN_VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                               bos_token="<bos>")
    cfg = transformers.Qwen2Config(vocab_size=LEARN_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return tok


def two_source_reward(completion_ids: list[list[int]], source: list[str], **kwargs: Any) -> list[float]:
    """``even``: the share of even tokens of a completion; ``low``: the share of tokens below half the vocabulary."""
    out = []
    for ids, s in zip(completion_ids, source):
        ids = [t for t in ids if t != 2] or [0]
        out.append(sum((t % 2 == 0) if s == "even" else (t < LEARN_VOCAB // 2) for t in ids) / len(ids))
    return out


@dataclass
class LearningConfig:
    """The two-source task of ``bench trl``'s learning part."""

    steps: int = 40
    quotas: tuple[int, int] = (8, 4)  # samples per optimizer step of "even" and "low"
    group: int = 4
    max_new_tokens: int = 6
    max_staleness: int = 1
    learning_rate: float = 1e-2
    seed: int = 0


def _learning_prompts(n: int) -> dict[str, list[str]]:
    gen = torch.Generator().manual_seed(1)
    return {s: [" ".join(f"w{int(t)}" for t in torch.randint(3, LEARN_VOCAB, (3,), generator=gen)) for _ in range(n)]
            for s in LEARN_SOURCES}


def _learn_trl(cfg: LearningConfig, workdir: str) -> dict[str, Any]:
    """``trl.GRPOTrainer`` on the two sources mixed in one dataset in the quotas' proportions (TRL's sampler draws the
    prompts, so each step's mix varies around them)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    path = os.path.join(workdir, "trl-model")
    tok = _text_model(path)
    per_step = sum(cfg.quotas)
    prompts = _learning_prompts(cfg.steps * per_step)
    # the dataset mixes the sources as the quotas do: q samples a step are q / group prompts a step
    rows = [(p, s) for s, q in zip(LEARN_SOURCES, cfg.quotas) for p in prompts[s][: cfg.steps * q // cfg.group]]
    steps: list[dict[str, Any]] = []

    def reward(completion_ids: list[list[int]], source: list[str], **kwargs: Any) -> list[float]:
        r = two_source_reward(completion_ids, source)
        steps.append({"sources": list(source), "rewards": r})
        return r

    args = GRPOConfig(output_dir=os.path.join(workdir, "trl-out"), per_device_train_batch_size=per_step // 2,
                      gradient_accumulation_steps=2, num_generations=cfg.group, max_completion_length=cfg.max_new_tokens,
                      max_steps=cfg.steps, learning_rate=cfg.learning_rate, use_cpu=True, bf16=False, report_to=[],
                      save_strategy="no", logging_steps=1, seed=cfg.seed, data_seed=cfg.seed, disable_tqdm=True,
                      temperature=1.0)
    torch.manual_seed(cfg.seed)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=reward,  # type: ignore[arg-type]
                          args=args,
                          processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": [p for p, _ in rows], "source": [s for _, s in rows]}))
    _quiet(trainer)
    trainer.train()
    out = []
    for i, st in enumerate(steps[: cfg.steps]):
        n = len(st["sources"])
        out.append({"step": i + 1, "reward": sum(st["rewards"]) / n,
                    "share": {s: st["sources"].count(s) / n for s in LEARN_SOURCES},
                    "reward_by_source": {s: statistics.fmean([r for r, x in zip(st["rewards"], st["sources"]) if x == s])
                                         for s in LEARN_SOURCES if s in st["sources"]},
                    "staleness": 0})
    return {"trainer": "trl.GRPOTrainer (synchronous; prompts of both sources in one dataset)", "steps": out}


def _learn_knitdata(cfg: LearningConfig, workdir: str) -> dict[str, Any]:
    """``AsyncGRPOTrainer`` fed by knitdata's rollout worker: per-source quotas per step, a hard staleness bound."""
    import warnings

    import transformers
    from datasets import Dataset
    warnings.filterwarnings("ignore", message=".*experimental.*")
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from knitdata import BatchSpec
    from knitdata.integrations.trl import HFGenerationEngine, KnitdataRolloutWorker, cpu_stand_ins

    path = os.path.join(workdir, "knit-model")
    tok = _text_model(path)
    per_step = sum(cfg.quotas)
    prompts = _learning_prompts(cfg.steps * per_step)
    spec = BatchSpec({s: 2 * q for s, q in zip(LEARN_SOURCES, cfg.quotas)}, num_minibatches=2, group_size=cfg.group)
    engine = HFGenerationEngine(transformers.AutoModelForCausalLM.from_pretrained(path), pad_token_id=0, eos_token_id=2)
    worker = KnitdataRolloutWorker(spec, prompts, engine, two_source_reward, processing_class=tok,
                                   max_new_tokens=cfg.max_new_tokens, chunk_tokens=3)
    args = AsyncGRPOConfig(output_dir=os.path.join(workdir, "knit-out"), per_device_train_batch_size=per_step // 2,
                           gradient_accumulation_steps=2, num_generations=cfg.group, max_steps=cfg.steps,
                           max_staleness=cfg.max_staleness, learning_rate=cfg.learning_rate, save_strategy="no",
                           use_cpu=True, report_to=[], logging_steps=1, seed=cfg.seed, token_budget=0,
                           weight_sync_steps=1, disable_tqdm=True)
    torch.manual_seed(cfg.seed)
    with cpu_stand_ins():
        trainer = AsyncGRPOTrainer(model=path, args=args, processing_class=tok,
                                   train_dataset=Dataset.from_dict({"prompt": prompts["even"] + prompts["low"]}),
                                   rollout_worker=worker,  # type: ignore[arg-type]  # TRL's protocol types its queues loosely
                                   weight_transfer=engine, callbacks=[worker.callback])
    _quiet(trainer)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "knitdata/staleness_max" in e]
    out = []
    for rec, log in zip(worker.history, logs):
        n = sum(rec.per_source.values())
        by = {s: log[f"knitdata/reward/{s}"] for s in LEARN_SOURCES if f"knitdata/reward/{s}" in log}
        out.append({"step": rec.step, "reward": sum(by.get(s, 0.0) * rec.per_source.get(s, 0) for s in LEARN_SOURCES) / n,
                    "share": {s: rec.per_source.get(s, 0) / n for s in LEARN_SOURCES}, "reward_by_source": by,
                    "staleness": rec.max_staleness})
    return {"trainer": "trl.experimental.async_grpo.AsyncGRPOTrainer + knitdata.integrations.trl.KnitdataRolloutWorker "
                       f"(quotas {dict(zip(LEARN_SOURCES, cfg.quotas))} per step, max_staleness {cfg.max_staleness})",
            "steps": out}


def run_learning(cfg: LearningConfig) -> dict[str, Any]:
    """Both runs of the two-source task, summarized (reward per step, share per source per step, worst staleness)."""
    with tempfile.TemporaryDirectory() as workdir:
        runs = {"trl": _learn_trl(cfg, workdir), "knitdata": _learn_knitdata(cfg, workdir)}
    for r in runs.values():
        steps = r["steps"]
        r["worst_staleness"] = max((s["staleness"] for s in steps), default=0)
        r["share_range"] = {s: {"min": min(x["share"][s] for x in steps), "max": max(x["share"][s] for x in steps)}
                            for s in LEARN_SOURCES}
        r["reward_first"] = statistics.fmean(s["reward"] for s in steps[:3])
        r["reward_last"] = statistics.fmean(s["reward"] for s in steps[-3:])
    want = {s: q / sum(cfg.quotas) for s, q in zip(LEARN_SOURCES, cfg.quotas)}
    return {
        "what": (f"Two sources (`even`: reward the share of even tokens; `low`: of tokens below half the vocabulary), "
                 f"a random-init two-layer Qwen2, {cfg.steps} optimizer steps of {sum(cfg.quotas)} samples "
                 f"({cfg.group} completions per prompt), same weights and seeds. TRL alone (synchronous `GRPOTrainer`) "
                 f"draws prompts from one dataset mixing the sources in the quotas' proportions; on knitdata "
                 f"(`AsyncGRPOTrainer` with `KnitdataRolloutWorker`) each step holds exactly {cfg.quotas[0]} `even` + {cfg.quotas[1]} `low` samples "
                 f"(share {want['even']:.2f} / {want['low']:.2f}) within a staleness bound of {cfg.max_staleness}."),
        "config": asdict(cfg), "target_share": want, "runs": runs,
    }


def format_table(report: dict[str, Any]) -> str:
    """The results as text: speed (medians, ratios), learning (reward, shares, staleness), load average."""
    lines = []
    if report.get("speed"):
        lines.append(f"{'group':>5} {'px':>4} {'trl s/step':>11} {'knitdata':>9} {'speedup':>8} {'gen trl':>8} "
                     f"{'gen knit':>8} {'grad diff':>9}")
        for r in report["speed"]:
            lines.append(f"{r['group']:5d} {r['resolution']:4d} {r['train_side_s']['trl']:11.3f} "
                         f"{r['train_side_s']['knitdata']:9.3f} {r['speedup']:7.2f}x {r['generate_s']['trl']:8.3f} "
                         f"{r['generate_s']['knitdata']:8.3f} {r['max_rel_grad_diff']:9.1e}")
    a = report.get("acceptance") or {}
    if a.get("speedup") is not None:
        lines.append(f"acceptance (group {a['group']}, {a['resolution']} px): {a['speedup']:.2f}x, grad diff "
                     f"{a['max_rel_grad_diff']:.1e}: {'pass' if a['passes'] else 'FAIL'} (>= 2x, <= 1e-5)")
    for name, r in ((report.get("learning") or {}).get("runs") or {}).items():
        shares = ", ".join(f"{s} {v['min']:.2f}-{v['max']:.2f}" for s, v in r["share_range"].items())
        lines.append(f"learning {name:9s}: reward {r['reward_first']:.3f} -> {r['reward_last']:.3f} over "
                     f"{len(r['steps'])} steps; share per step {shares}; worst staleness {r['worst_staleness']}")
    lines.append(f"load average before {report.get('loadavg_before')}, after {report.get('loadavg_after')}; "
                 f"{report.get('timer', '')}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Speed per resolution against the group size; learning: reward and the first source's share per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = sorted({r["resolution"] for r in report.get("speed") or []})
    runs = (report.get("learning") or {}).get("runs") or {}
    panels = len(sides) + (2 if runs else 0)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(4.6 * max(panels, 1), 3.6), squeeze=False)
    for ax, side in zip(axes[0], sides):
        rows = sorted((r for r in report["speed"] if r["resolution"] == side), key=lambda r: r["group"])
        groups = [r["group"] for r in rows]
        for v, style in (("trl", "o-"), ("knitdata", "s-")):
            ax.plot(groups, [r["train_side_s"][v] for r in rows], style,
                    label="TRL alone" if v == "trl" else "TRL + knitdata shared encoding")
        for r in rows:
            ax.annotate(f"{r['speedup']:.2f}x", (r["group"], r["train_side_s"]["knitdata"]),
                        textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(groups, [str(g) for g in groups])
        ax.set_xlabel("group size (completions per prompt)")
        ax.set_ylabel("training side per optimizer step (s)")
        ax.set_title(f"VLM GRPO, {side} px images (CPU)", fontsize=9)
        ax.legend(fontsize=7)
    if runs:
        ax_r, ax_s = axes[0][len(sides)], axes[0][len(sides) + 1]
        first = next(iter(report["learning"].get("target_share") or {"": 0}))
        for name, r in runs.items():
            steps = [s["step"] for s in r["steps"]]
            label = "TRL alone" if name == "trl" else "TRL on knitdata"
            ax_r.plot(steps, [s["reward"] for s in r["steps"]], label=label)
            ax_s.plot(steps, [s["share"].get(first, 0.0) for s in r["steps"]], label=label)
        ax_r.set_xlabel("optimizer step")
        ax_r.set_ylabel("mean reward of the step")
        ax_r.set_title("two-source task: reward", fontsize=9)
        ax_r.legend(fontsize=7)
        ax_s.axhline(report["learning"]["target_share"].get(first, 0.0), color="grey", lw=0.8, ls="--")
        ax_s.set_xlabel("optimizer step")
        ax_s.set_ylabel(f"share of source '{first}' in the step")
        ax_s.set_ylim(0, 1)
        ax_s.set_title("two-source task: per-step share (dashed: quota)", fontsize=9)
        ax_s.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m benchmarks trl``."""
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write the plot (PNG)")
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--smoke", action="store_true", help="a tiny model, one group size, seconds (tests)")
    preset.add_argument("--gpu", action="store_true", help="Qwen2.5-VL-3B's shape in bf16 at 448 and 896 px on one GPU")
    parser.add_argument("--groups", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                        help="comma-separated group sizes (default 4,8,16)")
    parser.add_argument("--resolutions", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                        help="comma-separated image sides in pixels (default 224,448)")
    parser.add_argument("--cycles", type=int, default=None, help="measured generation cycles per run")
    parser.add_argument("--learning-steps", type=int, default=None, help="optimizer steps of the learning part")
    parser.add_argument("--no-learning", action="store_true", help="skip the learning part")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed part")


def preset(args: argparse.Namespace) -> SpeedConfig:
    """The configuration the arguments select."""
    cfg = SpeedConfig.smoke() if args.smoke else SpeedConfig.gpu() if args.gpu else SpeedConfig()
    if args.groups:
        cfg.groups = args.groups
    if args.resolutions:
        cfg.resolutions = args.resolutions
    if args.cycles:
        cfg.cycles = args.cycles
    return cfg


def run(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks trl``; print the table and write JSON (and the plot)."""
    cfg = preset(args)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("--gpu needs a CUDA device")
        return 2
    report: dict[str, Any] = (run_speed(cfg) if not args.no_speed
                              else {"benchmark": "trl", "speed": [], "acceptance": {}})
    if not args.no_learning:
        lcfg = LearningConfig(steps=2) if args.smoke else LearningConfig()
        if args.learning_steps:
            lcfg.steps = args.learning_steps
        t = time.perf_counter()
        report["learning"] = run_learning(lcfg)
        report["learning"]["elapsed_s"] = time.perf_counter() - t
        report["loadavg_after"] = list(os.getloadavg())
    print(format_table(report))
    if args.json:
        write_json(args.json, report, indent=1)
    if getattr(args, "plot", None):
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    from benchmarks.common.cli import run_script

    sys.exit(run_script("trl"))
