"""Independent jobs, run on this machine's cores or on a Ray cluster.

A job is any picklable object with a ``run()`` method that returns a picklable result: a sweep
point, a policy to simulate, a leave-one-out refit. :func:`run_jobs` runs a list of them on a
:class:`Backend` and returns the results in job order, whatever order they finish in, so a
backend never changes what a command prints. Progress is reported as jobs finish; Ctrl-C
cancels what has not finished and re-raises.

The process pool needs nothing beyond the standard library. Ray is an optional extra
(``pip install -e '.[ray]'``); every node of a cluster needs the same version of tg installed,
since jobs are this package's own classes.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from taskgraph.errors import TgError
from taskgraph.files import Terminated, restore_handlers, sigterm_raises

BACKENDS = ("pool", "ray")
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Backend:
    """Where jobs run. ``pool``: a process pool of `workers` on this machine (all cores by
    default; 1 runs in this process). ``ray``: Ray tasks, on the cluster at `address` (``auto``:
    the cluster this node belongs to, or ``ray://host:10001``), or on a local Ray started for
    the run and stopped after it when `address` is None."""

    kind: str = "pool"
    address: str | None = None
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in BACKENDS:
            raise TgError(f"--backend must be one of {', '.join(BACKENDS)}, not '{self.kind}'.")
        if self.address is not None and self.kind != "ray":
            raise TgError("--ray-address names a Ray cluster; it needs --backend ray.")


LOCAL = Backend()


def run_jobs(jobs: Sequence[Any], backend: Backend = LOCAL,
             progress: Progress | None = None) -> list[Any]:
    """Each job's ``run()`` result, in job order."""
    if not jobs:
        return []
    if backend.kind == "ray":
        return _run_ray(jobs, backend.address, progress)
    workers = min(backend.workers or os.cpu_count() or 1, len(jobs))
    if workers == 1:
        results = []
        for i, job in enumerate(jobs):
            results.append(job.run())
            if progress:
                progress(i + 1, len(jobs))
        return results
    return _run_pool(jobs, workers, progress)


def _run_pool(jobs: Sequence[Any], workers: int, progress: Progress | None) -> list[Any]:
    # SIGTERM ends the workers with this process, as Ctrl-C does (by default this process would
    # die alone and they would run on). Its handler is set before the workers start, so none
    # can be left by a SIGTERM that arrives as they do; each worker restores the default action.
    with sigterm_raises(_Terminated):
        return _pooled(jobs, workers, progress)


def _pooled(jobs: Sequence[Any], workers: int, progress: Progress | None) -> list[Any]:
    main = threading.current_thread() is threading.main_thread()
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_worker_start,
                               initargs=(os.getpid(),))
    finished = 0
    try:
        # The workers start (fork) in the first submit. A signal handled in the middle of that
        # would leave a started worker unknown to the pool, never killed, and this process
        # waiting for it at exit: Ctrl-C and SIGTERM wait until the pool knows them all.
        with _signals_held(main):
            futures = [pool.submit(_run, job) for job in jobs]
        index = {f: i for i, f in enumerate(futures)}
        results: list[Any] = [None] * len(jobs)
        pending: set[Future] = set(futures)
        while pending:
            # A bounded wait: an unbounded one would hold Ctrl-C until a job finishes.
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            for f in done:
                results[index[f]] = f.result()
                finished += 1
            if done and progress:
                progress(finished, len(jobs))
        pool.shutdown()
        return results
    except BaseException as err:
        # Stop now: drop what is queued and end the workers rather than wait for every job.
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            # SIGKILL: a handler installed before the fork (Ray installs one) can survive SIGTERM.
            proc.kill()
        if isinstance(err, KeyboardInterrupt):
            _say_interrupted(finished, len(jobs))
            err.said = True           # the CLI's own "interrupted." would repeat it
        if isinstance(err, _Terminated):
            _say_interrupted(finished, len(jobs), "terminated")
            raise Terminated(signal.SIGTERM, said=True) from None
        raise


_HELD = {signal.SIGINT, signal.SIGTERM}


@contextmanager
def _signals_held(main: bool) -> Iterator[None]:
    """Ctrl-C and SIGTERM arrive after the block, not in it (where the OS can hold them)."""
    if not (main and hasattr(signal, "pthread_sigmask")):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Terminated(BaseException):
    """SIGTERM while jobs run: a BaseException, so that no `except Exception` on the way out
    (a job's error handling) takes it for a job's failure."""


