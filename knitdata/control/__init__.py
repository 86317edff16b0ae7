"""The control plane: admission, placement, planning, commits and release on metadata only (one for every engine)."""

from knitdata.control.plane import PLANE_DEFAULTS, RELEASE_MODES, ControlPlane, fields_of

__all__ = ["ControlPlane", "PLANE_DEFAULTS", "RELEASE_MODES", "fields_of"]
