"""Finding flows: a filter (`FlowFilter`) and keyset pagination (`query_page`), for operators.

The inspector's ``list`` and bulk actions and the dashboard's flows page all ask the same
question -- which flows are in this state, of this plan and version, at this step, written or
started in this time range, with an id starting so -- and page through the answer. Here it is
asked once, in SQL that SQLite and PostgreSQL both run, against indexes made for it.

The order. Newest flow first: ``created_at`` descending, then ``flow_id`` descending. A flow's
``created_at`` and id never change, so a flow never moves from one page to another while
engines run (``updated_at`` would move every running flow to the front at each step, and a
reader paging by it would see flows twice or never), and the indexes that hold it are not
touched by an engine's writes except where they hold the state (docs/adr/0080). With an id
prefix the order is the id's instead (ascending, bytewise): the primary key then answers both
the filter and the order, however many flows the prefix matches.

Pagination is by keyset, not ``OFFSET``: the cursor of a page is the sort key of its last flow,
and the next page is the flows after it in the order, found by a range over the index. The
100th page costs what the first does. A cursor is an opaque string (URL-safe); one made for
another order, or not made here, is refused with a `ValueError`.

Indexes (in `_schema.ddl`, so an engine that opens an existing store adds them):
``(created_at, flow_id)`` for the unfiltered list and the creation time range,
``(state, created_at, flow_id)`` and ``(plan, version, created_at, flow_id)`` for the state and
plan filters; the primary key (on PostgreSQL an index on ``flow_id COLLATE "C"``, since the
database's collation may not order bytewise) for an id prefix. The step and the last-write time
range have no index of their own: they narrow one of the others, and the page is found by
reading the index in order until it is full (fast when many flows match; at worst a scan of the
flows the other conditions leave).

Everything here is synchronous and runs inside a store transaction (`Store.transact`).
"""

from __future__ import annotations

import base64
import datetime
import json
from typing import Any

import attrs

from ferry.projected import Tx

from .._model import _checks, _times
from .._model._plan import MAX_VERSION
from .._model._types import State
from .._model._values import Flow
from . import _dialect, _sql
from ._sql import FIELDS as _FIELDS
from ._sql import to_flow as _to_flow
from ._triage import ERROR_TEXT

#: The most flows one page may hold.
MAX_LIMIT = 1000


def _opt_state(value: object) -> State | None:
    if value is None or isinstance(value, State):
        return value
    raise TypeError(f"state must be a flow.State or None, got {value!r}")


def _check_text(name: str) -> Any:
    def check(_self: object, _attr: object, value: object) -> None:
        if value is None:
            return
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str or None, got {value!r}")
        if not value:
            raise ValueError(f"{name} must not be empty (leave it out to match every flow)")
        if "\x00" in value:
            raise ValueError(f"{name} must not contain a NUL character, got {value!r}")
        problem = _checks.text_problem(value)
        if problem is not None:  # a lone surrogate: no stored text holds it
            raise ValueError(f"{name} cannot match any stored text: {problem}")

    return check


def _check_version(_self: object, _attr: object, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"version must be an int or None, got {value!r}")
    if not 1 <= value <= MAX_VERSION:
        raise ValueError(
            f"version must be >= 1 and <= {MAX_VERSION} (a plan's versions), got"
            f" {_checks.shown_number(value)}"
        )


def _check_time(_self: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{attr.name} must be seconds since the epoch (a float) or None, got {value!r}"
        )
    if not _checks.finite(value):
        raise ValueError(f"{attr.name} must be a finite time, got {_checks.shown_number(value)}")


