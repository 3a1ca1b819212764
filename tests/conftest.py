from __future__ import annotations

import os
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
