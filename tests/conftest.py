"""Shared fixtures. `--runslow` runs long property searches and benchmarks (see README)."""

from __future__ import annotations

import os
import signal

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("TG_HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="run long property runs too")
    parser.addoption("--heavy", action="store_true",
                     help="run the heavy tests too (minutes each; .ci/run runs them apart: "
                          "python -m pytest -m heavy --heavy)")


def pytest_configure(config):
    if config.getoption("--runslow"):
        settings.load_profile("slow")
    # A suite started in the background of a script (`pytest &`) inherits Ctrl-C ignored, as
    # would every tg the tests start and then interrupt: a Ctrl-C test would wait for a run that
    # cannot hear it (and leave it running). Its children get the default back.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # A SIGTERM to the suite itself (a `timeout` around it expiring, a kill from outside) ends
    # the session and says so. Without this, one that came while a test ran tg's main() in
    # process was taken for that run's: the test failed with "tg execute: stopped by SIGTERM"
    # and the suite ran on, as if the test were flaky.
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        def terminated(signum, frame):
            pytest.exit(f"the test process received {signal.Signals(signum).name} from outside "
                        "(a timeout around the run, or a kill)", returncode=128 + signum)

        signal.signal(signal.SIGTERM, terminated)
        # a forked child dies by SIGTERM as it would have (a Python handler waits for the
        # child's C calls to return, and tg's main() in it would pass the signal on to this)
        os.register_at_fork(after_in_child=lambda: signal.getsignal(signal.SIGTERM) is terminated
                            and signal.signal(signal.SIGTERM, signal.SIG_DFL))


@pytest.fixture(autouse=True)
def _templates_compiled_afresh():
    """Each test compiles its own task graphs: a test that patches the builder (dropping an
    edge to see a check fail) must not be handed another test's kept templates
    (taskgraph.dag.compiled keeps them by the plan's structure, which knows nothing of patches)."""
    from taskgraph.dag import compiled

    compiled._TEMPLATES.clear()
    yield


def pytest_collection_modifyitems(config, items):
    heavy = pytest.mark.skip(reason="heavy: use --heavy (.ci/run runs these apart)")
    slow = pytest.mark.skip(reason="long run: use --runslow")
    for item in items:
        if "heavy" in item.keywords and not config.getoption("--heavy"):
            item.add_marker(heavy)
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(slow)
