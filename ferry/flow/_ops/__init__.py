"""The operator's tools: ``python -m ferry.flow`` (the inspector, its reads and its acts),
the bulk actions and the dashboard. They use the engine through its public API and the
store through its reads (docs/flow.md, "The folders").
"""
