"""TRL's ``AsyncGRPOTrainer`` trained from a knitdata pipeline: two sources, quotas per optimizer step, a hard
staleness bound in TRL's versions, partial rollouts, and resume with TRL's own checkpoints (docs/trl.md).

CPU, a tiny random-init ``Qwen2ForCausalLM`` and a hand-built word-level tokenizer (nothing downloaded)::

    python examples/trl_async_grpo.py --output-dir out/trl --max-steps 8 --save-steps 2 --record out/trl/steps.jsonl
    python examples/trl_async_grpo.py --output-dir out/trl --max-steps 8 --save-steps 2 --record out/trl/steps.jsonl \\
        --resume out/trl/checkpoint-4

Only the lines marked ``# knitdata`` differ from a plain ``AsyncGRPOTrainer`` script (plus the CPU stand-ins, which
a GPU run leaves out). ``--record`` appends one JSON line per optimizer step: TRL's step, the trajectory ids the
trainer read for it, each source's count, its staleness in TRL's versions, and the groups TRL's own collator
counted as trained by then.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from typing import Any

import torch

warnings.filterwarnings("ignore", message=".*experimental.*")

VOCAB, PAD, BOS, EOS = 48, 0, 1, 2
#: Two tasks: "even" rewards even response tokens, "low" tokens below VOCAB // 2.
SOURCES = ("even", "low")


def tiny_model_and_tokenizer(path: str) -> Any:
    """Save a random-init two-layer Qwen2 (hidden 32) and a WordLevel tokenizer to ``path``; return the tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                               bos_token="<bos>")
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return tok


def reward(completion_ids: list[list[int]], source: list[str], **kwargs: Any) -> list[float]:
    """Share of even tokens ("even") or of tokens below VOCAB // 2 ("low") in each completion."""
    out = []
    for ids, s in zip(completion_ids, source):
        ids = [t for t in ids if t != EOS] or [0]
        out.append(sum((t % 2 == 0) if s == "even" else (t < VOCAB // 2) for t in ids) / len(ids))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--save-steps", type=int, default=2)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--resume", default=None, help="a checkpoint-N folder of --output-dir")
    ap.add_argument("--record", default=None, help="append one JSON line per optimizer step")
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=3, help="tokens per generation round (partial rollouts)")
    ap.add_argument("--gen-delay", type=float, default=0.0, help="seconds added to each generation round")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step")
    args = ap.parse_args(argv)

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from knitdata import BatchSpec  # knitdata
    from knitdata.integrations.trl import HFGenerationEngine, KnitdataRolloutWorker, cpu_stand_ins  # knitdata

    model_dir = os.path.join(tempfile.mkdtemp(prefix="trl-tiny-"), "model")
    tok = tiny_model_and_tokenizer(model_dir)
    gen = torch.Generator().manual_seed(1)
    prompts = {s: [" ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (3,), generator=gen)) for _ in range(64)]
               for s in SOURCES}
    dataset = Dataset.from_dict({"prompt": prompts["even"] + prompts["low"]})

    import transformers

    spec = BatchSpec({"even": 8, "low": 4}, num_minibatches=2, group_size=2)  # knitdata: 6 samples per step, 4 + 2
    engine = HFGenerationEngine(transformers.AutoModelForCausalLM.from_pretrained(model_dir),  # knitdata
                                pad_token_id=PAD, eos_token_id=EOS)
    if args.gen_delay:  # a slower engine, as a real one is next to the trainer: weight syncs land mid-generation
        generate = engine.generate

        def slow_generate(*a: Any, **kw: Any) -> Any:
            time.sleep(args.gen_delay)
            return generate(*a, **kw)

        engine.generate = slow_generate  # type: ignore[method-assign]
    worker = KnitdataRolloutWorker(spec, prompts, engine, reward, processing_class=tok,  # knitdata
                                   max_new_tokens=args.max_new_tokens, chunk_tokens=args.chunk_tokens)

    config = AsyncGRPOConfig(output_dir=args.output_dir, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                             num_generations=2, max_steps=args.max_steps, max_staleness=args.max_staleness,
                             learning_rate=1e-3, save_strategy="steps", save_steps=args.save_steps, use_cpu=True,
                             report_to=[], logging_steps=1, seed=0,
                             token_budget=0, weight_sync_steps=1)  # knitdata: fixed-count batches, one version a step

    class Record(TrainerCallback):
        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            rec = worker.history[state.global_step - worker.history[0].step]
            if args.record:
                line = {"step": state.global_step, "ids": rec.trajectory_ids, "per_source": rec.per_source,
                        "staleness": rec.max_staleness, "trained_version": rec.trained_version,
                        "read_staleness": max(v - g for v, g in zip(rec.read_versions, rec.gen_versions)),
                        "gen_versions": rec.gen_versions, "spans": rec.token_version_spans, "pid": os.getpid(),
                        "trl_groups": sorted(trainer._trained_groups),  # TRL's own count (a private set, read only)
                        "groups": sorted({worker_group(t) for t in rec.trajectory_ids})}
                with open(args.record, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")
            time.sleep(args.step_sleep)

    def worker_group(tid: str) -> int:
        return worker.group_id(tid)

    with cpu_stand_ins():  # CPU only: no FlashAttention-3 kernel from the hub, no CUDA device name
        trainer = AsyncGRPOTrainer(model=model_dir, args=config, train_dataset=dataset, processing_class=tok,
                                   rollout_worker=worker, weight_transfer=engine,  # knitdata
                                   callbacks=[worker.callback, Record()])  # knitdata: worker.callback
    trainer.train(resume_from_checkpoint=args.resume)


if __name__ == "__main__":
    main()
