"""The Ray engine's control side: the coordinator actor hosting the control plane, and its client.

:class:`Coordinator` (the actor class :data:`CoordinatorActor`) hosts :class:`knitdata.control.ControlPlane`, the
very class the embedded engine calls directly, and owns the pipeline's storage-unit actors. It takes every
control call through two methods, :meth:`Coordinator.call` and (for calls that may block, ``waits`` in the
surface) :meth:`Coordinator.call_waiting`, which runs in the actor's ``"wait"`` concurrency group so that it never
holds up producers and commits. The engine's own plumbing (information, unit handles, recovery from spill,
drills, traces) is a part of its own, :class:`Plumbing`, declared like the plane's parts.

:class:`RayControl` is the client: it has the plane's parts (:class:`~knitdata.control.plane.Control`) and the
plumbing as proxies of the same types (:func:`~knitdata.control.surface.remote_part`), so a call is written and
type-checked as in process (``control.positions.commit(rank, upto, replica)``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from knitdata.control import ControlCall, ControlPlane
from knitdata.control.admit import Admission
from knitdata.control.journal import Journal
from knitdata.control.leases import Leases
from knitdata.control.ledger import Ledger
from knitdata.control.positions import Positions
from knitdata.control.records import Admitted
from knitdata.control.reporting import Reporting
from knitdata.control.reshape import Reshaping
from knitdata.control.surface import CONTROL_CALLS, control_call, control_part, positional, remote_part
from knitdata.errors import EngineError, KnitdataError, OptionalDependencyError
from knitdata.observe import trace as tracing

try:
    import ray
except ImportError as _e:  # pragma: no cover - exercised by monkeypatching in tests
    raise OptionalDependencyError("ray", "ray", "the Ray engine (knitdata.engines.ray.engine)") from _e

from knitdata.engines.ray.connect import host_gone_error, ray_get
from knitdata.engines.ray.unit import RayStorageUnit
from knitdata.engines.ray.unit_actor import SpillRecovery

__all__ = ["Coordinator", "CoordinatorActor", "Plumbing", "RayControl", "AdmitMeter"]


class AdmitMeter:
    """CPU seconds the coordinator's threads spent inside the plane's admission calls from the units."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._d = {"cpu_s": 0.0, "calls": 0, "trajectories": 0}

    def add(self, cpu_s: float, trajectories: int) -> None:
        """Count one admission call."""
        with self._lock:
            self._d["cpu_s"] += cpu_s
            self._d["calls"] += 1
            self._d["trajectories"] += trajectories

    def to_dict(self) -> dict[str, Any]:
        """``{"cpu_s", "calls", "trajectories"}`` so far."""
        with self._lock:
            return dict(self._d)


@control_part("plumbing")
class Plumbing:
    """The Ray engine's plumbing on the coordinator: what the engine needs besides the control plane.

    Every call takes and returns JSON-like values (or actor handles).

    Args:
        setup: The coordinator's setup (name, config, nodes, spill directory, journal, ...).
        units: The storage units by id.
        plane: The control plane the coordinator hosts.
        meter: The coordinator's admission meter.
        close: Closes the plane and the units (the coordinator's ``close``).
        restarted: Whether Ray restarted the coordinator.
    """

    def __init__(self, setup: Mapping[str, Any], units: Mapping[str, RayStorageUnit], plane: ControlPlane,
                 meter: AdmitMeter, close: Callable[[], dict[str, Any]], restarted: bool) -> None:
        self._setup = dict(setup)
        self._units = units
        self._plane = plane
        self._meter = meter
        self._close = close
        self._restarted = restarted
        self._recovery = SpillRecovery(setup["spill_dir"]) if setup.get("spill_dir") else None

    @control_call()
    def clock(self) -> float:
        """This actor's trace clock (:func:`knitdata.observe.trace.now_us`): the reference every process's offset is
        measured against."""
        return tracing.now_us()

    @control_call()
    def flush_trace(self) -> None:
        """Write the trace events recorded so far by this actor and by the units."""
        if tracing.tracer is not None:
            tracing.tracer.flush()
        try:
            ray.get([u.actor.flush_trace.remote() for u in self._units.values()], timeout=30)
        except Exception:  # noqa: BLE001 - a dead unit
            pass

    @control_call()
    def info(self) -> dict[str, Any]:
        """Name, config, units' nodes, spill directory, journal, whether this actor was restarted, and its last
        recovery (``replayed``: journal records replayed after the snapshot; ``snapshot_loaded``)."""
        s = self._plane.state
        return {"name": self._setup["name"], "config": s.config, "nodes": self._setup["nodes"],
                "spill_dir": self._setup.get("spill_dir"), "capacity_bytes": self._setup["capacity_bytes"],
                "journal": self._setup.get("journal"), "restarted": self._restarted,
                "replayed": s.journaling.replayed, "snapshot_loaded": s.journaling.snapshot_loaded, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id(),
                "creator_hosts": bool(self._setup.get("creator_hosts")), "trace": self._setup.get("trace")}

    @control_call()
    def admit_cpu(self) -> dict[str, Any]:
        """``{"cpu_s", "calls", "trajectories"}`` since this actor started: CPU seconds its threads spent inside the
        plane's admission calls from the units, how many calls, and the trajectories they carried (the rest of
        the actor's CPU is Ray's handling of calls, the consumers' calls and idle work)."""
        return self._meter.to_dict()

    @control_call()
    def unit_handles(self) -> dict[str, Any]:
        """``{unit id: [actor handle, description]}`` (handles stay valid after a unit dies: calls then fail)."""
        return {u: [unit.actor, unit.handle_info()] for u, unit in self._units.items()}

    @control_call()
    def recover(self, unit_id: str, ids: list[str]) -> dict[str, bytes]:
        """Records of a dead unit's payloads from its spill shards (those found)."""
        if self._recovery is None:
            return {}
        return self._recovery.records(unit_id, ids)

    @control_call()
    def recoverable(self, unit_ids: list[str], ids: list[str]) -> list[str]:
        """The ids of ``ids`` found in the spill shards of the (dead) units ``unit_ids``."""
        if self._recovery is None:
            return []
        found: set[str] = set()
        for u in unit_ids:
            found.update(self._recovery.held(u, [t for t in ids if t not in found]))
        return sorted(found)

    @control_call()
    def kill_unit(self, unit_id: str) -> None:
        """Kill a unit's actor (failure drills and tests)."""
        self._units[unit_id].kill()

    @control_call()
    def shutdown(self) -> None:
        """Close the plane and kill the units."""
        self._close()
        for u in self._units.values():
            try:
                u.kill()
            except Exception:  # noqa: BLE001 - already dead
                pass
        if self._recovery is not None:
            self._recovery.close()


