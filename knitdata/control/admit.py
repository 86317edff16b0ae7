"""Put and admission: the checks of a put, admission, planning of what is admitted, withdrawals, end of stream.

The path of one trajectory (:meth:`Admission.admit_many`, one call per put): the producer keeps a replica of the
placement (:meth:`Admission.placement_view`) and stores the payload on the unit it picks; the unit then asks the
plane to admit it. The plane runs the checks that need its state (source, unique id, withdrawn group, field
schema; one bad trajectory refuses its whole batch, whose payloads the unit drops), accounts the unit in its
placement, hands the metadata to admission and plans every mini-batch admitted at once. A call retried after a
coordinator restart is recognized by its put tokens. With one producer the replica picks exactly the units
:meth:`Placement.place` would; concurrent producers may pick a unit a little off balance, which is accounted
where it is.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from knitdata.admission import AdmittedMiniBatch
from knitdata.control.positions import check_verifications
from knitdata.control.records import Admitted, PlacementView, Refusal
from knitdata.control.reshape import note_planned, route
from knitdata.control.state import WITHDRAWN_MEMORY, PlaneState
from knitdata.control.surface import Part, control_call, control_part
from knitdata.errors import (
    ConfigError,
    FieldTypeError,
    KnitdataError,
    QuotaInfeasibleError,
    RolloutThrottled,
    ValidationError,
)
from knitdata.observe import trace as tracing
from knitdata.planner import MiniBatchPlan
from knitdata.record import TrajectoryMeta

__all__ = ["Admission", "acquire_rollout", "check_schema", "rejection_cause"]


def rejection_cause(e: KnitdataError) -> str:
    """The cause a refused put is counted under: its error's field (first part) or class name."""
    return str(getattr(e, "field", None) or type(e).__name__).split(".")[0]


def check_schema(tid: str, fields: Mapping[str, Any] | None, schema: Mapping[str, Any] | None) -> None:
    """Refuse trajectory ``tid`` whose ``fields`` (:func:`~knitdata.control.state.fields_of`) differ from
    ``schema`` (the pipeline's first trajectory's; ``None``: not fixed yet).

    Raises:
        ValidationError: Other scalar or tensor names. FieldTypeError: Another dtype.
    """
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


def acquire_rollout(engine: Any, want: Mapping[str, int], version: int | None = None, timeout: float | None = 60.0,
                    poll_s: float = 0.01) -> None:
    """The throttle of ``on_stale="wait"`` (:meth:`knitdata.Pipeline.acquire_rollout`): block until the staleness
    bound has room, then reserve ``want`` prompts (groups) per source, to start with policy ``version`` (default: the
    trainer's last reported). A reservation ends when the first member of a group of that source is put (or with
    :meth:`Admission.unreserve_rollout`). With ``on_stale="drop"`` it returns at once and reserves nothing.

    Args:
        engine: The pipeline's engine (its ``control`` and ``config``).
        want: ``{source: prompts}``.
        version: The policy version the prompts will be generated with.
        timeout: Most seconds to wait (``None``: no limit); tries are ``poll_s`` apart, doubling up to 0.2 s.
        poll_s: The first pause.

    Raises:
        RolloutThrottled: No room within ``timeout`` (the trainer has not advanced: it waits for other sources, or
            the consumers stopped); the message gives the capacity and what admission waits for. At once, without
            waiting, when ``version`` is already too old for a source's bound (the message names the source, the
            version, the trainer's and ``max_staleness``): retry with newer weights.
        ValidationError: At once, when ``want`` asks for more groups of a source than its bound's window of
            ``eta_s + 1`` steps can ever hold (waiting would be in vain).
        ConfigError: The pipeline has no ``max_staleness``.
    """
    plane = engine.control
    if dict(engine.config["admission_options"]).get("on_stale", "drop") != "wait":
        plane.admission.rollout_capacity(version)  # raises without a bound
        return
    out_of_reach = plane.admission.rollout_out_of_reach(dict(want), version)
    if out_of_reach is not None:
        raise RolloutThrottled(out_of_reach)  # a throttle: a caller that retries with newer weights still can
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = poll_s
    while not plane.admission.reserve_rollout(dict(want), version):
        if deadline is not None and time.monotonic() >= deadline:
            raise RolloutThrottled(f"no room within max_staleness for {dict(want)} after {timeout} s (capacity now "
                                   f"{plane.admission.rollout_capacity(version)}); the trainer must advance first: it "
                                   f"waits for {plane.reporting.missing()}")
        time.sleep(pause)
        pause = min(0.2, pause * 2)


