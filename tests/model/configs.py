"""The bounds the model check explores by default, and larger ones for `-m slow`."""

from __future__ import annotations

from ferry._lanes import Limits
from tests.model.checker import Config
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
