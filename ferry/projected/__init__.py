"""`ProjectedWrite` and its stores: fenced, idempotent journal writes with a projected view.

See docs/projected-write.md.
"""

from stm._internal import fixup_module_metadata as _fixup_module_metadata

from .._text import canonical_json as canonical_json
from ._errors import FenceConflict as FenceConflict
from ._errors import ProjectionBlocked as ProjectionBlocked
from ._journal import InboxRow as InboxRow
from ._journal import JournalSnapshot as JournalSnapshot
from ._journal import KeyRow as KeyRow
from ._journal import audit as audit
from ._postgres import PostgresStore as PostgresStore
from ._sqlite import SqliteStore as SqliteStore
from ._types import Decision as Decision
from ._types import Json as Json
from ._types import Posting as Posting
from ._types import ProjectedWriteStatistics as ProjectedWriteStatistics
from ._types import Record as Record
from ._types import Store as Store
from ._types import SweepReport as SweepReport
from ._types import Tx as Tx
from ._write import ProjectedWrite as ProjectedWrite

# Defined below the transport (ferry._text: the flow model and store use it too), public here.
canonical_json.__module__ = __name__
_fixup_module_metadata(__name__, globals())
