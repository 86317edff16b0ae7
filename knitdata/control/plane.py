"""The one control plane: admission, placement, planning, commits and release, on metadata only.

:class:`ControlPlane` is engine-neutral. The embedded engine calls it directly in the pipeline's process;
the Ray engine hosts the very same class inside one coordinator actor and forwards calls to it. Every
argument and return value is JSON-like (dicts, lists, strings, numbers), so the two engines cannot drift.
Payload bytes never pass through it: a storage unit holds them, and the plane asks the engine to drop
them through the ``releaser`` callback it was given.

The path of one trajectory through the plane (:meth:`ControlPlane.admit_many`, one call per put): the producer
keeps a replica of the placement (:meth:`ControlPlane.placement_view`) and stores the payload on the unit it
picks; the unit then asks the plane to admit it. The plane runs the checks that need its state (source, unique
id, withdrawn group, field schema; one bad trajectory refuses its whole batch, whose payloads the unit drops),
accounts the unit in its placement, hands the metadata to admission and plans every mini-batch admitted at
once. A call retried after a coordinator restart is recognized by its put tokens. With one producer the replica
picks exactly the units :meth:`Placement.place` would; concurrent producers may pick a unit a little off
balance, which is accounted where it is.

The two-phase protocol (:meth:`ControlPlane.reserve`, the engine stores, :meth:`ControlPlane.offer`) decides the
same for single puts and is kept for engines that must check before storing.

Plans are queued per rank as *entries*: the ``j``-th micro-batch of a rank over the whole run (``j`` counts
across mini-batches). Which rank receives which trajectory depends only on the admitted metadata, the
layout and the options: placement counts the bytes placed so far (never the bytes released), and a
consumer positioned past an entry (:meth:`ControlPlane.seek`) only releases it. So a pipeline fed the same
puts plans the same entries whenever consumers restore, and on either engine.

Release (``release``): ``"step"`` commits a rank's entries before a mini-batch when the rank's single
iterator hands out that mini-batch's first micro-batch; ``"commit"`` releases only on explicit
:meth:`ControlPlane.commit`; ``"handout"`` releases each entry as it is handed out. A rank restored from a
committed-or-later position receives exactly the entries after it.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from knitdata.admission import AdmissionPolicy, AdmittedMiniBatch, BatchSpec, make_policy
from knitdata.control.journal import Journal, dumps_strict, loads_strict, recovery_plan
from knitdata.control.snapshot import decode_snapshot
from knitdata.errors import (
    CodecError,
    ConfigError,
    EngineError,
    FencedError,
    FieldTypeError,
    IncompleteStreamError,
    KnitdataError,
    PipelineClosedError,
    QuotaInfeasibleError,
    StateError,
    ValidationError,
)
from knitdata.metrics import TransferMeter, summarize
from knitdata.placement import ConsumerLayout, make_placement
from knitdata.planner import MiniBatchPlan, Planner
from knitdata.record import TrajectoryMeta

__all__ = ["ControlPlane", "RELEASE_MODES", "PLANE_DEFAULTS", "LEASE_TTL_S", "fenced_message", "entry_fingerprint"]

#: When payloads leave storage (module docstring).
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
#: consumer renews its lease every :data:`~knitdata.handoff.HEARTBEAT_S` from a background thread and gives it up
#: at once when a newer iterator asks for it; it hands nothing out past its own, shorter, local deadline.
LEASE_TTL_S = 3.0
#: Seconds without a report after which a producer process counts as gone (it died without close()).
PRODUCER_TTL_S = 10.0
#: Prefix fingerprints of a rank's micro-batches kept below its committed position (states of DataLoader workers
#: may lie up to ``num_workers - 1`` micro-batches below it).
FP_KEEP = 64
#: The fingerprint of an empty prefix.
FP_EMPTY = "0" * 16
#: How many released trajectory ids a snapshot keeps, to send their releases again after a recovery.
RECENT_RELEASES = 8192
#: The version of :meth:`ControlPlane.snapshot`'s format (2 adds the replay fingerprints; 1 is still read).
SNAPSHOT_FORMAT = 2


@dataclass
class _Lease:
    """The live iterator of one (rank, worker): its token, epoch, who holds it, when it last renewed, and who asked
    for it (a newer iterator waits for it to let go)."""

    token: str
    epoch: int
    holder: str
    renewed: float
    fence_by: str | None = None


def fenced_message(rank: int, worker: int, by: str) -> str:
    """The message of :class:`~knitdata.errors.FencedError` for ``(rank, worker)`` taken over by ``by``."""
    return (f"rank {rank} (worker {worker}) was taken over by a newer iterator ({by}) while this one was alive: this "
            "iterator stops here, and the micro-batches it had not handed out go to the newer one (each rank has one "
            "consumer; if this process was replaced, let it exit)")


def entry_fingerprint(prev: str, info: Mapping[str, Any]) -> str:
    """The fingerprint of a rank's prefix ending in one micro-batch: a 64-bit BLAKE2b digest (hex) chained over
    ``prev`` (the prefix before it) and the micro-batch's :class:`~knitdata.collate.MicroBatchInfo` dict: its
    position, its mini-batch's token, trajectory and loss-token counts, and its trajectory ids in order (one
    C-level join per micro-batch: about 7 ms for 64,000 trajectories on 8,000 ranks)."""
    text = (f"{prev}\x1e{info['minibatch']}.{info['microbatch']}.{info['num_microbatches']}\x1e{info['global_tokens']}."
            f"{info['global_trajectories']}.{info['global_loss_tokens']}\x1e" + "\x1f".join(info["trajectory_ids"]))
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _journaled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Record the outermost call of a state-changing method in the plane's journal once it was applied.

    A call that raised a :class:`~knitdata.errors.KnitdataError` is recorded too: replaying it reproduces its
    effects (a refused offer releases its payload), and its error again.
    """
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: ControlPlane, *args: Any) -> Any:
        if self._journal is None:  # the common in-process case: no bookkeeping around the call
            return fn(self, *args)
        with self.cond:
            outer = self._depth == 0 and self._journal is not None and not self._replaying
            self._depth += 1
            try:
                out = fn(self, *args)
            except KnitdataError:
                if outer:
                    self._log(name, args)
                raise
            finally:
                self._depth -= 1
            if outer:
                self._log(name, args)
            return out

    return wrapper


def fields_of(scalars: Iterable[str], tensors: Mapping[str, str]) -> dict[str, Any]:
    """The schema record of a trajectory: its scalar names and its tensor fields' dtypes."""
    return {"scalars": sorted(scalars), "tensors": {k: str(v) for k, v in sorted(tensors.items())}}


