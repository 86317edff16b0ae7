"""Connecting to Ray: attach or start (loopback only by default), token authentication, the host watch, bounded gets.

* :func:`connect` with ``address=None`` starts a local Ray bound to ``127.0.0.1`` with the dashboard off (or uses the
  Ray this process is already attached to); with an address it attaches there and, with ``loopback_only=True``,
  refuses a cluster with a non-loopback node (:func:`check_loopback`). Before attaching to an address it applies
  this user's Ray token for a Ray of this user on this machine (:func:`prepare_auth`, :func:`probe_gcs`).
* Host watch (:func:`watch_host`, :func:`check_host`, :func:`host_gone_error`): every attached process watches the
  cluster's GCS port, so that calls raise :class:`~knitdata.errors.EngineError` within seconds when the Ray the
  pipeline's creator started is gone, instead of hanging; :func:`ray_get` waits in slices and checks it, and
  :func:`call_watched` does the same for a Ray call without a timeout (``ray.get_actor``). While a process attaches
  (:func:`attaching`) a GCS that refuses connections for :data:`HOST_GONE_S` seconds counts as gone.
* :func:`alive_nodes`, :func:`current_node`, :func:`current_address`, :func:`hosts_cluster`: where this process is.

Used by the storage units (:mod:`knitdata.engines.ray.unit`) and the Ray engine; imports no engine.
Importing this module without Ray installed raises :class:`~knitdata.errors.OptionalDependencyError`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from knitdata.errors import EngineError, OptionalDependencyError

try:
    import ray
except ImportError as _e:  # pragma: no cover - exercised by monkeypatching in tests
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.engines.ray.connect)") from _e

__all__ = [
    "LOOPBACK",
    "NAMESPACE",
    "HOST_GONE_S",
    "CLUSTER_GONE_S",
    "connect",
    "check_loopback",
    "current_address",
    "hosts_cluster",
    "probe_gcs",
    "prepare_auth",
    "watch_host",
    "check_host",
    "host_gone_error",
    "ray_get",
    "call_watched",
    "attaching",
    "alive_nodes",
    "current_node",
]

#: The only address the engine binds to unless told otherwise.
LOOPBACK = "127.0.0.1"
#: Ray namespace of knitdata's named actors (looked up explicitly, whatever namespace the driver uses).
NAMESPACE = "knitdata"

_INIT_PID: int | None = None
_log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- cluster
#: Seconds the GCS of a Ray that the pipeline's creator started itself (``ray.init()``: it lives and dies with
#: that process) may refuse connections before an attached process reports the pipeline's host gone.
HOST_GONE_S = 3.0
#: The same for a cluster that outlives its drivers (``ray start``), whose GCS may be restarted by Ray's fault
#: tolerance; Ray itself terminates an attached process after 60 s without its GCS. A process still inside
#: :func:`attaching` (it does not know yet who hosts the cluster) waits :data:`HOST_GONE_S` instead.
CLUSTER_GONE_S = 30.0
_AUTH_ENV = "RAY_AUTH_MODE"
_AUTH_DOCS = "https://docs.ray.io/en/latest/ray-security/token-auth.html"


def connect(
    address: str | None = None,
    *,
    loopback_only: bool = True,
    num_cpus: int | None = None,
    object_store_memory: int | None = None,
) -> None:
    """Attach this process to Ray (idempotent).

    Authentication (Ray >= 2.60 turns token authentication on for a cluster started by ``ray.init()``): before
    attaching to an address, this asks the cluster's GCS (one unauthenticated call, milliseconds) whether it
    wants a token. If it does and ``RAY_AUTH_MODE`` is not set, and the address is a loopback one served by a
    Ray of this user on this machine, this process uses the token Ray keeps for this user (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, the one such a cluster was started with), as Ray itself
    does for ``address="auto"``. A token is never sent on its own initiative to another machine or another
    user's process: there :class:`~knitdata.errors.EngineError` says what to set.

    Args:
        address: A running cluster's address (``"127.0.0.1:6379"``, or ``"auto"``). ``None`` (the
            default) starts a local single-node Ray bound to loopback only:
            ``ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)``, with Ray's default token
            authentication (the token file, if Ray creates it now, is made readable by its owner only).
        loopback_only: Bind this process to ``127.0.0.1`` and refuse a cluster with a node on any other
            address (:class:`~knitdata.errors.EngineError`). Turn off on a real multi-host cluster.
        num_cpus: Logical CPUs of a locally started Ray (default: Ray's; give actors enough).
        object_store_memory: Object store bytes of a locally started Ray.

    Raises:
        EngineError: If this is a forked child of a process attached to Ray (use the ``spawn`` start
            method for DataLoader workers), a node is not on loopback while ``loopback_only``, nothing
            answers at ``address``, or the cluster wants a token this process cannot present (the message
            names what to set).
    """
    global _INIT_PID
    if loopback_only:
        # Ray replaces a 127.0.0.1 address by the machine's address unless "clusters" are disabled, which
        # on Linux only makes loopback the default node address; children inherit the setting.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    if ray.is_initialized():
        if _INIT_PID is not None and _INIT_PID != os.getpid():
            raise EngineError(
                "this process was forked from one attached to Ray, and Ray does not survive fork; start "
                "DataLoader workers with multiprocessing_context='spawn' (or 'forkserver')"
            )
    else:
        kwargs: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
        if loopback_only:
            kwargs["_node_ip_address"] = LOOPBACK
        new_token = None
        if address is None:
            kwargs.update(include_dashboard=False, num_cpus=num_cpus, object_store_memory=object_store_memory)
            new_token = _default_token_path()
            if new_token is not None and new_token.exists():
                new_token = None
        elif address != "auto":  # Ray applies its own rule to "auto" (a local cluster: the token if there is one)
            prepare_auth(address)
        # address=None must start a new local Ray: ray.init(None) would attach to ANY cluster on the machine
        ray.init(address="local" if address is None else address, **kwargs)
        _INIT_PID = os.getpid()
        if new_token is not None and new_token.exists():  # Ray wrote it with the umask's mode (often 0644)
            try:
                new_token.chmod(0o600)
            except OSError:  # pragma: no cover - not ours to change
                pass
    if loopback_only:
        check_loopback()


def current_address() -> str:
    """The GCS address of the cluster this process is attached to (for processes it starts)."""
    return str(ray.get_runtime_context().gcs_address)


def hosts_cluster() -> bool:
    """Whether this process started the Ray cluster it is attached to (``ray.init()`` without an address).

    Such a cluster lives in this process's tree: it ends when the process does, whatever ``detached`` says.
    """
    node = getattr(ray._private.worker, "_global_node", None)
    return bool(ray.is_initialized() and node is not None and getattr(node, "head", False))


def check_loopback() -> None:
    """Raise :class:`~knitdata.errors.EngineError` unless every alive Ray node is on ``127.0.0.1``."""
    bad = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive") and n["NodeManagerAddress"] != LOOPBACK]
    if bad:
        raise EngineError(
            f"Ray nodes listen on {sorted(set(bad))}, not only on {LOOPBACK}; this engine was asked to stay on "
            "loopback (loopback_only=True). Start Ray with --node-ip-address=127.0.0.1, or pass "
            "loopback_only=False on a real multi-host cluster"
        )


def alive_nodes() -> list[str]:
    """Ids (hex) of the alive Ray nodes, in the order Ray lists them (the head first)."""
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def current_node() -> str:
    """The Ray node id of this process."""
    return ray.get_runtime_context().get_node_id()


# ---------------------------------------------------------------------------------- authentication
def _split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` or ``[v6]:port`` address; ``None`` for anything else (``ray://...``)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return None
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _auth_api() -> Any:
    """``ray._raylet`` if this Ray knows token authentication (2.60 and later), else ``None``."""
    raylet = ray._raylet
    need = ("AuthenticationTokenLoader", "AuthenticationMode", "get_authentication_mode", "Config")
    return raylet if all(hasattr(raylet, n) for n in need) else None


def _default_token_path() -> Any:
    """Where Ray keeps this user's token unless told otherwise (``~/.ray/auth_token``), if Ray has tokens."""
    if _auth_api() is None or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return None
    from pathlib import Path

    return Path.home() / ".ray" / "auth_token"


def _token_mode() -> bool:
    api = _auth_api()
    return api is not None and api.get_authentication_mode() == api.AuthenticationMode.TOKEN


def _token_header() -> tuple[tuple[str, str], ...]:
    """The authorization header of the token Ray finds for this process (empty when there is none)."""
    api = _auth_api()
    loader = api.AuthenticationTokenLoader.instance() if api is not None else None
    if loader is None or not loader.has_token(ignore_auth_mode=True):
        return ()
    return tuple(loader.get_token_for_http_header().items())


def probe_gcs(address: str, *, with_token: bool = False, timeout_s: float = 5.0) -> str:
    """Ask the GCS at ``address`` for the cluster id (one gRPC call): ``"ok"``, ``"unauthenticated"`` (the cluster
    wants a token and got none or a wrong one), ``"unreachable"`` (nothing accepts the connection), or
    ``"unknown"`` (no answer within ``timeout_s``, another error, or this Ray cannot probe)."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # pragma: no cover - every Ray that needs the probe ships them
        return "unknown"
    try:  # TLS as configured for Ray (RAY_USE_TLS), and Ray's own token interceptor in token mode
        from ray._private.grpc_utils import init_grpc_channel

        channel = init_grpc_channel(address)
    except Exception:  # noqa: BLE001 - an older Ray: plain channel
        channel = grpc.insecure_channel(address)
    metadata = _token_header() if with_token and not _token_mode() else ()
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]  # generated, no stubs
        stub.GetClusterId(request, timeout=timeout_s, metadata=metadata)
        return "ok"
    except grpc.RpcError as e:
        code = e.code() if callable(getattr(e, "code", None)) else None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return "unauthenticated"
        if code == grpc.StatusCode.UNAVAILABLE:
            return "unreachable"
        return "unknown"
    finally:
        channel.close()


def _local_cluster_of_this_user(address: str) -> bool:
    """Whether a raylet of this user on this machine serves the cluster at loopback ``address``."""
    hp = _split_address(address)
    if hp is None or not _is_loopback(hp[0]):
        return False
    import psutil

    uid = os.getuid() if hasattr(os, "getuid") else None
    for proc in psutil.process_iter(["cmdline", "uids"]):
        try:
            cmd = proc.info["cmdline"] or []
            if not cmd or not os.path.basename(cmd[0].split(" ")[0]).startswith("raylet"):
                continue
            if uid is not None and proc.info["uids"] is not None and proc.info["uids"].real != uid:
                continue
            for arg in " ".join(cmd).split(" "):
                if arg.startswith("--gcs-address="):
                    other = _split_address(arg.split("=", 1)[1])
                    if other is not None and other[1] == hp[1] and _is_loopback(other[0]):
                        return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def prepare_auth(address: str, *, wait_s: float = 5.0) -> None:
    """Make this (not yet attached) process able to attach to the cluster at ``address``, or fail fast.

    Probes the GCS (:func:`probe_gcs`). A cluster that wants a token while ``RAY_AUTH_MODE`` is unset gets this
    user's token when it is a Ray of this user on this machine (loopback address, a raylet of this user serves
    it): this turns token mode on for the process and its children, as ``ray.init(address="auto")`` does.
    Anything else that cannot work raises at once instead of Ray's 20 s of retries.

    Raises:
        EngineError: Nothing accepts a connection at ``address`` for ``wait_s`` seconds, or the cluster wants a token
            this process cannot present (the message says what to set).
    """
    api = _auth_api()
    if _split_address(address) is None:
        return  # not host:port (a Ray Client address): Ray's own checks apply
    deadline = time.monotonic() + wait_s
    while True:  # a GCS too slow to answer within 5 s is "unknown": Ray's own connection then waits longer
        answer = probe_gcs(address, with_token=_token_mode())
        if answer != "unreachable" or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if answer == "unreachable":
        raise EngineError(
            f"no Ray cluster answers at {address} (waited {wait_s:.0f} s): check the address "
            "(knitdata.ray_address() in the process that created the pipeline) and that this process is alive; "
            "a Ray started by Pipeline(..., engine='ray') ends with the process that created it")
    if answer != "unauthenticated" or api is None:
        return
    mode = os.environ.get(_AUTH_ENV)
    where = ("the cluster's token: RAY_AUTH_TOKEN=<token>, RAY_AUTH_TOKEN_PATH=<file>, or the file "
             "~/.ray/auth_token of the user who started the cluster copied to this user's ~/.ray/auth_token")
    if mode is not None and mode.lower() == "token":
        raise EngineError(
            f"the Ray cluster at {address} refused this process's token (RAY_AUTH_MODE=token is set, but the token "
            f"it finds is not that cluster's); give it {where}. See {_AUTH_DOCS}")
    if mode is not None:
        raise EngineError(
            f"the Ray cluster at {address} wants an authentication token, but RAY_AUTH_MODE={mode} is set in this "
            f"process; unset it (knitdata then uses your token for a Ray of yours on this machine), or set "
            f"RAY_AUTH_MODE=token and {where}. See {_AUTH_DOCS}")
    if not _local_cluster_of_this_user(address):
        raise EngineError(
            f"the Ray cluster at {address} wants an authentication token; knitdata sends your token only to a Ray "
            f"of yours on this machine (a loopback address). On a multi-host cluster set RAY_AUTH_MODE=token in "
            f"every process (before it imports Ray) and {where}. See {_AUTH_DOCS}")
    if not _token_header():
        raise EngineError(
            f"the Ray cluster at {address} wants an authentication token and this user has none (no "
            f"RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token): run this process as the user (and with the "
            f"HOME) that started the cluster, or give it {where}. See {_AUTH_DOCS}")
    if probe_gcs(address, with_token=True) != "ok":
        raise EngineError(
            f"the Ray cluster at {address} refused this user's token ({_token_source()}): it was started with "
            f"another one; run this process with the HOME of the process that started it, or give it {where}. "
            f"See {_AUTH_DOCS}")
    os.environ[_AUTH_ENV] = "token"  # children (DataLoader workers) inherit it, as Ray's own "auto" rule does
    api.Config.initialize("")
    api.AuthenticationTokenLoader.instance().reset_cache()
    _log.info("Ray cluster at %s wants a token: using %s", address, _token_source())


def _token_source() -> str:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    return "~/.ray/auth_token"


# ------------------------------------------------------------------------------------------ host watch
class _HostWatch:
    """Probes the GCS port of the cluster this process attached to (a daemon thread, one per process)."""

    def __init__(self, address: str, host: str, port: int) -> None:
        self.address = address
        self._hp = (host, port)
        self._lock = threading.Lock()
        self._pipelines: dict[str, bool] = {}  # name -> its creator hosts the cluster
        self._attaching = 0  # attaches in progress (the short grace applies)
        self._gone: str | None = None
        self._thread = threading.Thread(target=self._run, name="knitdata-host-watch", daemon=True)
        self._thread.start()

    def add(self, name: str, creator_hosts: bool) -> None:
        with self._lock:
            self._pipelines[name] = self._pipelines.get(name, False) or creator_hosts

    def grace_s(self) -> float:
        with self._lock:
            return HOST_GONE_S if self._attaching or any(self._pipelines.values()) else CLUSTER_GONE_S

    def set_attaching(self, delta: int) -> None:
        with self._lock:
            self._attaching += delta

    def _alive(self) -> bool:
        try:
            with socket.create_connection(self._hp, timeout=1.0):
                return True
        except OSError:
            return False

    def _run(self) -> None:
        down_since: float | None = None
        while True:
            grace = self.grace_s()
            now = time.monotonic()
            if self._alive():
                down_since = None
            elif down_since is None:
                down_since = now
            elif now - down_since >= grace:
                with self._lock:
                    self._gone = self._message(f"has refused connections for {grace:.0f} s")
                return
            time.sleep(min(1.0, grace / 6))

    def confirm(self, wait_s: float) -> EngineError | None:
        """After an actor of the pipeline died: the host-gone error if the GCS refuses a connection within
        ``wait_s`` seconds (it dies with the actors when the creator hosted it, maybe a moment after them), else
        ``None`` (an actor died on a cluster that is up)."""
        deadline = time.monotonic() + wait_s
        while True:
            err = self.error()
            if err is not None:
                return err
            if not self._alive():
                msg = self._message("refuses connections")
                with self._lock:
                    if any(self._pipelines.values()):  # such a GCS never comes back
                        self._gone = msg
                return EngineError(msg)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def _message(self, what: str) -> str:
        names = ", ".join(repr(n) for n in sorted(self._pipelines)) or "?"
        hosted = any(self._pipelines.values())
        if self._attaching:
            what += " while this process was attaching to the pipeline"
        why = (" That Ray was started by the process that created the pipeline (Pipeline(..., engine='ray') without "
               "an address), which has most likely exited or been killed: such a Ray ends with its creator, "
               "detached or not." if hosted else " Its head node, or the process that started it, is down.")
        return (f"the host of knitdata pipeline {names} is gone: the Ray cluster at {self.address} {what}, so this "
                f"process cannot reach the pipeline any more.{why} What to do: "
                "keep the creating process alive until every consumer has finished; or start Ray on its own "
                "(`ray start --head`, see 'Who owns the actors' in the Ray engine guide) and create the pipeline "
                "there with engine_options={'address': ..., 'detached': True}; or restart the job from its last "
                "checkpoint (with a spill_dir, a new pipeline resumes the dead one with engine_options={'resume': "
                "True})")

    def error(self) -> EngineError | None:
        with self._lock:
            return EngineError(self._gone) if self._gone is not None else None


_WATCH: _HostWatch | None = None
_WATCH_LOCK = threading.Lock()
#: Longest single ``ray.get`` of :func:`ray_get` between two looks at the host watch.
_GET_SLICE_S = 0.5


def watch_host(name: str, *, creator_hosts: bool) -> None:
    """Report pipeline ``name``'s host gone (:func:`check_host`, :func:`ray_get`) once the GCS of the cluster this
    process is attached to refuses connections for :data:`HOST_GONE_S` seconds (the pipeline's creator started
    that Ray: ``creator_hosts``) or :data:`CLUSTER_GONE_S` (a cluster of its own). No-op in the process that
    started the cluster (it is the host) and in Ray's own worker processes (tasks, actors: they end with their
    node). Starts one daemon thread per process (one TCP connect per second)."""
    global _WATCH
    if hosts_cluster() or ray._private.worker.global_worker.mode != ray._private.worker.SCRIPT_MODE:
        return
    with _WATCH_LOCK:
        if _WATCH is None:
            address = current_address()
            hp = _split_address(address)
            if hp is None:
                return
            _WATCH = _HostWatch(address, *hp)
        _WATCH.add(name, creator_hosts)


def check_host() -> None:
    """Raise :class:`~knitdata.errors.EngineError` if the host watch (:func:`watch_host`) found the cluster gone."""
    watch = _WATCH
    err = watch.error() if watch is not None else None
    if err is not None:
        raise err


def host_gone_error(wait_s: float = 1.0) -> EngineError | None:
    """Called when an actor of the pipeline died (a lost unit, the coordinator): the host watch's
    :class:`~knitdata.errors.EngineError` if the cluster itself is gone (its GCS refuses a connection within
    ``wait_s`` seconds), to raise instead of the actor's error; ``None`` if it is up or nothing is watched."""
    watch = _WATCH
    return watch.confirm(wait_s) if watch is not None else None


