"""A Prometheus exposition of a pipeline's figures, on request (optional extra: ``pip install knitdata[observe]``).

:func:`serve` starts an HTTP server (``prometheus_client``'s, on a daemon thread) whose ``/metrics`` reads the
pipeline's :meth:`~knitdata.Pipeline.stats` at every scrape and exposes :func:`knitdata.observe.monitor.flat_metrics` as
gauges: ``knitdata/staleness/math/p95`` becomes ``knitdata_staleness_p95{source="math"}``, ``knitdata/store/fill``
``knitdata_store_fill``, ``knitdata/starved/agent`` (a staleness bound's starvation signal)
``knitdata_starved{source="agent"}``. It listens on the loopback interface unless told otherwise (``addr="0.0.0.0"`` exposes
the pipeline's figures to the network: put it behind your cluster's access rules).

Example (a pipeline of any engine; a Ray-engine one from any process, with ``Pipeline.attach``):

```python
from knitdata import BatchSpec, Pipeline
from knitdata.integrations.prometheus import serve

pipe = Pipeline(BatchSpec({"math": 8}, num_minibatches=2, group_size=2), num_consumers=1)
server = serve(pipe, port=0)           # any free port (the default is 9464): http://127.0.0.1:<port>/metrics
print(server.url)
server.close()
```
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from knitdata.errors import ConfigError, KnitdataError, OptionalDependencyError
from knitdata.observe.monitor import flat_metrics

__all__ = ["MetricsServer", "serve", "collect"]

_BAD = re.compile(r"[^a-zA-Z0-9_]")


def _name(parts: list[str]) -> str:
    name = _BAD.sub("_", "_".join(["knitdata", *parts]))
    return name if not name[0].isdigit() else "_" + name


def collect(stats: Mapping[str, Any], *, rank: int | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The gauges of one scrape: ``{metric name: [(labels, value), ...]}`` from a stats dict.

    A path component of a :func:`~knitdata.observe.monitor.flat_metrics` key that names a source becomes the label
    ``source``; the rest, joined by ``_``, the name (characters Prometheus does not allow become ``_``).
    """
    bound = stats.get("staleness_bound")
    sources = set(stats.get("sources") or {}) | set(stats.get("staleness_by_source") or {}) | set(
        (bound.get("starved") or {}) if isinstance(bound, Mapping) else {})
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for key, value in flat_metrics(stats, rank=rank, prefix="").items():
        parts = key.split("/")
        labels: dict[str, str] = {}
        if len(parts) > 2 and parts[1] in sources and parts[0] in ("staleness", "sources"):
            labels["source"] = parts.pop(1)
        elif len(parts) > 2 and parts[-1] in sources and parts[0] == "stale_dropped":
            labels["source"] = parts.pop()
        elif len(parts) == 2 and parts[1] in sources and parts[0] in ("starved", "drop_streak"):
            labels["source"] = parts.pop()
        out.setdefault(_name(parts), []).append((labels, float(value)))
    return out


class MetricsServer:
    """A running exposition (see :func:`serve`).

    Attributes:
        addr: The address it listens on.
        port: The port it listens on (the one picked when ``port=0`` was asked).
        url: ``http://addr:port/metrics``.
    """

    def __init__(self, server: Any, thread: threading.Thread, addr: str) -> None:
        self._server = server
        self._thread = thread
        self.addr = addr
        self.port = int(server.server_address[1])
        self.url = f"http://{addr}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer(url={self.url!r})"


def serve(source: Any, *, port: int = 9464, addr: str = "127.0.0.1", rank: int | None = None) -> MetricsServer:
    """Serve a pipeline's figures at ``http://addr:port/metrics`` in the Prometheus text format.

    Args:
        source: A :class:`~knitdata.Pipeline` (its :meth:`~knitdata.Pipeline.stats` is read at every scrape), or a
            callable returning a stats dict.
        port: The TCP port (``0``: any free one; read it back from :attr:`MetricsServer.port`).
        addr: The interface to listen on; loopback by default.
        rank: Also expose that rank's consumer figures (data wait, bytes, staleness).

    Returns:
        The running :class:`MetricsServer`; :meth:`MetricsServer.close` stops it.

    Raises:
        OptionalDependencyError: ``prometheus_client`` is not installed.
        ConfigError: A bad port, or ``source`` is neither a pipeline nor a callable.
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.core import GaugeMetricFamily
    except ImportError as e:
        raise OptionalDependencyError("prometheus_client", "observe", "knitdata.integrations.prometheus") from e
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ConfigError(f"port must be an int in 0..65535, got {port!r}")
    stats_fn: Callable[[], Mapping[str, Any]]
    if hasattr(source, "stats") and callable(source.stats):
        stats_fn = source.stats
    elif callable(source):
        stats_fn = source
    else:
        raise ConfigError(f"source must be a knitdata Pipeline or a callable returning its stats, got "
                          f"{type(source).__name__}")

    class _Collector:
        def collect(self) -> Iterator[Any]:
            try:
                stats = stats_fn()
            except KnitdataError:
                up = GaugeMetricFamily("knitdata_up", "1 when the pipeline answered this scrape")
                up.add_metric([], 0.0)
                yield up
                return
            up = GaugeMetricFamily("knitdata_up", "1 when the pipeline answered this scrape")
            up.add_metric([], 1.0)
            yield up
            for name, samples in sorted(collect(stats, rank=rank).items()):
                label_names = sorted({k for labels, _v in samples for k in labels})
                fam = GaugeMetricFamily(name, f"knitdata {name[len('knitdata_'):]}", labels=label_names)
                for labels, value in samples:
                    fam.add_metric([labels.get(k, "") for k in label_names], value)
                yield fam

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    started = start_http_server(port, addr=addr, registry=registry)
    if not isinstance(started, tuple):  # prometheus_client < 0.20 returns nothing
        raise OptionalDependencyError("prometheus_client>=0.20", "observe", "knitdata.integrations.prometheus")
    server, thread = started
    return MetricsServer(server, thread, addr)
