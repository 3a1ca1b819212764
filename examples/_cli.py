"""Command-line pieces the examples share: help that shows every default, and argument types
whose errors are one argparse line (`argument --max-batch-size: must be at least 1, got 0`)
instead of a traceback from deep inside a run."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout (a docstring) and ends each option's help with its default,
    unless the help already says it or there is none (`None`, or an off switch shown as off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or "default" in text or default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: {'off' if default is False else '%(default)s'})"


class ArgumentParser(argparse.ArgumentParser):
    """Reports a bad command line in one line on stderr (`prog: error: ... (see --help)`, exit
    code 2), without the usage block that argparse prints first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parser(description: str | None, epilog: str | None = None) -> ArgumentParser:
    """An `ArgumentParser` for an example: `description` is its docstring, shown as written."""
    return ArgumentParser(description=description, epilog=epilog, formatter_class=HelpFormatter)


def add_ferry_options(parser: argparse.ArgumentParser) -> None:
    """The ferry options every ledger example takes: `--max-batch-size` and `--in-flight`."""
    parser.add_argument(
        "--max-batch-size", metavar="N", type=integer(1), default=100, help="most inputs in a call"
    )
    parser.add_argument(
        "--in-flight",
        metavar="N",
        type=integer(1),
        default=4,
        help="max_in_flight_batches: batch calls at once",
    )


def integer(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def number(
    minimum: float, *, below: float | None = None, above: bool = False
) -> Callable[[str], float]:
    """An argparse type: a finite number `>= minimum` (`> minimum` if `above`), `< below`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < minimum or (above and value == minimum):
            bound = "above" if above else "at least"
            raise argparse.ArgumentTypeError(f"must be {bound} {minimum:g}, got {value:g}")
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"must be below {below:g}, got {value:g}")
        return value

    return parse


def new_file(text: str) -> str:
    """An argparse type: a file path whose directory exists (the file itself may not yet)."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file's path")
    directory = path.resolve().parent
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {directory}")
    return text


def postgres_dsn(text: str) -> str:
    """An argparse type: a PostgreSQL connection string that connects, tried once, now, so that
    a typo ends the run with one line before anything starts."""
    try:
        import psycopg
    except ImportError:
        raise argparse.ArgumentTypeError(
            "PostgreSQL needs psycopg: pip install 'stm-ferry[postgres]'"
        ) from None
    try:
        psycopg.conninfo.conninfo_to_dict(text)
    except psycopg.ProgrammingError as exc:
        raise argparse.ArgumentTypeError(f"not a connection string: {_first_line(exc)}") from None
    try:
        with psycopg.connect(text, connect_timeout=10):
            pass
    except psycopg.Error as exc:
        raise argparse.ArgumentTypeError(f"cannot connect: {_first_line(exc)}") from None
    return text


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
