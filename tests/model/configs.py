"""The bounds the model check explores by default, and larger ones for `-m slow`."""

from __future__ import annotations

from ferry._lanes import Limits
from tests.model.checker import Config

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
