"""What a caller of a ferry can get back besides its result (docs/errors-and-lifecycle.md).

Every ferry error derives from `FerryError`. `Closed` is also a `trio.ClosedResourceError`, so code
that already handles trio's "used after close" keeps working. `Committed` is not an error: it is a
value returned by `ProjectedWrite` when an input is durable but its view is not confirmed.
"""

from __future__ import annotations

from typing import Generic, TypeVar, final

import attrs
import trio

T = TypeVar("T")


class FerryError(Exception):
    """Root of every error a ferry raises to a caller."""


@final
class Rejected(FerryError):
    """The waiting room was full (by count or by weight); nothing was sent. Back off and retry."""


@final
class Failed(FerryError):
    """The batch call that carried this input raised; `__cause__` is its exception.

    Every caller of that batch gets its own `Failed`. Retry if the write is idempotent.
    """


@final
class BatchContractError(FerryError):
    """The batch call returned a malformed output, or `extract` raised for this caller: a bug."""


class InputError(FerryError):
    """The batch call refused this one input as invalid; the other inputs of its batch are served.

    A batch call signals it by returning an instance of `InputError` (or a subclass) in the input's
    slot; the ferry raises it to that caller alone. `IdReused` is the one `ProjectedWrite` uses.
    """


@final
class IdReused(InputError):
    """An input id was submitted again with different content: a client bug, never retried."""


@final
class Closed(FerryError, trio.ClosedResourceError):
    """The ferry closed while this caller waited, or it was called after close."""


@final
@attrs.frozen
class Committed(Generic[T]):
    """The input is durable, but its view is not confirmed.

    `provisional` is the answer the journal decided (for example the new balance or a refusal on
    the merits); `cause` is the exception that kept the projection from confirming it. The key's
    next batch, or `sweep()`, finishes the view: tell the client it was accepted, do not resubmit.
    """

    provisional: T
    cause: BaseException = attrs.field(eq=False)


def wrong_run(called: str, owner: str, hint: str) -> RuntimeError:
    """The error for a call from outside the trio run that owns the callee (not raised: returned).

    A ferry and a flow engine each belong to the trio run that opened them, and check that the
    caller runs on that run's thread. `called` names what was called ("a ferry",
    "flow.Engine.get"), `owner` the object in the explanation ("a ferry", "an engine"), and
    `hint` the `trio.from_thread` call that does it right ("trio.from_thread.run(f, x,
    trio_token=token)"). Call it on the caller's thread: it tells a task of another trio run
    from a plain thread by asking trio for the current run's token.
    """
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        where = "outside any trio run (a plain thread)"
    else:
        where = "from a task of another trio run"
    return RuntimeError(
        f"{called} was called {where}: {owner} belongs to the trio run that opened it, and only"
        f" that run's tasks may call it. From another thread, call it in its run: {hint}, with"
        " the token of that run (trio.lowlevel.current_trio_token() there)"
    )
