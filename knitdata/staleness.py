"""Staleness accounting: a version clock, per-trajectory and architectural staleness.

A trajectory generated with policy version ``gen_version`` and trained in a mini-batch whose gradient is
computed with trainer version ``v`` (before that mini-batch's own optimizer step) has staleness
``v - gen_version``. In colocated execution the k-th mini-batch of a train batch (k = 1..M; ``index`` =
k - 1 here) has staleness k - 1, so the **architectural staleness** of a trajectory is its staleness minus
its mini-batch's ``index``. It can be negative (fresher than colocated execution would be).

Per token. Under partial rollout one trajectory spans several versions (``token_versions``; ``gen_version`` is the
oldest, ``version_mean`` the token-weighted mean, ``version_span`` newest minus oldest). Its *worst* token
staleness is the trajectory's staleness ``v - gen_version`` (what a bound ``max_staleness`` limits), its *mean*
token staleness ``v - version_mean`` and its *span* ``version_span``; :class:`TokenStaleness` accumulates them.

Generating and queued. A trajectory's staleness ``v - gen_version`` splits into the versions that passed while it
was generated, ``put_version - gen_version`` (from its oldest token's version to the trainer's version when it was
put into the pipeline), and the versions it then waited in the pipeline, ``v - put_version`` (admission, planning,
delivery), the split Prime-RL reports; :class:`PutLog` remembers each put's version and time, :class:`StalenessSplit`
accumulates both parts and the seconds queued.

Pure metadata: nothing here imports torch payload code, storage or engines.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Any

from knitdata.errors import StateError, ValidationError

__all__ = [
    "VersionClock",
    "StalenessTracker",
    "TokenStaleness",
    "PutLog",
    "StalenessSplit",
    "summarize",
    "percentile",
    "staleness_reduction",
]


class VersionClock:
    """The trainer's optimizer-step counter and the version last synced to rollout.

    Args:
        version: Starting trainer version.
        sync_every: Sync weights to rollout every this many optimizer steps (1: after every step; ``M``:
            per train batch).
    """

    def __init__(self, version: int = 0, sync_every: int = 1) -> None:
        if sync_every < 1:
            raise ValidationError(f"sync_every must be >= 1, got {sync_every}", field="sync_every")
        self.version = int(version)
        self.rollout_version = int(version)
        self.sync_every = int(sync_every)

    def step(self) -> bool:
        """Advance by one optimizer step; returns ``True`` if weights were synced to rollout."""
        self.version += 1
        if self.version % self.sync_every == 0:
            self.rollout_version = self.version
            return True
        return False

    def sync(self) -> None:
        """Force a weight sync to rollout."""
        self.rollout_version = self.version

    def state_dict(self) -> dict[str, int]:
        """JSON-serializable state."""
        return {"version": self.version, "rollout_version": self.rollout_version, "sync_every": self.sync_every}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            StateError: A state that is not three ints (``sync_every`` at least 1).
        """
        keys = ("version", "rollout_version", "sync_every")
        raw = [state.get(k) for k in keys] if isinstance(state, Mapping) else []
        values = [v for v in raw if type(v) is int]
        if len(values) != 3 or values[2] < 1:
            raise StateError(f"not a VersionClock state {{version, rollout_version, sync_every}}: {state!r:.200}")
        self.version, self.rollout_version, self.sync_every = values


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of already sorted values; ``nan`` if empty."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def summarize(values: Iterable[float]) -> dict[str, float]:
    """Mean, positive-part mean, p50, p95, share of negative values (``nan`` when empty) and the count.

    The positive-part mean (the mean of ``max(0, x)``) is the headline of architectural staleness: with fewer
    rollout slots than trajectories per batch, late starters get negative values that cancel in the signed
    mean and can push a "reduction" past 100%.
    """
    v = sorted(float(x) for x in values)
    n = len(v)
    return {
        "mean": (math.fsum(v) / n) if n else math.nan,
        "positive_mean": (math.fsum(max(0.0, x) for x in v) / n) if n else math.nan,
        "p50": percentile(v, 50),
        "p95": percentile(v, 95),
        "share_negative": (sum(1 for x in v if x < 0) / n) if n else math.nan,
        "count": n,
    }


def staleness_reduction(arch_policy: float, arch_train_batch: float) -> float | None:
    """``1 - arch(policy) / arch(train_batch)``; ``None`` when train-batch staleness is not positive."""
    if not (arch_train_batch > 0) or math.isnan(arch_policy):
        return None
    return 1.0 - arch_policy / arch_train_batch


_gen_version = attrgetter("gen_version")
_version_span = attrgetter("version_span")
_version_mean = attrgetter("version_mean")
_seq = attrgetter("seq")


