"""The SIGKILL test on SQLite (ADR 0055): a child process runs hundreds of flows and is
killed at random moments, several times; the oracle (tests/flow/_sigkill.py) must hold, and it
must catch a planted bug that re-runs a recorded step. Some of the flows are parents that spawn
children (tests/flow/_sigkill_family.py, ADR 0162): the oracle's family half (each child started
once, its steps recorded once, each parent resumed once after its last child ended, the
completed children of a failed parent compensated once each) is shown on planted inputs too.
Beside them run flows of a plan with limits (tests/flow/_sigkill_limited.py, ADR 0171): the
oracle's limits half (each admitted once and ended, the limits never exceeded by their
histories' times, the counters back to 0) is shown on planted inputs too."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest

from ferry import flow

from . import _sigkill_limited as lim
from ._sigkill import (
    Observed,
    Spec,
    audit,
    limited_specs,
    read_limited,
    read_outcome,
    run_with_kills,
    scenario,
    summary,
)
from ._sigkill_family import FAMILIES


def check(tmp_path: Path, *, flows: int, kills: int, seed: int) -> None:
    run = run_with_kills(tmp_path, flows=flows, kills=kills, seed=seed)
    outcome = read_outcome(tmp_path, scenario(flows, seed))
    print(summary(run, outcome))
    assert audit(scenario(flows, seed), outcome, run.hits) == []
    # A fast machine may finish the scenario before the last kills (the wakes and timeouts are
    # at fixed wall-clock times); several kills must have landed all the same.
    assert run.kills >= min(kills, 3), f"only {run.kills} kills: make the scenario longer"
    # The test exercised what it is for: kills caught work in flight (the bodies held for the
    # first and last kills at least), and some of it ran again.
    assert run.held and all(run.hits[key] > 0 for key in run.held), (run.held, run.hits)
    assert sum(n - 1 for n in outcome.runs.values() if n > 1) > 0
    assert sum(r["recovered"] for r in run.reports) > 0
    assert any(key.count("/") > 2 for key in run.hits), "no kill caught a child in flight"
    # The limited flows (tests/flow/_sigkill_limited.py, ADR 0171): every one ended, admitted
    # once; the limits held at every write; no slot leaked; and the concurrency limit was
    # reached (the queue was deep enough to bind it).
    queued = limited_specs(flows, seed)
    states, history, order, left = read_limited(tmp_path, queued)
    assert lim.audit_limited(queued, states, history, run.epoch, order) + left == []
    assert lim.max_active(order) == lim.CONCURRENCY


def test_flows_survive_sigkills(tmp_path: Path) -> None:
    check(tmp_path, flows=400, kills=5, seed=1)


@pytest.mark.long
@pytest.mark.parametrize("seed", [2, 3])
def test_flows_survive_many_sigkills(tmp_path: Path, seed: int) -> None:
    check(tmp_path, flows=1500, kills=10, seed=seed)


def test_the_oracle_catches_an_engine_that_replays_a_recorded_step(tmp_path: Path) -> None:
    """Planted: on a re-run, the step body also runs the previous step again, as an engine that
    resumes by replaying would (the side table sees it; the history does not)."""
    flows, seed = 200, 5
    run = run_with_kills(tmp_path, flows=flows, kills=2, seed=seed, plant="replay")
    problems = audit(scenario(flows, seed), read_outcome(tmp_path, scenario(flows, seed)), run.hits)
    assert problems
    assert all("kills caught it in flight" in p for p in problems), problems


# ------------------------------------------------------------------ the oracle on planted inputs

SPECS = scenario(40, seed=96)
PARENTS = [s for s in SPECS if s.kids]
PLAIN = [s for s in SPECS if not s.kids]
assert {s.scenario for s in PARENTS} == set(FAMILIES), "a seed with every kind of parent"


def _event(kind: str, step: str | None = None, outcome: str | None = None) -> flow.Event:
    detail = None if outcome is None else {"outcome": outcome}
    return flow.Event(revision=0, at=0.0, kind=kind, step=step, attempt=1, detail=detail)


class _Calls:
    """A made-up side table: each call one row id, in the order they are made."""

    def __init__(self) -> None:
        self.order: dict[str, list[int]] = {}

    def __call__(self, key: str) -> None:
        self.order.setdefault(key, []).append(sum(map(len, self.order.values())) + 1)


def _family(spec: Spec, calls: _Calls, history: dict[str, list[flow.Event]]) -> None:
    """A clean run of a parent and its children: children one after the other, each once, the
    completed ones undone newest first if the parent fails."""
    fid, kind, bad = spec.flow_id, spec.scenario, spec.data["bad"]
    events = [_event("started"), _event("step", "prepare", "continue")]
    calls(f"{fid}/0/prepare")
    events += [_event("step", "fan", "spawn"), _event("children_ended", "fan")]
    completed = []
    for i, k in enumerate(spec.kids):
        if k.expected is None:
            continue
        kid = [_event("started"), _event("step", "pick", "continue")]
        calls(f"{k.flow_id}/0/pick")
        if i == bad:
            kid += [_event("step", "pack", "fail"), _event("compensated", "pick")]
            calls(f"{k.flow_id}/0-compensate/pick")
        else:
            kid += [_event("step", "pack", "continue"), _event("completed")]
            calls(f"{k.flow_id}/1/pack")
            completed.append(k.flow_id)
        history[k.flow_id] = kid
    if kind in ("fanout", "carryon", "rejected"):
        events.append(_event("step", "collect", "fail" if kind == "rejected" else "continue"))
        calls(f"{fid}/2/collect")
    if spec.expected is flow.State.FAILED:
        for child in reversed(completed):
            history[child] += [_event("undone_by_parent"), _event("compensated", "pick")]
            calls(f"{child}/0-compensate/pick")
        events.append(_event("compensated", "prepare"))
        calls(f"{fid}/0-compensate/prepare")
    history[fid] = events


def clean_outcome() -> tuple[Observed, Counter[str]]:
    """A made-up outcome that satisfies the oracle: each flow ran each of its steps once."""
    states: dict[str, flow.State | None] = {}
    history: dict[str, list[flow.Event]] = {}
    calls = _Calls()
    for spec in SPECS:
        states[spec.flow_id] = spec.expected
        states.update({k.flow_id: k.expected for k in spec.kids})
        if spec.kids:
            _family(spec, calls, history)
            continue
        events = []
        for i, step in enumerate(("reserve", "charge")):
            events.append(_event("step", step, "continue"))
            calls(f"{spec.flow_id}/{i}/{step}")
        history[spec.flow_id] = events
    runs = Counter({key: len(ids) for key, ids in calls.order.items()})
    return Observed(states, history, runs, calls.order), Counter()


def test_the_oracle_passes_a_clean_outcome() -> None:
    outcome, hits = clean_outcome()
    assert audit(SPECS, outcome, hits) == []


def test_the_oracle_catches_a_flow_that_did_not_end() -> None:
    outcome, hits = clean_outcome()
    fid = PLAIN[3].flow_id
    states = dict(outcome.states, **{fid: flow.State.PARKED})
    (problem,) = audit(SPECS, Observed(states, outcome.history, outcome.runs), hits)
    assert problem.startswith(f"{fid} ") and "not COMPLETED or FAILED" in problem


def test_the_oracle_catches_a_flow_that_ended_wrong() -> None:
    outcome, hits = clean_outcome()
    spec = PLAIN[4]
    other = flow.State.FAILED if spec.expected is flow.State.COMPLETED else flow.State.COMPLETED
    states = dict(outcome.states, **{spec.flow_id: other})
    (problem,) = audit(SPECS, Observed(states, outcome.history, outcome.runs), hits)
    assert "expected" in problem


def test_the_oracle_catches_an_outcome_recorded_twice() -> None:
    outcome, hits = clean_outcome()
    fid = PLAIN[0].flow_id
    events = list(outcome.history[fid])
    history = dict(outcome.history, **{fid: [*events, events[1]]})
    (problem,) = audit(SPECS, Observed(outcome.states, history, outcome.runs), hits)
    assert problem == f"{fid}: the step outcome of 'charge' is recorded 2 times"


def test_the_oracle_catches_a_step_that_ran_once_too_often() -> None:
    outcome, hits = clean_outcome()
    key = f"{PLAIN[1].flow_id}/0/reserve"
    runs = outcome.runs + Counter({key: 1})
    bad = Observed(outcome.states, outcome.history, runs, outcome.order)
    (problem,) = audit(SPECS, bad, hits)
    assert problem == f"{key} ran 2 times, but only 0 kills caught it in flight"
    assert audit(SPECS, bad, Counter({key: 1})) == []  # a kill that caught it allows one more


def test_the_oracle_catches_a_step_recorded_but_never_run() -> None:
    outcome, hits = clean_outcome()
    key = f"{PLAIN[2].flow_id}/1/charge"
    runs = Counter({k: n for k, n in outcome.runs.items() if k != key})
    (problem,) = audit(SPECS, Observed(outcome.states, outcome.history, runs, outcome.order), hits)
    assert problem == f"{key} is recorded as done but never ran"


# ----------------------------------------------- the family oracle on planted inputs (issue 28)


def _planted(fid: str, **changes: Any) -> list[str]:
    outcome, hits = clean_outcome()
    return audit(SPECS, attrs.evolve(outcome, **changes), hits)


def test_the_oracle_catches_a_child_started_twice() -> None:
    outcome, _ = clean_outcome()
    child = next(k.flow_id for s in PARENTS for k in s.kids if k.expected is not None)
    twice = [outcome.history[child][0], *outcome.history[child]]
    problems = _planted(child, history={**outcome.history, child: twice})
    assert problems == [f"{child}: started 2 times, not once"]
    # ... or its first step's call made twice, with no kill to explain it
    key = f"{child}/0/pick"
    problems = _planted(child, runs=outcome.runs + Counter({key: 1}))
    assert problems == [f"{key} ran 2 times, but only 0 kills caught it in flight"]


def test_the_oracle_catches_a_kept_child_started_after_its_brother_failed() -> None:
    outcome, _ = clean_outcome()
    kept = next(k.flow_id for s in PARENTS for k in s.kids if k.expected is None)
    states = {**outcome.states, kept: flow.State.FAILED}
    history = {**outcome.history, kept: [_event("started"), _event("failed")]}
    (problem,) = _planted(kept, states=states, history=history)
    assert problem.startswith(f"{kept}: a kept child started")


def test_the_oracle_catches_a_parent_resumed_twice_or_before_its_last_child_ended() -> None:
    outcome, _ = clean_outcome()
    spec = next(s for s in SPECS if s.scenario in ("fanout", "carryon", "rejected"))
    fid, events = spec.flow_id, outcome.history[spec.flow_id]
    twice = [*events[:4], events[3], *events[4:]]
    (problem,) = _planted(fid, history={**outcome.history, fid: twice})
    assert problem == f"{fid} ({spec.scenario}): its spawn ended 2 times, not once"
    early = dict(outcome.order)
    early[f"{fid}/2/collect"] = [0]  # before any child's call
    (problem,) = _planted(fid, order=early)
    assert problem == f"{fid} ({spec.scenario}): collect ran before its last child ended"


def test_the_oracle_catches_a_completed_child_not_undone_or_undone_twice() -> None:
    outcome, _ = clean_outcome()
    spec = next(s for s in PARENTS if s.scenario == "stopwide")
    child = next(k.flow_id for i, k in enumerate(spec.kids) if i != spec.data["bad"])
    events = outcome.history[child]
    kept = [e for e in events if e.kind != "undone_by_parent"]
    (problem,) = _planted(child, history={**outcome.history, child: kept})
    assert problem == f"{child}: undone by its parent 0 times, expected 1"
    undo = next(e for e in events if e.kind == "undone_by_parent")
    problems = _planted(child, history={**outcome.history, child: [*events, undo]})
    assert f"{child}: compensated for its parent 2 times" in problems


def test_the_oracle_catches_children_undone_oldest_first() -> None:
    outcome, _ = clean_outcome()
    spec = next(s for s in PARENTS if s.scenario == "stop" and s.data["bad"] >= 2)
    a, b = (f"{k.flow_id}/0-compensate/pick" for k in spec.kids[:2])
    order = {**outcome.order, a: outcome.order[b], b: outcome.order[a]}
    (problem,) = _planted(spec.flow_id, order=order)
    assert problem.startswith(f"{spec.flow_id}: children undone in the order")


# ------------------------------------------------------ the limits half on planted inputs

LIMITED = [lim.Limited(f"q{i}", {"customer": f"c{i}"}, 0, None) for i in range(lim.CONCURRENCY + 1)]
DONE = {s.flow_id: flow.State.COMPLETED for s in LIMITED}


def _admitted(at: float) -> list[flow.Event]:
    return [flow.Event(revision=1, at=at, kind="admitted", step=None, attempt=None, detail=None)]


ONCE = {s.flow_id: _admitted(1.0) for s in LIMITED}


def _order(text: str) -> list[tuple[str, str]]:
    """``"+q0 +q1 -q0"``: q0 admitted, q1 admitted, q0 ended."""
    return [(w[1:], "admitted" if w[0] == "+" else "ended") for w in text.split()]


def test_the_limits_half_passes_flows_that_kept_to_the_limits() -> None:
    order = _order("+q0 +q1 +q2 -q0 +q3 -q1 -q2 -q3")
    assert lim.audit_limited(LIMITED, DONE, ONCE, 0.0, order) == []
    assert lim.max_active(order) == lim.CONCURRENCY


def test_the_limits_half_catches_a_limit_exceeded_a_slot_doubled_and_an_early_start() -> None:
    order = _order("+q0 +q1 +q2 +q3 -q0 -q1 -q2 -q3")
    (problem,) = lim.audit_limited(LIMITED, DONE, ONCE, 0.0, order)
    assert problem == "4 limited flows were active at write 3 (q3 admitted)"
    same = [lim.Limited(f"k{i}", {"customer": "c0"}, 0, None) for i in range(2)]
    done = {"k0": flow.State.COMPLETED, "k1": flow.State.COMPLETED}
    once = {"k0": _admitted(1.0), "k1": _admitted(1.0)}
    (problem,) = lim.audit_limited(same, done, once, 0.0, _order("+k0 +k1 -k0 -k1"))
    assert problem == "2 flows of customer 'c0' were active at write 1 (k1 admitted; per_key 1)"
    twice = {**ONCE, "q0": _admitted(1.0) + _admitted(1.5)}
    (problem,) = lim.audit_limited(LIMITED, DONE, twice, 0.0, [])
    assert problem == "q0 (limited) was admitted 2 times, not once"
    late = [lim.Limited("q0", {"customer": "c0"}, 0, 5.0)]
    (problem,) = lim.audit_limited(late, DONE, {"q0": _admitted(104.0)}, 100.0, [])
    assert problem == "q0 was admitted 1.000 s early"
    ended, never = lim.audit_limited(late, {"q0": flow.State.RUNNING}, {}, 100.0, [])
    assert ended.startswith("q0 (limited) ended State.RUNNING")
    assert never == "q0 (limited) was admitted 0 times, not once"


def test_the_oracle_catches_a_stream_value_twice_or_a_gap() -> None:
    outcome, hits = clean_outcome()
    fid = PLAIN[0].flow_id
    keys = [f"{fid}/0/reserve", f"{fid}/1/charge"]
    for stream, said in [
        (list(enumerate(keys, 1)), None),
        ([(1, keys[0]), (2, keys[0]), (3, keys[1])], "its recorded calls are"),
        ([(1, keys[0]), (3, keys[1])], "offsets are not 1, 2, 3"),
    ]:
        bad = attrs.evolve(outcome, streams={fid: stream})
        problems = audit(SPECS, bad, hits)
        if said is None:
            assert problems == []
        else:
            (problem,) = problems
            assert problem.startswith(f"{fid}: its stream") and said in problem
