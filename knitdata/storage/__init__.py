"""Storage units: where trajectory payloads live between rollout and training."""
