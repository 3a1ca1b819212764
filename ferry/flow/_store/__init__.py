"""The flow store: synchronous code that runs inside one store transaction on the store's
thread (the schema, the reads, the leases' rows, the SQL of both dialects, the batch
writer, the notifications it sends, the operators' queries, the SQLite file and its
lock). No trio, no clock (docs/flow.md, "The folders").
"""
