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


def _knitdata_imports() -> dict[str, set[str]]:
    """``{module: knitdata modules it imports}`` (top level and inside functions), from the source."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "knitdata"
    mods = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        mods[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                if t in mods and t != name and t.startswith("knitdata"):
                    deps.add(t)
        graph[name] = deps
    return graph


def test_no_two_modules_import_each_other() -> None:
    """The layering of the design: dependencies point one way (package __init__ re-exports aside)."""
    graph = _knitdata_imports()
    pairs = sorted((a, b) for a, deps in graph.items() for b in deps
                   if a in graph.get(b, ()) and a < b and not (b.startswith(a + ".") or a.startswith(b + ".")))
    assert pairs == [], pairs


def test_no_module_uses_another_modules_private_names() -> None:
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "knitdata"
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("knitdata"):
                bad += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == [], bad


def test_control_plane_and_metadata_layers_do_not_import_engines_or_payload_code() -> None:
    graph = _knitdata_imports()
    low = ("knitdata.admission", "knitdata.staleness", "knitdata.placement", "knitdata.planner", "knitdata.control.plane")
    for mod in low:
        for dep in graph[mod]:
            assert not dep.startswith(("knitdata.engines", "knitdata.storage", "knitdata.pipeline", "knitdata.dataset")), (mod, dep)