class Coordinator:
    """Hosts the pipeline's :class:`~knitdata.control.ControlPlane` and :class:`Plumbing`, and owns its
    storage-unit actors (the class of :data:`CoordinatorActor`).

    Every call takes and returns metadata only: JSON-like values or the control plane's records
    (:mod:`knitdata.control.records`, module-level classes that Ray pickles as they are).

    Args:
        setup: Name, config, nodes, capacity, spill directory, journal, trace path, ...
        unit_handles: ``{unit id: (actor handle, description)}``.
    """

    def __init__(self, setup: dict[str, Any], unit_handles: dict[str, Any]) -> None:
        # the units belong to the pipeline's creator, so they outlive a restart of this actor
        units = {u: RayStorageUnit.from_handle(actor, desc) for u, (actor, desc) in unit_handles.items()}
        self._units = units
        path = setup.get("journal")
        journal = Journal(path, compact_every=int(setup.get("journal_compact_every", 10_000))) if path else None
        self._plane = plane = ControlPlane(
            setup["config"], {u: unit.node for u, unit in units.items()},
            lambda u, ids, wait: units[u].release(ids) if wait else units[u].release_async(ids), journal=journal)
        restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
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
            plane.recover(path)  # a restart: the state as of the last journaled call (traced as "restart")
        self._meter = AdmitMeter()
        self.plumbing = Plumbing(setup, units, plane, self._meter, self.close, restarted)
        parts: dict[str, Any] = {"plumbing": self.plumbing, "admission": plane.admission,
                                 "positions": plane.positions, "leasing": plane.leasing,
                                 "reporting": plane.reporting, "reshaping": plane.reshaping, "ledger": plane.ledger}
        #: Every control call by name, bound to its part (the metered admission calls and close to this actor).
        self._calls: dict[str, Callable[..., Any]] = {
            n: getattr(parts[c.part], n) for n, c in CONTROL_CALLS.items() if c.part in parts}
        self._calls.update(admit_many=self.admit_many, admit_batches=self.admit_batches, close=self.close)

    def call(self, name: str, *args: Any) -> Any:
        """Make the control call ``name`` (of a plane's part or of :class:`Plumbing`) with positional ``args``.

        Raises:
            EngineError: No control call of that name.
        """
        fn = self._calls.get(name)
        if fn is None:
            raise EngineError(f"the coordinator has no control call {name!r}")
        return fn(*args)

    @ray.method(concurrency_group="wait")  # type: ignore[misc]
    def call_waiting(self, name: str, *args: Any) -> Any:
        """:meth:`call` for a call that may block (``waits`` in the surface), in the ``"wait"`` concurrency group."""
        return self.call(name, *args)

    # the calls the units make on this actor directly (the one-round-trip put), metered ---------------------
    def admit_many(self, unit: str, items: list[Any]) -> Admitted:
        """See :meth:`knitdata.control.admit.Admission.admit_many` (called by the storage units)."""
        c0 = time.thread_time()
        try:
            return self._plane.admission.admit_many(unit, items)
        finally:
            self._meter.add(time.thread_time() - c0, len(items))

    def admit_batches(self, unit: str, batches: list[Any]) -> list[Admitted]:
        """See :meth:`knitdata.control.admit.Admission.admit_batches` (called by the storage units)."""
        c0 = time.thread_time()
        try:
            return self._plane.admission.admit_batches(unit, batches)
        finally:
            self._meter.add(time.thread_time() - c0, sum(map(len, batches)))

    def clock(self) -> float:
        """See :meth:`Plumbing.clock` (the units measure their trace offsets with it)."""
        return self.plumbing.clock()

    def close(self) -> dict[str, Any]:
        """See :meth:`knitdata.control.admit.Admission.close`; also closes the units."""
        report = self._plane.admission.close()
        for u in self._units.values():
            u.close()
        return report


