from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests import pg

# `dev` is quick for the edit-test loop; `ci` digs deeper and is what CI=true selects.
settings.register_profile(
    "dev",
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# A test that hangs (say, a trio.run whose MockClock has no deadline left to jump to) must fail
# the run quickly, not use up CI's time: pytest dumps every thread's traceback after
# `faulthandler_timeout` (pyproject.toml), and this timer ends the process a minute later.
# No test comes near either.
_TEST_TIMEOUT = float(os.environ.get("TEST_TIMEOUT", "300"))


def _give_up(name: str) -> None:
    message = f"\n{name} ran for more than {_TEST_TIMEOUT:.0f} s: stopping the run\n"
    os.write(2, message.encode())
    os._exit(3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    timer = threading.Timer(_TEST_TIMEOUT, _give_up, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# `long` tests (minute-scale runs) are left out unless the marker expression names them: `make test`
# runs everything else, `-m long` runs them alone.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "long" in config.getoption("-m"):
        return
    skip = pytest.mark.skip(reason="a minute-scale run: select it with -m long")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)


# One throwaway PostgreSQL for the whole session (tests/pg.py), shared by the store contract
# suite and the fleet test; skipped with a clear reason when the server binaries are missing.
@pytest.fixture(scope="session")
def pg_server() -> Iterator[pg.PgServer]:
    server = pg.acquire()
    if server is None:
        pytest.skip(pg.SKIP_REASON)
    try:
        yield server
    finally:
        pg.release()


# Every test starts with Python's own SIGINT handler, which `trio.run` replaces with its own only
# if it finds it there, and must leave it so (ADR 0172). A run started in the background by a
# shell without job control (`pytest ... &` in a script, a loaded CI step) inherits SIGINT
# ignored, and so do its xdist workers: the Ctrl-C tests then failed (stm's `trio_owns_sigint`,
# ferry's test_interrupt, the inspector's Ctrl-C) wherever they landed. A test that leaves another
# handler, or a signal wakeup fd, fails here, named, and the next one starts clean.
@pytest.fixture(autouse=True)
def _sigint_handler_left_as_found() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        # Say, a run started in the background, which inherits SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    left = signal.getsignal(signal.SIGINT)
    if left is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        pytest.fail(f"the test left SIGINT's handler {left!r} installed, not Python's default")
    fd = signal.set_wakeup_fd(-1)
    if fd != -1:
        pytest.fail(f"the test left a signal wakeup fd ({fd}) set")
