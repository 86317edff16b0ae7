"""Partial rollout: a generation interrupted by a weight update, continued under newer weights, as one trajectory.

When the trainer publishes new weights, a rollout engine aborts its running requests (SGLang ``/abort_request``
or ``/pause_generation``, vLLM ``abort``), loads the weights, and resubmits each aborted sample with its prompt
followed by the tokens generated so far. Each piece is a *segment*, generated under one policy version.
:class:`PartialRollout` accumulates the segments of one sample (from any adapter of :mod:`knitdata.rollout`) and
yields one sample whose ``token_versions`` give each response token's version; its trajectory's
``gen_version`` is the oldest. :class:`SegmentBuffer` does the bookkeeping for many requests of ``n`` samples:
it says what to resubmit (:meth:`SegmentBuffer.pending`) and hands back a request's group once every one of its
samples has finished. Both keep their state as JSON (:meth:`PartialRollout.to_dict` /
:meth:`PartialRollout.from_dict`; :meth:`SegmentBuffer.state_dict` / :meth:`SegmentBuffer.from_state_dict`, or
:meth:`SegmentBuffer.load_state_dict` into an existing buffer), so a rollout worker that restarts continues where it
stopped.

Refused, with :class:`~knitdata.errors.RolloutOutputError` naming the request, sample and field: a segment whose
prompt is not the request's prompt followed by the tokens generated so far (``prompt_ids``), a segment after the
sample finished (``status``), a segment without a version or under an older version than the previous one
(``version``), log-probs on some segments only (``logprobs``).

Example:
    >>> buf = SegmentBuffer()
    >>> first = RolloutSample("q1", 0, prompt_ids=[1, 2], response_ids=[5, 6], logprobs=[-0.5, -0.5],
    ...                       status="aborted", finish_reason="abort", version=3)
    >>> buf.add_group(RolloutGroup("q1", [first])) is None          # aborted: nothing to put yet
    True
    >>> c = buf.pending()[0]                                        # what to resubmit
    >>> c.request_id, c.index, tuple(c.input_ids)
    ('q1', 0, (1, 2, 5, 6))
    >>> cont = RolloutSample("q1-retry", 0, prompt_ids=[1, 2, 5, 6], response_ids=[7, 2], logprobs=[-0.25, -0.125],
    ...                      status="completed", finish_reason="stop", version=4)
    >>> group = buf.add(cont, request_id="q1", index=0)
    >>> t = group.trajectories("math")[0]
    >>> t.gen_version, t.token_versions.tolist()
    (3, [3, 3, 4, 4])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from knitdata.errors import RolloutOutputError, StateError
from knitdata.record import MediaItem, Trajectory
from knitdata.rollout.sample import LOGPROBS_KEY, RolloutGroup, RolloutSample, as_token_ids

__all__ = ["Segment", "PartialRollout", "Continuation", "SegmentBuffer"]

_STATE_FORMAT = "knitdata.partial_rollout/1"


@dataclass(frozen=True)
class Segment:
    """One piece of a generation, under one policy version.

    Attributes:
        version: Policy version that generated it.
        token_ids: Its tokens (possibly none: aborted before the first token).
        logprobs: Their behaviour log-probs, or ``None``.
        status: ``"completed"``, ``"truncated"`` or ``"aborted"``.
        finish_reason: The engine's finish reason.
    """

    version: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    status: str
    finish_reason: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return {"version": self.version, "token_ids": list(self.token_ids),
                "logprobs": None if self.logprobs is None else list(self.logprobs), "status": self.status,
                "finish_reason": self.finish_reason}


class PartialRollout:
    """The segments of one sample's generation.

    The finished sample carries the extra tensors of the *last* segment (SGLang's ``routed_experts`` cover the
    whole sequence, the continuation's prompt included, so the last segment's are complete) and the media given
    here. The state (:meth:`to_dict`) holds everything but the media: after a restart, attach them to the finished
    group (:func:`~knitdata.rollout.multimodal.attach_media`).

    Args:
        request_id: The original request's id (the group).
        index: The sample's index within the request.
        prompt_ids: The original prompt's token ids.
        media: The prompt's media items (kept in memory only).
    """

    def __init__(self, request_id: str, index: int, prompt_ids: Any, media: Sequence[MediaItem] = ()):
        self.request_id = str(request_id)
        self.index = int(index)
        self.prompt_ids: list[int] = as_token_ids(prompt_ids, request_id=self.request_id, sample=self.index,
                                                  field="prompt_ids").tolist()
        self.media = list(media)
        self.segments: list[Segment] = []
        self.tensors: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ state
    @property
    def finished(self) -> bool:
        """Whether the last segment completed or was truncated (no continuation is accepted then)."""
        return bool(self.segments) and self.segments[-1].status != "aborted"

    @property
    def generated(self) -> list[int]:
        """The response tokens generated so far, over every segment."""
        return [t for s in self.segments for t in s.token_ids]

    @property
    def input_ids(self) -> list[int]:
        """What to resubmit to continue: the prompt followed by the tokens generated so far."""
        return self.prompt_ids + self.generated

    def add(self, segment: RolloutSample, *, version: int | None = None) -> None:
        """Append a segment (a sample from any adapter, generated from :attr:`input_ids`).

        Args:
            segment: The engine's output for the continuation; its ``prompt_ids`` must be :attr:`input_ids`.
            version: Its policy version; default ``segment.version``.

        Raises:
            RolloutOutputError: The sample has finished, the prompt does not continue it, the version is missing or
                older than the previous segment's, or log-probs are present on some segments only.
        """
        where: dict[str, Any] = {"request_id": self.request_id, "sample": self.index}
        k = len(self.segments)
        if self.finished:
            raise RolloutOutputError(
                f"segment {k}: the generation already finished ({self.segments[-1].status}); a finished request cannot "
                "be continued", field="status", **where,
            )
        expected = self.input_ids
        got = segment.prompt_ids.tolist()
        if got != expected:
            at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            raise RolloutOutputError(
                f"segment {k}: its prompt ({len(got)} tokens) is not the request's prompt followed by the "
                f"{len(expected) - len(self.prompt_ids)} tokens generated so far ({len(expected)} tokens); first "
                f"difference at position {at}",
                field="prompt_ids", **where,
            )
        v = version if version is not None else segment.version
        if v is None:
            raise RolloutOutputError(f"segment {k}: no policy version; pass version=", field="version", **where)
        if self.segments and v < self.segments[-1].version:
            raise RolloutOutputError(f"segment {k}: version {v} is older than the previous segment's "
                                     f"{self.segments[-1].version}", field="version", **where)
        earlier = [s for s in self.segments if s.token_ids]
        if earlier and segment.response_ids.numel() and (earlier[0].logprobs is None) != (segment.logprobs is None):
            raise RolloutOutputError(f"segment {k}: log-probs on some segments only", field="logprobs", **where)
        lp = None if segment.logprobs is None else tuple(segment.logprobs.tolist())
        self.segments.append(Segment(int(v), tuple(segment.response_ids.tolist()), lp, segment.status,
                                     segment.finish_reason))
        if segment.tensors:
            self.tensors = dict(segment.tensors)

    def sample(self) -> RolloutSample:
        """The finished generation as one sample, with per-token versions.

        Raises:
            RolloutOutputError: The generation has not finished (its last segment was aborted, or none was added).
        """
        if not self.finished:
            raise RolloutOutputError("the generation has not finished: continue it first", request_id=self.request_id,
                                     sample=self.index, field="status")
        ids: list[int] = []
        versions: list[int] = []
        lps: list[float] = []
        missing_lp = False
        for s in self.segments:
            ids.extend(s.token_ids)
            versions.extend([s.version] * len(s.token_ids))
            if s.token_ids:
                if s.logprobs is None:
                    missing_lp = True
                else:
                    lps.extend(s.logprobs)
        last = self.segments[-1]
        return RolloutSample(self.request_id, self.index, prompt_ids=self.prompt_ids, response_ids=ids,
                             logprobs=None if missing_lp else lps, status=last.status,
                             finish_reason=last.finish_reason, version=last.version, token_versions=versions,
                             tensors=self.tensors, media=self.media)

    def trajectory(self, source: str, *, scalars: Mapping[str, float] | None = None,
                   logprobs_key: str = LOGPROBS_KEY) -> Trajectory:
        """The finished generation as a trajectory (:meth:`RolloutSample.to_trajectory` of :meth:`sample`)."""
        return self.sample().to_trajectory(source, scalars=scalars, logprobs_key=logprobs_key)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (:meth:`from_dict` rebuilds it)."""
        tensors = {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "values": t.reshape(-1).tolist()} for k, t in self.tensors.items()}
        return {"request_id": self.request_id, "index": self.index, "prompt_ids": list(self.prompt_ids),
                "segments": [s.to_dict() for s in self.segments], "tensors": tensors}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PartialRollout:
        """Rebuild from :meth:`to_dict`.

        Raises:
            StateError: A missing or malformed entry.
        """
        try:
            out = cls(d["request_id"], d["index"], d["prompt_ids"])
            for s in d["segments"]:
                lp = s["logprobs"]
                out.segments.append(Segment(int(s["version"]), tuple(int(t) for t in s["token_ids"]),
                                            None if lp is None else tuple(float(x) for x in lp), str(s["status"]),
                                            str(s["finish_reason"])))
            for k, t in d.get("tensors", {}).items():
                dtype = getattr(torch, str(t["dtype"]))
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"unknown dtype {t['dtype']!r}")
                out.tensors[str(k)] = torch.tensor(t["values"], dtype=dtype).reshape(t["shape"])
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise StateError(f"bad partial rollout state: {type(e).__name__}: {e}") from e
        return out


