"""The bounds the model check explores by default (in `make test`), and larger ones for `-m long`
(minutes in all: left out of `make test`, run them before changing a machine or the shell)."""

from __future__ import annotations

import attrs

from ferry._lanes import Limits
from tests.model.checker import Config
from tests.model.flow import FlowConfig, StepSpec
from tests.model.shell import ShellConfig

DEFAULT = [
    Config(
        "per-key, delay 0, direct calls, batches split by size",
        Limits(max_batch_size=2, direct_calls=True),
        keys=("a", "b", "a", "a"),
    ),
    Config(
        "per-key, delay 0, no direct calls, split by weight, failures",
        Limits(max_batch_size=3, max_batch_weight=2.0),
        weights=(1.0, 2.0, 1.0),
        keys=("a", "a", "b"),
        failures=True,
    ),
    Config(
        "per-key, delay 1, batches split by size",
        Limits(max_batch_size=2, max_batch_delay=1.0),
        keys=("a", "b", "a", "a"),
    ),
    Config(
        "per-key, delay 1, ranked, room of 2",
        Limits(max_batch_size=2, max_batch_delay=1.0, max_queueing=2),
        keys=("a", "a", "a"),
        ranks=(2, 1, 1),
    ),
    Config(
        "plain, delay 0, split by size",
        Limits(max_batch_size=2, one_in_flight=False),
        keys=("room", "room", "room"),
    ),
    Config(
        "per-key, delay 0, direct calls, at most 2 calls in flight",
        Limits(max_batch_size=2, direct_calls=True, max_in_flight=2),
        keys=("a", "b", "c", "a"),
    ),
    Config(
        "per-key, delay 1, at most 1 call in flight for 2 workers",
        Limits(max_batch_size=2, max_batch_delay=1.0, max_in_flight=1),
        keys=("a", "b", "a"),
    ),
    Config(
        "plain, delay 1, split by size",
        Limits(max_batch_size=2, max_batch_delay=1.0, one_in_flight=False),
        keys=("room", "room", "room"),
    ),
]

SLOW = [
    Config(
        "per-key, delay 0, direct calls, 3 keys, 4 inputs",
        Limits(max_batch_size=2, direct_calls=True),
        keys=("a", "b", "a", "c"),
    ),
    Config(
        "per-key, delay 1, 4 inputs, split by size and weight",
        Limits(max_batch_size=2, max_batch_weight=2.5, max_batch_delay=1.0),
        keys=("a", "b", "a", "a"),
        weights=(1.0, 1.0, 2.0, 0.5),
    ),
]

# The shell's protocol (tests/model/shell.py): fewer inputs, since each worker also sleeps, wakes
# and is cancelled, and every caller may abort at any step.
SHELL_DEFAULT = [
    ShellConfig(
        "shell: per-key, delay 0, direct calls, batches split by size",
        Limits(max_batch_size=2, direct_calls=True),
        keys=("a", "b", "a", "a"),
    ),
    ShellConfig(
        "shell: per-key, delay 0, no direct calls, split by weight, failures",
        Limits(max_batch_size=3, max_batch_weight=2.0),
        keys=("a", "a", "b"),
        weights=(1.0, 2.0, 1.0),
        failures=True,
    ),
    ShellConfig(
        "shell: per-key, delay 1, batches split by size",
        Limits(max_batch_size=2, max_batch_delay=1.0),
        keys=("a", "b", "a"),
    ),
    ShellConfig(
        "shell: per-key, delay 1, ranked, room of 2",
        Limits(max_batch_size=2, max_batch_delay=1.0, max_queueing=2),
        keys=("a", "a", "a"),
        ranks=(2, 1, 1),
    ),
    ShellConfig(
        "shell: per-key, delay 0, direct calls, at most 2 calls in flight",
        Limits(max_batch_size=2, direct_calls=True, max_in_flight=2),
        keys=("a", "b", "c", "a"),
    ),
    ShellConfig(
        "shell: per-key, delay 1, at most 1 call in flight for 2 workers",
        Limits(max_batch_size=2, max_batch_delay=1.0, max_in_flight=1),
        keys=("a", "b", "a"),
    ),
    ShellConfig(
        "shell: plain, delay 1, split by size",
        Limits(max_batch_size=2, max_batch_delay=1.0, one_in_flight=False),
        keys=("room", "room", "room"),
    ),
    ShellConfig(
        "shell: per-key, delay 0, direct calls, calls hang until close",
        Limits(max_batch_size=2, direct_calls=True),
        keys=("a", "b", "a", "a"),
        hang=True,
        cancels=False,
    ),
    ShellConfig(
        "shell: per-key, delay 1, never closed, callers never give up (quiescence)",
        Limits(max_batch_size=2, max_batch_delay=1.0),
        keys=("a", "b", "a"),
        close=False,
        cancels=False,  # a caller that can always give up would hide one never answered
    ),
]

