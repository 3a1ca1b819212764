"""Flow protocols with one planted bug each: the flow model check must catch every one of them."""

from __future__ import annotations

import attrs

from ferry.flow._model import _machine as fm
from ferry.flow._model._types import Outcome, State
from ferry.flow._model._values import EMPTY_MAILBOX, Flow, Mailbox, Message, Shape, Transition
from tests.model.flow import FlowProtocol


class ParkIgnoresQueue(FlowProtocol):
    """(1) A park does not look at the mailbox: a wake that came before it stays queued."""

    def step_done(
        self, flow: Flow, mailbox: Mailbox, shape: Shape, outcome: Outcome, now: float
    ) -> Transition:
        return super().step_done(flow, EMPTY_MAILBOX, shape, outcome, now)


class WriteWithoutRevisionCheck(FlowProtocol):
    """(2) The runner's UPDATE bumps the revision but does not compare it (no
    ``AND revision = ?``): a write whose answer was lost, sent again, records its step twice."""

    runner_cas = False


class CompensateOldestFirst(FlowProtocol):
    """(3) The compensation stack is used as a queue: the oldest completed step is undone first."""

    def _oldest_first(self, t: Transition, shape: Shape | None) -> Transition:
        flow = t.flow
        if flow.state is not State.COMPENSATING or shape is None:
            return t
        first = flow.stack[0]
        return attrs.evolve(t, flow=attrs.evolve(flow, step_index=first, step=shape.steps[first]))

    def step_done(
        self, flow: Flow, mailbox: Mailbox, shape: Shape, outcome: Outcome, now: float
    ) -> Transition:
        return self._oldest_first(super().step_done(flow, mailbox, shape, outcome, now), shape)

    def step_failed(self, flow: Flow, shape: Shape, error: str, now: float) -> Transition:
        return self._oldest_first(super().step_failed(flow, shape, error, now), shape)

    def timeout(
        self, flow: Flow, shape: Shape | None, now: float, expected: int | None
    ) -> Transition:
        return self._oldest_first(super().timeout(flow, shape, now, expected), shape)

    def cancel(self, flow: Flow, shape: Shape | None, now: float) -> Transition:
        return self._oldest_first(super().cancel(flow, shape, now), shape)

    def compensated(self, flow: Flow, shape: Shape, now: float) -> Transition:
        # Take the compensated step out of the stack (not the top), then go on from the bottom.
        rest = tuple(j for j in flow.stack if j != flow.step_index)
        t = super().compensated(attrs.evolve(flow, stack=(*rest, flow.step_index)), shape, now)
        return self._oldest_first(t, shape)


class TimerWithoutRevisionCheck(FlowProtocol):
    """(4) The timer fires from the row it armed and writes without comparing the revision, so
    a wake accepted since is overwritten by the timeout."""

    timer_checks_revision = False


# More planted bugs, one per remaining property, to show that each can fail.


class RetryOnceTooOften(FlowProtocol):
    """(5) A raising body is retried while ``failures <= attempts``: one run more than allowed."""

    def retries(self, flow: Flow, shape: Shape, failures: int) -> bool:
        return failures + 1 <= shape.attempts[flow.step_index]


class WriteRevisionFromCopy(FlowProtocol):
    """(6) The runner's UPDATE sets the revision from its copy, with no compare: a stale write
    takes the revision back."""

    runner_cas = False
    blind_write_bumps_stored_revision = False


class WakeForgetsSeen(FlowProtocol):
    """(7) The wake does not look up its message id: a duplicate is accepted again."""

    def wake(
        self, flow: Flow, mailbox: Mailbox, message: Message, shape: Shape | None, now: float
    ) -> Transition:
        return super().wake(flow, attrs.evolve(mailbox, seen=frozenset()), message, shape, now)


class RecoveryForgetsTimers(FlowProtocol):
    """(8) Recovery resumes running flows but arms no timer for the parked ones: a flow parked
    when the engine crashed stays parked for ever."""

    recovery_arms_timers = False


class RecoveryReusesTheAttempt(FlowProtocol):
    """(9) Recovery re-runs the step without writing `next_attempt` first: a run after a crash
    claims the attempt number of a run that may already have happened."""

    recovery_bumps_attempt = False


class RecoveryBumpsEveryAttempt(FlowProtocol):
    """(10) The old recovery rule (ADR 0024 before 0064): recovery writes attempt + 1 for every
    active flow, also one that its closing engine let go before the run began, so a step's first
    run can be attempt 2."""

    def rerun(self, flow: Flow, now: float) -> Transition:
        return self.next_attempt(flow, now)


class CloseLetsGoOfARunThatBegan(FlowProtocol):
    """(11) A closing engine also lets go of a flow whose body had run (its result not written):
    the next engine runs it again with the same attempt number."""

    close_lets_go_of_unbegun_runs_only = False


class AbandonRunsTheCompensation(FlowProtocol):
    """(12) Abandon re-drives the blocked compensation (a resume under another name): the
    compensation that can never succeed runs again, after the operator gave up on it."""

    def abandon(self, flow: Flow, shape: Shape | None, now: float) -> Transition:
        t = fm.resume(flow, EMPTY_MAILBOX, shape, now)
        if not t.done:
            return t
        events = (*t.events, attrs.evolve(t.events[0], kind="abandoned", detail={"skipped": []}))
        return attrs.evolve(t, events=events)


class AbandonSkipsTooLittle(FlowProtocol):
    """(13) Abandon ends the flow but leaves the compensation that failed out of what it says it
    skipped: an operator reading the history would believe it ran."""

    def abandon(self, flow: Flow, shape: Shape | None, now: float) -> Transition:
        t = fm.abandon(flow, shape, "abandoned", None, now)
        if not t.done:
            return t
        first = t.events[0]
        assert isinstance(first.detail, dict)
        detail = {**first.detail, "skipped": first.detail["skipped"][1:]}
        return attrs.evolve(t, events=(attrs.evolve(first, detail=detail), *t.events[1:]))