def _worker_start(parent: int) -> None:
    """A pool worker's start: SIGTERM ends it (the parent's handler is the parent's), it is
    killed when tg dies, however tg dies (kill -9 included, where no handler runs), on Linux,
    and one whose parent is already gone ends at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)      # held by the parent as it forked
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


def _run_ray(jobs: Sequence[Any], address: str | None, progress: Progress | None) -> list[Any]:
    ray = require_ray()
    check_reachable(address)
    stops = _Stops()
    results: dict[int, Any] = {}
    try:
        with stops:
            if ray.is_initialized():      # a Ray this process joined already: its owner's to stop
                _ray_jobs(ray, jobs, results, progress, stops)
            else:
                with _ray_session(ray, address, stops):
                    _ray_jobs(ray, jobs, results, progress, stops)
    except KeyboardInterrupt as err:
        signum = stops.received[0] if stops.received else signal.SIGINT
        _say_interrupted(len(results), len(jobs), _HOW[signum])
        if signum == signal.SIGINT:
            err.said = True
            raise
        raise Terminated(signum, said=True) from None
    return [results[i] for i in range(len(jobs))]


def _ray_jobs(ray: Any, jobs: Sequence[Any], results: dict[int, Any],
              progress: Progress | None, stops: _Stops) -> None:
    """Each job's result into `results` by its index, as it finishes."""
    task = ray.remote(_run)
    refs = [task.remote(job) for job in jobs]
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.25)
            for ref in done:
                results[index[ref]] = _get(ray, ref)
            if done and progress:
                progress(len(results), len(jobs))
            stops.check()
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise


@contextmanager
def _ray_session(ray: Any, address: str | None, stops: _Stops) -> Iterator[None]:
    """Ray started (or a cluster joined) for the run and stopped after it however it ends: a
    local Ray's processes end with it, and its files (a session folder in the temp dir, which
    Ray never removes) are kept in a folder of the run's own and removed."""
    before = _descendants()
    temp = _temp_folder() if address is None else None
    adopting = _adopt_orphans(True)
    try:
        with _ray_starting(ray, stops):
            try:
                # Workers' log lines would interleave with tg's tables; their errors still
                # arrive as exceptions from ray.get.
                # "local": a Ray of its own for this run, even where a cluster is already
                # running on this machine (ray.init() would join that one)
                ray.init(address=address or "local", include_dashboard=False,
                         log_to_driver=False, logging_level=logging.WARNING, _temp_dir=temp)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise TgError(f"--ray-address {address or '(local)'}: could not start or join "
                              f"a Ray cluster ({err}). For an existing cluster run `ray start "
                              "--head` on one node and pass --ray-address auto on it.") from None
            finally:
                stops.install()       # again: a Ray without the names above sets its own
        yield
    finally:
        stops.hold()
        try:
            ray.shutdown(wait_for_processes=True)
        except TypeError:         # an older Ray, which cannot wait for them
            ray.shutdown()
        # Processes the raylet started can outlive it (they are this process's children now)
        _end_new(before)
        _adopt_orphans(adopting)
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


def _temp_folder() -> str:
    """A folder for a local Ray's files. Its sockets go 64 bytes deeper and their paths may not
    pass 107 (AF_UNIX): where the temp dir is too deep for that (macOS's is), one in /tmp."""
    temp = tempfile.mkdtemp(prefix="tg-ray-")
    if len(os.fsencode(temp)) + 64 <= 107 or not os.path.isdir("/tmp"):
        return temp
    os.rmdir(temp)
    return tempfile.mkdtemp(prefix="tg-ray-", dir="/tmp")


@contextmanager
def _ray_starting(ray: Any, stops: _Stops) -> Iterator[None]:
    """tg's signal handlers kept through ray.init, which as it starts sets a SIGTERM handler of
    its own (sys.exit: status 15, or 1 from inside Ray's waits) and has its C++ core add one
    that prints a stack trace and may abort. A signal that stopped ray.init as it built that
    core (`connect`) left it half-built, and tg crashed at exit (SIGSEGV): one then waits for
    `connect` to finish, a second or so. These are Ray's private names; a Ray that lacks one
    is left as it is."""
    private = ray._private
    connect = getattr(private.worker, "connect", None)

    def connect_whole(*args: Any, **kwargs: Any) -> Any:
        with stops.deferred():
            return connect(*args, **kwargs)

    changes = [(private.utils, "set_sigterm_handler", lambda handler: None),
               (private.ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", True),
               (private.worker, "connect", connect_whole)]
    saved = [(where, name, getattr(where, name)) for where, name, _ in changes
             if hasattr(where, name)]
    for where, name, value in changes:
        if hasattr(where, name):
            setattr(where, name, value)
    try:
        yield
    finally:
        for where, name, value in saved:
            setattr(where, name, value)


def _adopt_orphans(on: bool) -> bool:
    """Makes orphaned descendants of this process its children rather than init's (Linux's
    child subreaper), so that those left by Ray's raylet can be found and ended; returns
    whether it was so before."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        was = ctypes.c_int(0)
        libc.prctl(37, ctypes.byref(was))          # PR_GET_CHILD_SUBREAPER
        libc.prctl(36, int(on))                     # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False
    return bool(was.value)


def _descendants() -> dict[int, Any]:
    """This process's descendants (psutil processes by pid; none where psutil, which Ray
    brings, is missing)."""
    try:
        import psutil
    except ImportError:
        return {}
    try:
        return {p.pid: p for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return {}


def _end_new(before: dict[int, Any]) -> None:
    """Kills the descendants of this process not among `before` and waits for them."""
    for _ in range(3):          # one being killed may have started another
        new = [p for pid, p in _descendants().items() if pid not in before]
        if not new:
            return
        import psutil

        for proc in new:
            try:
                proc.kill()        # psutil's kill spares a process whose pid was reused
            except psutil.Error:
                pass
        psutil.wait_procs(new, timeout=10)


class _Stops:
    """SIGINT, SIGTERM and SIGHUP while Ray runs. The first stops the run as Ctrl-C does, by
    KeyboardInterrupt: the only exception Ray passes on from a handler run inside its waits
    (SystemExit comes out as SystemExit(1), anything else is printed and dropped). One that
    comes while Ray builds its core or is being shut down is noted and acted on after that,
    and the others are noted only, so that none cuts short either, or the clean-up."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.main = threading.current_thread() is threading.main_thread()
        self.before: dict[int, Any] = {}
        self.held = False
        self.unraisable = sys.unraisablehook

    def install(self) -> None:
        if not self.main:
            return
        for sig in _STOPS:
            previous = signal.signal(sig, self.stop)
            self.before.setdefault(sig, previous)

    def stop(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if len(self.received) == 1 and not self.held:
            raise KeyboardInterrupt

    def dropped(self, unraisable: Any) -> None:
        """sys.unraisablehook: a KeyboardInterrupt raised where Python drops it (in an at-fork
        hook, as Ray starts a process) goes unprinted; `check` acts on its signal."""
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and self.received):
            self.unraisable(unraisable)

    def hold(self) -> None:
        self.held = True

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.held = True
        try:
            yield
        finally:
            self.held = False
        self.check()

    def check(self) -> None:
        """Stops the run for a signal that came while held, or whose KeyboardInterrupt was
        dropped."""
        if self.received:
            raise KeyboardInterrupt

    def __enter__(self) -> _Stops:
        self.install()
        if self.main:
            sys.unraisablehook = self.dropped
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        restore_handlers(self.before)     # a signal pending then is in self.received: checked
        if self.main:
            sys.unraisablehook = self.unraisable
        if kind is None:          # one held through the shutdown
            self.check()


