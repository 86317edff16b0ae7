"""Tests of knitdata.errors: one root, the fitting builtin, actionable messages."""

from __future__ import annotations

import pytest

import knitdata
from knitdata import errors


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_derives_from_the_root_and_a_builtin(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.KnitdataError)
    if cls is not errors.KnitdataError:
        assert issubclass(cls, (ValueError, TypeError, RuntimeError, ImportError, TimeoutError))
    assert getattr(knitdata, name) is cls


def test_error_class_is_an_explicit_table_of_the_hierarchy() -> None:
    assert set(errors.ERROR_CLASSES) == set(errors.__all__)
    for name in errors.__all__:
        assert errors.error_class(name) is getattr(errors, name)
    for other in ("KeyError", "Exception", "error_class", "ERROR_CLASSES", "__class__"):
        assert errors.error_class(other) is errors.KnitdataError


def test_messages_name_trajectory_field_and_item() -> None:
    e = errors.ValidationError("must be finite", trajectory_id="t7", field="scalars.reward")
    assert str(e) == "trajectory 't7': field 'scalars.reward': must be finite"
    m = errors.MediaError("truncated PNG", trajectory_id="t7", item=2)
    assert "trajectory 't7'" in str(m) and "media item 2" in str(m)
    lost = errors.TrajectoryLostError("storage unit on node1 died", trajectory_ids=[f"t{i}" for i in range(12)])
    assert "lost 12 trajectories" in str(lost) and "'t0'" in str(lost) and lost.trajectory_ids[-1] == "t11"
    dep = errors.OptionalDependencyError("ray", "ray", "the Ray engine")
    assert "pip install 'knitdata[ray]'" in str(dep) and isinstance(dep, ImportError)
