"""`FerryStatistics`: one frozen snapshot of a ferry, read with a single TVar peek."""

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
    waiting room, `rejected` found it full, `after_close` came after the ferry closed and
    `direct_calls` were sent at once by their caller; `batches` sent by workers carrying
    `inputs_sent` inputs, `failed_batches` calls that raised (batched or direct), `dropped` inputs
    whose callers were cancelled while they waited, `drained` inputs still waiting at close (their
    callers got `Closed`), and `batch_sizes`, an immutable histogram: batch size -> number of
    batches of that size.

    Every snapshot satisfies the two conservation equations (docs/guide.md, "Watching it"):

        submitted == admitted + rejected + after_close + direct_calls
        admitted == queued + inputs_sent + dropped + drained

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
    after_close: int
    direct_calls: int
    batches: int
    inputs_sent: int
    failed_batches: int
    dropped: int
    drained: int
    batch_sizes: Mapping[int, int]
