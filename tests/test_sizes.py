"""No file, class or function of `ferry/flow/` outgrows what one reader holds in mind.

Read from the code (an AST walk, like `test_layers`): no file over `FILE_LINES` lines, no class
over `CLASS_LINES`, no function (or method, async or not, nested too) over `FUNCTION_LINES`, a
class or function counted from its ``def``/``class`` line to its last (``end_lineno - lineno +
1``; decorators left out). What is over today is listed in `SIZE_EXCEPTIONS`: the list must
shrink to nothing, and an entry that no longer breaks the rule fails the test too, so that the
list stays true.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOW = "ferry/flow"

FILE_LINES = 600
CLASS_LINES = 300
FUNCTION_LINES = 80

#: (file, what: "file", "class Name" or "def name") -> why it is over, for now.
SIZE_EXCEPTIONS: dict[tuple[str, str], str] = {}


def sources(root: Path = ROOT) -> dict[str, str]:
    """Every Python file of ``ferry/flow/``, by path from the root."""
    return {
        path.relative_to(root).as_posix(): path.read_text()
        for path in sorted((root / FLOW).rglob("*.py"))
    }


def oversized(files: Mapping[str, str]) -> dict[tuple[str, str], int]:
    """(file, what) -> its length in lines, for each file, class and function over its limit."""
    found: dict[tuple[str, str], int] = {}
    for path, text in files.items():
        lines = len(text.splitlines())
        if lines > FILE_LINES:
            found[(path, "file")] = lines
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.ClassDef):
                what, limit = f"class {node.name}", CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                what, limit = f"def {node.name}", FUNCTION_LINES
            else:
                continue
            assert node.end_lineno is not None
            size = node.end_lineno - node.lineno + 1
            if size > limit:
                found[(path, what)] = max(size, found.get((path, what), 0))
    return found


def test_no_file_class_or_function_is_over_its_size_but_the_listed_exceptions() -> None:
    found = oversized(sources())
    new = {key: size for key, size in found.items() if key not in SIZE_EXCEPTIONS}
    paid = [key for key in SIZE_EXCEPTIONS if key not in found]
    assert new == {}, (
        f"over {FILE_LINES} lines a file, {CLASS_LINES} a class, {FUNCTION_LINES} a function: "
        "split it by concern"
    )
    assert paid == [], "no longer over its size: strike it from SIZE_EXCEPTIONS"


def test_a_planted_long_file_class_and_function_are_found() -> None:
    """The rule can fail: each planted oversize is found, at its limit plus one and not at it."""
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    files = {
        "ferry/flow/_model/_long_def.py": f"def f():\n{body}\n",
        "ferry/flow/_model/_short_def.py": "def g():\n" + "\n".join(body.splitlines()[1:]) + "\n",
        "ferry/flow/_model/_long_class.py": "class C:\n" + "    x = 1\n" * CLASS_LINES,
        "ferry/flow/_model/_long_file.py": "x = 1\n" * (FILE_LINES + 1),
        "ferry/flow/_model/_full_file.py": "x = 1\n" * FILE_LINES,
    }
    assert oversized(files) == {
        ("ferry/flow/_model/_long_def.py", "def f"): FUNCTION_LINES + 1,
        ("ferry/flow/_model/_long_class.py", "class C"): CLASS_LINES + 1,
        ("ferry/flow/_model/_long_file.py", "file"): FILE_LINES + 1,
    }