class TokenStaleness:
    """Running per-token staleness figures of trained trajectories in O(1) memory.

    For each trajectory trained at version ``v``: mean token staleness ``v - version_mean``, worst token
    staleness ``v - gen_version`` (the oldest token) and the span ``version_span`` (newest minus oldest token
    version; > 0 for a partial rollout continued under newer weights).

    Example:
        >>> from knitdata.record import TrajectoryMeta
        >>> ts = TokenStaleness()
        >>> ts.record(5, [TrajectoryMeta("a", "s", "g", gen_version=2, version_mean=3.0, version_span=2)])
        >>> ts.summary()["token_mean"], ts.summary()["worst"], ts.summary()["span_max"]
        (2.0, 3, 2)
    """

    def __init__(self) -> None:
        self.count = 0
        self.partial = 0
        self._mean_sum = 0.0
        self._span_sum = 0
        self.span_max = 0
        self.worst: int | None = None

    def record(self, train_version: int, metas: Iterable[Any]) -> None:
        """Record trajectories (anything with ``gen_version``, ``version_mean``, ``version_span``) trained at
        ``train_version``."""
        sums = self.sums(metas)
        if sums is not None:
            self.record_sums(train_version, sums)

    @staticmethod
    def sums(metas: Iterable[Any]) -> tuple[int, float, int, int, int, int] | None:
        """What :meth:`record_sums` takes of ``metas``, computed once where they are at hand (the control plane
        does it when it plans a micro-batch, so that a hand-out records it without visiting the trajectories):
        ``(count, sum of version_mean, oldest gen_version, sum of version_span, how many span versions, widest
        span)``; ``None`` for no metas.

        Example:
            >>> from knitdata.record import TrajectoryMeta
            >>> TokenStaleness.sums([TrajectoryMeta("a", "s", "g", gen_version=2, version_mean=3.0, version_span=2)])
            (1, 3.0, 2, 2, 1, 2)
        """
        metas = metas if isinstance(metas, (list, tuple)) else list(metas)
        if not metas:
            return None
        # a column per field, then the sums in C
        gens = list(map(_gen_version, metas))
        try:
            spans = list(map(_version_span, metas))
        except AttributeError:
            spans = [getattr(m, "version_span", 0) for m in metas]
        wide = int(max(spans))
        if wide > 0:  # partial rollouts continued under newer weights (rare): counted one by one
            span_sum, partial = int(sum(spans)), sum(1 for s in spans if s > 0)
        else:
            span_sum = partial = 0
        return len(gens), float(sum(map(_version_mean, metas))), int(min(gens)), span_sum, partial, wide

    def record_sums(self, train_version: int, sums: Sequence[Any]) -> None:
        """Record trajectories trained at ``train_version`` by their :meth:`sums`."""
        count, mean_sum, oldest, span_sum, partial, wide = sums
        self.count += count
        self._mean_sum += train_version * count - mean_sum
        if wide > 0:
            self._span_sum += span_sum
            self.partial += partial
            if wide > self.span_max:
                self.span_max = wide
        worst = train_version - oldest
        self.worst = worst if self.worst is None or worst > self.worst else self.worst

    def summary(self) -> dict[str, Any]:
        """``{count, token_mean, span_mean, span_max, worst, partial_share}`` (``nan`` / ``None`` when empty):
        ``token_mean`` is the mean over trajectories of their mean token staleness, ``worst`` the largest
        staleness of any token, ``partial_share`` the share of trajectories that span several versions."""
        n = self.count
        return {"count": n, "token_mean": self._mean_sum / n if n else math.nan,
                "span_mean": self._span_sum / n if n else math.nan, "span_max": self.span_max, "worst": self.worst,
                "partial_share": self.partial / n if n else math.nan}


