"""Cross-node byte counters of the Ray engine (pure Python: no Ray import, JSON state).

Two places count bytes, separately:

* **read side** -- where a consumer reads a payload: the reader's Ray node against the Ray node holding
  the object (the node of the unit that owns it, or every node holding a copy from
  ``ray.experimental.get_object_locations``, see :func:`knitdata.engines.ray.unit.read_records`). A read
  is *cross-node* when the reader's node holds no copy; Ray then pulls the object over the network. Counted per fetch mode, per placement and per step (mini-batch).
* **put side** -- where a producer puts a payload: the producer's node against the unit's node.

A :class:`TransferMeter` lives in each process that reads or puts; processes report their counters to the
coordinator (:meth:`TransferMeter.to_dict` / :meth:`TransferMeter.merge`), which sums them. The size of a
meter is bounded by the number of (placement, mode) pairs plus ``max_steps`` step rows.
"""

from __future__ import annotations

from knitdata.observe.metrics import TransferMeter  # re-exported: it lives with the other counters

__all__ = ["TransferMeter"]
