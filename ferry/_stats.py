"""`FerryStatistics`: one frozen snapshot of a ferry, read with a single TVar peek (SPEC 2.9)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import final

import attrs


@final
@attrs.frozen(kw_only=True)
class FerryStatistics:
    """What a ferry holds now, and what it has done since it opened.

    Gauges (now): `queued` inputs waiting and their `queued_weight`; `busy` calls in flight
    (batched or direct); `lanes` keys with inputs waiting or a call in flight; `ready` lanes in line
    to be taken; `waiting` lanes holding a partial batch until their deadline.

    Counters (since open): `submitted` calls that reached admission, of which `admitted` entered the
    waiting room, `rejected` found it full and `direct_calls` were sent at once by their caller;
    `batches` sent by workers carrying `inputs_sent` inputs, `failed_batches` calls that raised
    (batched or direct), `dropped` inputs whose callers were cancelled while they waited, and
    `batch_sizes`, a histogram: batch size -> number of batches of that size.

    Fields that do not apply to a ferry are zero (the plain ferry has no lanes, no direct calls
    and no weights).
    """

    queued: int
    queued_weight: float
    busy: int
    lanes: int
    ready: int
    waiting: int
    submitted: int
    admitted: int
    rejected: int
    direct_calls: int
    batches: int
    inputs_sent: int
    failed_batches: int
    dropped: int
    batch_sizes: Mapping[int, int]
