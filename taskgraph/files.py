"""Writing output files whole or not at all.

Every file tg writes (traces, plots, profiles, CSV, JSONL) goes through :func:`atomic_path`: the
content is written to a temporary file of its own beside the target and renamed over it only once
complete. So an interrupted or failed write leaves the previous file (or none), never half of one,
and two runs writing the same path each leave a valid file: the last to finish wins.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import re
import signal
import stat
import tempfile
import threading
import zlib
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from taskgraph.errors import TgError

# Every file the running command or API call has read (resolved): no output may replace one
# of them. A context variable, so that calls running at once in several threads each have their
# own (with what the calls around them read); the executor's threads run in a copy of their
# call's context (exec.dispatch), and the set itself is shared by reference with them. None
# outside any command or call: library functions called directly keep nothing.
_INPUTS: ContextVar[set[Path] | None] = ContextVar("tg_inputs", default=None)
# Inside a command line (command_inputs): its calls share its one set.
_IN_COMMAND: ContextVar[bool] = ContextVar("tg_in_command", default=False)


def note_input(path: str | Path) -> None:
    """Remember that this run read `path` (a scenario, profile, request list, prompts file,
    checkpoint file...): :func:`atomic_path` refuses to replace it."""
    inputs = _INPUTS.get()
    if inputs is None:
        return
    try:
        inputs.add(Path(path).resolve())
    except (OSError, RuntimeError):      # an unresolvable path was not read either
        pass


#: The largest input file tg reads (a 1,000,000-request list is ~20 MB).
MAX_INPUT_BYTES = 512 * 2**20


def read_text(path: str | Path, what: str) -> str:
    """The one way tg reads a text input (scenario, profile, config, measurements, request list,
    prompts): :func:`read_bytes`, as UTF-8 with or without a byte-order mark."""
    data = read_bytes(path, what)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise TgError(f"The {what} '{path}' is not UTF-8 text (byte {err.start}).") from None


def read_bytes(path: str | Path, what: str, gunzip: bool = False) -> bytes:
    """The bytes of an input file: a regular file (a pipe or a device would hang or never end),
    at most MAX_INPUT_BYTES, and, `gunzip`, at most that once inflated (a few MB of gzip can
    inflate to many GB); noted as an input of this run."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        st = None
    if st is None or stat.S_ISDIR(st.st_mode):
        raise TgError(f"The {what} '{path}' does not exist (or is not a file).")
    if not stat.S_ISREG(st.st_mode):
        raise TgError(f"The {what} '{path}' is not a regular file (a pipe or a device); give a "
                      "file.")
    if st.st_size > MAX_INPUT_BYTES:
        raise TgError(f"The {what} '{path}' is {st.st_size / 2**20:,.0f} MiB; tg reads input "
                      f"files of at most {MAX_INPUT_BYTES // 2**20} MiB.")
    note_input(path)
    try:
        if not gunzip:
            return path.read_bytes()
        with gzip.open(path, "rb") as f:
            data = f.read(MAX_INPUT_BYTES + 1)       # never more, whatever the header claims
    except (gzip.BadGzipFile, EOFError, zlib.error):
        raise TgError(f"The {what} '{path}' is not gzip data, or is truncated.") from None
    except OSError as err:
        raise TgError(f"The {what} '{path}' cannot be read: {err.strerror or err}.") from None
    if len(data) > MAX_INPUT_BYTES:
        raise TgError(f"The {what} '{path}' inflates to more than "
                      f"{MAX_INPUT_BYTES // 2**20} MiB; tg reads input files of at most that.")
    return data


def read_json(path: str | Path, what: str) -> Any:
    """A JSON input read as every text input is (:func:`read_text`); a document JSON cannot
    hold (bad syntax, a number of more than 4,300 digits, nesting deeper than Python's stack)
    is one error naming the file."""
    return parsed_json(read_text(path, what), f"{what} '{path}'")


