"""What a schedule refuses at `Schedule(...)` (SPEC 5.9): a bad cron expression (wrong number of
fields, a field out of range, one that never ticks), an unknown time zone, an unknown overlap,
a negative or non-finite catchup, a bad name, data that is not a JSON object or holds
``scheduled_at``, a plan that is not a plan: a `TypeError` or `ValueError` naming the field.
And what it keeps: the definition the store will compare, equal for equal definitions, data the
caller cannot change afterwards.

The tests take the type from its module (`_store/_cron.py`); it is `flow.Schedule` too."""

from __future__ import annotations

import math

import pytest

from ferry import flow
from ferry.flow._model import _schedule
from ferry.flow._store._cron import CronRule, Schedule

report = flow.Plan("report", version=2)


@report.step
async def write(ctx: flow.Context) -> None:
    pass


def make(**kwargs: object) -> Schedule:
    args: dict[str, object] = {"cron": "0 3 * * *"}
    args.update(kwargs)
    name = args.pop("name", "nightly")
    plan = args.pop("plan", report)
    return Schedule(name, plan, **args)  # type: ignore[arg-type]


def test_a_good_definition_keeps_every_field_and_its_definition() -> None:
    s = make(timezone="Europe/Warsaw", data={"kind": "daily"}, overlap="queue", catchup=3600)
    assert (s.name, s.plan, s.cron, s.timezone, s.overlap, s.catchup) == (
        "nightly",
        report,
        "0 3 * * *",
        "Europe/Warsaw",
        "queue",
        3600.0,
    )
    assert s.data == {"kind": "daily"}
    assert s.definition() == {
        "plan": "report",
        "version": 2,
        "cron": "0 3 * * *",
        "timezone": "Europe/Warsaw",
        "data": {"kind": "daily"},
        "overlap": "queue",
        "catchup": 3600.0,
    }


def test_the_defaults_are_utc_no_data_skip_and_no_catchup() -> None:
    s = make()
    assert (s.timezone, s.data, s.overlap, s.catchup) == ("UTC", {}, "skip", 0.0)


def test_equal_definitions_are_equal_and_a_changed_one_is_not() -> None:
    assert make(data={"a": 1}) == make(data={"a": 1})
    assert hash(make()) == hash(make())
    assert make() != make(cron="0 4 * * *")
    assert make() != make(overlap="allow")
    assert make() != make(name="other")


def test_the_callers_data_changed_later_changes_nothing() -> None:
    data: dict[str, object] = {"list": [1]}
    s = make(data=data)
    data["list"] = [2]
    s.data["list"] = [3]
    assert s.data == {"list": [1]}


def test_the_cron_expression_is_kept_with_its_spaces_made_single() -> None:
    assert make(cron="  0   3 * *\t* ").cron == "0 3 * * *"


@pytest.mark.parametrize(
    ("cron", "said"),
    [
        ("* * * *", "5 fields"),
        ("* * * * * *", "5 fields"),  # seconds: not the SPEC's five fields
        ("@daily", "5 fields"),
        ("", "5 fields"),
        ("61 * * * *", "Bad minute"),
        ("* 24 * * *", "Bad hour"),
        ("* * 0 * *", "Bad day-of-month"),
        ("* * * 13 *", "Bad month"),
        ("* * * * 8", "Bad day-of-week"),
        ("*/0 * * * *", "Bad minute"),
        ("a b c d e", "Bad minute"),
        ("0 3 30 2 *", "Bad day-of-month"),  # 30 February
        ("* * */20 * 1L", "never ticks"),  # 1st or 21st that is the last Monday
    ],
)
def test_a_bad_cron_expression_is_a_value_error_naming_cron(cron: str, said: str) -> None:
    with pytest.raises(ValueError, match="cron") as caught:
        make(cron=cron)
    assert said in str(caught.value)


def test_a_cron_that_is_not_a_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="cron must be a str"):
        make(cron=None)


@pytest.mark.parametrize("zone", ["Europe/Warsav", "Mars/Olympus", "", "../etc/passwd", "/tmp"])
def test_an_unknown_timezone_is_a_value_error_naming_it(zone: str) -> None:
    with pytest.raises(ValueError, match="timezone"):
        make(timezone=zone)


