"""How the conformance suite (``tests/test_conformance*.py``) runs a scenario of ``tests/_conformance.py`` on an
engine: the embedded one in this process, the Ray one in a driver subprocess attached to a local 2-node
``ray.cluster_utils`` cluster (one per test module, the ``cluster`` fixture; results cached per process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _conformance as cf  # noqa: E402
from _ray_helpers import PY, ClusterProcess, run_json_subprocess  # noqa: E402

__all__ = ["cluster", "run_on", "ENGINES", "ENGINES_RAY_SLOW", "FETCHES"]

FETCHES = ("sample", "eager", "iter")
HERE = Path(__file__).resolve().parent
ENGINES = ["embedded", pytest.param("ray", marks=pytest.mark.ray)]
#: The newer features' Ray runs go to make test-slow (CI runs it after make test): each conformance file runs on one
#: xdist worker, so its Ray cases are on the critical path of make test.
ENGINES_RAY_SLOW = ["embedded", pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow])]


def _ray_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("ray") is not None
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(scope="module")
def cluster():
    if not _ray_available():
        pytest.skip("ray is not installed")
    with ClusterProcess(nodes=2, cpus=8, store_mb=160) as c:
        yield c


_CACHE: dict[str, Any] = {}


def run_on(engine: str, request: pytest.FixtureRequest, name: str, timeout_s: float = 300.0, **kwargs: Any) -> Any:
    """Run a scenario on ``engine`` (Ray: in a subprocess attached to the module's cluster; cached)."""
    if engine == "embedded":
        return cf.run(name, engine="embedded", **kwargs)
    key = json.dumps([name, kwargs], sort_keys=True)
    if key in _CACHE:
        return _CACHE[key]
    c = request.getfixturevalue("cluster")
    cmd = [PY, str(HERE / "_conformance.py"), name, "--address", c.address, "--args", json.dumps(kwargs)]
    _CACHE[key] = run_json_subprocess(cmd, f"scenario {name}", timeout_s)
    return _CACHE[key]
