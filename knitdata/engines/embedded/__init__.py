"""The embedded engine: one process, the control plane called directly, storage units in memory.

* :mod:`knitdata.engines.embedded.engine`: :class:`~knitdata.engines.embedded.engine.EmbeddedEngine`;
* :mod:`knitdata.engines.embedded.unit`: the in-memory storage unit (capacity, backpressure, spill, media once).
"""
