"""Failure triage: the FAILED and BLOCKED flows grouped by a normalised error (docs/adr/0127).

Two thousand flows blocked by "refund to account 12345 failed", "... 67890 ...", and so on are
one problem, not two thousand: `normalise` folds what varies from one flow to the next (numbers,
hex ids, uuids, quoted values, the flow's own id) into placeholders, and `failure_groups` counts
the flows of each normalised error, with when the first and the last of them was written, and a
few of their ids.

Where the work is done. The database groups first, by the error's first `PREFIX` characters
with their digits removed (ten nested ``REPLACE``, which SQLite and PostgreSQL both have; the
digits are what varies most often): one ``GROUP BY`` over the FAILED and BLOCKED rows, in C,
that returns a row per group with one of its texts, the biggest groups first, at most `SCAN` of
them (``LIMIT``). Python then normalises that text (a few microseconds each: the hex ids, uuids,
quoted values the database cannot fold without regular expressions, which SQLite lacks) and
merges the groups that normalise alike. So the rows that cross to Python are bounded by `SCAN`
whatever the store holds: 100,000 flows each with its own account number are one row; 100,000
flows each with its own uuid are `SCAN` rows, and the flows of the groups past them are counted
as not grouped (the caller says how many). Two texts that differ only in where their digits
are ("v1 x" and "v x1") fall in one group: the price of folding in SQL.

The error of a flow is what `Snapshot.error` shows: a BLOCKED flow's reason (the ``blocked``
column), any other flow's ``error``.

Everything here is synchronous and runs inside a store transaction (`Store.transact`).
"""

from __future__ import annotations

import math
import re
from typing import Final

import attrs

from ferry.projected import Tx

from .._model._types import State
from .._model._values import Flow
from . import _sql

#: The most distinct error texts read from the database (the most common first).
SCAN: Final = 20_000
#: Errors are grouped by their first this many characters (a traceback-long text costs no more).
PREFIX: Final = 500
#: How many flow ids a group keeps as examples.
EXAMPLES: Final = 3
#: What a flow with no error text is grouped under.
NO_ERROR: Final = "(no error recorded)"

#: The SQL expression of a flow's error as `Snapshot.error` shows it.
ERROR_TEXT: Final = "CASE WHEN state = 'BLOCKED' THEN blocked ELSE error END"

_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
#: 0x... anywhere; or a run of 8 or more hex digits holding a digit and a letter (a sha, an id).
_HEX = r"0[xX][0-9a-fA-F]+|\b(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"
#: A quoted value: one token (no blank, no quote) in single or double quotes, unless it is the
#: step's name in the engine's own words ("step 'charge' raised ...", "compensation of step
#: 'refund' failed"), which says where, not which. A quoted text with blanks (a message, the
#: quotes of an exception's repr) is kept, and its own values folded.
_QUOTED = r"(?<!\bstep )(?P<q>['\"])[^\s'\"]+(?P=q)"
_NUMBER = r"\d+(?:\.\d+)?"
_FOLD: Final = re.compile(
    f"(?P<uuid>{_UUID})|(?P<hex>{_HEX})|(?P<quoted>{_QUOTED})|(?P<n>{_NUMBER})"
)


def _placeholder(m: re.Match[str]) -> str:
    kind = m.lastgroup
    if kind == "quoted":
        q = m.group(0)[0]
        return f"{q}<s>{q}"
    return f"<{kind}>"


def error_of(flow: Flow) -> str | None:
    """The error a flow shows (`Snapshot.error`, `ERROR_TEXT`): a BLOCKED flow's reason, any
    other flow's error."""
    return flow.blocked if flow.state is State.BLOCKED else flow.error


def normalise(error: str | None, flow_id: str | None = None) -> str:
    """`error` with what varies between flows folded: uuids to ``<uuid>``, hex ids (``0x7f..``,
    a run of 8+ hex digits with a digit and a letter) to ``<hex>``, a quoted token to ``'<s>'``
    (not a step's name after ``step``), numbers to ``<n>``; `flow_id` (the flow's own id), where
    it appears, to ``<flow>`` first. None or empty: `NO_ERROR`. Pure; cost linear in the text.

    >>> normalise("refund to account 12345 failed")
    'refund to account <n> failed'
    """
    if not error:
        return NO_ERROR
    if flow_id:
        error = error.replace(flow_id, "<flow>")
    return _FOLD.sub(_placeholder, error)


_PLACEHOLDER: Final = re.compile(r"<(?:uuid|hex|n|s|flow)>")


