"""The one read path of the trio side: a store read (a function of `_store`, `_inbox`, ... run
in one transaction on the store's thread) and the one error contract every caller meets
(docs/adr/0134). A read for a caller outside the engine goes through `read`: the engine's API
(`Requests.read`, and through it the waits) and the client (`flow.connect`'s `get`,
`history`, and its requests' reads: their answers, the engines' leases). A read the engine
makes for itself, inside a loop that retries (`Writes.load_row`, which the runner and the
lease re-read rows with), goes through `own`.

What `read` raises:

- a lost connection, a locked or busy database, a full disk, a server that restarts (the store
  is unavailable now: `_retry.unavailable`): `ferry.Failed` naming what was read, its
  ``__cause__`` the driver's error, and `_retry.unavailable` is True for it. A caller that
  retries (the engine's own reads, with `_retry.Backoff`) pauses and reads again; an API call
  raises it to its caller, who may call again.
- a closed store (its ``async with`` ended): `ferry.Failed`, its ``__cause__`` the store's
  `trio.ClosedResourceError`; not unavailable, so nothing retries it.
- any other error of the database or of the read (a missing table, a corrupt file, a row the
  codec cannot read): `ferry.Failed`, its ``__cause__`` the error; not unavailable.
- `trio.Cancelled` if cancelled: nothing was read.

The driver's exception is never raised as it is: a caller needs to know one type, and the
message names what failed.

What `own` raises: the same errors as they are (the driver's, `trio.ClosedResourceError`, the
codec's), which `_retry.unavailable` classifies exactly as it classifies `read`'s `Failed`:
the engine's loop retries the unavailable ones (`_retry.Backoff`), and any other error ends the
engine's ``async with`` block with that error itself, as every error of the engine's own
store calls does (docs/adr/0061).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ferry import Failed
from ferry.projected import Store

T = TypeVar("T")


async def read(store: Store, fn: Callable[[Any], T], what: str) -> T:
    """``fn(tx)`` in one transaction of `store`; `what` names the read in the error ("reading
    flow 'f'"). Raises as the module docstring says: `ferry.Failed` for every error of the
    store or of `fn`, its cause the error. A checkpoint."""
    try:
        return await store.transact(fn)
    except Exception as exc:
        raise Failed(f"the flow store failed while {what}: {exc!r}") from exc


async def own(store: Store, fn: Callable[[Any], T]) -> T:
    """``fn(tx)`` in one transaction of `store`, for the engine itself: its errors as they are
    (the module docstring). A checkpoint."""
    return await store.transact(fn)
