"""The statements an admission writes that its single form (`_admission`) and its batch form
(`_admission_batch`) share (docs/adr/0182): the ``admitted`` history row and its detail, a due
fresh start's update to ``RUNNING``, and the probe for an open key."""

from __future__ import annotations

import json
from typing import Final

from ferry.projected import Tx

from ._sql import FLOWS, HISTORY

KEYS: Final = "flow_keys"
QUEUED: Final = "QUEUED"  # `State.QUEUED` as the rows hold it

#: An admission's history row: (flow id, revision, time, `admitted_detail`), and its detail.
ADMITTED: Final = (
    f"INSERT INTO {HISTORY} (flow_id, revision, n, at, kind, step, attempt, detail)"
    " VALUES (?, ?, 0, ?, 'admitted', NULL, NULL, ?)"
)
#: A due fresh start admitted as it is queued (nothing for a row that is not a fresh start).
STRAIGHT_IN: Final = (
    f"UPDATE {FLOWS} SET queue_key = ?, priority = ?, turn = ?, seq = ?, not_before = ?,"
    " due = 1, state = 'RUNNING', owner = ?, lease_until = NULL, revision = revision + 1,"
    f" updated_at = ? WHERE flow_id = ? AND plan = ? AND state = '{QUEUED}'"
    " AND seq IS NULL AND blocked_from IS NULL"
)


def admitted_detail(owner: str, state: str) -> str:
    return json.dumps({"engine": owner or None, "state": state})


def any_open(tx: Tx, plan: str) -> bool:
    """Has the plan a key whose head may go (one passed over while another held its row)?"""
    return bool(tx.execute(f"SELECT 1 FROM {KEYS} WHERE plan = ? AND open = 1 LIMIT 1", (plan,)))