@attrs.frozen(kw_only=True)
class FlowFilter:
    """Which flows: every condition given must hold (None: any). Times are seconds since the
    epoch; a range is ``after <= t < before``.

    - `state`: the flow's state; `plan`, `version`: its plan name and version; `step`: the
      name of its current step.
    - `updated_after`/`updated_before`: the time of its last write; `created_after`/
      `created_before`: when it was started.
    - `id_prefix`: its id starts with this (then the flows come in id order).
    - `parent`: it is a child of the flow of this id (SPEC 5.7; the index on ``parent``).
    - `error`: its error (`Snapshot.error`: a BLOCKED flow's reason, any other flow's error)
      holds this text, in any case (PostgreSQL folds every letter's case, SQLite's ``LIKE``
      only ASCII's); ``%``, ``_`` and ``\\`` in it are matched as themselves. No index
      serves it: it narrows the rows the other conditions leave (docs/adr/0127).

    Raises `TypeError` for a value of the wrong type and `ValueError` for an impossible one
    (an empty name, a version < 1, a time that is not finite, a range that ends before it
    starts). `FlowFilter.from_text` builds one from an operator's words.
    """

    state: State | None = attrs.field(default=None, converter=_opt_state)
    plan: str | None = attrs.field(default=None, validator=_check_text("plan"))
    version: int | None = attrs.field(default=None, validator=_check_version)
    step: str | None = attrs.field(default=None, validator=_check_text("step"))
    updated_after: float | None = attrs.field(default=None, validator=_check_time)
    updated_before: float | None = attrs.field(default=None, validator=_check_time)
    created_after: float | None = attrs.field(default=None, validator=_check_time)
    created_before: float | None = attrs.field(default=None, validator=_check_time)
    id_prefix: str | None = attrs.field(default=None, validator=_check_text("id_prefix"))
    error: str | None = attrs.field(default=None, validator=_check_text("error"))
    parent: str | None = attrs.field(default=None, validator=_check_text("parent"))

    def __attrs_post_init__(self) -> None:
        for what in ("updated", "created"):
            lo, hi = getattr(self, f"{what}_after"), getattr(self, f"{what}_before")
            if lo is not None and hi is not None and hi < lo:
                raise ValueError(
                    f"{what}_before ({_iso(hi)}) is earlier than {what}_after ({_iso(lo)}):"
                    " no flow can match; swap them"
                )

    @property
    def by_id(self) -> bool:
        """Do the matches come in id order (an id prefix is given)?"""
        return self.id_prefix is not None

    def is_empty(self) -> bool:
        """Does it match every flow?"""
        return self == FlowFilter()

    @classmethod
    def from_text(
        cls,
        *,
        now: float,
        state: str | None = None,
        plan: str | None = None,
        version: str | None = None,
        step: str | None = None,
        updated_after: str | None = None,
        updated_before: str | None = None,
        created_after: str | None = None,
        created_before: str | None = None,
        id_prefix: str | None = None,
        error: str | None = None,
        parent: str | None = None,
    ) -> FlowFilter:
        """A filter from words (a form, a command line); empty or None words are left out.

        `state` is a state's name in any case (``blocked``); `version` a whole number; times
        are ISO 8601 (``2026-12-01T12:00``, UTC unless it names a zone) or a duration before
        `now` (``90s``, ``15m``, ``2h``, ``3d``). Raises `ValueError` naming the word that is
        wrong and what it should be."""

        def word(text: str | None) -> str | None:
            return None if text is None or not text.strip() else text.strip()

        s = word(state)
        st: State | None = None
        if s is not None:
            try:
                st = State[s.upper()]
            except KeyError:
                names = ", ".join(x.name for x in State)
                raise ValueError(f"no state {s!r}: give one of {names}") from None
        v = word(version)
        ver: int | None = None
        if v is not None:
            try:
                ver = int(v)
            except ValueError:
                raise ValueError(
                    f"version must be a whole number from 1 to {MAX_VERSION}, got"
                    f" {_checks.shown_number(v)}"
                ) from None
        times = {
            name: None if word(text) is None else parse_time(str(word(text)), now, name)
            for name, text in (
                ("updated_after", updated_after),
                ("updated_before", updated_before),
                ("created_after", created_after),
                ("created_before", created_before),
            )
        }
        return cls(
            state=st,
            plan=word(plan),
            version=ver,
            step=word(step),
            id_prefix=id_prefix or None,  # kept as given: an id may begin with a space
            error=word(error),
            parent=parent or None,  # kept as given, like an id prefix
            **times,
        )

    def where(self, dialect: str) -> tuple[list[str], list[Any]]:
        """The SQL conditions (to be joined with AND) and their parameters."""
        conds: list[str] = []
        params: list[Any] = []
        for column, value in (
            ("state", None if self.state is None else self.state.value),
            ("plan", self.plan),
            ("version", self.version),
            ("step", self.step),
            ("parent", self.parent),
        ):
            if value is not None:
                conds.append(f"{column} = ?")
                params.append(value)
        for column, lo, hi in (
            ("updated_at", self.updated_after, self.updated_before),
            ("created_at", self.created_after, self.created_before),
        ):
            if lo is not None:
                conds.append(f"{column} >= ?")
                params.append(float(lo))
            if hi is not None:
                conds.append(f"{column} < ?")
                params.append(float(hi))
        if self.id_prefix is not None:
            fid = _id_column(dialect)
            conds.append(f"{fid} >= ?")
            params.append(self.id_prefix)
            upper = _after_prefix(self.id_prefix)
            if upper is not None:
                conds.append(f"{fid} < ?")
                params.append(upper)
        if self.error is not None:
            like = _dialect.DIALECTS[dialect].like_any_case
            conds.append(f"({ERROR_TEXT}) {like} ? ESCAPE '\\'")
            params.append(f"%{like_literal(self.error)}%")
        return conds, params


