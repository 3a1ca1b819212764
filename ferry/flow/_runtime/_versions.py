"""Which plan versions an engine runs, and (in a fleet) which versions it lacks that another live
engine has.

A rolling deploy runs old and new engines side by side (docs/adr/0074): a flow of a version this
engine lacks and a live engine of the fleet has is not missing, it is *elsewhere*: this engine
leaves it to such an engine (nobody's after its write, taken over at that engine's next scan) and
never blocks it. The versions elsewhere are read at every scan (`refresh`) and on a request for a
version not seen yet (`_requests.Requests.versioned`).
"""

from __future__ import annotations

from functools import partial

from ferry.projected import Store

from .._model._plan import Plan, StepDef
from .._model._values import Flow, Shape
from .._store import _store


class Versions:
    """The plan versions of one engine: `shapes` and `steps` of its own plans (fixed at open),
    and `fleet_known`: versions it lacks that a live engine has (replaced as a whole, never
    edited: a reader may hold the old dict)."""

    __slots__ = ("fleet_known", "shapes", "steps")

    def __init__(self, plans: dict[tuple[str, int], Plan]) -> None:
        self.shapes: dict[tuple[str, int], Shape] = {k: p._close() for k, p in plans.items()}
        self.steps: dict[tuple[str, int], tuple[StepDef, ...]] = {
            k: p.steps for k, p in plans.items()
        }
        self.fleet_known: dict[tuple[str, int], Shape] = {}

    def elsewhere(self, flow: Flow) -> bool:
        """Is this a flow of a plan version this fleet engine lacks and another live engine
        has? It is left to such an engine (the module docstring)."""
        key = (flow.plan, flow.version)
        return key in self.fleet_known and key not in self.shapes

    def learn(self, live: list[Shape]) -> dict[tuple[str, int], Shape]:
        """Keep the versions of `live` (every version a live engine has) that this engine lacks;
        returns them."""
        own = self.shapes
        self.fleet_known = {
            (sh.name, sh.version): sh for sh in live if (sh.name, sh.version) not in own
        }
        return self.fleet_known

    async def refresh(self, store: Store, now: float) -> dict[tuple[str, int], Shape]:
        """Read the versions live engines have (`_store.live_plans_on_clock`: live by the lease
        clock; `now` is the engine's clock) and `learn` them. Raises the store's error."""
        return self.learn(await store.transact(partial(_store.live_plans_on_clock, now=now)))
