"""What `stm` lends to the other packages of this distribution (`ferry`, `ferry.projected`,
`ferry.flow`), and the only module of `stm` they import besides `stm` itself.

Not public API: users get no promise about these names. They are a contract inside the
distribution: change one here and its callers in `ferry` in the same commit. Everything else
under `stm._*` is private to `stm`; tests/test_public_names.py checks that `ferry` keeps to this
module.

- `update_single_tvar(tvar, bell, fn, args)`: one transaction on a single TVar (and maybe its
  doorbell) for a pure `fn` of its committed value, without the read and write logs of
  `atomically`: the waiting room of a ferry runs on it (ADR 0033). Its rules are in its
  docstring: never inside a transaction; `fn` reads and writes no TVar.
- `fixup_module_metadata(name, namespace)`: the public objects of a package show its public
  name (`ferry.Closed`, not `ferry._errors.Closed`); each package's `__init__.py` calls it.
"""

from __future__ import annotations

from ._txn import update as update_single_tvar
from ._util import NoPublicConstructor, fixup_module_metadata

__all__ = ["NoPublicConstructor", "fixup_module_metadata", "update_single_tvar"]
