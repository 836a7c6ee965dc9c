"""Which method of the executor's runtime runs which task kind: a method marked
``@runs("Name")`` (:class:`taskgraph.exec.runtime.Runtime`, its parts and subclasses)."""

from __future__ import annotations

from typing import Callable


def runs(kind: str) -> Callable[[Callable], Callable]:
    """Mark a method as the executor's work for a task kind (:meth:`Runtime.kernels`)."""
    def mark(method: Callable) -> Callable:
        method.runs = kind
        return method
    return mark


def marked(cls: type) -> dict[str, str]:
    """The kinds the methods of a class and of its bases marked ``@runs`` run, and those
    methods' names (a class's own mark overriding its bases')."""
    kernels: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        kernels.update({fn.runs: name for name, fn in vars(klass).items()
                        if hasattr(fn, "runs")})
    return kernels
