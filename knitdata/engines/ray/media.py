"""Media stored once on the Ray engine, without Ray: a unit's media table, what a client sends, and spill recovery.

* :class:`UnitMedia`: the content-addressed media of one :class:`~knitdata.engines.ray.unit_actor.StorageUnitActor`
  (the semantics of :class:`knitdata.storage.media.MediaStore`, holding object-store refs or inline records);
* :class:`MediaSender`: a client's side of a put: records written with ``encode_trajectory(..., media="refs")``,
  each distinct media item sent once per call and not at all when the unit holds it (a per-unit memory of the
  digests sent; a unit that freed one answers ``"missing:<i>"`` and the content goes again);
* :class:`SpillRecovery` and the spill layout: a unit's write-through spill keeps each media item once, as its
  own sample (:func:`media_spill_id`), and its trajectories with references.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from knitdata.codec import decode_media, encode_media, encode_trajectory
from knitdata.errors import MediaRefError, ValidationError
from knitdata.record import MediaItem, Trajectory

__all__ = ["UnitMedia", "MediaSender", "SpillRecovery", "spill_directory", "media_spill_id", "media_sample",
           "resolved_from_spill", "as_record_array", "refuse_references", "content_bytes", "MEDIA_SPILL_PREFIX",
           "SENT_DIGESTS_MAX"]

#: Most media digests a client remembers having sent to one unit (it skips their content on later puts; a unit
#: that freed one answers "missing" and the client sends the content again).
SENT_DIGESTS_MAX = 1 << 16


# --------------------------------------------------------------------------------------------- spill
def spill_directory(spill_dir: str | os.PathLike[str], unit_id: str) -> str:
    """The :class:`~knitdata.storage.spill.SpillStore` directory of one unit under a shared ``spill_dir``."""
    return os.path.join(os.fspath(spill_dir), unit_id.replace("/", "_"))


#: Spill-store id prefix of a unit's media items (one sample per digest; no trajectory id starts with ``~``
#: in practice, and a shard key cannot hold ``.`` or ``/``).
MEDIA_SPILL_PREFIX = "~media-"


def media_spill_id(digest: str) -> str:
    """The id under which a unit's write-through spill keeps the media item of ``digest`` (once per digest)."""
    return MEDIA_SPILL_PREFIX + digest


def media_sample(item: MediaItem) -> Trajectory:
    """A media item as a spill sample of its own (a one-token carrier trajectory holding only the item)."""
    import torch

    one = torch.zeros(1, dtype=torch.int32)
    return Trajectory(id=media_spill_id(item.digest), source="knitdata.media.process", group=item.digest, prompt_ids=one,
                      response_ids=one, media=[item])


def resolved_from_spill(store: Any, traj: Trajectory, cache: dict[str, MediaItem] | None = None) -> Trajectory | None:
    """``traj`` with its media references replaced by the items the spill ``store`` keeps (``None``: one is
    missing); ``cache``: items read already (each read from disk once per call)."""
    if not any(m.reference for m in traj.media):
        return traj
    media = []
    cache = {} if cache is None else cache
    for m in traj.media:
        if m.reference:
            found = cache.get(m.digest)
            if found is None:
                key = media_spill_id(m.digest)
                if key not in store:
                    return None
                found = cache[m.digest] = store.get(key).media[0]
            m = found
        media.append(m)
    traj.media = media
    return traj


