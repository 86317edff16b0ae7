"""Helpers of tests/test_checkpoint.py and tests/test_node_loss.py: run a script in a driver subprocess as a user
would (``python script.py ...``, this checkout importable), and the Ray scenarios of ``_ray_ckpt_script.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent

__all__ = ["HERE", "user_env", "run_script", "run_ray_scenario"]


def user_env() -> dict[str, str]:
    """The user's environment, with this checkout importable (as ``pip install -e .`` makes it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    return env


def run_script(script: Path, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> Any:
    """Run ``python script args...`` under a hard time-out; return the last JSON line it printed."""
    p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                       env=env if env is not None else user_env(), start_new_session=True)
    assert p.returncode == 0, p.stderr[-6000:]
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])


def run_ray_scenario(name: str, d: Path, timeout: float = 400.0) -> Any:
    """Run scenario ``name`` of tests/_ray_ckpt_script.py (its own 3-node loopback Ray cluster) in a driver process."""
    pytest.importorskip("ray")
    env = user_env()
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0",
               OMP_NUM_THREADS="1")
    return run_script(HERE / "_ray_ckpt_script.py", name, str(d), timeout=timeout, env=env)


def reissue_missing(pipe: Any, make: Any, put: list[str], tag: str = "r") -> None:
    """Reissue what ``pipe.restore_report`` names: ``make(id, prompt)`` the missing members of each prompt (ids
    ``p{prompt}-{tag}{k}``), put them, record their ids in ``put``, and report each prompt finished."""
    for r in pipe.restore_report.reissue:
        p = int(r["prompt_id"][1:])
        fresh = [make(f"p{p}-{tag}{k}", p) for k in range(r["missing"])]
        if fresh:
            pipe.put_many(fresh)
            put.extend(t.id for t in fresh)
        pipe.ledger.finished(r["prompt_id"])
