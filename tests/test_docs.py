"""The documentation site: it builds without warnings, its API reference covers ``knitdata.__all__``, and every code
example of README.md, docs/**/*.md and the package's docstrings runs (``tests/_docs_harness.py`` says how)."""

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

sys.path.insert(0, str(Path(__file__).parent))
import _docs_harness as harness  # noqa: E402

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
    pages = [*DOCS.rglob("*.md"), ROOT / "README.md", *(ROOT / "examples").rglob("*.md"),
             *(ROOT / "examples").rglob("*.py")]
    for page in pages:
        for m in OUTSIDE.finditer(page.read_text(encoding="utf-8")):
            hits.append(f"{page.relative_to(ROOT)}: {m.group(0)}")
    for path in sorted((ROOT / "knitdata").rglob("*.py")):
        for m in OUTSIDE.finditer(path.read_text(encoding="utf-8")):
            hits.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not hits, hits


# ---------------------------------------------------------------------------------------------- code examples
def _module_names() -> list[str]:
    """Every module of the package, from the file tree (nothing imported at collection)."""
    pkg = ROOT / "knitdata"
    names = []
    for path in sorted(pkg.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in harness.markdown_files()])
def test_markdown_code_blocks_run(page: str, tmp_path: Path) -> None:
    """Every ```python block of README.md and docs/ runs (placeholders from the harness's setups), in order; a block
    that cannot run here is marked ``<!-- docs-test: skip REASON -->``."""
    skipped = harness.run_markdown(ROOT / page, tmp_path)
    for line in skipped:
        print("skipped", line)


@pytest.mark.parametrize("module", _module_names())
def test_docstring_examples_run(module: str, tmp_path: Path) -> None:
    """Every doctest, ```python fence and ``Example::`` block in the docstrings of ``module`` runs."""
    try:
        mod = importlib.import_module(module)
    except knitdata.OptionalDependencyError as e:  # pragma: no cover - every extra is installed by make install-dev
        pytest.skip(str(e))
    for block in harness.docstring_blocks(mod):
        harness.run_docstring_block(block, tmp_path)


def test_the_harness_finds_the_examples_it_must_run() -> None:
    """No example escapes the harness: doctests are not skipped, an ``Example`` heading has code the harness runs,
    a marker sits right before a ```python fence, and the examples known to exist are found."""
    skips = [f"{p.relative_to(ROOT)}" for p in (ROOT / "knitdata").rglob("*.py") if "doctest: +SKIP" in p.read_text()]
    assert not skips, f"doctests skipped in {skips}: make them run (placeholders: tests/_docs_harness.py)"
    assert harness.example_headers_without_code() == []
    for path in harness.markdown_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if "docs-test" in line:
                assert harness.MARKER.match(line.strip()), f"{path.name}:{i + 1}: malformed marker {line!r}"
                nxt = next(ln for ln in lines[i + 1:] if ln.strip())
                assert nxt.strip() == "```python", f"{path.name}:{i + 1}: a marker must come right before ```python"
    assert len(harness.markdown_blocks(ROOT / "README.md")) >= 2
    import knitdata.integrations.transformers as hf
    import knitdata.media.encoder

    assert len([b for b in harness.docstring_blocks(knitdata.media.encoder) if b.mode == "run"]) == 2  # DDP and FSDP2
    codes = [b.code for b in harness.docstring_blocks(hf)]
    assert len(codes) == 2 and "adapter_for(model)" in codes[0] and "pad_sequence" in codes[1]
    assert all(s in harness.SETUPS for s in ("default", "consumer", "resume", "multimodal", "qwen"))


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


# ---------------------------------------------------------------------------------------------- documented patterns
def _group(g: int, source: str, size: int = 2) -> list[knitdata.Trajectory]:
    import torch

    return [knitdata.Trajectory(id=f"g{g}-{k}", source=source, group=f"g{g}", prompt_ids=torch.tensor([1, 2]),
                                response_ids=torch.tensor([3, 4, 5]), scalars={"reward": float(k)})
            for k in range(size)]


def _consume_all(pipe: knitdata.Pipeline, rank: int, out: dict[int, object]) -> None:
    ids: list[str] = []
    try:
        for mb in pipe.dataset(rank, timeout=30):
            assert mb.info is not None
            ids.extend(mb.info.trajectory_ids)
        out[rank] = ids
    except Exception as e:  # noqa: BLE001 - the test inspects it
        out[rank] = (e, ids)