def parsed_json(text: str, what: str, parse: Callable[[str], Any] = json.loads) -> Any:
    """`parse(text)` (json's own, or a reader built on its decoder), what JSON cannot hold one
    error naming `what`."""
    try:
        return parse(text)
    except json.JSONDecodeError as err:
        raise TgError(f"The {what} is not valid JSON: {err.msg} at line {err.lineno}.") from None
    except (ValueError, RecursionError):
        raise TgError(f"The {what} holds a number of more than 4,300 digits or nests deeper "
                      "than JSON can be read.") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def command_inputs() -> Iterator[None]:
    """One command line: it starts with no inputs read, and what any of its calls reads stays
    an input to its end (it writes a trace after the verb's call returns)."""
    inputs, command = _INPUTS.set(set()), _IN_COMMAND.set(True)
    try:
        yield
    finally:
        _IN_COMMAND.reset(command)
        _INPUTS.reset(inputs)


@contextmanager
def inputs_of_call() -> Iterator[None]:
    """A call of the Python API: what it reads is an input while it runs (with what its caller
    read), and, outside a command line, not after it, so that a notebook's next call may write a
    file an earlier one read. Each call has its own set: calls in several threads at once
    neither see nor clear each other's."""
    if _IN_COMMAND.get():
        yield
        return
    token = _INPUTS.set(set(_INPUTS.get() or ()))
    try:
        yield
    finally:
        _INPUTS.reset(token)


def refuse_input(path: str | Path, flag: str = "") -> None:
    """A clear error if writing `path` would replace a file this run read."""
    try:
        target = Path(path).resolve()
    except (OSError, RuntimeError):
        return
    if target in (_INPUTS.get() or ()):
        raise TgError(f"{flag + ' ' if flag else ''}'{path}' is an input of this run; writing "
                      "it would replace it. Choose another path.")


class Output(str):
    """A path a run will write: a file ending in one of `suffixes` (any, if none), or a folder
    (`folder`) whose files named in `holds` it writes."""

    def __new__(cls, text: str, *suffixes: str, folder: bool = False,
                holds: tuple[str, ...] = ()) -> "Output":
        path = super().__new__(cls, text)
        path.suffixes, path.folder, path.holds = suffixes, folder, holds
        return path


@dataclass(frozen=True)
class Folder:
    """What a parameter of an API verb names when the verb writes a folder there, and the
    files of fixed names it writes in it (``taskgraph.api.verb``)."""

    holds: tuple[str, ...] = ()


def output_path(text: str, spec: tuple[str, ...] | Folder) -> Output:
    """`text` as the path a verb writes at a parameter declared `spec`: a file ending in one
    of the suffixes `spec` holds (any, if none), or a :class:`Folder`."""
    if isinstance(spec, Folder):
        return Output(text, folder=True, holds=spec.holds)
    return Output(text, *spec)


def checked_outputs(writes: dict[str, tuple[str, ...] | Folder], given: dict[str, Any]
                    ) -> dict[str, Output]:
    """The outputs an API call names (its arguments `given`, at the parameters `writes`
    declares), by the option that names each on the command line, checked before any work
    (:func:`check_outputs`) against each other and the inputs the call names."""
    outputs = {}
    for name, spec in writes.items():
        flag, path = f"--{name.replace('_', '-')}", given.get(name)
        if path is None:
            continue
        text = os.fspath(path) if isinstance(path, os.PathLike) else path
        if not isinstance(text, str):
            raise TgError(f"{flag} is a path (a str or os.PathLike), not "
                          f"{type(path).__name__}.")
        outputs[flag] = output_path(text, spec)
    # what no output may replace: the inputs the command line names too
    inputs = [given[k] for k in ("scenario", "measurements", "prompts")
              if isinstance(given.get(k), (str, os.PathLike))]
    check_outputs(outputs, inputs)
    return outputs


# The outputs of the API call running (flag -> Output): a file its scenario names (a profile,
# a request list) may not be one of them. Per call, as the inputs are.
_WRITING: ContextVar[dict[str, Output]] = ContextVar("writing", default={})


@contextmanager
def writing(outputs: dict[str, Output]) -> Iterator[None]:
    """An API call that will write `outputs` (:func:`checked_outputs`) runs inside this."""
    token = _WRITING.set(outputs)
    try:
        yield
    finally:
        _WRITING.reset(token)


def refuse_outputs_read() -> None:
    """A clear error if the running call will write over a file it has read."""
    for flag, path in _WRITING.get().items():
        refuse_input(path, flag)


