"""Tests of the top-level package: lazy public names, optional extras stay optional."""

from __future__ import annotations

import subprocess
import sys

import knitdata


def test_public_names_resolve() -> None:
    for name in knitdata.__all__:
        assert getattr(knitdata, name) is not None, name
    assert set(knitdata._LAZY) <= set(dir(knitdata))


def test_import_does_not_pull_optional_extras() -> None:
    code = (
        "import sys, knitdata; knitdata.Pipeline; knitdata.SharedEncoding; knitdata.write_shards; "
        "print(knitdata.__version__); "
        "bad = [m for m in ('ray', 'matplotlib', 'transfer_queue') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == knitdata.__version__


def test_unknown_attribute_raises() -> None:
    try:
        knitdata.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")