class PutLog:
    """The trainer's version and the time at each put, by arrival sequence number (``TrajectoryMeta.seq``).

    A control plane stamps every accepted put (:meth:`stamp`, in ``seq`` order) and forgets the stamps of
    trajectories no longer held (:meth:`forget_below`); :meth:`sums` reads them for a planned micro-batch. Memory:
    12 bytes per stamp kept (two typed arrays).

    Example:
        >>> from knitdata.record import TrajectoryMeta
        >>> log = PutLog()
        >>> log.stamp(0, 3, 10.0)
        >>> log.sums([TrajectoryMeta("a", "s", "g", gen_version=1, seq=0)])
        (1, 1, 3, 10.0, 3, 2, 10.0)
    """

    def __init__(self) -> None:
        self.base = 0  # seq of the first stamp kept
        self._versions = array("q")
        self._times = array("d")

    def __len__(self) -> int:
        return len(self._versions)

    def stamp(self, seq: int, version: int, t: float) -> None:
        """Record that the put of sequence number ``seq`` happened at trainer ``version``, monotonic time ``t``.

        Stamps are expected in ``seq`` order; any other ``seq`` (a plane restored from a snapshot) starts the log
        again from it: the trajectories put before are not stamped (:meth:`sums` leaves them out).
        """
        if seq != self.base + len(self._versions):
            self.base = seq
            del self._versions[:], self._times[:]
        self._versions.append(int(version))
        self._times.append(float(t))

    def restart(self, seq: int) -> None:
        """Forget every stamp: the next put has sequence number ``seq`` (a plane restored from a snapshot)."""
        self.base = seq
        del self._versions[:], self._times[:]

    def forget_below(self, seq: int) -> None:
        """Forget the stamps of sequence numbers below ``seq`` (no trajectory held has one)."""
        k = min(len(self._versions), seq - self.base)
        if k > 0:
            del self._versions[:k], self._times[:k]
            self.base += k

    def sums(self, metas: Iterable[Any]) -> tuple[int, int, int, float, int, int, float] | None:
        """What :meth:`StalenessSplit.record_sums` takes of ``metas`` (anything with ``seq``, ``gen_version``,
        ``version_span``): ``(count, sum of gen_version, sum of put versions, sum of put times, oldest put version,
        largest generating part, earliest put time)`` over the ones stamped; ``None`` for none.

        A put version below the trajectory's newest token version (``gen_version + version_span``: the trainer's
        report had not reached the plane yet) counts as that version, so that both parts are at least 0 for a
        trajectory trained at or after its newest token's version.
        """
        versions, times, base, n = self._versions, self._times, self.base, len(self._versions)
        count = gen_sum = put_sum = 0
        time_sum = 0.0
        oldest = widest = 0
        first = math.inf
        for m in metas:
            i = m.seq - base
            if i < 0 or i >= n:
                continue
            gv = m.gen_version
            pv = versions[i]
            newest = gv + getattr(m, "version_span", 0)
            if pv < newest:
                pv = newest
            t = times[i]
            if count == 0 or pv < oldest:
                oldest = pv
            if count == 0 or pv - gv > widest:
                widest = pv - gv
            if t < first:
                first = t
            count += 1
            gen_sum += gv
            put_sum += pv
            time_sum += t
        if count == 0:
            return None
        return count, gen_sum, put_sum, time_sum, oldest, widest, first


class StalenessSplit:
    """Staleness split into versions generating and versions (and seconds) queued, in O(1) memory.

    For a trajectory put at trainer version ``p`` (:class:`PutLog`; at least its newest token's version) and
    trained at ``v``: *generating* ``p - gen_version`` (its oldest token's version to its put: the generation, and
    the weight sync's lag before it) and *queued* ``v - p`` (put to training); they add up to its staleness
    ``v - gen_version``. *Queued seconds*: from its put to the plane's record of its hand-out.

    Example:
        >>> from knitdata.record import TrajectoryMeta
        >>> log, split = PutLog(), StalenessSplit()
        >>> log.stamp(0, 3, 10.0)
        >>> split.record_sums(5, 12.5, log.sums([TrajectoryMeta("a", "s", "g", gen_version=1, seq=0)]))
        >>> {k: split.summary()[k] for k in ("generating_mean", "queued_mean", "queued_s_mean")}
        {'generating_mean': 2.0, 'queued_mean': 2.0, 'queued_s_mean': 2.5}
    """

    def __init__(self) -> None:
        self.count = 0
        self._gen = 0  # sum of put version - gen_version
        self._queued = 0  # sum of train version - put version
        self._queued_s = 0.0
        self.generating_max: int | None = None
        self.queued_max: int | None = None
        self.queued_s_max: float | None = None

    def record_sums(self, train_version: int, now: float, sums: Sequence[Any] | None) -> None:
        """Record trajectories trained at ``train_version``, handed out at monotonic time ``now``, by their
        :meth:`PutLog.sums` (``None``: nothing to record)."""
        if sums is None:
            return
        count, gen_sum, put_sum, time_sum, oldest, widest, first = sums
        self.count += count
        self._gen += put_sum - gen_sum
        self._queued += train_version * count - put_sum
        self._queued_s += now * count - time_sum
        if self.generating_max is None or widest > self.generating_max:
            self.generating_max = widest
        q = train_version - oldest
        if self.queued_max is None or q > self.queued_max:
            self.queued_max = q
        qs = now - first
        if self.queued_s_max is None or qs > self.queued_s_max:
            self.queued_s_max = qs

    def totals(self) -> tuple[int, int, int, float]:
        """``(count, versions generating, versions queued, seconds queued)`` summed so far."""
        return self.count, self._gen, self._queued, self._queued_s

    def means_since(self, before: Sequence[Any]) -> dict[str, float] | None:
        """``{"generating", "queued", "queued_s"}``: the means over the trajectories recorded since :meth:`totals`
        returned ``before`` (``None`` if none were)."""
        n = self.count - before[0]
        if n <= 0:
            return None
        return {"generating": (self._gen - before[1]) / n, "queued": (self._queued - before[2]) / n,
                "queued_s": (self._queued_s - before[3]) / n}

    def summary(self) -> dict[str, Any]:
        """``{count, generating_mean, generating_max, queued_mean, queued_max, queued_s_mean, queued_s_max}``
        (means ``nan`` and maxima ``None`` when empty)."""
        n = self.count
        return {"count": n, "generating_mean": self._gen / n if n else math.nan, "generating_max": self.generating_max,
                "queued_mean": self._queued / n if n else math.nan, "queued_max": self.queued_max,
                "queued_s_mean": self._queued_s / n if n else math.nan, "queued_s_max": self.queued_s_max}