def written_in_place(path: Path) -> bool:
    """A device or a pipe (``/dev/null``, ``/dev/stdout`` into a pipe): written where it is,
    never replaced by a file, so the folder it lies in need take no new file."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_outputs(outputs: dict[str, Output], inputs: list[str | Path]) -> None:
    """Every output a run will write, checked before any work, for a bad one must not cost a
    simulation: `outputs` maps the option that names one (``--trace``) to it. No output may
    replace an input or another."""
    inputs = [Path(p) for p in inputs]
    written: dict[Path, str] = {}
    for flag, text in outputs.items():
        if not text.strip():
            raise TgError(f"{flag} is empty; give a path.")
        plain_text(text, flag)
        try:
            _check_output(flag, text, inputs, written)
        except (OSError, ValueError) as err:        # a name too long, a folder not searchable
            raise TgError(f"{flag} '{text}' cannot be written: "
                          f"{getattr(err, 'strerror', None) or err}.") from None


def _check_output(flag: str, text: Output, inputs: list[Path], written: dict[Path, str]) -> None:
    folder, suffixes = text.folder, text.suffixes
    path = Path(text)
    try:
        where = path.resolve()
    except RuntimeError as err:                     # a loop of symbolic links
        raise TgError(f"{flag} '{text}' cannot be resolved: {err}.") from None
    if where in written:
        raise TgError(f"{flag} and {written[where]} name the same file '{text}'; one would "
                      "replace the other. Give each its own path.")
    written[where] = flag
    refuse_input(path, flag)
    for name in text.holds:
        refuse_input(path / name, flag)
    if path.exists() and path.is_dir() != folder:
        raise TgError(f"{flag} '{text}' is {'a file' if folder else 'a folder'}; give "
                      f"{'a folder' if folder else 'a file path'}.")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise TgError(f"{flag} '{text}' lies under '{parent}', which is a file.")
    # where the file (atomic_path writes beside the file a link names) or in the folder
    written_in = where if folder and where.is_dir() else next(
        (p for p in where.parents if p.exists()), None)
    if (written_in is not None and written_in.is_dir() and not written_in_place(path)
            and (why := _unwritable(written_in))):
        raise TgError(f"{flag} '{text}' cannot be written: nothing can be created in "
                      f"'{written_in}' ({why}).")
    for source in inputs:
        if path.exists() and source.exists() and path.resolve() == source.resolve():
            raise TgError(f"{flag} '{text}' is the input {source}; writing it would replace "
                          "it. Choose another path.")
    for name in text.holds:
        if (path / name).is_dir():
            raise TgError(f"{flag} '{text}' holds a folder '{name}' where a file of that name "
                          "is written; remove it or give another folder.")
    if suffixes and not folder and not text.endswith(suffixes):
        endings = ", ".join(suffixes[:-1]) + " or " + suffixes[-1] if len(suffixes) > 1 \
            else suffixes[0]
        raise TgError(f"{flag} '{text}' must end in {endings}.")


def _unwritable(folder: Path) -> str | None:
    """Why no file can be created in `folder`, or None. Found by creating one, for permission
    bits do not say (root, read-only mounts, /proc): found after a run, it lost the run."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as err:
        return err.strerror or type(err).__name__


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path to write `path`'s content to; it replaces `path` when the block ends
    without an exception (Ctrl-C included) and is removed otherwise. The temporary name keeps
    the target's suffixes, so writers that pick a format by suffix (matplotlib) still do.

    A symbolic link keeps pointing where it did (the file it points to is replaced); a device
    or a pipe (``/dev/null``) is written in place, never replaced by a file; a file this run
    read is never replaced (:func:`note_input`); and a failed write (no permission, a full disk,
    ``/dev/full``) is a clear error, the previous file left as it was."""
    path = Path(path)
    refuse_input(path)
    try:
        if written_in_place(path):
            yield path
            return
        target = path.resolve()          # (a loop of symbolic links raises here)
        if target.is_dir():
            raise TgError(f"'{path}' is a folder; give a file path.")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{target.stem}.",
                                    suffix=f".partial{''.join(target.suffixes)}",
                                    dir=target.parent)
        os.close(fd)
    except (OSError, RuntimeError) as err:
        raise TgError(f"Cannot write '{path}': {getattr(err, 'strerror', None) or err}.") \
            from None
    tmp = Path(name)
    try:
        yield tmp
        # mkstemp makes the file private; the result gets the mode the file had, or the umask's
        os.chmod(tmp, target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask())
        os.replace(tmp, target)
    except OSError as err:
        raise TgError(f"Cannot write '{path}': {err.strerror or err}; the previous file, if "
                      "any, is as it was.") from None
    finally:
        tmp.unlink(missing_ok=True)


# C0 and C1 control characters but tab and newline, and the bidirectional formatting ones: an
# escape sequence in a name would reach the terminal of whoever reads the table, and U+202E
# would show it reversed.
# What a name or an id may not hold (a tab or a newline may be in text a user wrote).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                      "\u2066-\u2069]")
# What a message may not show raw: those, and newlines and tabs (and U+2028 and U+2029, the line
# and paragraph separators), for a message is one paragraph and a newline in it came from a
# value (a path), splitting the message over lines.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e"
                          "\u2066-\u2069]")
# A run of this many characters without a space in a message is a value, not prose: cut.
_LONG_RUN = re.compile(r"\S{200,}")
#: The longest message shown whole (the longest tg writes, listing every preset, is ~700):
#: a longer one echoes a value with spaces in it, cut in the middle (the field is named at the
#: start, what to do at the end).
LONGEST_MESSAGE = 2_000


def printable(message: str) -> str:
    """A message as it may reach a terminal: each control or bidirectional character shown as
    its escape, each run of 200 or more characters without a space (a 100,000-character bad
    value, whatever option echoed it) cut to its first 120 and its length, and a message
    longer than :data:`LONGEST_MESSAGE` to its first 1,000 and last 500 characters."""
    message = _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], message)
    message = _LONG_RUN.sub(lambda m: f"{m.group()[:120]}...({len(m.group()):,} characters)",
                            message)
    if len(message) > LONGEST_MESSAGE:
        message = (f"{message[:1_000]}...({len(message) - 1_500:,} characters)..."
                   f"{message[-500:]}")
    return message


#: What a spreadsheet runs as a formula when a cell starts with it (OWASP, "CSV Injection").
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_row(values) -> list[Any]:
    """A row of a CSV file tg writes, each text cell that a spreadsheet would run as a formula
    (an id or a value starting with = + - @, a tab or a carriage return) given a leading single
    quote, as OWASP recommends; numbers, and text that reads as one ('-1.5'), are left alone."""
    return [_csv_cell(v) for v in values]


def _csv_cell(value: Any) -> Any:
    if not isinstance(value, str) or not value.startswith(_FORMULA_START):
        return value
    try:
        float(value)
        return value
    except ValueError:
        return "'" + value


#: The system's answers to a path that names no usable file: the user's input.
_BAD_PATH = {errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES,
             errno.ELOOP}


def path_error(err: OSError) -> TgError | None:
    """An OSError about a path where no check of tg's looked (a 100,000-character name) as the
    one-line error a bad path gets: a TgError where the path is the user's mistake, an error
    exiting 1 where the machine failed (a full disk); None where the error names no path."""
    if err.filename is None:
        return None
    error = TgError(f"'{os.fsdecode(err.filename)}': {err.strerror or err}.")
    if err.errno not in _BAD_PATH:
        error.exit_code = 1
    return error


def plain_text(value: Any, context: str) -> None:
    """Refuse control and bidirectional characters in any text of `value` (a value, or a
    document read from a file: nested mappings and lists, however deep), and binary data,
    naming the field after `context`; names, ids and paths are printed, so they must be text.
    The character is never echoed, only its code."""
    stack: list[tuple[Any, str]] = [(value, "")]
    seen: set[int] = set()          # YAML aliases share containers: each is walked once
    while stack:
        item, at = stack.pop()
        if isinstance(item, (dict, list)):
            if id(item) in seen:
                continue
            seen.add(id(item))
        if isinstance(item, (bytes, bytearray)):      # YAML's !!binary: no field is binary
            raise TgError(f"{context}{': ' + at if at else ''} is binary data (!!binary); give "
                          "text.")
        if isinstance(item, str):
            bad = _CONTROL.search(item)
            if bad:
                raise TgError(f"{context}{': ' + at if at else ''} holds a control character "
                              f"({ascii(bad.group())} at position {bad.start()}); names, ids "
                              "and paths are printed, so they must be plain text.")
        elif isinstance(item, dict):
            stack += [(k, f"{at} (a key)".strip()) for k in item]
            stack += [(v, f"{at}.{k}".lstrip(".")) for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(v, f"{at}[{i}]") for i, v in enumerate(item)]


class Terminated(SystemExit):
    """A signal ended the run: exit status 128 + the signal, and the CLI says which."""

    def __init__(self, signum: int, said: bool = False) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.said = said                  # its own line printed already (the jobs' runner's)
        self.signal_name = signal.Signals(signum).name
        self.previous: Any = None         # the handler exit_on_termination had replaced

    def pass_on(self) -> None:
        """The signal to the program's own handler, where it has one (a test runner, a service
        running tg in process): tg ends its run, the program decides about itself. A command's
        (the default action) has none: it exits 128 + the signal."""
        if callable(self.previous):
            signal.raise_signal(self.signum)


@contextmanager
def exit_on_termination() -> Iterator[None]:
    """SIGTERM and SIGHUP end the run as an exit (status 128 + the signal) raised where it is,
    so that every `finally` runs: a half-written output is removed (:func:`atomic_path`) and
    child processes are stopped by their owners, as after Ctrl-C. Without this the process
    died where it stood, leaving a 1.3 GB partial trace. Only the main thread may set handlers:
    elsewhere this does nothing. The exit knows the handler it replaced (Terminated.pass_on)."""
    def stop(signum, _frame):
        raise Terminated(signum)

    # A signal the program ignores stays ignored (`nohup tg ...` ran on no longer than the
    # terminal).
    signals = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.signal(sig, stop) for sig in signals
              if signal.getsignal(sig) is not signal.SIG_IGN} if main else {}
    ended: BaseException | None = None
    try:
        yield
    except BaseException as err:
        ended = err
    late = restore_handlers(before)     # a signal that came as the run ended is acted on too,
    if isinstance(late, Terminated) and not isinstance(ended, Terminated):
        late.__context__, ended = ended, late       # over an error the run ended in
    ended = ended or late
    if isinstance(ended, Terminated):
        ended.previous = before.get(ended.signum)
    if ended is not None:
        raise ended


@contextmanager
def sigterm_raises(error: type[BaseException]) -> Iterator[Callable[[int, Any], None] | None]:
    """Within, SIGTERM raises `error` where the main thread is, once: a second one during the
    clean-up the first starts is ignored (it raised out of that clean-up with a traceback).
    One that leaves the body unhandled ends it as Terminated. The handler before is put back
    after, and a SIGTERM pending then ends a run that was not already ending (Terminated). A
    SIGTERM the program ignores stays ignored, and off the main thread nothing is set: then it
    yields None, else the handler (for a caller that sets another for a while and this one
    back)."""
    def raise_once(signum, _frame):
        signal.signal(signum, signal.SIG_IGN)
        raise error

    hear = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN)
    previous = signal.signal(signal.SIGTERM, raise_once) if hear else None
    ending = False
    try:
        yield raise_once if hear else None
    except error:           # raised where nothing made it an exit (in a failing run's clean-up)
        ending = True
        raise Terminated(signal.SIGTERM) from None
    except BaseException:
        ending = True
        raise
    finally:
        late = restore_handlers({signal.SIGTERM: previous}) if hear else None
        if late is not None and not ending:
            raise Terminated(signal.SIGTERM)


def restore_handlers(before: dict[int, Any]) -> BaseException | None:
    """Put signal handlers back (None: one not set from Python, put back as the default).
    signal.signal() first runs the handlers of signals already pending, so a second SIGTERM
    (timeout(1) sends one to the process, then one to its group) raised out of a plain loop and
    left the run's handler installed for good, the process deaf to SIGTERM. Each is put back
    whatever those handlers raise (the run's own, or a program's: a SIGCHLD reaper's
    ChildProcessError); the first thing raised is returned, for the caller to act on. Tries are
    bounded: a last one raises (signals without end, or signal.signal's own error)."""
    raised: BaseException | None = None
    for sig, old in before.items():
        handler = signal.SIG_DFL if old is None else old
        for _ in range(_RESTORE_TRIES):
            try:
                signal.signal(sig, handler)
                break
            except BaseException as err:      # a pending signal's handler ran, and raised
                raised = raised or err
        else:
            signal.signal(sig, handler)
    return raised


_RESTORE_TRIES = 100