def like_literal(text: str) -> str:
    """`text` as a ``LIKE ... ESCAPE '\\'`` pattern that matches it literally (its ``%``,
    ``_`` and ``\\`` escaped)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def parse_time(text: str, now: float, name: str = "time") -> float:
    """Seconds since the epoch from ISO 8601 (UTC unless it names a zone) or a duration before
    `now` (``90s``, ``15m``, ``2h``, ``3d``); `ValueError` naming `name` otherwise."""
    when = _times.read(text, now, units="smhd")
    if when is None:
        raise ValueError(
            f"{name}: {_checks.shown_number(text.strip())} is neither a time (ISO 8601, e.g."
            " 2026-12-01T12:00) nor a duration before now (e.g. 90s, 15m, 2h, 3d)"
        )
    return when


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


def _id_column(dialect: str) -> str:
    # A prefix is a range of ids only in byte order (PostgreSQL's collation may not be).
    return "flow_id" + _dialect.DIALECTS[dialect].bytewise


def _after_prefix(prefix: str) -> str | None:
    """The least string greater than every string starting with `prefix` (code point order,
    which is UTF-8's byte order), or None if there is none."""
    chars = list(prefix)
    while chars:
        last = ord(chars.pop())
        nxt = last + 1
        if 0xD800 <= nxt <= 0xDFFF:  # surrogates are no characters of a stored string
            nxt = 0xE000
        if nxt <= 0x10FFFF:
            return "".join(chars) + chr(nxt)
    return None


# ------------------------------------------------------------------------------- pagination


@attrs.frozen
class Page:
    """One page of flows in the filter's order; `next` is the cursor of the page after it
    (None: this is the last); `created` the start time of each flow (as `flows`)."""

    flows: tuple[Flow, ...]
    next: str | None
    created: tuple[float, ...] = ()


def _cursor(f: Flow, created_at: float, by_id: bool) -> str:
    key: list[Any] = ["i", f.flow_id] if by_id else ["c", created_at, f.flow_id]
    raw = json.dumps(key, ensure_ascii=False, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode(cursor: str, by_id: bool) -> list[Any]:
    bad = ValueError(
        f"not a cursor of this listing: {cursor[:60]!r} (start again from the first page)"
    )
    if not isinstance(cursor, str):
        raise TypeError(f"a cursor is a str, got {cursor!r}")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        key = json.loads(raw, parse_constant=_no_constant)  # no NaN, no Infinity
    except ValueError:
        raise bad from None
    if by_id:
        ok = isinstance(key, list) and len(key) == 2 and key[0] == "i"
        ok = ok and isinstance(key[1], str)
    else:
        ok = isinstance(key, list) and len(key) == 3 and key[0] == "c"
        ok = ok and isinstance(key[1], int | float) and not isinstance(key[1], bool)
        ok = ok and _checks.finite(key[1]) and isinstance(key[2], str)
    if not ok:
        raise bad
    return list(key)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is no time")


def check_cursor(cursor: str) -> str:
    """`cursor` if it is a cursor of either order (by start time, by id); else `ValueError`
    (for a command line, which checks it before it knows the order)."""
    try:
        _decode(cursor, by_id=False)
    except ValueError:
        _decode(cursor, by_id=True)
    return cursor


def _check_limit(limit: object) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, got {limit!r}")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(
            f"limit must be between 1 and {MAX_LIMIT}, got {_checks.shown_number(limit)}"
        )
    return limit


def page_sql(
    flt: FlowFilter, dialect: str, *, limit: int = 50, after: str | None = None
) -> tuple[str, list[Any]]:
    """The statement of `query_page` and its parameters (for tests and ``EXPLAIN``)."""
    limit = _check_limit(limit)
    conds, params = flt.where(dialect)
    fid = _id_column(dialect)
    if after is not None:
        key = _decode(after, flt.by_id)
        if flt.by_id:
            conds.append(f"{fid} > ?")
            params.append(key[1])
        else:
            # A row value: both databases read it as one range over the index.
            conds.append("(created_at, flow_id) < (?, ?)")
            params += [float(key[1]), key[2]]
    order = f"{fid}" if flt.by_id else "created_at DESC, flow_id DESC"
    sql = f"SELECT {', '.join(_FIELDS)}, created_at FROM {_sql.FLOWS}"
    if conds:
        sql += " WHERE " + " AND ".join(conds)
    # One more than the page: is there a next page?
    sql += f" ORDER BY {order} LIMIT {limit + 1}"
    return sql, params


def query_page(tx: Tx, flt: FlowFilter, *, limit: int = 50, after: str | None = None) -> Page:
    """The first `limit` flows matching `flt` (after the flow of the cursor `after`, if given),
    newest first (in id order with an id prefix). Cost: a range over an index, about `limit`
    rows read when the conditions are indexed (see the module's docstring). Raises
    `ValueError` for a bad cursor or limit."""
    sql, params = page_sql(flt, tx.dialect, limit=limit, after=after)
    rows = tx.execute(sql, params)
    more = len(rows) > limit
    rows = rows[:limit]
    flows = tuple(_to_flow(r) for r in rows)
    nxt = None
    if more and rows:
        nxt = _cursor(flows[-1], rows[-1][len(_FIELDS)], flt.by_id)
    return Page(flows, nxt, tuple(r[len(_FIELDS)] for r in rows))


def count(tx: Tx, flt: FlowFilter) -> int:
    """How many flows match `flt`. Cost: a pass over the matching index entries."""
    conds, params = flt.where(tx.dialect)
    sql = f"SELECT COUNT(*) FROM {_sql.FLOWS}"
    if conds:
        sql += " WHERE " + " AND ".join(conds)
    return int(tx.execute(sql, params)[0][0])


def count_upto(tx: Tx, flt: FlowFilter, cap: int) -> int:
    """How many flows match `flt`, counted up to ``cap + 1`` (a result over `cap` means "more
    than `cap`"). Cost: at most ``cap + 1`` matching index entries, whatever the store's size."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"cap must be a whole number >= 0, got {_checks.shown_number(cap)}")
    conds, params = flt.where(tx.dialect)
    inner = f"SELECT 1 FROM {_sql.FLOWS}"
    if conds:
        inner += " WHERE " + " AND ".join(conds)
    sql = f"SELECT COUNT(*) FROM ({inner} LIMIT {int(cap) + 1}) AS upto"
    return int(tx.execute(sql, params)[0][0])


def cursor_of(f: Flow, created_at: float, by_id: bool) -> str:
    """The cursor of the place of flow `f` (started at `created_at`) in the listing: the page
    ``after`` it begins with the flow after it, the page ``before`` it ends with the one before."""
    return _cursor(f, created_at, by_id)


def query_page_before(
    tx: Tx, flt: FlowFilter, *, limit: int = 50, before: str
) -> tuple[Page, str | None]:
    """The `limit` flows matching `flt` just before the flow of the cursor `before`, in the
    listing's order (the previous page), and the cursor of the page before that one (None: this
    is the first page). The page's `next` is the cursor after its last flow. Cost: as
    `query_page` (the same index range, read the other way). Raises `ValueError` for a bad
    cursor or limit."""
    limit = _check_limit(limit)
    conds, params = flt.where(tx.dialect)
    fid = _id_column(dialect=tx.dialect)
    key = _decode(before, flt.by_id)
    if flt.by_id:
        conds.append(f"{fid} < ?")
        params.append(key[1])
        order = f"{fid} DESC"
    else:
        conds.append("(created_at, flow_id) > (?, ?)")
        params += [float(key[1]), key[2]]
        order = "created_at ASC, flow_id ASC"
    sql = f"SELECT {', '.join(_FIELDS)}, created_at FROM {_sql.FLOWS}"
    sql += " WHERE " + " AND ".join(conds)
    sql += f" ORDER BY {order} LIMIT {limit + 1}"
    rows = tx.execute(sql, params)
    more = len(rows) > limit
    rows = list(reversed(rows[:limit]))
    flows = tuple(_to_flow(r) for r in rows)
    created = tuple(r[len(_FIELDS)] for r in rows)
    nxt = _cursor(flows[-1], created[-1], flt.by_id) if flows else None
    prev = _cursor(flows[0], created[0], flt.by_id) if more and flows else None
    return Page(flows, nxt, created), prev
