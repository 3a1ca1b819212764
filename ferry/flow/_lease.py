"""A fleet engine's name and lease: the checks of `owner` and `lease`, and who holds a name.

Each `open_engine` on a fleet is an *incarnation* of its owner name (a new uuid): the name's row
in ``ns_engines`` says which incarnation holds it, where that one runs and until when its lease
runs (`_store.claim`). One live engine per name: a second opening while the holder's lease runs
raises `flow.StoreLocked` naming the owner, unless the holder's process is proven gone
(`process_gone`: it ran on this very host, in this pid namespace and boot, and that process id
no longer exists), as after a crash and a restart on the same machine. A clean close ends the
lease (`_store.end_lease`), so a restart after one claims the name at once too. docs/adr/0071.

The lease's range is what the store can enforce: its guard on idle transactions is a quarter of
the lease in milliseconds, a 32-bit count on PostgreSQL, and a lease under half a second leaves no
time for a renewal on a loaded machine.
"""

from __future__ import annotations

import math
import os
import socket
from functools import cache

OWNER_MAX = 200  # characters
LEASE_MIN = 0.5  # seconds
LEASE_MAX = 86_400.0  # seconds (one day)


def check_owner(owner: object) -> str:
    """`owner` if it is a usable engine name; else a `ValueError` saying why."""
    if not isinstance(owner, str):
        raise ValueError(
            f"owner must be a str (the engine's name in the fleet) or None, got {owner!r}"
        )
    if not owner:
        raise ValueError("owner must not be empty: give each engine a name, or None for a new uuid")
    if len(owner) > OWNER_MAX:
        raise ValueError(
            f"owner must be at most {OWNER_MAX} characters, got {len(owner)}"
            f" ({owner[:20]!r}...): use a short name such as a host and an instance number"
        )
    if not owner.isprintable():
        bad = next(ch for ch in owner if not ch.isprintable())
        raise ValueError(
            f"owner must be printable text, got {owner!r} (it holds {bad!r}, a control,"
            " separator or unpaired surrogate character): use letters, digits and punctuation"
        )
    return owner


def check_lease(lease: object) -> float:
    """`lease` in seconds if it is in the range the store can enforce; else a `ValueError`."""
    if isinstance(lease, bool) or not isinstance(lease, int | float):
        raise ValueError(f"lease must be a number of seconds, got {lease!r}")
    if not (math.isfinite(lease) and LEASE_MIN <= lease <= LEASE_MAX):
        raise ValueError(
            f"lease must be between {LEASE_MIN:g} s and {LEASE_MAX:g} s (one day), got {lease!r}:"
            " engines renew it every third, and the database ends a transaction left idle for a"
            " quarter of it"
        )
    return float(lease)


@cache
def host_identity() -> str:
    """This machine and process namespace, as precisely as it can be told: the host name, the
    boot id and the pid namespace (two containers on one host, or one host before and after a
    reboot, are different hosts here: a process id means something only within one of them)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("")
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append("")
    return "/".join(parts)


def process_gone(host: str | None, pid: int | None) -> bool:
    """Is the process that holds a name proven gone? Only if it ran in this host identity and
    its process id exists no more. False whenever it cannot be told (another host, an engine of
    an older version that recorded neither): then its lease must lapse first."""
    if host is None or pid is None or host != host_identity():
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's): alive
        return False
    return False
