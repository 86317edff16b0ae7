"""Observing a run: counters, the status table and the trace every layer records into.

* :mod:`knitdata.observe.metrics`: per-consumer, prefetch and transfer counters;
* :mod:`knitdata.observe.monitor`: flat per-step metrics for a logger and the ``knitdata status`` table;
* :mod:`knitdata.observe.trace`: spans and events recorded by every layer (``knitdata trace``).
"""
