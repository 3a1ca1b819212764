"""The way an engine shares its store is one object picked once at open (`_runtime._mode`,
docs/adr/0132), built from one config record (`_runtime._config.Config`, docs/adr/0133), and
each piece of the fleet's state has one owner.

Each test here fails on the code before: there the runner, the write path, the waits, the
timers, the requests and recovery each kept a ``fleet`` flag and branched on it, `Writes` kept
the lease's epoch and released map (which the lease wrote), the runner deleted from the live
map, and the loop rounds had a retry rule of their own beside `_retry` (`_lease.transient`).
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import attrs
import pytest
import trio

from ferry import Failed, flow
from ferry.flow._fleet._mode import Fleet
from ferry.flow._runtime import _retry
from ferry.flow._runtime._mode import OneFile
from tests import switches

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "ferry/flow/_runtime"


def _plan() -> flow.Plan:
    plan = flow.Plan("p")

    @plan.step()
    async def s(ctx: flow.Context) -> None:
        pass

    return plan


async def test_an_engine_on_one_file_runs_alone_and_a_fleet_engine_shares(
    tmp_path: Path,
) -> None:
    """One object, picked once: one file's mode on SQLite, the fleet's when leases are on."""
    plan = _plan()
    async with flow.open_engine(str(tmp_path / "one.db"), [plan]) as engine:
        mode = engine._parts.mode
        assert isinstance(mode, OneFile) and not mode.shared and mode.guard is None
        fid = await engine.start(plan)
        assert (await engine.wait(fid, timeout=10)).state is flow.State.COMPLETED
    async with switches.open_engine(str(tmp_path / "fleet.db"), [plan], fleet=True) as engine:
        mode = engine._parts.mode
        assert isinstance(mode, Fleet) and mode.shared and mode.guard is not None
        fid = await engine.start(plan)
        assert (await engine.wait(fid, timeout=10)).state is flow.State.COMPLETED
        assert mode.epoch == mode.lease.epoch == 0


async def test_the_config_record_is_built_once_from_the_arguments(tmp_path: Path) -> None:
    """`open_engine`'s checked arguments are one frozen record the parts share."""
    async with switches.open_engine(
        str(tmp_path / "f.db"), [_plan()], owner="a", lease=6.0, max_running=3
    ) as engine:
        config = engine._parts._config
        assert (config.owner, config.lease, config.max_running) == ("a", 6.0, 3)
        assert config.scan_interval == 2.0 and config.fleet is False
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            config.owner = "b"  # type: ignore[misc]


def _runtime_sources() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(), str(p)) for p in sorted(RUNTIME.glob("*.py"))}


def test_no_part_of_the_runtime_keeps_a_fleet_flag() -> None:
    """No function of `_runtime/` takes a ``fleet`` parameter, and none reads ``self._fleet``:
    what differs is asked of the mode."""
    found: list[str] = []
    for name, tree in _runtime_sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args.args + node.args.kwonlyargs
                found += [f"{name}: {node.name}(fleet)" for a in args if a.arg == "fleet"]
            if isinstance(node, ast.Attribute) and node.attr == "_fleet":
                found.append(f"{name}:{node.lineno}: ._fleet")
    assert found == []


def test_the_live_map_is_changed_by_the_write_path_only() -> None:
    """Only `_writes.py` adds to or deletes from the live map (``X.live[...] = ...``, ``del
    X.live[...]``): the others call its methods (`let_go`, `drop`)."""
    found: list[str] = []
    for name, tree in _runtime_sources().items():
        if name == "_writes.py":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Delete | ast.Assign):
                continue
            for target in node.targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Attribute)
                    and target.value.attr == "live"
                ):
                    found.append(f"{name}:{node.lineno}")
    assert found == []


async def test_the_lease_owns_its_epoch_and_its_released_map(tmp_path: Path) -> None:
    """The write path reads the trust epoch (it cannot set it) and keeps no released map: a
    flow let go is the lease's to release."""
    plan = _plan()
    async with switches.open_engine(str(tmp_path / "f.db"), [plan], fleet=True) as engine:
        writes = engine._parts.writes
        mode = engine._parts.mode
        assert isinstance(mode, Fleet)
        with pytest.raises(AttributeError):
            writes.epoch = 1  # type: ignore[misc]
        assert not hasattr(writes, "released")
        mode.lease.epoch += 1  # as a renewal after a lapse does
        assert writes.epoch == 1
        mode.release_later("f", 3)
        assert mode.lease.released == {"f": 3}
        mode.given_back("f")
        assert mode.lease.released == {}


def test_a_loop_round_raises_a_bug_and_logs_the_store_failing_for_now(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One rule for loop rounds (`_retry.next_round`): a store failing for now (unavailable,
    a write the ferry could not get through, a group of those) is a WARNING naming the round
    and what comes next; anything else is raised."""
    with caplog.at_level(logging.WARNING, logger="ferry.flow"):
        _retry.next_round(Failed("the batch failed"), "scanning", then="again in 1.0 s")
        group = ExceptionGroup("two", [Failed("a"), Failed("b")])
        _retry.next_round(group, "scanning")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "scanning" in messages[0] and "again in 1.0 s" in messages[0]
    with pytest.raises(ValueError, match="a bug"):
        _retry.next_round(ValueError("a bug"), "scanning")
    with pytest.raises(ExceptionGroup):
        _retry.next_round(ExceptionGroup("mixed", [Failed("a"), KeyError("k")]), "scanning")
    with pytest.raises(trio.TooSlowError):
        _retry.next_round(trio.TooSlowError(), "scanning")
