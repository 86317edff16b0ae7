"""knitdata.integrations.prometheus: the exposition scraped over HTTP on loopback, parsed as the text format."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

import pytest
import torch

from knitdata import BatchSpec, Pipeline, Trajectory
from knitdata.errors import ConfigError, PipelineClosedError
from knitdata.integrations.prometheus import collect, serve

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def _pipe() -> Pipeline:
    spec = BatchSpec({"math": 2, "code": 2}, num_minibatches=1, group_size=2)
    pipe = Pipeline(spec, num_consumers=1, capacity_bytes=1 << 20, token_budget=64)
    for i in range(4):
        src = "math" if i < 2 else "code"
        pipe.put(Trajectory(id=f"t{i}", source=src, group=f"g-{src}", gen_version=0, prompt_ids=torch.arange(3),
                            response_ids=torch.arange(4), scalars={"reward": 1.0}))
    return pipe


def _scrape(url: str) -> dict[str, list[Any]]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {fam.name: fam.samples for fam in text_string_to_metric_families(text)}


def test_scrape_on_loopback_parses_and_tracks_the_run() -> None:
    pipe = _pipe()
    with serve(pipe, port=0, rank=0) as server:
        assert server.addr == "127.0.0.1" and server.url == f"http://127.0.0.1:{server.port}/metrics"
        before = _scrape(server.url)
        assert before["knitdata_up"][0].value == 1.0
        assert before["knitdata_puts"][0].value == 4
        puts = {s.labels["source"]: s.value for s in before["knitdata_sources_puts"]}
        assert puts == {"math": 2.0, "code": 2.0}
        assert 0.0 < before["knitdata_store_fill"][0].value <= 1.0
        assert before["knitdata_staleness_count"][0].value == 0
        for _mb in pipe.dataset(0, fetch="sample", max_minibatches=1):
            pass
        after = _scrape(server.url)
        assert after["knitdata_staleness_count"][0].value == 4
        per_src = {s.labels["source"]: s.value for s in after["knitdata_staleness_count"][1:]}
        assert per_src == {"math": 2.0, "code": 2.0}
        assert after["knitdata_steps"][0].value == 1
        assert after["knitdata_admission_delay_s_count"][0].value == 4
        assert after["knitdata_staleness_split_count"][0].value == 4  # generating / queued (issue 45)
        for part in ("generating", "queued", "queued_s"):
            assert after[f"knitdata_staleness_{part}_mean"][0].value >= 0
            assert after[f"knitdata_staleness_{part}_max"][0].value >= 0
        pipe.close()
    with pytest.raises(OSError):  # closed: nothing listens there any more
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_an_unreachable_pipeline_scrapes_as_down() -> None:
    def gone() -> dict[str, Any]:
        raise PipelineClosedError("the pipeline's host is gone")

    with serve(gone, port=0) as server:
        fams = _scrape(server.url)
    assert fams["knitdata_up"][0].value == 0.0 and len(fams) == 1


def test_names_and_labels() -> None:
    got = collect({"staleness_by_source": {"a-b": {"count": 1, "mean": 1.0, "p95": 1.0, "max": 1.0}},
                   "staleness_bound": {"dropped_groups": {"a-b": 2}}})
    assert got["knitdata_staleness_max"] == [({"source": "a-b"}, 1.0)]
    assert got["knitdata_stale_dropped_dropped_groups"] == [({}, 2.0), ({"source": "a-b"}, 2.0)]
    split = collect({"staleness_split": {"count": 3, "generating_mean": 1.5, "generating_max": 2, "queued_mean": 0.5,
                                         "queued_max": 1, "queued_s_mean": 0.25, "queued_s_max": None}})
    assert split["knitdata_staleness_generating_mean"] == [({}, 1.5)]
    assert split["knitdata_staleness_queued_max"] == [({}, 1.0)]
    assert split["knitdata_staleness_queued_s_max"] == [({}, 0.0)]  # none yet reads 0
    assert split["knitdata_staleness_split_count"] == [({}, 3.0)]
    starved = collect({"staleness_bound": {"starved": {"math": False, "agent": True},
                                           "drop_streak": {"math": 0, "agent": 3}}})
    assert starved["knitdata_starved"] == [({"source": "math"}, 0.0), ({"source": "agent"}, 1.0)]
    assert starved["knitdata_starved_sources"] == [({}, 1.0)]
    assert starved["knitdata_drop_streak"] == [({"source": "math"}, 0.0), ({"source": "agent"}, 3.0)]


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="port"):
        serve(lambda: {}, port=70000)
    with pytest.raises(ConfigError, match="source"):
        serve(42, port=0)
