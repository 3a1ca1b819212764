"""The readers of events and streams out of running flows (SPEC 5.10): `Engine.get_event`,
`get_events` and `stream`.

Design
------
A flow somebody reads has a `Feed`: what was last read of it (its state, its events, the tail
of its stream) and a version counter moved by every committed write of the flow this engine
hears of (`Feeds.saw`, handed to the write path as the waits' `saw` is: the engine's own
commits; docs/adr/0176). A reader that finds nothing new in the feed waits for the version to
move (a `trio.Event` the write sets: no polling), then refreshes the feed: the first reader
so woken takes the feed's lock and reads once (the state, the events if anyone reads them, the
stream after the feed's tail), and the others find the feed fresh when they get the lock. So
N readers of one flow cost one read per write (at most one more per write that lands during a
read), not N. A reader more than `TAIL` values behind the feed (it joined late with
``after=0``, or its consumer is slow) reads its own pages until it catches up.

In a fleet another engine may run the flow: its commits are heard through PostgreSQL
notifications instead (docs/adr/0177): a batch that writes a flow's events or stream values
notifies the signals' channel, one that settles a flow the waits' channel; the feeds' own
listener (`_mode.Mode.listen_signals`, a thread with its connection, started by the first
feed and stopped with the engine) hears both and moves the versions of the feeds they name
(a revision this engine already saw is not read again). When the listening begins (again),
every feed is read once: what was sent before is not heard. Besides, a waiting reader reads
once per `fallback` seconds (the lease), for a notification that was lost.

Feeds live in a `weakref.WeakValueDictionary`: a feed is kept while a reader (an iterator of
`stream`, or a call of `get_event`) holds it, and goes with the last one; nothing is left
behind by a reader that stops early or is cancelled. No task is started: every read runs in a
reader's own task.

Invariants (trio thread): `Feed.read_at <= Feed.version`; the feed is fresh iff they are
equal and nothing is left to page (`more` False); `Feed.tail` is contiguous, its last offset
`Feed.top`.
"""

from __future__ import annotations

import contextlib
import json
import math
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any, TypeVar, final

import trio

from ferry import Closed

from .._model._errors import UnknownFlow
from .._model._types import Json
from .._model._values import Flow
from .._store import _signals
from ._mode import Listen, Listening

T = TypeVar("T")

#: Values a feed keeps of its stream's tail for readers that are a little behind.
TAIL = 1000
_ENDED = frozenset({"COMPLETED", "FAILED"})


@final
class Feed:
    """What this engine last read of one flow for its readers, and a version its writes move."""

    __slots__ = (
        "__weakref__",
        "changed",
        "events",
        "flow_id",
        "known",
        "lock",
        "more",
        "read_at",
        "seen",
        "state",
        "tail",
        "top",
        "version",
        "want_events",
        "want_stream",
    )

    def __init__(self, flow_id: str) -> None:
        self.flow_id = flow_id
        self.version = 0  # moved by every write of the flow heard of
        self.known = 0  # the newest revision of the flow this engine wrote or heard of
        self.read_at = -1  # the version the last read began at (-1: never read)
        self.changed = trio.Event()  # set (and replaced) when `version` moves
        self.lock = trio.Lock()  # one refresh at a time
        self.state: str | None = None  # as last read
        self.seen = False  # the flow was found once (a missing flow later: purged, ended)
        self.want_events = False  # some reader reads the events: a refresh reads them too
        self.want_stream = False  # some reader reads the stream: a refresh reads it too
        self.events: dict[str, str] | None = None
        self.tail: deque[tuple[int, str]] = deque(maxlen=TAIL)
        self.top = -1  # the last offset read (-1: none read yet)
        self.more = False  # the last read returned a full page: read again before waiting

    def fresh(self) -> bool:
        """Is what was read up to date with every write heard of, for what is read of it?"""
        if self.read_at != self.version or self.more:
            return False
        return (self.events is not None or not self.want_events) and (
            self.top >= 0 or not self.want_stream
        )

    @property
    def ended(self) -> bool:
        return self.state in _ENDED or (self.seen and self.state is None)


