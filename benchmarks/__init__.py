"""knitdata's benchmarks, the admission simulator and the demo: drivers that use only knitdata's public API.

This folder is a package of the repository, not of the wheel: run it from a checkout with
``python -m benchmarks <name> [options]`` (or ``python -m benchmarks demo``; ``knitdata bench <name>`` and
``knitdata demo`` forward here when the checkout is importable), or a driver as a script,
``python benchmarks/<name>.py [options]``, which writes ``benchmarks/results/<name>.json`` (and ``.png``) by default.

Layout:

* one driver module per benchmark (:data:`BENCHMARKS`), each with ``add_arguments(parser)`` and ``run(args)``;
* :mod:`benchmarks.sim` (the seeded admission simulator) and :mod:`benchmarks.demo` (the end-to-end demo);
* :mod:`benchmarks.common`: what several drivers share (toy models, the transferqueue baseline, the consumer
  harness and worker pool, result output);
* ``report.py`` renders the README figures from ``results/*.json``; ``cuda_check.py`` and
  ``planner_before_after.py`` are stand-alone scripts.

Importing this package is cheap (no torch): the drivers load only when a command names them.
"""

from __future__ import annotations

__all__ = ["BENCHMARKS", "DEMO"]

#: Benchmark name -> (module, one-line help).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "admission": ("benchmarks.admission", "architectural staleness and quota violations per admission policy"),
    "transfer": ("benchmarks.transfer", "exposed transfer latency and step time: transferqueue, sample, eager, iter (--compute accel|cpu)"),
    "encode": ("benchmarks.encode", "duplicated vs deduplicated multimodal encoding"),
    "loader": ("benchmarks.loader", "loader overhead vs a plain torch DataLoader, and memcpy bandwidth"),
    "placement": ("benchmarks.placement", "cross-node bytes: consumer-aware placement vs index-mod-units (Ray)"),
    "soak": ("benchmarks.soak", "sustained load: throughput, memory high-water, lost/duplicated"),
    "learning": ("benchmarks.learning", "held-out reward per step of a small RL task trained through knitdata, per admission"),
    "vlm": ("benchmarks.vlm", "shared encoding on Qwen2.5-VL / Qwen2-Audio: model's own path vs fold/leaf/recompute"),
    "control": ("benchmarks.control", "control-plane throughput, put latency, commit cost; --scale: planning at cluster scale"),
    "journal": ("benchmarks.journal", "control-plane journal with and without compaction: bytes, restart time"),
    "agent": ("benchmarks.agent", "multi-turn visual agent episodes: screenshots stored, moved, encoded once vs per-trajectory copies"),
    "trl": ("benchmarks.trl", "TRL VLM GRPO training side per step: GRPOTrainer alone vs knitdata's shared encoding"),
}

#: The demo: (module, one-line help).
DEMO: tuple[str, str] = ("benchmarks.demo", "run the end-to-end demo on the embedded engine (no servers)")