# ray's stubs omit the actor options max_concurrency and concurrency_groups
CoordinatorActor = ray.remote(num_cpus=0, max_concurrency=16,  # type: ignore[call-overload]
                              concurrency_groups={"wait": 256})(Coordinator)


class RayControl:
    """The Ray engine's control (:class:`~knitdata.control.plane.Control`): the plane's parts and the engine's
    plumbing, each a proxy of its part's type whose control calls go to the coordinator actor.

    The coordinator's own exception reaches the caller as it was raised there (a ``KnitdataError``). A
    fire-and-forget call returns at once; a call that may block (``leasing.lease``, ``leasing.next_entries``) gets
    its own wait added to the time bound.

    Args:
        actor: The coordinator actor handle.
        name: The pipeline's name (for messages).
        timeout_s: Bound on each call beyond the time the call itself may wait.
    """

    def __init__(self, actor: Any, name: str, timeout_s: float) -> None:
        self._actor = actor
        self._name = name
        self._timeout_s = timeout_s
        self.admission: Admission = remote_part(Admission, self)
        self.positions: Positions = remote_part(Positions, self)
        self.leasing: Leases = remote_part(Leases, self)
        self.reporting: Reporting = remote_part(Reporting, self)
        self.reshaping: Reshaping = remote_part(Reshaping, self)
        self.ledger: Ledger = remote_part(Ledger, self)
        self.plumbing: Plumbing = remote_part(Plumbing, self)

    def send(self, call: ControlCall, args: tuple[Any, ...]) -> Any:
        """Make ``call`` on the coordinator with positional ``args`` and return its result (``None`` at once for a
        fire-and-forget call); retried while Ray restarts the coordinator, within the bound."""
        return self.bind(call)(*args)

    def _ray_down(self, call: str) -> EngineError:
        """The error of a control call made while Ray is not running in this process (``ray.shutdown()`` was called):
        the call is not made, since a Ray call there starts a new Ray, which then ends the process."""
        return EngineError(
            f"pipeline {self._name!r}: Ray is not running in this process (ray.shutdown() was called, or Ray was "
            f"never started here), so the control call {call!r} was not sent. Shut the pipeline down "
            "(pipe.shutdown()) before ray.shutdown(), or keep Ray up while the pipeline's datasets and producers live")

    def bind(self, call: ControlCall) -> Callable[..., Any]:
        """The function making ``call`` on the coordinator (the proxies' methods, see
        :func:`~knitdata.control.surface.remote_part`): one frame, then the bounded wait for the answer."""
        name, waits, index, default = call.name, call.waits is not None, call.wait_index, call.wait_default
        if call.fire_and_forget:
            def fire(*args: Any, **kwargs: Any) -> None:
                if kwargs:
                    args = positional(call, args, kwargs)
                if not ray.is_initialized():
                    raise self._ray_down(name)
                self._actor.call.remote(name, *args)

            return fire

        def make(*args: Any, **kwargs: Any) -> Any:
            if kwargs:
                args = positional(call, args, kwargs)
            if not ray.is_initialized():  # an actor call would start a new Ray here (Ray then ends the process)
                raise self._ray_down(name)
            wait = (float(args[index]) if len(args) > index else default) if waits else 0.0
            deadline = time.monotonic() + self._timeout_s + wait
            while True:
                timeout = max(0.1, deadline - time.monotonic())
                actor = self._actor
                try:
                    # ray_get checks the host watch first (a cluster found gone raises within a second)
                    return ray_get((actor.call_waiting if waits else actor.call).remote(name, *args),
                                   timeout=timeout)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    if not isinstance(cause, KnitdataError):
                        cause = e.as_instanceof_cause()
                    if isinstance(cause, KnitdataError):
                        raise cause from None
                    raise
                except ray.exceptions.ActorUnavailableError:  # restarting (journaled): retry within the bound
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.2)
                except ray.exceptions.RayActorError as e:
                    gone = host_gone_error()
                    if gone is not None:
                        raise gone from e
                    raise EngineError(
                        f"the coordinator of pipeline {self._name!r} is gone: the process that created the pipeline "
                        "owns it and has most likely exited (or the coordinator died without a journal). Keep the "
                        "creator alive until every consumer has finished, or create the pipeline with "
                        "engine_options={'detached': True} (and 'journal_dir' so that Ray restarts a crashed "
                        f"coordinator). Ray said: {e}") from e
                except ray.exceptions.GetTimeoutError as e:
                    raise EngineError(f"the coordinator of pipeline {self._name!r} did not answer {name}() within "
                                      f"{timeout:.0f} s") from e

        return make
