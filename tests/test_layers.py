"""The folders of `ferry/flow/` are layers: which folder may import which (docs/adr/0120).

Read from the code's own imports (every ``import`` and ``from ... import`` of every file, in a
function or under ``TYPE_CHECKING`` too), like `test_public_names`. Bottom first:

- ``_model/``: pure. The standard library (not ``sqlite3``), attrs and pyrsistent, ferry's pure
  text forms (``ferry._text``), and itself.
- ``_store/``: synchronous, inside one transaction. No trio, no stm, no clock, no ``ferry`` but
  the transport (``ferry.projected``) and ``ferry._text``.
- ``_runtime/``: the engine's trio parts. Below the fleet: it does not name it.
- ``_fleet/``: PostgreSQL only. The only folder that imports the driver (``psycopg``) and
  ``ferry.projected._postgres``.
- ``_engine/``: the composition root (`Engine`, `open_engine`, `Parts`); the one folder above
  the fleet that may name it.
- ``_ops/``: the operator's tools, through the public API (`_engine/_engine.py`,
  `_engine/_open.py`), the model and the store's reads; never the runtime or the fleet.
- ``__init__.py``, ``__main__.py``: the face. Outside ``ferry/flow/`` (``ferry.metrics``, the
  examples) only the face is used.

No folder imports one above it. What breaks a rule today is listed in `EXCEPTIONS`, each with
why it is there: the list must shrink to nothing (the mode chosen once, the store's split), and
an entry that no longer breaks a rule fails the test too, so that the list stays true.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOW = "ferry/flow"

#: The layer folders of ``ferry/flow/``, bottom first.
ORDER = ("_model", "_store", "_runtime", "_fleet", "_engine", "_ops")
FACE = ("ferry/flow/__init__.py", "ferry/flow/__main__.py")
#: The modules of the engine the operator's tools may use: the public API's own.
API = ("ferry.flow._engine._engine", "ferry.flow._engine._open", "ferry.flow._engine._client")
POSTGRES = ("psycopg", "ferry.projected._postgres")
#: ferry's pure text forms (canonical JSON, a DSN masked or shown; the standard library only),
#: below the transport and every layer: the model and the store may use them.
PURE = ("ferry._text",)

#: (file, what it imports) -> why it may, for now. Each entry is a debt of the layering.
EXCEPTIONS: dict[tuple[str, str], str] = {}

_MODEL_THIRD_PARTY = {"attrs", "pyrsistent"}
_MODEL_NOT_STDLIB = {"sqlite3"}
_STORE_NEVER = {"trio", "stm", "time"}


def sources(root: Path = ROOT) -> dict[str, str]:
    """Every Python file the rules read: ``ferry/`` and ``examples/``, by path from the root."""
    found = {}
    for top in ("ferry", "examples"):
        for path in sorted((root / top).rglob("*.py")):
            found[path.relative_to(root).as_posix()] = path.read_text()
    return found


def _module_of(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _statements(path: str, text: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each import of one file: (module, names), names empty for ``import X``; relative ones
    resolved from the file's package."""
    package = _module_of(path)
    if not path.endswith("__init__.py"):
        package = package.rpartition(".")[0]
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.append((base, tuple(alias.name for alias in node.names)))
    return tuple(found)


