"""The rollout ledger and the control side of a whole-pipeline checkpoint.

The **ledger** records which prompts the producer has in flight: ``ledger_started`` when a rollout begins,
``ledger_finished`` once every trajectory of it was put (or the producer gave it up). A checkpoint saves the
prompts started and not finished; a restored pipeline tells the producer to reissue them
(:func:`reissue_list`), with the members of each prompt's group that the checkpoint already holds.

The **cut** (:meth:`Ledger.checkpoint_cut`) is one consistent copy of the plane's state and of the ledger, taken
under the plane's lock (the only moment trainers can be held up; its duration is returned as ``pause_ms``).
From the cut until :meth:`Ledger.checkpoint_done`, releases of the payloads the cut holds are deferred (the
plane's releaser is wrapped), so that the checkpoint can copy them from the units outside the lock: payloads
are immutable once put, and none of them disappears before it was written.

:meth:`Ledger.lost_on` names what the plane holds on given storage units (node loss on Ray: the groups that
must be regenerated).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from knitdata.control.state import PlaneState
from knitdata.control.surface import Part, control_call, control_part
from knitdata.errors import StateError, ValidationError

__all__ = ["Ledger", "reissue_list", "LEDGER_FORMAT", "CUT_TTL_S"]

#: The version of :meth:`Ledger.ledger_state`'s format.
LEDGER_FORMAT = 1
#: Seconds after which a checkpoint that never called :meth:`Ledger.checkpoint_done` (its process died) is
#: ended by the next cut: its deferred releases are sent.
CUT_TTL_S = 600.0


def reissue_list(plane_state: Mapping[str, Any], prompts: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """The prompts a producer must reissue after a restore from ``plane_state`` (a plane's ``state_dict``).

    Args:
        plane_state: The plane's state at the cut.
        prompts: The ledger's in-flight prompts ``{prompt id: [group, expected trajectories]}``.

    Returns:
        One dict per prompt started and not finished, in start order: ``prompt_id``, ``group``, ``have`` (the
        ids of its group's trajectories the checkpoint holds: do not generate them again) and ``missing`` (how
        many trajectories of it are still to generate; ``0`` when its group was admitted already).
    """
    by_group: dict[str, list[str]] = {}
    for m in plane_state.get("live", []):
        by_group.setdefault(str(m["group"]), []).append(str(m["id"]))
    planned: set[str] = set()
    for q in plane_state.get("queues", []):
        for e in q:
            planned.update(it[0] for it in e["items"])
    withdrawn = set(plane_state.get("withdrawn", []))
    out = []
    for pid, (group, n) in prompts.items():
        have = sorted(by_group.get(group, []))
        admitted = any(t in planned for t in have)
        out.append({"prompt_id": pid, "group": group, "have": have, "withdrawn": group in withdrawn,
                    "missing": 0 if admitted or group in withdrawn else max(0, int(n) - len(have))})
    return out


@control_part("ledger")
class Ledger(Part):
    """The rollout ledger, the checkpoint cut and the node-loss report of one plane.

    Args:
        s: The plane's shared state.
        state_dict: The plane's :meth:`~knitdata.control.durability.Durability.state_dict`.
        load_state_dict: The plane's :meth:`~knitdata.control.durability.Durability.load_state_dict`.
    """

    def __init__(self, s: PlaneState, state_dict: Callable[..., dict[str, Any]] | None = None,
                 load_state_dict: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        super().__init__(s)
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        self.prompts: dict[str, list[Any]] = {}  # prompt id -> [group, expected trajectories], in start order
        self.finished_count = 0
        self._pinned: set[str] | None = None  # payload ids a checkpoint in progress still copies
        self._deferred: list[tuple[str, list[str]]] = []
        self._releaser: Any = None
        self._cut_at = 0.0

    # ---------------------------------------------------------------------------------------- the ledger
    @control_call()
    def ledger_started(self, prompt_ids: Sequence[str], groups: Sequence[str | None] | None = None,
                       n: Sequence[int | None] | None = None) -> int:
        """Record that the producer started the rollouts of ``prompt_ids``.

        Args:
            prompt_ids: The prompts (strings, unique among the prompts in flight; starting one again is a no-op).
            groups: The group id of each prompt's trajectories (default: the prompt id).
            n: How many trajectories each prompt yields (default: the spec's group size).

        Returns:
            How many prompts are in flight now.

        Raises:
            ValidationError: A prompt id that is not a string, or lists of other lengths.
        """
        s = self.s
        k = len(prompt_ids)
        if (groups is not None and len(groups) != k) or (n is not None and len(n) != k):
            raise ValidationError(f"ledger_started: {k} prompt ids but {len(groups or [])} groups and "
                                  f"{len(n or [])} counts", field="prompt_id")
        with s.cond:
            for i, pid in enumerate(prompt_ids):
                if not isinstance(pid, str) or not pid:
                    raise ValidationError(f"a prompt id must be a non-empty string, got {pid!r}", field="prompt_id")
                g = groups[i] if groups is not None and groups[i] is not None else pid
                cnt = n[i] if n is not None and n[i] is not None else s.spec.group_size
                if isinstance(cnt, bool) or not isinstance(cnt, int) or cnt < 1:
                    raise ValidationError(f"prompt {pid!r}: n must be a positive int, got {cnt!r}", field="n")
                self.prompts.setdefault(pid, [str(g), int(cnt)])
            return len(self.prompts)

    @control_call()
    def ledger_finished(self, prompt_ids: Sequence[str]) -> int:
        """Record that every trajectory of ``prompt_ids`` was put (or that the producer gave them up).

        Unknown prompt ids are ignored (finishing twice is a no-op). Returns how many prompts are in flight now.
        """
        with self.s.cond:
            for pid in prompt_ids:
                if self.prompts.pop(pid, None) is not None:
                    self.finished_count += 1
            return len(self.prompts)

    @control_call()
    def ledger_state(self) -> dict[str, Any]:
        """The ledger: ``{"format", "in_flight": [[prompt id, group, n], ...] (start order), "finished"}``."""
        with self.s.cond:
            return {"format": LEDGER_FORMAT, "in_flight": [[p, g, n] for p, (g, n) in self.prompts.items()],
                    "finished": self.finished_count}

    # ---------------------------------------------------------------------------------------- the cut
    @control_call()
    def checkpoint_cut(self) -> dict[str, Any]:
        """Take one consistent copy of the plane's state and the ledger, and hold back releases of its payloads.

        Until :meth:`checkpoint_done`, releases of the payloads the cut holds are deferred (other releases go
        through): the checkpoint copies them from the units meanwhile.

        Returns:
            ``{"plane": the plane's state_dict, "ledger": ledger_state(), "reissue": reissue_list(...),
            "pause_ms": milliseconds the plane's lock was held}``.

        Raises:
            StateError: Another checkpoint is in progress, or this plane cannot export its state.
        """
        s = self.s
        if self._state_dict is None:
            raise StateError("this control plane was built without its state_dict: it cannot be checkpointed")
        t0 = time.perf_counter()
        with s.cond:
            if self._pinned is not None and time.monotonic() - self._cut_at > CUT_TTL_S:
                self.checkpoint_done()  # its checkpointing process died: let its releases go
                t0 = time.perf_counter()
            if self._pinned is not None:
                raise StateError("a checkpoint of this pipeline is in progress; wait for it to finish (one at a time)")
            state = self._state_dict(raw_metas=True)  # metadata objects: converted after the lock
            rows = [[p, g, n] for p, (g, n) in self.prompts.items()]
            ledger = {"format": LEDGER_FORMAT, "in_flight": rows, "finished": self.finished_count}
            self._pinned = set(s.live)
            self._releaser = s.releaser
            s.releaser = self._deferring
            self._cut_at = time.monotonic()
            pause_ms = (time.perf_counter() - t0) * 1e3
        state["live"] = [m.to_dict() for m in state["live"]]
        state["pending"] = [m.to_dict() for m in state["pending"]]
        reissue = reissue_list(state, {p: (g, n) for p, g, n in rows})
        return {"plane": state, "ledger": ledger, "reissue": reissue, "pause_ms": pause_ms}

    def _deferring(self, unit: str, ids: list[str], wait: bool) -> Any:
        pinned = self._pinned or set()
        held = [i for i in ids if i in pinned]
        rest = [i for i in ids if i not in pinned]
        if held:
            self._deferred.append((unit, held))
        if rest:
            return self._releaser(unit, rest, wait)
        return None

    @control_call()
    def checkpoint_done(self) -> int:
        """End the checkpoint in progress: send the releases it deferred. Returns how many payloads that were."""
        s = self.s
        with s.cond:
            if self._pinned is None:
                return 0
            s.releaser = self._releaser
            deferred, self._deferred, self._pinned = self._deferred, [], None
            n = 0
            for unit, ids in deferred:
                s.releaser(unit, ids, False)
                n += len(ids)
            return n

    @control_call()
    def checkpoint_restore(self, state: Mapping[str, Any], ledger: Mapping[str, Any]) -> int:
        """Load a cut (:meth:`checkpoint_cut`) into this fresh plane, its payloads already stored on its units.

        ``state`` must have this plane's configuration and units (:func:`knitdata.checkpoint.remap_plane_state`
        converts a cut of another topology). Returns the number of prompts in flight restored into the ledger.

        Raises:
            StateError: A malformed state or ledger, or one of another configuration.
        """
        s = self.s
        if self._load_state_dict is None:
            raise StateError("this control plane was built without its load_state_dict: it cannot be restored")
        rows = ledger.get("in_flight") if isinstance(ledger, Mapping) else None
        if ledger.get("format") != LEDGER_FORMAT or not isinstance(rows, list) or not all(
                isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and isinstance(r[1], str)
                and isinstance(r[2], int) and not isinstance(r[2], bool) for r in rows):
            raise StateError(f"not a rollout ledger of format {LEDGER_FORMAT}: {str(ledger)[:200]}")
        with s.cond:
            self._load_state_dict(state)
            self.prompts = {p: [g, n] for p, g, n in rows}
            self.finished_count = int(ledger.get("finished", 0))
            if s.journaling.journal is not None:  # a restart of the coordinator continues from here, not from nothing
                s.journaling.journal.compact(self._state_dict() if self._state_dict is not None else dict(state))
            return len(self.prompts)

    # ---------------------------------------------------------------------------------------- node loss
    @control_call()
    def lost_on(self, units: Sequence[str]) -> dict[str, Any]:
        """What the plane holds on ``units`` (storage units whose node is gone), by group.

        Returns:
            ``{"groups": {group: {"trajectories": [ids], "admitted": bool, "ranks": [ranks with a planned
            micro-batch holding one]}}, "trajectories": total}`` for the trajectories stored there and not
            released.
        """
        s = self.s
        wanted = set(units)
        with s.cond:
            where: dict[str, set[int]] = {}
            for r, q in enumerate(s.queues):
                for e in q.values():
                    for tid, u, _n in e.items:
                        if u in wanted:
                            where.setdefault(tid, set()).add(r)
            groups: dict[str, dict[str, Any]] = {}
            n = 0
            for m in s.live.values():
                if m.location not in wanted:
                    continue
                n += 1
                g = groups.setdefault(m.group, {"trajectories": [], "admitted": False, "ranks": set()})
                g["trajectories"].append(m.id)
                if m.id in where:
                    g["admitted"] = True
                    g["ranks"] |= where[m.id]
            for g in groups.values():
                g["ranks"] = sorted(g["ranks"])
                g["trajectories"].sort()
            return {"groups": groups, "trajectories": n}
