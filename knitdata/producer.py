"""A producer's side of the put path: this process's replica of the placement, and the control plane's answers.

:class:`PutRouter` picks the storage unit of each put from this process's replica of the pipeline's placement (the
control plane's last view, followed with every answer), so that a put is one round trip to its unit, and turns the
plane's answer into :class:`~knitdata.record.TrajectoryMeta` s or the error it names.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from knitdata.engines.base import Engine
from knitdata.errors import FieldTypeError, KnitdataError, ValidationError
from knitdata.placement import Placement, make_placement
from knitdata.record import TrajectoryMeta

__all__ = ["PutRouter"]


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
                self._follow_locked(self.engine.control.admission.placement_view())
            seq = self._next_seq
            out = []
            for i, m in enumerate(metas):
                tm = TrajectoryMeta.from_dict({**{k: v for k, v in m.items() if k != "fields"}, "seq": seq + i,
                                               "location": None})
                out.append(self._replica.place(tm))
            return out

    def _follow_locked(self, view: Mapping[str, Any]) -> None:
        assert self._replica is not None
        self._replica.follow(view["placement"])
        self._next_seq = max(self._next_seq, int(view["seq"]))

    def take(self, ans: Mapping[str, Any], idx: Sequence[int], out: list[TrajectoryMeta | None]) -> None:
        """Record the plane's answer for ``idx``; raise its first error (the others stay accepted)."""
        with self._lock:
            if self._replica is not None:
                self._follow_locked(ans)
        for i, a in zip(idx, ans["accepted"]):
            if a is not None:
                out[i] = TrajectoryMeta.from_dict(a)
        if ans.get("exception") is not None:
            raise ans["exception"]
        if ans["errors"]:
            import knitdata.errors as errors_mod

            tid, cls_name, message, field = ans["errors"][0]
            cls = getattr(errors_mod, cls_name, KnitdataError)
            more = f" ({len(ans['errors']) - 1} more refused in this batch)" if len(ans["errors"]) > 1 else ""
            if cls in (ValidationError, FieldTypeError):
                prefix = f"trajectory {tid!r}: " + (f"field {field!r}: " if field is not None else "")
                raise cls(message.removeprefix(prefix) + more, trajectory_id=tid, field=field)
            raise cls(message + more)
