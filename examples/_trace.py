"""``--trace`` of the examples: collect the engine's OpenTelemetry spans in memory, then show the
spans of one flow as an indented tree.

An application would give the engine its own TracerProvider (exporting to its tracing backend);
here an SDK provider keeps every finished span in memory (`InMemorySpanExporter`), so that the
end of the run can print one flow's trace. Needs opentelemetry-sdk (in the project's ``[dev]``
extra; an application needs only ``pip install 'stm-ferry[otel]'`` and its own SDK set-up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
except ImportError:  # pragma: no cover - the project's [dev] extra has it
    AVAILABLE = False
else:
    AVAILABLE = True

NEEDS = "--trace needs opentelemetry-sdk: pip install opentelemetry-sdk (or the [dev] extra)"


class Collector:
    """A TracerProvider for the engine (`provider`) that keeps every finished span."""

    def __init__(self) -> None:
        if not AVAILABLE:  # pragma: no cover
            raise RuntimeError(NEEDS)
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self) -> Sequence[ReadableSpan]:
        return self.exporter.get_finished_spans()


def _attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def pick(spans: Sequence[ReadableSpan]) -> str | None:
    """The flow whose trace shows most: a step that raised and was retried, else the flow with
    the most spans; ties go to the smallest flow id."""
    runs: dict[str, int] = {}
    raised: set[str] = set()
    for span in spans:
        a = _attributes(span)
        fid = a.get("workflow.id")
        if isinstance(fid, str):
            runs[fid] = runs.get(fid, 0) + 1
            if a.get("workflow.task.outcome") == "raised":
                raised.add(fid)
    if not runs:
        return None
    return min(runs, key=lambda fid: (fid not in raised, -runs[fid], fid))


def tree(spans: Sequence[ReadableSpan], flow_id: str) -> list[dict[str, Any]]:
    """The spans of `flow_id`'s trace, depth first in start order: one dict per span with its
    depth, name, duration (ms) and what the engine recorded."""
    mine = [s for s in spans if _attributes(s).get("workflow.id") == flow_id]
    if not mine:
        return []
    assert mine[0].context is not None
    trace_id = mine[0].context.trace_id
    members = [s for s in spans if s.context is not None and s.context.trace_id == trace_id]
    ids = {s.context.span_id for s in members if s.context is not None}
    children: dict[int | None, list[ReadableSpan]] = {}
    for s in members:
        parent = s.parent.span_id if s.parent is not None and s.parent.span_id in ids else None
        children.setdefault(parent, []).append(s)
    rows: list[dict[str, Any]] = []

    def walk(parent: int | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_time or 0):
            a = _attributes(s)
            rows.append(
                {
                    "depth": depth,
                    "name": s.name,
                    "ms": round(((s.end_time or 0) - (s.start_time or 0)) / 1e6, 3),
                    "attempt": a.get("workflow.task.attempt"),
                    "outcome": a.get("workflow.task.outcome"),
                    "delivery": a.get("workflow.wake.delivery"),
                    "end": a.get("workflow.end"),
                    "error": s.status.description,
                }
            )
            walk(s.context.span_id if s.context is not None else None, depth + 1)

    walk(None, 0)
    return rows


def one_flow(spans: Sequence[ReadableSpan]) -> dict[str, Any] | None:
    """The trace of the flow `pick` chooses: its id, the trace id (hex) and the `tree`; None
    if no flow was traced."""
    fid = pick(spans)
    if fid is None:
        return None
    rows = tree(spans, fid)
    first = next(s for s in spans if _attributes(s).get("workflow.id") == fid)
    assert first.context is not None
    trace_id = f"{first.context.trace_id:032x}"
    return {"flow_id": fid, "trace_id": trace_id, "spans": rows}


def render(shown: dict[str, Any]) -> list[str]:
    """`one_flow`'s trace as text lines: indented by depth; attempt and outcome (a wake: what
    became of it), duration, error."""
    rows = shown["spans"]
    width = max(2 * r["depth"] + len(r["name"]) for r in rows)
    lines = [f"trace {shown['trace_id']} of flow {shown['flow_id']} ({len(rows)} spans)"]
    for r in rows:
        name = "  " * r["depth"] + r["name"]
        what = "" if r["attempt"] is None else f"attempt {r['attempt']}  {r['outcome']:<9}"
        if r.get("delivery"):
            what = r["delivery"]
        if r.get("end"):
            what = r["end"]
        line = f"  {name:<{width}}  {what:<20}  {r['ms']:>8.3f} ms"
        if r["error"]:
            line += f"  {r['error']}"
        lines.append(line.rstrip())
    return lines
