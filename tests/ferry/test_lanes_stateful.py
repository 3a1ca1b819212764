"""The real `Lanes` against a naive reference model (plain lists and dicts), step by step.

After every rule, everything observable is compared: lane contents and order, lane states and
deadlines, the ready order, the waiting order, counters, and `next_deadline`. Every state ever
produced is checked again at the end of each step against the snapshot taken when it was made:
old states are never modified (persistence).
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ferry import _lanes as core
from ferry._lanes import Admission, Item, Limits

KEYS = st.sampled_from(["a", "b", "c"])


class Ref:
    """The waiting room the obvious way: slow, and correct by inspection."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.closed = False
        # key -> {"items": [(entry, weight, submitted, rank, arrival)], "calls", "where", ...}
        self.lanes: dict[str, dict[str, Any]] = {}
        self.ready: list[str] = []
        self.clock = 0  # orders lanes whose deadlines tie: when the deadline was set
        self.arrival = 0
        self.counts = dict.fromkeys(
            ["submitted", "admitted", "rejected", "direct_calls", "batches", "inputs_sent",
             "failed_batches", "dropped", "drained"], 0,
        )  # fmt: skip
        self.sizes: dict[int, int] = {}

    def queued(self) -> int:
        return sum(len(lane["items"]) for lane in self.lanes.values())

    def weight(self) -> float:
        return float(sum(it[1] for lane in self.lanes.values() for it in lane["items"]))

    def full(self, lane: dict[str, Any]) -> bool:
        items = lane["items"]
        return (
            len(items) >= self.limits.max_batch_size
            or sum(it[1] for it in items) >= self.limits.max_batch_weight
        )

    def to_waiting(self, lane: dict[str, Any], deadline: float) -> None:
        lane["where"], lane["deadline"], lane["since"] = "waiting", deadline, self.clock
        self.clock += 1

    def queue(self, key: str, now: float) -> None:
        lane = self.lanes[key]
        deadline = min(it[2] for it in lane["items"]) + self.limits.max_batch_delay
        if self.limits.max_batch_delay == 0 or self.full(lane) or deadline <= now:
            lane["where"] = "ready"
            self.ready.append(key)
        else:
            self.to_waiting(lane, deadline)

    def admit(self, key: str, entry: int, weight: float, rank: Any, now: float) -> Admission:
        self.counts["submitted"] += 1
        limits = self.limits
        if self.closed:
            return Admission.CLOSED
        if limits.direct_calls and limits.max_batch_delay == 0 and key not in self.lanes:
            self.lanes[key] = {"items": [], "calls": 1, "where": "idle"}
            self.counts["direct_calls"] += 1
            return Admission.CLAIMED
        if (
            self.queued() >= limits.max_queueing
            or self.weight() + weight > limits.max_queued_weight
        ):
            self.counts["rejected"] += 1
            return Admission.REJECTED
        self.counts["admitted"] += 1
        lane = self.lanes.setdefault(key, {"items": [], "calls": 0, "where": "idle"})
        was_empty = not lane["items"]
        lane["items"].append((entry, weight, now, rank, self.arrival))
        self.arrival += 1
        lane["items"].sort(key=lambda it: (it[3], it[4]) if it[3] is not None else it[4])
        if was_empty:
            if lane["calls"] == 0 or not limits.one_in_flight:
                if limits.max_batch_delay == 0 or self.full(lane):
                    lane["where"] = "ready"
                    self.ready.append(key)
                else:
                    self.to_waiting(lane, now + limits.max_batch_delay)
        elif lane["where"] == "waiting":
            if self.full(lane):
                lane["where"] = "ready"
                self.ready.append(key)
            elif now + limits.max_batch_delay < lane["deadline"]:
                self.to_waiting(lane, now + limits.max_batch_delay)
        return Admission.ADMITTED

    def waiting(self) -> list[tuple[float, str]]:
        found = [(lane["deadline"], lane["since"], key) for key, lane in self.lanes.items()
                 if lane["where"] == "waiting"]  # fmt: skip
        return [(d, k) for d, _, k in sorted(found)]

    def take(self, now: float) -> tuple[str, list[int]] | None:
        for deadline, key in self.waiting():
            if deadline <= now:
                self.lanes[key]["where"] = "ready"
                self.ready.append(key)
        if not self.ready:
            return None
        key = self.ready.pop(0)
        lane = self.lanes[key]
        batch: list[Any] = []
        for it in lane["items"]:
            if len(batch) == self.limits.max_batch_size:
                break
            if batch and sum(b[1] for b in batch) + it[1] > self.limits.max_batch_weight:
                break
            batch.append(it)
        del lane["items"][: len(batch)]
        lane["calls"] += 1
        lane["where"] = "idle"
        if lane["items"] and not self.limits.one_in_flight:
            self.queue(key, now)
        self.counts["batches"] += 1
        self.counts["inputs_sent"] += len(batch)
        self.sizes[len(batch)] = self.sizes.get(len(batch), 0) + 1
        return key, [it[0] for it in batch]

    def release(self, key: str, now: float, failed: bool) -> None:
        lane = self.lanes[key]
        lane["calls"] -= 1
        self.counts["failed_batches"] += failed
        if lane["calls"] == 0 and not lane["items"]:
            del self.lanes[key]
        elif (
            lane["items"]
            and lane["where"] == "idle"
            and (lane["calls"] == 0 or not self.limits.one_in_flight)
        ):
            self.queue(key, now)

    def cancel(self, key: str, entry: int) -> bool:
        lane = self.lanes.get(key)
        if lane is None or entry not in [it[0] for it in lane["items"]]:
            return False
        lane["items"] = [it for it in lane["items"] if it[0] != entry]
        self.counts["dropped"] += 1
        if not lane["items"]:
            if lane["where"] == "ready":
                self.ready.remove(key)
            lane["where"] = "idle"
            if lane["calls"] == 0:
                del self.lanes[key]
        return True

    def drain(self) -> list[int]:
        self.closed = True
        out = [it[0] for lane in self.lanes.values() for it in lane["items"]]
        self.lanes = {k: {"items": [], "calls": lane["calls"], "where": "idle"}
                      for k, lane in self.lanes.items() if lane["calls"]}  # fmt: skip
        self.ready = []
        self.counts["drained"] += len(out)
        return out


