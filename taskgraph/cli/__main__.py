"""`python -m taskgraph.cli`: the `tg` command."""

import sys

from taskgraph.cli import main

sys.exit(main())
