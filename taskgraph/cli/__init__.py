"""The `tg` command line (docs/design.md §5): wiring over the Python API (:mod:`taskgraph.api`).

``parsing`` turns a command line into arguments and checks every output path before any work;
``verbs`` runs each verb through the API and prints its result: JSON on stdout with ``--json``,
tables on stderr otherwise. Nothing here computes what a verb reports.
"""

from __future__ import annotations

import os
import sys

from taskgraph.cli.parsing import check_outputs, parser
from taskgraph.errors import TgError
from taskgraph.files import command_inputs, exit_on_termination


def main(argv: list[str] | None = None) -> int:
    parser_ = parser()
    try:
        args = parser_.parse_args(argv)
    except SystemExit as done:        # --help, --version, or a usage error (status 2)
        return done.code
    if not getattr(args, "func", None):
        parser_.print_help(sys.stderr)
        return 2
    try:
        with exit_on_termination(), command_inputs():   # no output may replace what it reads
            check_outputs(args)
            return args.func(args) or 0
    except BrokenPipeError:       # e.g. `tg ... --json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except TgError as err:
        print(f"tg {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:       # a file being written is left as it was (atomic_path)
        print(f"tg {args.command}: interrupted.", file=sys.stderr)
        return 130
