"""Command-line pieces the examples share, and the convention they all follow.

- Help shows every default. A bad command line is one line on stderr, ``PROG: error: argument
  --flag: what is wrong (see --help)``, exit status 2, never a traceback from inside a run.
- Numbers go through `integer` and `number`: ``expected an integer, got 'x'``, ``must be at
  least 1, got 0``, ``must be between 1 and 100000, got 0``.
- ``--seed N`` is an integer >= 0 in every example (`add_seed`).
- Metavars name the unit: ``N`` (a count or a seed), ``SECONDS``, ``PER_SECOND``, ``FRACTION``,
  ``PATH``, ``DSN``.
- ``--db PATH`` and ``--postgres DSN`` exclude each other (refused as a pair before anything
  connects); a DSN is parsed at once and connected to once, after the whole command line was
  read (`ArgumentParser.connects`).
- ``--json`` prints one object whose keys are snake_case; counts of things are written with
  `plural` (``1 account``, ``2 accounts``).
- Ctrl-C ends a run with one line on stderr, ``PROG: interrupted (Ctrl-C)`` (and what was left
  where, if anything was), exit status 130, never a traceback (`ctrl_c`). In trio the examples
  run through `run`, where Ctrl-C cancels the run (its engines and ferries close as at the end
  of their ``async with``) instead of raising KeyboardInterrupt wherever the code happens to be.
- Output piped into a reader that stops early (``| head``) ends the example quietly, exit status
  141, never a BrokenPipeError traceback (also `ctrl_c`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import outcome
import trio

T = TypeVar("T")


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
    code 2), without the usage block that argparse prints first; connects to the DSNs of the
    options given to `connects` once the whole line has been read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connects: list[argparse.Action] = []

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def connects(self, action: argparse.Action) -> argparse.Action:
        """`action` (a `postgres_dsn` option) is tried once, after parsing: a DSN that does not
        connect is a one-line error then, and a DSN given with an option it excludes is refused
        as that combination without trying to connect."""
        self._connects.append(action)
        return action

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        for action in self._connects:
            dsn = getattr(parsed, action.dest, None)
            if dsn is not None:
                try:
                    connect(dsn)
                except argparse.ArgumentTypeError as exc:
                    self.error(f"argument {'/'.join(action.option_strings)}: {exc}")
        return parsed, extras


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


def add_seed(parser: argparse.ArgumentParser, default: int, help: str = "workload seed") -> None:
    """``--seed N``: an integer >= 0, the same in every example."""
    parser.add_argument("--seed", metavar="N", type=integer(0), default=default, help=help)


def plural(n: int, word: str) -> str:
    """``1 account``, ``2 accounts`` (`word` is the singular; English plural by ``s``)."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum` (and at most `maximum`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if maximum is not None and not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"must be between {minimum} and {maximum}, got {value}"
            )
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def number(
    minimum: float,
    maximum: float | None = None,
    *,
    below: float | None = None,
    above: bool = False,
) -> Callable[[str], float]:
    """An argparse type: a finite number `>= minimum` (`> minimum` if `above`), `<= maximum`,
    `< below`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if maximum is not None and not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"must be between {minimum:g} and {maximum:g}, got {value:g}"
            )
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
    """An argparse type: a PostgreSQL connection string that parses (see `connect` for the
    check that it connects, which an `ArgumentParser` makes after the whole line was read)."""
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
    return text


def connect(dsn: str) -> None:
    """Connect to `dsn` once, now, so that a typo ends the run with one line before anything
    starts; `argparse.ArgumentTypeError` if it does not connect."""
    import psycopg

    try:
        with psycopg.connect(dsn, connect_timeout=10):
            pass
    except psycopg.Error as exc:
        raise argparse.ArgumentTypeError(f"cannot connect: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def is_ctrl_c(error: BaseException) -> bool:
    """A Ctrl-C: KeyboardInterrupt, alone or in trio's exception groups."""
    if isinstance(error, BaseExceptionGroup):
        return all(is_ctrl_c(e) for e in error.exceptions)
    return isinstance(error, KeyboardInterrupt)


def _stdout_closed(error: BaseException) -> bool:
    """`error` is BrokenPipeError (alone or in trio's exception groups) and standard output is
    a pipe whose reader has gone (``python examples/ledger.py | head``)."""
    if isinstance(error, BaseExceptionGroup):
        return all(_stdout_closed(e) for e in error.exceptions)
    if not isinstance(error, BrokenPipeError):
        return False
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout is not a file
        return False


@contextlib.contextmanager
def ctrl_c(prog: str, left: Callable[[], str] | None = None) -> Iterator[None]:
    """Ctrl-C in the block ends the program with one line on stderr, ``PROG: interrupted
    (Ctrl-C)``, then ``: `` and ``left()`` if it says something (what the run left where), and
    exit status 130 (the shell's for SIGINT), instead of a traceback. A standard output closed
    by its reader (``| head``) ends it quietly, with exit status 141 (the shell's for SIGPIPE):
    the reader has what it wanted."""
    try:
        yield
    except BaseException as error:
        if _stdout_closed(error):
            # What is still buffered for stdout would fail again at exit: send it nowhere.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            raise SystemExit(141) from None
        if not is_ctrl_c(error):
            raise
        note = left() if left is not None else ""
        print(f"{prog}: interrupted (Ctrl-C){': ' + note if note else ''}", file=sys.stderr)
        raise SystemExit(130) from None


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``trio.run(fn, *args)``, where Ctrl-C (SIGINT) cancels `fn` and then raises
    KeyboardInterrupt from here, once everything it opened has closed: trio's default raises
    KeyboardInterrupt inside whatever code runs at that moment, which can be in the middle of
    a library's bookkeeping. A second Ctrl-C during the close gets trio's default."""
    return trio.run(_until_ctrl_c, fn, args)


async def _until_ctrl_c(fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    done: list[outcome.Outcome[T]] = []
    interrupted = False

    async def watch(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal interrupted
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                interrupted = True
                nursery.cancel_scope.cancel()
                return

    async def body() -> None:  # its outcome as it is (a SystemExit not in an ExceptionGroup)
        done.append(await outcome.acapture(fn, *args))
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        await nursery.start(watch)
        nursery.start_soon(body)
    if interrupted:
        raise KeyboardInterrupt
    return done[0].unwrap()
