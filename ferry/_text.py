"""Pure text forms that every layer may use (the standard library only, no I/O): the one text
of a JSON value (`canonical_json`) and a DSN's text without its password (`masked`, `shown`).

They sit below both the transport (`ferry.projected`) and the flow package's model and store,
which use them without importing the transport (tests/test_layers.py, docs/adr/0135).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final, TypeAlias

#: A JSON value (as `ferry.projected.Json`): kept as `Any` so user types need no casts.
Json: TypeAlias = Any

# One encoder for every call: `json.dumps` with options builds a new `JSONEncoder` each time,
# which costs more than encoding a small value. `encode` keeps no state between calls, so the
# one instance serves every thread.
_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def canonical_json(value: Json) -> str:
    """The one text form of a JSON value the journal stores and compares (sorted keys, no spaces).

    Raises `TypeError`/`ValueError` for values JSON cannot carry (sets, NaN, ...). Cost: O(size).
    """
    return _ENCODER.encode(value)


#: A DSN's password, in either form (``password=...`` or ``scheme://user:password@host``).
PASSWORD: Final = re.compile(
    r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)|(://[^:/@\s]*:)([^@\s]*)(@)"
)


def _mask(match: re.Match[str]) -> str:
    if match.group(1) is not None:
        return f"{match.group(1)}***"
    return f"{match.group(3)}***{match.group(5)}"


def masked(text: str) -> str:
    """`text` (a DSN, or an error that quotes one) with every password in it replaced by
    ``***``: what an error message or a log line may show of a DSN."""
    return PASSWORD.sub(_mask, text)


def shown(spec: str) -> str:
    """A store's path or DSN as a message prints it: quoted, a DSN's password masked."""
    return repr(masked(spec))
