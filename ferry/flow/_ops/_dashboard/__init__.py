"""The flow dashboard: ``python -m ferry.flow STORE serve`` (docs/dashboard.md).

An ASGI app (`_app`, Starlette and Jinja2) served by hypercorn's trio worker (`_serve`), reading
the store through read-only transactions (`_reads`) and acting through an operator's engine.
`_app` holds the `Dashboard` and its routes; the pages are in `_pages`, the actions on one flow
in `_acts` and on a filter in `_on_many`, the session and the check of every POST in
`_session`, the guards around every request in `_guard`, the templates' environment and the
chart in `_render`, what a page shows of a value in `_shown`.
Needs the ``dashboard`` extra: ``pip install 'stm-ferry[dashboard]'``. ``import ferry.flow``
does not import this package.
"""
