"""`fixup_module_metadata`: public objects show their public module, not the private one.

Shared by the `__init__.py` of `stm`, `ferry` and `ferry.projected` (one distribution), in the
manner of trio's helper of the same name.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import FunctionType
from typing import NoReturn, TypeVar


def fixup_module_metadata(module_name: str, namespace: Mapping[str, object]) -> None:
    """Point the public objects of `namespace` defined in private modules at `module_name`.

    `namespace` is a package's `globals()` after its re-exports, `module_name` its `__name__`.
    Each public class or function from a private module below the package (a dotted part
    starting with `_`, as `ferry._errors`) gets `__module__ = module_name`, so tracebacks, reprs
    and `help()` show `ferry.Closed` rather than `ferry._errors.Closed`; so do the methods and
    nested classes defined in such a class, whose `__qualname__` is also set under the public
    class name. An object re-exported under another name takes that name. Objects from other
    packages, or already public, are left alone. Not thread-safe: call it once, at import.
    """
    prefix = module_name + "."
    seen: set[int] = set()

    def private(module: object) -> bool:
        return (
            isinstance(module, str)
            and module.startswith(prefix)
            and any(part.startswith("_") for part in module[len(prefix) :].split("."))
        )

    def fix(obj: object, qualname: str) -> None:
        if not isinstance(obj, type | FunctionType):  # an instance keeps its class's module
            return
        if id(obj) in seen or not private(getattr(obj, "__module__", None)):
            return
        seen.add(id(obj))
        inner = f"{obj.__qualname__}."
        try:
            obj.__module__ = module_name
            obj.__qualname__ = qualname
            obj.__name__ = qualname.rpartition(".")[2]
        except (AttributeError, TypeError):  # a class whose metaclass keeps its metadata
            return
        if isinstance(obj, type):
            for value in vars(obj).values():
                member = getattr(value, "__func__", value)  # a classmethod's or staticmethod's
                name = getattr(member, "__name__", None)
                if name is not None and str(getattr(member, "__qualname__", "")).startswith(inner):
                    fix(member, f"{qualname}.{name}")  # defined in the class, not imported

    for name, obj in list(namespace.items()):
        if not name.startswith("_"):
            fix(obj, name)


_C = TypeVar("_C")


class NoPublicConstructor(type):
    """The metaclass of a class that users get from a factory and never construct (as trio's
    own): calling the class raises `TypeError`; its own module makes one with ``Cls._create``."""

    def __call__(cls, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor: it is made by a"
            " factory function (see its docstring)"
        )

    def _create(cls: type[_C], *args: object, **kwargs: object) -> _C:
        return super().__call__(*args, **kwargs)  # type: ignore[misc, no-any-return]
