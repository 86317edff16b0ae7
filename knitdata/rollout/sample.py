"""One generated response (:class:`RolloutSample`) and one request's responses (:class:`RolloutGroup`).

Every adapter of :mod:`knitdata.rollout` (vLLM, SGLang, OpenAI-compatible, Hugging Face ``generate``) turns an
engine's output into a :class:`RolloutGroup`: one request with ``n`` samples is one group (GRPO's ``n`` responses
to one prompt). A sample holds the token ids, the behaviour log-probs, the status (completed / truncated /
aborted), the policy version and, where the adapter knows them, a loss mask, per-token versions, extra tensors
and media; construction checks that every per-token field has the response's length and raises
:class:`~knitdata.errors.RolloutOutputError` naming the request, the sample and the field otherwise.

:meth:`RolloutGroup.trajectories` turns the group into :class:`~knitdata.record.Trajectory` records ready for
``Pipeline.put``: the log-probs become ``tensors["old_logprobs"]``, the version ``gen_version`` (the oldest one
when the tokens carry several: ``token_versions``). An aborted sample is refused there: continue it
(:class:`~knitdata.rollout.partial.SegmentBuffer`) or withdraw its group.

Example:
    >>> s = RolloutSample("req-7", 0, prompt_ids=[1, 2], response_ids=[5, 6, 2], logprobs=[-0.1, -0.5, -0.2],
    ...                   finish_reason="stop", status="completed", version=3)
    >>> t = RolloutGroup("req-7", [s]).trajectories("math", scalars=[{"reward": 1.0}])[0]
    >>> t.id, t.gen_version
    ('req-7-0', 3)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from knitdata.errors import RolloutOutputError
from knitdata.record import MediaItem, Trajectory
from knitdata.rollout.status import STATUSES

__all__ = ["LOGPROBS_KEY", "RolloutSample", "RolloutGroup", "as_token_ids", "as_logprobs", "safe_id"]

#: Name of the behaviour log-probs in ``Trajectory.tensors`` (what a PPO/GRPO loss reads as the old policy).
LOGPROBS_KEY: str = "old_logprobs"

_BAD_ID_CHARS = "./\\\x00"
#: Largest log-probability accepted (numerical noise above 0).
_LOGPROB_MAX = 1e-4


def safe_id(text: str) -> str:
    """Return ``text`` usable as a trajectory id or group: ``.``, ``/``, ``\\`` and NUL become ``_``, spaces are
    stripped.

    Example:
        >>> safe_id("cmpl-a/b.c")
        'cmpl-a_b_c'
    """
    out = "".join("_" if c in _BAD_ID_CHARS else c for c in str(text)).strip()
    return out or "_"


def _to_tensor(values: Any, where: dict[str, Any], what: str, ok: tuple[type, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor, an array, or a sequence whose every entry is an instance of ``ok`` (never a ``bool``), as a tensor."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu()
    if isinstance(values, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(values))
    try:
        seq = list(values)
    except TypeError:
        raise RolloutOutputError(f"expected a sequence of {what}s, got {type(values).__name__}", **where) from None
    for i, v in enumerate(seq):
        if isinstance(v, bool) or not isinstance(v, ok):
            raise RolloutOutputError(f"position {i}: expected a {what}, got {v!r} ({type(v).__name__})", **where)
    try:
        return torch.tensor([int(v) if dtype == torch.int64 else float(v) for v in seq], dtype=dtype)
    except (OverflowError, RuntimeError, ValueError) as e:
        raise RolloutOutputError(f"a {what} out of range: {e}", **where) from None


def as_token_ids(values: Any, *, request_id: str | None = None, sample: int | None = None, field: str = "token_ids") -> torch.Tensor:
    """Return token ids as a 1-D ``int64`` tensor.

    Args:
        values: A sequence of ints, a 1-D integer numpy array or tensor.
        request_id: Named in errors.
        sample: Named in errors.
        field: Named in errors.

    Raises:
        RolloutOutputError: ``None``, not 1-D, not integers (``bool`` and floats included), or negative.
    """
    where: dict[str, Any] = {"request_id": request_id, "sample": sample, "field": field}
    if values is None:
        raise RolloutOutputError("missing (no token ids)", **where)
    t = _to_tensor(values, where, "token id", (int, np.integer), torch.int64)
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise RolloutOutputError(f"token ids must be integers, got dtype {t.dtype}", **where)
    if t.dim() != 1:
        raise RolloutOutputError(f"expected a 1-D sequence, got shape {tuple(t.shape)}", **where)
    t = t.to(torch.int64)
    if t.numel() and int(t.min()) < 0:
        raise RolloutOutputError(f"token ids must be non-negative, got {int(t.min())}", **where)
    return t


def as_logprobs(values: Any, *, request_id: str | None = None, sample: int | None = None, field: str = "logprobs") -> torch.Tensor:
    """Return log-probs as a 1-D ``float32`` tensor.

    Args:
        values: A sequence of floats, a 1-D numpy array or tensor.
        request_id: Named in errors.
        sample: Named in errors.
        field: Named in errors.

    Raises:
        RolloutOutputError: Not 1-D numbers, a ``None`` entry, a non-finite value, or a value above 0.
    """
    where: dict[str, Any] = {"request_id": request_id, "sample": sample, "field": field}
    t = _to_tensor(values, where, "log-prob", (int, float, np.floating, np.integer), torch.float64)
    if t.dtype == torch.bool or t.dtype.is_complex:
        raise RolloutOutputError(f"log-probs must be real numbers, got dtype {t.dtype}", **where)
    if t.dim() != 1:
        raise RolloutOutputError(f"expected a 1-D sequence, got shape {tuple(t.shape)}", **where)
    t = t.to(torch.float64)
    if t.numel():
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            i = int((~finite).nonzero()[0])
            raise RolloutOutputError(f"position {i}: non-finite log-prob {float(t[i])}", **where)
        if float(t.max()) > _LOGPROB_MAX:
            i = int(t.argmax())
            raise RolloutOutputError(f"position {i}: a log-prob must be <= 0, got {float(t[i])}", **where)
    return t.to(torch.float32)


def _check_version(v: Any, where: dict[str, Any]) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 0:
        raise RolloutOutputError(f"a policy version must be a non-negative int, got {v!r}", **where)
    return int(v)


@dataclass
class RolloutSample:
    """One generated response of one request, as an engine reported it.

    Construction converts sequences to tensors and checks every field (see :func:`as_token_ids`,
    :func:`as_logprobs`); a per-token field whose length differs from ``response_ids`` is refused.

    Attributes:
        request_id: The engine's request id (a group: every sample of one request shares it).
        index: Index of this response within its request (``0..n-1``).
        prompt_ids: Token ids the engine was given (``int64``).
        response_ids: Token ids it generated (``int64``); empty only for an aborted sample.
        logprobs: Behaviour log-prob of each response token (``float32``), or ``None`` when the engine
            returned none.
        status: ``"completed"``, ``"truncated"`` or ``"aborted"`` (:mod:`knitdata.rollout.status`).
        finish_reason: The engine's own finish reason, kept for the record.
        version: Policy version that generated the response, or ``None`` when unknown (then
            :meth:`to_trajectory` refuses it unless ``token_versions`` are given).
        loss_mask: Per response token, 1 where the loss trains on it (``None``: all ones).
        token_versions: Per response token policy versions (multi-turn or partial rollouts), or ``None``.
        tensors: Extra per-sample tensors (e.g. ``routed_experts``), carried into the trajectory.
        media: Images and audio clips of the prompt.
    """

    request_id: str
    index: int
    prompt_ids: Any
    response_ids: Any
    logprobs: Any = None
    status: str = "completed"
    finish_reason: str = "stop"
    version: int | None = None
    loss_mask: Any = None
    token_versions: Any = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    media: list[MediaItem] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RolloutOutputError(f"request id must be a non-empty string, got {self.request_id!r}", field="request_id")
        rid = self.request_id
        if isinstance(self.index, bool) or not isinstance(self.index, (int, np.integer)) or self.index < 0:
            raise RolloutOutputError(f"sample index must be a non-negative int, got {self.index!r}", request_id=rid,
                                     field="index")
        self.index = int(self.index)
        where: dict[str, Any] = {"request_id": rid, "sample": self.index}
        self.prompt_ids = as_token_ids(self.prompt_ids, field="prompt_ids", **where)
        self.response_ids = as_token_ids(self.response_ids, field="response_ids", **where)
        n = int(self.response_ids.numel())
        if self.status not in STATUSES:
            raise RolloutOutputError(f"unknown status {self.status!r}; use one of {STATUSES}", field="status", **where)
        if n == 0 and self.status != "aborted":
            raise RolloutOutputError(f"no response tokens, but the status is {self.status!r}", field="response_ids", **where)
        self.version = _check_version(self.version, {**where, "field": "version"})
        if self.logprobs is not None:
            self.logprobs = as_logprobs(self.logprobs, field="logprobs", **where)
            if self.logprobs.numel() != n:
                raise RolloutOutputError(f"{self.logprobs.numel()} log-probs for {n} response tokens", field="logprobs",
                                         **where)
        if self.loss_mask is not None:
            m = torch.as_tensor(self.loss_mask)
            if m.dim() != 1 or m.numel() != n:
                raise RolloutOutputError(f"shape {tuple(m.shape)} does not match {n} response tokens", field="loss_mask",
                                         **where)
            self.loss_mask = m
        if self.token_versions is not None:
            tv = as_token_ids(self.token_versions, field="token_versions", **where)
            if tv.numel() != n:
                raise RolloutOutputError(f"{tv.numel()} versions for {n} response tokens", field="token_versions", **where)
            self.token_versions = tv
        if not isinstance(self.tensors, Mapping) or not all(isinstance(v, torch.Tensor) for v in self.tensors.values()):
            raise RolloutOutputError("must map names to tensors", field="tensors", **where)
        self.tensors = dict(self.tensors)
        self.media = list(self.media)

    @property
    def trajectory_id(self) -> str:
        """The default trajectory id: ``"<request_id>-<index>"`` made id-safe (:func:`safe_id`)."""
        return safe_id(f"{self.request_id}-{self.index}")

    @property
    def versions(self) -> torch.Tensor | None:
        """Per response token policy versions: ``token_versions``, else ``version`` repeated, else ``None``."""
        if self.token_versions is not None:
            return self.token_versions
        if self.version is None:
            return None
        return torch.full((int(self.response_ids.numel()),), self.version, dtype=torch.int64)

    def to_trajectory(
        self,
        source: str,
        *,
        id: str | None = None,
        group: str | None = None,
        scalars: Mapping[str, float] | None = None,
        logprobs_key: str = LOGPROBS_KEY,
        require_logprobs: bool = True,
    ) -> Trajectory:
        """Return the sample as a :class:`~knitdata.record.Trajectory`.

        Args:
            source: The trajectory's source (e.g. the task of the prompt).
            id: Trajectory id; default :attr:`trajectory_id`.
            group: Group id; default the request id made id-safe.
            scalars: Named floats (reward, advantage, ...).
            logprobs_key: Name of the log-probs in ``Trajectory.tensors``.
            require_logprobs: Refuse a sample without log-probs (the default: an off-policy loss needs them).

        Returns:
            The trajectory: ``gen_version`` is the oldest token version; ``token_versions`` is set when the
            sample has per-token versions (partial rollouts, multi-turn episodes).

        Raises:
            RolloutOutputError: The sample is aborted, has no version, or has no log-probs (``require_logprobs``),
                or ``tensors`` already holds ``logprobs_key``.
            ValidationError: A field the trajectory refuses (it names the trajectory and the field).
        """
        where: dict[str, Any] = {"request_id": self.request_id, "sample": self.index}
        if self.status == "aborted":
            raise RolloutOutputError(
                "the generation was aborted; continue it (knitdata.rollout.SegmentBuffer) or withdraw its group",
                field="status", **where,
            )
        versions = self.versions
        if versions is None:
            raise RolloutOutputError("no policy version; pass version= to the adapter", field="version", **where)
        tensors = dict(self.tensors)
        if self.logprobs is not None:
            if logprobs_key in tensors:
                raise RolloutOutputError(f"tensors already hold {logprobs_key!r}", field="tensors", **where)
            tensors[logprobs_key] = self.logprobs
        elif require_logprobs:
            raise RolloutOutputError(
                "no log-probs; ask the engine for them (vLLM logprobs=0, SGLang return_logprob=True, OpenAI "
                "logprobs=true) or pass require_logprobs=False",
                field="logprobs", **where,
            )
        return Trajectory(
            id=id if id is not None else self.trajectory_id,
            source=source,
            group=group if group is not None else safe_id(self.request_id),
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            gen_version=int(versions.min()),
            loss_mask=self.loss_mask,
            token_versions=self.token_versions,
            scalars=dict(scalars or {}),
            tensors=tensors,
            media=list(self.media),
        )

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serializable dict (tensors as lists; media are not included)."""

        def lst(t: torch.Tensor | None) -> list | None:
            return None if t is None else t.tolist()

        return {
            "request_id": self.request_id,
            "index": self.index,
            "prompt_ids": lst(self.prompt_ids),
            "response_ids": lst(self.response_ids),
            "logprobs": lst(self.logprobs),
            "status": self.status,
            "finish_reason": self.finish_reason,
            "version": self.version,
            "loss_mask": lst(self.loss_mask),
            "token_versions": lst(self.token_versions),
        }


