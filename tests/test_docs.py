"""The documentation site: it builds without warnings and its API reference covers ``knitdata.__all__``."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import knitdata

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
DIRECTIVE = re.compile(r"^::: (knitdata(?:\.[A-Za-z_][A-Za-z0-9_]*)+)\s*$", re.MULTILINE)
# Files outside the repository that neither the docs nor the docstrings may cite.
OUTSIDE = re.compile(r"DESIGN\.md|NOTES\.md|\bissue \d+", re.IGNORECASE)


def _directives() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for page in sorted(REFERENCE.glob("*.md")):
        for target in DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            out[target] = page
    return out


def _resolve(path: str) -> object:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_reference_covers_every_public_name() -> None:
    directives = _directives()
    documented = {target.rsplit(".", 1)[1]: target for target in directives}
    missing = [name for name in knitdata.__all__ if name not in documented]
    assert not missing, f"no '::: knitdata.NAME' directive in docs/reference/*.md for {missing}"
    for name in knitdata.__all__:
        if name == "__version__":
            continue
        assert _resolve(documented[name]) is getattr(knitdata, name), documented[name]


def test_reference_pages_are_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in REFERENCE.glob("*.md"):
        assert f"reference/{page.name}" in nav, page.name


def test_docs_and_docstrings_cite_nothing_outside_the_repository() -> None:
    hits = []
    for page in DOCS.rglob("*.md"):
        for m in OUTSIDE.finditer(page.read_text(encoding="utf-8")):
            hits.append(f"{page.relative_to(ROOT)}: {m.group(0)}")
    for mod in ("record", "sim", "collate", "staleness", "admission", "placement"):
        text = (ROOT / "knitdata" / f"{mod}.py").read_text(encoding="utf-8")
        for m in OUTSIDE.finditer(text):
            hits.append(f"knitdata/{mod}.py: {m.group(0)}")
    assert not hits, hits


def _inventory_names(path: Path) -> set[str]:
    """Object names in a Sphinx-format ``objects.inv`` (four header lines, then zlib-compressed entries)."""
    data = path.read_bytes()
    body = data.split(b"\n", 4)[4]
    names = set()
    for line in zlib.decompress(body).decode("utf-8").splitlines():
        names.add(line.split(" ", 1)[0])
    return names


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("material")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "WARNING" not in log, log[-4000:]
    inv = _inventory_names(site / "objects.inv")
    for target in _directives():
        assert target in inv, f"{target} missing from the built site's objects inventory"
