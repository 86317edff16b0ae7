"""The Ray engine's control side: the coordinator actor hosting the control plane, and its client.

:class:`CoordinatorActor` hosts :class:`knitdata.control.ControlPlane`, the very class the embedded engine calls
directly, and owns the pipeline's storage-unit actors. Its control methods are not written out here: one
forwarding method per call of the control surface (:data:`knitdata.control.SURFACE`) is generated onto the
class before ``ray.remote`` sees it (Ray discovers an actor's methods on its class). Calls that may block
(``waits`` in the surface) run in the actor's ``"wait"`` concurrency group, so they never hold up producers and
commits. :class:`RayControl` derives its remote method list, its fire-and-forget calls and each call's wait
bound from the same table.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from knitdata import trace as tracing
from knitdata.control import FIRE_AND_FORGET, SURFACE, ControlCall, ControlPlane
from knitdata.control.journal import Journal
from knitdata.errors import EngineError, KnitdataError, OptionalDependencyError

try:
    import ray
except ImportError as _e:  # pragma: no cover - exercised by monkeypatching in tests
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.engines.ray)") from _e

from knitdata.storage.ray_actor import SpillRecovery
from knitdata.storage.ray_connect import check_host, host_gone_error, ray_get
from knitdata.storage.ray_unit import RayStorageUnit

__all__ = ["CoordinatorActor", "CoordinatorBase", "RayControl", "coordinator_class"]


class CoordinatorBase:
    """The coordinator's own methods: setup, the admission calls it meters, close, and the engine's plumbing.

    Every method takes and returns JSON-like values (metadata only). :func:`coordinator_class` adds one
    forwarding method per other control call.
    """

    def __init__(self, setup: dict[str, Any], unit_handles: dict[str, Any]) -> None:
        self._setup = dict(setup)
        # the units belong to the pipeline's creator, so they outlive a restart of this actor
        self._units = {u: RayStorageUnit.from_handle(actor, desc) for u, (actor, desc) in unit_handles.items()}
        units = self._units
        path = setup.get("journal")
        journal = Journal(path, compact_every=int(setup.get("journal_compact_every", 10_000))) if path else None
        self._plane = ControlPlane(setup["config"], {u: unit.node for u, unit in units.items()},
                                   lambda u, ids, wait: units[u].release(ids) if wait else units[u].release_async(ids),
                                   journal=journal)
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        me = ray.get_runtime_context().current_actor
        calls = [unit.actor.set_control.remote(me) for unit in units.values()]
        try:  # the units call admit_many on this actor (the one-round-trip put); a dead unit is skipped
            ray.get(calls, timeout=30)
        except Exception:  # noqa: BLE001 - a dead unit: its puts fail anyway
            pass
        trace_path = setup.get("trace")
        if trace_path:  # this process's clock is the trace's reference; the units measure their offsets to it
            tracing.start(trace_path, "coordinator")
            try:
                ray.get([unit.actor.start_trace.remote(trace_path) for unit in units.values()], timeout=60)
            except Exception:  # noqa: BLE001 - a dead unit traces nothing
                pass
        if path and os.path.exists(path):
            self._plane.recover(path)  # a restart: the state as of the last journaled call (traced as "restart")
        self._recovery = SpillRecovery(setup["spill_dir"]) if setup.get("spill_dir") else None
        self._admit_lock = threading.Lock()
        self._admit_cpu = {"cpu_s": 0.0, "calls": 0, "trajectories": 0}  # this actor's CPU inside the plane's admits

    # control calls with more to do than forwarding ------------------------------------------------------
    def admit_many(self, unit: str, items: list[Any]) -> dict[str, Any]:
        """See :meth:`knitdata.control.admit.Admission.admit_many` (called by the storage units)."""
        c0 = time.thread_time()
        try:
            return self._plane.admit_many(unit, items)  # type: ignore[no-any-return]
        finally:
            self._count_admit(time.thread_time() - c0, len(items))

    def admit_batches(self, unit: str, batches: list[Any]) -> list[dict[str, Any]]:
        """See :meth:`knitdata.control.admit.Admission.admit_batches` (called by the storage units)."""
        c0 = time.thread_time()
        try:
            return self._plane.admit_batches(unit, batches)  # type: ignore[no-any-return]
        finally:
            self._count_admit(time.thread_time() - c0, sum(map(len, batches)))

    def _count_admit(self, cpu_s: float, trajectories: int) -> None:
        with self._admit_lock:
            self._admit_cpu["cpu_s"] += cpu_s
            self._admit_cpu["calls"] += 1
            self._admit_cpu["trajectories"] += trajectories

    def admit_cpu(self) -> dict[str, Any]:
        """``{"cpu_s", "calls", "trajectories"}`` since this actor started: CPU seconds its threads spent inside the
        plane's admission calls from the units, how many calls, and the trajectories they carried (the rest of
        the actor's CPU is Ray's handling of calls, the consumers' calls and idle work)."""
        with self._admit_lock:
            return dict(self._admit_cpu)

    def close(self) -> dict[str, Any]:
        """See :meth:`knitdata.control.admit.Admission.close`; also closes the units."""
        report: dict[str, Any] = self._plane.close()
        for u in self._units.values():
            u.close()
        return report

    # engine plumbing ---------------------------------------------------------------------------------
    def clock(self) -> float:
        """This actor's trace clock (:func:`knitdata.trace.now_us`): the reference every process's offset is
        measured against."""
        return tracing.now_us()

    def flush_trace(self) -> None:
        """Write the trace events recorded so far by this actor and by the units."""
        if tracing.tracer is not None:
            tracing.tracer.flush()
        try:
            ray.get([u.actor.flush_trace.remote() for u in self._units.values()], timeout=30)
        except Exception:  # noqa: BLE001 - a dead unit
            pass

    def info(self) -> dict[str, Any]:
        """Name, config, units' nodes, spill directory, journal, whether this actor was restarted, and its last
        recovery (``replayed``: journal records replayed after the snapshot; ``snapshot_loaded``)."""
        return {"name": self._setup["name"], "config": self._plane.config, "nodes": self._setup["nodes"],
                "spill_dir": self._setup.get("spill_dir"), "capacity_bytes": self._setup["capacity_bytes"],
                "journal": self._setup.get("journal"), "restarted": self.restarted,
                "replayed": self._plane.replayed,
                "snapshot_loaded": self._plane.snapshot_loaded, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id(),
                "creator_hosts": bool(self._setup.get("creator_hosts")), "trace": self._setup.get("trace")}

    def unit_handles(self) -> dict[str, Any]:
        """``{unit id: [actor handle, description]}`` (handles stay valid after a unit dies: calls then fail)."""
        return {u: [unit.actor, unit.handle_info()] for u, unit in self._units.items()}

    def recover(self, unit_id: str, ids: list[str]) -> dict[str, bytes]:
        """Records of a dead unit's payloads from its spill shards (those found)."""
        if self._recovery is None:
            return {}
        return self._recovery.records(unit_id, ids)

    def recoverable(self, unit_ids: list[str], ids: list[str]) -> list[str]:
        """The ids of ``ids`` found in the spill shards of the (dead) units ``unit_ids``."""
        if self._recovery is None:
            return []
        found: set[str] = set()
        for u in unit_ids:
            found.update(self._recovery.held(u, [t for t in ids if t not in found]))
        return sorted(found)

    def kill_unit(self, unit_id: str) -> None:
        """Kill a unit's actor (failure drills and tests)."""
        self._units[unit_id].kill()

    def shutdown(self) -> None:
        """Close and kill the units."""
        self.close()
        for u in self._units.values():
            try:
                u.kill()
            except Exception:  # noqa: BLE001 - already dead
                pass
        if self._recovery is not None:
            self._recovery.close()


