"""Schedules: window arithmetic (cron with time zones and DST, intervals) and
firing through the engine, driven by a virtual clock on every store."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably.schedules import ScheduleSpec, window_run_id
from durably.testing import VirtualClock

from .conftest import EngineFactory

HOUR = 3_600_000
PARIS = "Europe/Paris"


def ms(*args: int, tz: str = "UTC") -> int:
    """Epoch ms of a wall-clock time in ``tz`` (``fold=0`` for repeated times)."""
    from zoneinfo import ZoneInfo

    return int(datetime(*args, tzinfo=ZoneInfo(tz)).timestamp() * 1000)


def utc(moment: int) -> str:
    return datetime.fromtimestamp(moment / 1000, UTC).strftime("%m-%d %H:%M")


def cron(expression: str, tz: str = "UTC") -> ScheduleSpec:
    return ScheduleSpec.build("wf", cron=expression, tz=tz)


# -- window arithmetic ----------------------------------------------------------------------


def test_interval_windows_are_multiples_of_the_interval() -> None:
    spec = ScheduleSpec.build("wf", every="15m")
    base = ms(2027, 1, 15, 8, 0)

    assert spec.next_after(base) == base + 15 * 60_000
    assert spec.next_after(base - 1) == base
    assert spec.latest_at(base) == base
    assert spec.latest_at(base + 14 * 60_000) == base
    assert spec.windows(base, base + HOUR) == [base + i * 15 * 60_000 for i in range(1, 5)]


def test_cron_windows_follow_the_time_zone() -> None:
    spec = cron("0 9 * * 1-5", PARIS)  # 09:00 Paris on weekdays
    friday = ms(2027, 1, 15, 12, 0)

    assert utc(spec.next_after(friday) or 0) == "01-18 08:00"  # Monday, UTC+1 in winter
    assert utc(spec.latest_at(friday) or 0) == "01-15 08:00"
    summer = ms(2027, 7, 1, 12, 0)
    assert utc(spec.next_after(summer) or 0) == "07-02 07:00"  # UTC+2 in summer


def test_hourly_cron_fires_every_real_hour_across_both_dst_changes() -> None:
    spring = cron("0 * * * *", PARIS)
    start = ms(2024, 3, 31, 0, 30, tz=PARIS)
    # 02:00 does not exist that night: one window fewer, still one per real hour
    assert [utc(w) for w in spring.windows(start, start + 4 * HOUR)] == [
        "03-31 00:00",
        "03-31 01:00",
        "03-31 02:00",
        "03-31 03:00",
    ]
    autumn = cron("0 * * * *", PARIS)
    start = ms(2024, 10, 27, 0, 30, tz=PARIS)
    # 02:00 happens twice: both fire, an hour apart
    assert [utc(w) for w in autumn.windows(start, start + 4 * HOUR)] == [
        "10-26 23:00",
        "10-27 00:00",
        "10-27 01:00",
        "10-27 02:00",
    ]


def test_daily_cron_in_a_skipped_hour_fires_once_after_the_gap() -> None:
    spec = cron("30 2 * * *", PARIS)
    start = ms(2024, 3, 29, 12, 0)

    windows = spec.windows(start, start + 3 * 24 * HOUR)

    # 30 March 02:30 CET, 31 March (02:30 does not exist) at 03:00 CEST, 1 April 02:30 CEST
    assert [utc(w) for w in windows] == ["03-30 01:30", "03-31 01:00", "04-01 00:30"]


def test_daily_cron_in_a_repeated_hour_fires_once() -> None:
    spec = cron("30 2 * * *", PARIS)
    start = ms(2024, 10, 26, 12, 0)

    windows = spec.windows(start, start + 3 * 24 * HOUR)

    assert [utc(w) for w in windows] == ["10-27 00:30", "10-28 01:30", "10-29 01:30"]
    # from inside the repeated hour, the last window is the first 02:30
    inside = ms(2024, 10, 27, 1, 45)  # 02:45 CET, the second time round
    assert utc(spec.latest_at(inside) or 0) == "10-27 00:30"
    assert utc(spec.next_after(inside) or 0) == "10-28 01:30"


def test_latest_and_next_windows_agree_around_dst_changes() -> None:
    specs = [
        cron("0 * * * *", PARIS),
        cron("*/20 * * * *", PARIS),
        cron("30 2 * * *", PARIS),
        cron("15 1-3 * * *", PARIS),
        cron("0 2 * * *", "America/New_York"),
        ScheduleSpec.build("wf", every="45m"),
    ]
    for day in ((2024, 3, 30), (2024, 10, 26), (2024, 3, 9), (2024, 11, 2)):
        begin = ms(*day, 12, 0)
        for spec in specs:
            windows = spec.windows(begin - 2 * 24 * HOUR, begin + 2 * 24 * HOUR)
            assert windows == sorted(set(windows))
            for at in range(begin, begin + 24 * HOUR, 13 * 60_000):
                latest = spec.latest_at(at)
                assert latest is not None and latest <= at
                assert latest in windows
                following = spec.next_after(at)
                assert following is not None and following > at
                assert spec.next_after(latest) == following


def _windows_minute_by_minute(expression: str, tz: str, start: int, end: int) -> list[int]:
    """The documented DST rules applied to every whole minute in ``(start, end]``."""
    from zoneinfo import ZoneInfo

    from croniter import croniter

    zone = ZoneInfo(tz)
    hourly = croniter(expression).expanded[1] == ["*"]

    def wall(at: int) -> datetime:
        return datetime.fromtimestamp(at / 1000, zone).replace(tzinfo=None)

    found: list[int] = []
    for at in range(start - start % 60_000 + 60_000, end + 1, 60_000):
        local = datetime.fromtimestamp(at / 1000, zone)
        before = wall(at - 60_000)
        if croniter.match(expression, wall(at)):
            if hourly or not local.fold:  # a repeated wall time: the first occurrence only
                found.append(at)
        elif not hourly and wall(at) - before > timedelta(minutes=1):
            # the clocks jumped forward: a skipped wall time fires at the jump
            skipped = before + timedelta(minutes=1)
            while skipped < wall(at) and not croniter.match(expression, skipped):
                skipped += timedelta(minutes=1)
            if skipped < wall(at):
                found.append(at)
    return found


@pytest.mark.parametrize(
    ("expression", "tz", "day"),
    [
        (expression, tz, day)
        for expression in ("*/20 * * * *", "30 2 * * *", "0,45 1,2 * * *")
        for tz, day in (
            ("America/New_York", (2024, 3, 10)),
            ("America/New_York", (2024, 11, 3)),
            ("Australia/Lord_Howe", (2024, 4, 7)),  # half-hour DST
            ("Australia/Lord_Howe", (2024, 10, 6)),
        )
    ],
)
def test_cron_windows_match_a_minute_by_minute_reading_of_the_dst_rules(
    expression: str, tz: str, day: tuple[int, int, int]
) -> None:
    spec = cron(expression, tz)
    start, end = ms(*day, 0, 0, tz=tz) - 6 * HOUR, ms(*day, 0, 0, tz=tz) + 30 * HOUR

    expected = _windows_minute_by_minute(expression, tz, start - 24 * HOUR, end + 24 * HOUR)

    assert spec.windows(start, end) == [w for w in expected if start < w <= end]
    for at in range(start, end, 37 * 60_000):
        assert spec.next_after(at) == next(w for w in expected if w > at)
        assert spec.latest_at(at) == max(w for w in expected if w <= at)


def test_a_cron_that_never_fires_has_no_window() -> None:
    spec = cron("0 0 30 2 *")  # 30 February
    assert spec.next_after(ms(2027, 1, 1, 0, 0)) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "exactly one of"),
        ({"cron": "* * * * *", "every": "1m"}, "exactly one of"),
        ({"cron": "not cron"}, "invalid cron"),
        ({"cron": "* * * * * *"}, "invalid cron"),
        ({"cron": "0 * * * *", "tz": "Mars/Olympus"}, "unknown time zone"),
        ({"every": "1h", "tz": PARIS}, "tz= applies to cron"),
        ({"every": "500ms"}, "at least 1s"),
        ({"every": "soon"}, "invalid every"),
        ({"every": "1h", "overlap": "queue"}, "overlap must be"),
    ],
)
def test_invalid_schedules_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScheduleSpec.build("wf", **options)


def test_cron_aliases() -> None:
    assert cron("@hourly").next_after(ms(2027, 1, 1, 0, 30)) == ms(2027, 1, 1, 1, 0)
    assert cron("@DAILY").cron == "@daily"


# -- firing through the engine --------------------------------------------------------------


def _engine(make_engine: EngineFactory, clock: VirtualClock, **options: Any) -> durably.Engine:
    engine = make_engine(clock=clock, **options)

    @engine.workflow("job")
    async def job(ctx: durably.WorkflowContext, data: Any = None) -> Any:
        return data

    @engine.workflow("long")
    async def long(ctx: durably.WorkflowContext) -> str:
        return str(await ctx.wait_for_signal(f"done:{ctx.run_id}"))

    return engine


async def _scheduled_runs(engine: durably.Engine, name: str) -> list[str]:
    page = await engine.list_runs(tag=f"schedule:{name}", limit=1000)
    return sorted(r.run_id for r in page.runs)


async def test_an_interval_schedule_fires_each_window_once(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = _engine(make_engine, clock)
    engine.schedule("tick", "job", every="15m", input={"n": 1})
    start = clock.now_ms()
    await engine.open()

    assert await engine.fire_schedules() == 0
    (info,) = await engine.list_schedules()
    assert (info.name, info.workflow, info.every_ms, info.next_fire_at) == (
        "tick",
        "job",
        15 * 60_000,
        start + 15 * 60_000,
    )
    clock.advance("15m")
    assert await engine.fire_schedules() == 1
    assert await engine.fire_schedules() == 0
    await engine.join()  # the run completes (a live one would make the next window skip)
    clock.advance("14m")
    assert await engine.fire_schedules() == 0
    clock.advance("1m")
    assert await engine.fire_schedules() == 1

    first = window_run_id("tick", start + 15 * 60_000)
    assert await _scheduled_runs(engine, "tick") == [
        first,
        window_run_id("tick", start + HOUR // 2),
    ]
    result = await engine.wait_for_run(first, terminal=True, timeout=10)
    assert result.output == {"n": 1}
    (info,) = await engine.list_schedules()
    assert (info.last_fired_at, info.last_run_id, info.next_fire_at) == (
        start + 30 * 60_000,
        window_run_id("tick", start + 30 * 60_000),
        start + 45 * 60_000,
    )


async def test_a_cron_schedule_fires_in_its_time_zone(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = _engine(make_engine, clock)
    engine.schedule("morning", "job", cron="0 9 * * *", tz=PARIS)
    await engine.open()  # the clock starts at 2027-01-15 08:00 UTC, 09:00 in Paris

    (info,) = await engine.list_schedules()
    assert (info.cron, info.tz) == ("0 9 * * *", PARIS)
    assert info.next_fire_at == ms(2027, 1, 16, 8, 0)
    clock.advance("23h59m")
    assert await engine.fire_schedules() == 0
    clock.advance("1m")
    assert await engine.fire_schedules() == 1
    assert await _scheduled_runs(engine, "morning") == [
        window_run_id("morning", ms(2027, 1, 16, 8, 0))
    ]


@pytest.mark.parametrize(
    ("start", "expected"),
    [
        ((2024, 3, 30, 12, 0), ["03-31 01:00"]),  # 02:30 is skipped: fires at 03:00 CEST
        ((2024, 10, 26, 12, 0), ["10-27 00:30"]),  # 02:30 happens twice: fires once
    ],
)
async def test_a_daily_cron_fires_once_on_a_dst_day(
    make_engine: EngineFactory, start: tuple[int, ...], expected: list[str]
) -> None:
    clock = VirtualClock(datetime(*start, tzinfo=UTC))
    engine = _engine(make_engine, clock)
    engine.schedule("nightly", "job", cron="30 2 * * *", tz=PARIS)
    await engine.open()

    for _ in range(2 * 20):  # through the night, a pass every 30 minutes
        clock.advance("30m")
        await engine.fire_schedules()

    fired = [int(r.rsplit(":", 1)[1]) for r in await _scheduled_runs(engine, "nightly")]
    assert [utc(w) for w in sorted(fired)] == expected


async def test_two_engines_on_one_store_never_fire_a_window_twice(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engines = [_engine(make_engine, clock) for _ in range(3)]
    for engine in engines:
        engine.schedule("shared", "job", every="1m", overlap="allow")
        await engine.open()

    for round_number in range(1, 6):
        clock.advance("1m")
        fired = await asyncio.gather(*(e.fire_schedules() for e in engines))
        assert sum(fired) >= 1
        assert len(await _scheduled_runs(engines[0], "shared")) == round_number
    # and catching up after downtime, racing, still one run per window
    for engine in engines:
        engine.schedule("backlog", "job", every="1m", overlap="allow", catchup=True)
        await engine.fire_schedules()
    clock.advance("10m")
    await asyncio.gather(*(e.fire_schedules() for e in engines))

    assert len(await _scheduled_runs(engines[0], "shared")) == 6
    assert len(await _scheduled_runs(engines[0], "backlog")) == 10


async def test_overlap_skip_skips_windows_while_the_previous_run_is_live(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = _engine(make_engine, clock)
    engine.schedule("slow", "long", every="1h")
    start = clock.now_ms()
    await engine.open()

    clock.advance("1h")
    assert await engine.fire_schedules() == 1
    first = window_run_id("slow", start + HOUR)
    assert (await engine.wait_for_run(first, timeout=10)).status is RunStatus.SUSPENDED
    clock.advance("1h")
    assert await engine.fire_schedules() == 0  # the 2h window is skipped
    (info,) = await engine.list_schedules()
    assert (info.last_run_id, info.next_fire_at) == (first, start + 3 * HOUR)

    await engine.signal(f"done:{first}", "ok")
    assert (await engine.wait_for_run(first, terminal=True, timeout=10)).output == "ok"
    clock.advance("1h")
    assert await engine.fire_schedules() == 1
    assert await _scheduled_runs(engine, "slow") == [first, window_run_id("slow", start + 3 * HOUR)]


async def test_overlap_allow_and_cancel_previous(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = _engine(make_engine, clock)
    engine.schedule("both", "long", every="1h", overlap="allow")
    engine.schedule("latest", "long", every="1h", overlap="cancel_previous")
    start = clock.now_ms()
    await engine.open()

    for _ in range(2):
        clock.advance("1h")
        assert await engine.fire_schedules() == 2
        await engine.join()

    both = await _scheduled_runs(engine, "both")
    assert len(both) == 2
    for run_id in both:
        assert (await engine.get_run(run_id)).status is RunStatus.SUSPENDED  # type: ignore[union-attr]
    old, new = window_run_id("latest", start + HOUR), window_run_id("latest", start + 2 * HOUR)
    assert (await engine.get_run(old)).status is RunStatus.CANCELLED  # type: ignore[union-attr]
    assert (await engine.get_run(new)).status is RunStatus.SUSPENDED  # type: ignore[union-attr]


async def test_only_the_latest_missed_window_fires_after_downtime(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = _engine(make_engine, clock)
    engine.schedule("hourly", "job", every="1h")
    engine.schedule("backfill", "job", every="1h", catchup=True, overlap="allow")
    start = clock.now_ms()
    await engine.open()

    clock.advance("5h30m")
    assert await engine.fire_schedules() == 1 + 5
    assert await engine.fire_schedules() == 0

    assert await _scheduled_runs(engine, "hourly") == [window_run_id("hourly", start + 5 * HOUR)]
    assert await _scheduled_runs(engine, "backfill") == sorted(
        window_run_id("backfill", start + i * HOUR) for i in range(1, 6)
    )
    for info in await engine.list_schedules():
        assert info.next_fire_at == start + 6 * HOUR


async def test_pause_and_resume_persist_and_skip_the_paused_windows(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = _engine(make_engine, clock)
    engine.schedule("report", "job", every="1h")
    start = clock.now_ms()
    await engine.open()

    paused = await engine.pause_schedule("report")
    assert paused.paused
    clock.advance("3h")
    assert await engine.fire_schedules() == 0

    # another engine (a restart, or another instance) sees the pause
    other = _engine(make_engine, clock)
    other.schedule("report", "job", every="1h")
    assert [s.paused for s in await other.list_schedules()] == [True]
    assert await other.fire_schedules() == 0

    clock.advance("10m")
    resumed = await other.resume_schedule("report")
    assert (resumed.paused, resumed.next_fire_at) == (False, start + 4 * HOUR)
    assert await engine.fire_schedules() == 0  # the windows missed while paused are not fired
    clock.advance("50m")
    assert await engine.fire_schedules() == 1
    assert await _scheduled_runs(engine, "report") == [window_run_id("report", start + 4 * HOUR)]

    with pytest.raises(durably.ScheduleNotFound):
        await engine.pause_schedule("nope")
    with pytest.raises(durably.ScheduleNotFound):
        await engine.resume_schedule("nope")


async def test_trigger_starts_a_run_now_even_when_paused(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = _engine(make_engine, clock)
    engine.schedule("report", "job", every="1d", input=[1, 2], paused=True)
    await engine.open()

    run_id = await engine.trigger_schedule("report")

    assert run_id == f"sched:report:manual:{clock.now_ms()}"
    assert (await engine.wait_for_run(run_id, terminal=True, timeout=10)).output == [1, 2]
    (info,) = await engine.list_schedules()
    assert (info.paused, info.last_run_id) == (True, run_id)
    with pytest.raises(durably.ScheduleNotFound):
        await engine.trigger_schedule("nope")


async def test_a_trigger_from_an_engine_without_the_workflow_is_queued(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    worker = _engine(make_engine, clock)
    worker.schedule("report", "job", every="1d", input="x")
    await worker.open()
    client = make_engine(clock=clock, drive=False)  # like the CLI: no workflows registered

    run_id = await client.trigger_schedule("report")

    assert await client.get_run(run_id) is None
    with pytest.raises(durably.DurablyError, match="already has a start queued"):
        await client.trigger_schedule("report")
    assert await worker.fire_schedules() == 1
    assert (await worker.wait_for_run(run_id, terminal=True, timeout=10)).output == "x"
    assert await worker.fire_schedules() == 0
    clock.advance("1ms")
    assert (await client.trigger_schedule("report")) != run_id  # the slot is free again


async def test_runtime_schedules_are_shared_and_removable(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    admin = _engine(make_engine, clock, drive=False)
    worker = _engine(make_engine, clock)
    start = clock.now_ms()

    added = await admin.add_schedule("adhoc", "job", every="30m", input={"a": 1})

    assert (added.source, added.next_fire_at, added.paused) == ("runtime", start + HOUR // 2, False)
    assert [s.name for s in await worker.list_schedules()] == ["adhoc"]
    clock.advance("30m")
    assert await worker.fire_schedules() == 1
    # adding it again with another spec replaces it
    replaced = await admin.add_schedule("adhoc", "job", cron="0 * * * *", paused=True)
    assert (replaced.cron, replaced.every_ms, replaced.paused) == ("0 * * * *", None, True)
    assert replaced.last_run_id == window_run_id("adhoc", start + HOUR // 2)
    assert await admin.remove_schedule("adhoc") is True
    assert await admin.remove_schedule("adhoc") is False
    assert await worker.get_schedule("adhoc") is None
    clock.advance("2h")
    assert await worker.fire_schedules() == 0

    with pytest.raises(durably.WorkflowNotRegistered):
        await admin.add_schedule("typo", "jbo", every="1h")
    with pytest.raises(durably.SchemaValidationError):
        await admin.add_schedule("bad", "long", every="1h", input={"unexpected": True})
    with pytest.raises(ValueError, match="non-empty name"):
        await admin.add_schedule(" ", "job", every="1h")


async def test_an_engine_fires_only_schedules_of_workflows_it_has(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    other_app = _engine(make_engine, clock, drive=False)

    @other_app.workflow("ghost")
    async def ghost(ctx: durably.WorkflowContext) -> None:
        return None

    for i in range(120):  # more than one pass lists: they must not crowd ours out
        await other_app.add_schedule(f"ghost-{i:03}", "ghost", every="1m")
    worker = _engine(make_engine, clock)
    worker.schedule("mine", "job", every="1h")
    await worker.open()

    clock.advance("1h")
    assert await worker.fire_schedules() == 1
    assert len(await _scheduled_runs(worker, "mine")) == 1
    assert await _scheduled_runs(worker, "ghost-000") == []


async def test_a_changed_declaration_moves_the_next_window_and_keeps_the_state(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    first = _engine(make_engine, clock)
    first.schedule("s", "job", every="1h")
    start = clock.now_ms()
    await first.open()
    await first.pause_schedule("s")

    same = _engine(make_engine, clock)
    same.schedule("s", "job", every="1h", input="new input")
    (info,) = await same.list_schedules()
    assert (info.input, info.paused, info.next_fire_at) == ("new input", True, start + HOUR)

    clock.advance("5m")
    changed = _engine(make_engine, clock)
    changed.schedule("s", "job", every="10m")
    (info,) = await changed.list_schedules()
    assert (info.every_ms, info.paused, info.next_fire_at) == (600_000, True, start + 600_000)


async def test_schedules_declared_on_the_decorator(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock)

    @engine.workflow("report", schedule="0 * * * *")
    async def report(ctx: durably.WorkflowContext) -> None:
        return None

    @engine.workflow("digest", schedule={"every": "15m", "name": "digest-15", "input": 3})
    async def digest(ctx: durably.WorkflowContext, n: int) -> int:
        return n

    schedules = {s.name: s for s in await engine.list_schedules()}
    assert set(schedules) == {"report", "digest-15"}
    assert (schedules["report"].workflow, schedules["report"].cron) == ("report", "0 * * * *")
    assert (schedules["digest-15"].workflow, schedules["digest-15"].input) == ("digest", 3)


async def test_opening_with_a_schedule_of_an_unknown_workflow_fails_loudly(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = make_engine(clock=clock)
    engine.schedule("orphan", "missing", every="1h")

    with pytest.raises(durably.WorkflowNotRegistered, match="schedule 'orphan'"):
        await engine.open()


async def test_the_worker_tick_fires_schedules(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = _engine(make_engine, clock)
    engine.schedule("tick", "job", every="1m")
    await engine.open()

    clock.advance("1m")
    await engine.tick()

    assert len(await _scheduled_runs(engine, "tick")) == 1


async def test_a_start_lost_after_its_window_was_claimed_is_repaired(
    make_engine: EngineFactory, clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(make_engine, clock)
    engine.schedule("s", "job", every="1m")
    start = clock.now_ms()
    await engine.open()
    real_start = engine.start
    failures = [RuntimeError("the process died here")]

    async def flaky_start(*args: Any, **kwargs: Any) -> durably.Run:
        if failures:
            raise failures.pop()
        return await real_start(*args, **kwargs)

    monkeypatch.setattr(engine, "start", flaky_start)
    clock.advance("1m")
    assert await engine.fire_schedules() == 0  # claimed, then the start failed
    (info,) = await engine.list_schedules()
    assert info.next_fire_at == start + 2 * 60_000  # the window is taken…
    assert await _scheduled_runs(engine, "s") == []

    assert await engine.fire_schedules() == 1  # …and its start is repaired on the next pass
    assert await _scheduled_runs(engine, "s") == [window_run_id("s", start + 60_000)]
    assert await engine.fire_schedules() == 0


async def test_the_worker_loop_fires_schedules_in_real_time(make_engine: EngineFactory) -> None:
    engine = make_engine(poll_interval=0.02)
    runs: list[str] = []
    fired = asyncio.Event()

    @engine.workflow("beat")
    async def beat(ctx: durably.WorkflowContext) -> None:
        runs.append(ctx.run_id)
        fired.set()

    engine.schedule("beat", "beat", every="1s")
    async with engine:
        await asyncio.wait_for(fired.wait(), 10)
    assert runs[0].startswith("sched:beat:")
    assert int(runs[0].rsplit(":", 1)[1]) % 1000 == 0


def test_window_run_ids_are_deterministic() -> None:
    when = datetime(2027, 1, 1, tzinfo=UTC) + timedelta(hours=1)
    assert window_run_id("n", int(when.timestamp() * 1000)) == "sched:n:1798765200000"


async def test_max_catchup_fires_only_the_latest_missed_windows(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    engine = _engine(make_engine, clock)
    engine.schedule("bounded", "job", every="1m", overlap="allow", catchup=True, max_catchup=3)
    start = clock.now_ms()
    await engine.open()
    assert await engine.fire_schedules() == 0
    clock.advance("10m")  # ten windows missed

    assert await engine.fire_schedules() == 3
    fired = await _scheduled_runs(engine, "bounded")
    assert fired == sorted(window_run_id("bounded", start + m * 60_000) for m in (8, 9, 10))
    (info,) = await engine.list_schedules()
    assert info.next_fire_at == start + 11 * 60_000
    clock.advance("1m")
    assert await engine.fire_schedules() == 1


async def test_jitter_delays_each_window_by_a_fixed_amount(
    make_engine: EngineFactory, clock: VirtualClock
) -> None:
    first, second = _engine(make_engine, clock), _engine(make_engine, clock)
    for engine in (first, second):
        engine.schedule("spread", "job", every="1h", jitter="10m")
        await engine.open()
    start = clock.now_ms()
    clock.advance("1h")
    await asyncio.gather(first.fire_schedules(), second.fire_schedules())

    run_id = window_run_id("spread", start + HOUR)
    spec = ScheduleSpec.build("job", every="1h", jitter="10m")
    delay = spec.jitter_of(run_id)
    assert 0 <= delay < 600_000
    assert delay == spec.jitter_of(run_id)  # the same on every instance, every retry
    run = await first.get_run(run_id)
    assert run is not None and run.status is RunStatus.SUSPENDED
    assert run.wake_at == start + HOUR + delay
    assert await _scheduled_runs(first, "spread") == [run_id]

    clock.advance(delay / 1000 + 0.001)
    assert await first.resume_due_timers() == 1
    assert (await first.wait_for_run(run_id, terminal=True, timeout=10)).status is (
        RunStatus.COMPLETED
    )


def test_bad_catchup_and_jitter_options_are_refused() -> None:
    with pytest.raises(ValueError, match="max_catchup bounds catchup"):
        ScheduleSpec.build("job", every="1m", max_catchup=3)
    with pytest.raises(ValueError, match="max_catchup must be"):
        ScheduleSpec.build("job", every="1m", catchup=True, max_catchup=0)
    with pytest.raises(ValueError, match="invalid jitter"):
        ScheduleSpec.build("job", every="1m", jitter="-1m")