def imports(files: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    """(file, module) for each import of each file; ``from X import a`` is ``X.a`` where that
    is a module of `files`, else ``X``."""
    modules = {_module_of(path) for path in files}
    for path, text in files.items():
        for base, names in _statements(path, text):
            if not names:
                yield path, base
            for name in names:
                full = f"{base}.{name}"
                yield path, full if full in modules else base


def _folder(path: str) -> str | None:
    """The layer a file of ``ferry/flow/`` is in ("face" for the face), None outside."""
    if not path.startswith(FLOW + "/"):
        return None
    if path in FACE:
        return "face"
    return path.split("/")[2]


def _target_folder(module: str) -> str | None:
    """The layer a module of ``ferry.flow`` is in ("face" for ``ferry.flow``), None outside."""
    if module == "ferry.flow":
        return "face"
    if not module.startswith("ferry.flow."):
        return None
    return module.split(".")[2]


def _within(module: str, names: tuple[str, ...]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def _rule(path: str, module: str) -> str | None:
    """The rule that `path` importing `module` breaks, or None."""
    folder, target = _folder(path), _target_folder(module)
    if folder is None:  # ferry/ outside the package, examples/
        ok = target in (None, "face")
        return None if ok else "outside ferry/flow/ only the face (ferry.flow) is used"
    if folder != "face" and folder not in ORDER:
        return f"{path} is in no layer folder ({', '.join(ORDER)})"
    if folder == "face":
        return None
    if target is not None:  # a module of the package
        if target == "face":
            return "the package's face is imported by no folder"
        if target not in ORDER:
            return f"{module} is in no layer folder"
        if ORDER.index(target) > ORDER.index(folder):
            return f"{folder}/ imports {target}/, which sits above it"
        if folder == "_ops" and target in ("_runtime", "_fleet"):
            return "the operator's tools use the public API and the store, not the engine's parts"
        if folder == "_ops" and target == "_engine" and not _within(module, API):
            return "the operator's tools use the engine through its public API only"
        return None
    top = module.split(".")[0]
    if _within(module, POSTGRES) and folder != "_fleet":
        return "only the fleet imports the PostgreSQL driver and ferry.projected._postgres"
    if _within(module, PURE):
        return None
    if folder == "_model" and top == "ferry":
        return "the model imports no ferry package: no ferry, no transport, no driver"
    if folder == "_model" and not (
        top in _MODEL_THIRD_PARTY
        or (top in sys.stdlib_module_names and top not in _MODEL_NOT_STDLIB)
    ):
        return "the model imports the standard library (not sqlite3), attrs and pyrsistent only"
    if folder == "_store" and top in _STORE_NEVER:
        return "the store imports no trio, no stm, no clock"
    if folder == "_store" and top == "ferry" and not _within(module, ("ferry.projected",)):
        return "the store imports no ferry but the transport (ferry.projected)"
    return None


def problems(files: Mapping[str, str]) -> dict[tuple[str, str], str]:
    """(file, module) -> the rule that import breaks."""
    found = {}
    for path, module in imports(files):
        rule = _rule(path, module)
        if rule is not None:
            found[(path, module)] = rule
    return found


def test_no_folder_imports_one_above_it_but_the_listed_exceptions() -> None:
    found = problems(sources())
    new = {key: rule for key, rule in found.items() if key not in EXCEPTIONS}
    paid = [key for key in EXCEPTIONS if key not in found]
    assert new == {}, "imports that break a rule of the layers (move the code, or the import)"
    assert paid == [], "no longer an exception: strike it from EXCEPTIONS"


def test_every_module_of_the_package_is_in_a_layer_folder() -> None:
    strays = [
        path
        for path in sources()
        if _folder(path) not in (None, "face", *ORDER)
        or (path.startswith(FLOW + "/") and path.count("/") == 2 and path not in FACE)
    ]
    assert strays == []


def _planted(path: str, line: str) -> dict[tuple[str, str], str]:
    files = sources()
    files[path] = files[path] + f"\n{line}\n"
    return problems(files)


@pytest.mark.parametrize(
    ("path", "line", "module"),
    [
        # an upward import: the model names the operator's tools
        ("ferry/flow/_model/_values.py", "from .._ops import _bulk", "ferry.flow._ops._bulk"),
        # the model imports trio, a driver, the transport
        ("ferry/flow/_model/_machine.py", "import trio", "trio"),
        ("ferry/flow/_model/_machine.py", "import sqlite3", "sqlite3"),
        ("ferry/flow/_model/_plan.py", "from ferry.projected import Tx", "ferry.projected"),
        # the store imports trio, the clock, the runtime
        ("ferry/flow/_store/_batch.py", "import trio", "trio"),
        ("ferry/flow/_store/_sql.py", "import time", "time"),
        (
            "ferry/flow/_store/_sql.py",
            "from .._runtime import _retry",
            "ferry.flow._runtime._retry",
        ),
        # the runtime names the fleet or the root, inside a function too
        (
            "ferry/flow/_runtime/_writes.py",
            "from .._fleet._fleet import Fleet",
            "ferry.flow._fleet._fleet",
        ),
        (
            "ferry/flow/_runtime/_live.py",
            "def f():\n    from .._engine import _parts",
            "ferry.flow._engine._parts",
        ),
        # the driver outside the fleet
        ("ferry/flow/_runtime/_retry.py", "import psycopg", "psycopg"),
        # the operator's tools past the public API
        ("ferry/flow/_ops/_bulk.py", "from .._engine import _parts", "ferry.flow._engine._parts"),
        (
            "ferry/flow/_ops/_bulk.py",
            "from .._runtime import _writes",
            "ferry.flow._runtime._writes",
        ),
        # outside the package, past the face
        ("ferry/metrics.py", "from ferry.flow._store import _store", "ferry.flow._store._store"),
    ],
)
def test_a_planted_import_that_breaks_a_rule_is_found(path: str, line: str, module: str) -> None:
    """The rules can fail: each planted import is found, and only it."""
    assert problems(sources()).keys() == EXCEPTIONS.keys()  # the tree as it is
    found = _planted(path, line)
    assert (path, module) in found
    assert found.keys() - EXCEPTIONS.keys() == {(path, module)}


def test_a_planted_module_outside_the_folders_is_found() -> None:
    files = sources()
    files["ferry/flow/_stray.py"] = "from ._model import _values\n"
    assert ("ferry/flow/_stray.py", "ferry.flow._model._values") in problems(files)


def test_an_allowed_import_is_not_found() -> None:
    """The root names the fleet; the tools use the API and the store's reads."""
    for path, line in [
        ("ferry/flow/_engine/_parts.py", "from .._fleet import _listener"),
        ("ferry/flow/_ops/_bulk.py", "from .._store import _query"),
        ("ferry/flow/_ops/_bulk.py", "from .._engine._open import open_engine"),
        ("ferry/flow/_runtime/_writes.py", "from .._store import _batch"),
    ]:
        assert _planted(path, line).keys() == EXCEPTIONS.keys()


def _not_stdlib(path: str, text: str) -> set[str]:
    """The top-level modules `text` (the file at `path`) imports that are not the standard
    library's."""
    tops = {module.split(".")[0] for _p, module in imports({path: text})}
    return {top for top in tops if top not in sys.stdlib_module_names}


def test_the_pure_text_forms_import_the_standard_library_only() -> None:
    """`ferry._text` sits below every layer (the model and the store use it): it must stay
    pure, or the model's rule would be broken through it. (It can fail: a planted import of
    attrs is found.)"""
    path = "ferry/_text.py"
    text = sources()[path]
    assert _not_stdlib(path, text) == set()
    assert _not_stdlib(path, text + "\nimport attrs\n") == {"attrs"}
