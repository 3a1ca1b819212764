"""Public objects of `stm`, `ferry`, `ferry.projected` and `ferry.flow` show public module names,
methods too."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest

import ferry
import ferry.flow
import ferry.projected
import stm
from stm._internal import fixup_module_metadata

PACKAGES = [stm, ferry, ferry.projected, ferry.flow]


def _ours(obj: object) -> bool:
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] in {"stm", "ferry"}


def _public_objects() -> Iterator[tuple[str, object]]:
    """(dotted public name, object) for each public class or function of ours, and each member
    a class defines."""
    for package in PACKAGES:
        for name in dir(package):
            obj = getattr(package, name)
            if name.startswith("_") or not isinstance(obj, type | types.FunctionType):
                continue  # instances (constants) show their class's module, and modules their own
            if not _ours(obj):
                continue
            yield f"{package.__name__}.{name}", obj
            if isinstance(obj, type):
                for attr, value in vars(obj).items():
                    member = getattr(value, "__func__", value)
                    qualname = getattr(member, "__qualname__", "")
                    if _ours(member) and qualname.startswith(f"{obj.__qualname__}."):
                        yield f"{package.__name__}.{name}.{attr}", member


def test_every_public_object_and_method_shows_a_public_module() -> None:
    objects = list(_public_objects())
    assert len(objects) > 100  # classes and their methods, in all three packages
    private = [
        f"{name}: {obj.__module__}"
        for name, obj in objects
        if any(part.startswith("_") for part in obj.__module__.split("."))
    ]
    assert private == []


@pytest.mark.parametrize(
    ("obj", "shown"),
    [
        (stm.TVar, "stm.TVar"),
        (stm.TVar.get, "stm.TVar.get"),
        (stm.TQueue.get_nowait, "stm.TQueue.get_nowait"),
        (stm.atomically, "stm.atomically"),
        (ferry.Closed, "ferry.Closed"),
        (ferry.open_per_key_ferry, "ferry.open_per_key_ferry"),
        (ferry.ProjectedWrite, "ferry.projected.ProjectedWrite"),
        (ferry.projected.SqliteStore, "ferry.projected.SqliteStore"),
        (ferry.flow.Engine.wake, "ferry.flow.Engine.wake"),
    ],
)
def test_shown_name(obj: object, shown: str) -> None:
    assert f"{obj.__module__}.{obj.__qualname__}" == shown  # type: ignore[attr-defined]


def test_fixup_leaves_foreign_and_imported_objects_alone() -> None:
    def helper() -> None: ...

    class Widget:
        other = helper  # defined elsewhere: keeps its qualname

        def spin(self) -> None: ...

        @classmethod
        def make(cls) -> None: ...

    def make_private(obj: object, module: str) -> None:
        obj.__module__ = module

    for obj in (helper, Widget, Widget.spin, Widget.__dict__["make"].__func__):
        make_private(obj, "pkg._impl")
    foreign = types.SimpleNamespace(__module__="other._impl")
    instance = Widget()  # an instance (say, a constant): its class's module, not its own
    namespace = {
        "Widget": Widget,
        "alias": helper,
        "foreign": foreign,
        "CONSTANT": instance,
        "_hidden": int,
    }
    fixup_module_metadata("pkg", namespace)
    assert (Widget.__module__, Widget.__qualname__) == ("pkg", "Widget")
    assert (Widget.spin.__module__, Widget.spin.__qualname__) == ("pkg", "Widget.spin")
    assert Widget.__dict__["make"].__func__.__qualname__ == "Widget.make"
    assert (helper.__module__, helper.__name__, helper.__qualname__) == ("pkg", "alias", "alias")
    assert foreign.__module__ == "other._impl"
    assert "__module__" not in vars(instance)
    assert int.__module__ == "builtins"


def test_ferry_imports_stm_only_through_its_public_api_and_stm_internal() -> None:
    """`ferry` (with `ferry.projected` and `ferry.flow`) may import `stm` and `stm._internal`,
    the interface stm keeps for this distribution; any other `stm._*` module is stm's own."""
    import ast
    from pathlib import Path

    root = Path(ferry.__file__).parent
    allowed = {"stm", "stm._internal"}
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [
                f"{path.relative_to(root)}: {name}"
                for name in names
                if name.split(".")[0] == "stm" and name not in allowed
            ]
    assert len(list(root.rglob("*.py"))) > 20  # the walk saw the packages
    assert found == []