class SpillRecovery:
    """Serves the payloads of dead units from their write-through spill shards (thread-safe).

    Each unit with a ``spill_dir`` writes every accepted payload through to a
    :class:`knitdata.storage.spill.SpillStore` (webdataset tar shards) in ``spill_directory(spill_dir, unit_id)``
    and releases it there too. After the unit's actor dies, this opens the store once
    (:meth:`SpillStore.open <knitdata.storage.spill.SpillStore.open>` rebuilds exactly the unreleased samples) and
    returns records by id. Open it in one process only (the coordinator): opening rewrites the release log.

    Args:
        spill_dir: The shared spill directory.
    """

    def __init__(self, spill_dir: str | os.PathLike[str]) -> None:
        self.spill_dir = os.fspath(spill_dir)
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def records(self, unit_id: str, traj_ids: Sequence[str]) -> dict[str, bytes]:
        """Codec records of the ids found in the unit's spill (absent ids are left out)."""
        from knitdata.storage.spill import SpillStore

        with self._lock:
            store = self._stores.get(unit_id)
            if store is None:
                directory = spill_directory(self.spill_dir, unit_id)
                if not os.path.isdir(directory):
                    return {}
                store = self._stores[unit_id] = SpillStore.open(directory, repair=False)
            out: dict[str, bytes] = {}
            media: dict[str, MediaItem] = {}
            for tid in traj_ids:
                if tid in store:
                    traj = resolved_from_spill(store, store.get(tid), media)  # media stored once: its own samples
                    if traj is not None:
                        out[tid] = bytes(encode_trajectory(traj))
            return out

    def held(self, unit_id: str, traj_ids: Sequence[str]) -> list[str]:
        """The ids of ``traj_ids`` the unit's spill holds (recoverable), without reading them."""
        from knitdata.storage.spill import SpillStore

        with self._lock:
            store = self._stores.get(unit_id)
            if store is None:
                directory = spill_directory(self.spill_dir, unit_id)
                if not os.path.isdir(directory):
                    return []
                store = self._stores[unit_id] = SpillStore.open(directory, repair=False)
            return [t for t in traj_ids if t in store]

    def close(self) -> None:
        """Close the opened stores."""
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()


