"""ferry: many concurrent `await f(x)` calls become a few batched calls, on trio.

`open_ferry` batches into `call(inputs)`; `open_per_key_ferry` batches per key into
`call(key, inputs)` with at most one call in flight per key. See docs/guide.md.
"""

from __future__ import annotations

from stm._internal import fixup_module_metadata as _fixup_module_metadata

from ._errors import BatchContractError as BatchContractError
from ._errors import Closed as Closed
from ._errors import Committed as Committed
from ._errors import Failed as Failed
from ._errors import FerryError as FerryError
from ._errors import IdReused as IdReused
from ._errors import InputError as InputError
from ._errors import Rejected as Rejected
from ._ferry import Ferry as Ferry
from ._ferry import PerKeyFerry as PerKeyFerry
from ._ferry import open_ferry as open_ferry
from ._ferry import open_per_key_ferry as open_per_key_ferry
from ._stats import FerryStatistics as FerryStatistics
from .projected import FenceConflict as FenceConflict
from .projected import ProjectedWrite as ProjectedWrite

__all__ = [
    "BatchContractError",
    "Closed",
    "Committed",
    "Failed",
    "FenceConflict",
    "Ferry",
    "FerryError",
    "FerryStatistics",
    "IdReused",
    "InputError",
    "PerKeyFerry",
    "ProjectedWrite",
    "Rejected",
    "open_ferry",
    "open_per_key_ferry",
]

# Tracebacks, reprs and help() show the public names, not the private modules.
_fixup_module_metadata(__name__, globals())
