"""Ray storage units: one actor per training node, payloads in that node's Ray object store.

A :class:`StorageUnitActor` is pinned to its node with ``NodeAffinitySchedulingStrategy(soft=False)``. A
producer encodes a trajectory with :func:`knitdata.codec.encode_trajectory` (raw buffers + JSON header +
CRC32, never pickle) and sends the record as a ``numpy.uint8`` array; the actor ``ray.put`` s it, so the
object lives in the object store of the unit's node and is owned by the unit. A consumer asks the unit
for the :class:`ray.ObjectRef` s of the ids it needs and ``ray.get`` s them: on the same node that is a
read-only view of shared memory (no copy), decoded with ``decode_trajectory(buf, copy=False)``; on another
node Ray pulls the object once over the network, and :class:`~knitdata.storage.ray_metrics.TransferMeter`
counts those bytes as cross-node (the Ray node holding the object -- its owning unit's node, or Ray's
object locations on request -- against the reader's node).

Memory bound: a unit accounts each payload by ``Trajectory.nbytes`` and accepts a put when
``used + n <= capacity_bytes`` or when it is empty (the bound of :mod:`knitdata.storage.base`). A full unit
answers ``"full"`` and the client waits for room (:meth:`RayStorageUnit.put` with ``timeout``), then raises
:class:`~knitdata.errors.StoreFull`. Object store memory per node must exceed the unit's capacity plus
what consumers on the node pull in from other nodes. With a spill directory, a payload past the capacity
is kept only in the unit's :class:`~knitdata.spill.SpillStore` (webdataset tar shards, bounded on disk)
and reloaded into the object store, for that read only, when a consumer fetches it.

Failure: if a unit's actor dies, every payload it owned is gone from Ray (owner died). Reads then raise
:class:`~knitdata.errors.TrajectoryLostError` naming the lost ids, unless a ``recover`` callback (e.g. a
spill written through, see :class:`SpillRecovery`) returns them.

Importing this module without Ray installed raises :class:`~knitdata.errors.OptionalDependencyError`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from knitdata.errors import (
    ConfigError,
    EngineError,
    KnitdataError,
    OptionalDependencyError,
    StoreFull,
    TrajectoryLostError,
    ValidationError,
)

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as _e:  # pragma: no cover - exercised by monkeypatching in tests
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.storage.ray_unit)") from _e

import numpy as np

from knitdata.codec import decode_trajectory, encode_trajectory
from knitdata.record import Trajectory
from knitdata.storage.base import StorageStats, StorageUnit
from knitdata.storage.ray_metrics import TransferMeter

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
    "alive_nodes",
    "current_node",
    "StorageUnitActor",
    "RayStorageUnit",
    "SpillRecovery",
    "spill_directory",
    "read_records",
]

#: The only address the engine binds to unless told otherwise.
LOOPBACK = "127.0.0.1"
#: Ray namespace of knitdata's named actors (looked up explicitly, whatever namespace the driver uses).
NAMESPACE = "knitdata"

_LOST_ERRORS: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.ActorUnavailableError,
)
_LOST_OR_TIMEOUT: tuple[type[BaseException], ...] = (*_LOST_ERRORS, ray.exceptions.GetTimeoutError)
_MISSING_OR_LOST: tuple[type[BaseException], ...] = (ValueError, *_LOST_ERRORS)  # get_actor: ValueError if none
_INIT_PID: int | None = None
_ON_DISK = "on-disk"  # marks a payload that spilled over: only in the unit's spill store
#: Records up to this many bytes stay in the unit actor's own memory and travel inline in its replies (a
#: ``ray.put`` costs about 1 ms per object whatever its size; Ray inlines replies below 100 KiB).
INLINE_MAX_BYTES = 64 << 10
#: Seconds a storage unit keeps retrying the admission of a put while the coordinator restarts.
ADMIT_TIMEOUT_S = 120.0
_log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- cluster
#: Seconds the GCS of a Ray that the pipeline's creator started itself (``ray.init()``: it lives and dies with
#: that process) may refuse connections before an attached process reports the pipeline's host gone.
HOST_GONE_S = 3.0
#: The same for a cluster that outlives its drivers (``ray start``), whose GCS may be restarted by Ray's fault
#: tolerance; Ray itself terminates an attached process after 60 s without its GCS.
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
        self._gone: str | None = None
        self._thread = threading.Thread(target=self._run, name="knitdata-host-watch", daemon=True)
        self._thread.start()

    def add(self, name: str, creator_hosts: bool) -> None:
        with self._lock:
            self._pipelines[name] = self._pipelines.get(name, False) or creator_hosts

    def grace_s(self) -> float:
        with self._lock:
            return HOST_GONE_S if any(self._pipelines.values()) else CLUSTER_GONE_S

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


# --------------------------------------------------------------------------------------------- spill
def spill_directory(spill_dir: str | os.PathLike[str], unit_id: str) -> str:
    """The :class:`~knitdata.spill.SpillStore` directory of one unit under a shared ``spill_dir``."""
    return os.path.join(os.fspath(spill_dir), unit_id.replace("/", "_"))


class SpillRecovery:
    """Serves the payloads of dead units from their write-through spill shards (thread-safe).

    Each unit with a ``spill_dir`` writes every accepted payload through to a
    :class:`knitdata.spill.SpillStore` (webdataset tar shards) in ``spill_directory(spill_dir, unit_id)``
    and releases it there too. After the unit's actor dies, this opens the store once
    (:meth:`SpillStore.open <knitdata.spill.SpillStore.open>` rebuilds exactly the unreleased samples) and
    returns records by id. Open it in one process only (the coordinator): opening rewrites the release log.

    Args:
        spill_dir: The shared spill directory.
    """

    def __init__(self, spill_dir: str | os.PathLike[str]) -> None:
        self.spill_dir = os.fspath(spill_dir)
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def records(self, unit_id: str, traj_ids: Sequence[str]) -> dict[str, bytes]:
        """Codec records of the ids found in the unit's spill (absent ids are left out)."""
        from knitdata.spill import SpillStore

        with self._lock:
            store = self._stores.get(unit_id)
            if store is None:
                directory = spill_directory(self.spill_dir, unit_id)
                if not os.path.isdir(directory):
                    return {}
                store = self._stores[unit_id] = SpillStore.open(directory, repair=False)
            out: dict[str, bytes] = {}
            for tid in traj_ids:
                if tid in store:
                    out[tid] = bytes(encode_trajectory(store.get(tid)))
            return out

    def close(self) -> None:
        """Close the opened stores."""
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()


