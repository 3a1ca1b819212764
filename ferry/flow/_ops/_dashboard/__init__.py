"""The flow dashboard: ``python -m ferry.flow STORE serve`` (docs/dashboard.md).

An ASGI app (`_app`, Starlette and Jinja2) served by hypercorn's trio worker (`_serve`), reading
the store through read-only transactions (`_reads`) and acting through an operator's engine.
Needs the ``dashboard`` extra: ``pip install 'stm-ferry[dashboard]'``. ``import ferry.flow``
does not import this package.
"""
