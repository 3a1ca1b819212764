"""Every difference between SQLite and PostgreSQL in `ferry/flow/` is in one place: the
`Dialect` records of `ferry/flow/_store/_dialect.py` (docs/adr/0134). No other module compares
a dialect's name (``tx.dialect == "postgres"``, ``store.dialect != "sqlite"``, ``dialect in
(...)``); a part that must know asks its dialect a question (`_dialect.of(tx).notifies`).

Read from the code (an AST walk, like `tests/test_layers.py`): a comparison with a ``dialect``
name or attribute on either side.
"""

from __future__ import annotations

import ast
import functools

from tests.test_layers import sources

#: The one module that may name the dialects.
DIALECT = "ferry/flow/_store/_dialect.py"


def _names_a_dialect(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "dialect") or (
        isinstance(node, ast.Attribute) and node.attr == "dialect"
    )


# Cached: the planted checks parse the same unchanged files again and again (only the planted
# file's text is new).
@functools.cache
def comparisons(path: str, text: str) -> tuple[str, ...]:
    """``path:line`` of each comparison of a dialect in `text`."""
    found = []
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, ast.Compare) and any(
            _names_a_dialect(side) for side in (node.left, *node.comparators)
        ):
            found.append(f"{path}:{node.lineno}")
    return tuple(found)


def _outside(files: dict[str, str]) -> list[str]:
    return [
        where
        for path, text in files.items()
        if path.startswith("ferry/flow/") and path != DIALECT
        for where in comparisons(path, text)
    ]


def test_no_module_but_the_dialects_compares_a_dialect() -> None:
    assert _outside(sources()) == [], "ask the store's Dialect (ferry/flow/_store/_dialect.py)"


def test_a_planted_comparison_of_a_dialect_is_found() -> None:
    """The check can fail: each form of a branch on the dialect's name is found."""
    files = sources()
    path = "ferry/flow/_store/_inbox.py"
    for line in (
        'x = tx.dialect == "postgres"',
        'x = store.dialect != "sqlite"',
        'x = dialect in ("postgres",)',
        'x = "sqlite" == self._store.dialect',
    ):
        planted = dict(files, **{path: files[path] + f"\n{line}\n"})
        assert len(_outside(planted)) == 1, line


def test_the_dialects_module_may_compare_them() -> None:
    files = sources()
    planted = dict(files, **{DIALECT: files[DIALECT] + '\nx = tx.dialect == "postgres"\n'})
    assert _outside(planted) == []
