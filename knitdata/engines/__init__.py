"""Engines: where storage units live and how payload bytes move. The control plane is the same in every one.

* :mod:`knitdata.engines.embedded`: one process, the control plane called directly, units in memory.
* :mod:`knitdata.engines.ray`: the control plane in one Ray actor, one storage-unit actor per node.

Build engines through :class:`knitdata.pipeline.Pipeline`; this package holds the plumbing.
"""

from knitdata.engines.base import ENGINES, Engine

__all__ = ["ENGINES", "Engine"]
