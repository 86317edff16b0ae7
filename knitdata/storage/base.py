"""The storage-unit interface: where trajectory payloads live between rollout and training.

A storage unit holds the payloads of one node. Everything that crosses its interface is either a
:class:`~knitdata.record.Trajectory` (in) or ids (in) and trajectories / codec records (out): no pickle,
so a unit can live in another process (a Ray actor, later) behind the very same interface.

Capacity and memory bound (every implementation must keep it):

* A unit accounts each payload by :attr:`Trajectory.nbytes <knitdata.record.Trajectory.nbytes>`; a unit that
  stores media once (``media_dedup``, :mod:`knitdata.storage.media`) accounts a payload's own tensors plus the
  media items it brings that the unit does not hold yet (each distinct item counted once, while any payload
  held refers to it; a reference to a held item costs nothing), so ``n`` is at most ``Trajectory.nbytes`` of
  the payload with its media resolved.
* ``put`` accepts a payload of ``n`` bytes when ``used + n <= capacity`` or when the unit is empty. So the
  high-water mark of ``used`` never exceeds ``max(capacity, largest single trajectory)``, which is at most
  ``capacity + one trajectory``.
* When the payload does not fit, ``put`` waits up to ``timeout`` seconds for releases and then raises
  :class:`~knitdata.errors.StoreFull` (at once with ``timeout=0``; ``None`` waits without limit). A payload
  that was accepted is never dropped: it leaves the unit only through :meth:`StorageUnit.release`.

What a Ray-backed unit must implement to plug in: every abstract method below, with the same semantics
(``put`` blocking with a timeout and raising ``StoreFull``, ``get`` returning payloads in the order of the
ids and raising :class:`~knitdata.errors.TrajectoryLostError` for unknown ids, ``release`` idempotent,
``stats`` returning a :class:`StorageStats`), plus ``unit_id``/``node``/``capacity_bytes``. Across
processes it returns payloads as codec records (:meth:`StorageUnit.get_records`) and decodes them with
:func:`knitdata.codec.decode_trajectory` on the consumer's side.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from knitdata.codec import encode_trajectory
from knitdata.control.records import Admitted, Stored
from knitdata.errors import StoreFull, ValidationError
from knitdata.record import Trajectory

__all__ = ["StorageStats", "StorageUnit", "dead_units"]


@dataclass(frozen=True)
class StorageStats:
    """A snapshot of one storage unit's counters.

    Attributes:
        unit_id: The unit.
        node: The node the unit lives on.
        capacity_bytes: Configured capacity.
        used_bytes: Bytes currently held (sum of ``Trajectory.nbytes``).
        high_water_bytes: Largest ``used_bytes`` ever reached.
        num_items: Payloads currently held.
        puts: Payloads accepted so far.
        rejected_puts: ``put`` calls that raised ``StoreFull``.
        put_wait_s: Total time producers spent waiting for room.
        gets: Payloads handed out (one per id requested).
        get_requests: ``get`` calls.
        bytes_fetched: Bytes of the payloads handed out.
        releases: Payloads released.
        spilled_items: Payloads currently held on disk (a unit with a spill store), not in memory.
        spilled_bytes: Their bytes (``Trajectory.nbytes``; not counted in ``used_bytes``).
        spill_puts: Payloads written to the spill store so far.
        spill_gets: Payloads read back from it so far.
        media_items: Distinct media items held (one copy per digest; :class:`~knitdata.storage.media.MediaStore`).
        media_bytes: Their bytes, each item counted once (included in ``used_bytes``).
        media_refs: References to them: one per (trajectory, media index) held.
        media_bytes_saved: Bytes that per-trajectory copies of the media would hold beyond ``media_bytes``.
        media_resolved: References (``MediaItem.ref``) resolved at put so far.
        media_copied_in: Media items copied in from another unit of the pipeline to resolve a reference so far.
    """

    unit_id: str
    node: str
    capacity_bytes: int
    used_bytes: int
    high_water_bytes: int
    num_items: int
    puts: int
    rejected_puts: int
    put_wait_s: float
    gets: int
    get_requests: int
    bytes_fetched: int
    releases: int
    spilled_items: int = 0
    spilled_bytes: int = 0
    spill_puts: int = 0
    spill_gets: int = 0
    media_items: int = 0
    media_bytes: int = 0
    media_refs: int = 0
    media_bytes_saved: int = 0
    media_resolved: int = 0
    media_copied_in: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serializable dict."""
        return asdict(self)


