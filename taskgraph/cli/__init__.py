"""The `tg` command line (docs/design.md §5): wiring over the Python API (:mod:`taskgraph.api`).

``parsing`` turns a command line into arguments and checks every output path before any work;
``verbs`` runs each verb through the API and prints its result: JSON on stdout with ``--json``,
tables otherwise, both on stdout; progress and diagnostics go to stderr). Nothing here
computes what a verb reports.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

from taskgraph.errors import LongRunWarning, TgError
from taskgraph.files import (Terminated, command_inputs, exit_on_termination, path_error,
                             printable)


@contextlib.contextmanager
def announced(command: str):
    """A long run's warning (taskgraph.sim.simulate.LongRunWarning) printed as one line on
    stderr as soon as it is known, before the work, whether or not stderr is a terminal."""
    def show(message, category, *rest, previous=warnings.showwarning):
        if issubclass(category, LongRunWarning):
            print(f"tg {command}: note: {printable(str(message))}", file=sys.stderr,
                  flush=True)
        else:
            previous(message, category, *rest)
    with warnings.catch_warnings():
        warnings.simplefilter("always", LongRunWarning)
        warnings.showwarning = show
        yield


def main(argv: list[str] | None = None) -> int:
    try:      # the API and every verb: half a second, in which a Ctrl-C or a SIGTERM is a clean
        with exit_on_termination():      # exit too (a SIGTERM killed it there, saying nothing)
            from taskgraph.cli.parsing import check_outputs, parser
    except KeyboardInterrupt:
        print("tg: interrupted.", file=sys.stderr)
        return 130
    except Terminated as end:
        print(f"tg: stopped by {end.signal_name}.", file=sys.stderr)
        end.pass_on()
        return end.code
    parser_ = parser()
    try:
        args = parser_.parse_args(argv)
    except SystemExit as done:        # --help, --version, or a usage error (status 2)
        return done.code
    if not getattr(args, "func", None):
        parser_.print_help(sys.stderr)
        return 2
    try:
        with exit_on_termination(), command_inputs(), announced(args.command):
            check_outputs(args)           # no output may replace what the command reads
            return args.func(args) or 0
    except BrokenPipeError:       # e.g. `tg ... --json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except TgError as err:
        print(f"tg {args.command}: error: {printable(str(err))}", file=sys.stderr)
        return err.exit_code
    except OSError as err:      # the API turns a bad path into a TgError; this is the rest
        error = path_error(err)
        if error is None:
            raise
        print(f"tg {args.command}: error: {printable(str(error))}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt as err:   # a file being written is left as it was (atomic_path)
        if not getattr(err, "said", False):         # the jobs' runner says how far they got
            print(f"tg {args.command}: interrupted.", file=sys.stderr)
        return 130
    except Terminated as end:
        if not end.said:                  # the jobs' runner says how far they got
            print(f"tg {args.command}: stopped by {end.signal_name}.", file=sys.stderr)
        end.pass_on()
        return end.code
