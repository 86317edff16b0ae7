"""The Ray engine: the control plane in one coordinator actor, one storage-unit actor per node.

Everything of this engine lives in this folder (importing it does not import Ray):

* :mod:`knitdata.engines.ray.engine`: :class:`~knitdata.engines.ray.engine.RayEngine`, the engine the pipeline builds;
* :mod:`knitdata.engines.ray.control`: the coordinator actor and :class:`~knitdata.engines.ray.control.RayControl`,
  typed proxies of the control plane's parts;
* :mod:`knitdata.engines.ray.connect`: connecting to Ray, actor options, shared helpers;
* :mod:`knitdata.engines.ray.unit_actor`: the storage-unit actor of a node;
* :mod:`knitdata.engines.ray.unit`: :class:`~knitdata.engines.ray.unit.RayStorageUnit`, its client;
* :mod:`knitdata.engines.ray.media`: media stored once per digest in the node's object store;
* :mod:`knitdata.engines.ray.read`: a consumer's reads (zero-copy on the same node);
* :mod:`knitdata.engines.ray.metrics`: the engine's transfer counters.
"""
