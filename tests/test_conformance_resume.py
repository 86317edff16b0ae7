"""Conformance, exactly-once resume (``tests/test_conformance.py`` holds the other scenarios): a run saved at a
micro-batch, restored into the same or a fresh pipeline, delivers what the uninterrupted run delivers, on every
engine. Its own file so that pytest-xdist (``--dist loadfile``) runs it beside the rest of the suite.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _conformance_run import ENGINES, FETCHES, cluster, run_on  # noqa: E402,F401 - cluster: the module's fixture

pytestmark = pytest.mark.timeout(600)


def _check_resume(res: dict[str, Any], case: str) -> None:
    nodes = case.split("/")[0]
    ref = res["ref"][nodes]
    ids = [i for row in ref for ids, _pos in row for i in ids]
    assert len(ids) == len(set(ids)), "the reference run delivered a trajectory twice"
    assert res["cases"][case], case
    for s, got_case in res["cases"][case].items():
        for r, want in enumerate(ref):
            got = got_case["taken"][r] + got_case["rest"][r]
            assert got == want, f"{case}: rank {r}, saved after {s} micro-batches: stream differs from the uninterrupted run"


#: Ray runs every case of one fetch mode in one driver process (each restore builds actors): a few save points.
RAY_POINTS = [0, 3]
#: Ray in make test: fetch='iter' (the default) with a fresh pipeline restored across two nodes. The fetch modes
#: differ in the dataset (engine-neutral code, run at every save point on the embedded engine); the other Ray cases
#: (every restore of fetch='iter' in one driver run, the other modes across two nodes: minutes on 2 cores) go to
#: make test-slow.
RAY_FAST = (2, "fresh")


def _save_point_cases() -> list[Any]:
    out: list[Any] = []
    for restore in ("same", "fresh"):
        for nodes in (1, 2):
            for fetch in FETCHES:
                out.append(pytest.param("embedded", fetch, nodes, restore, id=f"{restore}-{nodes}-{fetch}-embedded"))
                if (nodes, restore) == RAY_FAST or fetch == "iter":
                    slow = [] if (nodes, restore, fetch) == (*RAY_FAST, "iter") else [pytest.mark.slow]
                    out.append(pytest.param("ray", fetch, nodes, restore, marks=[pytest.mark.ray, *slow],
                                            id=f"{restore}-{nodes}-{fetch}-ray"))
    return out


RAY_SLOW_CASES = [[n, r, "plain"] for n in (1, 2) for r in ("same", "fresh") if (n, r) != RAY_FAST]


@pytest.mark.parametrize(("engine", "fetch", "nodes", "restore"), _save_point_cases())
def test_exactly_once_at_every_save_point(engine, fetch, nodes, restore, request):
    if engine == "ray":
        cases = RAY_SLOW_CASES if fetch == "iter" and (nodes, restore) != RAY_FAST else [[nodes, restore, "plain"]]
        res = run_on(engine, request, "resume", fetch=fetch, cases=cases, save_points=RAY_POINTS, n_groups=8)
    else:  # every save point
        res = run_on(engine, request, "resume", fetch=fetch, cases=[[nodes, restore, "plain"]])
    _check_resume(res, f"{nodes}/{restore}/plain")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("restore", ["same", "fresh"])
def test_exactly_once_through_stateful_dataloader(engine, restore, request):
    cases = [[2, r, "stateful"] for r in ("same", "fresh")]
    if engine == "ray":
        res = run_on(engine, request, "resume", fetch="iter", cases=cases, save_points=[2], n_groups=8)
    else:
        res = run_on(engine, request, "resume", fetch="iter", cases=[[2, restore, "stateful"]])
    _check_resume(res, f"2/{restore}/stateful")
