"""PostgreSQL only: a fleet engine's rounds (renewals, scans, hand-offs), its lease and
what it may trust on it, the lease thread, the LISTEN thread and the first contact
with a PostgreSQL store (docs/flow.md, "The folders").
"""
