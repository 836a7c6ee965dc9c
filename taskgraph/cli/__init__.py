"""The `tg` command line (docs/design.md §5): wiring over the Python API (:mod:`taskgraph.api`).

``parsing`` turns a command line into arguments and checks every output path before any work;
``verbs`` runs each verb through the API and prints its result: JSON on stdout with ``--json``,
tables on stderr otherwise. Nothing here computes what a verb reports.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable

from taskgraph.cli.parsing import check_outputs, parser
from taskgraph.cli.verbs import TraceInterrupted
from taskgraph.errors import TgError
from taskgraph.files import forget_inputs


def main(argv: list[str] | None = None) -> int:
    parser_ = parser()
    args = parser_.parse_args(argv)
    if not getattr(args, "func", None):
        parser_.print_help(sys.stderr)
        return 2
    restore = _exit_on_termination()
    try:
        forget_inputs()                 # what this run reads, no output of it may replace
        check_outputs(args)
        return args.func(args) or 0
    except TraceInterrupted:
        print(f"tg {args.command}: interrupted while writing the trace; the results above "
              f"are complete, {args.trace} was left as it was.", file=sys.stderr)
        return 130
    except BrokenPipeError:       # e.g. `tg ... --json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except TgError as err:
        print(f"tg {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"tg {args.command}: interrupted.", file=sys.stderr)
        return 130
    finally:
        restore()



def _exit_on_termination() -> Callable[[], Any]:
    """SIGTERM and SIGHUP end the run as an exit (status 128 + the signal) raised where it is,
    so that every `finally` runs: a half-written output is removed (files.atomic_path) and
    child processes are stopped by their owners, as after Ctrl-C. Without this the process
    died where it stood, leaving a 1.3 GB partial trace."""
    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():   # only it may set handlers
        return lambda: None
    signals = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    before = {sig: signal.signal(sig, stop) for sig in signals}
    return lambda: [signal.signal(sig, old) for sig, old in before.items()]

