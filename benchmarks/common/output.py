"""Result output shared by the drivers: the command line that produced a result, strict JSON files, plots."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["command_line", "pyplot", "strict_json", "write_json"]


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that runs this process, as a user would type it (recorded in results).

    ``python -m benchmarks NAME ...``, ``knitdata bench NAME ...`` / ``python -m knitdata ...``, or
    ``python SCRIPT ...``.

    Args:
        argv: The process's arguments (default ``sys.argv``).
    """
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "python"
    head = os.path.abspath(argv[0])
    rest = " ".join(argv[1:])
    if head.endswith(os.path.join("benchmarks", "__main__.py")):
        return f"python -m benchmarks {rest}".rstrip()
    if os.path.basename(head) in ("__main__.py", "knitdata"):
        return f"knitdata {rest}".rstrip()
    return f"python {' '.join(argv)}"


def strict_json(o: Any) -> Any:
    """``o`` with NaN/inf floats as ``None`` and tuples as lists (strict JSON)."""
    if isinstance(o, float):
        return None if (math.isnan(o) or math.isinf(o)) else o
    if isinstance(o, Mapping):
        return {str(k): strict_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [strict_json(v) for v in o]
    return o


def write_json(path: str, obj: Any, indent: int = 1, strict: bool = False) -> None:
    """Write ``obj`` as JSON to ``path`` (its folder created if missing) and say so on stdout.

    Args:
        path: The file to write.
        obj: A JSON-serialisable value.
        indent: Indentation of the file.
        strict: Write NaN/inf as ``null`` (:func:`strict_json`) and refuse any other non-standard value.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        if strict:
            json.dump(strict_json(obj), f, indent=indent, allow_nan=False)
        else:
            json.dump(obj, f, indent=indent)
    print(f"wrote {path}")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only), for a benchmark's ``--plot``.

    Raises:
        OptionalDependencyError: If matplotlib is not installed (it names the ``--plot`` option).
    """
    from knitdata.errors import OptionalDependencyError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise OptionalDependencyError("matplotlib", "plot", "--plot") from e
    return plt
