"""The link from a flow to its trace: ``serve --trace-url TEMPLATE`` (docs/adr/0128).

A template is an ``http://`` or ``https://`` address with a host that holds ``{trace_id}``
exactly once and no other brace, for example ``https://jaeger.example/trace/{trace_id}`` or
``https://grafana.example/explore?traceId={trace_id}``. It is checked when the command is
read (`check`), so that a typo is an error at the call, not a broken link on every page. The
trace id put in is `ferry.flow._model._values.trace_id`'s: 32 lower-case hex digits, taken from
the stored ``traceparent`` only when it is a valid one, so nothing else of the row reaches the
address; the page escapes the address all the same.
"""

from __future__ import annotations

import urllib.parse
from typing import Final

PLACE: Final = "{trace_id}"


def check(template: object) -> str:
    """`template`, if it is a trace URL template; `TypeError`/`ValueError` saying what is
    wrong otherwise."""
    if not isinstance(template, str):
        raise TypeError(f"a trace URL template is a str, got {template!r}")
    if template.count(PLACE) != 1:
        raise ValueError(
            f"the trace URL template {template!r} must hold {PLACE} exactly once (where the"
            " trace id goes), e.g. https://jaeger.example/trace/{trace_id}"
        )
    rest = template.replace(PLACE, "")
    if "{" in rest or "}" in rest:
        raise ValueError(
            f"the trace URL template {template!r} has a brace besides {PLACE}: only {PLACE} is"
            " replaced"
        )
    if any(c.isspace() or not c.isprintable() or c in "<>\"'`\\" for c in rest):
        raise ValueError(
            f"the trace URL template {template!r} holds a space, a quote, an angle bracket, a"
            " backslash or a control character: percent-encode it"
        )
    parts = urllib.parse.urlsplit(template.replace(PLACE, "0" * 32))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"the trace URL template {template!r} must be an http:// or https:// address with a"
            " host"
        )
    return template


def link(template: str, trace_id: str) -> str:
    """The address of the trace `trace_id` (hex, from `trace_id`) by a checked `template`."""
    return template.replace(PLACE, trace_id)
