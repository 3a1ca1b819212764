"""The heartbeat thread watches the trio loop (docs/adr/0112), in process and without a
database: the loop answers the thread's tick whatever its clock, and a frozen loop is said once
per freeze, at most once a minute. The process tests with a standby engine are in
tests/fleet/test_frozen_loop.py."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import trio
import trio.testing

from ferry.flow._fleet._heartbeat import Keeper


def keeper() -> Keeper:
    return Keeper(
        "postgresql://nowhere/none",  # never connected: no renewal is made here
        owner="k",
        incarnation="i",
        lease=1.0,
        margin=0.1,
        held_until=time.time() + 1.0,
    )


def test_an_idle_loop_under_a_mock_clock_answers_the_lease_thread() -> None:
    """A loop whose clock never moves (a `MockClock`) and that waits for nothing still notes
    the time when the thread asks: the tick wakes it up."""

    async def main() -> float:
        k = keeper()
        k._token = trio.lowlevel.current_trio_token()
        k._alive_at = asked = time.monotonic() - 5.0
        answered = trio.Event()
        token = k._token

        def thread() -> None:
            k._tick()
            while k._alive_at == asked:
                time.sleep(0.001)
            token.run_sync_soon(answered.set)

        threading.Thread(target=thread, daemon=True).start()
        with trio.fail_after(1.0):  # never: the mock clock stands still
            await answered.wait()
        assert not k._loop_frozen()
        return k._alive_at - asked

    assert trio.run(main, clock=trio.testing.MockClock()) >= 5.0


def test_a_frozen_loop_is_logged_once_per_freeze_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    k = keeper()
    caplog.set_level(logging.INFO, logger="ferry.flow")
    k._alive_at = time.monotonic() - 2.0  # silent for two leases
    assert k._loop_frozen() and k._loop_frozen()  # two renewals not made, one WARNING
    k._noted()  # the loop runs again
    assert not k._loop_frozen()  # INFO: it runs again
    k._alive_at = time.monotonic() - 2.0  # a second freeze within the minute: counted, unsaid
    assert k._loop_frozen()
    k._noted()
    assert not k._loop_frozen()  # (nothing said of its end either)
    k._warned_at -= 60.0
    k._alive_at = time.monotonic() - 3.0  # a third, a minute after the first WARNING
    assert k._loop_frozen()
    assert k.frozen == 4
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "INFO", "WARNING"], said
    assert "its trio loop has not run for 2.0 s (longer than its lease of 1 s" in said[0][1]
    assert "runs again after about" in said[1][1]
    assert said[2][1].endswith("(1 earlier freeze(s) not logged)"), said[2][1]
    assert "has not run for 3.0 s" in said[2][1]
