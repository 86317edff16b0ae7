"""The state the parts of the control plane share, its options and the helpers more than one part needs.

:class:`PlaneState` holds what several parts of a :class:`~knitdata.control.ControlPlane` share, under one lock
(:attr:`PlaneState.cond`): the options it was built with, admission, placement and planning, the trajectories
held, the per-rank queues and positions, counters. What one part owns lives in that part (the admission part's
schema and withdrawn groups) or in an object of one concern held here:
:class:`~knitdata.control.observed.Observations` (reporting), :class:`LeaseBook` (leases), :class:`Journaling`
(durability), :class:`~knitdata.control.fingerprints.ReplayMarks` (the replay fingerprints, the run's mark and the
layout history: planning, positions and the reshape part). The shared state, the replay marks, the admission
part, the observations and the reshape part each write their own slice of a snapshot (``state_dict`` /
``load_state_dict``); :class:`~knitdata.control.durability.Durability` only gathers them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_, itemgetter
from typing import Any, cast

from knitdata.admission import AdmissionPolicy, AdmittedMiniBatch, BatchSpec, make_policy
from knitdata.control.fingerprints import FP_EMPTY, ReplayMarks, entry_fingerprint
from knitdata.control.held import HeldTrajectories, RecentIds
from knitdata.control.journal import Journal
from knitdata.control.observed import Observations
from knitdata.control.records import ConsumerId, ItemRef, PlanEntry, item_refs
from knitdata.errors import ConfigError, KnitdataError, PipelineClosedError
from knitdata.observe import trace as tracing
from knitdata.placement import ConsumerLayout, make_placement
from knitdata.planner import MicroBatchInfo, MiniBatchPlan, Planner
from knitdata.reclaim import Graveyard
from knitdata.record import TrajectoryMeta
from knitdata.staleness import PutLog, TokenStaleness

__all__ = ["PlaneState", "Lease", "LeaseBook", "Journaling", "RELEASE_MODES", "PLANE_DEFAULTS", "LEASE_TTL_S", "PRODUCER_TTL_S",
           "DELIVERED_MEMORY", "WITHDRAWN_MEMORY", "PUT_LOG_PRUNE", "FP_KEEP", "FP_EMPTY", "RECENT_RELEASES", "SNAPSHOT_FORMAT",
           "fields_of", "entry_fingerprint", "fenced_message", "Replicas", "RecentIds"]

_first = itemgetter(0)  # the trajectory id of a queue item (ItemRef)
_location = attrgetter("location")
_seq = attrgetter("seq")
#: The put log is pruned (stamps of trajectories no longer held forgotten) when it holds this many stamps, or twice
#: as many as after the last pruning.
PUT_LOG_PRUNE = 4096

#: When payloads leave storage (see :mod:`knitdata.control.plane`).
RELEASE_MODES: tuple[str, ...] = ("step", "commit", "handout")

#: Defaults of the options every engine shares.
PLANE_DEFAULTS: dict[str, Any] = {
    "admission": "constraint_preserving",
    "admission_options": {},
    "token_budget": 8192,
    "placement": "consumer_aware",
    "allow_split_groups": False,
    "balance_tolerance": 0.1,
    "release": "step",
    "producer_timeout_s": 15.0,
}

#: How many delivered-and-released trajectory ids the plane remembers, to refuse a producer's retry of a put
#: that was accepted, delivered and released (its answer lost with the producer).
DELIVERED_MEMORY = 1 << 16
#: How many withdrawn group ids the plane remembers, to refuse late members.
WITHDRAWN_MEMORY = 1 << 16
#: Seconds after its last renewal after which an iterator's lease counts as expired: a newer iterator of the same
#: rank (and worker) then takes it over without the old one's consent (a consumer process died or froze). A live
#: consumer renews its lease every :data:`~knitdata.consumer.handoff.HEARTBEAT_S` from a background thread and gives it up
#: at once when a newer iterator asks for it; it hands nothing out past its own, shorter, local deadline.
LEASE_TTL_S = 3.0
#: Seconds without a report after which a producer process counts as gone (it died without close()).
PRODUCER_TTL_S = 10.0
#: Prefix fingerprints of a rank's micro-batches kept below its committed position (states of DataLoader workers
#: may lie up to ``num_workers - 1`` micro-batches below it).
FP_KEEP = 64
#: How many released trajectory ids a snapshot keeps, to send their releases again after a recovery.
RECENT_RELEASES = 8192
#: The version of :meth:`ControlPlane.state_dict`'s format (2 adds the replay fingerprints, 3 the reshape part:
#: layout history and the queued mini-batches; 1 and 2 are still read).
SNAPSHOT_FORMAT = 3


@dataclass
class Lease:
    """The live iterator of one (rank, worker): its token, epoch, who holds it, when it last renewed, and who asked
    for it (a newer iterator waits for it to let go)."""

    token: str
    epoch: int
    holder: str
    renewed: float
    fence_by: str | None = None


@dataclass
class Replicas:
    """The tensor/pipeline-parallel replicas of every rank (registered by their datasets): each replica receives
    the rank's micro-batches and has a position of its own; an entry is released once every replica is past it.

    Attributes:
        num: Replicas per rank.
        committed: ``committed[rank][replica]``: the replica's entries below are committed (the rank's committed
            position is the smallest over its replicas).
        position: ``position[rank][replica]``: the next entry of the replica's iterator.
        handed: ``handed[rank][j]`` (``release="handout"``): the bit mask of the replicas that handed entry ``j``
            out (released when every replica did).
    """

    num: int
    committed: list[list[int]]
    position: list[list[int]]
    handed: list[dict[int, int]]

    def to_dict(self) -> dict[str, Any]:
        """JSON: ``{"num", "committed", "position", "handed": [[[j, mask], ...] per rank]}``."""
        return {"num": self.num, "committed": [list(r) for r in self.committed],
                "position": [list(r) for r in self.position],
                "handed": [[[j, m] for j, m in sorted(h.items())] for h in self.handed]}


def fenced_message(rank: int, worker: int, by: str, replica: int = 0) -> str:
    """The message of :class:`~knitdata.errors.FencedError` for ``(rank, worker)`` (of ``replica``) taken over by
    ``by``."""
    rank_s = f"{rank}" if not replica else f"{rank} replica {replica}"
    return (f"rank {rank_s} (worker {worker}) was taken over by a newer iterator ({by}) while this one was alive: this "
            "iterator stops here, and the micro-batches it had not handed out go to the newer one (each rank has one "
            "consumer; if this process was replaced, let it exit)")


def fields_of(scalars: Iterable[str], tensors: Mapping[str, str]) -> dict[str, Any]:
    """The schema record of a trajectory: its scalar names and its tensor fields' dtypes."""
    return {"scalars": sorted(scalars), "tensors": {k: str(v) for k, v in sorted(tensors.items())}}


@dataclass
class Journaling:
    """The journal of a plane and the bookkeeping of journaled calls (owned by
    :class:`~knitdata.control.durability.Durability`; :func:`~knitdata.control.surface.control_call` reads it).

    Attributes:
        journal: Where journaled calls are recorded (or ``None``).
        depth: How deep the journaled calls running now are nested.
        replaying: Whether a recovery replays the journal (calls are not recorded again).
        log: The hook that records one call.
        replayed: Journal records the last recovery replayed.
        snapshot_loaded: Whether the last recovery loaded a snapshot.
    """

    journal: Journal | None = None
    depth: int = 0
    replaying: bool = False
    log: Callable[[str, Sequence[Any]], None] | None = None
    replayed: int = 0
    snapshot_loaded: bool = False


class LeaseBook:
    """The live iterators of the ranks and the producers that report (written by
    :class:`~knitdata.control.leases.Leases`; a reshape drops the leases of removed ranks; reporting reads the
    producers). Not in snapshots.

    Args:
        producer_timeout_s: Seconds consumers keep waiting once every producer stopped without ``close()``.
    """

    def __init__(self, producer_timeout_s: float | None) -> None:
        self.leases: dict[ConsumerId, Lease] = {}  # (rank, worker, replica) -> its live iterator
        self.epochs: dict[ConsumerId, int] = {}
        # producers that put here: id -> [holder, last report, any of its putting threads alive, when they ended]
        self.producers: dict[str, list[Any]] = {}
        self.producer_timeout_s = producer_timeout_s

    def take(self, key: ConsumerId, token: str, holder: str, now: float) -> Lease:
        """Give the lease of ``key`` to ``token`` under a new epoch."""
        epoch = self.epochs.get(key, 0) + 1
        self.epochs[key] = epoch
        lease = self.leases[key] = Lease(token, epoch, holder or token[:8], now)
        return lease


class PlaneState:
    """What the parts of one control plane share (use it under :attr:`cond`); see the module for what they own.

    Args:
        config: JSON-like options: ``spec``, ``layout`` and the keys of :data:`PLANE_DEFAULTS`.
        unit_nodes: ``{storage unit id: layout node}``.
        releaser: ``releaser(unit_id, ids, wait)`` drops payloads from a unit.
        policy: An admission policy object to use instead of ``config["admission"]``.
        on_plan: Called as ``on_plan(admitted, plan)`` after each mini-batch is planned.
        journal: Where journaled calls are recorded (or ``None``).
        graveyard: Released metadata and plan entries are kept there and freed later, off the releasing thread
            (:mod:`knitdata.reclaim`; ``None``: freed at release). One that keeps (the embedded engine's) also
            leaves a commit's trajectories to be forgotten at the next read of the held tables
            (:mod:`knitdata.control.held`).

    Raises:
        ConfigError: Inconsistent options.
    """

    def __init__(self, config: Mapping[str, Any], unit_nodes: Mapping[str, str],
                 releaser: Callable[[str, list[str], bool], Any], *, policy: AdmissionPolicy | None = None,
                 on_plan: Callable[[AdmittedMiniBatch, MiniBatchPlan], None] | None = None,
                 journal: Journal | None = None, graveyard: Graveyard | None = None) -> None:
        cfg = {**PLANE_DEFAULTS, **dict(config)}
        self.config = cfg
        self.base_layout = cfg["layout"]  # the layout the plane was built with (a reshape changes config["layout"])
        self.spec = BatchSpec.from_dict(cfg["spec"])
        self.layout = ConsumerLayout.from_dict(cfg["layout"])
        if cfg["release"] not in RELEASE_MODES:
            raise ConfigError(f"release must be one of {RELEASE_MODES}, got {cfg['release']!r}")
        self.release_mode: str = cfg["release"]
        self.policy = policy if policy is not None else make_policy(
            cfg["admission"], self.spec, **dict(cfg.get("admission_options") or {}))
        self.unit_nodes = dict(unit_nodes)
        self.placement = make_placement(cfg["placement"], list(self.unit_nodes))
        self.planner = Planner(self.layout, int(cfg["token_budget"]),
                               allow_split_groups=bool(cfg["allow_split_groups"]),
                               locality=self.placement.consumer_aware,
                               balance_tolerance=float(cfg["balance_tolerance"]), unit_nodes=self.unit_nodes)
        self.releaser = releaser
        #: The trajectories held (live, put tokens, loss tokens) and what commits left to forget.
        self._held = HeldTrajectories(graveyard)
        #: Where released metadata and plan entries go to be freed later (limit 0: freed at release).
        self._graveyard = self._held.graveyard
        self.on_plan = on_plan
        self.cond = threading.Condition(threading.RLock())
        n = self.layout.num_consumers
        self.put_log = PutLog()  # each put's trainer version and time, by seq (staleness split; not in snapshots)
        self.put_log_prune_at = PUT_LOG_PRUNE
        self._seq = 0
        self.seq = 0
        self.delivered = RecentIds(DELIVERED_MEMORY)  # released after planning
        self.pending: dict[str, TrajectoryMeta] = {}  # admitted to the policy, not in a mini-batch yet
        self.queues: list[dict[int, PlanEntry]] = [{} for _ in range(n)]
        #: The token staleness sums of each queued entry (:meth:`~knitdata.staleness.TokenStaleness.sums`), made when
        #: it is planned, so that its hand-out does not visit its trajectories; not in snapshots (an entry restored
        #: or reshaped has none: its hand-out visits them).
        self.entry_sums: list[dict[int, Any]] = [{} for _ in range(n)]
        self.planned = [0] * n  # entries appended per rank
        self.committed = [0] * n  # entries below are released
        self.position = [0] * n  # next entry of the rank's iterator (handed out below)
        self.lease_book = LeaseBook(cfg.get("producer_timeout_s"))  # leases and producers (Leases writes them)
        # tensor/pipeline-parallel replicas of each rank (None: one consumer per rank, until a dataset registers them)
        self.replicas: Replicas | None = None
        #: Replay fingerprints, the run's mark, the layout history and the queued mini-batches' records (planning
        #: extends them, positions check against them, the reshape part rewrites them).
        self.replay = ReplayMarks(n)
        self.closed = False
        self.close_report: dict[str, Any] | None = None
        self.error: KnitdataError | None = None
        #: The admission part's poll (set by it): a version report can free admission (the bound learned its offset).
        self.admission_poll: Callable[[], Any] | None = None
        self.version = 0
        #: Observations for reporting (staleness, metrics; only staleness in snapshots).
        self.observed = Observations(self.spec.sources, n)
        self.counts = {"puts": 0, "rejected": 0, "withdrawn": 0, "admitted_minibatches": 0,
                       "admitted_trajectories": 0, "planned_local_bytes": 0, "planned_remote_bytes": 0,
                       "released": 0, "dropped_at_close": 0, "version_rollbacks": 0}
        self.rejected_by_cause: dict[str, int] = {}
        # releases sent lately ([unit, ids], oldest first; RECENT_RELEASES ids at most): a snapshot keeps them,
        # and a recovery from it sends them again, in case the coordinator died before they reached the units
        self.recent_releases: deque[tuple[str, list[str]]] = deque()
        self.recent_ids = 0
        self.journaling = Journaling(journal)  # the journal and its bookkeeping (Durability owns it)

    @property
    def seq(self) -> int:
        """The next put's arrival sequence number. An accepted put raises it by one, which stamps the put's
        trainer version and time in :attr:`put_log`; any other change (a snapshot loaded) restarts the log."""
        return self._seq

    @seq.setter
    def seq(self, value: int) -> None:
        log = self.put_log
        if value == self._seq + 1:
            log.stamp(self._seq, self.version, time.monotonic())
            if len(log) >= self.put_log_prune_at:  # amortized: a pass over the held trajectories per doubling
                log.forget_below(min(map(_seq, self.live.values()), default=self._seq))
                self.put_log_prune_at = max(PUT_LOG_PRUNE, 2 * len(log))
        else:
            log.restart(value)
        self._seq = value

    @property
    def live(self) -> dict[str, TrajectoryMeta]:
        """The trajectories stored and not released, by id (:class:`~knitdata.control.held.HeldTrajectories`)."""
        return self._held.live

    @property
    def put_tokens(self) -> dict[str, str]:
        """The token of the ``admit_many`` call that put each held trajectory (a retried call is recognised)."""
        return self._held.put_tokens

    @property
    def loss(self) -> dict[str, int]:
        """The loss-mask tokens of each held trajectory."""
        return self._held.loss

    def settle(self) -> None:
        """Forget now what commits left to forget (every read of :attr:`live`, :attr:`put_tokens` or :attr:`loss`
        does it first; call under :attr:`cond`)."""
        self._held.settle()

    # ------------------------------------------------------------------------------------ snapshot slice
    def state_dict(self, raw_metas: bool = False) -> dict[str, Any]:
        """The shared part of a snapshot (call under :attr:`cond`): admission and placement, the held and pending
        trajectories, queues, positions, counters, the end of stream and the recent releases (see
        :meth:`~knitdata.control.durability.Durability.state_dict`; ``raw_metas``: metas as objects). The replay
        fingerprints are :attr:`replay`'s own slice (:meth:`ReplayMarks.state_dict`)."""
        err = None if self.error is None else {"type": type(self.error).__name__, "message": str(self.error)}
        live, pending = self.live.values(), self.pending.values()
        return {
            "policy": self.policy.state_dict(), "placement": self.placement.state_dict(), "seq": self.seq,
            "delivered": list(self.delivered),
            "live": list(live) if raw_metas else [m.to_dict() for m in live], "put_tokens": dict(self.put_tokens),
            "pending": list(pending) if raw_metas else [m.to_dict() for m in pending], "loss": dict(self.loss),
            "queues": [[q[j].to_json() for j in sorted(q)] for q in self.queues],
            "planned": list(self.planned), "committed": list(self.committed), "position": list(self.position),
            "closed": self.closed, "close_report": self.close_report, "error": err, "version": self.version,
            "counts": dict(self.counts), "rejected_by_cause": dict(self.rejected_by_cause),
            "recent_releases": [[u, list(ids)] for u, ids in self.recent_releases],
            **({} if self.replicas is None else {"replicas": self.replicas.to_dict()}),
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Continue from the shared part of a checked snapshot ``d``
        (:func:`~knitdata.control.snapshot.decode_snapshot`); the policy first, which is checked whole before it
        changes anything."""
        placement = make_placement(self.config["placement"], list(self.unit_nodes))
        placement.load_state_dict(d["placement"])
        self.policy.load_state_dict(d["policy"])
        self.placement = placement
        self.seq = d["seq"]
        self.delivered = RecentIds(self.delivered.limit, d["delivered"])
        self._held.load({m.id: m for m in d["live"]}, d["put_tokens"], d["loss"])
        self.pending = {m.id: self.live.get(m.id, m) for m in d["pending"]}
        self.queues = [{e.j: e for e in q} for q in d["queues"]]  # PlanEntry (decode_snapshot built them)
        self.entry_sums = [{} for _ in self.queues]
        self.planned, self.committed, self.position = d["planned"], d["committed"], d["position"]
        self.closed, self.close_report, self.error = d["closed"], d["close_report"], d["error"]
        self.version = d["version"]
        self.counts = d["counts"]
        self.rejected_by_cause = d["rejected_by_cause"]
        self.recent_releases = deque((u, ids) for u, ids in d["recent_releases"])
        self.recent_ids = sum(len(ids) for _u, ids in self.recent_releases)
        self.replicas = d.get("replicas")

    # ------------------------------------------------------------------------------------ checks
    def check_rank(self, rank: int) -> None:
        """Raise :class:`~knitdata.errors.ConfigError` unless ``rank`` is a consumer of the layout."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.layout.num_consumers:
            raise ConfigError(f"rank must be an int in 0..{self.layout.num_consumers - 1}, got {rank!r}")

    def check_open(self) -> None:
        """Raise :class:`~knitdata.errors.PipelineClosedError` once the pipeline is closed or stopped."""
        if self.closed:
            raise PipelineClosedError("the pipeline is closed (end of stream); build a new Pipeline to continue")
        if self.error is not None:
            raise PipelineClosedError(f"the pipeline stopped after an admission error: {self.error}")

    def count_rejected(self, cause: str, n: int = 1) -> None:
        """Count ``n`` refused puts under ``cause``."""
        self.rejected_by_cause[cause] = self.rejected_by_cause.get(cause, 0) + n
        self.counts["rejected"] += n

    def fail(self, e: KnitdataError) -> None:
        """Stop the pipeline with ``e`` (every waiting consumer raises it)."""
        self.error = e
        self.cond.notify_all()

    # ------------------------------------------------------------------------------------ release
    def release_metas(self, metas: Sequence[TrajectoryMeta], delivered: bool = False) -> None:
        """Forget ``metas`` (those still held) and ask their units to drop the payloads (see :meth:`release_ids`)."""
        self.release_ids([m.id for m in metas], delivered)

    def release_ids(self, ids: list[str], delivered: bool = False) -> None:
        """Forget the trajectories ``ids`` still held and ask their units to drop the payloads (``delivered``:
        remember their ids, to refuse a retried put). Ids not held are skipped. ``ids``: a new list (kept).

        Each pass over the ids is a ``map`` of a C function (no bytecode per trajectory) while every id is held by
        one unit, as on the embedded engine and on a node. A commit releases with :meth:`release_delivered`.
        """
        popped = self._held.pop(ids)  # (their metadata and put tokens are freed later, see knitdata.reclaim)
        metas: list[TrajectoryMeta]
        if any(map(is_, popped, repeat(None))):  # some already released (a restore, a withdrawn group): held ones
            held = [i for i, m in zip(ids, popped) if m is not None]
            metas = [m for m in popped if m is not None]
        else:
            held, metas = ids, cast("list[TrajectoryMeta]", popped)
        if not held:
            return
        if delivered:  # remembered in order; the oldest beyond DELIVERED_MEMORY forgotten
            self.delivered.add_many(held)
        units = set(map(_location, metas))
        if len(units) == 1:  # the common case: one unit
            u = units.pop()
            by_unit = {} if u is None else {u: held}
        else:
            by_unit = {}
            for mid, m in zip(held, metas):
                u = m.location
                if u is not None:
                    by_unit.setdefault(u, []).append(mid)
        self._drop_payloads(by_unit, delivered)

    def release_delivered(self, ids: list[str]) -> None:
        """:meth:`release_ids` of the trajectories of committed entries (``delivered``; each released once): the units
        drop the payloads and the counts move now; with a graveyard that keeps (the embedded engine) the held
        tables forget them at their next read (:meth:`HeldTrajectories.forget_later
        <knitdata.control.held.HeldTrajectories.forget_later>`): the trainer's thread, which commits, does one
        membership test per trajectory and the units' release. ``ids``: a new list (kept)."""
        held = self._held.forget_later(ids)
        if held is None:
            self.release_ids(ids, delivered=True)
            return
        if not held:
            return
        self.delivered.add_many(held)
        if len(self.unit_nodes) == 1:  # the common case: one unit, no metadata visited
            by_unit = {next(iter(self.unit_nodes)): held}
        else:
            by_unit = {}
            for mid in held:
                u = self._held.location(mid)
                if u is not None:
                    by_unit.setdefault(u, []).append(mid)
        self._drop_payloads(by_unit, True)
        self._held.settle_over_limit()

    def _drop_payloads(self, by_unit: dict[str, list[str]], delivered: bool) -> None:
        """Ask each unit to drop the payloads of its released ids; count them and keep them for a resend."""
        tr = tracing.tracer
        for u, uids in by_unit.items():
            if tr is not None:
                tr.instant("release", "storage", {"unit": u, "trajectories": len(uids), "delivered": delivered})
            self.releaser(u, uids, False)
            self.counts["released"] += len(uids)
            self.recent_releases.append((u, uids))
            self.recent_ids += len(uids)
            while self.recent_ids > RECENT_RELEASES and len(self.recent_releases) > 1:
                self.recent_ids -= len(self.recent_releases.popleft()[1])

    def resend_releases(self) -> None:
        """Send the releases of :attr:`recent_releases` again (after a recovery from a snapshot: the coordinator
        may have died before they reached the units; a release is idempotent)."""
        for u, ids in list(self.recent_releases):
            self.releaser(u, list(ids), False)

    def live_metas(self, items: Iterable[ItemRef]) -> list[TrajectoryMeta]:
        """The metas of the queue items ``[id, unit, nbytes]`` still held (released ones left out), in order."""
        return self.held_metas(map(_first, items))

    def held_metas(self, ids: Iterable[str]) -> list[TrajectoryMeta]:
        """The metas of the trajectories ``ids`` still held (released ones left out), in order."""
        found = list(map(self.live.get, ids))
        if any(map(is_, found, repeat(None))):  # (``None in found`` would call each meta's ``__eq__``)
            return [m for m in found if m is not None]
        return cast("list[TrajectoryMeta]", found)

    def record_handouts(self, rank: int, handouts: Sequence[tuple[PlanEntry, int]]) -> None:
        """Record the staleness of entries of ``rank`` handed out (:meth:`Observations.record_handouts`)."""
        self.observed.record_handouts(rank, handouts, self.entry_sums[rank], self.held_metas, self.put_log)

    def unqueue(self, rank: int, j: int) -> PlanEntry | None:
        """Take entry ``j`` out of ``rank``'s queue (``None``: not queued), keeping its mini-batch's record count."""
        e = self.queues[rank].pop(j, None)
        self.entry_sums[rank].pop(j, None)
        if e is not None:
            records = self.replay.mb_records
            rec = records.get(e.minibatch)
            if rec is not None:
                rec[4] -= 1
                if rec[4] <= 0:
                    del records[e.minibatch]
        return e

    def skip_gaps(self, rank: int) -> None:
        """Move ``rank``'s committed position past the planned entries no longer queued."""
        committed, planned, q = self.committed[rank], self.planned[rank], self.queues[rank]
        while committed < planned and committed not in q:
            committed += 1
        self.committed[rank] = committed

    def drop_entry(self, rank: int, j: int) -> None:
        """Release entry ``j`` of ``rank`` (if still queued) and advance the committed position over gaps."""
        e = self.unqueue(rank, j)
        if e is not None:
            self.release_delivered(list(map(_first, e.items)))
            self._graveyard.bury([e])
            del e
        self.skip_gaps(rank)
        self.prune_fps(rank)

    def commit_upto(self, rank: int, upto: int) -> int:
        """Release ``rank``'s entries below ``upto`` (the ones not planned yet when they are); returns how many."""
        top = min(upto, self.planned[rank])
        start = self.committed[rank]
        n = 0
        if top > start:
            # the entries' payloads are released together (one release per unit), in entry order
            ids: list[str] = []
            entries: list[PlanEntry] = []
            for j in range(start, top):
                e = self.unqueue(rank, j)
                if e is not None:
                    entries.append(e)
                    ids += map(_first, e.items)
            n = len(entries)
            if ids:
                self.release_delivered(ids)
            self._graveyard.bury(entries)  # the entries (their items and infos) are freed later, off this thread
            del entries
            self.committed[rank] = top
            self.skip_gaps(rank)
        # positions past what is planned yet (a restore before the refill): released as they are planned
        if upto > self.committed[rank]:
            self.committed[rank] = upto
        self.prune_fps(rank)
        if tracing.tracer is not None:
            tracing.tracer.instant("commit", "positions", {"rank": rank, "upto": upto, "released": n})
        if n:
            self.cond.notify_all()
        return n

    def queue_row(self, rank: int, row: Sequence[Any]) -> None:
        """Append the planned micro-batches ``row`` to ``rank``'s entries (released at once below its commit)."""
        replay = self.replay
        fps, chain, records = replay.fps[rank], replay.chain[rank], replay.mb_records
        for pmb in row:
            j = self.planned[rank]
            self.planned[rank] = j + 1
            info: MicroBatchInfo = pmb.info
            if chain is not None:
                chain = entry_fingerprint(chain, info.__dict__)  # the info's fields (what to_dict() would copy)
                fps[j + 1] = chain
                if j == 0 and rank == 0 and replay.run_mark is None:
                    replay.run_mark = chain
            if j < self.committed[rank]:  # the rank restored past it: release at once
                self.release_ids([m.id for m in pmb.trajectories], delivered=True)
                continue
            metas = pmb.trajectories
            self.queues[rank][j] = PlanEntry(j, info.minibatch, info.microbatch, info,
                                             item_refs(metas), chain)
            token_sums = TokenStaleness.sums(metas)
            self.entry_sums[rank][j] = None if token_sums is None else (token_sums, self.put_log.sums(metas))
            rec = records.get(info.minibatch)
            if rec is not None:
                rec[4] += 1
        replay.chain[rank] = chain
        self.prune_fps(rank)

    def forget_if_unqueued(self, minibatch: int) -> None:
        """Drop the record of ``minibatch`` when none of its entries is queued (all released at once)."""
        records = self.replay.mb_records
        rec = records.get(minibatch)
        if rec is not None and rec[4] <= 0:
            del records[minibatch]

    # ------------------------------------------------------------------------------------ positions
    def start(self, rank: int, replica: int = 0) -> int:
        """Where a new iterator of ``rank`` (its ``replica``) starts: after the last micro-batch handed out or
        committed (by that replica)."""
        r = self.replicas
        if r is not None:
            return max(r.position[rank][replica], r.committed[rank][replica], self.committed[rank])
        return max(self.position[rank], self.committed[rank])

    def prune_fps(self, rank: int) -> None:
        """Forget the prefix fingerprints of ``rank`` far below its committed position (no state lies there)."""
        self.replay.prune(rank, min(self.committed[rank], self.planned[rank]) - FP_KEEP)

    def fp(self, rank: int, length: int) -> str | None:
        """The fingerprint of ``rank``'s first ``length`` micro-batches, if known here."""
        return self.replay.get(rank, length, self.planned[rank])
