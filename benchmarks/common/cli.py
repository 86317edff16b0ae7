"""The ``python -m benchmarks`` command, and the script entry point of each driver.

``python -m benchmarks <name> [options]`` runs benchmark ``<name>`` (:data:`benchmarks.BENCHMARKS`), and
``python -m benchmarks demo`` the demo. Each driver exposes ``add_arguments(parser)`` and ``run(args) -> int``;
only the module of the command named on the command line is imported, so a benchmark's optional dependencies
load only when it runs. ``knitdata bench <name>`` and ``knitdata demo`` call :func:`main` with their own
program name.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from benchmarks import BENCHMARKS, DEMO

__all__ = ["RESULTS", "build_parser", "child_env", "main", "run_script", "script_main"]


def _attach(p: argparse.ArgumentParser, module: str) -> None:
    mod = importlib.import_module(module)
    if mod.__doc__:
        p.description = mod.__doc__.strip()
        p.formatter_class = argparse.RawDescriptionHelpFormatter
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)


def build_parser(argv: Sequence[str] = (), prog: str = "python -m benchmarks", demo: bool = True
                 ) -> argparse.ArgumentParser:
    """Build the argument parser; only the module of the command named first in ``argv`` is imported.

    Args:
        argv: The command line (its first word picks the module to import).
        prog: The program name shown in help and usage (``knitdata bench`` when forwarded).
        demo: Offer the ``demo`` command.
    """
    parser = argparse.ArgumentParser(prog=prog, description="knitdata's benchmarks and demo (run from a checkout).")
    sub = parser.add_subparsers(dest="command", metavar="NAME")
    first = list(argv)[:1]
    if demo:
        p = sub.add_parser("demo", help=DEMO[1], description=DEMO[1])
        if first == ["demo"]:
            _attach(p, DEMO[0])
    for name, (module, help_) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if first == [name]:
            _attach(p, module)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks", demo: bool = True) -> int:
    """Run the command named in ``argv`` (default: the process's command line).

    Args:
        argv: Arguments, e.g. ``["transfer", "--smoke"]``.
        prog: The program name shown in help and usage.
        demo: Offer the ``demo`` command.

    Returns:
        The exit code: the command's, or 2 when no command is named.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv, prog, demo)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    return int(run(args) or 0)


def script_main(module: ModuleType, name: str, results_dir: str, argv: Sequence[str] | None = None) -> int:
    """Run benchmark ``module`` as a script: ``--json``/``--plot`` default to ``results_dir/<name>.json|png``.

    Args:
        module: A driver module (``add_arguments``, ``run``).
        name: The file stem of its results.
        results_dir: Folder of the default result files (created if missing).
        argv: Arguments (default: the command line).

    Returns:
        The benchmark's exit code.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    doc = (module.__doc__ or name).strip().splitlines()[0]
    parser = argparse.ArgumentParser(description=doc)
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    os.makedirs(results_dir, exist_ok=True)
    if getattr(args, "json", None) is None:
        args.json = os.path.join(results_dir, f"{name}.json")
    if getattr(args, "plot", "") is None:
        try:
            import matplotlib  # noqa: F401

            args.plot = os.path.join(results_dir, f"{name}.png")
        except ImportError:
            pass
    return int(module.run(args) or 0)


#: The default folder of result files: ``benchmarks/results`` of this checkout.
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that imports ``benchmarks``: this process's, with the checkout's root
    first on ``PYTHONPATH`` (whatever the working directory), plus ``extra``.

    Args:
        **extra: Variables to set in the child.
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [root, *[x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x and x != root]]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}


def run_script(name: str, argv: Sequence[str] | None = None) -> int:
    """The entry of ``python benchmarks/<name>.py``: the driver's own ``main`` if it has one, else
    :func:`script_main` writing into :data:`RESULTS`.

    The driver is imported as ``benchmarks.<name>`` (not run as ``__main__``), so what its worker processes
    unpickle names the package module.

    Args:
        name: The driver's module name in :mod:`benchmarks`.
        argv: Arguments (default: the command line).

    Returns:
        The exit code.
    """
    mod = importlib.import_module(f"benchmarks.{name}")
    main_fn = getattr(mod, "main", None)
    if main_fn is not None:
        return int(main_fn(argv) or 0)
    return script_main(mod, name, RESULTS, argv)
