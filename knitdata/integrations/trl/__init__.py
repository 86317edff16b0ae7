"""TRL 1.16 on knitdata (``pip install 'knitdata[trl]'``): see docs/trl.md "Use with TRL".

* :class:`~knitdata.integrations.trl.worker.KnitdataRolloutWorker`: a rollout worker for
  ``trl.experimental.async_grpo.AsyncGRPOTrainer(rollout_worker=...)`` whose samples come from a knitdata pipeline
  (per-source quotas per optimizer step, the hard staleness bound in TRL's model versions, partial rollouts
  continued across weight updates, exact resume with the trainer's checkpoint).
"""

from __future__ import annotations

from knitdata.errors import OptionalDependencyError

try:
    import trl as _trl  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by tests/test_integrations_trl.py with trl hidden
    raise OptionalDependencyError("trl", "trl", "knitdata.integrations.trl") from e

__all__: list[str] = []