@dataclass
class RolloutGroup:
    """The responses of one request (``n`` samples = one GRPO group).

    Attributes:
        request_id: The request id, shared by every sample.
        samples: The responses, in index order.

    Raises:
        RolloutOutputError: No sample, a sample of another request, or a repeated index.
    """

    request_id: str
    samples: list[RolloutSample]

    def __post_init__(self) -> None:
        self.samples = list(self.samples)
        if not self.samples:
            raise RolloutOutputError("a group needs at least one sample", request_id=self.request_id, field="samples")
        seen: set[int] = set()
        for s in self.samples:
            if s.request_id != self.request_id:
                raise RolloutOutputError(f"belongs to request {s.request_id!r}", request_id=self.request_id,
                                         sample=s.index, field="request_id")
            if s.index in seen:
                raise RolloutOutputError("index repeated within the request", request_id=self.request_id, sample=s.index,
                                         field="index")
            seen.add(s.index)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def aborted(self) -> list[RolloutSample]:
        """The samples whose generation was aborted (to continue, or to drop with the group)."""
        return [s for s in self.samples if s.status == "aborted"]

    def trajectories(
        self,
        source: str,
        *,
        group: str | None = None,
        scalars: Sequence[Mapping[str, float]] | None = None,
        logprobs_key: str = LOGPROBS_KEY,
        require_logprobs: bool = True,
    ) -> list[Trajectory]:
        """Return one trajectory per sample, all in one group.

        Args:
            source: The trajectories' source.
            group: Group id; default the request id made id-safe.
            scalars: One mapping per sample (e.g. ``[{"reward": r} for r in rewards]``), or ``None``.
            logprobs_key: Name of the log-probs in ``Trajectory.tensors``.
            require_logprobs: Refuse samples without log-probs.

        Raises:
            RolloutOutputError: A sample is aborted (a group is put whole or not at all), ``scalars`` does not have
                one entry per sample, or a sample cannot become a trajectory (:meth:`RolloutSample.to_trajectory`).
        """
        if scalars is not None and len(scalars) != len(self.samples):
            raise RolloutOutputError(f"{len(scalars)} scalar mappings for {len(self.samples)} samples",
                                     request_id=self.request_id, field="scalars")
        bad = [s.index for s in self.aborted]
        if bad:
            raise RolloutOutputError(
                f"samples {bad} were aborted; continue them (knitdata.rollout.SegmentBuffer) before putting the group",
                request_id=self.request_id, field="status",
            )
        g = group if group is not None else safe_id(self.request_id)
        out = []
        for i, s in enumerate(self.samples):
            sc = scalars[i] if scalars is not None else None
            out.append(s.to_trajectory(source, group=g, scalars=sc, logprobs_key=logprobs_key,
                                       require_logprobs=require_logprobs))
        return out