_STOPS = [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
          if hasattr(signal, name)]
_HOW = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
if hasattr(signal, "SIGHUP"):
    _HOW[signal.SIGHUP] = "hung up"


def _get(ray: Any, ref: Any) -> Any:
    """A Ray task's result; a job's own error is raised as itself, as the pool raises it."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, ModuleNotFoundError) and "taskgraph" in str(cause):
            raise TgError("The Ray workers cannot import tg: install the same version of tg "
                          "(pip install -e '.[ray]') on every node of the cluster.") from None
        if isinstance(cause, Exception):
            raise cause from None
        raise


def check_reachable(address: str | None) -> None:
    """A HOST:PORT that nothing answers on, or that accepts and never answers, or answers but not
    as Ray, fails here within seconds; Ray itself retries for minutes."""
    if address is None or address == "auto" or address.startswith(("local", "anyscale://")):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise TgError(f"--ray-address '{address}' must be 'auto', HOST:PORT of a Ray head "
                      "node, or ray://HOST:PORT of its client server.")
    try:
        conn = socket.create_connection((host, int(port)), timeout=5)
    except OSError as err:
        raise TgError(f"--ray-address {address}: nothing answers there ({err}). Start the "
                      "cluster with `ray start --head` and pass the address it prints, or "
                      "--ray-address auto on one of its nodes.") from None
    # A port that accepts is not yet a Ray node: ray.init waits for minutes on one that never
    # answers. A Ray head (its GCS) and Ray's client server speak gRPC, so sent HTTP/2's client
    # preface they answer at once with a SETTINGS frame.
    reply = b""
    try:
        with conn:
            conn.settimeout(ANSWER_S)
            conn.sendall(_HTTP2_PREFACE)
            while len(reply) < 9:
                chunk = conn.recv(9 - len(reply))
                if not chunk:
                    break
                reply += chunk
    except TimeoutError:
        raise TgError(f"--ray-address {address}: something accepts connections there but does "
                      f"not answer within {ANSWER_S:g} s; it is not a Ray node that is up. Check "
                      "the address `ray start --head` printed.") from None
    except OSError as err:
        raise TgError(f"--ray-address {address}: the connection failed ({err}).") from None
    if len(reply) < 9 or reply[3] != 0x04:
        raise TgError(f"--ray-address {address}: what answers there is not a Ray node (it does "
                      "not speak gRPC). Check the address `ray start --head` printed.")


#: Seconds a Ray address may take to answer (a gRPC server answers in milliseconds).
ANSWER_S = 10.0
# HTTP/2's client connection preface, then an empty SETTINGS frame (RFC 9113, 3.4 and 6.5).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise TgError("--backend ray needs Ray, an optional extra: pip install -e '.[ray]'."
                      ) from None
    return ray


def _run(job: Any) -> Any:
    return job.run()


def _say_interrupted(done: int, total: int, how: str = "interrupted") -> None:
    print(f"tg: {how} with {done} of {total} jobs finished; the rest were cancelled.",
          file=sys.stderr)
