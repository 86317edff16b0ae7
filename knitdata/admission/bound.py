"""The hard staleness bound of admission: expiry, dropped groups listed for regeneration, the rollout throttle.

Units. Every bound is in **versions as the trainer reports them** (:meth:`knitdata.Pipeline.report_version`: one
optimizer step per mini-batch, as :mod:`knitdata.staleness` counts). The mini-batch of global step ``t`` is trained
with version ``offset + t``, where ``offset`` is the trainer's version at step 0: given as ``version_offset``, or
(``version_offset=None``) learned from the trainer's versions: the first hand-out taken under a reported version
(:meth:`StalenessBound.note_handout`) or the first report (:meth:`StalenessBound.note_version`), whichever comes
first; a given one is checked the same way. A group
whose oldest token has version ``v`` may join steps up to ``v + eta_s - offset`` (``eta_s``: the bound of its source;
``max_staleness`` is an int or ``{source: int}``); a complete group past that is dropped whole (never admitted),
counted per source and listed for regeneration. Quotas are untouched: the policy's feasibility check counts only
groups still admissible.

Modes. ``on_stale="drop"``: producers run free; guaranteed: nothing admitted staler than its source's bound, exact
quotas. ``on_stale="wait"`` (needs a bound): producers also reserve within the policy's ``rollout_capacity``, which
follows the policy's own plan of the next steps; guaranteed besides: no deadlock (while admission waits for a step
and every reservation was delivered, a producer at the trainer's version, or lagging by up to ``eta``, gets room
for what the step needs) and nothing dropped when each source's groups arrive in the order they were started
(admission takes them in the order they expire, and waits for a reserved group that must join the step being
formed). Both are property-tested against an independent model (``tests/test_bound.py``).
"""

from __future__ import annotations

import bisect
import heapq
import warnings
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from knitdata.admission.composition import even_completion
from knitdata.errors import ConfigError, StateError, ValidationError

__all__ = ["ON_STALE", "REGENERATE_MEMORY", "FUTURE_SLACK", "ENTRIES_MEMORY", "StalenessBound", "WaitSchedule", "check_counts", "check_settings",
           "check_etas"]

#: How to keep a staleness bound: drop what expired (producers run free) or also throttle producers.
ON_STALE: tuple[str, ...] = ("drop", "wait")
#: Most dropped groups kept for the producer to regenerate (:meth:`StalenessBound.take_dropped`); older ones are
#: forgotten (counted as ``regenerate_overflow``).
REGENERATE_MEMORY = 100_000
#: How many versions a ``gen_version`` may be ahead of the newest reported one (a weight sync can reach a producer
#: before the trainer's report reaches the pipeline); newer is refused as a version from the future.
FUTURE_SLACK = 1
#: Most steps whose micro-batch counts are kept until the trainer's first report (to count the steps it finished);
#: a trainer that reports nothing for longer keeps the offset it has (given, or 0 assumed) and is not checked.
ENTRIES_MEMORY = 10_000
_COUNTERS = ("dropped_groups", "dropped_trajectories", "dropped_tokens")
#: Offset states: given (``version_offset`` int), assumed (learn mode, 0 while the versions agree), unknown (learn
#: mode, a version showed that 0 is wrong: admission holds until the first report), learned (from the first report).
_GIVEN, _ASSUMED, _UNKNOWN, _LEARNED = "given", "assumed", "unknown", "learned"


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


