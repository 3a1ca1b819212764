"""The reference of every public name (docs/reference.md), made from the code.

``python -m tests.reference > docs/reference.md`` writes it; `tests/test_reference.py` checks that
the committed page is what the code makes now, so it cannot drift. Every public function, class,
method and property of `ferry.flow`, `ferry`, `ferry.projected` and `stm` gets its signature as
the code declares it (keyword-only arguments after ``*``), the fields of its records with their
types and defaults, and its docstring.
"""

from __future__ import annotations

import enum
import inspect
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

import attrs

import ferry
import ferry.flow
import ferry.projected
import stm

PACKAGES: tuple[types.ModuleType, ...] = (ferry.flow, ferry, ferry.projected, stm)

_ADDRESS = re.compile(r"<([^<>]*?) at 0x[0-9a-f]+>")


def _text(value: object) -> str:
    return _ADDRESS.sub(r"<\1>", repr(value))


def _signature(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parts: list[str] = []
    star = False
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            star = True
            parts.append(f"*{p.name}")
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        text = p.name
        if p.annotation is not p.empty:
            text += f": {p.annotation}" if isinstance(p.annotation, str) else ""
        if p.default is not p.empty:
            text += f" = {_text(p.default)}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (
            list(sig.parameters.values()).index(p) == len(sig.parameters) - 1
            or list(sig.parameters.values())[list(sig.parameters.values()).index(p) + 1].kind
            is not p.POSITIONAL_ONLY
        ):
            parts.append("/")
    ret = sig.return_annotation
    arrow = f" -> {ret}" if isinstance(ret, str) else ""
    return f"({', '.join(parts)}){arrow}"


def _doc(obj: object) -> str:
    doc = inspect.getdoc(obj)
    return doc.strip() if doc else "(no docstring)"


def _public(package: types.ModuleType) -> Iterator[tuple[str, Any]]:
    names = getattr(package, "__all__", None) or [n for n in dir(package) if not n.startswith("_")]
    for name in sorted(names, key=lambda n: (n.lower(), n)):
        obj = getattr(package, name)
        if isinstance(obj, types.ModuleType) or type(obj).__name__ == "_Feature":
            continue
        yield name, obj


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    for attr, value in vars(cls).items():
        if attr.startswith("_") and attr not in ("__aenter__", "__aexit__"):
            continue
        if attrs.has(cls) and attr in {f.name for f in attrs.fields(cls)}:
            continue
        if isinstance(value, property | staticmethod | classmethod | types.FunctionType):
            yield attr, value


def _fields(cls: type) -> list[str]:
    rows = ["| field | type | default |", "| --- | --- | --- |"]
    for f in attrs.fields(cls):
        if f.default is attrs.NOTHING:
            default = ""
        elif isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
            default = f"`{f.default.factory.__name__}()`"
        else:
            default = f"`{_text(f.default)}`"
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", _text(f.type))
        cells = [f"`{f.name}`", f"`{kind}`", default]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return rows


def _kind(obj: Any) -> str:
    if isinstance(obj, type):
        if issubclass(obj, BaseException):
            bases = ", ".join(b.__name__ for b in obj.__bases__)
            return f"exception ({bases})"
        if issubclass(obj, enum.Enum):
            return "enum"
        if attrs.has(obj):
            return "record"
        return "class"
    if inspect.iscoroutinefunction(obj):
        return "async function"
    if callable(obj):
        return "function"
    return "constant"


def _method(cls: type, attr: str, value: Any) -> list[str]:
    if isinstance(value, property):
        return [f"- **`{cls.__name__}.{attr}`** (property): {_doc(value)}".replace("\n", "\n  ")]
    fn = value.__func__ if isinstance(value, staticmethod | classmethod) else value
    prefix = "async " if inspect.iscoroutinefunction(fn) else ""
    head = f"- **`{prefix}{cls.__name__}.{attr}{_signature(fn)}`**"
    return [f"{head}: {_doc(fn)}".replace("\n", "\n  ")]


def _entry(package: str, name: str, obj: Any) -> list[str]:
    kind = _kind(obj)
    out = [f"### `{package}.{name}` ({kind})", ""]
    if kind == "constant":
        out += [f"`{name} = {_text(obj)}`", ""]
        return out
    if isinstance(obj, type):
        if issubclass(obj, enum.Enum):
            out += [", ".join(f"`{m.name}`" for m in obj), ""]
        elif (
            attrs.has(obj) or (not issubclass(obj, BaseException) and "__init__" in vars(obj))
        ) and "no public constructor" not in _doc(obj):
            out += [f"`{name}{_signature(obj)}`", ""]
        out += [_doc(obj), ""]
        if attrs.has(obj) and attrs.fields(obj):
            out += [*_fields(obj), ""]
        methods = [line for attr, value in _members(obj) for line in _method(obj, attr, value)]
        if methods:
            out += [*methods, ""]
        return out
    prefix = "async " if inspect.iscoroutinefunction(obj) else ""
    out += [f"`{prefix}{name}{_signature(obj)}`", "", _doc(obj), ""]
    return out


def render() -> str:
    out = [
        "# Reference: every public name",
        "",
        "Made from the code by `python -m tests.reference > docs/reference.md`;"
        " `tests/test_reference.py` fails when this page and the code disagree. Arguments after"
        " `*` are keyword-only: `engine.start(plan, flow_id='a', data={})`, never"
        " `engine.start(plan, 'a', {})`. The guides say how to use these names: docs/flow.md,"
        " docs/guide.md, docs/stm.md, docs/projected-write.md.",
        "",
    ]
    for package in PACKAGES:
        out += [f"## `{package.__name__}`", ""]
        for name, obj in _public(package):
            if package is not ferry.flow and getattr(obj, "__module__", "").startswith(
                "ferry.flow"
            ):
                continue
            if package is ferry and getattr(obj, "__module__", "").startswith("ferry.projected"):
                continue  # listed under ferry.projected
            out += _entry(package.__name__, name, obj)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
