"""The park deadlines of a serving engine, and the task that fires them.

The heap itself is `_timers` (pure). It sits in one `stm.TVar`; one task sleeps in
``retry(deadline=...)`` on its top (docs/adr/0023) and, when entries come due, starts a timeout
write for each (`fire`, given by the write path). Entries are never removed early: a flow woken
before its deadline leaves its entry behind, and the timeout transition, armed for the park's
revision, then does nothing.

In a fleet every engine arms the deadlines near enough of flows parked by any engine (its scans
see them again and again: `armed` keeps each (flow, revision) from being pushed twice), and
exactly one engine's timeout takes each (a compare-and-set on the parked revision).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import trio

import stm

from .._model import _timers as timers
from ._clock import Clock


class Timers:
    """The deadline heap of one engine, and its timer task (`run`)."""

    __slots__ = ("_clock", "_heap", "armed")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._heap: stm.TVar[timers.Heap] = stm.TVar(timers.EMPTY)
        # The revision each flow's pushed deadline is for (so that a fleet's scan does not arm
        # one twice); an entry leaves when it comes due.
        self.armed: dict[str, int] = {}

    def load(self, entries: Iterable[timers.Entry]) -> None:
        """Replace the heap by `entries`, sorted by deadline (recovery at open). No checkpoint."""
        stm.atomically_nowait(self._heap.set, timers.from_sorted(entries))

    def arm(self, deadline: float, flow_id: str, revision: int) -> None:
        """Push a timer for the flow parked at `revision` (once: a fleet's scans see it again)."""
        if self.armed.get(flow_id) == revision:
            return
        self.armed[flow_id] = revision
        entry = (deadline, flow_id, revision)
        stm.atomically_nowait(lambda: self._heap.set(timers.push(self._heap.get(), entry)))

    def _due_txn(self) -> list[timers.Entry]:
        trio_time = self._clock.trio_time
        heap = self._heap.get()
        first = timers.top(heap)
        if first is None:
            stm.retry()
        now = trio.current_time()
        if now < trio_time(first[0]):
            # Tested first, so this is right whether a passed deadline makes `retry` rerun the
            # transaction or return (then the top is due anyway and is taken below).
            stm.retry(deadline=trio_time(first[0]))
        due = [first]
        heap = timers.pop(heap)
        while (entry := timers.top(heap)) is not None and trio_time(entry[0]) <= now:
            due.append(entry)
            heap = timers.pop(heap)
        self._heap.set(heap)
        return due

    async def run(
        self,
        nursery: trio.Nursery,
        stale: Callable[[str, int], bool],
        fire: Callable[[str, int, float], Awaitable[object]],
    ) -> None:
        """The timer task: for every entry that comes due and is not `stale(flow_id, revision)`
        (the flow was woken meanwhile), start ``fire(flow_id, revision, deadline)`` in
        `nursery`. Runs until cancelled."""
        while True:
            due = await stm.atomically(self._due_txn)
            for deadline, fid, revision in due:
                if self.armed.get(fid) == revision:
                    del self.armed[fid]
                if stale(fid, revision):
                    continue
                nursery.start_soon(fire, fid, revision, deadline)