class StalenessTracker:
    """Accumulates staleness per trained trajectory.

    Memory: two floats and one int per recorded trajectory (three Python lists).
    """

    def __init__(self) -> None:
        self.raw: list[int] = []
        self.arch: list[int] = []
        self.version_mean_staleness: list[float] = []
        self.span: list[int] = []

    def record(
        self, index: int, train_version: int, gen_versions: Iterable[int], version_means: Iterable[float] | None = None,
        spans: Iterable[int] | None = None,
    ) -> None:
        """Record one mini-batch.

        Args:
            index: The mini-batch's 0-based index ``k`` within its train batch (colocated staleness).
            train_version: Trainer version the gradient is computed with (before its optimizer step).
            gen_versions: ``gen_version`` (oldest among tokens) of each trajectory.
            version_means: Token-weighted mean version of each trajectory (optional).
            spans: Newest minus oldest token version of each trajectory (optional; partial rollouts).
        """
        for gv in gen_versions:
            s = train_version - int(gv)
            self.raw.append(s)
            self.arch.append(s - index)
        if version_means is not None:
            self.version_mean_staleness.extend(train_version - float(x) for x in version_means)
        if spans is not None:
            self.span.extend(int(x) for x in spans)

    def record_minibatch(self, mb: Any, train_version: int) -> None:
        """Record an :class:`~knitdata.admission.AdmittedMiniBatch` trained at ``train_version``."""
        self.record(
            mb.index,
            train_version,
            (t.gen_version for t in mb.trajectories),
            (t.version_mean for t in mb.trajectories),
            (getattr(t, "version_span", 0) for t in mb.trajectories),
        )

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state: the recorded staleness values, in order."""
        return {"raw": list(self.raw), "arch": list(self.arch), "version_mean": list(self.version_mean_staleness),
                "span": list(self.span)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (later records append to the loaded ones).

        Raises:
            StateError: A state of another shape.
        """
        raw = [state.get(k) for k in ("raw", "arch", "version_mean")] if isinstance(state, Mapping) else []
        parts: list[list[Any]] = [p for p in raw if isinstance(p, list)]
        if (len(parts) != 3 or len(parts[0]) != len(parts[1])
                or any(type(v) is not int for v in (*parts[0], *parts[1]))
                or any(type(v) not in (int, float) for v in parts[2])):
            raise StateError(f"not a StalenessTracker state {{raw, arch, version_mean}}: {str(state)[:200]}")
        self.raw, self.arch = list(parts[0]), list(parts[1])
        self.version_mean_staleness = [float(v) for v in parts[2]]
        span = state.get("span", [])
        if not isinstance(span, list) or any(type(v) is not int for v in span):
            raise StateError(f"not a StalenessTracker state: span must be a list of ints, got {str(span)[:200]}")
        self.span = list(span)

    def summary(self) -> dict[str, Any]:
        """``{"arch": {mean, positive_mean, p50, p95, share_negative, count}, "raw": {...}, "version_mean": {...},
        "span": {...}, "worst": int or None}``: per trajectory (``raw``, ``arch``) and per token (``version_mean``:
        mean token staleness, ``span``: newest minus oldest token version, ``worst``: the stalest token)."""
        return {
            "arch": summarize(self.arch),
            "raw": summarize(self.raw),
            "version_mean": summarize(self.version_mean_staleness),
            "span": summarize(self.span),
            "worst": max(self.raw) if self.raw else None,
        }
