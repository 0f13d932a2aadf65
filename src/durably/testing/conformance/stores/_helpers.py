"""What the ``StateStore`` conformance modules share: fixed times, owners and
payloads, and the builders of runs and checkpoints."""

from __future__ import annotations

from typing import Any

from durably.model import Checkpoint, CheckpointStatus, Run, RunStatus
from durably.stores import StateStore

NOW = 1_700_000_000_000  # past 2**31: times must be 64-bit everywhere
LEASE = 30_000
OWNER = "instance-a"
OTHER = "instance-b"
ERROR = {"message": "timed out", "code": "signal_timeout", "type": "SignalTimeout"}

PENDING = frozenset({RunStatus.PENDING})
RUNNING = frozenset({RunStatus.RUNNING})
SUSPENDED = frozenset({RunStatus.SUSPENDED})

NESTED: dict[str, Any] = {
    "unicode": "héllo wörld — ✓ 日本語 עברית 🎉👩‍👩‍👧",
    "escapes": 'quote " backslash \\ newline \n tab \t bell \u0007',
    "numbers": [0, -1, 2**53 + 1, 2**70, 0.1, 1e300, -2.5],
    "flags": [True, False, None],
    "deep": {"a": [{"b": [[{"c": "🎉"}]]}], "empty": {}, "none": None, "list": []},
    "ключ": "значение",
}


def make_run(run_id: str, status: RunStatus = RunStatus.PENDING, **fields: Any) -> Run:
    fields.setdefault("created_at", NOW)
    fields.setdefault("updated_at", fields["created_at"])
    fields.setdefault("workflow", "wf")
    return Run(run_id=run_id, workflow_version="1", status=status, **fields)


def make_cp(
    run_id: str, seq: int, status: CheckpointStatus = CheckpointStatus.PENDING, **fields: Any
) -> Checkpoint:
    fields.setdefault("name", f"op-{seq}")
    fields.setdefault("kind", "local")
    return Checkpoint(run_id=run_id, seq=seq, status=status, **fields)


def signal_cp(run_id: str, seq: int, token: str, **fields: Any) -> Checkpoint:
    return make_cp(run_id, seq, name=f"signal:{token}", kind="signal", started_at=NOW, **fields)


async def leased(
    store: StateStore, run_id: str, owner: str = OWNER, now: int = NOW, **fields: Any
) -> Run:
    """Create a pending run and take its lease until ``now + LEASE``."""
    await store.create_run(make_run(run_id, **fields))
    run = await lease_one(store, run_id, owner, now, now + LEASE, PENDING)
    assert run is not None
    return run


async def lease_one(
    store: StateStore,
    run_id: str,
    owner: str,
    now: int,
    lease_until: int,
    statuses: frozenset[RunStatus],
) -> Run | None:
    """Lease one run the engine's way (``start_turns`` of one id); the run, or ``None``."""
    started = await store.start_turns([run_id], owner, now, lease_until, statuses)
    return started[run_id][0] if run_id in started else None


async def status_of(store: StateStore, run_id: str) -> RunStatus:
    run = await store.get_run(run_id)
    assert run is not None
    return run.status


async def checkpoint(store: StateStore, run_id: str, seq: int) -> Checkpoint:
    return (await store.load_checkpoints(run_id))[seq]
