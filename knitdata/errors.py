"""One error hierarchy for knitdata.

Every error raised on purpose by knitdata derives from :class:`KnitdataError`, and also from the
builtin that fits (``ValueError`` for bad input, ``TypeError`` for wrong types, ``RuntimeError`` for
conditions of the running system), so ``except ValueError`` keeps working for callers that do not know
knitdata. Messages name the trajectory and the field where there is one, and say what to do.
"""

from __future__ import annotations

__all__ = [
    "KnitdataError",
    "ValidationError",
    "FieldTypeError",
    "CodecError",
    "ConfigError",
    "QuotaInfeasibleError",
    "StoreFull",
    "StateError",
    "EngineError",
    "PipelineClosedError",
    "FencedError",
    "DataTimeoutError",
    "IncompleteStreamError",
    "TrajectoryLostError",
    "MediaError",
    "MediaRefError",
    "OptionalDependencyError",
    "RolloutOutputError",
    "RolloutThrottled",
]  # the error hierarchy only (re-exported by the package); ERROR_CLASSES and error_class are reached as errors.*


class KnitdataError(Exception):
    """Root of every error knitdata raises on purpose."""


class _LocatedError(KnitdataError):
    """An error about one trajectory and field: the message starts with both where they are known."""

    def __init__(self, message: str, *, trajectory_id: str | None = None, field: str | None = None):
        prefix = ""
        if trajectory_id is not None:
            prefix += f"trajectory {trajectory_id!r}: "
        if field is not None:
            prefix += f"field {field!r}: "
        super().__init__(prefix + message)
        self.trajectory_id = trajectory_id
        self.field = field


class ValidationError(_LocatedError, ValueError):
    """A trajectory (or another input) holds a bad value.

    Attributes:
        trajectory_id: The id of the offending trajectory, or ``None`` when not known.
        field: The name of the offending field, or ``None``.
    """


class FieldTypeError(_LocatedError, TypeError):
    """A field of a trajectory has the wrong Python type or tensor dtype.

    Attributes:
        trajectory_id: The id of the offending trajectory, or ``None`` when not known.
        field: The name of the offending field, or ``None``.
    """


class CodecError(KnitdataError, ValueError):
    """A binary buffer or shard is corrupted, truncated or not knitdata's format."""


class ConfigError(KnitdataError, ValueError):
    """A configuration (batch spec, engine option, scenario...) is invalid."""


class QuotaInfeasibleError(KnitdataError, RuntimeError):
    """The per-source quotas of a train batch can no longer be met with what rollout can deliver."""


class StoreFull(KnitdataError, RuntimeError):
    """A storage unit is at capacity and could not take a payload within the timeout."""


class StateError(KnitdataError, ValueError):
    """A state dict does not match the object it is loaded into."""


class EngineError(KnitdataError, RuntimeError):
    """An engine was used in a way it does not support (e.g. worker processes on the embedded engine)."""


class PipelineClosedError(EngineError):
    """The pipeline was closed (end of stream) or stopped after an admission error: no more puts."""


class FencedError(EngineError):
    """A newer iterator took this consumer's rank (and worker) over while this one was alive: this one stops.

    Its micro-batches not yet handed out go to the newer holder; nothing is delivered twice.
    """


class DataTimeoutError(KnitdataError, TimeoutError):
    """A consumer waited longer than its dataset's ``timeout`` for its next micro-batch.

    The message says what admission still waits for (per source, incomplete groups).
    """


class IncompleteStreamError(KnitdataError, RuntimeError):
    """The stream ended with stored trajectories that were never admitted (an incomplete train batch or group).

    Raised to consumers after every admitted mini-batch was delivered; the message names the sources and groups.
    """


class TrajectoryLostError(KnitdataError, RuntimeError):
    """Payloads became unreachable (e.g. a storage node died) and could not be recovered.

    Attributes:
        trajectory_ids: The ids of the lost trajectories.
    """

    def __init__(self, message: str, *, trajectory_ids: list[str] | tuple[str, ...] = ()):
        ids = list(trajectory_ids)
        shown = ", ".join(repr(i) for i in ids[:10]) + (" ..." if len(ids) > 10 else "")
        super().__init__(f"{message} (lost {len(ids)} trajectories: {shown})" if ids else message)
        self.trajectory_ids = ids


