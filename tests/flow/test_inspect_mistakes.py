"""The inspector as a newcomer meets it, with the mistakes a shell makes easy: text that is not
UTF-8 (bytes a terminal could not decode arrive as lone surrogates), a wake's payload given as
a second word instead of ``--payload``, JSON that Python reads but no store can hold (``NaN``),
a bulk action over many flows (it shows how far it got) and Ctrl-C in the middle of one (it
says how far it got, and no traceback).

On the store of tests/flow/test_inspect.py (flows in every state)."""

from __future__ import annotations

import json
import signal

import pytest

from ferry.flow._ops import _bulk, _inspect

from .test_inspect import db as db  # the fixture
from .test_inspect import run, state

Capsys = pytest.CaptureFixture[str]

# What Python makes of the bytes b"m\xed\xb2\x80" (a UTF-8 encoded surrogate, which is not
# UTF-8) on a command line: os.fsdecode's surrogateescape.
UNDECODABLE = b"m\xed\xb2\x80".decode("utf-8", "surrogateescape")


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["show", UNDECODABLE], "FLOW_ID"),
        (["wake", UNDECODABLE], "FLOW_ID"),
        (["cancel", UNDECODABLE], "FLOW_ID"),
        (["resume", UNDECODABLE], "FLOW_ID"),
        (["list", "--id-prefix", UNDECODABLE], "--id-prefix"),
        (["list", "--plan", UNDECODABLE], "--plan"),
        (["list", "--step", "a\udc80"], "--step"),
        (["list", "--after", UNDECODABLE], "--after"),
        (["cancel", "--plan", UNDECODABLE, "--yes"], "--plan"),
        (["wake", "parked", "--message-id", UNDECODABLE], "--message-id"),
        (["cancel", "parked", "--reason", UNDECODABLE], "--reason"),
    ],
)
def test_text_that_is_not_utf8_is_a_one_line_argument_error(
    db: str, argv: list[str], name: str, capsys: Capsys
) -> None:
    code, out, err = run(capsys, db, *argv)
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1, err
    assert f"argument {name}: " in err and "is not valid UTF-8 text" in err, err
    assert "codec" not in err and "--help" in err, err
    assert state(db, "parked").state.name == "PARKED"  # nothing was done


def test_a_payload_given_as_a_second_word_says_to_use_payload(db: str, capsys: Capsys) -> None:
    code, out, err = run(capsys, db, "wake", "parked", '{"status": "confirmed"}')
    assert (code, out) == (2, "")
    assert err.count("\n") == 1, err
    assert "the payload goes in --payload" in err, err
    assert '--payload \'{"status": "confirmed"}\'' in err, err
    assert state(db, "parked").state.name == "PARKED"


@pytest.mark.parametrize("text", ["NaN", "[1, Infinity]", '{"x": -Infinity}'])
def test_a_payload_with_nan_is_an_argument_error(db: str, text: str, capsys: Capsys) -> None:
    code, out, err = run(capsys, db, "wake", "parked", "--payload", text)
    assert (code, out) == (2, ""), err
    assert "argument --payload: not JSON" in err and "NaN and Infinity" in err, err
    assert "None, bool" not in err  # no Python type names for a shell's user


def test_a_bulk_action_shows_its_progress_on_stderr(
    db: str, capsys: Capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_bulk, "PROGRESS_EVERY", 0.0)  # a line per flow, not per second
    code, out, err = run(capsys, db, "cancel", "--plan", "order", "--yes")
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("cancel: 1 of 7 flows done (1 cancelled),"), err
    assert lines[-1].startswith("cancel: 7 of 7 flows done (3 cancelled),"), err
    assert out.startswith("cancel: 7 flows, 3 cancelled\n"), out


def test_ctrl_c_in_a_bulk_action_says_how_far_it_got(
    db: str, capsys: Capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _bulk.cancel_one
    calls = 0

    async def cancel_then_ctrl_c(*args: object, **kwargs: object) -> _bulk.Done:
        nonlocal calls
        calls += 1
        if calls == 3:  # Ctrl-C while the third flow is in hand
            signal.raise_signal(signal.SIGINT)
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_bulk, "cancel_one", cancel_then_ctrl_c)
    code, out, err = run(capsys, db, "cancel", "--plan", "order", "--yes")
    assert code == 130, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("python -m ferry.flow: interrupted: cancel stopped after 2 of 7"), err
    assert "run the same command again" in err, err
    assert out == ""


def test_ctrl_c_in_a_read_is_one_line(
    db: str, capsys: Capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def interrupted(*args: object) -> None:
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setitem(_inspect.COMMANDS, "stats", interrupted)
    code, out, err = run(capsys, db, "stats")
    assert (code, out) == (130, "")
    assert err == "python -m ferry.flow: interrupted\n"


def test_json_payload_that_is_not_an_object_is_delivered_as_it_is(db: str, capsys: Capsys) -> None:
    # A wake's payload may be any JSON value (the next step reads it as ctx.wake).
    code, out, err = run(capsys, db, "wake", "parked", "--payload", "[1, 2]", "--json")
    assert code == 0, err
    assert json.loads(out)["delivery"] == "RESUMED"