def _actor_forwarder(call: ControlCall) -> Callable[..., Any]:
    """The coordinator's method for ``call``: the same call on its plane (in the ``"wait"`` group if it blocks)."""
    name = call.name

    def forward(self: CoordinatorBase, *args: Any) -> Any:
        return getattr(self._plane, name)(*args)

    forward.__name__ = name
    forward.__qualname__ = f"CoordinatorActor.{name}"
    forward.__doc__ = f"See :meth:`knitdata.control.ControlPlane.{name}`."
    if call.waits is not None:
        return ray.method(concurrency_group="wait")(forward)  # type: ignore[no-any-return]
    return forward


def coordinator_class() -> type:
    """:class:`CoordinatorBase` with one forwarding method per control call it does not define itself."""
    methods = {c.name: _actor_forwarder(c) for c in SURFACE.values() if not hasattr(CoordinatorBase, c.name)}
    cls = type("CoordinatorActor", (CoordinatorBase,), {
        **methods, "__module__": __name__,
        "__doc__": "Hosts the pipeline's :class:`~knitdata.control.ControlPlane` and owns its storage-unit actors "
                   "(:class:`CoordinatorBase`, with a forwarding method per control call)."})
    return cls


# ray's stubs omit the actor options max_concurrency and concurrency_groups
CoordinatorActor = ray.remote(num_cpus=0, max_concurrency=16,  # type: ignore[call-overload]
                              concurrency_groups={"wait": 256})(coordinator_class())


