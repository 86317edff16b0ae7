"""Suite-wide test settings: the order in which ``pytest -n 2 --dist loadfile`` (``make test``) hands out files.

With ``--dist loadfile`` each xdist worker runs whole files and takes the next one from a queue when it is
nearly done. pytest-xdist orders that queue by the number of tests per file, so a long file with few tests
(a benchmark smoke run, mypy) could start last and keep one worker busy while the other idles. Here the queue
starts with the slowest files, longest first (greedy longest-processing-time), so both workers finish
together. Only the order changes: every test still runs, each file in one worker as before.
"""

from __future__ import annotations

import pytest

#: The slowest test files, longest first (seconds of one whole-suite run on 2 cores; every other file takes a few
#: seconds and keeps its collection order after these).
SLOWEST_FIRST = (
    "test_conformance.py",
    "test_conformance_resume.py",
    "test_ray_engine.py",
    "test_bench_transfer.py",
    "test_examples.py",
    "test_ray_attach.py",
    "test_reliability.py",
    "test_bench_soak.py",
    "test_typecheck.py",
    "test_example_grpo_vlm.py",
    "test_accelerate.py",
    "test_encoder_distributed.py",
    "test_integrations_transformers.py",
    "test_shards.py",
    "test_bench_learning.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # keep the collection order below (xdist's --loadscope-reorder would sort files by their test count)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file stays in one piece