class Feeds:
    """The feeds of one engine and the reads that refresh them."""

    def __init__(
        self,
        read: Callable[[Callable[[Any], T], str], Awaitable[T]],
        *,
        fallback: float,
        listen: Listen | None = None,
    ) -> None:
        self._read: Callable[..., Awaitable[Any]] = read
        self._fallback = fallback  # seconds between reads while waiting (inf: one file)
        self._listen = listen  # makes the listener (a fleet on PostgreSQL), or None
        self.listener: Listening | None = None
        self._feeds: weakref.WeakValueDictionary[str, Feed] = weakref.WeakValueDictionary()
        self._closed = False
        #: Reads made, and the stream values they read, for the tests and the benches.
        self.reads = 0
        self.values_read = 0

    def saw(self, flow: Flow) -> None:
        """A committed write of `flow` (trio thread, commit order): its readers read again.
        O(1); nothing if nobody reads it."""
        feed = self._feeds.get(flow.flow_id)
        if feed is not None:
            feed.known = max(feed.known, flow.revision)
            _moved(feed)

    def _heard(self, pairs: list[tuple[str, int]] | None) -> None:
        """The listener heard of writes of these flows (None: of any): their readers read
        again, unless this engine saw that revision already."""
        feeds = self._feeds
        if pairs is None:
            for every in list(feeds.values()):
                _moved(every)
            return
        for fid, revision in pairs:
            feed = feeds.get(fid)
            if feed is not None and revision > feed.known:
                feed.known = revision
                _moved(feed)

    def _state(self, listening: bool) -> None:
        """The listener began (again) or stopped listening: what was sent meanwhile is lost,
        so every feed is read again once it listens."""
        if listening:
            self._heard(None)

    async def aclose(self) -> None:
        """Stop the listener, if a feed started one. A checkpoint."""
        listener, self.listener = self.listener, None
        if listener is not None:
            await listener.stop()
        else:
            await trio.lowlevel.checkpoint()

    def close(self) -> None:
        """The engine closes: every reader raises `ferry.Closed`."""
        self._closed = True
        for feed in list(self._feeds.values()):
            feed.changed.set()

    def feed(self, flow_id: str) -> Feed:
        feed = self._feeds.get(flow_id)
        if feed is None:
            feed = self._feeds[flow_id] = Feed(flow_id)
            if self._listen is not None and self.listener is None and not self._closed:
                self.listener = self._listen(self._heard, self._state)
                self.listener.start()
        return feed

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("the flow engine closed while reading a flow's events or stream")

    async def wait(self, feed: Feed) -> None:
        """Until the feed's version moves (or `fallback` seconds pass: a read is due)."""
        self._check_open()
        changed = feed.changed
        if self._fallback == math.inf:
            await changed.wait()
        else:
            with trio.move_on_after(self._fallback):
                await changed.wait()
            if not changed.is_set():
                self.saw_nothing(feed)
        self._check_open()

    def saw_nothing(self, feed: Feed) -> None:
        """A read is due without a write heard of (the fleet's fallback)."""
        feed.version += 1

    async def refresh(self, feed: Feed, after: int) -> None:
        """Bring `feed` up to date with one read, unless another reader did meanwhile; a reader
        at offset `after` asks (the first read starts the tail there). A checkpoint. Raises
        `UnknownFlow` if the flow was never found."""
        async with feed.lock:
            self._check_open()
            if feed.fresh():
                return
            version = feed.version
            start = feed.top if feed.top >= 0 else after
            what = f"reading the events and stream of flow {feed.flow_id!r}"
            limit = TAIL if feed.want_stream else 0
            read = partial(
                _signals.read_feed,
                flow_id=feed.flow_id,
                after=start,
                events=feed.want_events,
                limit=limit,
            )
            self.reads += 1
            state, events, values = await self._read(read, what)
            self.values_read += len(values)
            if state is None and not feed.seen:
                raise UnknownFlow(f"no flow has id {feed.flow_id!r}")
            feed.seen = True
            feed.state = state
            if events is not None:
                feed.events = events
            if feed.top < 0 and feed.want_stream:
                feed.top = start
            feed.tail.extend(values)
            if values:
                feed.top = values[-1][0]
            feed.more = limit > 0 and len(values) == limit
            feed.read_at = version

    async def page(self, flow_id: str, after: int) -> list[tuple[int, str]]:
        """A reader's own read of the values after `after` (it is behind the feed's tail)."""
        self.reads += 1
        read = partial(_signals.stream_of, flow_id=flow_id, after=after, limit=TAIL)
        result: list[tuple[int, str]] = await self._read(read, f"reading flow {flow_id!r}'s stream")
        self.values_read += len(result)
        return result

    # ------------------------------------------------------------------------ the readers

    async def get_event(self, flow_id: str, key: str, timeout: float | None) -> Json:  # noqa: ASYNC109
        """`Engine.get_event`: the key's latest value, once it is set."""
        with _deadline(timeout):
            feed = self.feed(flow_id)
            feed.want_events = True
            checked = False
            while True:
                if feed.fresh() and feed.events is not None:
                    text = feed.events.get(key)
                    if text is not None:
                        if not checked:
                            await trio.lowlevel.checkpoint()
                        return json.loads(text)
                    if feed.ended:
                        raise LookupError(
                            f"flow {flow_id!r} ended ({feed.state or 'purged'}) without setting"
                            f" event {key!r}"
                        )
                    await self.wait(feed)
                await self.refresh(feed, 0)
                checked = True

    async def get_events(self, flow_id: str) -> dict[str, Json]:
        """`Engine.get_events`: every key set so far, with its latest value (one read)."""
        feed = self.feed(flow_id)
        feed.want_events = True
        if not feed.fresh():
            await self.refresh(feed, 0)
        else:
            await trio.lowlevel.checkpoint()
        assert feed.events is not None
        return {key: json.loads(text) for key, text in feed.events.items()}

    def stream(self, flow_id: str, after: int) -> Stream:
        feed = self.feed(flow_id)
        feed.want_stream = True
        return Stream(self, feed, after)


