"""The control plane: admission, placement, planning, commits and release on metadata only (one for every engine).

Modules: :mod:`~knitdata.control.plane` (the :class:`ControlPlane` facade and its derived surface tables),
:mod:`~knitdata.control.surface` (the declaration of control calls), :mod:`~knitdata.control.state` (the state
the parts share), the parts :mod:`~knitdata.control.admit`, :mod:`~knitdata.control.positions`,
:mod:`~knitdata.control.leases`, :mod:`~knitdata.control.reporting`, :mod:`~knitdata.control.durability`, and the
file formats :mod:`~knitdata.control.journal` and :mod:`~knitdata.control.snapshot`.
"""

from knitdata.control.admit import acquire_rollout
from knitdata.control.plane import (
    FIRE_AND_FORGET,
    JOURNALED_OPS,
    PLANE_DEFAULTS,
    RELEASE_MODES,
    SURFACE,
    ControlPlane,
    fields_of,
)
from knitdata.control.surface import ControlCall

__all__ = ["ControlPlane", "ControlCall", "SURFACE", "JOURNALED_OPS", "FIRE_AND_FORGET", "PLANE_DEFAULTS",
           "RELEASE_MODES", "fields_of", "acquire_rollout"]
