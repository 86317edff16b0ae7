"""MkDocs hooks for the knitdata docs (not a page: excluded in mkdocs.yml).

The docstrings use Sphinx-style roles (``:class:`~knitdata.consumer.dataset.TrajectoryDataset```), which mkdocstrings
renders literally; :func:`on_page_content` turns each into an optional cross-reference that mkdocs-autorefs
resolves into a link when the target is documented (else plain code, without a warning).

KNOWN_DOCSTRING_WARNINGS silences griffe warnings about docstrings that are known and awaiting a fix in their
module, each by (file, message fragment), so that ``mkdocs build --strict`` still fails on every other warning.
Remove an entry once its docstring is fixed.
"""

from __future__ import annotations

import logging
import re

KNOWN_DOCSTRING_WARNINGS: tuple[tuple[str, str], ...] = ()


class _KnownWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(path in msg and fragment in msg for path, fragment in KNOWN_DOCSTRING_WARNINGS)


def on_startup(**kwargs: object) -> None:
    logging.getLogger("mkdocs.plugins.griffe").addFilter(_KnownWarnings())


_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(~?)([A-Za-z_][\w.]*)</code>")


def _role_to_ref(m: re.Match[str]) -> str:
    tilde, target = m.group(1), m.group(2)
    title = target.rsplit(".", 1)[-1] if tilde else target
    return f'<autoref optional identifier="{target}"><code>{title}</code></autoref>'


def on_page_content(html: str, **kwargs: object) -> str:
    return _ROLE.sub(_role_to_ref, html)