def trace_admitted(tr: tracing.Tracer, mb: AdmittedMiniBatch, plan: MiniBatchPlan | None, t0: float) -> None:
    """Record an admitted mini-batch (``admit``: its trajectories per source and ``held_by``, the source of the
    trajectory that arrived last, whose quota held the mini-batch back) and its plan (``plan``)."""
    by_source: dict[str, int] = {}
    last = None
    for m in mb.trajectories:
        by_source[m.source] = by_source.get(m.source, 0) + 1
        if last is None or m.seq > last.seq:
            last = m
    args = {"step": mb.step, "train_batch": mb.train_batch, "index": mb.index, "trajectories": len(mb.trajectories),
            "by_source": by_source, "held_by": None if last is None else last.source}
    tr.instant("admit", "admission", args, ts_us=t0)
    if plan is not None:
        tr.span("plan", "admission", t0, tracing.now_us(), {"step": mb.step, "microbatches": plan.num_microbatches,
                                                            "local_bytes": plan.local_bytes,
                                                            "remote_bytes": plan.remote_bytes})


@control_part("admission")
class Admission(Part):
    """The producer side of one plane: puts, admission and planning, withdrawals, in-flight counts, close."""

    def __init__(self, s: PlaneState) -> None:
        super().__init__(s)
        s.admission_poll = self.poll  # a version report can free admission (the bound learned its offset)
        #: The schema of the first trajectory put (every later one must match it).
        self.schema: dict[str, Any] | None = None
        #: The withdrawn groups (their late members are refused), the oldest forgotten first.
        self.withdrawn: OrderedDict[str, None] = OrderedDict()

    def state_dict(self) -> dict[str, Any]:
        """This part's slice of a snapshot: ``schema`` and ``withdrawn`` (see
        :class:`~knitdata.control.durability.StateSlice`)."""
        return {"schema": self.schema, "withdrawn": list(self.withdrawn)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore this part's slice from a checked snapshot ``d``."""
        self.schema = d["schema"]
        self.withdrawn = OrderedDict.fromkeys(d["withdrawn"])

    @control_call(journaled=True)
    def admit_many(self, unit: str, items: Sequence[Sequence[Any]]) -> Admitted:
        """The one-round-trip put: payloads already stored on ``unit`` are checked, placed there and admitted.

        The producer chose ``unit`` with a replica of the placement (:meth:`placement_view`), stored the
        payloads, and the unit (on Ray, the storage-unit actor itself) makes this one call. Every check runs
        first for the whole batch: one bad trajectory refuses the batch (the unit drops every payload of it). A
        call retried after a coordinator restart is recognized by its put tokens and answers as the first time.

        Args:
            unit: The storage unit holding the payloads.
            items: ``[metadata, loss_tokens, token]`` per trajectory, in arrival order: metadata is
                :meth:`TrajectoryMeta.to_dict` plus ``fields`` (:func:`~knitdata.control.fields_of`), ``token``
                a string unique to this put.

        Returns:
            :class:`~knitdata.control.records.Admitted`: the :class:`~knitdata.record.TrajectoryMeta` (or ``None``)
            of each item, the :class:`~knitdata.control.records.Refusal` s, the placement view and the next arrival
            index. Refused items (``None``) are not held by the plane: the unit drops their payloads.

        Raises:
            ConfigError: An unknown unit.
            QuotaInfeasibleError: Admission found the quotas impossible (the pipeline stops).
        """
        s = self.s
        if unit not in s.unit_nodes:
            raise ConfigError(f"unknown storage unit {unit!r}; the units are {list(s.unit_nodes)[:8]}")
        accepted: list[TrajectoryMeta | None] = [None] * len(items)
        errors: list[Refusal] = []
        with s.cond:
            fresh = self._check_batch(items, accepted, errors)
            if errors:  # refused with the batch: the good ones too (retried ones stay accepted)
                if fresh:
                    s.count_rejected("batch", len(fresh))
                return Admitted(accepted, errors, s.placement.view(), s.seq)
            raised = self._admit_checked(unit, items, fresh, accepted, errors)
            # a non-knitdata exception (an on_plan hook's) goes to the pipeline in process, re-raised there
            return Admitted(accepted, errors, s.placement.view(), s.seq,
                            None if raised is None or isinstance(raised, KnitdataError) else raised)

    def _check_batch(self, items: Sequence[Sequence[Any]], accepted: list[TrajectoryMeta | None],
                     errors: list[Refusal]) -> list[int]:
        """Every check of a batch, no state changed; fills ``accepted`` for retried items and ``errors``; returns
        the indices of the new items."""
        s = self.s
        fresh: list[int] = []
        seen: set[str] = set()
        schema = self.schema
        for k, (meta, _loss, token) in enumerate(items):
            tid = str(meta["id"])
            try:
                done = s.live.get(tid)
                if done is not None and s.put_tokens.get(tid) == token:
                    accepted[k] = done  # a retried call (the coordinator restarted before answering)
                    continue
                s.check_open()
                self._check_put(meta, tid, seen, schema)
            except KnitdataError as e:
                errors.append(Refusal.of(tid, e))
                s.count_rejected(rejection_cause(e))
                continue
            seen.add(tid)
            if schema is None and meta.get("fields") is not None:
                schema = meta["fields"]
            fresh.append(k)
        return fresh

    def _admit_checked(self, unit: str, items: Sequence[Sequence[Any]], fresh: list[int],
                       accepted: list[TrajectoryMeta | None], errors: list[Refusal]) -> BaseException | None:
        """Place, admit and plan the checked items ``fresh`` of a batch; returns what stopped admission, if any."""
        s = self.s
        raised: BaseException | None = None
        for k in fresh:
            meta, loss, token = items[k]
            if raised is not None:  # admission stopped (or a hook failed) after an earlier item: not admitted
                errors.append(Refusal(str(meta["id"]), type(raised).__name__, str(raised)))
                continue
            m = TrajectoryMeta.from_dict({**{x: v for x, v in meta.items() if x != "fields"}, "seq": s.seq,
                                          "location": unit})
            try:
                s.placement.place_at(m, unit)
                try:
                    s.policy.offer([m])
                except BaseException:
                    s.placement.unplace(m, unit)
                    raise
            except KnitdataError as e:
                s.count_rejected(rejection_cause(e))
                errors.append(Refusal.of(m.id, e))
                continue
            except BaseException as e:  # not admitted, nor anything after it; the producer gets the error
                raised = e
                s.count_rejected(type(e).__name__)
                errors.append(Refusal(m.id, type(e).__name__, str(e)))
                continue
            s.seq += 1
            fields = meta.get("fields")
            if self.schema is None and fields is not None:
                self.schema = {"scalars": list(fields["scalars"]), "tensors": dict(fields["tensors"])}
            s.live[m.id] = m
            s.put_tokens[m.id] = str(token)
            s.loss[m.id] = int(loss)
            s.pending[m.id] = m
            s.observed.put_times[m.id] = time.monotonic()
            s.counts["puts"] += 1
            row = s.observed.source_counts.get(m.source)
            if row is not None:
                row["puts"] += 1
            accepted[k] = m
            try:
                self.poll()
            except BaseException as e:  # this item is admitted; the producer gets the error
                raised = e
                errors.insert(0, Refusal(m.id, type(e).__name__, str(e)))
        return raised

    def _check_put(self, meta: Mapping[str, Any], tid: str, batch: set[str], schema: Mapping[str, Any] | None) -> None:
        """The checks of a put that need the plane's state (``batch``: ids earlier in the same call)."""
        s = self.s
        if meta["source"] not in s.spec.quotas:
            raise ValidationError(f"unknown source {meta['source']!r}; the batch spec has {list(s.spec.sources)}",
                                  trajectory_id=tid, field="source")
        if tid in s.live or tid in batch:
            raise ValidationError("was already put and is still held; ids must be unique", trajectory_id=tid,
                                  field="id")
        if tid in s.delivered:
            raise ValidationError("was already put, delivered and released (a retry of a put that was accepted?); "
                                  "ids must be unique", trajectory_id=tid, field="id")
        if meta["group"] in self.withdrawn:
            raise ValidationError(f"its group {meta['group']!r} was withdrawn (aborted or filtered); a late member is "
                                  "not accepted", trajectory_id=tid, field="group")
        check_schema(tid, meta.get("fields"), schema)

    @control_call(journaled=True)
    def admit_batches(self, unit: str, batches: Sequence[Sequence[Sequence[Any]]]) -> list[Admitted]:
        """:meth:`admit_many` for several independent batches stored on ``unit`` (concurrent puts a unit sends
        together), in order, under one lock; each batch is refused or admitted on its own.

        Returns:
            The :class:`~knitdata.control.records.Admitted` of each batch, in order.

        Raises:
            ConfigError: An unknown unit. QuotaInfeasibleError: As :meth:`admit_many`.
        """
        with self.s.cond:
            return [self.admit_many(unit, b) for b in batches]

    @control_call()
    def placement_view(self) -> PlacementView:
        """The placement's view and the next arrival index, for a producer's placement replica (see
        :meth:`admit_many`)."""
        with self.s.cond:
            return PlacementView(self.s.placement.view(), self.s.seq)

    @control_call()
    def note_rejected(self, traj_id: str | None, cause: str) -> None:
        """A put refused before it reached the plane (validation in the producer): counted by ``cause``.

        A waited call, not fire-and-forget: a refusal is rare, and a ``stats()`` read right after the put raised
        counts it (a remote coordinator runs calls on several threads, so a fired call could land after the read).
        """
        with self.s.cond:
            self.s.count_rejected(cause)

    @control_call(journaled=True)
    def set_in_flight(self, counts: Mapping[str, int]) -> None:
        """See :meth:`knitdata.admission.AdmissionPolicy.set_in_flight`.

        Raises:
            QuotaInfeasibleError: A source can no longer deliver its quota (the pipeline stops).
        """
        s = self.s
        with s.cond:
            s.check_open()
            try:
                s.policy.set_in_flight(dict(counts))
            except QuotaInfeasibleError as e:
                s.fail(e)
                raise
            self.poll()

    @control_call(journaled=True)
    def withdraw(self, group: str) -> list[dict[str, Any]]:
        """Drop a group waiting for admission; late members are refused. Returns the dropped members."""
        s = self.s
        with s.cond:
            metas = s.policy.withdraw(group)
            self.withdrawn[group] = None
            while len(self.withdrawn) > WITHDRAWN_MEMORY:
                self.withdrawn.popitem(last=False)
            for m in metas:
                s.pending.pop(m.id, None)
                s.observed.put_times.pop(m.id, None)
            s.release_metas(metas)
            s.counts["withdrawn"] += len(metas)
            s.placement.forget_group(group)
            if not s.closed and s.error is None:
                self.poll()
            return [m.to_dict() for m in metas]

    @control_call(journaled=True)
    def close(self) -> dict[str, Any]:
        """End of stream. Idempotent.

        Returns:
            What was dropped: ``{"dropped_trajectories", "dropped_groups", "by_source", "in_progress"}``
            (trajectories that were stored but never admitted: an incomplete train batch or group). Consumers
            finish the admitted mini-batches, then raise :class:`~knitdata.errors.IncompleteStreamError` if
            anything was dropped.
        """
        s = self.s
        with s.cond:
            if s.close_report is None:
                dropped = list(s.pending.values())
                by_source: dict[str, int] = {}
                groups: dict[str, int] = {}
                for m in dropped:
                    by_source[m.source] = by_source.get(m.source, 0) + 1
                    groups[m.group] = groups.get(m.group, 0) + 1
                s.close_report = {
                    "dropped_trajectories": len(dropped), "dropped_groups": sorted(groups),
                    "by_source": by_source, "in_progress": [],
                    "group_members": groups, "group_size": s.spec.group_size,
                }
                s.counts["dropped_at_close"] = len(dropped)
            s.closed = True
            s.cond.notify_all()
            return dict(s.close_report)

    # ------------------------------------------------------------------------------------ staleness bound
    @control_call()
    def rollout_capacity(self, version: int | None = None) -> dict[str, int]:
        """Groups (prompts) per source that may still start with policy ``version`` (default: the trainer's last
        reported version) and be admitted within ``max_staleness``; see
        :meth:`~knitdata.admission.AdmissionPolicy.rollout_capacity`.

        Raises:
            ConfigError: The pipeline has no staleness bound.
        """
        with self.s.cond:
            return self.s.policy.rollout_capacity(self._version(version))

    @control_call(journaled=True)
    def reserve_rollout(self, counts: Mapping[str, int], version: int | None = None) -> bool:
        """Reserve ``counts`` groups per source if the bound leaves room for all (all or nothing); see
        :meth:`~knitdata.admission.AdmissionPolicy.reserve`."""
        with self.s.cond:
            return self.s.policy.reserve(dict(counts), self._version(version))

    @control_call()
    def rollout_out_of_reach(self, counts: Mapping[str, int], version: int | None = None) -> str | None:
        """Why ``counts`` can never be reserved with policy ``version`` (``None`` when it may fit, now or later): a
        source whose bound's window ``version + max_staleness + 1 - offset - step`` is already <= 0 with the
        trainer's offset known (given or learned); the step only grows, so waiting cannot help."""
        with self.s.cond:
            return self.s.policy.out_of_reach(dict(counts), self._version(version))

    @control_call(journaled=True)
    def unreserve_rollout(self, counts: Mapping[str, int]) -> None:
        """Give back reservations of prompts that will not be generated."""
        with self.s.cond:
            self.s.policy.unreserve(dict(counts))

    @control_call(journaled=True)
    def take_dropped(self) -> list[dict[str, Any]]:
        """The groups the staleness bound dropped since the last call, for the producer to regenerate (see
        :meth:`~knitdata.admission.AdmissionPolicy.take_dropped`)."""
        with self.s.cond:
            return self.s.policy.take_dropped()

    def _version(self, version: int | None) -> int:
        if version is None:
            return self.s.version
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValidationError(f"version must be a non-negative int or None, got {version!r}", field="version")
        return version

    def _release_dropped(self) -> None:
        """Free the payloads of the groups the staleness bound dropped (the policy lists them for regeneration)."""
        s = self.s
        metas = s.policy.pop_released()
        if not metas:
            return
        for m in metas:
            s.pending.pop(m.id, None)
            s.observed.put_times.pop(m.id, None)
            s.placement.forget_group(m.group)
        s.release_metas(metas)

    # ------------------------------------------------------------------------------------ planning
    def poll(self) -> None:
        """Plan every mini-batch admission releases now and queue its micro-batches per rank (as *entries*)."""
        s = self.s
        try:
            admitted = s.policy.poll(time.monotonic())
        except KnitdataError as e:
            self._release_dropped()
            s.fail(e)
            raise
        self._release_dropped()
        planned: list[tuple[AdmittedMiniBatch, MiniBatchPlan]] = []
        tr = tracing.tracer
        for mb in admitted:
            t0 = tracing.now_us() if tr is not None else 0.0
            plan, items = route(s, mb)  # the planner's plan, or what is left after an elastic resume
            if tr is not None:
                trace_admitted(tr, mb, plan, t0)
            s.counts["admitted_minibatches"] += 1
            s.counts["admitted_trajectories"] += len(mb.trajectories)
            now = time.monotonic()
            for m in mb.trajectories:
                s.pending.pop(m.id, None)
                put_at = s.observed.put_times.pop(m.id, None)
                if put_at is not None:
                    s.observed.admission_delay.append(now - put_at)
                counts = s.observed.source_counts.get(m.source)
                if counts is not None:
                    counts["admitted"] += 1
                s.placement.forget_group(m.group)
            if plan is None:  # handed out before an elastic resume: nothing left to plan
                continue
            s.policy.note_planned(plan.num_microbatches)
            s.counts["planned_local_bytes"] += plan.local_bytes
            s.counts["planned_remote_bytes"] += plan.remote_bytes
            note_planned(s, mb, plan, items, s.planned[0])
            for rank, row in enumerate(plan.microbatches):
                self._queue(rank, row)
            s.forget_if_unqueued(mb.step)
            planned.append((mb, plan))
        if admitted:
            s.cond.notify_all()
            check_verifications(s)
        if s.on_plan is not None:  # after every plan is queued: a failing hook loses no mini-batch
            for mb, plan in planned:
                s.on_plan(mb, plan)

    def _queue(self, rank: int, row: Sequence[Any]) -> None:
        """Append the planned micro-batches ``row`` to ``rank``'s entries (released at once below its commit)."""
        self.s.queue_row(rank, row)