def observe(s: core.Lanes[Any, Any]) -> Any:
    """Everything a user of the room can see, as plain values."""
    where = {core.IDLE: "idle", core.WAITING: "waiting", core.READY: "ready"}
    lanes = {
        key: ([it.entry for it in lane.items()], lane.calls, where[lane.where])
        for key, lane in s.lanes.items()
    }
    counts = {name: getattr(s, name) for name in Ref(Limits()).counts}
    return (
        lanes,
        s.ready_keys(),
        s.waiting_keys(),
        s.queued,
        round(s.weight, 6),
        s.busy,
        s.closed,
        counts,
        dict(s.batch_sizes),
        core.next_deadline(s),
    )


def observe_ref(r: Ref) -> Any:
    lanes = {
        key: ([it[0] for it in lane["items"]], lane["calls"], lane["where"])
        for key, lane in r.lanes.items()
    }
    waiting = r.waiting()
    return (
        lanes,
        list(r.ready),
        waiting,
        r.queued(),
        round(r.weight(), 6),
        sum(lane["calls"] for lane in r.lanes.values()),
        r.closed,
        dict(r.counts),
        dict(r.sizes),
        waiting[0][0] if waiting else None,
    )


class LanesMachine(RuleBasedStateMachine):
    state: core.Lanes[Any, Any]

    @initialize(
        size=st.integers(1, 4),
        batch_weight=st.sampled_from([math.inf, 2.0, 3.5]),
        delay=st.sampled_from([0.0, 1.0, 1.0, 2.5]),
        queueing=st.integers(0, 8),
        queued_weight=st.sampled_from([math.inf, 6.0]),
        per_key=st.booleans(),
        direct=st.booleans(),
        ranked=st.booleans(),
    )
    def start(self, size, batch_weight, delay, queueing, queued_weight, per_key, direct, ranked):
        self.limits = Limits(
            max_batch_size=size,
            max_batch_weight=batch_weight,
            max_batch_delay=delay,
            max_queueing=queueing,
            max_queued_weight=queued_weight,
            direct_calls=direct and per_key,
            one_in_flight=per_key,
        )
        self.ranked = ranked
        self.state = core.empty(self.limits)
        self.ref = Ref(self.limits)
        self.now = 0.0
        self.entry = 0
        self.items: dict[int, tuple[str, Item[Any]]] = {}
        self.calls: list[str] = []  # one key per call in flight (batch or direct)
        self.history: list[tuple[core.Lanes[Any, Any], Any]] = []

    def step(self, new: core.Lanes[Any, Any]) -> None:
        self.history.append((self.state, observe(self.state)))
        self.state = new

    @rule(
        key=KEYS,
        weight=st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0]),
        rank=st.integers(0, 3),
        back=st.sampled_from([0.0, 0.0, 0.25, 0.5]),
    )
    def admit(self, key, weight, rank, back):
        if not self.limits.one_in_flight:
            key = "a"  # the plain ferry: one room
        now = self.now - back  # submitted a little earlier than admitted, sometimes
        r = rank if self.ranked else None
        new, outcome, item = core.admit(self.state, key, self.entry, weight=weight, rank=r, now=now)
        expected = self.ref.admit(key, self.entry, weight, r, now)
        assert outcome is expected
        if outcome is Admission.ADMITTED:
            assert item is not None and item.entry == self.entry and item.weight == weight
            self.items[self.entry] = (key, item)
        else:
            assert item is None
        if outcome is Admission.CLAIMED:
            self.calls.append(key)
        self.entry += 1
        self.step(new)

    @rule()
    def take(self):
        new, batch = core.take(self.state, self.now)
        expected = self.ref.take(self.now)
        if expected is None:
            assert batch is None
        else:
            assert batch is not None
            assert (batch.key, [it.entry for it in batch.items]) == expected
            self.calls.append(batch.key)
        self.step(new)

    @precondition(lambda self: self.calls)
    @rule(data=st.data(), failed=st.booleans())
    def release(self, data, failed):
        key = self.calls.pop(data.draw(st.integers(0, len(self.calls) - 1)))
        self.ref.release(key, self.now, failed)
        self.step(core.release(self.state, key, self.now, failed=failed))

    @precondition(lambda self: self.items)
    @rule(data=st.data())
    def cancel(self, data):
        entry = data.draw(st.sampled_from(sorted(self.items)))
        key, item = self.items.pop(entry)
        new, gone = core.cancel(self.state, key, item)
        assert gone == self.ref.cancel(key, entry)
        if not gone:
            assert new is self.state
        self.step(new)

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 3.0]))
    def tick(self, dt):
        self.now += dt

    @rule()
    def tick_to_deadline(self):
        deadline = core.next_deadline(self.state)
        if deadline is not None:
            self.now = max(self.now, deadline)

    @rule()
    def drain(self):
        new, drained = core.drain(self.state)
        assert sorted(it.entry for it in drained) == sorted(self.ref.drain())
        self.step(new)

    @invariant()
    def same_as_reference(self):
        core.check_invariants(self.state)
        assert observe(self.state) == observe_ref(self.ref)

    @invariant()
    def old_states_unchanged(self):
        for old, seen in self.history[-30:]:
            assert observe(old) == seen


TestLanes = LanesMachine.TestCase
TestLanes.settings = settings(TestLanes.settings, stateful_step_count=40)