@dataclass(frozen=True)
class Continuation:
    """A sample to resubmit (:meth:`SegmentBuffer.pending`).

    Attributes:
        request_id: The original request.
        index: The sample's index within it.
        input_ids: Prompt plus the tokens generated so far: the continuation's prompt.
        generated: How many tokens were generated so far (subtract them from ``max_tokens``).
    """

    request_id: str
    index: int
    input_ids: list[int]
    generated: int


class SegmentBuffer:
    """The partial rollouts of many requests, each of ``n`` samples, until each request's group has finished.

    Feed it every engine output: :meth:`add_group` for a request's first output (all ``n`` samples), :meth:`add`
    for each continuation. Each returns the request's merged :class:`~knitdata.rollout.sample.RolloutGroup` when its
    last sample finishes (then the request leaves the buffer), else ``None``.
    """

    def __init__(self) -> None:
        self._requests: dict[str, list[PartialRollout]] = {}

    def __len__(self) -> int:
        """Requests with an unfinished sample."""
        return len(self._requests)

    def _finished(self, request_id: str) -> RolloutGroup | None:
        parts = self._requests[request_id]
        if not all(p.finished for p in parts):
            return None
        del self._requests[request_id]
        return RolloutGroup(request_id, [p.sample() for p in parts])

    def add_group(self, group: RolloutGroup, *, version: int | None = None) -> RolloutGroup | None:
        """Start a request from its first output (every sample is its first segment).

        Args:
            group: The engine's output for the request.
            version: Policy version; default each sample's own.

        Raises:
            RolloutOutputError: The request is already in the buffer (continue it with :meth:`add`), or a segment is
                refused (:meth:`PartialRollout.add`).
        """
        rid = group.request_id
        if rid in self._requests:
            raise RolloutOutputError("the request is already being continued; add its segments with add()",
                                     request_id=rid, field="request_id")
        indices = sorted(s.index for s in group.samples)
        if indices != list(range(len(indices))):
            raise RolloutOutputError(f"sample indices {indices} are not 0..n-1", request_id=rid, field="index")
        parts = []
        for s in sorted(group.samples, key=lambda s: s.index):
            p = PartialRollout(rid, s.index, s.prompt_ids, media=s.media)
            p.add(s, version=version)
            parts.append(p)
        self._requests[rid] = parts
        return self._finished(rid)

    def add(self, segment: RolloutSample, *, request_id: str | None = None, index: int | None = None,
            version: int | None = None) -> RolloutGroup | None:
        """Append a continuation segment to sample ``index`` of request ``request_id``.

        Args:
            segment: The engine's output for the continuation (its prompt: :attr:`Continuation.input_ids`).
            request_id: The original request; default ``segment.request_id``.
            index: The sample within it; default ``segment.index``.
            version: Policy version; default ``segment.version``.

        Raises:
            RolloutOutputError: Unknown request or sample (``request_id``, ``index``), or a refused segment.
        """
        rid = segment.request_id if request_id is None else str(request_id)
        i = segment.index if index is None else int(index)
        parts = self._requests.get(rid)
        if parts is None:
            raise RolloutOutputError("no such request in the buffer (finished, or never added with add_group())",
                                     request_id=rid, sample=i, field="request_id")
        if not 0 <= i < len(parts):
            raise RolloutOutputError(f"the request has {len(parts)} samples", request_id=rid, sample=i, field="index")
        parts[i].add(segment, version=version)
        return self._finished(rid)

    def pending(self) -> list[Continuation]:
        """The samples to resubmit (aborted, not yet continued), oldest request first."""
        return [Continuation(p.request_id, p.index, p.input_ids, len(p.generated))
                for parts in self._requests.values() for p in parts if not p.finished]

    def partial(self, request_id: str, index: int) -> PartialRollout:
        """The partial rollout of one sample (``KeyError`` when not in the buffer)."""
        return self._requests[str(request_id)][int(index)]

    def discard(self, request_id: str) -> None:
        """Forget a request (e.g. its group was dropped); unknown ids are ignored."""
        self._requests.pop(str(request_id), None)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state (:meth:`load_state_dict` restores it)."""
        return {"format": _STATE_FORMAT,
                "requests": [[p.to_dict() for p in parts] for parts in self._requests.values()]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> SegmentBuffer:
        """A new buffer holding ``state`` (a :meth:`state_dict`, e.g. read back from JSON after a restart).

        Raises:
            StateError: Another format, or a malformed entry.
        """
        buf = cls()
        buf.load_state_dict(state)
        return buf

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the buffer's content with ``state``.

        Raises:
            StateError: Another format, or a malformed entry.
        """
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise StateError(f"not a segment buffer state (expected format {_STATE_FORMAT!r})")
        requests: dict[str, list[PartialRollout]] = {}
        for entry in state.get("requests", []):
            parts = [PartialRollout.from_dict(d) for d in entry]
            if not parts or [p.index for p in parts] != list(range(len(parts))):
                raise StateError("bad segment buffer state: a request without samples 0..n-1")
            requests[parts[0].request_id] = parts
        self._requests = requests

