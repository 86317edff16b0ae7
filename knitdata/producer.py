"""A producer's side of the put path: checks, this process's replica of the placement, the control plane's answers.

:class:`Producer` is the put path of one :class:`~knitdata.pipeline.Pipeline` handle (``Pipeline.put`` and
``put_many`` delegate to it): it checks each trajectory in the producer (type, fields, token budget, media
decoding), stores each payload on the unit this process's replica picks, and waits for room when that unit is full.
:class:`PutRouter` picks the storage unit of each put from this process's replica of the pipeline's placement (the
control plane's last view, followed with every answer), so that a put is one round trip to its unit, and takes the
plane's answer (:class:`~knitdata.control.records.Admitted`): its :class:`~knitdata.record.TrajectoryMeta` s, or the
error it names.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from knitdata.consumer.handoff import ProducerPresence
from knitdata.control import fields_of
from knitdata.control.records import Admitted
from knitdata.engines.base import Engine
from knitdata.errors import (
    EngineError,
    FieldTypeError,
    KnitdataError,
    MediaRefError,
    PipelineClosedError,
    StoreFull,
    ValidationError,
)
from knitdata.observe import trace as tracing
from knitdata.placement import Placement, make_placement
from knitdata.record import Trajectory, TrajectoryMeta

__all__ = ["Producer", "PutRouter", "PUT_TIMEOUT"]

#: ``timeout`` of :meth:`Pipeline.put <knitdata.pipeline.Pipeline.put>` meaning "the pipeline's ``put_timeout``".
PUT_TIMEOUT: Literal["put_timeout"] = "put_timeout"


def _loss_tokens(traj: Trajectory) -> int:
    if traj.loss_mask is None:
        return int(traj.response_ids.numel())
    return int((traj.loss_mask != 0).sum())


class PutRouter:
    """Routes the puts of one pipeline handle (thread-safe).

    Args:
        engine: The pipeline's engine (its units, config and control plane).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._replica: Placement | None = None  # made at the first put
        self._next_seq = 0

    def route(self, metas: Sequence[Mapping[str, Any]]) -> list[str]:
        """The unit of each put, from this process's replica of the placement (the plane's last view)."""
        with self._lock:
            if self._replica is None:
                units = list(self.engine.units)
                self._replica = make_placement(str(self.engine.config.get("placement", "consumer_aware")), units)
                view = self.engine.control.admission.placement_view()
                self._follow_locked(view.placement, view.seq)
            seq = self._next_seq
            out = []
            for i, m in enumerate(metas):
                tm = TrajectoryMeta.from_dict({**{k: v for k, v in m.items() if k != "fields"}, "seq": seq + i,
                                               "location": None})
                out.append(self._replica.place(tm))
            return out

    def _follow_locked(self, placement: Mapping[str, Any], seq: int) -> None:
        assert self._replica is not None
        self._replica.follow(placement)
        self._next_seq = max(self._next_seq, int(seq))

    def take(self, ans: Admitted, idx: Sequence[int], out: list[TrajectoryMeta | None]) -> None:
        """Record the plane's answer for ``idx`` (its metadata into ``out``); raise its first error (the others stay
        accepted)."""
        with self._lock:
            if self._replica is not None:
                self._follow_locked(ans.placement, ans.seq)
        for i, m in zip(idx, ans.accepted):
            if m is not None:
                out[i] = m
        if ans.exception is not None:
            raise ans.exception
        refused = ans.errors
        if refused:
            more = f" ({len(refused) - 1} more refused in this batch)" if len(refused) > 1 else ""
            raise refused[0].to_exception(more)


