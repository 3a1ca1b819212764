"""Unit tests of the pure waiting room: every transition and every branch of admission."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from ferry import _lanes as core
from ferry import _persistent as persistent
from ferry import _room
from ferry._lanes import (
    Admission,
    Lanes,
    Limits,
    admit,
    cancel,
    check_invariants,
    claim,
    drain,
    empty,
    next_deadline,
    release,
    take,
)


def _admit(s: Lanes[Any, Any], key: Any, entry: Any, **kw: Any) -> tuple[Lanes[Any, Any], Any]:
    kw.setdefault("now", 0.0)
    s2, outcome, item = admit(s, key, entry, **kw)
    check_invariants(s2)
    return s2, (outcome, item)


def _entries(batch: Any) -> list[Any]:
    return [it.entry for it in batch.items]


# ---- admission ------------------------------------------------------------------------------


def test_admit_into_new_lane_zero_delay_is_ready() -> None:
    s, (outcome, item) = _admit(empty(Limits()), "a", "x", weight=2.0, now=3.0)
    assert outcome is Admission.ADMITTED
    assert (item.entry, item.weight, item.submitted, item.rank) == ("x", 2.0, 3.0, None)
    assert s.ready_keys() == ["a"] and s.waiting_keys() == []
    assert (s.queued, s.weight, s.submitted, s.admitted) == (1, 2.0, 1, 1)
    assert next_deadline(s) is None


def test_admit_with_delay_waits_until_deadline() -> None:
    s, _ = _admit(empty(Limits(max_batch_delay=0.5)), "a", 1, now=1.0)
    assert s.waiting_keys() == [(1.5, "a")] and next_deadline(s) == 1.5
    s, _ = _admit(s, "a", 2, now=1.2)
    assert s.waiting_keys() == [(1.5, "a")]  # the oldest input sets the deadline
    s, _ = _admit(s, "a", 3, now=0.9)  # submitted earlier, admitted later: earlier deadline
    assert s.waiting_keys() == [(1.4, "a")] and next_deadline(s) == 1.4


def test_admit_full_lane_becomes_ready_by_size_and_by_weight() -> None:
    s = empty(Limits(max_batch_size=2, max_batch_weight=3.0, max_batch_delay=1.0))
    s, _ = _admit(s, "a", 1)
    s, _ = _admit(s, "a", 2)
    assert s.ready_keys() == ["a"] and next_deadline(s) is None
    s, _ = _admit(s, "b", 3, weight=1.0)
    s, _ = _admit(s, "b", 4, weight=2.5)
    assert s.ready_keys() == ["a", "b"]
    s, _ = _admit(s, "c", 5, weight=7.0)  # heavier than a batch: ready alone, at once
    assert s.ready_keys() == ["a", "b", "c"]


def test_admit_when_closed() -> None:
    s, _ = drain(empty(Limits()))
    s, (outcome, item) = _admit(s, "a", 1)
    assert (outcome, item) == (Admission.CLOSED, None)
    assert (s.submitted, s.admitted, s.queued) == (1, 0, 0) and not s.lanes


def test_admit_claims_an_idle_key_for_a_direct_call() -> None:
    s, (outcome, item) = _admit(empty(Limits(direct_calls=True)), "a", 1)
    assert (outcome, item) == (Admission.CLAIMED, None)
    assert (s.busy, s.direct_calls, s.submitted, s.admitted, s.queued) == (1, 1, 1, 0, 0)
    assert s.lanes["a"].calls == 1 and s.ready_keys() == []
    s, (outcome, _) = _admit(s, "a", 2)  # the key is busy: wait for it
    assert outcome is Admission.ADMITTED and s.ready_keys() == []
    s = release(s, "a", 0.0)
    check_invariants(s)
    assert s.ready_keys() == ["a"] and s.busy == 0


def test_no_claim_with_delay() -> None:
    _, (outcome, _) = _admit(empty(Limits(direct_calls=True, max_batch_delay=0.1)), "a", 1)
    assert outcome is Admission.ADMITTED


@pytest.mark.parametrize(
    "limits", [Limits(max_queueing=2), Limits(max_queued_weight=2.5)], ids=["count", "weight"]
)
def test_admit_rejects_when_room_is_full(limits: Limits) -> None:
    s, _ = _admit(empty(limits), "a", 1)
    s, _ = _admit(s, "b", 2)
    before = s
    s, (outcome, item) = _admit(s, "c", 3)
    assert (outcome, item) == (Admission.REJECTED, None)
    assert (s.rejected, s.submitted, s.queued) == (1, 3, 2) and s.lanes == before.lanes


def test_rejected_by_weight_only_when_it_does_not_fit() -> None:
    s, _ = _admit(empty(Limits(max_queued_weight=2.0)), "a", 1, weight=1.5)
    s, (outcome, _) = _admit(s, "a", 2, weight=0.5)
    assert outcome is Admission.ADMITTED
    s, (outcome, _) = _admit(s, "a", 3, weight=0.0)
    assert outcome is Admission.ADMITTED  # weight zero always fits


def test_claim_alone() -> None:
    s = claim(empty(Limits(direct_calls=True)), "k")
    check_invariants(s)
    assert s.busy == 1 and s.direct_calls == 1 and s.submitted == 1  # as admit counts it
    with pytest.raises(AssertionError):
        claim(s, "k")


def test_mixing_ranked_and_unranked_in_one_lane_is_refused() -> None:
    s, _ = _admit(empty(Limits()), "a", 1)
    with pytest.raises(AssertionError, match="ranked"):
        admit(s, "a", 2, rank=3, now=0.0)


# ---- take -----------------------------------------------------------------------------------


def test_take_nothing_ready_returns_the_same_state() -> None:
    s, _ = _admit(empty(Limits(max_batch_delay=1.0)), "a", 1)
    s2, batch = take(s, 0.5)
    assert batch is None and s2 is s


def test_take_promotes_due_lanes_in_deadline_order() -> None:
    s = empty(Limits(max_batch_delay=1.0))
    s, _ = _admit(s, "b", 1, now=0.2)
    s, _ = _admit(s, "a", 2, now=0.1)
    s, batch = take(s, 1.5)
    check_invariants(s)
    assert batch is not None and batch.key == "a"
    assert s.ready_keys() == ["b"] and s.lanes["a"].calls == 1 and s.busy == 1
    assert (s.batches, s.inputs_sent, dict(s.batch_sizes)) == (1, 1, {1: 1})


def test_take_splits_by_size_and_weight_and_sends_a_heavy_input_alone() -> None:
    s = empty(Limits(max_batch_size=3, max_batch_weight=4.0))
    for i, w in enumerate([1.0, 2.0, 0.5, 1.0, 9.0, 1.0]):
        s, _ = _admit(s, "a", i, weight=w)
    sent = []
    while s.queued:
        s, batch = take(s, 0.0)
        check_invariants(s)
        assert batch is not None
        sent.append(_entries(batch))
        s = release(s, "a", 0.0)
        check_invariants(s)
    assert sent == [[0, 1, 2], [3], [4], [5]]
    assert not s.lanes and s.weight == 0.0


def test_take_skips_cancelled_entries() -> None:
    s = empty(Limits(max_batch_size=2))
    items = []
    for i in range(4):
        s, (_, it) = _admit(s, "a", i)
        items.append(it)
    s, gone = cancel(s, "a", items[0])
    assert gone
    s, _ = cancel(s, "a", items[2])
    s, batch = take(s, 0.0)
    check_invariants(s)
    assert _entries(batch) == [1, 3] and s.queued == 0


def test_ranked_lane_takes_in_rank_order_ties_by_arrival() -> None:
    s = empty(Limits(max_batch_size=3, max_batch_delay=1.0))
    for i, rank in enumerate([5, 1, 3, 1, 0]):
        s, _ = _admit(s, "a", i, rank=rank)
    s, batch = take(s, 0.0)
    assert _entries(batch) == [4, 1, 3]
    s = release(s, "a", 0.5)
    check_invariants(s)
    assert s.waiting_keys() == [(1.0, "a")]  # 2 left, partial, deadline ahead
    s, batch = take(s, 1.0)
    assert _entries(batch) == [2, 0]


def test_busy_lane_is_not_taken_again_until_released() -> None:
    s = empty(Limits(max_batch_size=1))
    for i in range(2):
        s, _ = _admit(s, "a", i)
    s, _ = _admit(s, "b", 9)
    s, first = take(s, 0.0)
    s, second = take(s, 0.0)
    _, third = take(s, 0.0)
    assert first is not None and second is not None
    assert (first.key, second.key, third) == ("a", "b", None)
    s = release(s, "a", 0.0)
    s, again = take(s, 0.0)
    assert _entries(again) == [1]


# ---- release --------------------------------------------------------------------------------


def test_release_back_to_tail_of_ready_or_to_waiting() -> None:
    s = empty(Limits(max_batch_size=2, max_batch_delay=1.0))
    for i in range(5):
        s, _ = _admit(s, "a", i, now=0.0)
    s, _ = _admit(s, "b", 9, now=0.0)
    s, batch = take(s, 0.0)  # a is full: ready at once
    assert batch is not None and batch.key == "a"
    s, _ = take(s, 1.0)  # b, promoted
    s = release(s, "a", 1.0)
    check_invariants(s)
    assert s.ready_keys() == ["a"]  # 3 left: full
    s, batch = take(s, 1.0)
    s = release(s, "a", 1.0)
    assert s.ready_keys() == ["a"]  # 1 left but its deadline (1.0) has passed
    s, batch = take(s, 1.0)
    s, _ = _admit(s, "a", 10, now=1.5)
    s = release(s, "a", 2.0, failed=True)
    check_invariants(s)
    assert s.waiting_keys() == [(2.5, "a")] and s.failed_batches == 1
    s = release(s, "b", 2.0)
    assert "b" not in s.lanes and s.busy == 0


def test_release_without_a_call_is_refused() -> None:
    s, _ = _admit(empty(Limits()), "a", 1)
    with pytest.raises(AssertionError, match="no call in flight"):
        release(s, "a", 0.0)


def test_plain_room_keeps_several_batches_in_flight() -> None:
    s = empty(Limits(max_batch_size=2, max_batch_delay=1.0, one_in_flight=False))
    for i in range(5):
        s, _ = _admit(s, None, i, now=0.0)
    s, b1 = take(s, 0.0)
    s, b2 = take(s, 0.0)
    check_invariants(s)
    assert (_entries(b1), _entries(b2)) == ([0, 1], [2, 3])
    assert s.busy == 2 and s.lanes[None].calls == 2 and s.waiting_keys() == [(1.0, None)]
    s, b3 = take(s, 0.5)
    assert b3 is None
    s = release(s, None, 0.5)
    s, b3 = take(s, 1.0)
    assert _entries(b3) == [4]
    s = release(s, None, 1.0)
    s = release(s, None, 1.0)
    check_invariants(s)
    assert not s.lanes and s.busy == 0


# ---- cancel ---------------------------------------------------------------------------------


def test_cancel_removes_an_emptied_idle_lane_and_its_deadline() -> None:
    s = empty(Limits(max_batch_delay=1.0))
    s, (_, item) = _admit(s, "a", 1)
    s, gone = cancel(s, "a", item)
    check_invariants(s)
    assert gone and not s.lanes and next_deadline(s) is None and s.dropped == 1
    s2, again = cancel(s, "a", item)
    assert not again and s2 is s


def test_cancel_in_a_busy_lane_keeps_the_lane() -> None:
    s = empty(Limits(max_batch_size=1))
    s, _ = _admit(s, "a", 1)
    s, (_, item) = _admit(s, "a", 2, rank=None)
    s, _ = take(s, 0.0)
    s, gone = cancel(s, "a", item)
    check_invariants(s)
    assert gone and s.lanes["a"].calls == 1 and s.queued == 0


def test_cancel_after_take_is_false() -> None:
    s, (_, item) = _admit(empty(Limits()), "a", 1)
    s, _ = take(s, 0.0)
    s2, gone = cancel(s, "a", item)
    assert not gone and s2 is s


def test_cancel_ranked_and_unknown() -> None:
    s = empty(Limits(max_batch_delay=1.0))
    s, (_, i1) = _admit(s, "a", 1, rank=2)
    s, (_, i2) = _admit(s, "a", 2, rank=1)
    s, gone = cancel(s, "a", i1)
    check_invariants(s)
    assert gone and [it.entry for it in s.lanes["a"].items()] == [2]
    assert cancel(s, "a", i1) == (s, False)
    assert cancel(s, "zz", i2) == (s, False)


def test_many_cancels_compact_the_lane() -> None:
    s = empty(Limits(max_batch_delay=1.0, max_batch_size=1000))
    items = []
    for i in range(200):
        s, (_, it) = _admit(s, "a", i)
        items.append(it)
    for it in items[:150]:
        s, gone = cancel(s, "a", it)
        assert gone
    check_invariants(s)
    lane = s.lanes["a"]
    assert len(lane.fifo) * persistent.CHUNK + len(lane.tail) - lane.head < 100 and lane.count == 50


# ---- drain and next_deadline ------------------------------------------------------------------


def test_drain_returns_every_waiting_input_and_keeps_busy_lanes() -> None:
    s = claim(empty(Limits(max_batch_size=1)), "d")  # a direct call in flight
    s, _ = _admit(s, "a", 1)
    s, _ = take(s, 0.0)
    s, _ = _admit(s, "a", 2)
    s, _ = _admit(s, "b", 3)
    s, drained = drain(s)
    check_invariants(s)
    assert sorted(it.entry for it in drained) == [2, 3]
    assert s.closed and s.queued == 0 and set(s.lanes) == {"a", "d"} and s.busy == 2
    s = release(s, "a", 0.0)
    s = release(s, "d", 0.0)
    assert not s.lanes
    s, again = drain(s)
    assert again == [] and s.drained == 2


def test_next_deadline_skips_lanes_that_moved_on() -> None:
    s = empty(Limits(max_batch_size=2, max_batch_delay=1.0))
    s, _ = _admit(s, "a", 1, now=0.0)
    s, _ = _admit(s, "b", 2, now=0.5)
    s, _ = _admit(s, "a", 3, now=0.6)  # a is full: ready, its entry in `waiting` is dead
    check_invariants(s)
    assert next_deadline(s) == 1.5


def test_waiting_heap_under_random_deadlines() -> None:
    rng = random.Random(7)
    s = empty(Limits(max_batch_delay=1.0, max_batch_size=1000))
    for i in range(300):
        s, _ = _admit(s, i, i, now=rng.random() * 10)
    check_invariants(s)
    order = []
    for now in [x / 4 for x in range(48)]:
        while True:
            s, batch = take(s, now)
            if batch is None:
                break
            order.append(batch.items[0].submitted + 1.0)
            s = release(s, batch.key, now)
        check_invariants(s)
    assert order == sorted(order) and len(order) == 300 and not s.lanes
    assert len(s.waiting) == s.waiting_size == 0  # nothing kept of what left


def test_ready_queue_keeps_only_what_is_queued() -> None:
    s = empty(Limits())
    for i in range(500):
        s, _ = _admit(s, i, i)
    for _ in range(450):
        s, batch = take(s, 0.0)
        assert batch is not None
        s = release(s, batch.key, 0.0)
    check_invariants(s)
    assert len(s.ready) == 50 and s.ready_head == 450


# ---- persistence and the invariant checker --------------------------------------------------


def test_old_states_are_never_modified() -> None:
    s0 = empty(Limits(max_batch_size=2, max_batch_delay=1.0))
    s1, _ = _admit(s0, "a", 1)
    snapshot = (dict(s1.lanes), s1.waiting_keys(), s1.ready_keys(), s1.queued)
    s2, _ = _admit(s1, "a", 2)
    s3, _ = take(s2, 0.0)
    drain(s3)
    assert (dict(s1.lanes), s1.waiting_keys(), s1.ready_keys(), s1.queued) == snapshot
    assert not s0.lanes and s0.queued == 0
    check_invariants(s1)
    check_invariants(s2)


def test_records_are_frozen() -> None:
    s, (_, item) = _admit(empty(Limits()), "a", 1)
    with pytest.raises(AttributeError):
        s.queued = 5
    with pytest.raises(AttributeError):
        s.lanes["a"].count = 5
    with pytest.raises(AttributeError):
        item.weight = 3.0
    with pytest.raises(AttributeError):
        del s.queued


def test_a_draft_copies_every_field_and_check_invariants_catches_an_escaped_draft() -> None:
    s, _ = _admit(empty(Limits()), "a", 1)
    draft, lane = core._draft(s), core._lane_draft(s.lanes["a"])
    assert draft == s and lane == s.lanes["a"]  # equality compares every slot
    kinds: tuple[type, type] = (type(draft), type(lane))
    assert kinds == (core._LanesDraft, core._LaneDraft)
    draft.lanes = s.lanes.set("a", lane)
    with pytest.raises(AssertionError, match="draft of the room"):
        check_invariants(draft)
    draft.__class__ = core.Lanes
    with pytest.raises(AssertionError, match="draft of its lane"):
        check_invariants(draft)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"queued": 5}, "queued"),
        ({"busy": 1}, "busy"),
        ({"weight": 9.0}, "weight"),
        ({"closed": True}, "closed room"),
        ({"n_ready": 0}, "n_ready"),
        ({"admitted": 7}, "conserved"),
    ],
)
def test_check_invariants_catches_broken_states(change: dict[str, Any], message: str) -> None:
    s, _ = _admit(empty(Limits()), "a", 1)
    with pytest.raises(AssertionError, match=message):
        check_invariants(core._evolve(s, change))


def test_check_invariants_catches_empty_idle_lane_and_busy_queued_lane() -> None:
    s, _ = _admit(empty(Limits()), "a", 1)
    lane = s.lanes["a"]
    empty_lane = core._evolve(
        lane, {"count": 0, "fifo": persistent.EMPTY_VECTOR, "tail": (), "weight": 0.0}
    )
    broken = core._evolve(s, {"lanes": s.lanes.set("a", empty_lane), "queued": 0})
    with pytest.raises(AssertionError):
        check_invariants(broken)
    busy = core._evolve(lane, {"calls": 1})
    with pytest.raises(AssertionError, match="busy lane is queued"):
        check_invariants(core._evolve(s, {"lanes": s.lanes.set("a", busy), "busy": 1}))


def test_limits_are_checked() -> None:
    with pytest.raises(AssertionError):
        Limits(max_batch_size=0)
    with pytest.raises(AssertionError, match="per-key"):
        Limits(direct_calls=True, one_in_flight=False)
    assert Limits().max_batch_weight == math.inf


def test_a_lane_that_never_empties_does_not_keep_what_was_taken() -> None:
    """A plain room under steady load: its lane is never empty, yet memory stays bounded."""
    state = core.empty(Limits(max_batch_size=10, one_in_flight=False))
    for i in range(5):
        state, _, _ = core.admit(state, None, ("first", i), now=0.0)
    for round_ in range(2_000):
        for i in range(10):
            state, _, _ = core.admit(state, None, (round_, i), now=0.0)
        state, batch = core.take(state, 0.0)
        assert batch is not None and len(batch.items) == 10
        state = core.release(state, None, 0.0)
    lane = state.lanes[None]
    assert lane.count == 5
    assert len(lane.fifo) <= 4
    core.check_invariants(state)


def test_chunked_fifo_keeps_order_across_chunks_with_cancels() -> None:
    state = core.empty(Limits(max_batch_size=1000, max_batch_delay=1.0))
    items = []
    for i in range(200):
        state, _, item = core.admit(state, "k", i, now=0.0)
        assert item is not None
        items.append(item)
    for item in items[::3]:
        state, dropped = core.cancel(state, "k", item)
        assert dropped
    core.check_invariants(state)
    state, batch = core.take(state, 5.0)
    assert batch is not None
    assert [it.entry for it in batch.items] == [i for i in range(200) if i % 3]


def test_the_plain_rooms_one_lane_map_is_persistent_and_behaves_like_the_per_key_map() -> None:
    import immutables

    empty_map: persistent.OneLane[Any, str] = persistent.OneLane()
    one = empty_map.set(None, "lane")
    other = one.set(None, "lane 2")
    assert (len(empty_map), len(one), one[None], other[None]) == (0, 1, "lane", "lane 2")
    assert one.get(None) == "lane" and empty_map.get(None) is None and None in one
    per_key = immutables.Map({None: "lane"})
    assert dict(one.items()) == dict(per_key.items()) and one == {None: "lane"}
    assert len(one.delete(None)) == 0 and len(one) == 1  # the old version is untouched
    mutation = one.mutate()
    del mutation[None]
    assert len(mutation.finish()) == 0 and len(one) == 1
    with pytest.raises(KeyError):
        empty_map.delete(None)
    with pytest.raises(AssertionError, match="single lane"):
        one.set("another key", "lane")
    plain = empty(Limits(one_in_flight=False))
    assert isinstance(plain.lanes, persistent.OneLane)
    assert not isinstance(empty(Limits()).lanes, persistent.OneLane)


# ---- the room's admission transaction ------------------------------------------------------------


@pytest.mark.parametrize("delay", [0.0, 1.0])
@pytest.mark.parametrize("one_in_flight", [True, False])
def test_an_admission_rings_exactly_when_the_doorbell_rule_says(
    delay: float, one_in_flight: bool
) -> None:
    """`Room.admit`'s transaction function specializes the doorbell rule for an admission (which
    never changes `busy`); it must agree with `rings` on every admission of a random run."""
    rng = random.Random(f"{delay}-{one_in_flight}")
    limits = Limits(
        max_batch_size=3,
        max_batch_delay=delay,
        max_in_flight=2,
        one_in_flight=one_in_flight,
        direct_calls=one_in_flight and delay == 0.0,
    )
    state = core.empty(limits)
    keys = ["a", "b", "c", "d"] if one_in_flight else [None]
    in_flight: list[Any] = []
    now, rang = 0.0, 0
    for step in range(2000):
        now += rng.choice([0.0, 0.3, 1.5])
        move = rng.random()
        if move < 0.4:
            key = rng.choice(keys)
            new, got, ring = _room._admit(state, (key, step, 1.0, None, now))
            assert type(new) is Lanes
            if got is Admission.CLAIMED:
                in_flight.append(key)
            expected = type(got) is core.Item and _room.rings(state, new)
            assert ring == expected, (step, got, state, new)
            rang += ring
            state = new
        elif move < 0.7:
            state, batch = core.take(state, now)
            if batch is not None:
                in_flight.append(batch.key)
        elif in_flight:
            key = in_flight.pop(rng.randrange(len(in_flight)))
            state = core.release(state, key, now)
        core.check_invariants(state)
    assert rang > 10  # the run did ring, on ready lanes and on new deadlines