@pytest.mark.parametrize("zone", ["localtime", "posixrules", "Factory"])
def test_a_zone_file_that_is_no_zone_is_refused(zone: str) -> None:
    """The host's own zone would make two engines of a fleet tick at different times."""
    with pytest.raises(ValueError, match="is no zone"):
        make(timezone=zone)


def test_a_timezone_that_is_not_a_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="timezone"):
        make(timezone=1)


@pytest.mark.parametrize("zone", ["UTC", "Etc/UTC", "Europe/Warsaw", "America/New_York"])
def test_iana_zones_are_taken(zone: str) -> None:
    assert make(timezone=zone).timezone == zone


@pytest.mark.parametrize(
    ("overlap", "error"),
    [("skipp", ValueError), ("", ValueError), ("SKIP", ValueError), (None, TypeError)],
)
def test_an_unknown_overlap_is_refused_naming_it(overlap: object, error: type) -> None:
    with pytest.raises(error, match="overlap"):
        make(overlap=overlap)


@pytest.mark.parametrize(
    ("catchup", "error"),
    [
        (-1, ValueError),
        (-0.5, ValueError),
        (math.inf, ValueError),
        (math.nan, ValueError),
        (10**400, ValueError),
        (True, TypeError),
        ("60", TypeError),
        (None, TypeError),
    ],
)
def test_a_negative_or_non_finite_catchup_is_refused_naming_it(
    catchup: object, error: type
) -> None:
    with pytest.raises(error, match="catchup"):
        make(catchup=catchup)


@pytest.mark.parametrize(
    ("name", "error", "said"),
    [
        ("", ValueError, "empty"),
        ("night\nly", ValueError, "printable"),
        ("tab\there", ValueError, "printable"),
        ("nul\x00", ValueError, "cannot be stored"),
        ("x\udc80", ValueError, "cannot be stored"),
        (" nightly", ValueError, "space"),
        ("nightly ", ValueError, "space"),
        ("a@b", ValueError, "'@'"),
        ("n" * (_schedule.MAX_NAME + 1), ValueError, "at most"),
        (None, TypeError, "str"),
        (b"nightly", TypeError, "str"),
    ],
)
def test_a_bad_name_is_refused_naming_it(name: object, error: type, said: str) -> None:
    with pytest.raises(error, match="name") as caught:
        make(name=name)
    assert said in str(caught.value)


@pytest.mark.parametrize(
    "name", ["nightly report", "payments.retry-stuck", "zamknięcie", "n" * 200]
)
def test_printable_names_are_taken(name: str) -> None:
    assert make(name=name).name == name


@pytest.mark.parametrize(
    ("data", "error", "said"),
    [
        ([1, 2], TypeError, "JSON object"),
        ("text", TypeError, "JSON object"),
        ({"when": object()}, TypeError, "JSON"),
        ({"n": math.nan}, TypeError, "JSON"),
        ({"scheduled_at": "soon"}, ValueError, "scheduled_at"),
    ],
)
def test_data_that_is_not_a_json_object_is_refused_naming_it(
    data: object, error: type, said: str
) -> None:
    with pytest.raises(error, match="data") as caught:
        make(data=data)
    assert said in str(caught.value)


def test_a_plan_that_is_not_a_plan_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="plan"):
        make(plan="report")


def test_the_tick_of_a_schedule_names_its_flow_and_sets_scheduled_at() -> None:
    s = make(data={"kind": "daily"})
    t = 1_796_176_800.0  # 2026-12-02T02:00:00Z
    assert s.tick_id(t) == "nightly@2026-12-02T02:00:00Z"
    assert s.tick_data(t) == {"kind": "daily", "scheduled_at": "2026-12-02T02:00:00Z"}
    assert s.tick_data(t + 0.75) == s.tick_data(t)  # a whole second


def test_a_cron_rule_is_refused_without_a_schedule_too() -> None:
    """The store rebuilds rules from stored definitions: the same checks hold there."""
    with pytest.raises(ValueError, match="cron"):
        CronRule("61 * * * *", _schedule.check_timezone("UTC"))


def test_the_type_is_the_public_flow_schedule() -> None:
    assert flow.Schedule is Schedule and Schedule.__module__ == "ferry.flow"
