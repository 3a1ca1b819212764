"""Errors raised by `ProjectedWrite` and its stores.

Neither is a `ferry.FerryError`: they are what a batch call raises, and the ferry hands them to
its callers as the `__cause__` of `ferry.Failed` (a fence conflict) or of `ferry.Committed`
(a blocked projection).
"""

from __future__ import annotations

from typing import final


@final
class FenceConflict(RuntimeError):
    """Another process wrote this key since this process last looked at it.

    The journal transaction was rolled back: nothing of the batch was written. This process has
    forgotten what it knew of the key, so a retry (same ids, same content) reloads it and is safe.
    """


@final
class ProjectionBlocked(RuntimeError):
    """A record was not projected because an earlier record of its key failed to project.

    The projected offset only advances over a contiguous prefix of successful records;
    `__cause__` is the earlier record's failure.
    """