@contextlib.contextmanager
def attaching(name: str) -> Iterator[None]:
    """Attach to pipeline ``name`` inside this block: :func:`watch_host` starts (if this process watches at all)
    and, until the block ends, a GCS that refuses connections for :data:`HOST_GONE_S` seconds counts as gone,
    whoever started the cluster (this process does not know yet). The calls of an attach (:func:`call_watched`,
    :func:`ray_get`) then raise the watch's :class:`~knitdata.errors.EngineError` within seconds of the
    creator's death, instead of Ray terminating the process after 60 s."""
    watch_host(name, creator_hosts=False)
    watch = _WATCH
    if watch is not None:
        watch.set_attaching(+1)
    try:
        yield
    finally:
        if watch is not None:
            watch.set_attaching(-1)


_R = TypeVar("_R")


def call_watched(fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
    """``fn(*args, **kwargs)`` for a Ray call that has no timeout of its own (``ray.get_actor``: Ray retries a GCS
    that is gone for 60 s, then terminates the process): run on a daemon thread, waited for in slices, raising the
    host watch's :class:`~knitdata.errors.EngineError` (:func:`check_host`) as soon as it finds the cluster gone.
    Without a watch (the process hosting the cluster, a Ray worker) it is a plain call. ``fn``'s own exception is
    raised as is."""
    watch = _WATCH
    if watch is None:
        return fn(*args, **kwargs)
    box: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name="knitdata-watched-call", daemon=True).start()
    while not done.wait(_GET_SLICE_S / 2):
        check_host()
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def ray_get(refs: Any, timeout: float | None = None) -> Any:
    """``ray.get(refs, timeout=timeout)`` that raises the host watch's :class:`~knitdata.errors.EngineError`
    within a second of it finding the cluster gone, instead of waiting for Ray to give up (60 s)."""
    watch = _WATCH
    if watch is None:
        return ray.get(refs, timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        check_host()
        left = _GET_SLICE_S if deadline is None else max(0.0, min(_GET_SLICE_S, deadline - time.monotonic()))
        try:
            return ray.get(refs, timeout=left)
        except ray.exceptions.GetTimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise
