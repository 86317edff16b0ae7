"""Reads from Ray storage units: one request per unit, records and (media stored once) each media item once.

:func:`read_records` asks each unit for the object-store refs of the ids it reads (and of the media items their
records use that the reader lacks), fetches them with one ``ray.get`` (a read-only view of shared memory on the
unit's node, pulled once over the network from another node), counts the bytes as local or cross-node, and
recovers what a dead unit cannot serve (its spill). :func:`decode_records` decodes the records zero-copy, their
media references resolved from the reader's media. Importing this module without Ray installed raises
:class:`~knitdata.errors.OptionalDependencyError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from knitdata.errors import ConfigError, OptionalDependencyError, TrajectoryLostError

try:
    import ray
except ImportError as _e:  # pragma: no cover - exercised by monkeypatching in tests
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.engines.ray.read)") from _e

import numpy as np

from knitdata.codec import decode_media, decode_trajectory
from knitdata.engines.ray.connect import current_node, host_gone_error, ray_get
from knitdata.engines.ray.metrics import TransferMeter
from knitdata.record import MediaItem, Trajectory

__all__ = ["read_records", "decode_records", "LOST_ERRORS", "LOST_OR_TIMEOUT"]

#: What a call to a dead unit's actor (or one of its lost objects) raises.
LOST_ERRORS: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.ActorUnavailableError,
)
#: The same, or a call that did not answer in time.
LOST_OR_TIMEOUT: tuple[type[BaseException], ...] = (*LOST_ERRORS, ray.exceptions.GetTimeoutError)


def read_records(
    items: Sequence[tuple[str, Any]],
    *,
    meter: TransferMeter | None = None,
    mode: str = "sample",
    placement: str = "",
    step: int = -1,
    recover: Callable[[Any, list[str]], Mapping[str, Any]] | None = None,
    timeout_s: float = 120.0,
    locate: str = "owner",
    media: dict[str, MediaItem] | None = None,
    here: str | None = None,
) -> list[Any]:
    """Fetch the records of ``(trajectory id, unit)`` pairs in one request per unit, in order.

    Media stored once (``media`` given: the reader's media by digest, e.g. those of its share of the step so
    far): each unit also sends the media items its records use that ``media`` lacks, each once, fetched with
    the records in one ``ray.get`` and decoded here (zero-copy on the unit's node, the checksum checked once)
    into ``media``; decode the records with ``decode_trajectory(record, copy=False, media=media)``
    (:func:`decode_records`).

    Bytes are counted on ``meter`` as local or cross-node from Ray's object locations against this
    process's node, before the ``ray.get`` that moves them.

    Args:
        items: ``(id, unit)`` pairs.
        meter: Counters to update (none when ``None``).
        mode: Fetch mode the bytes are filed under.
        placement: Placement the bytes are filed under.
        step: Mini-batch step the bytes are filed under.
        recover: Called with ``(unit, ids)`` for ids a dead or forgetful unit cannot serve; returns the
            records it found (e.g. :meth:`SpillRecovery.records`). Recovered bytes count as cross-node reads
            of shared storage only if they come from another node, which a callback cannot know: they
            are counted under mode ``"<mode>+recovered"`` as cross-node.
        timeout_s: Bound on each Ray call (a dead node never hangs the reader).
        media: The reader's media by digest, filled in place with the items fetched (``None``: records as stored,
            the references of records written with ``media="refs"`` left unresolved).
        here: This process's Ray node id (looked up when ``None``; an engine passes the one it looked up once).
        locate: Where an object is, for the counters: ``"owner"`` (default): the Ray node of the unit that
            owns it, where its primary copy lives (exact as long as each payload is read once per node, which
            is how the planner hands them out); ``"ray"``: ``ray.experimental.get_object_locations``, which
            also sees secondary copies pulled earlier by another reader on this node. Ray 2.60 aborted a
            consumer process once ("std::future_error: Promise already satisfied" in
            ``GetLocationFromOwner``) under ``"ray"`` on this 2-core machine, hence the default.

    Returns:
        Records in the order of ``items`` (read-only ``numpy.uint8`` arrays, or ``bytes`` if recovered).

    Raises:
        TrajectoryLostError: Naming every id that could be neither read nor recovered.
    """
    if here is None:
        here = current_node()
    by_unit: dict[str, tuple[Any, list[int]]] = {}
    for idx, (_tid, unit) in enumerate(items):
        by_unit.setdefault(unit.unit_id, (unit, []))[1].append(idx)
    have = list(media) if media is not None else None
    futures = {uid: (unit.actor.refs.remote([items[p][0] for p in pos], have) if have is not None and unit.media_dedup
                     else unit.actor.refs.remote([items[p][0] for p in pos]))
               for uid, (unit, pos) in by_unit.items()}
    out: list[Any] = [None] * len(items)
    lost: dict[str, list[int]] = {}  # unit id -> positions
    refs: list[Any] = []
    ref_pos: list[int] = []  # position in items, or -1 - k for media_refs[k]
    ref_len: list[int] = []
    media_refs: list[tuple[str, str]] = []  # (digest, unit id) of the media objects among refs
    pending: set[str] = set()
    for uid, fut in futures.items():
        unit, pos = by_unit[uid]
        try:
            answer, *rest = ray_get(fut, timeout=timeout_s)
        except LOST_OR_TIMEOUT:
            lost.setdefault(uid, []).extend(pos)
            continue
        if media is not None and len(rest) > 1:
            for d, (obj, n) in rest[1].items():
                if d in media or d in pending:
                    continue
                if isinstance(obj, np.ndarray):  # a small item, inline in the unit's reply
                    media[d] = decode_media(obj.data, copy=False)
                    if meter is not None:
                        meter.record_read(int(n), cross=here != unit.ray_node, mode=mode,
                                          placement=placement, step=step)
                else:
                    refs.append(obj)
                    ref_pos.append(-1 - len(media_refs))
                    ref_len.append(int(n))
                    media_refs.append((d, uid))
                    pending.add(d)
        for p, a in zip(pos, answer):
            if a is None:
                lost.setdefault(uid, []).append(p)
            elif isinstance(a[0], np.ndarray):  # a small record, inline in the unit's reply
                out[p] = a[0]
                if meter is not None:
                    meter.record_read(int(a[1]), cross=here != unit.ray_node, mode=mode, placement=placement,
                                      step=step)
            else:
                refs.append(a[0])
                ref_pos.append(p)
                ref_len.append(int(a[1]))
    if refs:
        locations: dict[Any, Any] = {}
        if locate == "ray":
            for r in refs:  # one object per call: the narrowest use of the call
                try:
                    locations.update(ray.experimental.get_object_locations([r], timeout_ms=int(timeout_s * 1000)))
                except Exception:  # noqa: BLE001 - owner gone: the gets below find out which ones
                    pass
        elif locate != "owner":
            raise ConfigError(f"locate must be 'owner' or 'ray', got {locate!r}")
        try:
            values = ray_get(refs, timeout=timeout_s)
        except LOST_OR_TIMEOUT:
            values = []
            for r in refs:  # find out which ones are gone
                try:
                    values.append(ray_get(r, timeout=timeout_s))
                except LOST_OR_TIMEOUT:
                    values.append(None)
        for r, p, n, v in zip(refs, ref_pos, ref_len, values):
            if p < 0:  # a media item: decoded once here (checksum once per hop), shared by every record using it
                d, uid = media_refs[-1 - p]
                unit = by_unit[uid][0]
                if v is None:  # its unit's records go to recovery (whole records from the spill)
                    lost.setdefault(uid, []).extend(by_unit[uid][1])
                    continue
                media[d] = decode_media(v, copy=False)  # type: ignore[index]  # media is a dict here
                if meter is not None:
                    nodes = locations.get(r, {}).get("node_ids") or [unit.ray_node]
                    meter.record_read(n, cross=here not in nodes, mode=mode, placement=placement, step=step)
                continue
            if v is None:
                lost.setdefault(items[p][1].unit_id, []).append(p)
                continue
            out[p] = v
            if meter is not None:
                nodes = locations.get(r, {}).get("node_ids") or [items[p][1].ray_node]
                meter.record_read(n, cross=here not in nodes, mode=mode, placement=placement, step=step)
    lost = {uid: sorted(set(pos)) for uid, pos in lost.items()}
    if lost and recover is not None:
        _recover_lost(items, lost, out, recover, meter, mode=mode, placement=placement, step=step)
    if lost:
        gone = host_gone_error()
        if gone is not None:
            raise gone
        ids = [items[p][0] for uid in lost for p in lost[uid]]
        units = sorted(lost)
        raise TrajectoryLostError(
            f"storage unit(s) {units} could not serve these payloads (the unit's actor or node died, or they "
            "were released before this read); enable spill (spill_dir=...) to recover from disk, or restart "
            "from the last checkpoint",
            trajectory_ids=ids,
        )
    return out


def decode_records(records: Sequence[Any], media: Mapping[str, MediaItem] | None,
                   ids: Sequence[str] | None = None) -> list[Trajectory]:
    """Decode records from :func:`read_records` zero-copy, their media references resolved from ``media`` (equal
    digests decode to the same item).

    Raises:
        TrajectoryLostError: A record refers to media that were not fetched (released meanwhile), naming it.
    """
    out = [decode_trajectory(r, copy=False, media=media) for r in records]
    bad = [t.id for t in out if any(m.reference for m in t.media)]
    if bad:
        raise TrajectoryLostError("the media these payloads refer to were not served with them (released before "
                                  "this read?)", trajectory_ids=bad)
    return out


def _recover_lost(items: Sequence[tuple[str, Any]], lost: dict[str, list[int]], out: list[Any],
                  recover: Callable[[Any, list[str]], Mapping[str, Any]], meter: TransferMeter | None, *,
                  mode: str, placement: str, step: int) -> None:
    """Fill ``out`` with what ``recover`` finds of the ``lost`` positions (by unit id); ``lost`` keeps the rest.

    Recovered bytes are counted under ``"<mode>+recovered"`` as cross-node (see :func:`read_records`).
    """
    for uid in list(lost):
        unit = items[lost[uid][0]][1]
        found = recover(unit, [items[p][0] for p in lost[uid]])
        still = []
        for p in lost[uid]:
            rec = found.get(items[p][0])
            if rec is None:
                still.append(p)
            else:
                out[p] = rec
                if meter is not None:
                    meter.record_read(len(rec), cross=True, mode=f"{mode}+recovered", placement=placement, step=step)
        if still:
            lost[uid] = still
        else:
            del lost[uid]
