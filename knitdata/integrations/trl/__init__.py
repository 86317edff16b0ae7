"""TRL 1.16 on knitdata (``pip install 'knitdata[trl]'``): see docs/trl.md "Use with TRL".

* :class:`~knitdata.integrations.trl.worker.KnitdataRolloutWorker`: a rollout worker for
  ``trl.experimental.async_grpo.AsyncGRPOTrainer(rollout_worker=...)`` whose samples come from a knitdata pipeline
  (per-source quotas per optimizer step, the hard staleness bound in TRL's model versions, partial rollouts
  continued across weight updates, exact resume with the trainer's checkpoint);
* :class:`~knitdata.integrations.trl.engine.HFGenerationEngine`: ``generate`` on a local policy copy that is also
  the trainer's ``weight_transfer`` (a CPU stand-in for the vLLM server);
* :func:`~knitdata.integrations.trl.cpu.cpu_stand_ins`: the two stand-ins ``AsyncGRPOTrainer`` needs without CUDA.
* :class:`~knitdata.integrations.trl.vlm.SharedEncodingGRPOTrainer`: ``trl.GRPOTrainer`` for vision-language
  models with each prompt's image processed once and encoded once per step (no-grad passes and gradient pass).
"""

from __future__ import annotations

from knitdata.errors import OptionalDependencyError

try:
    import trl as _trl  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by tests/test_integrations_trl.py with trl hidden
    raise OptionalDependencyError("trl", "trl", "knitdata.integrations.trl") from e

from knitdata.integrations.trl.cpu import cpu_stand_ins, reference_tree_attention  # noqa: E402
from knitdata.integrations.trl.engine import HFGenerationEngine  # noqa: E402
from knitdata.integrations.trl.vlm import DedupImageProcessor, SharedEncodingGRPOTrainer, SharedEncodingStats  # noqa: E402
from knitdata.integrations.trl.worker import (  # noqa: E402
    STATE_FILE,
    GenerationEngine,
    KnitdataRolloutWorker,
    KnitdataTRLCallback,
    StepRecord,
    trained_prompts,
)

__all__: list[str] = [
    "KnitdataRolloutWorker",
    "KnitdataTRLCallback",
    "GenerationEngine",
    "HFGenerationEngine",
    "StepRecord",
    "STATE_FILE",
    "trained_prompts",
    "cpu_stand_ins",
    "reference_tree_attention",
    "SharedEncodingGRPOTrainer",
    "SharedEncodingStats",
    "DedupImageProcessor",
]
