"""The Ray engine as a user runs it: creator, producers and ranks as separate, independently started processes.

Every process is started by ``tests/_ray_attach_roles.py`` with an environment built from scratch (``PATH``,
``HOME``, ``PYTHONPATH`` = this checkout): nothing a user is not told to set, in particular no ``RAY_AUTH_MODE``.
One creator (one local Ray, started by ``Pipeline(..., engine="ray")`` as in README.md) serves the whole file; the
last test kills it.

* Ray 2.60 turns token authentication on for the local Ray a creator starts; a process started on its own then
  attaches with ``Pipeline.attach(name, address=...)`` only because knitdata applies this user's token for a Ray
  of this user on this machine (issue 23, item 1: 20 s of ``InvalidAuthToken`` retries, then ``ConnectionError``
  before). What cannot work fails within seconds with an :class:`~knitdata.errors.EngineError` naming the fix.
* When the creator dies (SIGKILL), its Ray goes with it: attached ranks and producers get an ``EngineError`` saying
  the pipeline's host is gone within seconds, instead of Ray terminating them after 60 s (item 6).

No Ray runs in the pytest process (the decision tests at the end only stub the probe); every subprocess runs under
a hard timeout.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
ROLES = Path(__file__).resolve().parent / "_ray_attach_roles.py"
PIPE_ATTACH, PIPE_DEATH = "attach-demo", "death-demo"
#: Seconds from the creator's SIGKILL to the knitdata error in an attached process: the watch's 3 s grace, its
#: 0.5 s probe period and the consumers' 1 s polls, with room for a loaded 2-core machine.
HOST_GONE_BOUND_S = 10.0


def user_env() -> dict[str, str]:
    """What a user's shell gives a process: PATH and HOME, and this checkout on PYTHONPATH; nothing else."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
            "PYTHONPATH": str(ROOT)}


class Proc:
    """A role process; its stdout JSON lines are collected by a thread (``lines``), stderr kept for failures."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, stdin: bool = False) -> None:
        self.args = args
        self.p = subprocess.Popen([sys.executable, str(ROLES), *args], env=env or user_env(), text=True,
                                  stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True)
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._err: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self._err.extend(self.p.stderr or []), daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout or []:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def next(self, key: str, timeout_s: float) -> dict[str, Any]:
        """The next line holding ``key`` (or ``"error"``), within ``timeout_s``; fails the test otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{self.args}: no {key!r} within {timeout_s:.0f} s; stderr:\n{self.stderr()[-3000:]}")
            if msg is None:
                pytest.fail(f"{self.args} exited ({self.p.wait()}) before {key!r}; stderr:\n{self.stderr()[-3000:]}")
            self.seen.append(msg)
            if key in msg or "error" in msg:
                return msg

    def wait(self, timeout_s: float) -> int:
        try:
            return self.p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.args} did not exit within {timeout_s:.0f} s; stderr:\n{self.stderr()[-3000:]}")

    def stderr(self) -> str:
        time.sleep(0.2)
        return "".join(self._err)

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(timeout=30)


@pytest.fixture(scope="module")
def creator() -> Any:
    """The creating process (README's rollout process): two pipelines on the local Ray it starts."""
    proc = Proc("creator", PIPE_ATTACH, PIPE_DEATH, stdin=True)
    try:
        proc.address = proc.next("address", 180)["address"]  # type: ignore[attr-defined]
        assert "error" not in proc.seen[-1], proc.seen[-1]
        yield proc
    finally:
        if proc.p.poll() is None and proc.p.stdin:
            proc.p.stdin.close()
            try:
                proc.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        proc.kill()


def test_attach_from_independent_processes_with_the_documented_recipe(creator: Any) -> None:
    """Issue 23, item 1: a producer and two ranks started on their own attach by name and address (token auth)."""
    n = 2 * 8
    ranks = [Proc("rank", PIPE_ATTACH, creator.address, str(r)) for r in range(2)]
    prod = Proc("producer", PIPE_ATTACH, creator.address, str(n))
    try:
        for p in (prod, *ranks):
            msg = p.next("attached", 120)
            assert "error" not in msg, f"{p.args}: {msg}"
            assert msg["attached"] < 10, f"{p.args} took {msg['attached']:.1f} s to attach"
        assert "error" not in prod.next("done", 120)
        got: Counter[str] = Counter()
        for p in ranks:
            end = p.next("done", 120)
            assert "error" not in end, f"{p.args}: {end}"
            got.update(i for msg in p.seen if "ids" in msg for i in msg["ids"])
            assert p.wait(60) == 0
        assert prod.wait(60) == 0
        assert got == Counter(f"t{i}" for i in range(n))  # every trajectory trained exactly once
    finally:
        for p in (prod, *ranks):
            p.kill()


def test_attach_that_cannot_work_fails_fast_naming_the_fix(creator: Any) -> None:
    """A wrong token (given as Ray's docs say: RAY_AUTH_TOKEN) and a dead address: EngineError within seconds."""
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    wrong = Proc("rank", PIPE_ATTACH, creator.address, "0", env={**user_env(), "RAY_AUTH_TOKEN": "0" * 64})
    nobody = Proc("rank", PIPE_ATTACH, dead, "0")
    try:
        msg = wrong.next("attached", 120)
        assert msg.get("error") == "EngineError" and msg["after"] < 8, msg
        assert creator.address in msg["message"] and "refused" in msg["message"], msg
        assert "RAY_AUTH_TOKEN" in msg["message"] and "docs.ray.io" in msg["message"], msg
        msg = nobody.next("attached", 120)
        assert msg.get("error") == "EngineError" and msg["after"] < 15, msg
        assert f"no Ray cluster answers at {dead}" in msg["message"], msg
    finally:
        wrong.kill()
        nobody.kill()


def test_attached_processes_get_a_knitdata_error_when_the_creator_dies(creator: Any) -> None:
    """Issue 23, item 6: SIGKILL the creator; waiting ranks and a putting producer get EngineError naming the
    pipeline, the address and what to do within seconds, and exit (Ray would terminate them after 60 s)."""
    ranks = [Proc("rank", PIPE_DEATH, creator.address, str(r)) for r in range(2)]
    prod = Proc("trickle", PIPE_DEATH, creator.address)
    procs = [*ranks, prod]
    try:
        for p in procs:
            assert "error" not in p.next("attached", 120), p.seen
        time.sleep(1.0)  # the ranks wait for micro-batches, the producer puts
        killed_at = time.time()
        creator.kill()
        for p in procs:
            msg = p.next("error", 60)
            assert msg.get("error") == "EngineError", f"{p.args}: {msg}"
            text = msg["message"]
            assert f"pipeline {PIPE_DEATH!r} is gone" in text and creator.address in text, text
            assert "keep the creating process alive" in text and "'detached': True" in text, text
            delay = msg["t"] - killed_at
            print(f"{p.args[0]} {p.args[-1]}: EngineError {delay:.1f} s after the kill")
            assert delay < HOST_GONE_BOUND_S, f"{p.args}: the error came {delay:.1f} s after the kill"
        for p in procs:
            p.wait(55)  # Ray's own shutdown without its node takes ~15 s; its GCS timeout would be 60 s
            assert "within 60 seconds" not in p.stderr(), p.stderr()[-2000:]
        print(f"all exited {time.time() - killed_at:.1f} s after the kill")
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow  # a Ray of its own: about 30 s
def test_a_process_inside_attach_gets_a_knitdata_error_when_the_creator_dies() -> None:
    """Issue 45.7: the creator dies while a process is inside Pipeline.attach (stopped at its lookup of the
    pipeline, and at its first call to the coordinator): an EngineError naming the pipeline and the address within
    seconds, instead of Ray terminating the process after 60 s. Its own creator (the module's is killed last)."""
    name = "attach-death-demo"
    owner = Proc("creator", name, stdin=True)
    paused: list[Proc] = []
    try:
        address = owner.next("address", 180)["address"]
        assert "error" not in owner.seen[-1], owner.seen[-1]
        paused = [Proc("paused_attach", name, address, where, stdin=True) for where in ("get_actor", "info")]
        for p in paused:
            msg = p.next("paused", 120)
            assert "error" not in msg, f"{p.args}: {msg}"
        killed_at = time.time()
        owner.kill()
        for p in paused:  # go on inside attach, on a dead cluster
            assert p.p.stdin is not None
            p.p.stdin.write("go\n")
            p.p.stdin.flush()
        for p in paused:
            msg = p.next("attached", 60)
            assert msg.get("error") == "EngineError", f"{p.args}: {msg}"
            text = msg["message"]
            assert f"pipeline {name!r} is gone" in text and address in text, text
            delay = msg["t"] - killed_at
            print(f"inside attach at {p.args[-1]}: EngineError {delay:.1f} s after the kill")
            assert delay < HOST_GONE_BOUND_S, f"{p.args}: the error came {delay:.1f} s after the kill"
        for p in paused:
            p.wait(55)
            assert "within 60 seconds" not in p.stderr(), p.stderr()[-2000:]
    finally:
        for p in (*paused, owner):
            p.kill()


# ------------------------------------------------------------------------- the decision, without a cluster
def _stub_probe(monkeypatch: pytest.MonkeyPatch, answer: str) -> tuple[Any, list[bool]]:
    """``ray_connect`` with ``probe_gcs`` answering ``answer``; the list records whether each probe sent a token."""
    from knitdata.engines.ray import connect as ray_connect

    sent: list[bool] = []

    def probe(address: str, *, with_token: bool = False, timeout_s: float = 5.0) -> str:
        sent.append(with_token)
        return answer

    monkeypatch.setattr(ray_connect, "probe_gcs", probe)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    return ray_connect, sent


def test_the_token_goes_only_to_a_ray_of_this_user_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from knitdata.errors import EngineError

    ray_connect, sent = _stub_probe(monkeypatch, "unauthenticated")
    # another machine; a loopback port that no raylet of this user serves
    for address in ("10.1.2.3:6379", "127.0.0.1:1"):
        with pytest.raises(EngineError, match="RAY_AUTH_MODE=token") as ei:
            ray_connect.prepare_auth(address)
        assert address in str(ei.value) and "only to a Ray of yours on this machine" in str(ei.value)
    assert sent == [False, False]  # asked without credentials, never with the token
    assert "RAY_AUTH_MODE" not in os.environ


def test_an_explicit_auth_mode_is_respected_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from knitdata.errors import EngineError

    ray_connect, sent = _stub_probe(monkeypatch, "unauthenticated")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(EngineError, match="RAY_AUTH_MODE=disabled is set"):
        ray_connect.prepare_auth("127.0.0.1:1")
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and sent == [False]


def test_a_cluster_without_authentication_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    ray_connect, sent = _stub_probe(monkeypatch, "ok")
    ray_connect.prepare_auth("127.0.0.1:1")
    ray_connect.prepare_auth("ray://head:10001")  # not host:port (Ray Client): left to Ray, not probed
    assert sent == [False] and "RAY_AUTH_MODE" not in os.environ