# ----------------------------------------------------------------------------------------- the actor
class _UnitState:
    """The unit's bookkeeping (plain Python; the actor wraps it)."""

    def __init__(self, unit_id: str, capacity_bytes: int, spill_dir: str | None, node_name: str | None,
                 spill_bytes: int | None = None, resume: bool = False) -> None:
        self.unit_id = unit_id
        self.node_name = node_name
        self.capacity_bytes = capacity_bytes
        self.node = current_node()
        self.spill: Any = None
        if spill_dir:
            from knitdata.spill import SpillStore

            max_bytes = spill_bytes if spill_bytes is not None else 4 * capacity_bytes + (64 << 20)
            directory = spill_directory(spill_dir, unit_id)
            if resume and os.path.isdir(directory) and os.listdir(directory):
                # a whole-job restart: the unreleased payloads of the previous run, served from disk
                self.spill = SpillStore.open(directory, max_bytes=max(max_bytes, 1 << 30))
            else:
                self.spill = SpillStore(directory, max_bytes=max_bytes)
        # id -> (ObjectRef | inline numpy record | _ON_DISK | None while being put, accounted memory bytes,
        # record bytes)
        self.items: dict[str, tuple[Any, int, int]] = {}
        if resume and self.spill is not None:
            for tid in self.spill.ids():
                self.items[tid] = (_ON_DISK, 0, 0)
        self.cond = threading.Condition()
        self.used = self.high = 0
        self.counters = dict.fromkeys(
            ("puts", "rejected_puts", "gets", "get_requests", "bytes_fetched", "releases", "written_through",
             "spilled_over", "reloaded"), 0
        )
        self.put_wait_s = 0.0
        self.closed = False

    def fits(self, n: int) -> bool:
        return self.used + n <= self.capacity_bytes or self.used == 0


