"""The SIGKILL test on SQLite (ADR 0055): a child process runs hundreds of flows and is
killed at random moments, several times; the oracle (tests/flow/_sigkill.py) must hold, and it
must catch a planted bug that re-runs a recorded step."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from ferry import flow

from ._sigkill import Observed, audit, read_outcome, run_with_kills, scenario, summary


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

SPECS = scenario(40, seed=9)


def clean_outcome() -> tuple[Observed, Counter[str]]:
    """A made-up outcome that satisfies the oracle: each flow ran each of its steps once."""
    states: dict[str, flow.State | None] = {}
    history: dict[str, list[flow.Event]] = {}
    runs: Counter[str] = Counter()
    for spec in SPECS:
        states[spec.flow_id] = spec.expected
        events = []
        for i, step in enumerate(("reserve", "charge")):
            events.append(
                flow.Event(
                    revision=i + 2,
                    at=0.0,
                    kind="step",
                    step=step,
                    attempt=1,
                    detail={"outcome": "continue"},
                )
            )
            runs[f"{spec.flow_id}/{i}/{step}"] += 1
        history[spec.flow_id] = events
    return Observed(states, history, runs), Counter()


def test_the_oracle_passes_a_clean_outcome() -> None:
    outcome, hits = clean_outcome()
    assert audit(SPECS, outcome, hits) == []


def test_the_oracle_catches_a_flow_that_did_not_end() -> None:
    outcome, hits = clean_outcome()
    fid = SPECS[3].flow_id
    states = dict(outcome.states, **{fid: flow.State.PARKED})
    (problem,) = audit(SPECS, Observed(states, outcome.history, outcome.runs), hits)
    assert problem.startswith(f"{fid} ") and "not COMPLETED or FAILED" in problem


def test_the_oracle_catches_a_flow_that_ended_wrong() -> None:
    outcome, hits = clean_outcome()
    spec = SPECS[4]
    other = flow.State.FAILED if spec.expected is flow.State.COMPLETED else flow.State.COMPLETED
    states = dict(outcome.states, **{spec.flow_id: other})
    (problem,) = audit(SPECS, Observed(states, outcome.history, outcome.runs), hits)
    assert "expected" in problem


def test_the_oracle_catches_an_outcome_recorded_twice() -> None:
    outcome, hits = clean_outcome()
    fid = SPECS[0].flow_id
    events = list(outcome.history[fid])
    history = dict(outcome.history, **{fid: [*events, events[1]]})
    (problem,) = audit(SPECS, Observed(outcome.states, history, outcome.runs), hits)
    assert problem == f"{fid}: the step outcome of 'charge' is recorded 2 times"


def test_the_oracle_catches_a_step_that_ran_once_too_often() -> None:
    outcome, hits = clean_outcome()
    key = f"{SPECS[1].flow_id}/0/reserve"
    runs = outcome.runs + Counter({key: 1})
    bad = Observed(outcome.states, outcome.history, runs)
    (problem,) = audit(SPECS, bad, hits)
    assert problem == f"{key} ran 2 times, but only 0 kills caught it in flight"
    assert audit(SPECS, bad, Counter({key: 1})) == []  # a kill that caught it allows one more


def test_the_oracle_catches_a_step_recorded_but_never_run() -> None:
    outcome, hits = clean_outcome()
    key = f"{SPECS[2].flow_id}/1/charge"
    runs = Counter({k: n for k, n in outcome.runs.items() if k != key})
    (problem,) = audit(SPECS, Observed(outcome.states, outcome.history, runs), hits)
    assert problem == f"{key} is recorded as done but never ran"