# ------------------------------------------------------------------------------------------ a unit's media
class UnitMedia:
    """A Ray unit's media, one record per digest with a count of the trajectories using it (the semantics of
    :class:`knitdata.storage.media.MediaStore`, holding object-store refs or inline records instead of items).

    Guarded by the unit's lock (``_UnitState.cond``). Each entry is ``[held record (ObjectRef, inline numpy
    record, or _ON_DISK after a resume), accounted bytes (the item's ``nbytes``, 0 while on disk), record bytes,
    references, kind, item bytes]``. Invariants (:meth:`check`): the sum of the references equals the number of
    (trajectory, media index) pairs held; ``bytes`` is the sum over distinct digests of what is in memory.
    """

    def __init__(self) -> None:
        self.entries: dict[str, list[Any]] = {}
        self.by_traj: dict[str, tuple[str, ...]] = {}
        self.bytes = 0  # accounted (in memory)
        self.pairs = 0
        self.logical = 0  # what per-trajectory copies would hold
        self.resolved = 0  # references (MediaItem.ref) taken at put
        self.copied_in = 0  # items brought from another unit to resolve a reference

    def plan(self, descs: Sequence[Sequence[Any]], staged: Mapping[str, Sequence[Any]]
             ) -> str | tuple[dict[str, Sequence[Any]], int]:
        """``(new entries, their bytes)`` for a trajectory's media ``descs`` (``[digest, kind, nbytes, is_ref]``
        each), or a status: ``"missing:<i>"`` (media ``i`` is neither held nor staged: the client resends its
        content or refuses a reference), ``"kind:<i>"`` (media ``i``'s kind differs from the held item of its
        digest). Changes nothing."""
        entries = self.entries
        new: dict[str, Sequence[Any]] = {}
        nbytes = 0
        for i, (d, kind, _n, _ref) in enumerate(descs):
            e = entries.get(d)
            if e is None:
                if d in new:
                    continue
                got = staged.get(d)
                if got is None:
                    return f"missing:{i}"
                new[d] = got
                nbytes += int(got[1])
            elif e[4] != kind:
                return f"kind:{i}"
        return new, nbytes

    def hold(self, traj_id: str, descs: Sequence[Sequence[Any]], new: Mapping[str, Sequence[Any]], spill: Any) -> None:
        """Take the references of ``traj_id`` (planned by :meth:`plan`); new items are written through to
        ``spill`` first (all or nothing: ``StoreFull`` leaves the table as it was)."""
        if spill is not None:
            written: list[str] = []
            try:
                for d, got in new.items():
                    key = media_spill_id(d)
                    if key not in spill:
                        spill.put(media_sample(decode_media(got[3], copy=False)))
                        written.append(key)
            except BaseException:
                for key in written:
                    spill.release(key)
                raise
        entries = self.entries
        kinds = {d: kind for d, kind, *_ in descs}
        for d, got in new.items():
            entries[d] = [got[0], int(got[1]), int(got[2]), 0, kinds[d], int(got[1])]
            self.bytes += int(got[1])
            self.copied_in += len(got) > 4 and bool(got[4])
        for d, _kind, _n, ref in descs:
            e = entries[d]
            e[3] += 1
            self.logical += e[5]
            self.resolved += bool(ref)
        self.by_traj[traj_id] = tuple(d for d, *_ in descs)
        self.pairs += len(descs)

    def drop(self, traj_id: str, spill: Any) -> int:
        """Give back ``traj_id``'s references; free (and release from ``spill``) what reaches 0; the bytes freed."""
        digests = self.by_traj.pop(traj_id, None)
        if not digests:
            return 0
        freed = 0
        for d in digests:
            e = self.entries[d]
            e[3] -= 1
            self.logical -= e[5]
            if e[3] == 0:
                del self.entries[d]
                freed += e[1]
                if spill is not None:
                    spill.release(media_spill_id(d))
        self.pairs -= len(digests)
        self.bytes -= freed
        return freed

    def stats(self) -> dict[str, int]:
        return {"media_items": len(self.entries), "media_bytes": self.bytes, "media_refs": self.pairs,
                "media_bytes_saved": self.logical - sum(e[5] for e in self.entries.values()),
                "media_resolved": self.resolved, "media_copied_in": self.copied_in}

    def check(self) -> dict[str, Any]:
        """Recount from the per-trajectory lists (the format of :meth:`MediaStore.check
        <knitdata.storage.media.MediaStore.check>`)."""
        want: dict[str, int] = {}
        for ds in self.by_traj.values():
            for d in ds:
                want[d] = want.get(d, 0) + 1
        refs = {d: e[3] for d, e in self.entries.items()}
        distinct = sum(e[1] for e in self.entries.values())
        pairs = sum(len(ds) for ds in self.by_traj.values())
        ok = want == refs and distinct == self.bytes and pairs == self.pairs == sum(refs.values())
        return {"ok": ok, "pairs": pairs, "refs": sum(refs.values()), "bytes": self.bytes, "distinct_bytes": distinct}