def fragment(normalised: str) -> str:
    """The longest literal piece of a normalised error (between its placeholders), stripped: a
    substring that every error of the group holds, for the error filter of a link to the
    group's flows (it may match a few flows of other groups too)."""
    pieces = [p.strip(" '\"") for p in _PLACEHOLDER.split(normalised)]
    return max(pieces, key=len) if pieces else normalised


@attrs.frozen
class Group:
    """The flows of one state whose errors normalise alike."""

    state: str
    error: str  # normalised
    flows: int
    first: float  # the earliest last write of its flows (when the first of them failed)
    last: float  # the latest
    examples: tuple[str, ...]  # a few flow ids, least first

    @property
    def match(self) -> str:
        """The error filter's text of a link to its flows (`fragment`)."""
        return fragment(self.error)


@attrs.frozen
class Groups:
    """`failure_groups`' answer. `groups` are the first `limit`, most flows first; the rest are
    counted in `groups_left_out` / `flows_left_out`; `flows_not_grouped` is how many FAILED and
    BLOCKED flows had an error past the `SCAN` most common distinct texts (not read)."""

    groups: tuple[Group, ...]
    total_groups: int
    groups_left_out: int
    flows_left_out: int
    flows_not_grouped: int
    flows: int  # FAILED and BLOCKED flows in the store


@attrs.define
class _Acc:
    """A group being merged from the database's exact-text groups."""

    flows: int
    first: float
    last: float
    examples: list[str]

    def add(self, flows: int, first: float, last: float, example: str) -> None:
        self.flows += flows
        self.first = min(self.first, first)
        self.last = max(self.last, last)
        if len(self.examples) < EXAMPLES and example not in self.examples:
            self.examples.append(example)


def _without_digits(expr: str) -> str:
    """SQL of `expr` with its digits removed (ten nested ``REPLACE``: both databases, in C)."""
    for d in "0123456789":
        expr = f"REPLACE({expr}, '{d}', '')"
    return expr


_PREFIXED: Final = f"SUBSTR({ERROR_TEXT}, 1, {PREFIX})"
#: A row per state and error prefix without its digits: numbers, the commonest variation, are
#: folded in the database; one text of each (the least) stands for it and is normalised here.
_STATEMENT: Final = (
    f"SELECT state, MIN({_PREFIXED}), COUNT(*), MIN(updated_at), MAX(updated_at),"
    f" MIN(flow_id), MAX(flow_id) FROM {_sql.FLOWS}"
    f" WHERE state IN ('FAILED', 'BLOCKED') GROUP BY state, {_without_digits(_PREFIXED)}"
    " ORDER BY COUNT(*) DESC, MAX(updated_at) DESC LIMIT ?"
)
_COUNT: Final = f"SELECT COUNT(*) FROM {_sql.FLOWS} WHERE state IN ('FAILED', 'BLOCKED')"


def failure_groups(tx: Tx, *, limit: int = 20, scan: int = SCAN) -> Groups:
    """The FAILED and BLOCKED flows grouped by state and normalised error (`normalise`), most
    flows first (then the most recent), the first `limit` groups. Cost: one pass over the failed
    and blocked rows in the database (an index range of each state), at most `scan` rows read
    into Python, a count by state."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a whole number >= 1, got {limit!r}")
    rows = tx.execute(_STATEMENT, (int(scan),))
    merged: dict[tuple[str, str], _Acc] = {}
    for state, text, n, first, last, least, most in rows:
        key = (state, normalise(text, least if n == 1 else None))
        acc = merged.get(key)
        if acc is None:
            merged[key] = acc = _Acc(0, math.inf, -math.inf, [])
        acc.add(int(n), float(first), float(last), least)
        if most != least:
            acc.add(0, float(first), float(last), most)
    groups = sorted(
        (
            Group(
                state=state,
                error=error,
                flows=a.flows,
                first=a.first,
                last=a.last,
                examples=tuple(sorted(a.examples)),
            )
            for (state, error), a in merged.items()
        ),
        key=lambda g: (-g.flows, -g.last, g.state, g.error),
    )
    total = int(tx.execute(_COUNT)[0][0])
    grouped = sum(g.flows for g in groups)
    shown = groups[:limit]
    return Groups(
        groups=tuple(shown),
        total_groups=len(groups),
        groups_left_out=len(groups) - len(shown),
        flows_left_out=grouped - sum(g.flows for g in shown),
        flows_not_grouped=total - grouped,
        flows=total,
    )