# ray's stubs omit the actor options max_concurrency and concurrency_groups
@ray.remote(num_cpus=0, max_concurrency=32, concurrency_groups={"wait": 64})  # type: ignore[call-overload]
class StorageUnitActor:
    """The storage unit of one node (a threaded Ray actor; every method is short or bounded).

    Producers waiting for room (:meth:`wait_room`, at most 0.5 s per call) run in their own concurrency
    group, so they never hold up reads and releases.

    Create it through :meth:`RayStorageUnit.create`, which pins it to its node.
    """

    def __init__(self, unit_id: str, capacity_bytes: int, spill_dir: str | None = None,
                 node_name: str | None = None, spill_bytes: int | None = None, resume: bool = False) -> None:
        self._s = _UnitState(unit_id, capacity_bytes, spill_dir, node_name, spill_bytes, resume)
        self._control: Any = None  # the coordinator, set by set_control
        # group commit of the puts' admission calls (see _admit)
        self._gc: dict[str, Any] = {"cond": threading.Condition(), "queue": [], "busy": False, "calls": 0, "puts": 0}

    def info(self) -> dict[str, Any]:
        """``unit_id``, ``node`` (Ray node id), ``node_name``, ``capacity_bytes``, ``pid``, ``spill``."""
        s = self._s
        return {"unit_id": s.unit_id, "node": s.node, "node_name": s.node_name or s.node,
                "capacity_bytes": s.capacity_bytes, "pid": os.getpid(),
                "spill": s.spill.directory if s.spill else None}

    def put(self, traj_id: str, record: np.ndarray, nbytes: int) -> str:
        """Store one record; returns ``"ok"``, ``"full"``, ``"dup"`` or ``"closed"`` (never blocks).

        With a spill store every record is written through to it; one that does not fit in memory stays on
        disk only (spill-over) and is reloaded into the object store when it is fetched. ``"full"`` then
        means the spill store is full too.
        """
        s = self._s
        with s.cond:
            if s.closed:
                return "closed"
            if traj_id in s.items:
                return "dup"
            in_memory = s.fits(nbytes)
            if not in_memory and s.spill is None:
                return "full"
            accounted = nbytes if in_memory else 0
            s.used += accounted  # reserve before the copy so concurrent puts respect the bound
            s.high = max(s.high, s.used)
            s.items[traj_id] = (None, accounted, int(record.nbytes))

        def undo() -> None:
            with s.cond:
                s.items.pop(traj_id, None)
                s.used -= accounted
                s.cond.notify_all()

        try:
            if s.spill is not None:  # write-through, so a dead unit's payloads stay recoverable
                s.spill.put(decode_trajectory(record.data, copy=False))
            if not in_memory:
                ref: Any = _ON_DISK
            elif record.nbytes <= INLINE_MAX_BYTES:  # small: a copy in this actor's memory, sent inline on reads
                ref = np.array(record, dtype=np.uint8, copy=True)
                ref.setflags(write=False)
            else:  # a copy into this node's object store, owned by this actor
                ref = ray.put(record)
        except StoreFull:
            undo()
            return "full"
        except BaseException:
            undo()
            raise
        with s.cond:
            s.items[traj_id] = (ref, accounted, int(record.nbytes))
            s.counters["puts"] += 1
            s.counters["written_through"] += s.spill is not None
            s.counters["spilled_over"] += not in_memory
        return "ok"

    def put_batch(self, items: list[tuple[str, np.ndarray, int]]) -> list[str]:
        """:meth:`put` for several records in one call, in order; stops at the first one that is not ``"ok"``.

        Returns:
            One status per record stored or refused (shorter than ``items`` after a refusal).
        """
        out: list[str] = []
        for traj_id, record, nbytes in items:
            status = self.put(traj_id, record, nbytes)
            out.append(status)
            if status != "ok":
                break
        return out

    def set_control(self, control: Any) -> None:
        """The coordinator actor handle, which :meth:`put_admit` calls (set by the coordinator as it starts)."""
        self._control = control

    def put_admit(self, recs: list[tuple[str, np.ndarray, int]], items: list[Any]) -> dict[str, Any]:
        """The one-round-trip put: store the records that fit now, then admit them with one coordinator call.

        See :meth:`knitdata.storage.base.StorageUnit.put_admit`. Records the coordinator refused are dropped.

        Returns:
            ``{"stored": n, "status": "ok" | "full" | "dup" | "closed", "index": position of the first record not
            stored, "admit": the coordinator's answer or None}``; after ``"dup"`` or ``"closed"`` nothing of the
            batch is kept.
        """
        statuses = self.put_batch(recs)
        status = statuses[-1] if statuses else "ok"
        n = len(statuses) - (status != "ok")
        ids = [r[0] for r in recs[:n]]
        if status in ("dup", "closed"):
            self.release(ids)
            return {"stored": 0, "status": status, "index": n, "admit": None}
        if n == 0:
            return {"stored": 0, "status": status, "index": 0, "admit": None}
        try:
            ans = self._admit(items[:n])
        except BaseException:
            self.release(ids)
            raise
        refused = [tid for tid, a in zip(ids, ans["accepted"]) if a is None]
        if refused:
            self.release(refused)
        return {"stored": n, "status": status, "index": n, "admit": ans}

    def _admit(self, items: list[Any]) -> dict[str, Any]:
        """Admit one put's items; concurrent puts share one coordinator call (a group commit)."""
        gc = self._gc
        box: dict[str, Any] = {}
        with gc["cond"]:
            gc["queue"].append((items, box))
            while not box and gc["busy"]:
                gc["cond"].wait()
            if box:  # another put's call carried this one
                return self._answer(box)
            batch, gc["queue"] = gc["queue"], []
            gc["busy"] = True
        try:
            answers = self._call_admit([b[0] for b in batch])
            for (_it, bx), ans in zip(batch, answers):
                bx["ans"] = ans
        except BaseException as e:  # noqa: BLE001 - handed to every put of the call
            for _it, bx in batch:
                bx["err"] = e
        finally:
            with gc["cond"]:
                gc["busy"] = False
                gc["calls"] += 1
                gc["puts"] += len(batch)
                gc["cond"].notify_all()
        return self._answer(box)

    @staticmethod
    def _answer(box: Mapping[str, Any]) -> dict[str, Any]:
        if "err" in box:
            raise box["err"]
        return dict(box["ans"])

    def _call_admit(self, batches: list[Any]) -> list[dict[str, Any]]:
        control = self._control
        if control is None:
            raise EngineError(f"storage unit {self._s.unit_id!r} has no coordinator yet; retry the put")
        deadline = time.monotonic() + ADMIT_TIMEOUT_S
        while True:  # a restarting coordinator (journaled) answers a retried call as the first one
            try:
                if len(batches) == 1:
                    return [ray.get(control.admit_many.remote(self._s.unit_id, batches[0]),
                                    timeout=max(0.1, deadline - time.monotonic()))]
                return list(ray.get(control.admit_batches.remote(self._s.unit_id, batches),
                                    timeout=max(0.1, deadline - time.monotonic())))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def admit_stats(self) -> dict[str, int]:
        """``{"calls", "puts"}``: coordinator calls made for puts, and puts they carried (group commits)."""
        gc = self._gc
        with gc["cond"]:
            return {"calls": gc["calls"], "puts": gc["puts"]}

    @ray.method(concurrency_group="wait")
    def wait_room(self, nbytes: int, max_wait_s: float) -> bool:
        """Wait up to ``max_wait_s`` until ``nbytes`` fit; returns whether they fit now."""
        s = self._s
        t0 = time.perf_counter()
        with s.cond:
            s.cond.wait_for(lambda: s.fits(nbytes) or s.closed, timeout=max(0.0, max_wait_s))
            s.put_wait_s += time.perf_counter() - t0
            return s.fits(nbytes) and not s.closed

    def count_rejected(self) -> None:
        """Count one put that gave up (``StoreFull`` on the client)."""
        with self._s.cond:
            self._s.counters["rejected_puts"] += 1

    def refs(self, ids: list[str]) -> tuple[list[Any], list[str]]:
        """Return ``([[ref or inline record, record bytes] per held id], [missing ids])`` (refs nested, so not
        resolved; records of at most :data:`INLINE_MAX_BYTES` come inline as ``numpy.uint8`` arrays)."""
        s = self._s
        out: list[Any] = []
        missing: list[str] = []
        on_disk: list[int] = []
        with s.cond:
            s.counters["get_requests"] += 1
            for tid in ids:
                item = s.items.get(tid)
                if item is None or item[0] is None:
                    missing.append(tid)
                    out.append(None)
                else:
                    if isinstance(item[0], str):  # _ON_DISK (compared by value: the string may come unpickled)
                        on_disk.append(len(out))
                    out.append([item[0], item[2]])
                    s.counters["gets"] += 1
                    s.counters["bytes_fetched"] += item[2]
        for k in on_disk:  # spilled over: reload into this node's object store for this read only
            rec = encode_trajectory(s.spill.get(ids[k]))
            out[k] = [ray.put(np.frombuffer(rec, dtype=np.uint8)), len(rec)]
            with s.cond:
                s.counters["reloaded"] += 1
        return out, missing

    def release(self, ids: list[str]) -> int:
        """Drop payloads (idempotent); returns the accounted bytes freed."""
        s = self._s
        freed = 0
        dropped: list[str] = []
        with s.cond:
            for tid in ids:
                item = s.items.get(tid)
                if item is None or item[0] is None:
                    continue
                del s.items[tid]
                freed += item[1]
                dropped.append(tid)
            s.used -= freed
            s.counters["releases"] += len(dropped)
            s.cond.notify_all()
        if s.spill is not None:
            for tid in dropped:
                s.spill.release(tid)
        return freed

    def contains(self, traj_id: str) -> bool:
        """Whether the unit holds ``traj_id``."""
        with self._s.cond:
            item = self._s.items.get(traj_id)
            return item is not None and item[0] is not None

    def spill_stats(self) -> dict[str, int]:
        """``written_through``, ``spilled_over`` (puts kept on disk only) and ``reloaded`` counts."""
        with self._s.cond:
            return {k: self._s.counters[k] for k in ("written_through", "spilled_over", "reloaded")}

    def stats(self) -> dict[str, Any]:
        """Counters as a JSON-serializable dict (fields of :class:`~knitdata.storage.base.StorageStats`)."""
        s = self._s
        with s.cond:
            return {"unit_id": s.unit_id, "node": s.node_name or s.node, "capacity_bytes": s.capacity_bytes, "used_bytes": s.used,
                    "high_water_bytes": s.high, "num_items": len(s.items), "puts": s.counters["puts"],
                    "rejected_puts": s.counters["rejected_puts"], "put_wait_s": s.put_wait_s,
                    "gets": s.counters["gets"], "get_requests": s.counters["get_requests"],
                    "bytes_fetched": s.counters["bytes_fetched"], "releases": s.counters["releases"]}

    def close(self) -> None:
        """Refuse further puts and wake waiting producers."""
        with self._s.cond:
            self._s.closed = True
            self._s.cond.notify_all()