class Producer:
    """The put path of one pipeline handle (thread-safe): checks, one round trip per storage unit, waits for room.

    Args:
        engine: The pipeline's engine.
        put_timeout: Default seconds a put waits for room (``None``: no limit; ``0``: fail at once).
        check_media: Decode every encoded media item once at put (in the producer) and refuse bad ones.
    """

    def __init__(self, engine: Engine, *, put_timeout: float | None, check_media: bool) -> None:
        self.engine = engine
        self.put_timeout = put_timeout
        self.check_media = check_media
        self._router = PutRouter(engine)  # this process's replica of the placement (one-round-trip puts)
        self._presence: ProducerPresence | None = None  # made at the first put: this handle is a producer

    def put(self, trajs: Sequence[Trajectory], timeout: float | None | Literal["put_timeout"]) -> list[TrajectoryMeta]:
        """Store ``trajs`` and offer them to admission (see :meth:`knitdata.pipeline.Pipeline.put_many`)."""
        if not trajs:
            return []
        plane = self.engine.control
        sender = self.engine.sender
        presence = self._presence
        if presence is None:
            presence = self._presence = ProducerPresence()
            sender.add_producer(presence)
        presence.note()
        if sender.version_pending:  # a put of the new weights' output must not overtake their report
            self.engine.flush_reports()
        media_seen: set[str] = set()  # each distinct media item is checked once per put (a group shares its image)
        checked = [self._checked(t, media_seen) for t in trajs]
        wait = self.put_timeout if timeout == PUT_TIMEOUT else timeout
        token = uuid.uuid4().hex
        items = [[m, n, f"{token}:{i}"] for i, (m, n) in enumerate(checked)]
        by_unit: dict[str, list[int]] = {}
        for i, unit_id in enumerate(self._router.route([m for m, _n in checked])):
            by_unit.setdefault(unit_id, []).append(i)
        out: list[TrajectoryMeta | None] = [None] * len(trajs)
        t0 = tracing.now_us() if tracing.tracer is not None else 0.0
        for unit_id, idx in by_unit.items():
            unit = self.engine.units[unit_id]
            rest = idx
            while rest:
                try:
                    res = unit.put_admit([trajs[i] for i in rest], [items[i] for i in rest], plane.admission.admit_many)
                except EngineError as e:
                    self._raise_closed(e)
                    raise
                except MediaRefError as e:  # a reference to media no unit holds: nothing of the batch stored
                    plane.admission.note_rejected(e.trajectory_id, "media")
                    raise
                n = res.stored
                if res.admit is not None:
                    self._router.take(res.admit, rest[:n], out)
                rest = rest[n:]
                if rest:  # the unit is full: wait for room with a blocking put of the next one
                    self._put_waiting(unit_id, trajs, items, rest, wait, out)
                    rest = rest[1:]
        tr = tracing.tracer
        if tr is not None:  # one event per burst of puts of this thread
            by_source: dict[str, int] = {}
            for m, _n in checked:
                by_source[m["source"]] = by_source.get(m["source"], 0) + 1
            tr.burst("put", "producer", t0, tracing.now_us(),
                     checked[0][0]["source"] if len(checked) == 1 else by_source)
        return [m for m in out if m is not None]

    def close(self) -> None:
        """The pipeline was closed: this handle no longer counts as a producer."""
        if self._presence is not None:
            self.engine.sender.remove_producer(self._presence)

    def _put_waiting(self, unit_id: str, trajs: Sequence[Trajectory], items: Sequence[Sequence[Any]],
                     rest: Sequence[int], timeout: float | None, out: list[TrajectoryMeta | None]) -> None:
        plane = self.engine.control
        unit = self.engine.units[unit_id]
        k = rest[0]
        try:
            unit.put(trajs[k], timeout=timeout)
        except StoreFull as e:
            for i in rest:
                plane.admission.note_rejected(trajs[i].id, "store_full")
            self.engine.flush_reports()  # this process's consumers' hand-outs and commits, for an exact answer
            holders = plane.reporting.holders(unit_id)
            more = f" (and {len(rest) - 1} more of this batch not yet stored)" if len(rest) > 1 else ""
            raise StoreFull(f"trajectory {trajs[k].id!r}{more} refused: storage unit {unit_id!r} is held by {holders}. "
                            f"{e}") from e
        except EngineError as e:
            plane.admission.note_rejected(trajs[k].id, "closed")
            self._raise_closed(e)
            raise
        except ValidationError as e:  # the id is held there already (not this put's payload), or a bad media reference
            plane.admission.note_rejected(trajs[k].id, "media" if isinstance(e, MediaRefError) else "id")
            raise
        except BaseException as e:  # interrupted while it waited: it may have been stored
            unit.release([trajs[k].id])
            plane.admission.note_rejected(trajs[k].id, type(e).__name__)
            raise
        try:
            ans = plane.admission.admit_many(unit_id, [list(items[k])])
        except BaseException:
            unit.release([trajs[k].id])
            raise
        if ans.accepted[0] is None:
            unit.release([trajs[k].id])
        self._router.take(ans, [k], out)

    def _raise_closed(self, e: EngineError) -> None:
        self.engine.flush_reports()
        if self.engine.control.reporting.stats()["closed"]:
            raise PipelineClosedError("the pipeline was closed (end of stream); build a new Pipeline to continue") \
                from e

    def _checked(self, traj: Any, media_seen: set[str]) -> tuple[dict[str, Any], int]:
        """The checks of the put path in the producer (type, fields, media decoding): ``(metadata, loss tokens)``.

        A refusal is counted by the control plane by its cause, then raised.
        """
        plane = self.engine.control
        if not isinstance(traj, Trajectory):
            plane.admission.note_rejected(None, "traj")
            raise FieldTypeError(f"put() takes a knitdata.Trajectory, got {type(traj).__name__}", field="traj")
        try:
            traj.validate()
            budget = int(self.engine.config["token_budget"])
            if traj.num_tokens > budget:
                raise ValidationError(
                    f"{traj.num_tokens} tokens (prompt {traj.prompt_ids.numel()} + response "
                    f"{traj.response_ids.numel()}) exceed the pipeline's token_budget of {budget} per micro-batch: "
                    "truncate it, or create the pipeline with a larger token_budget",
                    trajectory_id=traj.id, field="num_tokens")
            if self.check_media and traj.media:
                from knitdata.media.process import check_media_item

                for i, item in enumerate(traj.media):
                    # a reference's content was checked when it was put; an item of a digest checked in this put
                    # (the group's image again) is not decoded twice
                    if not item.reference and item.digest not in media_seen:
                        check_media_item(item, trajectory_id=traj.id, index=i)
                        media_seen.add(item.digest)
        except KnitdataError as e:
            cause = getattr(e, "field", None) or ("media" if traj.media else type(e).__name__)
            plane.admission.note_rejected(traj.id, cause.split(".")[0])
            raise
        meta = traj.meta().to_dict()
        dtypes = {k: str(v.dtype).replace("torch.", "") for k, v in traj.tensors.items()}
        meta["fields"] = fields_of(traj.scalars, dtypes)
        return meta, _loss_tokens(traj)
