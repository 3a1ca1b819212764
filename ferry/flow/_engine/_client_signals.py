"""A client's readers of events and streams (`flow.Client`, SPEC 5.10): the same as
`Engine.get_event`, `get_events` and `stream`, from another process (docs/adr/0177).

A client is not told of an engine's commits in memory: it reads the store, and reads again
each time the store changed (`Client._changes`: on SQLite the file written by any process and
its ``data_version`` moved, a counter in memory, no table read; on PostgreSQL a notification on
the signals' or the settled flows' channel), and at least once a second. The watch is opened
only while a call waits (and the store read once more under it, so that a commit between the
read and the watch is not missed), so a stream that is dropped mid-way holds nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
from functools import partial
from typing import Any, Protocol, final

import trio

from ferry.projected import Store

from .._model import _checks
from .._model._errors import UnknownFlow
from .._model._types import Json
from .._runtime import _feeds, _read
from .._store import _signals

_ENDED = frozenset({"COMPLETED", "FAILED"})
_PAGE = 1000


class _Changes(Protocol):
    async def next(self) -> None: ...


async def _feed(
    store: Store, flow_id: str, after: int, events: bool, limit: int
) -> tuple[str, dict[str, str] | None, list[tuple[int, str]]]:
    read = partial(_signals.read_feed, flow_id=flow_id, after=after, events=events, limit=limit)
    state, got, values = await _read.read(store, read, f"reading the events of {flow_id!r}")
    if state is None:
        raise UnknownFlow(f"no flow has id {flow_id!r}")
    return state, got, values


class SignalCalls:
    """The readers of `flow.Client` (its `_store`, and `_changes`, its watch of the store)."""

    __slots__ = ()
    _store: Store

    def _changes(self) -> contextlib.AbstractAsyncContextManager[_Changes]:
        raise NotImplementedError  # `Client._changes`

    async def get_event(self, flow_id: str, key: str, *, timeout: float | None = None) -> Json:  # noqa: ASYNC109
        """`Engine.get_event`: the key's latest value, once a step set it. `UnknownFlow`;
        `LookupError` at once for a flow that ended without it; `trio.TooSlowError` after
        `timeout` seconds."""
        fid = _checks.flow_id(flow_id)
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {_checks.describe(key, 200)}")
        seconds = _feeds.check_timeout(timeout)
        async with self._changes() as changes:
            with trio.fail_after(math.inf if seconds is None else seconds):
                while True:
                    state, events, _ = await _feed(self._store, fid, 0, True, 0)
                    assert events is not None
                    if key in events:
                        return json.loads(events[key])
                    if state in _ENDED:
                        raise LookupError(
                            f"flow {fid!r} ended ({state}) without setting event {key!r}"
                        )
                    await changes.next()

    async def get_events(self, flow_id: str) -> dict[str, Json]:
        """`Engine.get_events`: every key set so far with its latest value. `UnknownFlow`."""
        fid = _checks.flow_id(flow_id)
        _state, events, _ = await _feed(self._store, fid, 0, True, 0)
        assert events is not None
        return {key: json.loads(text) for key, text in events.items()}

    def stream(self, flow_id: str, *, after: int = 0) -> ClientStream:
        """`Engine.stream`: an async iterator of ``(offset, value)`` after `after`, which ends
        once the flow ended and every value is read. Each step is a checkpoint."""
        return ClientStream(self, _checks.flow_id(flow_id), _feeds.check_after(after))


@final
class ClientStream:
    """`Client.stream`'s iterator: pages of the flow's stream, and a watch while it waits.
    Dropping it mid-way holds nothing (the watch is open only during a wait)."""

    __slots__ = ("_buffer", "_client", "_flow_id", "_pos")

    def __init__(self, client: SignalCalls, flow_id: str, after: int) -> None:
        self._client = client
        self._flow_id = flow_id
        self._pos = after
        self._buffer: list[tuple[int, str]] = []

    def __aiter__(self) -> ClientStream:
        return self

    async def __anext__(self) -> tuple[int, Any]:
        store = self._client._store
        fid = self._flow_id
        if not self._buffer:
            state, _, values = await _feed(store, fid, self._pos, False, _PAGE)
            if not values and state not in _ENDED:  # wait, under a watch read again first
                async with self._client._changes() as changes:
                    while True:
                        state, _, values = await _feed(store, fid, self._pos, False, _PAGE)
                        if values or state in _ENDED:
                            break
                        await changes.next()
            if not values:
                raise StopAsyncIteration
            self._buffer = values[::-1]
        else:
            await trio.lowlevel.checkpoint()
        offset, text = self._buffer.pop()
        self._pos = offset
        return offset, json.loads(text)