def _moved(feed: Feed) -> None:
    """A write of the feed's flow: its readers read again."""
    feed.version += 1
    changed, feed.changed = feed.changed, trio.Event()
    changed.set()


@contextlib.contextmanager
def _deadline(timeout: float | None) -> Iterator[None]:
    if timeout is None:
        yield
        return
    with trio.fail_after(timeout):
        yield


def check_timeout(timeout: object) -> float | None:
    """`timeout` if it is None or a number >= 0; `TypeError`/`ValueError` otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
    return float(timeout)


def check_after(after: object) -> int:
    """`after` if it is an int >= 0; `TypeError`/`ValueError` otherwise."""
    if isinstance(after, bool) or not isinstance(after, int):
        raise TypeError(f"after must be an int offset (0: from the start), got {after!r}")
    if after < 0:
        raise ValueError(f"after must be >= 0, got {after!r}")
    return after


@final
class Stream:
    """`Engine.stream`'s async iterator of ``(offset, value)``: from the offset after `after`,
    until the flow has ended and every value is read. Every ``__anext__`` is a checkpoint. It
    holds its flow's feed while it lives; dropping it (or breaking out of a loop) leaves
    nothing behind."""

    __slots__ = ("_buffer", "_feed", "_feeds", "_pos")

    def __init__(self, feeds: Feeds, feed: Feed, after: int) -> None:
        self._feeds = feeds
        self._feed = feed
        self._pos = after  # the last offset yielded
        self._buffer: deque[tuple[int, str]] = deque()  # its own page, when behind the tail

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> tuple[int, Json]:
        feeds, feed = self._feeds, self._feed
        checked = False
        while True:
            found = self._next()
            if found is not None:
                if not checked:
                    await trio.lowlevel.checkpoint()
                self._pos = found[0]
                return found[0], json.loads(found[1])
            if feed.top >= 0 and self._pos < feed.top:  # behind the feed's tail: its own page
                page = await feeds.page(feed.flow_id, self._pos)
                if not page:  # the values are gone (the flow was purged meanwhile)
                    self._pos = feed.top
                self._buffer.extend(page)
                checked = True
                continue
            if feed.fresh():
                if feed.ended:
                    if not checked:
                        await trio.lowlevel.checkpoint()
                    raise StopAsyncIteration
                await feeds.wait(feed)
            await feeds.refresh(feed, self._pos)
            checked = True

    def _next(self) -> tuple[int, str] | None:
        """The next value after `_pos` held here or in the feed's tail, or None."""
        pos = self._pos
        buffer = self._buffer
        while buffer and buffer[0][0] <= pos:
            buffer.popleft()
        if buffer:
            return buffer.popleft()
        tail = self._feed.tail
        if not tail or tail[-1][0] <= pos or tail[0][0] > pos + 1:
            return None
        return tail[pos + 1 - tail[0][0]]
