"""Engines: where storage units live and how payload bytes move. The control plane is the same in every one.

* :mod:`knitdata.engines.base`: the :class:`Engine` base (capabilities declared with refusing defaults) and the
  ``ENGINES`` registry; :mod:`knitdata.engines.options`: a new pipeline's options, checked once.
* :mod:`knitdata.engines.embedded` (a folder): one process, the control plane called directly, units in memory.
* :mod:`knitdata.engines.ray` (a folder): the control plane in one Ray actor, one storage-unit actor per node; all of
  that engine, from connecting to Ray to a consumer's zero-copy read.

Build engines through :class:`knitdata.pipeline.Pipeline`; this package holds the plumbing.
"""

from knitdata.engines.base import ENGINES, Engine

__all__ = ["ENGINES", "Engine"]