# ------------------------------------------------------------------------------------------ a client's puts
def as_record_array(record: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A codec record as a flat ``numpy.uint8`` array (no copy)."""
    if isinstance(record, np.ndarray):
        return record.reshape(-1).view(np.uint8)
    return np.frombuffer(record, dtype=np.uint8)


def refuse_references(traj: Trajectory) -> None:
    """Per-trajectory copies (``media_dedup=False``) hold no references: refuse one, naming it.

    Raises:
        MediaRefError: ``traj`` holds a reference.
    """
    for i, m in enumerate(traj.media):
        if m.reference:
            raise MediaRefError(
                f"refers to media {m.digest} (kind {m.kind}, media index {i}) but the pipeline keeps per-trajectory "
                "copies (media_dedup=False): put the item with its content", trajectory_id=traj.id, digest=m.digest,
                kind=m.kind, index=i)


def content_bytes(content: Mapping[str, Sequence[Any]] | None) -> int:
    """Bytes of the media records a put call sends (``{digest: [record, nbytes, ...]}``)."""
    return 0 if not content else int(sum(int(v[0].nbytes) for v in content.values()))


class MediaSender:
    """A client's side of the puts to one unit (thread-safe): what each call sends.

    With ``media_dedup`` a trajectory with media goes as ``(id, record without media, own bytes, [[digest, kind,
    nbytes, is_reference], ...])`` (``encode_trajectory(..., media="refs")``) and each distinct media item with
    content once per call (:func:`~knitdata.codec.encode_media`), not at all when this client sent it to the unit
    before (the unit answers ``"missing:<i>"`` if it freed it since: :meth:`fix`, then the call goes again with
    ``resend``). Without it, full records (references refused).

    Args:
        unit_id: The unit (for error messages).
        media_dedup: Whether the unit stores media once.
    """

    def __init__(self, unit_id: str, media_dedup: bool) -> None:
        self.unit_id = unit_id
        self.media_dedup = media_dedup
        self._sent: OrderedDict[str, None] = OrderedDict()  # digests this client sent to (or saw held by) the unit
        self._lock = threading.Lock()

    def encode(self, trajs: Sequence[Trajectory], *, resend: bool = False,
               extra: Mapping[str, Sequence[Any]] | None = None) -> tuple[list[tuple[Any, ...]], dict[str, Any] | None]:
        """The records of ``trajs`` for one put call and the media content it sends (``None``: none).

        ``resend``: every item's content goes, sent before or not; ``extra``: content found elsewhere for
        references (``[record, nbytes, True]``).

        Raises:
            MediaRefError: A reference while the unit keeps per-trajectory copies.
        """
        recs: list[tuple[Any, ...]] = []
        if not self.media_dedup:
            for t in trajs:
                refuse_references(t)
                recs.append((t.id, as_record_array(encode_trajectory(t)), int(t.nbytes)))
            return recs, None
        content: dict[str, Any] = dict(extra or {})
        sent = self._sent
        for t in trajs:
            if not t.media:
                recs.append((t.id, as_record_array(encode_trajectory(t)), int(t.nbytes)))
                continue
            descs = []
            own = int(t.nbytes)
            for m in t.media:
                d = m.digest
                descs.append([d, m.kind, int(m.nbytes), bool(m.reference)])
                own -= int(m.nbytes)
                if not m.reference and d not in content and (resend or d not in sent):
                    content[d] = [as_record_array(encode_media(m)), int(m.nbytes)]
            recs.append((t.id, as_record_array(encode_trajectory(t, media="refs")), own, descs))
        return recs, content or None

    def mark_sent(self, recs: Sequence[tuple[Any, ...]]) -> None:
        """The unit holds the media of these stored records: later calls skip their content (the newest
        :data:`SENT_DIGESTS_MAX` digests are remembered)."""
        if not self.media_dedup:
            return
        with self._lock:
            sent = self._sent
            for r in recs:
                for desc in r[3] if len(r) > 3 else ():
                    sent[desc[0]] = None
                    sent.move_to_end(desc[0])
            while len(sent) > SENT_DIGESTS_MAX:
                sent.popitem(last=False)

    def fix(self, status: str, traj: Trajectory,
            resolve: Callable[[str], tuple[np.ndarray, int] | None] | None) -> dict[str, Any]:
        """Act on the unit's ``"missing:<i>"`` / ``"kind:<i>"`` answer for ``traj``: the content to send along
        next time (a reference found by ``resolve`` in another unit), or raise.

        Raises:
            MediaRefError: A reference to a digest no unit of the pipeline holds (nothing of the put stored).
            ValidationError: The item's kind differs from the held item of its digest.
        """
        what, _, i_s = status.partition(":")
        i = int(i_s)
        m = traj.media[i]
        with self._lock:
            self._sent.pop(m.digest, None)  # the unit no longer holds it: its content goes again
        if what == "kind":
            raise ValidationError(f"{m.kind} of digest {m.digest} differs from the kind of the item storage unit "
                                  f"{self.unit_id!r} holds for that digest", trajectory_id=traj.id, field=f"media.{i}")
        if not m.reference:
            return {}
        found = resolve(m.digest) if resolve is not None else None
        if found is None:
            raise MediaRefError(trajectory_id=traj.id, digest=m.digest, kind=m.kind, index=i)
        return {m.digest: [found[0], int(found[1]), True]}
