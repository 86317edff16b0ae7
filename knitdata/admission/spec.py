"""The batch specification (quotas, mini-batches, group size, bounds) and what admission emits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from knitdata.errors import ConfigError
from knitdata.record import TrajectoryMeta

__all__ = ["BatchSpec", "AdmittedMiniBatch"]


@dataclass(frozen=True)
class BatchSpec:
    """Shape of a train batch: per-source quotas, mini-batch count, group size and optional bounds.

    Attributes:
        quotas: Trajectories per source per train batch (their sum is ``B``).
        num_minibatches: ``M``, the number of mini-batches (optimizer steps) per train batch.
        group_size: Trajectories per group; groups are admitted whole.
        bounds: Optional per-mini-batch ``(lo, hi)`` trajectory counts per source. Sources without an
            entry get ``(0, m)``. Bounds are rounded inward to whole groups.

    Raises:
        ConfigError: Quotas that do not sum to a positive multiple of ``M``, a quota or ``m`` that is not
            a multiple of the group size, or bounds that cannot be met (they cannot sum to ``m``, or a
            source's quota cannot be split into ``M`` mini-batches within its bounds).
    """

    quotas: Mapping[str, int]
    num_minibatches: int
    group_size: int = 1
    bounds: Mapping[str, tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.quotas, Mapping) or not self.quotas:
            raise ConfigError("BatchSpec.quotas must be a non-empty mapping {source: trajectories per train batch}")
        quotas: dict[str, int] = {}
        for s, q in self.quotas.items():
            if not isinstance(s, str) or not s:
                raise ConfigError(f"BatchSpec.quotas: source names must be non-empty strings, got {s!r}")
            if isinstance(q, bool) or not isinstance(q, int) or q < 0:
                raise ConfigError(f"BatchSpec.quotas[{s!r}] must be a non-negative int, got {q!r}")
            quotas[s] = int(q)
        M, g = self.num_minibatches, self.group_size
        if isinstance(M, bool) or not isinstance(M, int) or M < 1:
            raise ConfigError(f"BatchSpec.num_minibatches must be an int >= 1, got {M!r}")
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ConfigError(f"BatchSpec.group_size must be an int >= 1, got {g!r}")
        B = sum(quotas.values())
        if B == 0 or B % M:
            raise ConfigError(
                f"BatchSpec: quotas sum to {B}, which is not a positive multiple of num_minibatches={M}; "
                f"adjust the quotas so that B = M * m"
            )
        m = B // M
        for s, q in quotas.items():
            if q % g:
                raise ConfigError(
                    f"BatchSpec: quota of source {s!r} is {q}, not a multiple of group_size={g}; "
                    f"groups are admitted whole, so use a multiple of {g}"
                )
        if m % g:
            raise ConfigError(
                f"BatchSpec: mini-batch size m = B / M = {B} / {M} = {m} is not a multiple of group_size={g}; "
                f"change B or M so that whole groups fill each mini-batch"
            )
        bounds: dict[str, tuple[int, int]] = {}
        if self.bounds is not None:
            for s, b in self.bounds.items():
                if s not in quotas:
                    raise ConfigError(
                        f"BatchSpec.bounds names source {s!r} which has no quota; known: {sorted(quotas)}"
                    )
                try:
                    lo, hi = (int(b[0]), int(b[1]))
                except (TypeError, ValueError, IndexError) as e:
                    raise ConfigError(f"BatchSpec.bounds[{s!r}] must be a pair (lo, hi) of ints, got {b!r}") from e
                if lo < 0 or hi < lo:
                    raise ConfigError(f"BatchSpec.bounds[{s!r}] = ({lo}, {hi}) must satisfy 0 <= lo <= hi")
                lo_g, hi_g = -(-lo // g), min(hi, m) // g
                if lo_g > hi_g:
                    raise ConfigError(
                        f"BatchSpec.bounds[{s!r}] = ({lo}, {hi}) contains no whole number of groups of size {g}; "
                        f"widen it to include a multiple of {g}"
                    )
                if M * lo_g * g > quotas[s] or M * hi_g * g < quotas[s]:
                    raise ConfigError(
                        f"BatchSpec: source {s!r} has quota {quotas[s]} but its per-mini-batch bounds "
                        f"({lo}, {hi}) (in whole groups: {lo_g * g}..{hi_g * g}) allow only "
                        f"{M * lo_g * g}..{M * hi_g * g} over {M} mini-batches; widen the bounds or change the quota"
                    )
                bounds[s] = (lo, hi)
        object.__setattr__(self, "quotas", dict(sorted(quotas.items())))
        object.__setattr__(self, "bounds", dict(sorted(bounds.items())) if self.bounds is not None else None)
        lo_sum = sum(self.group_bounds(s)[0] for s in quotas) * g
        hi_sum = sum(self.group_bounds(s)[1] for s in quotas) * g
        if not lo_sum <= m <= hi_sum:
            raise ConfigError(
                f"BatchSpec: per-mini-batch bounds sum to {lo_sum}..{hi_sum} (in whole groups), which cannot "
                f"make a mini-batch of m = {m}; widen the bounds"
            )

    @property
    def batch_size(self) -> int:
        """``B``: trajectories per train batch."""
        return sum(self.quotas.values())

    @property
    def minibatch_size(self) -> int:
        """``m = B / M``: trajectories per mini-batch."""
        return self.batch_size // self.num_minibatches

    @property
    def sources(self) -> tuple[str, ...]:
        """Source names, sorted."""
        return tuple(self.quotas)

    def group_bounds(self, source: str) -> tuple[int, int]:
        """Per-mini-batch bounds of ``source`` in whole groups (rounded inward)."""
        g, m = self.group_size, self.minibatch_size
        if self.bounds is None or source not in self.bounds:
            return 0, m // g
        lo, hi = self.bounds[source]
        return -(-lo // g), min(hi, m) // g

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serializable dict."""
        return {
            "quotas": dict(self.quotas),
            "num_minibatches": self.num_minibatches,
            "group_size": self.group_size,
            "bounds": None if self.bounds is None else {s: list(b) for s, b in self.bounds.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BatchSpec:
        """Inverse of :meth:`to_dict`."""
        bounds = d.get("bounds")
        return cls(
            quotas={str(k): int(v) for k, v in d["quotas"].items()},
            num_minibatches=int(d["num_minibatches"]),
            group_size=int(d.get("group_size", 1)),
            bounds=None if bounds is None else {str(k): (int(v[0]), int(v[1])) for k, v in bounds.items()},
        )


@dataclass(frozen=True)
class AdmittedMiniBatch:
    """One admitted mini-batch.

    Attributes:
        train_batch: ``b``, 0-based train batch index.
        index: ``k``, 0-based index within the train batch (``0..M-1``).
        step: Global mini-batch counter ``b * M + k``.
        trajectories: Exactly ``m`` trajectories, whole groups, in admission order.
        admitted_at: The ``now`` passed to :meth:`AdmissionPolicy.poll`, if any.
        group_sizes: How many trajectories each of those groups has, in order (empty: not given). The
            planner takes its assignment units from it instead of scanning every trajectory's group id.
    """

    train_batch: int
    index: int
    step: int
    trajectories: tuple[TrajectoryMeta, ...]
    admitted_at: float | None = None
    group_sizes: tuple[int, ...] = ()

    def counts(self) -> dict[str, int]:
        """Trajectories per source in this mini-batch."""
        out: dict[str, int] = {}
        for t in self.trajectories:
            out[t.source] = out.get(t.source, 0) + 1
        return out