def _eta(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ConfigError(f"{what} must be an int >= 0 (versions as the trainer reports them), got {x!r}")
    return x


def check_etas(max_staleness: Any, sources: Sequence[str]) -> dict[str, int] | None:
    """``max_staleness`` (``None``, an int >= 0 or ``{source: int >= 0}`` naming every source) per source.

    Raises:
        ConfigError: Anything else (a mapping must name exactly the batch spec's sources).
    """
    if max_staleness is None:
        return None
    if isinstance(max_staleness, Mapping):
        unknown = sorted(set(map(str, max_staleness)) - set(sources))
        missing = [s for s in sources if s not in max_staleness]
        if unknown or missing:
            raise ConfigError(f"max_staleness {{source: eta}} must name every source of the batch spec {list(sources)}"
                              f" and no other (unknown {unknown}, missing {missing})")
        return {s: _eta(max_staleness[s], f"max_staleness[{s!r}]") for s in sources}
    e = _eta(max_staleness, "max_staleness")
    return dict.fromkeys(sources, e)


def check_settings(max_staleness: Any, on_stale: str, version_offset: int | None,
                   sources: Sequence[str] = ()) -> None:
    """Refuse a bad ``max_staleness`` (``None``, an int >= 0 or ``{source: int >= 0}``), ``on_stale`` (``"wait"``
    needs a bound) or ``version_offset`` (``None`` or an int >= 0) with :class:`~knitdata.errors.ConfigError`."""
    if isinstance(max_staleness, Mapping) and not sources:
        sources = [str(s) for s in max_staleness]
    check_etas(max_staleness, sources)
    if on_stale not in ON_STALE:
        raise ConfigError(f"on_stale must be one of {ON_STALE}, got {on_stale!r}")
    if on_stale == "wait" and max_staleness is None:
        raise ConfigError("on_stale='wait' throttles producers to a staleness bound, but max_staleness is None: pass "
                          "max_staleness=eta (versions) or leave on_stale='drop'")
    if version_offset is not None and (isinstance(version_offset, bool) or not isinstance(version_offset, int)
                                       or version_offset < 0):
        raise ConfigError(f"version_offset must be None (learn it from the trainer's first report_version) or the "
                          f"trainer's version at step 0, an int >= 0; got {version_offset!r}")


def _int(x: Any, what: str, lo: int | None = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or (lo is not None and x < lo):
        raise StateError(f"{what} must be an int{'' if lo is None else f' >= {lo}'}, got {str(x)[:50]}")
    return x


class WaitSchedule:
    """The rollout throttle of :class:`StalenessBound` and, in wait mode, the groups committed to the next steps
    (reserved, incomplete or ready, by the step each must join by): what the policies' capacity, composition and
    waiting consult."""

    etas: dict[str, int]
    on_stale: str
    sources: tuple[str, ...]
    offset: int | None
    mode: str
    reserved: dict[str, int]
    outstanding: dict[str, list[int]]
    ready_versions: dict[str, list[int]]
    schedule_cum: list[dict[str, int]]
    _Q: dict[str, int]
    _M: int
    _per_step: dict[str, int]

    def window(self, version: int, source: str, step: int) -> int:
        """How many steps from ``step`` on a group of ``source`` started now with ``version`` may still join: ``version
        + eta_s + 1 - offset - step`` (offset unknown: ``eta_s + 1``, the version taken as the trainer's now)."""
        if self.offset is None or self.mode == _UNKNOWN:
            return self.etas[source] + 1
        return max(0, int(version) + self.etas[source] + 1 - self.offset - step)

    def most(self, source: str, mm: int) -> int:
        """The most groups of ``source`` any window of the bound can hold (``eta_s + 1`` steps; fifo: of ``mm``
        groups each): a reservation of more can never be granted."""
        w = self.etas[source] + 1
        if source not in self._per_step:
            return w * mm
        batches = -(-w // self._M) + 1
        return min(w * self._per_step[source], batches * self._Q[source])

    def reserve(self, want: Mapping[str, int], cap: Mapping[str, int], version: int = 0,
                total: int | None = None) -> bool:
        """Reserve ``want`` groups to start with ``version`` if ``cap`` (the policy's capacity) has room for all of
        it and their sum is at most ``total`` (a room the sources share), all or nothing."""
        if any(n > cap[s] for s, n in want.items()):
            return False
        if total is not None and sum(want.values()) > total:
            return False
        for s, n in want.items():
            self.reserved[s] += n
            for _ in range(n):
                bisect.insort(self.outstanding[s], int(version))
        return True

    def unreserve(self, want: Mapping[str, int]) -> None:
        """Give back reservations (floored at 0; the newest first)."""
        for s, n in want.items():
            n = min(n, self.reserved[s])
            self.reserved[s] -= n
            del self.outstanding[s][len(self.outstanding[s]) - n:]

    def arrived(self, source: str, version: int = 0) -> None:
        """A new group of ``source`` arrived (its first member, of ``version``): it ends one reservation, if any (the
        group keeps its place among the committed groups), else it joins them."""
        if self.reserved[source]:
            self.reserved[source] -= 1
        elif self.on_stale == "wait":
            bisect.insort(self.outstanding[source], int(version))

    def settled(self, source: str, version: int) -> None:
        """A committed group of ``source`` and ``version`` became ready, was dropped at arrival or withdrawn: its
        entry leaves (that version's, else the newest older one: a producer that got newer weights, else the
        oldest)."""
        out = self.outstanding[source]
        if not out or len(out) <= self.reserved[source]:
            return
        i = bisect.bisect_right(out, version) - 1
        del out[max(i, 0)]

    def due(self, step: int, source: str) -> bool:
        """Wait mode: whether a committed group of ``source`` that is not ready yet must join ``step`` (its version
        is ``offset + step - eta_s``): admitting ``step`` without it would drop it."""
        out = self.outstanding[source]
        if not out or self.offset is None or self.mode == _UNKNOWN:
            return False
        v = self.offset + step - self.etas[source]
        i = bisect.bisect_left(out, v)
        return i < len(out) and out[i] == v

    def readied(self, source: str, version: int) -> None:
        """Wait mode: a group of ``source`` and ``version`` is ready (kept sorted, to count by deadline)."""
        if self.on_stale == "wait":
            bisect.insort(self.ready_versions[source], version)

    def unready(self, source: str, version: int) -> None:
        """Wait mode: a ready group of ``source`` and ``version`` was admitted, dropped or withdrawn."""
        if self.on_stale == "wait":
            vs = self.ready_versions[source]
            i = bisect.bisect_left(vs, version)
            if i < len(vs) and vs[i] == version:
                del vs[i]

    def committed(self, source: str, step: int, last: int, ready_only: bool = False) -> int:
        """Committed groups of ``source`` (ready, or also reserved and incomplete) whose last step is in
        ``step..last``."""
        eta, off = self.etas[source], self.offset
        assert off is not None
        lo, hi = step + off - eta, last + off - eta  # the versions of those last steps
        n = 0
        for vs in (self.ready_versions[source],) if ready_only else (self.ready_versions[source],
                                                                       self.outstanding[source]):
            n += bisect.bisect_right(vs, hi) - bisect.bisect_left(vs, lo)
        return n

    def least(self, source: str, step: int, after: int, left: int, per_step: int) -> int:
        """Wait mode: the fewest groups of ``source`` that ``step`` must take so that every committed group of it
        (ready, reserved or incomplete) can still join by its last step, given at most ``per_step`` groups a step,
        ``left`` of its quota in this train batch and ``after`` steps left in it after ``step`` (later train batches:
        its quota each). O(eta log n)."""
        if self.offset is None or self.mode == _UNKNOWN:
            return 0
        Q, M = self._Q[source], self._M
        low = 0
        for n in range(self.etas[source] + FUTURE_SLACK + 1):  # last step d = step + n
            n1 = min(n, after)
            nb, r = divmod(n - n1, M)
            later = nb * Q + min(r * per_step, Q)
            low = max(low, self.committed(source, step, step + n) - later - min(n1 * per_step, max(0, left)))
        return low

    def room(self, step: int, size: int, windows: Mapping[str, int], floors: Mapping[str, int] | None = None,
             forced: Mapping[str, Sequence[int]] | None = None) -> dict[str, int]:
        """Wait mode: per source ``s``, how many more groups whose last step is ``step + windows[s] - 1`` the steps
        from ``step`` on can still hold beside every committed group (ready, reserved or incomplete) of any source
        that must join by then or later: ``min`` over ``d >= that last step`` of the ``(d - step + 1) * size``
        slots minus, per source, its committed groups whose last step is in ``step..d`` or what those steps must
        take of it anyway, whichever is more (``s``'s own unfilled forced slots are its to use). What ``k`` steps
        from ``step`` on must take of ``x``: ``forced[x][k]`` (its lower bounds, what its quota forces), else (and
        beyond that row) its per-step lower bound ``floors[x]`` (groups) a step. O(S^2 eta log n)."""
        if self.offset is None or self.mode == _UNKNOWN or self.on_stale != "wait":
            return {s: 1 << 62 for s in windows}
        floors = floors or {}

        def must(x: str, k: int) -> int:
            row = forced.get(x) if forced is not None else None
            if not row:
                return k * floors.get(x, 0)
            return row[k] if k < len(row) else row[-1] + (k - len(row) + 1) * floors.get(x, 0)

        top = max(self.etas.values()) + FUTURE_SLACK
        far = 1 << 40
        counts = [{s: self.committed(s, step, step + n) for s in self.sources} for n in range(top + 1)]
        counts.append({s: self.committed(s, step, step + far) for s in self.sources})  # beyond: what is free only grows
        out: dict[str, int] = {}
        for s, w in windows.items():
            if w < 1:
                out[s] = 0
                continue
            best = None
            for n in range(min(w - 1, top + 1), top + 2):
                steps = n + 1 if n <= top else max(w, top + 2)
                c = counts[n]
                taken = sum(max(c[x], must(x, steps)) for x in self.sources)
                free = steps * size - taken + max(0, must(s, steps) - c[s])
                best = free if best is None else min(best, free)
            out[s] = max(0, best or 0)
        return out

    def short(self, step: int, size: int, forced: Mapping[str, Sequence[int]] | None = None,
              most: Mapping[str, int] | None = None) -> bool:
        """Wait mode: whether ``step`` (``size`` groups) must wait for a reserved or incomplete group. For each later
        step ``d = step + n``, the committed groups of each source ``x`` that must join by ``d`` (``E_x``), or what
        the ``n`` steps after this one must take of ``x`` anyway (``forced[x][n]``: its per-step lower bounds and
        what its quota forces), whichever is more, must fit those ``n * size`` slots; this step has to take the
        excess from the groups that must join by ``d`` (at most ``most[x]`` of source ``x``: its per-step upper
        bound and what its quota leaves), and waits when the ready ones cannot cover it but all of them, once
        arrived, can (so waiting ends). O(S eta log n)."""
        if self.offset is None or self.mode == _UNKNOWN:
            return False
        for n in range(max(self.etas.values()) + FUTURE_SLACK + 1):
            due = {s: self.committed(s, step, step + n) for s in self.sources}
            must = {s: 0 if forced is None else forced[s][min(n, len(forced[s]) - 1)] for s in self.sources}
            excess = sum(max(e, must[s]) for s, e in due.items()) - n * size
            if excess <= 0 or excess > size:
                continue  # fits, or cannot fit whatever this step takes
            top = {s: max(0, due[s] - must[s]) if most is None else min(max(0, due[s] - must[s]), most[s])
                   for s in self.sources}
            if sum(top.values()) < excess:
                continue  # cannot fit even once every committed group arrived: waiting would not help
            if sum(min(self.committed(s, step, step + n, True), top[s]) for s in self.sources) < excess:
                return True
        return False


class StalenessBound(WaitSchedule):
    """The bound's state: settings, the trainer's version offset, reservations, the expiry heap, drops, starvation.

    Args:
        max_staleness: ``eta`` in versions: an int >= 0, or ``{source: int >= 0}`` (every source).
        on_stale: ``"drop"`` or ``"wait"`` (producers also reserve within the policy's ``rollout_capacity``).
        version_offset: The trainer's version at step 0, or ``None``: learned from its first report
            (:meth:`note_version`).
        quotas: Groups per source per train batch.
        num_minibatches: ``M``.
        per_step: Most groups of each source in one mini-batch (the spec's upper bounds); default: the quota.

    Raises:
        ConfigError: A bad setting.
    """

    def __init__(self, max_staleness: Any, on_stale: str, version_offset: int | None, quotas: Mapping[str, int],
                 num_minibatches: int, per_step: Mapping[str, int] | None = None) -> None:
        check_settings(max_staleness, on_stale, version_offset, tuple(quotas))
        etas = check_etas(max_staleness, tuple(quotas))
        assert etas is not None
        self.eta: Any = dict(max_staleness) if isinstance(max_staleness, Mapping) else max_staleness
        self.etas: dict[str, int] = etas
        self.on_stale, self.version_offset = on_stale, version_offset
        self.sources = tuple(quotas)
        self._Q, self._M = dict(quotas), num_minibatches
        self._per_step = dict(per_step) if per_step is not None else dict(quotas)
        self.reserved: dict[str, int] = dict.fromkeys(quotas, 0)
        self.counts: dict[str, dict[str, int]] = {k: dict.fromkeys(quotas, 0) for k in _COUNTERS}
        self.overflow = 0
        self.regenerate: deque[dict[str, Any]] = deque()
        self.released: list[Any] = []  # members of groups dropped since pop_released (payloads to free)
        self.expiry: list[tuple[int, int, Any]] = []  # (version + eta of its source, seq, ready group)
        self.schedule_cum = [dict.fromkeys(quotas, 0)]  # groups of each source in the first r mini-batches
        for col in even_completion(self._Q, num_minibatches):
            self.schedule_cum.append({s: self.schedule_cum[-1][s] + col[s] for s in quotas})
        # the trainer's version at step 0 (see _GIVEN ...); until the first report: micro-batches per rank planned
        # before each step (to count the steps a trainer finished) and per source the stalest admitted group
        self.offset: int | None = 0 if version_offset is None else version_offset
        self.mode = _GIVEN if version_offset is not None else _ASSUMED
        self.hold: int | None = None  # mode unknown: no step >= hold is admitted until the first report
        self.max_reported: int | None = None
        self.entries: list[int] | None = [0]
        self.pre: dict[str, int] = {}  # rank -> its position after what it handed out before any version report
        self.resumed: dict[str, int] = {}  # rank -> the steps a state it loaded had finished (before any report)
        self.worst: dict[str, list[Any]] = {}  # source -> [step - version, trajectory id] admitted before a report
        self.streak: dict[str, int] = dict.fromkeys(quotas, 0)  # groups dropped since the source's last admission
        self.warned: set[str] = set()  # sources a starvation warning named
        # wait mode: per source the versions of the groups committed and not ready (reserved or incomplete), sorted
        self.outstanding: dict[str, list[int]] = {s: [] for s in quotas}
        self.ready_versions: dict[str, list[int]] = {s: [] for s in quotas}  # wait mode: of the ready groups, sorted

    # -- settings and versions ---------------------------------------------------------------------------------
    def settings(self) -> list[Any]:
        """``[max_staleness, on_stale, version_offset]`` (as given)."""
        return [self.eta, self.on_stale, self.version_offset]

    def expired(self, version: int, step: int, source: str) -> bool:
        """Whether a group of ``source`` of oldest version ``version`` is staler than its bound at global step ``step``
        (never while the offset is unknown)."""
        return self.offset is not None and self.mode != _UNKNOWN and \
            self.offset + step - version > self.etas[source]

    def holds(self, step: int) -> bool:
        """Whether admission of ``step`` waits for the trainer's first version report (offset unknown)."""
        return self.mode == _UNKNOWN and self.hold is not None and step >= self.hold

    def offered(self, version: int, step: int) -> None:
        """A group of oldest version ``version`` is offered while admission is at ``step``: in learn mode before any
        report, a version newer than ``step`` (``0 + step`` + slack) shows that the trainer did not start at 0, and
        admission holds after what is admitted until the trainer reports its version."""
        if self.mode == _ASSUMED and version > step + FUTURE_SLACK:
            self.mode, self.offset, self.hold = _UNKNOWN, None, max(step, 1)
            warnings.warn(
                f"staleness bound: a trajectory of version {version} arrived at step {step} before the trainer "
                f"reported any version, so its versions do not start at 0; admission holds after step "
                f"{self.hold - 1} until pipe.report_version() tells the trainer's version (or pass "
                f"version_offset=<the trainer's version at step 0>)", RuntimeWarning, stacklevel=2)

    def note_planned(self, microbatches: int) -> None:
        """The next admitted step was planned with ``microbatches`` micro-batches per rank (kept until the first
        report, to count the steps the trainer finished)."""
        if self.entries is not None:
            self.entries.append(self.entries[-1] + int(microbatches))
            if len(self.entries) > ENTRIES_MEMORY:
                self.entries, self.worst, self.pre, self.resumed = None, {}, {}, {}

    def note_handed(self, rank: int, position: int) -> None:
        """Rank ``rank`` handed out the micro-batches before ``position`` before its process reported any version
        (kept until the first report: the steps the trainer finished when it reported)."""
        if self.entries is not None:
            key = str(rank)
            if position > self.pre.get(key, 0):
                self.pre[key] = position

    def note_resumed(self, rank: int, steps: int) -> None:
        """Rank ``rank`` loaded a state saved after ``steps`` finished steps (a new job refilled with the same puts:
        its trainer finished them in the job that saved the state). Kept until the first report, which counts them
        as done (the trainer reports the restored version before the refill has planned those steps again)."""
        if self.entries is not None:
            key = str(rank)
            if steps > self.resumed.get(key, 0):
                self.resumed[key] = steps

    def done_before_report(self, ranks: int) -> tuple[int, int]:
        """The fewest and most steps ``ranks`` ranks finished before their processes reported a version: by their
        hand-outs, or by the state each loaded (:meth:`note_resumed`)."""
        done = [max(self.steps_done(self.pre.get(str(r), 0)), self.resumed.get(str(r), 0))
                for r in range(ranks)] or [0]
        return min(done), max(done)

    def steps_done(self, position: int) -> int:
        """How many admitted steps lie wholly before hand-out ``position`` of a rank (before the first report)."""
        if self.entries is None:
            return 0
        return max(0, bisect.bisect_right(self.entries, position) - 1)

    def note_admitted(self, step: int, metas: Sequence[Any], source: str) -> None:
        """A group of ``source`` was admitted at ``step`` (resets its starvation streak; before the first report,
        keeps the stalest group per source for the check at the report)."""
        self.streak[source] = 0
        if self.mode in (_GIVEN, _LEARNED) or self.entries is None:
            return
        m = min(metas, key=lambda x: x.gen_version)
        w = self.worst.get(source)
        if w is None or step - m.gen_version > w[0]:
            self.worst[source] = [step - m.gen_version, m.id]

    def note_version(self, version: int, done_lo: int, done_hi: int) -> str | None:
        """The trainer reported ``version`` having finished ``done_lo..done_hi`` steps (the fewest and most of its
        ranks' hand-outs before any report): unless a hand-out told it first (:meth:`note_handout`), the first report
        learns the offset ``version - done_lo`` (learn mode) or checks the given one. Returns the error message when
        a mini-batch already admitted broke the bound under the trainer's real versions, or ``version_offset``
        understates them (the pipeline stops with it), else ``None``."""
        self.max_reported = version if self.max_reported is None else max(self.max_reported, version)
        if self.entries is None:
            return None
        return self._settle(version - done_lo, version - done_hi,
                            f"the trainer's first report_version ({version} after {done_lo} steps)")

    def note_handout(self, j: int, version: int) -> str | None:
        """A rank's micro-batch ``j`` (its ``j``-th over the run) was handed out under ``version``, the version its
        process last reported (``-1``: none): the first such version learns the offset exactly (the trainer takes
        step ``t`` with version ``offset + t``), or checks the given one. Returns an error message as
        :meth:`note_version`."""
        if self.entries is None or version < 0:
            return None
        t = max(0, bisect.bisect_right(self.entries, j) - 1)
        return self._settle(version - t, version - t, f"the trainer's version {version} at step {t}")

    def _settle(self, off_lo: int, off_hi: int, how: str) -> str | None:
        """Learn (or check) the offset from the trainer's versions: ``off_lo`` the highest it can be, ``off_hi`` the
        lowest."""
        self.entries, self.pre, self.resumed = None, {}, {}
        err = None
        if self.mode == _GIVEN:
            if self.offset is not None and off_hi > self.offset:
                err = (f"{how} shows that it trained step 0 with version {off_hi}, not version_offset={self.offset}: "
                       f"the staleness bound would count {off_hi - self.offset} version(s) too few; pass "
                       f"version_offset={off_hi} (or leave it None to learn it from the trainer)")
        else:
            for s, (gap, tid) in self.worst.items():
                if off_lo + gap > self.etas[s]:
                    err = (f"trajectory {tid!r} (source {s!r}) was admitted {off_lo + gap} versions stale > "
                           f"max_staleness {self.etas[s]}: it was admitted before {how} showed that it trained step 0 "
                           f"with version {off_lo}; pass version_offset={off_lo}, or report the version before the "
                           "first step")
                    break
            self.offset, self.mode, self.hold = off_lo, _LEARNED, None
        self.worst = {}
        return err

    # -- expiry ------------------------------------------------------------------------------------------------
    def push(self, grp: Any) -> None:
        """Track a ready group (``version``, ``source``, ``seq``, ``gone``) for expiry."""
        heapq.heappush(self.expiry, (grp.version + self.etas[grp.source], grp.seq, grp))

    def expiring(self, step: int) -> Iterator[Any]:
        """Pop and yield each tracked group (not ``gone``) that is staler than its bound at ``step``."""
        h = self.expiry
        if self.offset is None or self.mode == _UNKNOWN:
            while h and h[0][2].gone:
                heapq.heappop(h)
            return
        while h and (h[0][2].gone or self.offset + step > h[0][0]):
            grp = heapq.heappop(h)[2]
            if not grp.gone:
                yield grp

    # -- drops and starvation ----------------------------------------------------------------------------------
    def starve_after(self, source: str) -> int:
        """Groups of ``source`` dropped in a row (none admitted) after which it counts as starved."""
        return max(2, self._Q[source])

    def drop(self, group: str, source: str, version: int, metas: Sequence[Any], step: int,
             needy: bool = True) -> None:
        """Record a dropped group: counted, listed for regeneration, its members to release. ``needy``: the source
        still owes its quota and has no group ready: such drops in a row (none of its groups admitted in between)
        flag it as starved, with a warning that names it (once per source)."""
        tokens = sum(int(m.num_tokens) for m in metas)
        for key, n in zip(_COUNTERS, (1, len(metas), tokens)):
            self.counts[key][source] += n
        self.regenerate.append({"group": group, "source": source, "version": version,
                                "trajectories": [m.id for m in metas], "tokens": tokens, "step": step})
        while len(self.regenerate) > REGENERATE_MEMORY:
            self.regenerate.popleft()
            self.overflow += 1
        self.released.extend(metas)
        if not needy:
            return
        self.streak[source] += 1
        if self.streak[source] == self.starve_after(source) and source not in self.warned:
            self.warned.add(source)  # once per source (the stats keep the live flag)
            warnings.warn(
                f"staleness bound: source {source!r} is starved: {self.streak[source]} of its groups in a row arrived "
                f"staler than max_staleness {self.etas[source]} (step {step}) while its quota waited for them, and "
                f"were dropped; its quota cannot be met within the bound unless it delivers fresher groups (regenerate them under the "
                "current weights, or raise its max_staleness)", RuntimeWarning, stacklevel=2)

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
        """Settings, the trainer's version offset, reservations, drops and starvation per source, JSON-ready.

        ``starved``: ``{source: bool}``, whether ``max(2, quota)`` groups of the source in a row were dropped while
        its quota waited for them (nothing of it ready; none admitted since); ``drop_streak``: those counts; ``offset``: the trainer's version at step 0 in use
        (``None``: unknown, admission waits for the first report), ``offset_mode``: given, assumed, unknown or
        learned; ``max_staleness_by_source``: each source's bound."""
        return {"max_staleness": self.eta, "on_stale": self.on_stale, "version_offset": self.version_offset,
                "max_staleness_by_source": dict(self.etas), "offset": self.offset, "offset_mode": self.mode,
                "reserved": dict(self.reserved), "to_regenerate": len(self.regenerate),
                **{k: dict(v) for k, v in self.counts.items()}, "regenerate_overflow": self.overflow,
                "starved": {s: n >= self.starve_after(s) for s, n in self.streak.items()},
                "drop_streak": dict(self.streak)}

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The JSON-serializable state (the expiry heap is rebuilt from the policy's ready groups)."""
        return {"max_staleness": self.eta, "on_stale": self.on_stale, "version_offset": self.version_offset,
                "reserved": dict(self.reserved), "regenerate": list(self.regenerate),
                "stale": {**{k: dict(v) for k, v in self.counts.items()}, "regenerate_overflow": self.overflow},
                "versions": {"offset": self.offset, "mode": self.mode, "hold": self.hold,
                             "max_reported": self.max_reported, "entries": self.entries,
                             "worst": dict(self.worst), "streak": dict(self.streak), "pre": dict(self.pre),
                             "outstanding": {s: list(v) for s, v in self.outstanding.items()},
                             **({"resumed": dict(self.resumed)} if self.resumed else {})}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (settings already checked by the policy; a state without ``versions``, of an
        older release, keeps the offset of the settings).

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
            v = state.get("versions")
            if v is not None:
                mode = v["mode"]
                if mode not in (_GIVEN, _ASSUMED, _UNKNOWN, _LEARNED) or (mode == _GIVEN) != \
                        (self.version_offset is not None):
                    raise StateError(f"bound.versions.mode {str(mode)[:20]} does not fit version_offset "
                                     f"{self.version_offset}")
                offset = None if v["offset"] is None else _int(v["offset"], "versions.offset", None)
                hold = None if v["hold"] is None else _int(v["hold"], "versions.hold")
                top = None if v["max_reported"] is None else _int(v["max_reported"], "versions.max_reported")
                ent = v["entries"]
                entries = None if ent is None else [_int(x, "versions.entries") for x in ent]
                worst = {str(s): [_int(w[0], "versions.worst", None), str(w[1])] for s, w in v["worst"].items()
                         if s in self.etas}
                streak = {s: _int(v["streak"].get(s, 0), f"versions.streak.{s}") for s in self.sources}
                pre = {str(r): _int(n, "versions.pre") for r, n in v.get("pre", {}).items()}
                resumed = {str(r): _int(n, "versions.resumed") for r, n in v.get("resumed", {}).items()}
                outstanding = {s: sorted(_int(x, f"versions.outstanding.{s}", None)
                                         for x in v.get("outstanding", {}).get(s, [])) for s in self.sources}
                if (offset is None) != (mode == _UNKNOWN) or (entries is not None and not entries):
                    raise StateError(f"bound.versions is inconsistent: {str(v)[:100]}")
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise StateError(f"not a staleness-bound state: {e!r}") from e
        self.reserved, self.regenerate, self.counts, self.overflow = reserved, deque(regen), counts, overflow
        if v is not None:
            self.offset, self.mode, self.hold, self.max_reported = offset, mode, hold, top
            self.entries, self.worst, self.streak = entries, worst, streak
            self.outstanding, self.pre, self.resumed = outstanding, pre, resumed
        else:  # an older release's state: its offset was given; no first report to check
            self.entries = None
