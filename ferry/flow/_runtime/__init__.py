"""The engine's trio parts: the requests, the writes through the ferry, the runner,
recovery, the timer task, the waiters, retention, tracing, the clock, the live
records, the observer protocol, the retry rule, the refused-row split and the plan
versions. They import the model and the store, not the engine that wires them nor
(but for what tests/test_layers.py lists) the fleet (docs/flow.md, "The folders").
"""
