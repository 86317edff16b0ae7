"""``python -m benchmarks <name> [options]`` / ``python -m benchmarks demo``: see :mod:`benchmarks.common.cli`."""

import sys

from benchmarks.common.cli import main

sys.exit(main())
