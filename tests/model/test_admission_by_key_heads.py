"""The store's way to the next flow (the first head among the keys with room) is the rule's.

ADR 0141 finds the next flow to admit with two index probes instead of a scan: the first, in
order, of the keys' heads (each key's first due queued flow) among the keys with room under
`per_key`, once the budget has room. `_admission.first_by_heads` computes that; hypothesis checks
that it is always `admit`'s first choice, and that `admit` never takes a flow past a limit or
out of order. Fails if the heads are taken without the due time, without `per_key`, or in
another order than `admit`'s.
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from ferry.flow._model import _admission as adm
from ferry.flow._model._admission import Usage, Waiting
from ferry.flow._model._limits import Limits, Rate

KEYS = ("a", "b")
BEFORE = Limits(concurrency=1)
#: Key a's first flow in order is not due yet: its head is the second.
LATER_FIRST = [
    Waiting("x", 0, "a", 0, 0, 20.0),
    Waiting("y", 1, "a", 0, 1),
    Waiting("z", 2, "b", 0, 2),
]
#: Within key a, the fair turn decides before first come first served.
TURN_FIRST = [Waiting("x", 0, "a", 0, 2), Waiting("y", 1, "a", 0, 1), Waiting("z", 2, "b", 0, 2)]


def _key(data: object) -> str:
    return "a"


@st.composite
def cases(draw: st.DrawFn) -> tuple[Limits, Usage, list[Waiting], float]:
    concurrency = draw(st.none() | st.integers(1, 4))
    per_key = draw(st.none() | st.integers(1, 2))
    rate = draw(st.none() | st.builds(Rate, st.integers(1, 3), st.sampled_from([1.0, 5.0])))
    if concurrency is None and per_key is None and rate is None:
        concurrency = 2
    limits = Limits(concurrency=concurrency, key=_key, per_key=per_key, rate=rate)
    now = 10.0
    active = {k: draw(st.integers(0, 1)) for k in KEYS}
    keys = tuple(sorted((k, n) for k, n in active.items() if n))
    window = tuple(sorted(draw(st.lists(st.sampled_from([6.0, 8.0, 9.5, 10.0]), max_size=3))))
    usage = Usage(active=sum(active.values()), keys=keys, window=window)
    n = draw(st.integers(0, 8))
    queue = [
        Waiting(
            f"f{i}",
            i,
            draw(st.sampled_from(KEYS)),
            draw(st.integers(-1, 0)),
            draw(st.integers(0, 3)),
            draw(st.sampled_from([None, 5.0, 20.0])),
        )
        for i in range(n)
    ]
    return limits, usage, draw(st.permutations(queue)), now


@settings(max_examples=300)
@given(cases())
@example((BEFORE, adm.EMPTY, LATER_FIRST, 10.0))
@example((BEFORE, adm.EMPTY, TURN_FIRST, 10.0))
def test_the_first_head_among_keys_with_room_is_the_rules_first(
    case: tuple[Limits, Usage, list[Waiting], float],
) -> None:
    limits, usage, queue, now = case
    taken, _ = adm.admit(limits, usage, queue, now)
    assert adm.first_by_heads(limits, usage, queue, now) == (taken[0] if taken else None)


@settings(max_examples=300)
@given(cases())
def test_admit_takes_in_order_and_never_past_a_limit(
    case: tuple[Limits, Usage, list[Waiting], float],
) -> None:
    limits, usage, queue, now = case
    taken, after = adm.admit(limits, usage, queue, now)
    before = adm.prune(limits, usage, now)
    assert after.active == before.active + len(taken)
    if limits.concurrency is not None and taken:
        assert after.active <= max(limits.concurrency, before.active)
    for key, n in after.keys:
        if limits.per_key is not None:
            assert n <= max(limits.per_key, before.of(key))
    if limits.rate is not None:
        assert len(after.window) <= max(limits.rate.count, len(before.window))
    for w in taken:
        assert w.not_before is None or w.not_before <= now
    # Each flow taken was the first with room when it was taken: so, within a key, in order.
    for key in KEYS:
        mine = [adm.order(w) for w in taken if w.key == key]
        assert mine == sorted(mine)
    # What is left may not go now.
    left = [w for w in queue if w not in taken]
    assert all(adm.waits_for(limits, after, w, now) is not None for w in left)
