"""The composition root: the public `Engine`, `open_engine` and `Parts`, which builds the
parts of the runtime and the fleet and wires them together. The only folder that
names the fleet (docs/flow.md, "The folders").
"""
