"""``python -m knitdata`` runs the ``knitdata`` command."""

import sys

from knitdata.cli import main

sys.exit(main())
