"""The pure model of a flow: the public types, plans, the checks of what may be stored, the
values the machine works on, the machine's transitions, the invariants, the timer heap,
operators' times and the errors. Standard library and attrs only: no trio, no clock,
no database (docs/flow.md, "The folders").
"""