# ---------------------------------------------------------------------------------------- the client
@dataclass
class _Handle:
    actor: Any
    unit_id: str
    node: str
    node_name: str
    capacity_bytes: int
    spill: str | None

    @classmethod
    def from_info(cls, actor: Any, info: Mapping[str, Any]) -> _Handle:
        return cls(actor, info["unit_id"], info["node"], info["node_name"], int(info["capacity_bytes"]), info["spill"])


def _knitdata_cause(e: BaseException) -> BaseException:
    """The ``KnitdataError`` a Ray task error wraps (through nested actor calls), else the error itself."""
    seen = 0
    cur: Any = e
    while isinstance(cur, ray.exceptions.RayTaskError) and seen < 8:
        cause = getattr(cur, "cause", None)
        if cause is None:
            try:
                cause = cur.as_instanceof_cause()
            except Exception:  # noqa: BLE001 - not reconstructible
                break
            if cause is cur:
                break
        cur = cause
        seen += 1
    return cur if isinstance(cur, KnitdataError) else e


def _as_record_array(record: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(record, np.ndarray):
        return record.reshape(-1).view(np.uint8)
    return np.frombuffer(record, dtype=np.uint8)


class RayStorageUnit(StorageUnit):
    """Client of one :class:`StorageUnitActor` (usable from any process attached to the cluster).

    Implements :class:`knitdata.storage.base.StorageUnit`; a process that has no handle attaches by name
    with :meth:`attach`. ``node`` is the node's name in the consumer layout (what the planner matches
    against ranks; the Ray node id when none was given), ``ray_node`` the Ray node id (what the transfer
    counters compare the reader's node with). Reads go through :func:`read_records` (one request per unit, cross-node bytes
    counted).

    Args:
        handle: The actor handle and its description (from :meth:`create` / :meth:`attach`).
        meter: Where this client counts put bytes (a fresh meter when ``None``).
        placement: Placement name the put counters are filed under.
    """

    def __init__(self, handle: _Handle, *, meter: TransferMeter | None = None, placement: str = "") -> None:
        self._h = handle
        self.unit_id = handle.unit_id
        self.node = handle.node_name
        self.ray_node = handle.node
        self.capacity_bytes = handle.capacity_bytes
        self.meter = meter if meter is not None else TransferMeter()
        self.placement = placement

    @staticmethod
    def actor_name(prefix: str, unit_id: str) -> str:
        """Name of a unit's actor in :data:`NAMESPACE`."""
        return f"{prefix}/unit/{unit_id}"

    @classmethod
    def create(
        cls,
        unit_id: str,
        node: str,
        capacity_bytes: int,
        *,
        prefix: str = "knitdata",
        spill_dir: str | os.PathLike[str] | None = None,
        node_name: str | None = None,
        spill_bytes: int | None = None,
        timeout_s: float = 60.0,
        **kwargs: Any,
    ) -> RayStorageUnit:
        """Start a unit's actor on Ray node ``node`` (hard node affinity) and wait until it is up.

        Args:
            unit_id: Unit id (recorded as ``TrajectoryMeta.location``).
            node: Ray node id (hex) the actor must run on.
            capacity_bytes: Capacity in bytes.
            prefix: Name prefix of the actor (one pipeline's actors share it).
            node_name: The node's name in the consumer layout (default: the Ray node id).
            spill_bytes: Disk bound of the spill store (default ``4 * capacity_bytes + 64 MiB``).
            spill_dir: Write accepted payloads through to a :class:`~knitdata.spill.SpillStore` under this shared
                directory (recovery after the unit dies, see :class:`SpillRecovery`); payloads past the
                memory capacity then stay on disk only and are reloaded on fetch.
            timeout_s: How long to wait for the actor to start.
            **kwargs: Passed to :class:`RayStorageUnit`.

        Raises:
            ConfigError: On a bad capacity. EngineError: If the actor did not start in time.
        """
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        actor = StorageUnitActor.options(  # type: ignore[attr-defined]  # an ActorClass (ray's stubs keep the class)
            name=cls.actor_name(prefix, unit_id),
            namespace=NAMESPACE,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            lifetime="detached" if kwargs.pop("detached", False) else None,
        ).remote(unit_id, capacity_bytes, os.fspath(spill_dir) if spill_dir is not None else None, node_name,
                 spill_bytes)
        try:
            info = ray.get(actor.info.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            ray.kill(actor)
            raise EngineError(f"storage unit {unit_id!r} did not start on node {node[:12]} within {timeout_s} s; "
                              "give the node logical CPUs / check that it is alive") from e
        if info["node"] != node:  # hard affinity makes this an invariant
            raise EngineError(f"storage unit {unit_id!r} started on node {info['node']}, not {node}")
        return cls(_Handle.from_info(actor, info), **kwargs)

    @classmethod
    def create_many(
        cls,
        units: Sequence[tuple[str, str]],
        capacity_bytes: int,
        *,
        prefix: str = "knitdata",
        spill_dir: str | os.PathLike[str] | None = None,
        spill_bytes: int | None = None,
        timeout_s: float = 120.0,
        detached: bool = False,
        resume: bool = False,
        **kwargs: Any,
    ) -> dict[str, RayStorageUnit]:
        """Start several units at once (in parallel): ``units`` are ``(unit id = layout node name, Ray node id)``.

        ``detached``: the actors outlive the creating process (end them with :meth:`kill`). ``resume``: a unit
        whose spill directory holds a previous run's shards serves their unreleased payloads (from disk).
        """
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        actors = [
            StorageUnitActor.options(  # type: ignore[attr-defined]  # an ActorClass (ray's stubs keep the class)
                name=cls.actor_name(prefix, uid), namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                lifetime="detached" if detached else None,
            ).remote(uid, capacity_bytes, os.fspath(spill_dir) if spill_dir is not None else None, uid, spill_bytes,
                     resume)
            for uid, node in units
        ]
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            for a in actors:
                ray.kill(a)
            raise EngineError(f"storage units did not start within {timeout_s} s; check that the nodes are alive") from e
        out = {}
        for (uid, node), actor, info in zip(units, actors, infos):
            if info["node"] != node:  # hard affinity makes this an invariant
                raise EngineError(f"storage unit {uid!r} started on node {info['node']}, not {node}")
            out[uid] = cls(_Handle.from_info(actor, info), **kwargs)
        return out

    @classmethod
    def attach(cls, unit_id: str, *, prefix: str = "knitdata", timeout_s: float = 30.0, **kwargs: Any) -> RayStorageUnit:
        """Attach to a running unit by id (from any process attached to the cluster)."""
        try:
            actor = ray.get_actor(cls.actor_name(prefix, unit_id), namespace=NAMESPACE)
            info = ray_get(actor.info.remote(), timeout=timeout_s)
        except _MISSING_OR_LOST as e:
            raise EngineError(f"no storage unit {unit_id!r} (prefix {prefix!r}) is running in this Ray cluster") from e
        return cls(_Handle.from_info(actor, info), **kwargs)

    @classmethod
    def from_handle(cls, actor: Any, desc: Mapping[str, Any], **kwargs: Any) -> RayStorageUnit:
        """Wrap an actor handle and its :meth:`handle_info` (no call to the actor: works for a dead unit)."""
        return cls(_Handle.from_info(actor, desc), **kwargs)

    def handle_info(self) -> dict[str, Any]:
        """The unit's description (as its actor's ``info()``), for :meth:`from_handle`."""
        h = self._h
        return {"unit_id": h.unit_id, "node": h.node, "node_name": h.node_name, "capacity_bytes": h.capacity_bytes,
                "spill": h.spill}

    @property
    def actor(self) -> Any:
        """The Ray actor handle."""
        return self._h.actor

    @property
    def spill_dir(self) -> str | None:
        """The write-through directory, if any."""
        return self._h.spill

    # ---------------------------------------------------------------------------- StorageUnit API
    def put(self, traj: Trajectory, *, timeout: float | None = None) -> int:
        """Encode and store ``traj``; see :meth:`put_record`."""
        return self.put_record(traj.id, encode_trajectory(traj), int(traj.nbytes), timeout=timeout)

    def put_many(self, trajs: Sequence[Trajectory], *, timeout: float | None = None) -> int:
        """Store several payloads with one actor call in the common case (room for all of them).

        Stops at the first payload that does not fit at once and stores the rest one by one, waiting up to
        ``timeout`` each (:meth:`put_record`).

        Returns:
            How many were stored: all of them, unless an exception says otherwise (its ``stored`` attribute is
            the number stored before it, in order).
        """
        recs = [(t.id, _as_record_array(encode_trajectory(t)), int(t.nbytes)) for t in trajs]
        try:
            statuses = ray_get(self._h.actor.put_batch.remote(recs))
        except _LOST_ERRORS as e:
            err: KnitdataError = host_gone_error() or TrajectoryLostError(
                f"storage unit {self.unit_id!r} is dead; the puts were not stored", trajectory_ids=[r[0] for r in recs])
            err.stored = 0  # type: ignore[attr-defined]
            raise err from e
        ok = 0
        for (_tid, arr, _n), st in zip(recs, statuses):
            if st != "ok":
                break
            self.meter.record_put(arr.nbytes, cross=current_node() != self.ray_node, placement=self.placement)
            ok += 1
        for tid, arr, n in recs[ok:]:
            try:
                self.put_record(tid, arr, n, timeout=timeout)
            except BaseException as e:
                e.stored = ok  # type: ignore[attr-defined]
                raise
            ok += 1
        return ok

    def put_admit(self, trajs: Sequence[Trajectory], items: Sequence[Sequence[Any]],
                  admit: Callable[[str, list[Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The one-round-trip put (see :meth:`StorageUnit.put_admit`): the unit's actor stores the records that
        fit now and makes the admission call to the coordinator itself; ``admit`` is unused.

        Raises:
            ValidationError: An id is already held by this unit. EngineError: The unit is closed.
            TrajectoryLostError: The unit's actor is dead. The coordinator's error (a ``KnitdataError``).
        """
        recs = [(t.id, _as_record_array(encode_trajectory(t)), int(t.nbytes)) for t in trajs]
        try:
            res = ray_get(self._h.actor.put_admit.remote(recs, [list(x) for x in items]))
        except ray.exceptions.RayTaskError as e:
            raise _knitdata_cause(e) from None
        except _LOST_ERRORS as e:
            raise host_gone_error() or TrajectoryLostError(
                f"storage unit {self.unit_id!r} is dead; the puts were not stored",
                trajectory_ids=[r[0] for r in recs]) from e
        if res["status"] == "dup":
            raise ValidationError(f"already held by storage unit {self.unit_id!r}", trajectory_id=recs[res["index"]][0],
                                  field="id")
        if res["status"] == "closed":
            raise EngineError(f"storage unit {self.unit_id!r} is closed; create a new pipeline to put more")
        cross = current_node() != self.ray_node
        for _tid, arr, _n in recs[:res["stored"]]:
            self.meter.record_put(arr.nbytes, cross=cross, placement=self.placement)
        return {"stored": int(res["stored"]), "admit": res["admit"]}

    def put_record(self, traj_id: str, record: Any, nbytes: int, *, timeout: float | None = None) -> int:
        """Store one codec record, waiting up to ``timeout`` seconds for room.

        Args:
            traj_id: The trajectory id.
            record: The codec record (bytes-like or ``numpy.uint8`` array).
            nbytes: Bytes to account (``Trajectory.nbytes``).
            timeout: Seconds to wait for room; ``0`` raises at once; ``None`` waits without limit.

        Returns:
            ``nbytes``.

        Raises:
            StoreFull: No room within ``timeout``. ValidationError: The id is already held.
            EngineError: The unit is closed. TrajectoryLostError: The unit's actor is dead.
        """
        arr = _as_record_array(record)
        arg: Any = ray.put(arr) if arr.nbytes > 100_000 else arr  # put once locally, reuse on retries
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        try:
            while True:
                status = ray_get(self._h.actor.put.remote(traj_id, arg, int(nbytes)))
                if status == "ok":
                    self.meter.record_put(arr.nbytes, cross=current_node() != self.ray_node, placement=self.placement)
                    return int(nbytes)
                if status == "dup":
                    raise ValidationError(f"already held by storage unit {self.unit_id!r}", trajectory_id=traj_id,
                                          field="id")
                if status == "closed":
                    raise EngineError(f"storage unit {self.unit_id!r} is closed; create a new pipeline to put more")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._h.actor.count_rejected.remote()
                    raise StoreFull(
                        f"storage unit {self.unit_id!r} is full (capacity {self.capacity_bytes} bytes, trajectory "
                        f"{traj_id!r} needs {nbytes}) and nothing was released within {timeout} s; raise "
                        "capacity_bytes or let consumers commit (release) faster"
                    )
                wait = 0.5 if remaining is None else min(0.5, remaining)
                ray_get(self._h.actor.wait_room.remote(int(nbytes), wait))
        except _LOST_ERRORS as e:
            raise host_gone_error() or TrajectoryLostError(f"storage unit {self.unit_id!r} is dead; the put was not "
                                                           "stored", trajectory_ids=[traj_id]) from e

    def get(self, ids: Sequence[str]) -> list[Trajectory]:
        """Return the trajectories of ``ids`` in order, decoded zero-copy (read-only tensors on this node)."""
        return [decode_trajectory(r, copy=False) for r in self.get_records(ids)]

    def get_records(self, ids: Sequence[str]) -> list[Any]:
        """Return the codec records of ``ids`` (read-only ``numpy.uint8`` views of the object store)."""
        return read_records([(tid, self) for tid in ids], meter=self.meter, placement=self.placement)

    def release(self, ids: Sequence[str]) -> int:
        """Drop payloads (idempotent); returns the bytes freed (0 if the unit is dead)."""
        try:
            return int(ray_get(self._h.actor.release.remote(list(ids))))
        except _LOST_ERRORS:
            return 0

    def release_async(self, ids: Sequence[str]) -> Any:
        """Like :meth:`release`, without waiting (returns the Ray future)."""
        return self._h.actor.release.remote(list(ids))

    def contains(self, traj_id: str) -> bool:
        """Whether the unit holds ``traj_id``."""
        return bool(ray_get(self._h.actor.contains.remote(traj_id)))

    def stats(self) -> StorageStats:
        """The unit's counters."""
        return StorageStats(**ray_get(self._h.actor.stats.remote()))

    def close(self) -> None:
        """Refuse further puts."""
        try:
            ray_get(self._h.actor.close.remote())
        except _LOST_ERRORS:
            pass

    def kill(self) -> None:
        """Kill the unit's actor (its payloads are lost; used for shutdown and failure tests)."""
        ray.kill(self._h.actor, no_restart=True)

    def __repr__(self) -> str:
        return f"RayStorageUnit({self.unit_id!r}, node={self.node!r}, capacity_bytes={self.capacity_bytes})"


# -------------------------------------------------------------------------------------------- reads
def read_records(
    items: Sequence[tuple[str, RayStorageUnit]],
    *,
    meter: TransferMeter | None = None,
    mode: str = "sample",
    placement: str = "",
    step: int = -1,
    recover: Callable[[RayStorageUnit, list[str]], Mapping[str, Any]] | None = None,
    timeout_s: float = 120.0,
    locate: str = "owner",
) -> list[Any]:
    """Fetch the records of ``(trajectory id, unit)`` pairs in one request per unit, in order.

    Bytes are counted on ``meter`` as local or cross-node from Ray's object locations against this
    process's node, before the ``ray.get`` that moves them.

    Args:
        items: ``(id, unit)`` pairs.
        meter: Counters to update (none when ``None``).
        mode: Fetch mode the bytes are filed under.
        placement: Placement the bytes are filed under.
        step: Mini-batch step the bytes are filed under.
        recover: Called with ``(unit, ids)`` for ids a dead or forgetful unit cannot serve; returns the
            records it found (e.g. :meth:`SpillRecovery.records`). Recovered bytes count as cross-node reads
            of shared storage only if they come from another node, which a callback cannot know: they
            are counted under mode ``"<mode>+recovered"`` as cross-node.
        timeout_s: Bound on each Ray call (a dead node never hangs the reader).
        locate: Where an object is, for the counters: ``"owner"`` (default): the Ray node of the unit that
            owns it, where its primary copy lives (exact as long as each payload is read once per node, which
            is how the planner hands them out); ``"ray"``: ``ray.experimental.get_object_locations``, which
            also sees secondary copies pulled earlier by another reader on this node. Ray 2.60 aborted a
            consumer process once ("std::future_error: Promise already satisfied" in
            ``GetLocationFromOwner``) under ``"ray"`` on this 2-core machine, hence the default.

    Returns:
        Records in the order of ``items`` (read-only ``numpy.uint8`` arrays, or ``bytes`` if recovered).

    Raises:
        TrajectoryLostError: Naming every id that could be neither read nor recovered.
    """
    by_unit: dict[str, tuple[RayStorageUnit, list[int]]] = {}
    for idx, (_tid, unit) in enumerate(items):
        by_unit.setdefault(unit.unit_id, (unit, []))[1].append(idx)
    futures = {uid: unit.actor.refs.remote([items[p][0] for p in pos]) for uid, (unit, pos) in by_unit.items()}
    out: list[Any] = [None] * len(items)
    lost: dict[str, list[int]] = {}  # unit id -> positions
    refs: list[Any] = []
    ref_pos: list[int] = []
    ref_len: list[int] = []
    for uid, fut in futures.items():
        unit, pos = by_unit[uid]
        try:
            answer, _missing = ray_get(fut, timeout=timeout_s)
        except _LOST_OR_TIMEOUT:
            lost.setdefault(uid, []).extend(pos)
            continue
        for p, a in zip(pos, answer):
            if a is None:
                lost.setdefault(uid, []).append(p)
            elif isinstance(a[0], np.ndarray):  # a small record, inline in the unit's reply
                out[p] = a[0]
                if meter is not None:
                    meter.record_read(int(a[1]), cross=current_node() != unit.ray_node, mode=mode, placement=placement,
                                      step=step)
            else:
                refs.append(a[0])
                ref_pos.append(p)
                ref_len.append(int(a[1]))
    if refs:
        here = current_node()
        locations: dict[Any, Any] = {}
        if locate == "ray":
            for r in refs:  # one object per call: the narrowest use of the call
                try:
                    locations.update(ray.experimental.get_object_locations([r], timeout_ms=int(timeout_s * 1000)))
                except Exception:  # noqa: BLE001 - owner gone: the gets below find out which ones
                    pass
        elif locate != "owner":
            raise ConfigError(f"locate must be 'owner' or 'ray', got {locate!r}")
        try:
            values = ray_get(refs, timeout=timeout_s)
        except _LOST_OR_TIMEOUT:
            values = []
            for r in refs:  # find out which ones are gone
                try:
                    values.append(ray_get(r, timeout=timeout_s))
                except _LOST_OR_TIMEOUT:
                    values.append(None)
        for r, p, n, v in zip(refs, ref_pos, ref_len, values):
            if v is None:
                lost.setdefault(items[p][1].unit_id, []).append(p)
                continue
            out[p] = v
            if meter is not None:
                nodes = locations.get(r, {}).get("node_ids") or [items[p][1].ray_node]
                meter.record_read(n, cross=here not in nodes, mode=mode, placement=placement, step=step)
    if lost and recover is not None:
        for uid in list(lost):
            unit = by_unit[uid][0]
            want = [items[p][0] for p in lost[uid]]
            found = recover(unit, want)
            still = []
            for p in lost[uid]:
                rec = found.get(items[p][0])
                if rec is None:
                    still.append(p)
                else:
                    out[p] = rec
                    if meter is not None:
                        meter.record_read(len(rec), cross=True, mode=f"{mode}+recovered", placement=placement,
                                          step=step)
            if still:
                lost[uid] = still
            else:
                del lost[uid]
    if lost:
        gone = host_gone_error()
        if gone is not None:
            raise gone
        ids = [items[p][0] for uid in lost for p in lost[uid]]
        units = sorted(lost)
        raise TrajectoryLostError(
            f"storage unit(s) {units} could not serve these payloads (the unit's actor or node died, or they "
            "were released before this read); enable spill (spill_dir=...) to recover from disk, or restart "
            "from the last checkpoint",
            trajectory_ids=ids,
        )
    return out