class ControlPlane:
    """Admission, placement, planning, leases, commits and release of one pipeline. Thread-safe.

    Args:
        config: JSON-like options: ``spec`` (a :class:`~knitdata.admission.BatchSpec` dict), ``layout`` (a
            :class:`~knitdata.placement.ConsumerLayout` dict) and the keys of :data:`PLANE_DEFAULTS`.
        unit_nodes: ``{storage unit id: layout node}``, one unit per node.
        releaser: ``releaser(unit_id, ids, wait)`` drops payloads from a unit (called under the plane's lock:
            keep it non-blocking, e.g. an asynchronous actor call, unless ``wait`` is true; ``wait`` is set only
            for the rare release of a dead producer's orphaned copy, which must complete before its retry).
        policy: An admission policy object to use instead of ``config["admission"]`` (in-process only).
        on_plan: Called as ``on_plan(admitted, plan)`` after each mini-batch is planned (in-process only).
        journal: Record every state-changing call here (:class:`~knitdata.control.journal.Journal`), so that
            :meth:`recover` can rebuild the state after a restart.

    Raises:
        ConfigError: Inconsistent options.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        unit_nodes: Mapping[str, str],
        releaser: Callable[[str, list[str], bool], Any],
        *,
        policy: AdmissionPolicy | None = None,
        on_plan: Callable[[AdmittedMiniBatch, MiniBatchPlan], None] | None = None,
        journal: Journal | None = None,
    ) -> None:
        cfg = {**PLANE_DEFAULTS, **dict(config)}
        self.config = cfg
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
        self._release = releaser
        self._on_plan = on_plan
        self.cond = threading.Condition(threading.RLock())
        n = self.layout.num_consumers
        self.seq = 0
        # puts in progress: id -> (unit, meta, fields); a producer that died mid-put leaves one behind
        self.putting: dict[str, tuple[str, TrajectoryMeta, dict[str, Any] | None]] = {}
        self.schema: dict[str, Any] | None = None
        self.withdrawn: OrderedDict[str, None] = OrderedDict()
        self.delivered: OrderedDict[str, None] = OrderedDict()  # released after planning (DELIVERED_MEMORY)
        self.live: dict[str, TrajectoryMeta] = {}  # stored and not released
        self.put_tokens: dict[str, str] = {}  # live id -> token of the admit_many call that put it (retries)
        self.pending: dict[str, TrajectoryMeta] = {}  # offered, not admitted yet
        self.loss: dict[str, int] = {}
        self.queues: list[dict[int, dict[str, Any]]] = [{} for _ in range(n)]
        self.planned = [0] * n  # entries appended per rank
        self.committed = [0] * n  # entries below are released
        self.position = [0] * n  # next entry of the rank's iterator (handed out below)
        # producers that put here: id -> [holder, last report, any of its putting threads alive, when they ended]
        self.producers: dict[str, list[Any]] = {}
        self.producer_timeout_s = cfg.get("producer_timeout_s")
        self.leases: dict[tuple[int, int], _Lease] = {}
        self.lease_epochs: dict[tuple[int, int], int] = {}
        # replay fingerprints: the chained digest of each rank's micro-batches (entry_fingerprint)
        self.chain: list[str | None] = [FP_EMPTY] * n  # digest of the rank's planned prefix (None: unknown)
        self.fps: list[dict[int, str | None]] = [{0: FP_EMPTY} for _ in range(n)]  # prefix length -> digest
        self.verify_at: list[tuple[int, str, str] | None] = [None] * n  # pending check (length, digest, state)
        self.closed = False
        self.close_report: dict[str, Any] | None = None
        self.error: KnitdataError | None = None
        self.version = 0
        self.version_times: deque[float] = deque(maxlen=1024)
        self.staleness: deque[int] = deque(maxlen=10_000)
        self.consumer_stats: list[dict[str, Any] | None] = [None] * n
        self.transfer = TransferMeter()
        self.counts = {"puts": 0, "rejected": 0, "withdrawn": 0, "admitted_minibatches": 0,
                       "admitted_trajectories": 0, "planned_local_bytes": 0, "planned_remote_bytes": 0,
                       "released": 0, "dropped_at_close": 0, "version_rollbacks": 0}
        self.rejected_by_cause: dict[str, int] = {}
        # releases sent lately ([unit, ids], oldest first; RECENT_RELEASES ids at most): a snapshot keeps them,
        # and a recovery from it sends them again, in case the coordinator died before they reached the units
        self.recent_releases: deque[tuple[str, list[str]]] = deque()
        self._recent_ids = 0
        self._journal = journal
        self._depth = 0
        self._replaying = False
        self.replayed = 0

    def recover(self, path: str) -> int:
        """Rebuild this (fresh) plane's state from the journal at ``path`` and its snapshot, if any.

        The snapshot (``path + ".snapshot"``, written by :meth:`compact`) is loaded when the journal continues
        from it, and only the records after it are replayed; a snapshot of another run (left by a deleted
        journal) is ignored. Calls that raised when they were first made raise again here and are skipped:
        their effects are reproduced. Releases are sent to the units again (they are idempotent): the ones a
        replayed call makes, and after a snapshot the last :data:`RECENT_RELEASES` ids released before it.

        Returns:
            The number of journal records replayed (after the snapshot).

        Raises:
            CodecError: The journal or the snapshot it depends on is damaged or missing.
        """
        n = 0
        with self.cond:
            plan = recovery_plan(path)
            if plan.state is not None:
                try:
                    self.load_snapshot(plan.state)
                except KnitdataError as e:
                    raise CodecError(f"the snapshot of journal {path!r} cannot be loaded: {e}") from e
                for u, ids in list(self.recent_releases):
                    self._release(u, list(ids), False)
            self._replaying = True
            try:
                total = 0
                for op, args in Journal.read(path):
                    total += 1
                    if total <= plan.skip:
                        continue
                    try:
                        getattr(self, op)(*args)
                    except KnitdataError:
                        pass
                    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
                        raise CodecError(f"journal {path!r} record {total} ({op}) has malformed arguments "
                                         f"({type(e).__name__}: {e}); the journal is damaged") from e
                    n += 1
                if total < plan.skip:
                    raise CodecError(f"journal {path!r} holds {total} records but its snapshot covers {plan.skip}; "
                                     "the journal is damaged (truncated)")
            finally:
                self._replaying = False
            self.replayed = n
        return n

    def compact(self) -> None:
        """Write a snapshot of the state next to the journal and start a new, empty journal segment.

        Runs on its own every ``compact_every`` journal records (see :class:`~knitdata.control.journal.Journal`).

        Raises:
            ConfigError: This plane has no journal.
            OSError: The snapshot or the new segment could not be written (the journal is left as it was).
        """
        if self._journal is None:
            raise ConfigError("this control plane has no journal to compact")
        with self.cond:
            self._journal.compact(self.snapshot())

    def _log(self, name: str, args: Sequence[Any]) -> None:
        """Journal one call; compact when the segment is due (under the lock, between calls)."""
        j = self._journal
        assert j is not None
        j.append(name, list(args))
        if j.compaction_due:
            try:
                j.compact(self.snapshot())
            except (OSError, KnitdataError) as e:  # the journal stays whole; the next attempt comes later
                warnings.warn(f"journal {j.path!r}: compaction failed, the journal keeps growing: {e}",
                              RuntimeWarning, stacklevel=3)

    def snapshot(self) -> dict[str, Any]:
        """The plane's complete state, JSON-serializable, from which :meth:`load_snapshot` continues identically.

        Holds: admission, placement, queues and positions, puts in progress, held and pending trajectories
        (and the put tokens of the held ones), withdrawn groups, schema, version, counters, close report, the stopping error, staleness, and the
        recent releases. Not: iterator leases, version timestamps, consumers' stats and transfer totals.

        Raises:
            StateError: The configuration is not JSON-serializable.
        """
        with self.cond:
            try:
                config = loads_strict(dumps_strict(self.config))
            except (TypeError, ValueError) as e:
                raise StateError(f"the control plane's configuration is not JSON-serializable: {e}") from e
            err = None if self.error is None else {"type": type(self.error).__name__, "message": str(self.error)}
            return {
                "format": SNAPSHOT_FORMAT, "config": config, "unit_nodes": dict(self.unit_nodes),
                "policy": self.policy.state_dict(), "placement": self.placement.state_dict(),
                "seq": self.seq,
                "putting": [[tid, u, m.to_dict(), f] for tid, (u, m, f) in self.putting.items()],
                "schema": self.schema, "withdrawn": list(self.withdrawn), "delivered": list(self.delivered),
                "live": [m.to_dict() for m in self.live.values()], "put_tokens": dict(self.put_tokens),
                "pending": [m.to_dict() for m in self.pending.values()],
                "loss": dict(self.loss),
                "queues": [[q[j] for j in sorted(q)] for q in self.queues],
                "planned": list(self.planned), "committed": list(self.committed), "position": list(self.position),
                "closed": self.closed, "close_report": self.close_report, "error": err, "version": self.version,
                "staleness": list(self.staleness), "counts": dict(self.counts),
                "rejected_by_cause": dict(self.rejected_by_cause),
                "recent_releases": [[u, list(ids)] for u, ids in self.recent_releases],
                "chains": list(self.chain), "fps": [[[k, v] for k, v in fps.items()] for fps in self.fps],
                "verify_at": [None if v is None else list(v) for v in self.verify_at],
            }

    def load_snapshot(self, state: Mapping[str, Any]) -> None:
        """Replace this plane's state with a :meth:`snapshot` (of a plane of the same configuration and units).

        Every part is checked before anything changes. Leases, version timestamps, consumers' stats and
        transfer totals are kept as they are.

        Raises:
            StateError: A malformed snapshot, or one of another configuration, layout or set of units.
        """
        with self.cond:
            d = decode_snapshot(state, config=self.config, unit_nodes=self.unit_nodes,
                                num_consumers=self.layout.num_consumers, counts=self.counts)
            placement = make_placement(self.config["placement"], list(self.unit_nodes))
            placement.load_state_dict(d["placement"])
            self.policy.load_state_dict(d["policy"])  # checked whole before it changes anything
            self.placement = placement
            self.seq = d["seq"]
            self.putting = {tid: (u, m, f) for tid, u, m, f in d["putting"]}
            self.schema = d["schema"]
            self.withdrawn = OrderedDict.fromkeys(d["withdrawn"])
            self.delivered = OrderedDict.fromkeys(d["delivered"])
            self.live = {m.id: m for m in d["live"]}
            self.put_tokens = d["put_tokens"]
            self.pending = {m.id: self.live.get(m.id, m) for m in d["pending"]}
            self.loss = d["loss"]
            self.queues = [{e["j"]: e for e in q} for q in d["queues"]]
            self.planned, self.committed, self.position = d["planned"], d["committed"], d["position"]
            self.closed, self.close_report, self.error = d["closed"], d["close_report"], d["error"]
            self.version = d["version"]
            self.staleness = deque(d["staleness"], maxlen=self.staleness.maxlen)
            self.counts = d["counts"]
            self.rejected_by_cause = d["rejected_by_cause"]
            self.recent_releases = deque((u, ids) for u, ids in d["recent_releases"])
            self.chain, self.fps, self.verify_at = d["chains"], d["fps"], d["verify_at"]
            self._recent_ids = sum(len(ids) for _u, ids in self.recent_releases)
            self.cond.notify_all()

    @classmethod
    def from_snapshot(
        cls,
        state: Mapping[str, Any],
        releaser: Callable[[str, list[str], bool], Any],
        *,
        policy: AdmissionPolicy | None = None,
        on_plan: Callable[[AdmittedMiniBatch, MiniBatchPlan], None] | None = None,
        journal: Journal | None = None,
    ) -> ControlPlane:
        """A plane built from a :meth:`snapshot` alone (its configuration and units are in it).

        Raises:
            StateError: A malformed snapshot.
        """
        if not isinstance(state, Mapping) or not isinstance(state.get("config"), Mapping) \
                or not isinstance(state.get("unit_nodes"), Mapping):
            raise StateError(f"not a control-plane snapshot (no config and unit_nodes): {str(state)[:200]}")
        try:
            plane = cls(state["config"], state["unit_nodes"], releaser, policy=policy, on_plan=on_plan,
                        journal=journal)
        except KnitdataError as e:
            raise StateError(f"the snapshot's configuration is invalid: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise StateError(f"the snapshot's configuration is malformed ({type(e).__name__}: {e})") from e
        plane.load_snapshot(state)
        return plane

    # ------------------------------------------------------------------------------------ producer side
    @_journaled
    def reserve(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Check a trajectory about to be stored and choose its unit.

        Args:
            meta: :meth:`TrajectoryMeta.to_dict` plus ``fields`` (:func:`fields_of`).

        Returns:
            ``{"seq": arrival index, "unit": storage unit id}``.

        Raises:
            ValidationError / FieldTypeError: Unknown source, duplicate id, withdrawn group, other fields.
            PipelineClosedError: The pipeline is closed or stopped.
        """
        tid = str(meta["id"])
        with self.cond:
            self._check_open()
            try:
                self._check_put(meta, tid, set(), self.schema)
            except KnitdataError as e:
                self._count_rejected(e)
                raise
            stale = self.putting.pop(tid, None)
            if stale is not None:
                # a retry after the producer died mid-put (or a concurrent duplicate, which then loses)
                old_unit, old_meta, _ = stale
                # synchronously: the retry's own store into the same unit must not race the release
                self._release(old_unit, [tid], True)
                self.placement.unplace(old_meta, old_unit)
                self.counts["rejected"] += 1
            m = TrajectoryMeta.from_dict({**{k: v for k, v in meta.items() if k != "fields"}, "seq": self.seq,
                                          "location": None})
            self.seq += 1
            unit = self.placement.place(m)
            self.putting[tid] = (unit, m, meta.get("fields"))
            return {"seq": m.seq, "unit": unit}

    @_journaled
    def admit_many(self, unit: str, items: Sequence[Sequence[Any]]) -> dict[str, Any]:
        """The one-round-trip put: payloads already stored on ``unit`` are checked, placed there and admitted.

        The producer chose ``unit`` with a replica of the placement (:meth:`placement_view`), stored the
        payloads, and the unit (on Ray, the storage-unit actor itself) makes this one call. Every check of
        :meth:`reserve` runs first for the whole batch: one bad trajectory refuses the batch (the unit drops
        every payload of it). A call retried after a coordinator restart is recognized by its put tokens and
        answers as the first time.

        Args:
            unit: The storage unit holding the payloads.
            items: ``[metadata, loss_tokens, token]`` per trajectory, in arrival order: metadata as for
                :meth:`reserve` (with ``fields``), ``token`` a string unique to this put.

        Returns:
            ``{"accepted": [metadata dict or None per item], "errors": [[traj_id, error class name, message,
            field], ...], "placement": placement view, "seq": next arrival index}``. Refused items (``None``) are
            not held by the plane: the unit drops their payloads.

        Raises:
            ConfigError: An unknown unit.
            QuotaInfeasibleError: Admission found the quotas impossible (the pipeline stops).
        """
        if unit not in self.unit_nodes:
            raise ConfigError(f"unknown storage unit {unit!r}; the units are {list(self.unit_nodes)[:8]}")
        accepted: list[dict[str, Any] | None] = [None] * len(items)
        errors: list[list[Any]] = []
        with self.cond:
            # every check first, no state changed: one bad trajectory refuses the batch
            fresh: list[int] = []
            seen: set[str] = set()
            schema = self.schema
            for k, (meta, _loss, token) in enumerate(items):
                tid = str(meta["id"])
                try:
                    done = self.live.get(tid)
                    if done is not None and self.put_tokens.get(tid) == token:
                        accepted[k] = done.to_dict()  # a retried call (the coordinator restarted before answering)
                        continue
                    self._check_open()
                    self._check_put(meta, tid, seen, schema)
                except KnitdataError as e:
                    errors.append([tid, type(e).__name__, str(e), getattr(e, "field", None)])
                    self._count_rejected(e)
                    continue
                seen.add(tid)
                if schema is None and meta.get("fields") is not None:
                    schema = meta["fields"]
                fresh.append(k)
            if errors:  # refused with the batch: the good ones too (retried ones stay accepted)
                if fresh:
                    self.counts["rejected"] += len(fresh)
                    self.rejected_by_cause["batch"] = self.rejected_by_cause.get("batch", 0) + len(fresh)
                return {"accepted": accepted, "errors": errors, **self.placement_view()}
            raised: BaseException | None = None
            for k in fresh:
                meta, loss, token = items[k]
                if raised is not None:  # admission stopped (or a hook failed) after an earlier item: not admitted
                    errors.append([str(meta["id"]), type(raised).__name__, str(raised), None])
                    continue
                m = TrajectoryMeta.from_dict({**{x: v for x, v in meta.items() if x != "fields"}, "seq": self.seq,
                                              "location": unit})
                try:
                    self.placement.place_at(m, unit)
                    try:
                        self.policy.offer([m])
                    except BaseException:
                        self.placement.unplace(m, unit)
                        raise
                except KnitdataError as e:
                    self._count_rejected(e)
                    errors.append([m.id, type(e).__name__, str(e), getattr(e, "field", None)])
                    continue
                except BaseException as e:  # not admitted, nor anything after it; the producer gets the error
                    raised = e
                    self.counts["rejected"] += 1
                    self.rejected_by_cause[type(e).__name__] = self.rejected_by_cause.get(type(e).__name__, 0) + 1
                    errors.append([m.id, type(e).__name__, str(e), None])
                    continue
                self.seq += 1
                fields = meta.get("fields")
                if self.schema is None and fields is not None:
                    self.schema = {"scalars": list(fields["scalars"]), "tensors": dict(fields["tensors"])}
                self.live[m.id] = m
                self.put_tokens[m.id] = str(token)
                self.loss[m.id] = int(loss)
                self.pending[m.id] = m
                self.counts["puts"] += 1
                accepted[k] = m.to_dict()
                try:
                    self._poll()
                except BaseException as e:  # this item is admitted; the producer gets the error
                    raised = e
                    errors.insert(0, [m.id, type(e).__name__, str(e), None])
            ans = {"accepted": accepted, "errors": errors, **self.placement_view()}
            if raised is not None and not isinstance(raised, KnitdataError):
                ans["exception"] = raised  # in-process only (an on_plan hook): re-raised by the pipeline
            return ans

    @_journaled
    def admit_batches(self, unit: str, batches: Sequence[Sequence[Sequence[Any]]]) -> list[dict[str, Any]]:
        """:meth:`admit_many` for several independent batches stored on ``unit`` (concurrent puts a unit sends
        together), in order, under one lock; each batch is refused or admitted on its own.

        Raises:
            ConfigError: An unknown unit. QuotaInfeasibleError: As :meth:`admit_many`.
        """
        with self.cond:
            return [self.admit_many(unit, b) for b in batches]

    def placement_view(self) -> dict[str, Any]:
        """``{"placement": view, "seq": next arrival index}`` for a producer's placement replica (see
        :meth:`admit_many`)."""
        with self.cond:
            return {"placement": self.placement.view(), "seq": self.seq}

    @_journaled
    def reserve_many(self, metas: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """:meth:`reserve` for a batch, in order, under one lock: all are reserved, or none (the first error).

        Raises:
            ValidationError / FieldTypeError / PipelineClosedError: As :meth:`reserve`, for the first bad one;
                the reservations this call made are undone.
        """
        with self.cond:
            done: list[tuple[str, int]] = []
            try:
                for meta in metas:
                    r = self.reserve(meta)
                    done.append((str(meta["id"]), int(r["seq"])))
            except BaseException:
                for tid, seq in done:
                    self.unreserve(tid, seq, "batch")
                raise
            return [{"seq": seq, "unit": self.putting[tid][0]} for tid, seq in done]

    @_journaled
    def offer_many(self, items: Sequence[Sequence[Any]]) -> dict[str, Any]:
        """:meth:`offer` for a batch of ``[traj_id, seq, loss_tokens]``, in order, under one lock.

        Returns:
            ``{"accepted": [metadata dicts], "errors": [[traj_id, error class name, message, field]]}``: a
            refused item (withdrawn meanwhile, other fields) does not affect the others.
        """
        accepted: list[dict[str, Any]] = []
        errors: list[list[Any]] = []
        with self.cond:
            for tid, seq, loss in items:
                try:
                    accepted.append(self.offer(str(tid), int(seq), int(loss)))
                except KnitdataError as e:
                    errors.append([tid, type(e).__name__, str(e), getattr(e, "field", None)])
        return {"accepted": accepted, "errors": errors}

    @_journaled
    def unreserve(self, traj_id: str, seq: int, cause: str = "store") -> None:
        """Undo :meth:`reserve` after the payload could not be stored (``cause`` is counted in stats)."""
        with self.cond:
            cur = self.putting.get(traj_id)
            if cur is None or cur[1].seq != seq:
                return  # superseded by a retry, which owns the placement now
            del self.putting[traj_id]
            self.placement.unplace(cur[1], cur[0])
            self.counts["rejected"] += 1
            self.rejected_by_cause[cause] = self.rejected_by_cause.get(cause, 0) + 1

    @_journaled
    def offer(self, traj_id: str, seq: int, loss_tokens: int) -> dict[str, Any]:
        """The payload of a reserved trajectory is stored: hand its metadata to admission and plan.

        Returns:
            The accepted metadata (:meth:`TrajectoryMeta.to_dict`, with ``seq`` and ``location``).

        Raises:
            ValidationError: The group was withdrawn meanwhile, a concurrent first put fixed other fields, or
                a retry superseded this put. PipelineClosedError: Closed meanwhile. The payload is released.
        """
        with self.cond:
            done = self.live.get(traj_id)
            if done is not None and done.seq == seq and traj_id not in self.putting:
                return done.to_dict()  # a retried call (the coordinator restarted before answering)
            cur = self.putting.get(traj_id)
            if cur is None or cur[1].seq != seq:
                raise ValidationError("this put was superseded by a newer put of the same id (a retry); it was "
                                      "not accepted", trajectory_id=traj_id, field="id")
            del self.putting[traj_id]
            unit, m0, fields = cur
            m = TrajectoryMeta.from_dict({**m0.to_dict(), "location": unit})
            self.live[m.id] = m
            try:
                self._check_open()
                if m.group in self.withdrawn:
                    raise ValidationError(f"its group {m.group!r} was withdrawn while this put was in progress; "
                                          "it was not accepted", trajectory_id=m.id, field="group")
                self._check_schema(m.id, fields)  # again: a concurrent first put may have fixed the schema
                self.loss[m.id] = int(loss_tokens)
                self.policy.offer([m])
            except BaseException as e:
                if isinstance(e, KnitdataError):
                    self._count_rejected(e)
                self._release_metas([m])
                raise
            self.pending[m.id] = m
            if self.schema is None and fields is not None:
                self.schema = {"scalars": list(fields["scalars"]), "tensors": dict(fields["tensors"])}
            self.counts["puts"] += 1
            self._poll()
            return m.to_dict()

    def note_rejected(self, traj_id: str | None, cause: str) -> None:
        """A put refused before it reached the plane (validation in the producer): counted by ``cause``."""
        with self.cond:
            self.counts["rejected"] += 1
            self.rejected_by_cause[cause] = self.rejected_by_cause.get(cause, 0) + 1

    @_journaled
    def set_in_flight(self, counts: Mapping[str, int]) -> None:
        """See :meth:`knitdata.admission.AdmissionPolicy.set_in_flight`.

        Raises:
            QuotaInfeasibleError: A source can no longer deliver its quota (the pipeline stops).
        """
        with self.cond:
            self._check_open()
            try:
                self.policy.set_in_flight(dict(counts))
            except QuotaInfeasibleError as e:
                self._fail(e)
                raise
            self._poll()

    @_journaled
    def withdraw(self, group: str) -> list[dict[str, Any]]:
        """Drop a group waiting for admission; late members are refused. Returns the dropped members."""
        with self.cond:
            metas = self.policy.withdraw(group)
            self.withdrawn[group] = None
            while len(self.withdrawn) > WITHDRAWN_MEMORY:
                self.withdrawn.popitem(last=False)
            for m in metas:
                self.pending.pop(m.id, None)
            self._release_metas(metas)
            self.counts["withdrawn"] += len(metas)
            self.placement.forget_group(group)
            if not self.closed and self.error is None:
                self._poll()
            return [m.to_dict() for m in metas]

    @_journaled
    def report_version(self, version: int) -> None:
        """The trainer's new policy version (staleness of what is handed out afterwards is measured against it).

        A version lower than the last one is a rollback (a job restored from a checkpoint): accepted and counted
        (``version_rollbacks`` in :meth:`stats`).

        Raises:
            ValidationError: Not a non-negative int.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValidationError(f"version must be a non-negative int, got {version!r}", field="version")
        with self.cond:
            if version < self.version:
                self.counts["version_rollbacks"] += 1  # a job restored from a checkpoint reports its version again
            self.version = version
            self.version_times.append(time.monotonic())

    @_journaled
    def close(self) -> dict[str, Any]:
        """End of stream. Idempotent.

        Returns:
            What was dropped: ``{"dropped_trajectories", "dropped_groups", "by_source", "in_progress"}``
            (trajectories that were stored but never admitted: an incomplete train batch or group). Consumers
            finish the admitted mini-batches, then raise :class:`~knitdata.errors.IncompleteStreamError` if
            anything was dropped.
        """
        with self.cond:
            if self.close_report is None:
                dropped = list(self.pending.values())
                by_source: dict[str, int] = {}
                groups: dict[str, int] = {}
                for m in dropped:
                    by_source[m.source] = by_source.get(m.source, 0) + 1
                    groups[m.group] = groups.get(m.group, 0) + 1
                self.close_report = {
                    "dropped_trajectories": len(dropped), "dropped_groups": sorted(groups),
                    "by_source": by_source, "in_progress": sorted(self.putting),
                    "group_members": groups, "group_size": self.spec.group_size,
                }
                self.counts["dropped_at_close"] = len(dropped)
            self.closed = True
            self.cond.notify_all()
            return dict(self.close_report)

    # ------------------------------------------------------------------------------------ consumer side
    def lease(self, rank: int, worker: int, token: str, wait_s: float = 0.0, holder: str = "") -> dict[str, Any]:
        """Make ``token`` the one live iterator of ``(rank, worker)``, fencing an older one.

        A live older holder is asked to give the lease up: it stops handing out, sends its last hand-out records
        and lets go (within its heartbeat), or its lease expires :data:`LEASE_TTL_S` after its last renewal (its
        renewals are refused once asked). Its later calls raise :class:`~knitdata.errors.FencedError`.

        Args:
            rank: The consumer.
            worker: The DataLoader worker (0 without workers).
            token: The new iterator's token.
            wait_s: How long to wait for the older holder to let go or expire.
            holder: Who asks (for messages), e.g. ``"host:pid"``.

        Returns:
            ``{"epoch": lease epoch, "ttl_s": LEASE_TTL_S, "next": where the rank's new iterator starts (after
            the last micro-batch handed out), "fp": the fingerprint of the micro-batches before it (or None)}``.

        Raises:
            EngineError: The older holder neither let go nor expired within ``wait_s``.
        """
        self._check_rank(rank)
        key = (rank, worker)
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                cur = self.leases.get(key)
                now = time.monotonic()
                if cur is None or cur.token == token or now - cur.renewed > LEASE_TTL_S:
                    if cur is None or cur.token != token:
                        epoch = self.lease_epochs.get(key, 0) + 1
                        self.lease_epochs[key] = epoch
                        self.leases[key] = _Lease(token, epoch, holder or token[:8], now)
                    else:
                        cur.renewed = now
                    lease = self.leases[key]
                    p = self._start(rank)
                    return {"epoch": lease.epoch, "ttl_s": LEASE_TTL_S, "next": p, "fp": self._fp(rank, p)}
                if cur.fence_by is None:
                    cur.fence_by = f"{holder or token[:8]} (lease epoch {self.lease_epochs.get(key, 0) + 1})"
                    self.cond.notify_all()
                if now >= deadline:
                    raise EngineError(
                        f"rank {rank} (worker {worker}) is held by a live iterator ({cur.holder}, lease epoch "
                        f"{cur.epoch}) that did not give it up within {wait_s:.0f} s; each rank has one consumer: "
                        "finish or close() the other dataset/iterator first")
                self.cond.wait(min(0.05, deadline - now))

    def unlease(self, rank: int, worker: int, token: str) -> None:
        """End the lease of ``token`` (its iterator finished, was closed, or let a newer one take over)."""
        with self.cond:
            cur = self.leases.get((rank, worker))
            if cur is not None and cur.token == token:
                del self.leases[(rank, worker)]
                self.cond.notify_all()

    def report(self, leases: Sequence[Sequence[Any]], commits: Sequence[Sequence[int]] = (),
               version: int | None = None, producers: Sequence[Sequence[Any]] = ()) -> dict[str, Any]:
        """One consumer process's news, sent off the trainer's thread: hand-outs, lease renewals, commits, version.

        Args:
            leases: ``[rank, worker, token, records, release]`` per live iterator of the process: ``records`` are
                ``[j, minibatch, microbatch, auto_upto]`` of the micro-batches it handed out since its last report
                (applied as :meth:`handed_many` while ``token`` holds the lease, ignored otherwise), then the lease
                is renewed, or ended when ``release`` is true.
            commits: ``[rank, upto]`` pairs (as :meth:`commit`).
            version: The trainer's new policy version (as :meth:`report_version`), applied last.
            producers: ``[producer id, holder, alive]`` of the producers in the process: ``alive`` is false once
                every thread that put through it ended (see ``producer_timeout_s``).

        Returns:
            ``{"fenced": [[rank, worker, token, newer holder], ...]}``: the iterators that must stop (a newer one
            asked for their lease: they let go with ``release``; or it was taken over).
        """
        fenced: list[list[Any]] = []
        with self.cond:
            now = time.monotonic()
            for pid, holder, alive in producers:
                prev = self.producers.get(str(pid))
                ended = None if alive else (prev[3] if prev is not None and prev[3] is not None else now)
                self.producers[str(pid)] = [str(holder), now, bool(alive), ended]
            for rank, worker, token, records, release in leases:
                self._check_rank(rank)
                key = (rank, worker)
                cur = self.leases.get(key)
                if cur is None and not release:  # the plane restarted (leases are not journaled): held again
                    epoch = self.lease_epochs.get(key, 0) + 1
                    self.lease_epochs[key] = epoch
                    cur = self.leases[key] = _Lease(str(token), epoch, str(token)[:8], now)
                if cur is None or cur.token != token:
                    by = "a newer iterator" if cur is None else f"{cur.holder} (lease epoch {cur.epoch})"
                    fenced.append([rank, worker, token, by])
                    continue
                if records:
                    self.handed_many(rank, records)
                if release:
                    del self.leases[key]
                    self.cond.notify_all()
                elif cur.fence_by is not None:
                    fenced.append([rank, worker, token, cur.fence_by])
                else:
                    cur.renewed = now
            for rank, upto in commits:
                self.commit(rank, upto)
            if version is not None:
                self.report_version(version)
        return {"fenced": fenced}

    def next_entries(self, rank: int, j: int, timeout_s: float, token: str | None = None,
                     worker: int = 0) -> dict[str, Any]:
        """Entries ``j..`` up to the end of ``j``'s mini-batch, waiting up to ``timeout_s``.

        Returns:
            ``{"entries": [...]}``, ``{"end": True}`` (closed and drained), or ``{"wait": True}`` (nothing yet).

        Raises:
            StateError: Entry ``j`` was committed and released. IncompleteStreamError: The stream ended with
                trajectories that were never admitted. FencedError: ``token`` no longer holds the lease of
                ``(rank, worker)``. The admission error that stopped the pipeline.
        """
        self._check_rank(rank)
        deadline = time.monotonic() + timeout_s
        key = (rank, worker)
        with self.cond:
            while True:
                if token is not None:
                    cur = self.leases.get(key)
                    if cur is None:  # the plane restarted (leases are not journaled): held again
                        epoch = self.lease_epochs.get(key, 0) + 1
                        self.lease_epochs[key] = epoch
                        cur = self.leases[key] = _Lease(token, epoch, token[:8], time.monotonic())
                    if cur.token != token or cur.fence_by is not None:
                        by = (cur.fence_by if cur.token == token and cur.fence_by is not None
                              else f"{cur.holder} (lease epoch {cur.epoch})")
                        raise FencedError(fenced_message(rank, worker, by))
                    cur.renewed = time.monotonic()
                if self.error is not None:
                    raise self.error
                if j < self.planned[rank]:
                    q = self.queues[rank]
                    if j not in q:
                        raise StateError(
                            f"micro-batch {j} of rank {rank} was already committed and released (rank {rank} committed "
                            f"up to {self.committed[rank]}); resume from the last committed state or a later one")
                    first = q[j]
                    out = [first]
                    k = j + 1
                    while k in q and q[k]["minibatch"] == first["minibatch"]:
                        out.append(q[k])
                        k += 1
                    return {"entries": out}
                if self.closed:
                    rep = self.close_report or {}
                    if rep.get("dropped_trajectories"):
                        raise IncompleteStreamError(self._incomplete_message(rep))
                    return {"end": True}
                gone = self._producers_gone()
                if gone is not None:
                    raise IncompleteStreamError(gone)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return {"wait": True}
                self.cond.wait(remaining)

    @_journaled
    def handed(self, rank: int, j: int, minibatch: int, microbatch: int, auto_commit: bool = True) -> None:
        """Entry ``j`` of ``rank`` was handed out to the trainer (staleness; release per ``release``: with
        ``"step"`` and ``auto_commit`` the entries before a mini-batch's first micro-batch are released)."""
        self._check_rank(rank)
        with self.cond:
            self._handed(rank, j, microbatch, j if auto_commit else 0)

    @_journaled
    def handed_many(self, rank: int, records: Sequence[Sequence[Any]]) -> None:
        """:meth:`handed` for ``[j, minibatch, microbatch, auto_upto, version]`` records of ``rank``, in order.

        ``auto_upto``: with ``release="step"``, when ``j`` starts a mini-batch, release the rank's entries below
        ``min(j, auto_upto)`` (the consumer's last saved position caps it; ``0``: release nothing). ``version``: the
        trainer's policy version when it took the micro-batch, as its process last reported it (``-1`` or absent:
        the version last reported here); staleness is measured against it.
        """
        self._check_rank(rank)
        with self.cond:
            for rec in records:
                j, microbatch, auto_upto = int(rec[0]), int(rec[2]), int(rec[3])
                v = int(rec[4]) if len(rec) > 4 else -1
                self._handed(rank, j, microbatch, min(j, auto_upto), v)

    def _handed(self, rank: int, j: int, microbatch: int, auto_upto: int, version: int = -1) -> None:
        e = self.queues[rank].get(j)
        if e is not None:
            v = version if version >= 0 else self.version
            self.staleness.extend([v - g for g in e["info"]["gen_versions"]])
        if self.release_mode == "handout":
            self._drop_entry(rank, j)
        elif self.release_mode == "step" and auto_upto > 0 and microbatch == 0:
            self._commit(rank, auto_upto)
        if j + 1 > self.position[rank]:
            self.position[rank] = j + 1

    @_journaled
    def commit(self, rank: int, upto: int) -> int:
        """Release ``rank``'s entries below ``upto``; returns how many micro-batches were released."""
        self._check_rank(rank)
        with self.cond:
            return self._commit(rank, int(upto))

    def commit_async(self, rank: int, upto: int) -> None:
        """:meth:`commit` without a result (engines forward it without waiting)."""
        self.commit(rank, upto)

    @_journaled
    def seek(self, rank: int, j: int) -> None:
        """``rank`` restored at entry ``j``: everything below is committed (released now or when planned)."""
        self._check_rank(rank)
        with self.cond:
            self._commit(rank, int(j))
            self.position[rank] = int(j)

    @_journaled
    def verify(self, rank: int, length: int, fp: str, where: str = "") -> None:
        """Check that ``rank``'s first ``length`` micro-batches have the fingerprint ``fp`` (of a saved state).

        Checked now when they are planned, else as soon as they are (a new job refilled after its consumers
        loaded their states). A mismatch (the refill put other trajectories, sources or groups, or in another
        order) raises :class:`~knitdata.errors.StateError` now, or stops the pipeline with it when found later,
        so that nothing is delivered twice or skipped silently.

        Args:
            rank: The consumer.
            length: How many of its micro-batches the fingerprint covers.
            fp: The fingerprint, as in the state (:meth:`start_point`, the entries' ``fp``).
            where: The state's position, for the message.

        Raises:
            StateError: The fingerprint differs, or it is older than what this plane keeps.
        """
        self._check_rank(rank)
        length = int(length)
        with self.cond:
            if length > self.planned[rank]:
                self.verify_at[rank] = (length, str(fp), str(where))
                return
            have = self._fp(rank, length)
            if have is None:
                if self.chain[rank] is None or length < self.committed[rank] - FP_KEEP:
                    return  # unknown here (an old snapshot, or far below the committed position): not checkable
                raise StateError(f"rank {rank}: no fingerprint of its first {length} micro-batches")
            if have != fp:
                raise StateError(self._mismatch_message(rank, length, where))

    def start_position(self, rank: int) -> int:
        """Where a new dataset of ``rank`` starts: after the last micro-batch handed out to the rank.

        A consumer that crashed restores its saved state instead (:meth:`seek`), which may go back to the
        rank's committed position.
        """
        self._check_rank(rank)
        with self.cond:
            return self._start(rank)

    def start_point(self, rank: int) -> dict[str, Any]:
        """``{"next": start_position(rank), "fp": fingerprint of the micro-batches before it (None: unknown)}``."""
        self._check_rank(rank)
        with self.cond:
            p = self._start(rank)
            return {"next": p, "fp": self._fp(rank, p)}

    def _start(self, rank: int) -> int:
        return max(self.position[rank], self.committed[rank])

    def _fp(self, rank: int, length: int) -> str | None:
        """The fingerprint of ``rank``'s first ``length`` micro-batches, if known here."""
        fp = self.fps[rank].get(length)
        if fp is None and length > self.planned[rank]:
            v = self.verify_at[rank]
            if v is not None and v[0] == length:
                return v[1]
        return fp

    def _producers_gone(self) -> str | None:
        """The message when every producer stopped without close() for ``producer_timeout_s`` (else ``None``)."""
        timeout = self.producer_timeout_s
        if timeout is None or not self.producers:
            return None
        now = time.monotonic()
        gone = []  # (holder, since when it counts as gone, why)
        for holder, seen, alive, ended in self.producers.values():
            if now - seen > PRODUCER_TTL_S:
                gone.append((holder, seen + PRODUCER_TTL_S, f"no report for {now - seen:.0f} s: its process died?"))
            elif not alive:
                gone.append((holder, ended, "the threads that put through it ended"))
            else:
                return None
        last = max(t for _h, t, _w in gone)
        if now - last < timeout:
            return None
        who = "; ".join(f"{h}: {why}" for h, _t, why in gone[:8]) + (f"; and {len(gone) - 8} more" if len(gone) > 8 else "")
        return (f"every producer of this pipeline stopped without close() ({who}) {now - last:.0f} s ago, and admission "
                f"is still waiting for: {self._missing_text()}. Call close() when production ends (in a finally: "
                "block, so that a failing producer closes too), or withdraw() the groups it will not finish; "
                "Pipeline(producer_timeout_s=None) waits instead (up to the dataset's timeout)")

    def _mismatch_message(self, rank: int, length: int, where: str) -> str:
        e = self.queues[rank].get(length - 1)
        last = ""
        if e is not None:
            ids = [x[0] for x in e["items"]]
            last = (f"; this pipeline planned mini-batch {e['minibatch']} micro-batch {e['microbatch']} there with "
                    f"trajectories {ids[:8]}" + (" ..." if len(ids) > 8 else ""))
        return (f"rank {rank}: the saved state ({where or f'after {length} micro-batches'}) was taken in a run whose "
                f"first {length} micro-batches of rank {rank} differ from this pipeline's (other trajectory ids, "
                f"sources or groups, or another order of puts){last}. A new job must be refilled with the same puts "
                "in the same order as the run that saved the states; otherwise start it without loading them")

    def report_consumer(self, rank: int, stats: Mapping[str, Any]) -> None:
        """A consumer's metrics summary (:meth:`knitdata.metrics.ConsumerMetrics.to_dict`), for :meth:`stats`."""
        self._check_rank(rank)
        with self.cond:
            self.consumer_stats[rank] = dict(stats)

    def report_transfer(self, meter: Mapping[str, Any]) -> None:
        """Add a process's transfer counters (:meth:`knitdata.metrics.TransferMeter.to_dict`) to the totals."""
        self.transfer.merge(meter)

    # ------------------------------------------------------------------------------------ diagnostics
    def holders(self, unit: str) -> str:
        """Who holds ``unit``'s memory: uncommitted micro-batches per rank, and trajectories awaiting admission."""
        with self.cond:
            parts = []
            for r, q in enumerate(self.queues):
                n = nb = 0
                for e in q.values():
                    mine = [x for x in e["items"] if x[1] == unit]
                    if mine:
                        n += 1
                        nb += sum(int(x[2]) for x in mine)
                if n:
                    parts.append(f"rank {r}: {n} uncommitted micro-batches ({nb} bytes, committed up to "
                                 f"{self.committed[r]}, handed out up to {self.position[r]})")
            waiting = [m for m in self.pending.values() if m.location == unit]
            if waiting:
                parts.append(f"{len(waiting)} trajectories waiting for admission ({sum(m.nbytes for m in waiting)} bytes)")
            return "; ".join(parts) if parts else "nothing the control plane knows of (puts in progress only)"

    def missing(self) -> str:
        """What admission still waits for: per source needed/ready, incomplete groups."""
        with self.cond:
            return self._missing_text()

    def stats(self) -> dict[str, Any]:
        """JSON-serializable counters of the control plane."""
        with self.cond:
            times = list(self.version_times)
            return {
                **self.counts, "closed": self.closed, "version": self.version, "release": self.release_mode,
                "rejected_by_cause": dict(self.rejected_by_cause),
                "held_trajectories": len(self.live), "ready_not_admitted": self.policy.ready_counts(),
                "planned": list(self.planned), "committed": list(self.committed), "positions": list(self.position),
                "held_microbatches": [len(q) for q in self.queues],
                "staleness": summarize(self.staleness),
                "version_interval_s": summarize(b - a for a, b in zip(times, times[1:])),
                "close_report": self.close_report, "consumers": list(self.consumer_stats),
                "placement": self.placement.summary(), "transfer": self.transfer.to_dict(),
            }

    # ------------------------------------------------------------------------------------ internals
    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.layout.num_consumers:
            raise ConfigError(f"rank must be an int in 0..{self.layout.num_consumers - 1}, got {rank!r}")

    def _check_open(self) -> None:
        if self.closed:
            raise PipelineClosedError("the pipeline is closed (end of stream); build a new Pipeline to continue")
        if self.error is not None:
            raise PipelineClosedError(f"the pipeline stopped after an admission error: {self.error}")

    def _count_rejected(self, e: KnitdataError) -> None:
        cause = getattr(e, "field", None) or type(e).__name__
        cause = cause.split(".")[0]
        self.rejected_by_cause[cause] = self.rejected_by_cause.get(cause, 0) + 1
        self.counts["rejected"] += 1

    def _check_put(self, meta: Mapping[str, Any], tid: str, batch: set[str], schema: Mapping[str, Any] | None) -> None:
        """The checks of a put that need the plane's state (``batch``: ids earlier in the same call)."""
        if meta["source"] not in self.spec.quotas:
            raise ValidationError(f"unknown source {meta['source']!r}; the batch spec has {list(self.spec.sources)}",
                                  trajectory_id=tid, field="source")
        if tid in self.live or tid in batch:
            raise ValidationError("was already put and is still held; ids must be unique", trajectory_id=tid,
                                  field="id")
        if tid in self.delivered:
            raise ValidationError("was already put, delivered and released (a retry of a put that was accepted?); "
                                  "ids must be unique", trajectory_id=tid, field="id")
        if meta["group"] in self.withdrawn:
            raise ValidationError(f"its group {meta['group']!r} was withdrawn (aborted or filtered); a late member is "
                                  "not accepted", trajectory_id=tid, field="group")
        self._check_schema(tid, meta.get("fields"), schema)

    def _check_schema(self, tid: str, fields: Mapping[str, Any] | None,
                      schema: Mapping[str, Any] | None = None) -> None:
        schema = self.schema if schema is None else schema
        if schema is None or fields is None:
            return
        want_s, want_t = set(schema["scalars"]), dict(schema["tensors"])
        have_s, have_t = set(fields["scalars"]), dict(fields["tensors"])
        for kind, have, want in (("scalars", have_s, want_s), ("tensors", set(have_t), set(want_t))):
            if have != want:
                missing, extra = sorted(want - have), sorted(have - want)
                raise ValidationError(
                    f"carries {kind} {sorted(have)} but this pipeline's trajectories carry {sorted(want)} (missing "
                    f"{missing}, unexpected {extra}); every trajectory needs the same fields so that any micro-batch "
                    "collates", trajectory_id=tid, field=f"{kind}.{(missing or extra)[0]}")
        for name, dt in have_t.items():
            if want_t[name] != dt:
                raise FieldTypeError(
                    f"has dtype {dt} but the pipeline's first trajectory fixed {want_t[name]} for this field; cast it "
                    "before put (a micro-batch holds one dtype per field)", trajectory_id=tid, field=f"tensors.{name}")

    def _fail(self, e: KnitdataError) -> None:
        self.error = e
        self.cond.notify_all()

    def _release_metas(self, metas: Sequence[TrajectoryMeta], delivered: bool = False) -> None:
        by_unit: dict[str, list[str]] = {}
        for m in metas:
            if delivered:
                self.delivered[m.id] = None
                while len(self.delivered) > DELIVERED_MEMORY:
                    self.delivered.popitem(last=False)
            live = self.live.pop(m.id, None)
            self.loss.pop(m.id, None)
            self.put_tokens.pop(m.id, None)
            if m.location is not None and live is not None:
                by_unit.setdefault(m.location, []).append(m.id)
        for u, ids in by_unit.items():
            self._release(u, ids, False)
            self.counts["released"] += len(ids)
            self.recent_releases.append((u, ids))
            self._recent_ids += len(ids)
            while self._recent_ids > RECENT_RELEASES and len(self.recent_releases) > 1:
                self._recent_ids -= len(self.recent_releases.popleft()[1])

    def _drop_entry(self, rank: int, j: int) -> None:
        e = self.queues[rank].pop(j, None)
        if e is not None:
            self._release_metas([self.live[tid] for tid, _u, _n in e["items"] if tid in self.live], delivered=True)
        while self.committed[rank] < self.planned[rank] and self.committed[rank] not in self.queues[rank]:
            self.committed[rank] += 1
        self._prune_fps(rank)

    def _commit(self, rank: int, upto: int) -> int:
        top = min(upto, self.planned[rank])
        q = self.queues[rank]
        n = 0
        for j in range(self.committed[rank], top):
            n += j in q
            self._drop_entry(rank, j)
        # positions past what is planned yet (a restore before the refill): released as they are planned
        if upto > self.committed[rank]:
            self.committed[rank] = upto
        self._prune_fps(rank)
        if n:
            self.cond.notify_all()
        return n

    def _prune_fps(self, rank: int) -> None:
        """Forget the prefix fingerprints of ``rank`` far below its committed position (no state lies there)."""
        fps = self.fps[rank]
        floor = min(self.committed[rank], self.planned[rank]) - FP_KEEP
        if fps and next(iter(fps)) < floor:  # lengths are inserted in increasing order
            for k in [k for k in fps if k < floor]:
                del fps[k]

    def _check_verifications(self) -> None:
        """Run the pending fingerprint checks whose micro-batches are planned now; a mismatch stops the pipeline."""
        for rank, v in enumerate(self.verify_at):
            if v is None or v[0] > self.planned[rank]:
                continue
            self.verify_at[rank] = None
            have = self._fp(rank, v[0])
            if have is not None and have != v[1]:
                err = StateError(self._mismatch_message(rank, v[0], v[2]))
                self._fail(err)
                raise err

    def _poll(self) -> None:
        try:
            admitted = self.policy.poll(time.monotonic())
        except KnitdataError as e:
            self._fail(e)
            raise
        planned: list[tuple[AdmittedMiniBatch, MiniBatchPlan]] = []
        for mb in admitted:
            plan = self.planner.plan(mb, self.loss)
            self.counts["admitted_minibatches"] += 1
            self.counts["admitted_trajectories"] += len(mb.trajectories)
            self.counts["planned_local_bytes"] += plan.local_bytes
            self.counts["planned_remote_bytes"] += plan.remote_bytes
            for m in mb.trajectories:
                self.pending.pop(m.id, None)
                self.placement.forget_group(m.group)
            for rank, row in enumerate(plan.microbatches):
                fps, chain = self.fps[rank], self.chain[rank]
                for pmb in row:
                    j = self.planned[rank]
                    self.planned[rank] = j + 1
                    info = pmb.to_info().to_dict()
                    if chain is not None:
                        chain = entry_fingerprint(chain, info)
                        fps[j + 1] = chain
                    if j < self.committed[rank]:  # the rank restored past it: release at once
                        self._release_metas([self.live[m.id] for m in pmb.trajectories if m.id in self.live],
                                            delivered=True)
                        continue
                    self.queues[rank][j] = {
                        "j": j, "minibatch": pmb.minibatch, "microbatch": pmb.microbatch, "info": info,
                        "items": [[m.id, m.location, m.nbytes] for m in pmb.trajectories], "fp": chain,
                    }
                self.chain[rank] = chain
                self._prune_fps(rank)
            planned.append((mb, plan))
        if admitted:
            self.cond.notify_all()
            self._check_verifications()
        if self._on_plan is not None:  # after every plan is queued: a failing hook loses no mini-batch
            for mb, plan in planned:
                self._on_plan(mb, plan)

    def _missing_text(self) -> str:
        need = self.policy.remaining_quota()
        ready = self.policy.ready_counts()
        srcs = [f"{s}: {need.get(s, 0)} still to admit in train batch {self.policy.train_batch}, "
                f"{ready.get(s, 0)} ready" for s in self.spec.sources]
        groups: dict[str, int] = {}
        for m in self.pending.values():
            groups[m.group] = groups.get(m.group, 0) + 1
        g = self.spec.group_size
        partial = sorted(k for k, n in groups.items() if n < g)
        text = "sources " + "; ".join(srcs)
        if partial:
            shown = ", ".join(f"{k} ({groups[k]} of {g})" for k in partial[:10])
            text += f"; incomplete groups {shown}" + (f" and {len(partial) - 10} more" if len(partial) > 10 else "")
        if self.putting:
            text += f"; {len(self.putting)} puts in progress"
        return text

    def _incomplete_message(self, rep: Mapping[str, Any]) -> str:
        groups = rep["dropped_groups"]
        members = rep.get("group_members", {})
        shown = ", ".join(f"{k} ({members.get(k, '?')} of {rep.get('group_size')})" for k in groups[:10])
        more = f" and {len(groups) - 10} more" if len(groups) > 10 else ""
        return (f"the pipeline was closed with {rep['dropped_trajectories']} stored trajectories never admitted "
                f"(an incomplete train batch or group): by source {rep['by_source']}, groups {shown}{more}; every "
                "admitted mini-batch was delivered. Complete or withdraw() the groups before close(), or treat this "
                "as the end of the run")
