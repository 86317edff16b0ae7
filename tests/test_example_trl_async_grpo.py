"""Acceptance of issue 44 for TRL's AsyncGRPOTrainer on knitdata (examples/trl_async_grpo.py, the docs' script).

The script trains on CPU with two sources in its own process; the test kills it (SIGKILL) after a checkpoint,
restarts it with ``resume_from_checkpoint`` and checks, over both processes, what TRL trained: every optimizer
step holds exactly each source's share (4 "even" + 2 "low" samples), no sample (its oldest token: responses are
generated in chunks, continued after weight syncs) is staler than the bound in TRL's model versions, and the trajectories trained (the steps the first process made after its checkpoint are rolled
back with the model) cover each source's prompts 0..K-1 exactly once: nothing trained twice, nothing lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "trl_async_grpo.py"
STEPS, SAVE, BOUND = 8, 2, 2
SHARE = {"even": 4, "low": 2}


def _run(out: Path, record: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(SCRIPT), "--output-dir", str(out), "--max-steps", str(STEPS),
                             "--save-steps", str(SAVE), "--max-staleness", str(BOUND), "--record", str(record),
                             # chunks of 2 tokens on a slower engine: weight syncs land mid-generation
                             "--chunk-tokens", "2", "--max-new-tokens", "8", "--gen-delay", "0.02", *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _lines(record: Path) -> list[dict]:
    return [json.loads(x) for x in record.read_text().splitlines() if x.strip()]


def _stepped_past(record: Path, step: int) -> bool:
    """Whether the running script recorded a step after ``step`` (its last line may be half written)."""
    if not record.exists():
        return False
    for x in record.read_text().splitlines():
        try:
            if json.loads(x)["step"] > step:
                return True
        except ValueError:
            pass
    return False


def test_trains_two_sources_with_exact_shares_and_resumes_exactly_after_a_kill(tmp_path: Path) -> None:
    out, record = tmp_path / "out", tmp_path / "steps.jsonl"
    first = _run(out, record, "--step-sleep", "0.3")
    state_of = lambda n: out / f"checkpoint-{n}" / "knitdata_trl_worker.json"  # noqa: E731
    deadline = time.monotonic() + 120
    # kill once a step past the second checkpoint has trained: it must be rolled back and trained again
    while not (state_of(2 * SAVE).exists() and _stepped_past(record, 2 * SAVE)):
        assert first.poll() is None, first.stdout.read().decode()[-3000:] if first.stdout else ""
        assert time.monotonic() < deadline, "no step past the second checkpoint within 120 s"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    saved = max(int(p.parent.name.split("-")[1]) for p in out.glob("checkpoint-*/knitdata_trl_worker.json"))
    assert SAVE * 2 <= saved < STEPS
    killed = _lines(record)
    assert max(r["step"] for r in killed) >= saved

    second = _run(out, record, "--resume", str(out / f"checkpoint-{saved}"))
    log = second.communicate(timeout=180)[0].decode()
    assert second.returncode == 0, log[-4000:]

    lines = _lines(record)
    pids = sorted({r["pid"] for r in lines}, key=[r["pid"] for r in lines].index)
    assert len(pids) == 2
    kept = [r for r in lines if r["pid"] == pids[0] and r["step"] <= saved] + [r for r in lines if r["pid"] == pids[1]]
    assert [r["step"] for r in kept] == list(range(1, STEPS + 1))  # the resumed run starts at saved + 1
    for r in kept:
        assert r["per_source"] == SHARE, r                  # exact per-step shares
        assert 0 <= r["staleness"] <= BOUND, r              # in TRL's versions, when the step trains
        assert r["read_staleness"] <= BOUND, r              # TRL's own drop check never fires
        assert set(r["groups"]) <= set(r["trl_groups"]), r  # TRL's collator trained these groups by this step
    ids = [t for r in kept for t in r["ids"]]
    assert len(ids) == len(set(ids)) == STEPS * sum(SHARE.values())
    keys = [_key(t) for t in ids]                       # (source, prompt index, sample index)
    assert len(keys) == len(set(keys))                  # nothing trained twice
    for source, per_step in SHARE.items():              # nothing lost: each source's prompts 0..K-1, K = steps x groups
        assert {p for s, p, _ in keys if s == source} == set(range(STEPS * per_step // 2)), source
    # the first process trained past its checkpoint; those steps were rolled back with the model, so the second
    # process trained their prompts again
    redone = {_key(t) for r in lines if r["pid"] == pids[0] and r["step"] > saved for t in r["ids"]}
    assert redone and redone <= {_key(t) for r in lines if r["pid"] == pids[1] for t in r["ids"]}


def _key(trajectory_id: str) -> tuple[str, int, int]:
    """``even-p12-a0-1`` -> ("even", 12, 1): the worker's ids are source, prompt, attempt, sample."""
    source, prompt, _attempt, sample = trajectory_id.rsplit("-", 3)
    return source, int(prompt[1:]), int(sample)