SHELL_SLOW = [
    ShellConfig(
        "shell: per-key, delay 1, 4 inputs",
        Limits(max_batch_size=2, max_batch_delay=1.0),
        keys=("a", "b", "a", "a"),
    ),
    ShellConfig(
        "shell: per-key, delay 0, direct calls, 3 workers, 3 keys",
        Limits(max_batch_size=2, direct_calls=True),
        keys=("a", "b", "c", "a"),
        workers=3,
    ),
]

# The flow (tests/model/flow.py): reserve (retried once; its compensation may raise, which blocks
# the flow until an operator resumes it), charge (parks 10 s; on timeout: compensate), ship (no
# compensation; may fail the flow). The world sends 2 wakes at any moment (or stops early),
# cancels once, resumes once; the engine may crash once anywhere.
RESERVE = StepSpec("reserve", ("continue", "raise"), ("ok", "raise"), attempts=2)
CHARGE = StepSpec("charge", ("park",), ("ok",))
SHIP = StepSpec("ship", ("continue", "fail"))
ORDER = (RESERVE, CHARGE, SHIP)

FLOW_DEFAULT = [
    FlowConfig("flow: 3 steps, park with timeout, 2 wakes, cancel, resume, 1 crash", ORDER),
    FlowConfig(
        "flow: duplicate message id, on_timeout=continue, 1 crash",
        ORDER,
        wakes=("m1", "m1"),
        on_timeout="continue",
    ),
    FlowConfig(
        "flow: a write commits and loses its answer, a compensation that raises, 1 crash",
        (
            StepSpec("reserve", ("continue",), ("ok",)),
            StepSpec("charge", ("park",), ("ok", "raise")),
            SHIP,
        ),
        ambiguous=1,
    ),
]

# An operator's way out of BLOCKED (`Engine.abandon`): the compensation of reserve raises until
# the flow blocks; the operator abandons it (or, in other branches, never does); 1 crash.
ABANDON = FlowConfig(
    "flow: a compensation that keeps raising, abandoned, 1 wake, cancel, 1 crash",
    ORDER,
    wakes=("m1",),
    resumes=0,
    abandon=True,
)

FLOW_SLOW = [
    FlowConfig(
        "flow: 3 steps, park with timeout, 2 wakes, cancel, resume, 2 crashes", ORDER, crashes=2
    ),
    FlowConfig(
        "flow: 3 steps, 2 wakes, cancel, resume, a lost answer, 1 crash", ORDER, ambiguous=1
    ),
]

# A graceful close (ADR 0064): the engine lets go of a flow whose run had not begun, so that the
# restarted engine keeps its attempt number. With `-m long`, a crash as well: both ways down.
CLOSES = FlowConfig(
    "flow: 3 steps, park with timeout, 1 wake, cancel, resume, 1 close",
    ORDER,
    wakes=("m1",),
    crashes=0,
    closes=1,
)
CLOSES_SLOW = attrs.evolve(
    CLOSES,
    name="flow: 3 steps, park with timeout, 1 wake, cancel, resume, 1 close, 1 crash",
    crashes=1,
)

