"""The suite's two tiers, and the fixtures that start ranks.

The default tier (``pytest -q``) runs in this process and the ``megascope`` commands it starts:
unit tests, importers, detectors on synth runs and samples, the SQL, the dashboard's callbacks.
The live tier (``pytest -m live``) runs what starts ranks: trainings, scripts under torchrun,
gloo process groups, hangs and crashes, the browser. Its ``solo`` tests, whose verdicts come
from measured durations, run one at a time; the others may run beside each other (CI runs
``-m "live and not solo"`` on a worker per core, then ``-m "live and solo"``).

A test is live by what it uses: the fixtures below that start ranks (``ranks``, ``train``,
``trained``, ``attach``, ``attach_popen``, ``launch``, ``fr_case``, ``browser``) mark every test that takes
them, directly or through another fixture, ``live``. A test outside the live tier that starts
ranks anyway (torchrun, ``megascope train`` or ``demo``, a multiprocessing process, Chromium)
fails at that call, saying which fixture to take, so the tiers cannot drift apart.

Every tier may start ``megascope`` commands that start no rank (analyze, import, synth, a
dashboard server, a Dask cluster on loopback, py-spy).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator

import pytest

# `helpers` importable here and from spawned workers (they inherit sys.path)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import live  # noqa: E402
from helpers.tiers import LIVE_FIXTURES, Guard, runs_alone  # noqa: E402

# A non-interactive shell starts a background job with SIGINT ignored, and a child process
# inherits an ignored signal across exec: the tests that stop a launcher or a server with
# Ctrl-C (SIGINT) would then send it to processes that cannot hear it. A handler, unlike an
# ignored signal, is reset to the default at exec, so every process the tests start can be
# interrupted again, wherever the suite runs.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): a worker per core, up to 4, except where the marker
    expression can select a ``solo`` test: those run in one process, one test at a time.

    A solo test reads its verdict from durations its ranks measure (a slow rank named, a stall
    priced, a clock offset bounded), so its ranks share the cores with nothing but each other:
    a second test's ranks would slow them as a fault does. The other live tests (equivalences,
    checkpoints, launcher exits, hangs, the browser on a synth run) assert nothing a neighbour
    could change, and run beside each other: ``pytest -m "live and not solo" --dist loadfile``.
    An expression that can select a solo test (``live``, ``solo``, ``live and not gpu``, none
    at all) runs in one process; ``not live`` and ``live and not solo`` on a worker per core.
    """
    alone = runs_alone(config.option.markexpr or "")
    return 0 if alone else max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = set(callspec.params) if callspec is not None else set()
        # a parameter that shares a fixture's name (``ranks`` of a finding) is not that fixture
        used = LIVE_FIXTURES.intersection(getattr(item, "fixturenames", ())) - params
        if used:
            item.add_marker(pytest.mark.live)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    Guard.on = item.get_closest_marker("live") is None
    try:
        yield
    finally:
        Guard.on = False


Guard.install()

# -- the fixtures that start ranks ---------------------------------------------------------------


@pytest.fixture(scope="session")
def ranks():
    """``ranks(fn, world_size, *args)``: real gloo process groups (helpers/ranks.py)."""
    from helpers.ranks import run_ranks

    return run_ranks


@pytest.fixture(scope="session")
def train():
    """``train(*args)``: ``megascope train`` to its end (helpers/live.py)."""
    return live.train


@pytest.fixture(scope="session")
def trained():
    """``trained(out, *args)``: ``megascope train``, which must succeed; the run directory."""
    return live.trained


@pytest.fixture(scope="session")
def attach():
    """``attach(run, script, *args)``: a script under torchrun with the tracer attached."""
    return live.attach


@pytest.fixture(scope="session")
def attach_popen():
    """``attach_popen(run, script, *args)``: :func:`attach`, started in its own session."""
    return live.attach_popen


@pytest.fixture(scope="session")
def launch():
    """``launch(cmd, **popen_kwargs)``: any other process that starts ranks."""
    return live.launch


@pytest.fixture(scope="session")
def demo(tmp_path_factory, launch) -> live.Demo:
    """``megascope demo --no-serve``, run once for the session (a training of 8 ranks): its run
    directory and what it printed, for the tests that only read them."""
    return live.run_demo(str(tmp_path_factory.mktemp("demo") / "demo"), launch)


@pytest.fixture(scope="session")
def fr_case():
    """``fr_case(case, out)``: a Flight Recorder set made now by real processes
    (helpers/fr_cases.py)."""
    from helpers import fr_cases

    return fr_cases.make


@pytest.fixture(scope="session")
def browser():
    """Debian's headless Chromium through Playwright, one for the session; skips where
    /usr/bin/chromium is absent."""
    from dashboard import serving

    if not os.path.exists(serving.CHROMIUM):
        pytest.skip(
            f"{serving.CHROMIUM} not installed (apt-get install chromium; "
            "scripts/setup.sh --browser)"
        )
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=serving.CHROMIUM, args=serving.CHROMIUM_ARGS, headless=True
        )
        try:
            yield chromium
        finally:
            chromium.close()
