"""Orders that ship in boxes, with `ferry.flow`'s child flows: each order spawns one child flow
per box, at most a few at a time, and waits for them durably; an order whose box cannot be
shipped, or whose invoice is refused, undoes the boxes it shipped.

    python examples/boxes.py [--orders 12] [--boxes 5] [--max-running 2] [--seed 1]
                             [--fail FRACTION] [--db PATH] [--json]

Every order is a flow of the plan ``order``:

1. ``reserve`` holds the order's stock; compensation: let it go.
2. ``ship_all`` returns ``flow.spawn([...], max_running=N)``: a child flow of the plan ``box``
   for each box (``flow.Child(box, key="box-3", data=...)``, flow id ``<run>-order-7/1/box-3``,
   ``<run>`` a prefix of the run's own, so a kept ``--db`` can be run again), at most N of them
   active at once (the rest are kept, and each starts when one ends). The order
   waits, parked, until every box has ended. A box that fails (``--fail``: the carrier loses
   it) stops the spawn: the other boxes are cancelled, no kept one starts, and the order
   compensates. Compensation: tell the customer the shipment is off.
3. ``invoice`` reads ``ctx.children`` (key -> `flow.ChildResult`, in spawn order: each box's
   state and data) and bills the tracking numbers; a few invoices are refused (``--fail``).

A box is a flow of the plan ``box``: ``pack`` (compensation: unpack) and ``send`` (it gets a
tracking number; compensation: recall the parcel). When an order compensates past
``ship_all``, its completed boxes are compensated first, the last one shipped first, each
once, then ``ship_all``'s own compensation, then ``reserve``'s: the summary checks it. A box
whose ``send`` ran while a sibling's failure stopped the spawn is cancelled with that step
running: its outcome is discarded and its own ``recall`` never runs (SPEC: a cancelled step's
changes are discarded), so ``ship_all``'s compensation recalls, by the carrier's record,
whatever the order still has out, before calling the shipment off.

At the end, a summary and an audit: every completed order has all its boxes shipped and none
recalled; every failed order has every box it shipped recalled, exactly once, in the reverse
order of shipping, before its shipment was called off; no box ran more than ``--max-running``
at once for its order. The exit code is 1 if the audit fails.

``--db PATH`` keeps the store (``python -m ferry.flow PATH list`` shows the orders and their
boxes); without it the store is a file in a temporary directory, removed at the end.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

if not __package__:  # run as a script: make `ferry` and `examples` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import _cli
from ferry import flow


class Shop:
    """What the flows did, in order (the audit reads it); in memory, for the example."""

    def __init__(self, fail: float, seed: int) -> None:
        self.fail = fail
        self.seed = seed
        self.log: list[tuple[str, str, str]] = []  # (what, order, box)
        self.active: dict[str, int] = defaultdict(int)
        self.most: dict[str, int] = defaultdict(int)

    def lost(self, what: str) -> bool:
        """Does the carrier lose this box (or refuse this invoice)? Fixed by the seed."""
        return random.Random(f"{self.seed}:{what}").random() < self.fail


def plans(shop: Shop) -> tuple[flow.Plan, flow.Plan]:
    box = flow.Plan("box")

    async def unpack(ctx: flow.Context) -> None:
        shop.log.append(("unpack", *_order_and_box(ctx.flow_id)))

    async def recall(ctx: flow.Context) -> None:
        shop.log.append(("recall", *_order_and_box(ctx.flow_id)))

    @box.step(compensate=unpack)
    async def pack(ctx: flow.Context) -> None:
        order, _box = _order_and_box(ctx.flow_id)
        shop.active[order] += 1
        shop.most[order] = max(shop.most[order], shop.active[order])
        await trio.sleep(0.001)  # the packing bench
        shop.active[order] -= 1

    @box.step(compensate=recall)
    async def send(ctx: flow.Context) -> flow.Outcome | None:
        order, name = _order_and_box(ctx.flow_id)
        if shop.lost(ctx.flow_id):
            return flow.fail(f"the carrier lost {name}")
        ctx.data["tracking"] = f"T-{order}-{name}"
        shop.log.append(("sent", order, name))
        return None

    order = flow.Plan("order")

    async def release(ctx: flow.Context) -> None:
        shop.log.append(("release", ctx.flow_id, ""))

    async def call_off(ctx: flow.Context) -> None:
        # A box whose `send` ran while a sibling's failure stopped the spawn was cancelled with
        # that step running: its outcome is discarded and `recall` does not run for it (SPEC:
        # a cancelled step's changes are discarded). So the order's own compensation recalls
        # what the carrier still has out for it, by the carrier's record, before calling off.
        order = ctx.flow_id
        out = [b for what, o, b in shop.log if what == "sent" and o == order]
        for what, o, b in shop.log:
            if what in ("recall", "recall_late") and o == order and b in out:
                out.remove(b)
        for b in out:
            shop.log.append(("recall_late", order, b))
        shop.log.append(("call_off", order, ""))

    @order.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        shop.log.append(("reserve", ctx.flow_id, ""))

    @order.step(compensate=call_off)
    async def ship_all(ctx: flow.Context) -> flow.Outcome:
        boxes = [flow.Child(box, key=f"box-{i}", data={"n": i}) for i in range(ctx.data["boxes"])]
        return flow.spawn(boxes, max_running=ctx.data["max_running"])

    @order.step
    async def invoice(ctx: flow.Context) -> flow.Outcome | None:
        ctx.data["billed"] = [c.data["tracking"] for c in ctx.children.values()]
        if shop.lost(f"{ctx.flow_id}/invoice"):
            return flow.fail("the invoice was refused")
        return None

    return order, box


def _order_and_box(flow_id: str) -> tuple[str, str]:
    order, _index, name = flow_id.rsplit("/", 2)
    return order, name


def audit(shop: Shop, ends: dict[str, flow.Snapshot], max_running: int) -> list[str]:
    """What the summary promises, checked against what the flows did."""
    problems = []
    for order, snap in ends.items():
        sent = [b for what, o, b in shop.log if what == "sent" and o == order]
        recalled = [b for what, o, b in shop.log if what == "recall" and o == order]
        if shop.most[order] > max_running:
            problems.append(f"{order}: {shop.most[order]} boxes at once")
        if snap.state is flow.State.COMPLETED:
            if recalled or len(sent) != len(snap.data["billed"]):
                problems.append(f"{order}: completed with {sent} sent, {recalled} recalled")
            continue
        late = [b for what, o, b in shop.log if what == "recall_late" and o == order]
        if recalled != [b for b in sent[::-1] if b not in late] or sorted(
            recalled + late
        ) != sorted(sent):
            problems.append(f"{order}: sent {sent} but recalled {recalled} (late: {late})")
        kinds = [
            "recall" if what == "recall_late" else what for what, o, _b in shop.log if o == order
        ]
        if "call_off" in kinds and "recall" in kinds:
            last_recall = len(kinds) - 1 - kinds[::-1].index("recall")
            if kinds.index("call_off") < last_recall:
                problems.append(f"{order}: called off before its boxes were recalled")
    return problems


async def run_orders(path: str, args: Any) -> dict[str, Any]:
    shop = Shop(args.fail, args.seed)
    order, box = plans(shop)
    ends: dict[str, flow.Snapshot] = {}
    async with flow.open_engine(path, plans=[order, box]) as engine:
        data = {"boxes": args.boxes, "max_running": args.max_running}
        run = uuid.uuid4().hex[:8]  # a run's own ids: a kept --db may hold an earlier run's
        ids = [f"{run}-order-{i}" for i in range(args.orders)]
        for fid in ids:
            await engine.start(order, flow_id=fid, data=data)
        for fid in ids:
            ends[fid] = await engine.wait(fid, timeout=60)
        stats = engine.statistics()
        # A parcel recalled late must be one whose `send` never completed durably (else its
        # own compensation should have recalled it): the box's history says which.
        unsent = []
        for what, order_id, name in shop.log:
            if what == "recall_late":
                events = await engine.history(f"{order_id}/1/{name}")
                if any(e.kind == "step" and e.step == "send" for e in events):
                    unsent.append(f"{order_id}/1/{name}: send completed, yet recalled late")
    problems = audit(shop, ends, args.max_running) + unsent
    states = [s.state.name for s in ends.values()]
    return {
        "orders": {"started": len(ends), **{s: states.count(s) for s in sorted(set(states))}},
        "boxes_sent": sum(1 for e in shop.log if e[0] == "sent"),
        "boxes_recalled": sum(1 for e in shop.log if e[0] in ("recall", "recall_late")),
        "most_boxes_at_once": max(shop.most.values(), default=0),
        "steps_run": stats.steps_run,
        "audit": {"ok": not problems, "problems": problems},
    }


def build_parser() -> _cli.ArgumentParser:
    parser = _cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--orders", type=_cli.integer(1, 10_000), default=12, metavar="N", help="orders to run"
    )
    parser.add_argument(
        "--boxes",
        type=_cli.integer(1, 1000),
        default=5,
        metavar="N",
        help="boxes (child flows) per order",
    )
    parser.add_argument(
        "--max-running",
        type=_cli.integer(1, 1000),
        default=2,
        metavar="N",
        help="boxes of one order active at once",
    )
    parser.add_argument(
        "--fail",
        type=_cli.number(0.0, 1.0),
        default=0.1,
        metavar="FRACTION",
        help="share of boxes lost and of invoices refused",
    )
    _cli.add_seed(parser, 1)
    parser.add_argument(
        "--db",
        type=_cli.new_file,
        default=None,
        metavar="PATH",
        help="keep the store in this SQLite file (default: a temporary file)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with _cli.ctrl_c("boxes.py"), tempfile.TemporaryDirectory() as tmp:
        path = args.db or str(Path(tmp) / "boxes.db")
        report = _cli.run(run_orders, path, args)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key.replace('_', ' '):<20}{value}")
        print(f"{'audit':<20}{'OK' if report['audit']['ok'] else 'FAILED'}")
    return 0 if report["audit"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
