"""The control surface: every call a caller reaches on a part of the control plane, declared once where it is defined.

A part of the plane marks each of its public calls with :func:`control_call` and the part itself with
:func:`control_part`; that records a :class:`ControlCall` in :data:`CONTROL_CALLS`: the call's metadata only
(its part, whether it is journaled, fire-and-forget, and which argument bounds its wait). The calls themselves
are the parts' own methods, typed where they are written:

* in process a caller holds the part itself (``plane.positions.commit(...)`` is
  :meth:`knitdata.control.positions.Positions.commit`: no forwarding hop);
* another process holds a proxy of the same type (:func:`remote_part`: a subclass of the part, made once per
  part, whose control calls go through a :class:`Transport`), so the type checker sees the same signatures;
* the journal's operations (:data:`~knitdata.control.plane.JOURNALED_OPS`) are the calls marked ``journaled``:
  such a call is recorded in the plane's journal once it was applied (see :func:`control_call`).

Adding a control call is writing one decorated method in the part it belongs to.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from knitdata.control.state import PlaneState
from knitdata.errors import ConfigError, KnitdataError

__all__ = ["ControlCall", "CONTROL_CALLS", "Part", "Transport", "control_call", "control_part", "positional", "remote_part"]

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)
P = TypeVar("P")


@dataclass(frozen=True)
class ControlCall:
    """One call of the control surface.

    Attributes:
        name: The method name on its part (unique across the parts: the journal records calls by it).
        part: The attribute holding the part that defines it (on :class:`~knitdata.control.ControlPlane` and on
            a remote client).
        journaled: Whether the call changes the plane's state and is recorded in its journal.
        fire_and_forget: Whether a remote caller sends it without waiting for a result.
        waits: The parameter bounding how long the call may block (``None``: it answers at once); a remote
            caller adds it to its own deadline, and the coordinator runs it in its ``"wait"`` concurrency group.
        wait_index: The position of ``waits`` among the arguments (after ``self``).
        wait_default: Its default when a caller leaves it out.
        signature: The method's signature without ``self`` (a proxy binds keyword arguments with it).
    """

    name: str
    part: str
    journaled: bool
    fire_and_forget: bool
    waits: str | None
    wait_index: int
    wait_default: float
    signature: inspect.Signature

    def wait_of(self, args: tuple[Any, ...]) -> float:
        """How long the call with positional ``args`` may block (``0`` for a call that does not wait)."""
        if self.waits is None:
            return 0.0
        return float(args[self.wait_index]) if len(args) > self.wait_index else self.wait_default


#: Every control call by name, in the order the parts declare them (filled by :func:`control_part`).
CONTROL_CALLS: dict[str, ControlCall] = {}


def _journaled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Record the outermost call of a state-changing method in the plane's journal once it was applied.

    A call that raised a :class:`~knitdata.errors.KnitdataError` is recorded too: replaying it reproduces its
    effects, and its error again. Journaled calls take positional arguments only (they are replayed from them).
    """

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any) -> Any:
        jr = self.s.journaling
        if jr.journal is None:  # the common in-process case: no bookkeeping around the call
            return fn(self, *args)
        with self.s.cond:
            outer = jr.depth == 0 and not jr.replaying and jr.log is not None
            jr.depth += 1
            try:
                out = fn(self, *args)
            except KnitdataError:
                if outer:
                    jr.log(name, args)
                raise
            finally:
                jr.depth -= 1
            if outer:
                jr.log(name, args)
            return out

    return wrapper


def control_call(*, journaled: bool = False, fire_and_forget: bool = False,
                 waits: str | None = None) -> Callable[[F], F]:
    """Mark a method of a part as a call of the control surface (the part is registered by :func:`control_part`).

    Args:
        journaled: The call changes the plane's state: record it in the journal (outermost calls only).
        fire_and_forget: Remote callers do not wait for its result.
        waits: The name of the parameter bounding how long the call may block.
    """

    def mark(fn: F) -> F:
        out = _journaled(fn.__name__, fn) if journaled else fn
        out.__control_call__ = {"journaled": journaled, "fire_and_forget": fire_and_forget,  # type: ignore[attr-defined]
                                "waits": waits}
        return out  # type: ignore[return-value]

    return mark