# Versions fail closed: the engine may restart without the flow's plan version (and, after a
# second crash, with it again). The park is at a step without a compensation, after one with.
PLAN_MISSING = FlowConfig(
    "flow: an engine restarts without the plan version, then with it; 2 crashes",
    (StepSpec("reserve", ("continue",), ("ok",)), StepSpec("confirm", ("park",)), SHIP),
    crashes=2,
    unregistered=1,
)

# The fleet (tests/model/fleet.py): the same flow on two engines with leases. Engine 0 starts
# it; either engine may crash (and restart under its name); the engine that runs the flow may
# freeze past its lease (SIGSTOP) or fail to renew it in time; wakes, the cancel and the
# timeout reach either engine. LEAN is ORDER without the retry and the raising compensation,
# for the bounds where the leases branch most.
LEAN = (StepSpec("reserve", ("continue",), ("ok",)), CHARGE, SHIP)

FLEET_DEFAULT = [
    FlowConfig(
        "fleet: 3 steps, park with timeout, 2 wakes through either engine, 1 crash",
        LEAN,
        cancel=False,
        resumes=0,
        engines=2,
    ),
    FlowConfig(
        "fleet: 3 steps, 2 wakes, a cancel through either engine, 1 crash",
        LEAN,
        resumes=0,
        engines=2,
    ),
    FlowConfig(
        "fleet: a frozen owner, 1 wake, the timeout, 1 freeze",
        LEAN,
        wakes=("m1",),
        cancel=False,
        resumes=0,
        crashes=0,
        engines=2,
        freezes=1,
    ),
    FlowConfig(
        "fleet: renewals that fail, a takeover whose answer is lost, the timeout",
        LEAN,
        wakes=(),
        cancel=False,
        resumes=0,
        crashes=0,
        ambiguous=1,
        engines=2,
        outages=1,
    ),
]

# The fleet at its edges: owner incarnations (engine 1 is a second opening of engine 0's name)
# and versions (engine 1 lacks the flow's plan version, a rolling deploy).
FLEET_EDGES = [
    FlowConfig(
        "fleet: a second incarnation of engine 0's name, a freeze, 1 crash, the timeout",
        LEAN,
        wakes=(),
        cancel=False,
        resumes=0,
        engines=2,
        freezes=1,
        same_name=True,
    ),
    FlowConfig(
        "fleet: engine 1 lacks the version, 1 wake and a cancel through either, 1 crash",
        LEAN,
        wakes=("m1",),
        resumes=0,
        engines=2,
        versions=True,
    ),
]

# ADR 0112: the engine that runs the flow has its trio loop blocked while its lease thread runs
# on (a step's `time.sleep`, a full pipe), for longer than its lease.
FLEET_BLOCKED = FlowConfig(
    "fleet: a blocked loop whose lease thread runs on, the timeout",
    LEAN,
    wakes=(),
    cancel=False,
    resumes=0,
    crashes=0,
    engines=2,
    blocks=1,
)

FLEET_SLOW = [
    FlowConfig(
        "fleet: ORDER's retry and raising compensation, 1 wake, a cancel, 1 crash",
        ORDER,
        wakes=("m1",),
        resumes=0,
        engines=2,
    ),
    FlowConfig(
        "fleet: a frozen owner, 2 wakes, the timeout, 1 freeze",
        LEAN,
        cancel=False,
        resumes=0,
        crashes=0,
        engines=2,
        freezes=1,
    ),
    FlowConfig(
        "fleet: a crash, a freeze and renewals that fail, the timeout",
        LEAN,
        wakes=(),
        cancel=False,
        resumes=0,
        engines=2,
        freezes=1,
        outages=1,
    ),
]

# One clock for leases (ADR 0110): engine 1's host clock is ahead by more than a lease.
FLEET_CLOCK = [
    FlowConfig(
        "fleet: engine 1's clock is ahead by more than a lease, 1 crash, the timeout",
        LEAN,
        wakes=(),
        cancel=False,
        resumes=0,
        engines=2,
        skew=True,
    ),
]
