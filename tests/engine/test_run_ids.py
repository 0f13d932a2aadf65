"""The run ids the engine makes: time first, then random bits (``_start.new_run_id``).

Time first is for locality only (new runs land at the right end of the indexes on the id):
ties and a clock going back must change nothing a user can see, and ids stay unguessable.
"""

from __future__ import annotations

import re

import durably
from durably._start import new_run_id
from durably.testing import VirtualClock

from .conftest import EngineFactory

HEX32 = re.compile(r"[0-9a-f]{32}")
START = 1_800_000_000_000


class RewindableClock(VirtualClock):
    """A virtual clock a test can also set back, as a fleet's clocks disagree."""

    def set(self, now_ms: int) -> None:
        """Jump to ``now_ms``, earlier or later."""
        self._now = now_ms


def test_an_id_is_32_hex_its_start_time_first() -> None:
    run_id = new_run_id(START)
    assert HEX32.fullmatch(run_id)
    assert run_id[:12] == f"{START:012x}"
    assert new_run_id(START + 1) > new_run_id(START) > new_run_id(START - 1)
    # a clock outside 48 bits of milliseconds still makes a 32-character id
    assert HEX32.fullmatch(new_run_id(-1)) and HEX32.fullmatch(new_run_id(1 << 60))


def test_ids_of_one_millisecond_differ_in_80_random_bits() -> None:
    ids = [new_run_id(START) for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    tails = [int(run_id[12:], 16) for run_id in ids]
    varied = 0
    for tail in tails:
        varied |= tail ^ tails[0]
    # every one of the 80 bits after the time takes both values: none is a counter or constant
    assert varied == (1 << 80) - 1


async def test_a_clock_going_back_or_standing_still_changes_nothing_but_id_order(
    make_engine: EngineFactory,
) -> None:
    clock = RewindableClock(START)
    engine = make_engine(clock=clock)

    @engine.workflow("echo")
    async def echo(ctx: durably.WorkflowContext, x: int) -> int:
        return x

    async with engine:
        later = await engine.start("echo", 1)
        clock.set(START - 60_000)  # another host's clock, a minute behind
        earlier = [await engine.start("echo", i) for i in (2, 3, 4)]  # three in one millisecond
        mine = await engine.start("echo", 5, run_id="order-5")  # a caller's id: any text
        outputs = [
            (await engine.wait_for_run(h.run_id, terminal=True, timeout=10)).output
            for h in [later, *earlier, mine]
        ]
        page = await engine.list_runs()
    assert outputs == [1, 2, 3, 4, 5]
    assert later.run_id[:12] == f"{START:012x}"
    assert all(h.run_id[:12] == f"{START - 60_000:012x}" for h in earlier)
    assert len({h.run_id for h in earlier}) == 3
    assert all(h.run_id < later.run_id for h in earlier)  # only where they sort moved
    # listings order by start time, not by id: the run started first is listed last
    assert page.runs[-1].run_id in {h.run_id for h in earlier} | {mine.run_id}
    assert page.runs[0].run_id == later.run_id
    assert mine.run_id == "order-5"


async def test_runs_an_event_triggers_without_an_event_id_sort_by_time(
    make_engine: EngineFactory,
) -> None:
    clock = VirtualClock(START)
    engine = make_engine(clock=clock)

    @engine.workflow("audit", on_event="order.created")
    async def audit(ctx: durably.WorkflowContext) -> str:
        return "seen"

    async with engine:
        await engine.publish_event("order.created", {"id": 1})
        page = await engine.list_runs(workflow="audit")
    (run,) = page.runs
    prefix, trigger, workflow = run.run_id.split(":")
    assert (prefix, workflow) == ("evt", "audit")
    assert HEX32.fullmatch(trigger) and trigger[:12] == f"{START:012x}"