@pytest.mark.filterwarnings("ignore:knitdata. pipeline closed with")
def test_producer_that_raises_still_ends_consumers() -> None:
    """The documented pattern (``close()`` in ``finally``): a put that raises mid-stream does not hang consumers."""
    import threading

    spec = knitdata.BatchSpec({"math": 2, "code": 2}, num_minibatches=1, group_size=2)
    pipe = knitdata.Pipeline(spec, num_consumers=2, token_budget=64)
    out: dict[int, object] = {}
    threads = [threading.Thread(target=_consume_all, args=(pipe, r, out)) for r in range(2)]
    for t in threads:
        t.start()
    stream = _group(0, "math") + _group(1, "code") + _group(2, "math")
    with pytest.raises(RuntimeError, match="rollout failed"):
        try:
            for i, traj in enumerate(stream):
                if i == 5:
                    raise RuntimeError("rollout failed")  # e.g. StoreFull, or the rollout engine died
                pipe.put(traj)
        finally:
            report = pipe.close()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a consumer hangs after the producer failed"
    delivered = sorted(i for r in range(2) for i in (out[r] if isinstance(out[r], list) else out[r][1]))
    assert delivered == sorted(t.id for t in stream[:4])  # the admitted train batch, exactly once
    assert report["dropped_trajectories"] == 1 and report["dropped_groups"] == ["g2"]
    errors = [out[r][0] for r in range(2) if isinstance(out[r], tuple)]
    assert errors and all(isinstance(e, knitdata.IncompleteStreamError) for e in errors)


def test_withdraw_on_refused_member_lets_the_train_batch_complete() -> None:
    """The documented pattern: a member refused at ``put`` -> ``withdraw(group)``; the rest is delivered."""
    import threading

    import torch

    spec = knitdata.BatchSpec({"math": 2, "code": 2}, num_minibatches=1, group_size=2)
    pipe = knitdata.Pipeline(spec, num_consumers=1, token_budget=64)
    bad = _group(0, "math")
    bad[1].tensors = {"extra": torch.zeros(1)}  # other field names than the first put: refused
    stream = bad + _group(1, "code") + _group(2, "math")
    refused = []
    try:
        for traj in stream:
            try:
                pipe.put(traj)
            except (ValueError, TypeError) as e:
                refused.append((traj.id, type(e).__name__))
                pipe.withdraw(traj.group)
    finally:
        report = pipe.close()
    assert refused == [("g0-1", "ValidationError")]
    out: dict[int, object] = {}
    t = threading.Thread(target=_consume_all, args=(pipe, 0, out))
    t.start()
    t.join(20)
    assert not t.is_alive()
    assert sorted(out[0]) == sorted(x.id for x in _group(1, "code") + _group(2, "math"))  # type: ignore[arg-type]
    assert report["dropped_trajectories"] == 0
    assert pipe.stats()["rejected"] >= 1


def test_same_process_resume_fences_the_old_iterator() -> None:
    """Checkpoint and resume, case 1: a second live iterator of a rank takes it over; the old one is fenced."""
    spec = knitdata.BatchSpec({"math": 2, "code": 2}, num_minibatches=2, group_size=2)
    pipe = knitdata.Pipeline(spec, num_consumers=1, token_budget=8)   # one trajectory per micro-batch
    try:
        for g, source in enumerate(("math", "code", "math", "code")):
            for traj in _group(g, source):
                pipe.put(traj)
    finally:
        pipe.close()
    ds = pipe.dataset(0, fetch="iter", timeout=30)
    it = iter(ds)
    first = [next(it).info.trajectory_ids for _ in range(3)]  # type: ignore[union-attr]
    state = ds.state_dict()
    ds2 = pipe.dataset(0, fetch="iter", timeout=30)
    ds2.load_state_dict(state)
    it2 = iter(ds2)  # takes rank 0 over: the old iterator lets go
    with pytest.raises(knitdata.FencedError, match="rank 0"):
        next(it)
    ds.close()
    rest = [mb.info.trajectory_ids for mb in it2]  # type: ignore[union-attr]
    ids = [i for ids in first + rest for i in ids]
    assert sorted(ids) == sorted(f"g{g}-{k}" for g in range(4) for k in range(2)) and len(ids) == 8
    del it
