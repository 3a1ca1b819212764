"""stm: software transactional memory for trio (and plain threads). See docs/stm.md."""

from __future__ import annotations

from ._atomically import after_commit as after_commit
from ._atomically import atomically as atomically
from ._atomically import atomically_nowait as atomically_nowait
from ._atomically import atomically_sync as atomically_sync
from ._atomically import check as check
from ._atomically import or_else as or_else
from ._atomically import retry as retry
from ._errors import NestedTransactionError as NestedTransactionError
from ._errors import NoTransactionError as NoTransactionError
from ._errors import RetryWouldHangError as RetryWouldHangError
from ._stats import STMStatistics as STMStatistics
from ._stats import statistics as statistics
from ._structures import TBQueue as TBQueue
from ._structures import TMap as TMap
from ._structures import TMVar as TMVar
from ._structures import TQueue as TQueue
from ._structures import TSemaphore as TSemaphore
from ._tvar import TVar as TVar
from ._util import fixup_module_metadata as _fixup_module_metadata

_fixup_module_metadata(__name__, globals())
