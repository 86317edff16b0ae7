"""The hard staleness bound of admission: expiry, dropped groups listed for regeneration, the rollout throttle.

An :class:`~knitdata.admission.AdmissionPolicy` built with ``max_staleness=eta`` holds one :class:`StalenessBound`.
The mini-batch of global step ``t`` is trained with trainer version ``version_offset + t`` (one optimizer step per
mini-batch, as :mod:`knitdata.staleness` counts), so a group whose oldest token has version ``v`` may join steps up
to ``v + eta - version_offset``; a complete group past that is dropped whole (never admitted), counted per source and
listed for regeneration. Quotas are untouched: the policy's feasibility check counts only groups still admissible.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from knitdata.admission.composition import even_completion
from knitdata.errors import ConfigError, StateError, ValidationError

__all__ = ["ON_STALE", "REGENERATE_MEMORY", "StalenessBound", "check_counts", "check_settings"]

#: How to keep a staleness bound: drop what expired (producers run free) or also throttle producers.
ON_STALE: tuple[str, ...] = ("drop", "wait")
#: Most dropped groups kept for the producer to regenerate (:meth:`StalenessBound.take_dropped`); older ones are
#: forgotten (counted as ``regenerate_overflow``).
REGENERATE_MEMORY = 100_000
_COUNTERS = ("dropped_groups", "dropped_trajectories", "dropped_tokens")


def check_counts(counts: Any, sources: Sequence[str], what: str) -> dict[str, int]:
    """``counts`` as ``{source: int >= 0}`` (:class:`~knitdata.errors.ValidationError` otherwise)."""
    if not isinstance(counts, Mapping):
        raise ValidationError(f"{what} takes a mapping {{source: groups}}, got {type(counts).__name__}", field="counts")
    out: dict[str, int] = {}
    for s, n in counts.items():
        if s not in sources:
            raise ValidationError(f"{what}: unknown source {s!r}; known {list(sources)}", field="source")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValidationError(f"{what}: count for {s!r} must be an int >= 0, got {n!r}", field="counts")
        out[s] = n
    return out


def check_settings(max_staleness: int | None, on_stale: str, version_offset: int) -> None:
    """Refuse a bad ``max_staleness`` (``None`` or an int >= 0), ``on_stale`` or ``version_offset`` (ConfigError)."""
    if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                      or max_staleness < 0):
        raise ConfigError(f"max_staleness must be None or an int >= 0 (versions), got {max_staleness!r}")
    if on_stale not in ON_STALE:
        raise ConfigError(f"on_stale must be one of {ON_STALE}, got {on_stale!r}")
    if isinstance(version_offset, bool) or not isinstance(version_offset, int) or version_offset < 0:
        raise ConfigError(f"version_offset must be an int >= 0, got {version_offset!r}")


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise StateError(f"{what} must be an int >= 0, got {str(x)[:50]}")
    return x


class StalenessBound:
    """The bound's state: settings, reservations, the expiry heap and what it dropped.

    Args:
        max_staleness: ``eta`` in versions (int >= 0).
        on_stale: ``"drop"`` or ``"wait"`` (see :meth:`capacity`).
        version_offset: The trainer's version before step 0.
        quotas: Groups per source per train batch.
        num_minibatches: ``M``.

    Raises:
        ConfigError: A bad setting.
    """

    def __init__(self, max_staleness: int, on_stale: str, version_offset: int, quotas: Mapping[str, int],
                 num_minibatches: int) -> None:
        check_settings(max_staleness, on_stale, version_offset)
        self.eta, self.on_stale, self.version_offset = max_staleness, on_stale, version_offset
        self.sources = tuple(quotas)
        self._Q, self._M = dict(quotas), num_minibatches
        self.reserved: dict[str, int] = dict.fromkeys(quotas, 0)
        self.counts: dict[str, dict[str, int]] = {k: dict.fromkeys(quotas, 0) for k in _COUNTERS}
        self.overflow = 0
        self.regenerate: deque[dict[str, Any]] = deque()
        self.released: list[Any] = []  # members of groups dropped since pop_released (payloads to free)
        self.expiry: list[tuple[int, int, Any]] = []  # (version, seq, ready group) of ready groups
        self.schedule_cum = [dict.fromkeys(quotas, 0)]  # groups of each source in the first r mini-batches
        for col in even_completion(self._Q, num_minibatches):
            self.schedule_cum.append({s: self.schedule_cum[-1][s] + col[s] for s in quotas})

    def settings(self) -> list[Any]:
        """``[max_staleness, on_stale, version_offset]``."""
        return [self.eta, self.on_stale, self.version_offset]

    def expired(self, version: int, step: int) -> bool:
        """Whether a group of oldest version ``version`` is staler than the bound at global step ``step``."""
        return self.version_offset + step - version > self.eta

    def push(self, grp: Any) -> None:
        """Track a ready group (``version``, ``seq``, ``gone``) for expiry."""
        heapq.heappush(self.expiry, (grp.version, grp.seq, grp))

    def expiring(self, step: int) -> Iterator[Any]:
        """Pop and yield each tracked group (not ``gone``) that is staler than the bound at ``step``."""
        h = self.expiry
        while h and (h[0][2].gone or self.expired(h[0][0], step)):
            grp = heapq.heappop(h)[2]
            if not grp.gone:
                yield grp

    def capacity(self, version: int, used: Mapping[str, int]) -> dict[str, int]:
        """Groups per source that may still start with policy ``version``: AReaL's rule (at most ``(eta + v + 1) *
        batch`` started by version ``v``) on the quota schedule.

        The first ``T = version + eta + 1 - version_offset`` steps hold ``C_s(T) = Q_s * (T // M) + c_s(T % M)``
        groups of source ``s`` on the even schedule of the quotas (``c_s(r)``: the first ``r`` mini-batches of
        :func:`~knitdata.admission.even_completion`, the schedule :class:`~knitdata.admission.LinearTargetAdmission`
        admits; ``T * m / g`` groups in all). The capacity is ``C_s(T)`` minus ``used[s]`` (admitted since step 0,
        ready, in incomplete groups) minus what is reserved and has not arrived. A producer that keeps to it and
        delivers each source's groups in the order it started them has every started group admitted within the
        bound under linear-target admission (the ``k``-th started group of a source is its ``k``-th admitted) and,
        property-tested, under constraint-preserving admission; a slow group overtaken by newer ones of its source
        can still expire, and is then dropped and listed as in ``"drop"`` mode. The current step always has room:
        the capacities sum to at least a mini-batch beyond what is admitted, ready or reserved.
        """
        full, r = divmod(max(0, int(version) + self.eta + 1 - self.version_offset), self._M)
        cum = self.schedule_cum[r]
        return {s: max(0, Q * full + cum[s] - used[s] - self.reserved[s]) for s, Q in self._Q.items()}

    def reserve(self, want: Mapping[str, int], cap: Mapping[str, int]) -> bool:
        """Reserve ``want`` if ``cap`` (from :meth:`capacity`) has room for all of it (all or nothing)."""
        if any(n > cap[s] for s, n in want.items()):
            return False
        for s, n in want.items():
            self.reserved[s] += n
        return True

    def unreserve(self, want: Mapping[str, int]) -> None:
        """Give back reservations (floored at 0)."""
        for s, n in want.items():
            self.reserved[s] = max(0, self.reserved[s] - n)

    def arrived(self, source: str) -> None:
        """A new group of ``source`` arrived (its first member): it ends one reservation, if any."""
        if self.reserved[source]:
            self.reserved[source] -= 1

    def drop(self, group: str, source: str, version: int, metas: Sequence[Any], step: int) -> None:
        """Record a dropped group: counted, listed for regeneration, its members to release."""
        tokens = sum(int(m.num_tokens) for m in metas)
        for key, n in zip(_COUNTERS, (1, len(metas), tokens)):
            self.counts[key][source] += n
        self.regenerate.append({"group": group, "source": source, "version": version,
                                "trajectories": [m.id for m in metas], "tokens": tokens, "step": step})
        while len(self.regenerate) > REGENERATE_MEMORY:
            self.regenerate.popleft()
            self.overflow += 1
        self.released.extend(metas)

    def take_dropped(self) -> list[dict[str, Any]]:
        """The groups dropped since the last call, oldest first: ``{"group", "source", "version", "trajectories",
        "tokens", "step"}`` each (``step``: the mini-batch being formed when it expired)."""
        out = list(self.regenerate)
        self.regenerate.clear()
        return out

    def pop_released(self) -> list[Any]:
        """The members of the groups dropped since the last call (their payloads are to be freed)."""
        out, self.released = self.released, []
        return out

    def stats(self) -> dict[str, Any]:
        """Settings, reservations and what was dropped per source, JSON-ready."""
        return {"max_staleness": self.eta, "on_stale": self.on_stale, "version_offset": self.version_offset,
                "reserved": dict(self.reserved), "to_regenerate": len(self.regenerate),
                **{k: dict(v) for k, v in self.counts.items()}, "regenerate_overflow": self.overflow}

    def state_dict(self) -> dict[str, Any]:
        """The JSON-serializable state (the expiry heap is rebuilt from the policy's ready groups)."""
        return {"max_staleness": self.eta, "on_stale": self.on_stale, "version_offset": self.version_offset,
                "reserved": dict(self.reserved), "regenerate": list(self.regenerate),
                "stale": {**{k: dict(v) for k, v in self.counts.items()}, "regenerate_overflow": self.overflow}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (settings already checked by the policy).

        Raises:
            StateError: A malformed state (nothing changes then).
        """
        try:
            reserved = {s: _int(state["reserved"].get(s, 0), f"reserved.{s}") for s in self.sources}
            regen = state["regenerate"]
            if not isinstance(regen, list) or not all(isinstance(x, dict) and {"group", "source"} <= set(x)
                                                      for x in regen):
                raise StateError(f"bound.regenerate must be a list of dropped groups, got {str(regen)[:100]}")
            st = state["stale"]
            counts = {k: {s: _int(st[k].get(s, 0), f"stale.{k}.{s}") for s in self.sources} for k in _COUNTERS}
            overflow = _int(st["regenerate_overflow"], "stale.regenerate_overflow")
        except (KeyError, TypeError, AttributeError) as e:
            raise StateError(f"not a staleness-bound state: {e!r}") from e
        self.reserved, self.regenerate, self.counts, self.overflow = reserved, deque(regen), counts, overflow