class MediaError(KnitdataError, ValueError):
    """A media item (image, audio) cannot be decoded or processed.

    Attributes:
        trajectory_id: The id of the trajectory holding the item, or ``None``.
        item: The index of the item within the trajectory's media, or ``None``.
    """

    def __init__(self, message: str, *, trajectory_id: str | None = None, item: int | None = None):
        prefix = ""
        if trajectory_id is not None:
            prefix += f"trajectory {trajectory_id!r}: "
        if item is not None:
            prefix += f"media item {item}: "
        super().__init__(prefix + message)
        self.trajectory_id = trajectory_id
        self.item = item


class MediaRefError(ValidationError):
    """A trajectory refers to a media item (:meth:`MediaItem.ref <knitdata.record.MediaItem.ref>`) by a digest
    that the pipeline does not hold. Nothing of the put is stored; what was accepted before stays.

    Attributes:
        trajectory_id: The id of the referring trajectory.
        field: ``"media.<index>"``: the reference's index within the trajectory's media.
        digest: The digest referred to.
        kind: The reference's media kind (``None`` when not known).
        index: The reference's index within the trajectory's media (``None`` when not known).
    """

    def __init__(self, message: str | None = None, *, trajectory_id: str | None = None, field: str | None = None,
                 digest: str = "", kind: str | None = None, index: int | None = None):
        if field is None and index is not None:
            field = f"media.{index}"
        if message is None:
            where = ", ".join(x for x in (f"kind {kind}" if kind else "", f"media index {index}"
                                          if index is not None else "") if x)
            message = (f"refers to media {digest}{f' ({where})' if where else ''} which the pipeline does not hold: "
                       "put the item with its content once first (e.g. with the group's first member)")
        super().__init__(message, trajectory_id=trajectory_id, field=field)
        self.digest = digest
        self.kind = kind
        self.index = index


class OptionalDependencyError(KnitdataError, ImportError):
    """An optional extra (ray, transferqueue, matplotlib) is needed but not installed."""

    def __init__(self, package: str, extra: str, purpose: str):
        super().__init__(
            f"{purpose} needs the optional package {package!r}; install it with "
            f"`pip install 'knitdata[{extra}]'`"
        )
        self.package = package
        self.extra = extra


class RolloutOutputError(ValidationError):
    """A rollout engine's output cannot become a trajectory: a length mismatch, missing log-probs, an unknown
    finish reason, a continuation that does not extend its request (``knitdata.rollout``).

    The message starts with the request, the sample (the index of the response within the request) and the field.

    Attributes:
        request_id: The engine's request id, or ``None`` when not known.
        sample: The index of the response within its request (``n`` samples per request), or ``None``.
        field: The name of the offending field of the engine's output, or ``None``.
        trajectory_id: Always ``None`` (no trajectory exists yet).
    """

    def __init__(self, message: str, *, request_id: str | None = None, sample: int | None = None,
                 field: str | None = None):
        prefix = ""
        if request_id is not None:
            prefix += f"request {request_id!r}: "
        if sample is not None:
            prefix += f"sample {sample}: "
        if field is not None:
            prefix += f"field {field!r}: "
        Exception.__init__(self, prefix + message)
        self.trajectory_id = None
        self.field = field
        self.request_id = request_id
        self.sample = sample


class RolloutThrottled(KnitdataError, TimeoutError):
    """A rollout worker waited longer than its ``timeout`` for room within the pipeline's ``max_staleness``.

    The message says the capacity per source and what admission waits for.
    """


#: Every error class a control plane may name in an answer (a refusal of a put), by class name: the explicit table
#: :func:`error_class` reads (no attribute lookup on this module).
ERROR_CLASSES: dict[str, type[KnitdataError]] = {
    cls.__name__: cls for cls in (
        KnitdataError, ValidationError, FieldTypeError, CodecError, ConfigError, QuotaInfeasibleError, StoreFull,
        StateError, EngineError, PipelineClosedError, FencedError, DataTimeoutError, IncompleteStreamError,
        TrajectoryLostError, MediaError, MediaRefError, OptionalDependencyError, RolloutOutputError, RolloutThrottled)
}


def error_class(name: str) -> type[KnitdataError]:
    """The knitdata error class called ``name`` (:data:`ERROR_CLASSES`); :class:`KnitdataError` for another name
    (a newer control plane's class, or a builtin error's name).

    Example:
        >>> error_class("StoreFull").__name__, error_class("KeyError").__name__
        ('StoreFull', 'KnitdataError')
    """
    return ERROR_CLASSES.get(name, KnitdataError)
