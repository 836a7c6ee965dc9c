"""`python -m taskgraph.cli`: the `tg` command."""

import sys

from taskgraph.cli import main

# Guarded: processes spawned by multiprocessing (tg execute --processes) import this module again
# as __mp_main__, and must not run the command again.
if __name__ == "__main__":
    sys.exit(main())
