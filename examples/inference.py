"""Micro-batching "model inference" with weights: requests for several models are batched per
model, at most one batch per model on the accelerator at a time, and a batch holds at most 512
tokens. Each request's weight is its token count, so a long prompt fills a batch by itself.

    python examples/inference.py [--requests 3000]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

if not __package__:  # run as a script: make `examples._cli` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ferry
from examples import _cli as cli


@attrs.frozen
class Prompt:
    model: str
    tokens: int
    priority: int  # lower first, within a model's lane


class FakeModels:
    """A model server: a batch costs 5 ms plus 10 us per token, whatever its size."""

    def __init__(self) -> None:
        self.batch_tokens: list[int] = []

    async def infer(self, model: str, prompts: list[Prompt]) -> list[str]:
        tokens = sum(p.tokens for p in prompts)
        self.batch_tokens.append(tokens)
        await trio.sleep(0.005 + 10e-6 * tokens)
        return [f"{model}: {p.tokens} tokens in, an answer out" for p in prompts]


async def run(requests: int, seed: int) -> None:
    rnd = random.Random(seed)
    models = FakeModels()
    outcomes: Counter[str] = Counter()
    async with ferry.open_per_key_ferry(
        models.infer,
        key=lambda p: p.model,
        weight=lambda p: p.tokens,
        rank=lambda p: p.priority,
        max_batch_weight=512,
        max_batch_delay=0.003,
        max_in_flight_batches=3,
        max_queued_weight=200_000,
    ) as infer:

        async def client(prompt: Prompt) -> None:
            await trio.sleep(rnd.random() * 0.5)  # requests arrive over half a second
            try:
                answer = await infer(prompt)
            except ferry.Rejected:
                outcomes["rejected"] += 1
            else:
                assert answer.startswith(prompt.model)
                outcomes["answered"] += 1

        async with trio.open_nursery() as nursery:
            for _ in range(requests):
                prompt = Prompt(
                    model=rnd.choice(["small", "medium", "large"]),
                    tokens=min(int(rnd.expovariate(1 / 60)) + 1, 700),
                    priority=rnd.randrange(3),
                )
                nursery.start_soon(client, prompt)
        stats = infer.statistics()
    over = sum(1 for t in models.batch_tokens if t > 512)
    print(f"requests: {dict(outcomes)}")
    print(
        f"batches: {stats.batches} batched + {stats.direct_calls} direct, "
        f"mean {stats.inputs_sent / max(stats.batches, 1):.1f} prompts per batch, "
        f"largest {max(models.batch_tokens)} tokens ({cli.plural(over, 'single prompt')} above 512)"
    )
    assert outcomes["answered"] + outcomes["rejected"] == requests


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser(__doc__)
    parser.add_argument(
        "--requests",
        metavar="N",
        type=cli.integer(1),
        default=3000,
        help="prompts sent, over half a second",
    )
    cli.add_seed(parser, 1)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cli.run(run, args.requests, args.seed)


if __name__ == "__main__":
    with cli.ctrl_c("inference.py"):
        main()
