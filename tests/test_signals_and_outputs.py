"""What a run leaves behind when it is stopped, and outputs that would collide."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from taskgraph.cli import main
from tests.helpers import wait_for

TINY = "scenarios/tiny.yaml"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_termination_while_a_trace_is_written_leaves_no_partial_file(tmp_path, sig):
    """SIGTERM or SIGHUP while the trace is being written: the half-written file is removed and
    the exit status says which signal (it was left behind, 1.3 GB on a long run)."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "taskgraph.cli", "simulate", TINY, "--set",
         "workload.gen_len=20000", "--trace", str(out / "t.json"), "--trace-steps", "all"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(".partial" in p.name for p in out.iterdir()) or
                 proc.poll() is not None, 300, "the trace's partial file")
        assert proc.poll() is None, "the run ended before it could be stopped"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig
    finally:
        proc.kill()
    assert list(out.iterdir()) == []
    # one line that says why it stopped (it said nothing)
    assert err.strip().splitlines()[-1] == f"tg simulate: stopped by {signal.Signals(sig).name}."



def test_two_outputs_on_one_path_are_refused_before_any_work(tmp_path, capsys):
    """(validate's Gantt chart was silently replaced by its parity plot.)"""
    assert main(["validate", TINY, "--gantt", str(tmp_path / "x.png"), "--plot",
                 str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "name the same file" in err and "--gantt" in err and "--plot" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX symbolic links")
def test_an_output_under_a_loop_of_links_is_a_clear_error(tmp_path, capsys):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    assert main(["simulate", TINY, "--trace", str(tmp_path / "a" / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot be resolved" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, words", [
    (["simulate", TINY, "--set", "policy.N=1" + "0" * 5000], "4,300 digits"),
    (["simulate", TINY, "--set", "policy.N=" + "[" * 50000], "nests deeper"),
    (["compare", TINY, "--schedules", "S1:"], "after the colon give padded or refill"),
    (["simulate", "FOLDER/listkey.yaml"], "a key must be a name or a number"),
    (["simulate", "FOLDER/hugeint.yaml"], "4,300 digits"),
])
def test_values_yaml_cannot_hold_are_one_clean_error(tmp_path, capsys, argv, words):
    (tmp_path / "listkey.yaml").write_text("model: tiny\nhardware: t4\n? [a, b]\n: 1\n")
    (tmp_path / "hugeint.yaml").write_text(f"model: tiny\nhardware: t4\npolicy: "
                                           f"{{N: 1{'0' * 5000}, mu: 2}}\n")
    argv = [a.replace("FOLDER", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err) < 1000


@pytest.mark.parametrize("name, text", [
    ("generation_config.json", '{"eos_token_id": 1' + "0" * 5000 + "}"),
    ("generation_config.json", "[" * 100_000),
    ("model.safetensors.index.json", '{"metadata": {"total_size": 1' + "0" * 5000 + "}}"),
])
def test_a_checkpoint_json_file_is_read_by_the_one_reader(tmp_path, name, text):
    """A checkpoint's JSON files meet the same reader as every input (they were tracebacks)."""
    from taskgraph.errors import TgError
    from taskgraph.exec.prompts import eos_ids
    from taskgraph.kernels.weights import checkpoint_index

    (tmp_path / name).write_text(text)
    with pytest.raises(TgError, match="4,300 digits"):
        eos_ids(tmp_path, 32) if name.startswith("generation") else checkpoint_index(tmp_path)


@pytest.mark.parametrize("value", ["hardware.gpu.tflops=1e-320", "hardware.gpu.mem_gbps=5e-324",
                                   "hardware.gpu.memory_gb=1e308", "hardware.link.h2d_gbps=1e308",
                                   "hardware.link.h2d_gbps=1e-320"])
def test_a_figure_no_machine_has_is_refused_naming_it(capsys, value):
    """Outside [1e-6, 1e9] the arithmetic over- or underflows: an infinite prefill and NaN
    figures with exit 0 (invalid JSON), or a division by zero; now refused up front."""
    assert main(["simulate", TINY, "--set", value, "--json"]) == 2
    captured = capsys.readouterr()
    assert value.split("=")[0] in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_ctrl_c_while_tg_loads_is_a_clean_exit(monkeypatch, capsys):
    """Issue 40 point 2: Ctrl-C in the first second and a half, while the API loads, printed a
    traceback. The package imports nothing heavy (its functions load when first used), and
    main() turns an interrupt during the verbs' import into exit 130 with one line. The
    interrupt is raised where the import happens, as Ctrl-C would raise it there."""
    class CtrlC:
        def find_spec(self, name, path=None, target=None):
            if name == "taskgraph.cli.parsing":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "taskgraph.cli.parsing", raising=False)
    monkeypatch.setattr(sys, "meta_path", [CtrlC(), *sys.meta_path])
    assert main(["simulate", "scenarios/tiny.yaml"]) == 130
    err = capsys.readouterr().err
    assert err == "tg: interrupted.\n"
    # what the console script imports before main() runs is light: not the API
    out = subprocess.run([sys.executable, "-c", "import sys, taskgraph.cli; "
                          "print('taskgraph.api' in sys.modules, 'numpy' in sys.modules)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_sigterm_while_tg_loads_is_a_clean_exit():
    """A SIGTERM while the verbs load (the half second before a run) killed tg by the default
    action, saying nothing; now it is one line and exit 143, as later in a run. The signal is
    sent as the API's import starts, in a process of its own (this one's handler is the
    suite's)."""
    program = textwrap.dedent("""
        import os, signal, sys
        class Term:
            def find_spec(self, name, path=None, target=None):
                if name == "taskgraph.api":
                    os.kill(os.getpid(), signal.SIGTERM)
                return None
        sys.meta_path.insert(0, Term())
        from taskgraph.cli import main
        sys.exit(main(["simulate", "scenarios/tiny.yaml"]))
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stderr, done.stdout) == (143, "tg: stopped by SIGTERM.\n", "")


def _pending_as_handlers_go_back(monkeypatch, pending) -> None:
    """signal.signal() as CPython runs it with a signal pending: the first time a handler is put
    back on SIGTERM, `pending(current handler)` runs first."""
    real = signal.signal
    armed = [True]

    def as_cpython(sig, handler):
        if armed and sig == signal.SIGTERM and getattr(handler, "__name__", "") == "program":
            armed.clear()
            pending(signal.getsignal(sig))
        return real(sig, handler)

    monkeypatch.setattr(signal, "signal", as_cpython)


def _sigchld_reaper_fails(_current):
    raise ChildProcessError(10, "No child processes")     # a program's own handler, pending


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("pending", ["a second SIGTERM", "a program's handler that fails"])
def test_a_signal_pending_as_the_handlers_go_back_leaves_none_of_tgs_installed(monkeypatch,
                                                                             pending):
    """signal.signal() first runs the handlers of signals already pending. timeout(1) sends
    SIGTERM twice (to the process, then to its group): the second, pending as tg put the
    handlers back, raised out of that loop and left tg's handlers installed for good, the
    program deaf to SIGTERM from then on; so did any pending handler of the program's that
    raised. They go back whatever a pending handler raises, and a handler the program had hears
    the signal once tg has cleaned up (the CLI passes it on after its line)."""
    from taskgraph.files import Terminated, exit_on_termination

    heard: list[int] = []

    def program(signum, frame):           # the handler of a program that runs tg in process
        heard.append(signum)

    old = {sig: signal.signal(sig, program) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if pending == "a second SIGTERM":
            _pending_as_handlers_go_back(monkeypatch, lambda tgs: tgs(signal.SIGTERM, None))
            with pytest.raises(Terminated) as end, exit_on_termination():
                signal.raise_signal(signal.SIGTERM)
        else:
            _pending_as_handlers_go_back(monkeypatch, _sigchld_reaper_fails)
            with pytest.raises(ChildProcessError), exit_on_termination():
                pass
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGTERM) is program
        assert signal.getsignal(signal.SIGHUP) is program
        assert heard == []
        if pending == "a second SIGTERM":
            assert end.value.code == 128 + signal.SIGTERM
            end.value.pass_on()
            assert heard == [signal.SIGTERM]
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_sigterm_as_a_run_fails_still_stops_the_program(monkeypatch):
    """A SIGTERM pending as the handlers go back after a run that ended in an error was lost: the
    command exited with the error's status and a program's handler never heard it. The signal
    wins, the error kept as its context."""
    from taskgraph.errors import TgError
    from taskgraph.files import Terminated, exit_on_termination

    def program(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, program)
    try:
        _pending_as_handlers_go_back(monkeypatch, lambda tgs: tgs(signal.SIGTERM, None))
        with pytest.raises(Terminated) as end, exit_on_termination():
            raise TgError("the run's own error")
        monkeypatch.undo()
        assert isinstance(end.value.__context__, TgError)
        assert end.value.previous is program and signal.getsignal(signal.SIGTERM) is program
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_second_sigterm_in_a_pools_clean_up_says_one_line(monkeypatch, capsys):
    """timeout(1)'s two SIGTERMs in a pool's run: the second, coming as the pool ends its
    workers, raised out of that clean-up with a traceback (or, pending as the handler went
    back, printed a second line). One line, status 143, the program's handler once."""
    import concurrent.futures.process as process

    import taskgraph.study.jobs as jobs

    heard: list[int] = []
    sent: list[int] = []
    real_wait, real_shutdown = jobs.wait, process.ProcessPoolExecutor.shutdown

    def wait(*args, **kwargs):                    # the first, as the jobs run
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_wait(*args, **kwargs)

    def shutdown(self, wait=True, **kwargs):      # the second, as the workers are ended
        if not wait and len(sent) == 1:
            sent.append(2)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_shutdown(self, wait=wait, **kwargs)

    monkeypatch.setattr(jobs, "wait", wait)
    monkeypatch.setattr(process.ProcessPoolExecutor, "shutdown", shutdown)
    old = signal.signal(signal.SIGTERM, lambda sig, frame: heard.append(sig))
    try:
        rc = main(["search", "scenarios/t4.yaml", "--verify"])
        back = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, old)
    err = capsys.readouterr().err
    assert sent == [1, 2] and rc == 143, err
    assert re.fullmatch(r"tg: terminated with \d+ of \d+ jobs finished; the rest were "
                        r"cancelled\.", err.strip()), err
    assert heard == [signal.SIGTERM] and back is not old


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_hangup_a_command_ignores_does_not_stop_it(tmp_path):
    """`nohup tg ...`: SIGHUP ignored when tg starts stays ignored (tg stopped on it all the
    same, so a run started under nohup ended with the terminal)."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "taskgraph.cli", "simulate", TINY, "--set",
         "workload.gen_len=20000", "--trace", str(out / "t.json"), "--trace-steps", "all"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        wait_for(lambda: any(".partial" in p.name for p in out.iterdir()) or
                 proc.poll() is not None, 300, "the trace's partial file")
        assert proc.poll() is None, "the run ended before it could be signalled"
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert [p.name for p in out.iterdir()] == ["t.json"]


@pytest.mark.skipif(sys.platform == "win32" or not os.path.isdir("/proc"),
                    reason="POSIX signals; finds the pool's workers in /proc")
@pytest.mark.parametrize("verb", ["simulate", "fit"])
def test_a_program_running_tg_in_process_hears_its_sigterm(tmp_path, verb):
    """A program that calls tg's main() and handles SIGTERM itself: tg stops its run and
    cleans up (no partial trace, no worker left, no fit written), says why it stopped, then the
    program's handler runs. It got 143 back and carried on, the signal swallowed (a test runner
    killed by `timeout` ran its whole suite on); a pool's run raised a bare exit past it."""
    from tests.helpers import children

    out = tmp_path / "out"
    out.mkdir()
    argv = (["simulate", TINY, "--set", "workload.gen_len=20000", "--trace",
             str(out / "t.json"), "--trace-steps", "all"] if verb == "simulate" else
            ["fit", "scenarios/measurements/small-batch-fiddler-artifact.yaml", "--out",
             str(out / "fit")])
    program = (
        "import signal, sys\n"
        "from taskgraph.cli import main\n"
        "def bye(signum, frame):\n"
        "    print('the program heard it', flush=True)\n"
        "    sys.exit(99)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        f"rc = main({argv!r})\n"
        "print('main returned', rc, 'and the program ran on', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    running = ((lambda: any(".partial" in p.name for p in out.iterdir())) if verb == "simulate"
               else (lambda: len(children(proc.pid)) >= 2))
    try:
        wait_for(lambda: running() or proc.poll() is not None, 300, f"{verb} under way")
        assert proc.poll() is None, "the run ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        said, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 99, (said, err)
    assert said.strip().splitlines()[-1] == "the program heard it"     # after tg's table
    last = err.strip().splitlines()[-1]          # one line says why it stopped
    assert last == "tg simulate: stopped by SIGTERM." if verb == "simulate" else re.fullmatch(
        r"tg: terminated with \d+ of \d+ jobs finished; the rest were cancelled\.", last), err
    assert "Traceback" not in err
    assert list(out.iterdir()) == []


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_runs_sigterm_handler_raises_once_and_ends_as_an_exit():
    """The pool's and the distributed executor's SIGTERM (files.sigterm_raises): it raises their
    own exception once, a second is ignored while they clean up (it raised out of the clean-up
    with a traceback), one that comes in a failing run's clean-up, where nothing makes it an
    exit, ends the run as one (it was a traceback, rc 1), and the program's handler is back."""
    from taskgraph.files import Terminated, sigterm_raises

    class Stop(BaseException):
        pass

    def program(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, program)
    try:
        with sigterm_raises(Stop) as handler:
            with pytest.raises(Stop):
                signal.raise_signal(signal.SIGTERM)
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
            signal.raise_signal(signal.SIGTERM)          # the second: ignored
            signal.signal(signal.SIGTERM, handler)
        assert signal.getsignal(signal.SIGTERM) is program
        with pytest.raises(Terminated) as end, sigterm_raises(Stop):
            try:
                raise ValueError("the run fails")
            except ValueError:
                signal.raise_signal(signal.SIGTERM)      # in its clean-up
        assert end.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is program
    finally:
        signal.signal(signal.SIGTERM, old)