class RayControl:
    """Forwards :class:`~knitdata.control.ControlPlane` calls to the coordinator actor.

    The coordinator's own exception reaches the caller as it was raised there (a ``KnitdataError``). The
    fire-and-forget calls (:data:`knitdata.control.FIRE_AND_FORGET`) return at once; a call that may block
    (``lease``, ``next_entries``) gets its own wait added to the time bound.

    Args:
        actor: The coordinator actor handle.
        name: The pipeline's name (for messages).
        timeout_s: Bound on each call beyond the time the call itself may wait.
    """

    ASYNC: frozenset[str] = FIRE_AND_FORGET
    METHODS: frozenset[str] = frozenset(SURFACE)

    def __init__(self, actor: Any, name: str, timeout_s: float) -> None:
        self._actor = actor
        self._name = name
        self._timeout_s = timeout_s

    def call(self, method: str, *args: Any, wait_s: float = 0.0) -> Any:
        """Call ``method`` on the coordinator and return its result (``wait_s``: time the call may block)."""
        deadline = time.monotonic() + self._timeout_s + wait_s
        while True:
            try:
                return self._call_once(method, args, max(0.1, deadline - time.monotonic()))
            except ray.exceptions.ActorUnavailableError:  # restarting (journaled): retry within the bound
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _call_once(self, method: str, args: Sequence[Any], timeout: float) -> Any:
        check_host()
        fut = getattr(self._actor, method).remote(*args)
        try:
            return ray_get(fut, timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if not isinstance(cause, KnitdataError):
                cause = e.as_instanceof_cause()
            if isinstance(cause, KnitdataError):
                raise cause from None
            raise
        except ray.exceptions.ActorUnavailableError:
            raise
        except ray.exceptions.RayActorError as e:
            gone = host_gone_error()
            if gone is not None:
                raise gone from e
            raise EngineError(
                f"the coordinator of pipeline {self._name!r} is gone: the process that created the pipeline owns it "
                "and has most likely exited (or the coordinator died without a journal). Keep the creator alive until "
                "every consumer has finished, or create the pipeline with engine_options={'detached': True} (and "
                f"'journal_dir' so that Ray restarts a crashed coordinator). Ray said: {e}") from e
        except ray.exceptions.GetTimeoutError as e:
            raise EngineError(f"the coordinator of pipeline {self._name!r} did not answer {method}() within "
                              f"{timeout:.0f} s") from e

    def __getattr__(self, method: str) -> Any:
        call = SURFACE.get(method)
        if call is None:
            raise AttributeError(method)
        if call.fire_and_forget:
            actor_method = getattr(self._actor, method)
            return lambda *a: actor_method.remote(*a) and None

        def remote_call(*a: Any, **kw: Any) -> Any:
            if kw:  # the actor takes positional arguments: bind keywords to their places
                bound = call.signature.bind(*a, **kw)
                bound.apply_defaults()
                a = bound.args
            return self.call(method, *a, wait_s=call.wait_of(a))

        return remote_call
