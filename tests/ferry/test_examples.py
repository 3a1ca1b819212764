"""The ferry examples run as scripts, as a user would run them."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> str:
    done = run_script(name, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("lookups.py", ("--callers", "200", "--latency", "0.005"), "through a ferry"),
        ("inference.py", ("--requests", "500"), "prompts per batch"),
    ],
)
def test_example_runs(script: str, args: tuple[str, ...], expected: str) -> None:
    assert expected in run_example(script, *args)


# --- command lines --------------------------------------------------------------------------------

PARSERS = ["bank", "boxes", "lookups", "inference", "ledger", "ledger_service", "orders"]


@pytest.mark.parametrize("name", PARSERS)
def test_every_option_has_help_that_shows_its_default(name: str) -> None:
    parser = importlib.import_module(f"examples.{name}").build_parser()
    text = " ".join(parser.format_help().split())  # one line: help wraps anywhere
    options = [
        a
        for a in parser._actions
        if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS  # internal flags
    ]
    assert options
    for action in options:
        flag = action.option_strings[0]
        assert action.help, f"{name} {flag} has no help"
        described = " ".join(parser._get_formatter()._format_action(action).split())
        if action.default is None:
            assert action.required or "default" in described, f"{name} {flag}: {described}"
        else:
            shown = "off" if action.default is False else str(action.default)
            assert f"(default: {shown})" in described, f"{name} {flag}: {described}"
        assert described in text


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("lookups", ["--callers", "0"], "argument --callers: must be at least 1, got 0"),
        ("lookups", ["--latency", "-1"], "argument --latency: must be at least 0, got -1"),
        ("inference", ["--requests", "0"], "argument --requests: must be at least 1, got 0"),
        ("ledger", ["--max-batch-size", "0"], "argument --max-batch-size: must be at least 1"),
        ("ledger", ["--in-flight", "0"], "argument --in-flight: must be at least 1"),
        ("ledger", ["--max-queueing", "0"], "argument --max-queueing: must be at least 1"),
        ("ledger", ["--max-batch-delay", "nan"], "argument --max-batch-delay: expected a finite"),
        ("ledger", ["--ops", "-1"], "argument --ops: must be at least 0"),
        ("ledger", ["--faults", "1"], "argument --faults: must be below 1"),
        ("ledger", ["--timeout", "0"], "argument --timeout: must be above 0"),
        ("ledger", ["--clients", "many"], "argument --clients: expected an integer, got 'many'"),
        ("ledger", ["--db", "/no/such/dir/x.db"], "argument --db: no such directory: /no/such/dir"),
        ("ledger", ["--postgres", "not a dsn"], "argument --postgres: not a connection string"),
        ("ledger", ["--postgres", "host=/no/such/dir"], "argument --postgres: cannot connect"),
        (
            "ledger",
            ["--db", "x.db", "--postgres", "host=/no/such/dir"],
            "argument --postgres: not allowed with argument --db",
        ),
        ("ledger_service", ["--dsn", "host=/no/such/dir"], "argument --dsn: cannot connect"),
        ("ledger_service", ["--port", "-1", "--dsn", "x"], "argument --port: must be between"),
        ("bank", ["--seed", "-1"], "argument --seed: must be at least 0, got -1"),
        ("bank", ["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_option_is_a_one_line_error(
    name: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = importlib.import_module(f"examples.{name}").build_parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(args)
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()  # one line, no usage block
    assert line.startswith(f"{parser.prog}: error: {message}"), line
    assert line.endswith(" (see --help)"), line


@pytest.mark.parametrize(
    "script", ["bank.py", "lookups.py", "inference.py", "ledger.py", "ledger_service.py"]
)
def test_a_script_with_a_bad_option_prints_one_line(script: str) -> None:
    """As a script too: no traceback, exit status 2."""
    bad = ["--dsn", "host=/no/such/dir"] if script == "ledger_service.py" else ["--seed", "x"]
    if script == "lookups.py":
        bad = ["--callers", "0"]
    done = run_script(script, *bad)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"{script}: error: argument {bad[0]}"), line


# --- one convention for every example (examples/_cli.py) ----------------------------------------

SEEDED = ["bank", "inference", "ledger", "orders"]


@pytest.mark.parametrize("name", SEEDED)
@pytest.mark.parametrize(
    ("seed", "message"),
    [
        ("-1", "argument --seed: must be at least 0, got -1"),
        ("x", "argument --seed: expected an integer, got 'x'"),
    ],
)
def test_every_seed_is_a_whole_number_of_at_least_0(
    name: str, seed: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = importlib.import_module(f"examples.{name}").build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--seed", seed])
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"{parser.prog}: error: {message} (see --help)"


@pytest.mark.parametrize("name", PARSERS)
def test_every_metavar_names_a_unit(name: str) -> None:
    parser = importlib.import_module(f"examples.{name}").build_parser()
    units = {"N", "SECONDS", "PER_SECOND", "FRACTION", "PATH", "DSN", "HOST"}
    for action in parser._actions:
        if action.option_strings and action.nargs != 0 and action.help != argparse.SUPPRESS:
            assert action.metavar in units, f"{name} {action.option_strings[0]}: {action.metavar}"


def test_counts_are_written_in_the_singular_for_one() -> None:
    from examples import _cli as cli

    assert (cli.plural(1, "account"), cli.plural(2, "account")) == ("1 account", "2 accounts")
    assert cli.plural(1_000, "single prompt") == "1,000 single prompts"


def test_ledger_says_one_account_for_one_account(tmp_path: Path) -> None:
    done = run_script(
        "ledger.py", "--accounts", "1", "--clients", "1", "--ops", "5", "--quiet",
        "--db", str(tmp_path / "l.db"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "from 1 client over 1 account," in done.stdout


def test_the_json_keys_of_ledger_are_snake_case(tmp_path: Path) -> None:
    import json

    done = run_script("ledger.py", "--ops", "50", "--json", "--db", str(tmp_path / "l.db"))
    assert done.returncode == 0, done.stderr

    def keys(value: object) -> list[str]:
        if isinstance(value, dict):
            return [k for k, v in value.items() for k in [k, *keys(v)]]
        return []

    bad = [k for k in keys(json.loads(done.stdout)) if not k.replace("_", "").isalnum()]
    assert not bad
