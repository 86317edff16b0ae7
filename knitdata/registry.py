"""One registry idiom for every strategy family chosen by name (engines, fetch modes, admission policies, placements,
model adapters).

A :class:`Registry` maps names to entries of one type (a strategy class, or a strategy object) and is the only
table of its family: ``Pipeline(engine=...)`` reads :data:`knitdata.engines.base.ENGINES`, ``fetch=...`` reads
:data:`knitdata.consumer.fetch.FETCH_MODES`, ``admission=...`` reads :data:`knitdata.admission.POLICIES`,
``placement=...`` reads :data:`knitdata.placement.PLACEMENTS`, and ``adapter_for(model)`` reads
:data:`knitdata.integrations.transformers.MODEL_ADAPTERS`. Each family registers its built-in strategies where
it defines them, and anyone may register another one the same way::

    ENGINES.register_lazy("mine", "my_package.engine:MyEngine")   # imported when first chosen
    FETCH_MODES.register("sample2", SampleFetch())

An unknown name is a :class:`~knitdata.errors.ConfigError` that names the family and the choices.

Example:
    >>> colours: Registry[str] = Registry("colour", accepts=lambda e: isinstance(e, str) and e.startswith("#"))
    >>> colours.register("red", "#f00")
    '#f00'
    >>> colours.get("red"), colours.names(), "blue" in colours
    ('#f00', ('red',), False)
    >>> colours.get("blue")
    Traceback (most recent call last):
    ...
    knitdata.errors.ConfigError: unknown colour 'blue'; choose one of ('red',)
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from knitdata.errors import ConfigError, OptionalDependencyError

__all__ = ["Registry"]

T = TypeVar("T")


class _Lazy:
    """An entry not imported yet: the ``"module:attribute"`` that names it."""

    __slots__ = ("target",)

    def __init__(self, target: str) -> None:
        self.target = target


class Registry(Generic[T]):
    """Strategies of one family by name, in registration order (thread-safe).

    An entry is registered as itself (:meth:`register`), or as the ``"module:attribute"`` that names it
    (:meth:`register_lazy`), imported at its first :meth:`get` (so that a strategy with an optional dependency costs
    nothing until it is chosen).

    Args:
        kind: What the family's entries are, for messages (``"engine"``, ``"fetch mode"``...).
        accepts: Whether an object may be an entry (checked at registration and at a lazy entry's import);
            ``None``: anything.
    """

    def __init__(self, kind: str, *, accepts: Callable[[object], bool] | None = None) -> None:
        self.kind = kind
        self._accepts = accepts
        self._entries: dict[str, T | _Lazy] = {}
        self._lock = threading.Lock()

    def register(self, name: str, entry: T) -> T:
        """Make ``entry`` known as ``name``, replacing an entry of that name; returns ``entry``.

        Raises:
            ConfigError: An empty name, or an entry this family does not accept.
        """
        self._check_name(name)
        if self._accepts is not None and not self._accepts(entry):
            raise ConfigError(f"{self.kind} {name!r}: {entry!r} is not a {self.kind}")
        with self._lock:
            self._entries[name] = entry
        return entry

    def register_lazy(self, name: str, target: str) -> None:
        """Make the entry ``target`` names (``"module:attribute"``, imported at the first :meth:`get`) known as
        ``name``, replacing an entry of that name.

        Raises:
            ConfigError: An empty name, or ``target`` not of the form ``"module:attribute"``.
        """
        self._check_name(name)
        module, sep, attr = target.partition(":") if isinstance(target, str) else ("", "", "")
        if not (module and sep and attr):
            raise ConfigError(f"{self.kind} {name!r}: a lazy entry is 'module:attribute', got {target!r}")
        with self._lock:
            self._entries[name] = _Lazy(target)

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a {self.kind} is registered under a non-empty name, got {name!r}")

    def unregister(self, name: str) -> None:
        """Forget the entry registered as ``name`` (nothing if none)."""
        with self._lock:
            self._entries.pop(name, None)

    def get(self, name: str, *, what: str | None = None) -> T:
        """The entry registered as ``name`` (a lazy one is imported now).

        Args:
            name: A name of :meth:`names`.
            what: What needs it, for the message of a missing optional dependency (default ``<kind>=<name>``).

        Raises:
            ConfigError: No entry of that name (the message names the choices).
            OptionalDependencyError: A lazy entry's package is not installed.
        """
        with self._lock:
            entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise ConfigError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
        if not isinstance(entry, _Lazy):
            return entry
        module, _sep, attr = entry.target.partition(":")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            top = e.name.split(".")[0] if e.name else ""
            if top and top != "knitdata":
                raise OptionalDependencyError(top, top, what or f"{self.kind.replace(' ', '_')}={name!r}") from e
            raise
        found = getattr(mod, attr, None)
        if found is None or (self._accepts is not None and not self._accepts(found)):
            raise ConfigError(f"{self.kind} {name!r}: {entry.target!r} is not a {self.kind}")
        with self._lock:
            if self._entries.get(name) is entry:  # not replaced meanwhile
                self._entries[name] = found
        result: T = found
        return result

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (the built-in entries first)."""
        with self._lock:
            return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
