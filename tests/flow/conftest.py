from __future__ import annotations

# The store contract suite runs on both stores, on fresh databases, like tests/stores.
from tests.stores.conftest import make_store as make_store

__all__ = ["make_store"]