class StorageUnit(abc.ABC):
    """Holds trajectory payloads of one node; thread-safe.

    Attributes:
        unit_id: Unique id of the unit (the ``location`` recorded in :class:`~knitdata.record.TrajectoryMeta`).
        node: Name of the node the unit lives on (consumers on that node read it locally).
        capacity_bytes: Capacity in bytes (see the module docstring for the exact bound).
    """

    unit_id: str
    node: str
    capacity_bytes: int

    @abc.abstractmethod
    def put(self, traj: Trajectory, *, timeout: float | None = None) -> int:
        """Store one payload.

        Args:
            traj: A validated trajectory whose id is not held by this unit. The unit keeps the object;
                do not mutate it afterwards.
            timeout: Seconds to wait for room; ``0`` raises at once, ``None`` waits without limit.

        Returns:
            The bytes accounted for it.

        Raises:
            StoreFull: If it did not fit within ``timeout``.
            ValidationError: If the id is already held.
            EngineError: If the unit is closed.
        """

    def put_many(self, trajs: Sequence[Trajectory], *, timeout: float | None = None) -> int:
        """Store several payloads in order (one call where the unit supports it); see :meth:`put`.

        Returns:
            How many were stored: all of them. On an exception its ``stored`` attribute is the number stored
            before it.
        """
        n = 0
        for t in trajs:
            try:
                self.put(t, timeout=timeout)
            except BaseException as e:
                e.stored = n  # type: ignore[attr-defined]
                raise
            n += 1
        return n

    def try_put(self, traj: Trajectory) -> bool:
        """Store one payload if there is room now (or spill room); ``False`` if not, without waiting.

        Raises:
            ValidationError: If the id is already held. EngineError: If the unit is closed.
        """
        try:
            self.put(traj, timeout=0)
        except StoreFull:
            return False
        return True

    def put_admit(self, trajs: Sequence[Trajectory], items: Sequence[Sequence[Any]],
                  admit: Callable[[str, list[Any]], Admitted]) -> Stored:
        """The one-round-trip put: store the payloads that fit now, in order, then admit them in one control call.

        The control plane's :meth:`~knitdata.control.admit.Admission.admit_many` answers for the stored prefix;
        the payloads it refused are dropped here. A unit in another process makes the control call itself
        (``admit`` is then unused), so the producer waits for one round trip.

        Args:
            trajs: Validated trajectories, in arrival order.
            items: ``[metadata, loss_tokens, token]`` per trajectory (see ``admit_many``).
            admit: ``admit(unit_id, items)``: the control plane's ``admit_many``.

        Returns:
            :class:`~knitdata.control.records.Stored`: the first ``stored`` were stored and offered (fewer than
            ``len(trajs)`` when the unit is full, status ``"full"``; the rest were not stored), and the plane's
            :class:`~knitdata.control.records.Admitted` for them (``None`` when nothing was stored).

        Raises:
            ValidationError: An id is already held by this unit (nothing of the batch is kept).
            EngineError: The unit is closed (nothing of the batch is kept).
        """
        n = 0
        try:
            for t in trajs:
                if not self.try_put(t):
                    break
                n += 1
        except ValidationError:  # the id is held here already: that payload is not this put's to drop
            self.release([t.id for t in trajs[:n]])
            raise
        except BaseException:  # interrupted: the one in progress may be stored too
            self.release([t.id for t in trajs[:n + 1]])
            raise
        status = "ok" if n == len(trajs) else "full"
        if n == 0:
            return Stored(0, None, status, 0)
        try:
            ans = admit(self.unit_id, [list(x) for x in items[:n]])
        except BaseException:
            self.release([t.id for t in trajs[:n]])
            raise
        refused = [t.id for t, a in zip(trajs, ans.accepted) if a is None]
        if refused:
            self.release(refused)
        return Stored(n, ans, status, n)

    @abc.abstractmethod
    def get(self, ids: Sequence[str]) -> list[Trajectory]:
        """Return the payloads of ``ids`` in order (one request; no copy on the embedded engine).

        Raises:
            TrajectoryLostError: If some ids are not held (never put, released, or lost).
        """

    def get_records(self, ids: Sequence[str]) -> list[bytes | bytearray | memoryview]:
        """Return the payloads of ``ids`` as codec records (:func:`knitdata.codec.encode_trajectory`).

        The default encodes the trajectories from :meth:`get`; a unit in another process stores and
        returns records directly.
        """
        return [encode_trajectory(t) for t in self.get(ids)]

    @abc.abstractmethod
    def release(self, ids: Sequence[str]) -> int:
        """Drop the payloads of ``ids``; unknown ids are ignored (idempotent).

        Returns:
            The bytes freed.
        """

    @abc.abstractmethod
    def contains(self, traj_id: str) -> bool:
        """Whether the unit holds ``traj_id``."""

    @abc.abstractmethod
    def stats(self) -> StorageStats:
        """Return a snapshot of the counters."""

    @abc.abstractmethod
    def close(self) -> None:
        """Refuse further puts and wake blocked producers (they raise ``EngineError``)."""

    def alive(self, timeout_s: float = 10.0) -> bool:
        """Whether the unit answers within ``timeout_s`` (a unit in this process always does)."""
        return True

    def media_check(self) -> dict[str, Any]:
        """Recount the unit's media references from what it holds (tests, drills; not for a hot path).

        Returns:
            ``{"ok", "pairs", "refs", "items", "bytes", "distinct_bytes", "leaked"}``: ``pairs`` the (trajectory,
            media index) pairs of the payloads held, ``refs`` the sum of the reference counts, ``items`` the
            distinct items held, ``bytes`` the media bytes accounted, ``distinct_bytes`` their recount,
            ``leaked`` trajectory ids holding references without being held (a list). ``ok``: ``pairs == refs``,
            ``bytes == distinct_bytes`` and nothing leaked. This default reports the unit's
            :meth:`stats` only (``ok`` without a recount); units that store media once override it.
        """
        st = self.stats()
        return {"ok": True, "pairs": st.media_refs, "refs": st.media_refs, "items": st.media_items,
                "bytes": st.media_bytes, "distinct_bytes": st.media_bytes, "leaked": []}


def dead_units(units: Mapping[str, StorageUnit], timeout_s: float = 10.0) -> list[str]:
    """The ids of the units of ``units`` that do not answer (:meth:`StorageUnit.alive`), sorted."""
    return sorted(u for u, unit in units.items() if not unit.alive(timeout_s))
