"""The run page's model from stored rows alone: bar positions, the part of a
dispatched step before it was sent, heartbeats, parallel branches, what a
live run waits for, and lineage."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from durably.dashboard._runview import axis, lineage, timeline, waits
from durably.model import Checkpoint, CheckpointStatus, Run, RunStatus

T0 = 1_000_000


def run(status: RunStatus = RunStatus.COMPLETED, **fields: object) -> Run:
    fields.setdefault("created_at", T0)
    fields.setdefault("updated_at", T0 + 1000)
    fields.setdefault("run_id", "r")
    return Run(workflow="wf", workflow_version="1", status=status, **fields)  # type: ignore[arg-type]


def cp(seq: int, kind: str, status: CheckpointStatus, **fields: object) -> Checkpoint:
    return Checkpoint("r", seq, fields.pop("name", f"op-{seq}"), kind, status, **fields)  # type: ignore[arg-type]


def test_bars_are_placed_in_percent_of_the_runs_life() -> None:
    done = CheckpointStatus.COMPLETED
    history = [
        cp(0, "local", done, started_at=T0, finished_at=T0 + 250),
        cp(
            1,
            "step",
            done,
            started_at=T0 + 250,
            dispatched_at=T0 + 500,
            finished_at=T0 + 1000,
            attempts=2,
            last_heartbeat_at=T0 + 750,
            progress={"pct": 50},
        ),
    ]

    bars = timeline(run(), history, now=T0 + 5000)

    assert [(b.left, b.width) for b in bars] == [(0.0, 25.0), (25.0, 75.0)]
    assert bars[1].queued == 25.0  # 250 ms of its 750 before the last attempt went out
    assert bars[1].queue_ms == 250
    assert bars[1].heartbeat == 75.0
    assert bars[1].progress == {"pct": 50}
    assert bars[1].attempts == 2
    assert not any(b.parallel for b in bars)
    assert axis(run(), history, now=T0 + 5000) == [
        (0.0, 0),
        (25.0, 250),
        (50.0, 500),
        (75.0, 750),
        (100.0, 1000),
    ]


def test_overlapping_operations_are_marked_parallel_and_compensations_come_last() -> None:
    done = CheckpointStatus.COMPLETED
    history = [
        cp(-2, "compensation", done, started_at=T0 + 900, finished_at=T0 + 950),
        cp(0, "local", done, started_at=T0, finished_at=T0 + 100),
        cp(1, "local", done, started_at=T0 + 100, finished_at=T0 + 600, group="g"),
        cp(2, "local", done, started_at=T0 + 100, finished_at=T0 + 300, group="g"),
        cp(3, "local", done, started_at=T0 + 500, finished_at=T0 + 800),
    ]

    bars = timeline(run(), history, now=T0)

    assert [b.seq for b in bars] == [0, 1, 2, 3, -2]
    assert {b.seq for b in bars if b.parallel} == {1, 2, 3}


def test_a_live_runs_bars_reach_now_and_a_terminal_runs_stop_at_its_end() -> None:
    pending = [cp(0, "sleep", CheckpointStatus.PENDING, started_at=T0 + 500, wake_at=T0 + 10**9)]

    live = timeline(run(RunStatus.SUSPENDED), pending, now=T0 + 1000)
    ended = timeline(run(RunStatus.CANCELLED, updated_at=T0 + 4000), pending, now=T0 + 10**6)

    assert (live[0].left, live[0].width) == (50.0, 50.0)
    assert (ended[0].left, ended[0].width) == (12.5, 87.5)


def test_what_a_live_run_waits_for() -> None:
    pending = CheckpointStatus.PENDING
    history = [
        cp(0, "sleep", pending, name="sleep", wake_at=T0 + 60_000),
        cp(1, "signal", pending, name="signal:approve:r", wake_at=T0 + 99),
        cp(2, "event", pending, name="event:order.paid"),
        cp(3, "child", pending, name="child:wf", input={"run_id": "r/child-1", "workflow": "wf"}),
        cp(4, "step", pending, name="charge", dispatched_at=T0 + 5, queue="pay", redispatches=2),
        cp(5, "step", pending, name="ship"),
        cp(6, "local", CheckpointStatus.COMPLETED),
    ]

    found = waits(run(RunStatus.SUSPENDED), history)

    assert [(w.kind, w.what, w.due_at) for w in found] == [
        ("timer", "sleep", T0 + 60_000),
        ("signal", "approve:r", T0 + 99),
        ("event", "order.paid", None),
        ("child", "r/child-1", None),
        ("step", "charge", T0 + 5),
        ("step", "ship", None),
    ]
    assert "holding a slot in queue pay" in found[4].detail
    assert "sent again 2 times" in found[4].detail
    assert "not sent yet" in found[5].detail
    assert waits(run(RunStatus.COMPLETED), history) == []
    assert [w.kind for w in waits(run(RunStatus.PENDING), [])] == ["executor"]
    assert [w.kind for w in waits(run(RunStatus.BLOCKED), [])] == ["admission"]


def test_lineage_names_only_links_that_exist() -> None:
    link = run(run_id="job~3", output={"continued_as": "job~4"})
    retried = run(run_id="job~retry~0a1b2c3d", parent_id="p")

    assert lineage(link, {"job~2"}).previous_link == "job~2"
    assert lineage(link, set()).previous_link is None
    assert lineage(link, set()).next_link == "job~4"
    assert lineage(run(run_id="job~1"), {"job"}).previous_link == "job"
    assert lineage(retried, {"job"}).retry_of == "job"
    assert lineage(retried, set()).retry_of is None
    assert lineage(retried, set()).parent_id == "p"
    # a run that merely returns a look-alike value is no link
    assert lineage(run(RunStatus.FAILED, output={"continued_as": "x"}), set()).next_link is None
