"""Errors a user can act on.

Anything raised as a :class:`TgError` reaches the user as one paragraph on stderr and a non-zero
exit; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class TgError(Exception):
    """Bad input or an impossible request, explained in one paragraph that names the field."""

    exit_code = 2


class ScheduleError(TgError):
    """A schedule that cannot run: it launches a task before a task it depends on, or its
    description contradicts the policy it is asked to run."""


class MemoryFitError(TgError):
    """A policy that does not fit in GPU or CPU memory."""


class CheckFailed(TgError):
    """An ``expect`` gate in a scenario did not hold."""

    exit_code = 1


class LongRunWarning(UserWarning):
    """Work that will take minutes, said before it starts (the command line prints it as a
    note on stderr at once, on a terminal or not): a typo such as gen_len=9000000 is caught
    before hours go by."""