def control_part(part: str) -> Callable[[C], C]:
    """Register the calls a part class marked with :func:`control_call`, under the plane attribute ``part``.

    Raises:
        ConfigError: A call name registered twice, or ``waits`` naming no parameter.
    """

    def register(cls: C) -> C:
        for name, fn in vars(cls).items():
            opts = getattr(fn, "__control_call__", None)
            if opts is None:
                continue
            if name in CONTROL_CALLS:
                raise ConfigError(f"control call {name!r} is declared twice ({CONTROL_CALLS[name].part} and {part})")
            sig = inspect.signature(inspect.unwrap(fn))
            params = list(sig.parameters.values())[1:]
            index, default = -1, 0.0
            if opts["waits"] is not None:
                names = [p.name for p in params]
                if opts["waits"] not in names:
                    raise ConfigError(f"control call {name!r}: waits={opts['waits']!r} names no parameter of it")
                index = names.index(opts["waits"])
                d = params[index].default
                default = 0.0 if d is inspect.Parameter.empty else float(d)
            CONTROL_CALLS[name] = ControlCall(
                name=name, part=part, journaled=opts["journaled"], fire_and_forget=opts["fire_and_forget"],
                waits=opts["waits"], wait_index=index, wait_default=default,
                signature=sig.replace(parameters=params))
        return cls

    return register


class Part:
    """A part of the control plane: one concern, working on the plane's shared state.

    Args:
        s: The plane's shared state (:class:`~knitdata.control.state.PlaneState`).
    """

    def __init__(self, s: PlaneState) -> None:
        self.s = s


class Transport(Protocol):
    """How a proxy made by :func:`remote_part` reaches the part it stands for (in another process)."""

    def send(self, call: ControlCall, args: tuple[Any, ...]) -> Any:
        """Make ``call`` with positional ``args`` and return its result (``None`` at once for a fire-and-forget
        call)."""

    def bind(self, call: ControlCall) -> Callable[..., Any]:
        """The function that makes ``call`` with the arguments of the part's method (positional or keyword), in one
        frame: :func:`remote_part` puts it on the proxy, so a remote call is that frame and the transport's wait."""


def positional(call: ControlCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``args`` and ``kwargs`` of ``call`` (as the part's method takes them) as positional arguments, defaults
    filled in: the far side of a transport takes positional arguments."""
    bound = call.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.args)


_PROXIES: dict[type, type] = {}
#: The control calls of each part that has a proxy class, by name (what :func:`remote_part` binds).
_CALLS_OF: dict[type, dict[str, ControlCall]] = {}


def _proxy_method(call: ControlCall, impl: Callable[..., Any]) -> Callable[..., Any]:
    """The proxy's method for ``call``: its arguments made positional, then sent through the proxy's transport."""
    @functools.wraps(impl)
    def send(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs:  # the far side takes positional arguments: bind keywords to their places
            args = positional(call, args, kwargs)
        return self._transport.send(call, args)

    return send


def _refusal(cls: type, name: str) -> Callable[..., Any]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(f"{cls.__name__}.{name} is not a control call: it is not reachable from another process")

    refuse.__name__ = name
    return refuse


def proxy_class(part: type) -> type:
    """The proxy class of ``part`` (made once): a subclass whose control calls go through a :class:`Transport`
    and whose other public methods refuse (they work on state that lives in another process)."""
    cls = _PROXIES.get(part)
    if cls is not None:
        return cls
    methods: dict[str, Any] = {}
    calls: dict[str, ControlCall] = {}  # the part's control calls, by name (a subclass's override wins)
    for klass in reversed(part.__mro__[:-1]):
        for name, value in vars(klass).items():
            if name.startswith("_") or not callable(value):
                continue
            call = CONTROL_CALLS.get(name)
            if call is not None and getattr(value, "__control_call__", None) is not None:
                methods[name] = _proxy_method(call, value)
                calls[name] = call
            else:
                methods[name] = _refusal(part, name)
                calls.pop(name, None)

    def __init__(self: Any, transport: Transport) -> None:
        self._transport = transport

    cls = type(f"{part.__name__}Proxy", (part,), {
        **methods, "__init__": __init__, "__module__": part.__module__,
        "__doc__": f"A remote :class:`{part.__module__}.{part.__name__}`: its control calls sent through a transport."})
    _PROXIES[part] = cls
    _CALLS_OF[part] = calls
    return cls


def remote_part(part: type[P], transport: Transport) -> P:
    """A proxy of ``part`` (its type, for the type checker and ``isinstance``) whose control calls go through
    ``transport``: each is the transport's bound function for it (:meth:`Transport.bind`), set on the proxy, so a
    remote call takes one frame before the transport's wait (the class's methods, which send through
    :meth:`Transport.send`, stay for ``type(proxy).method(proxy, ...)``)."""
    proxy: P = proxy_class(part)(transport)
    vars(proxy).update((name, transport.bind(call)) for name, call in _CALLS_OF[part].items())
    return proxy
