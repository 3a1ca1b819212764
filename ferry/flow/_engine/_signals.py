"""The engine's readers of events and streams out of running flows (SPEC 5.10), a base of the
public `Engine` (its own class stays within the sizes of docs/adr/0137). The work is
`_runtime._feeds`'.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from .._model import _checks
from .._model._types import Json
from .._runtime import _feeds
from ._parts import Parts


class SignalReads:
    """`get_event`, `get_events` and `stream` of `Engine`."""

    _parts: Parts

    def _check(self, method: str) -> None:
        raise NotImplementedError  # `Engine._check`

    async def get_event(self, flow_id: str, key: str, *, timeout: float | None = None) -> Json:  # noqa: ASYNC109
        """The latest value of the flow's event `key` (`ctx.set_event`), waiting until a step
        sets it; no polling: woken by this engine's commit of the flow (in a fleet, also read
        once per lease for a flow another engine runs). Raises `flow.UnknownFlow` for no such
        flow, `LookupError` at once for a flow that ended (completed or failed) without setting
        it, `trio.TooSlowError` after `timeout` seconds, `TypeError`/`ValueError` for a bad
        id, key or timeout, `ferry.Failed` for a store error and `ferry.Closed` if the engine
        closes meanwhile. A checkpoint. Many callers on one flow share one read per write."""
        self._check("get_event")
        fid = _checks.flow_id(flow_id)
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {_checks.describe(key, 200)}")
        seconds = _feeds.check_timeout(timeout)
        return await self._parts.feeds.get_event(fid, key, seconds)

    async def get_events(self, flow_id: str) -> dict[str, Json]:
        """Every event key the flow set so far, with its latest value (one read, or none if a
        reader of the flow read since its last write). Raises `flow.UnknownFlow`. A
        checkpoint."""
        self._check("get_events")
        return await self._parts.feeds.get_events(_checks.flow_id(flow_id))

    def stream(self, flow_id: str, *, after: int = 0) -> AsyncIterator[tuple[int, Json]]:
        """An async iterator of the flow's stream (`ctx.emit`) as ``(offset, value)``, offsets
        1, 2, 3, ... from the first after `after` (0: every value), which ends once the flow
        has ended (completed or failed) and every value is read: a reader that joins late or
        resumes with the last offset it read gets exactly the rest. Pushed, not polled (as
        `get_event`); many readers of one flow share one read per write. Each step of it is a
        checkpoint and may raise `flow.UnknownFlow` (no such flow), `ferry.Failed` or
        `ferry.Closed`. No task is started; dropping the iterator leaves nothing behind.
        `TypeError`/`ValueError` here for a bad id or `after`."""
        self._check("stream")
        fid = _checks.flow_id(flow_id)
        return self._parts.feeds.stream(fid, _feeds.check_after(after))
