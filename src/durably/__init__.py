"""durably: durable execution for Python.

Write a workflow as an ordinary ``async def``; every step's result is
checkpointed, so a run survives crashes and deploys and never redoes finished
work. Start here: :class:`Engine` and :class:`WorkflowContext`.
"""

from __future__ import annotations

from .client import Client, SyncClient, SyncRunHandle
from .context import ChildCall, Settled, WorkflowContext
from .durations import Duration
from .engine import Engine, RunNotFound
from .errors import (
    ChildFailed,
    DurablyError,
    EventTimeout,
    FatalError,
    GatherFailed,
    NondeterminismError,
    RunCancelled,
    RunFailed,
    SchemaValidationError,
    SignalTimeout,
    StepFailed,
    WorkflowNotRegistered,
    WrongEventLoop,
    is_control_flow,
)
from .handle import RunHandle
from .model import Checkpoint, CheckpointStatus, Run, RunResult, RunStatus
from .retry import RetryPolicy
from .schedules import Schedule, ScheduleNotFound
from .steps import StepLogger, StepRef
from .stores import RunPage
from .transports import Transport, TransportError

__all__ = [
    "Checkpoint",
    "CheckpointStatus",
    "ChildCall",
    "ChildFailed",
    "Client",
    "DurablyError",
    "Duration",
    "Engine",
    "EventTimeout",
    "FatalError",
    "GatherFailed",
    "NondeterminismError",
    "RetryPolicy",
    "Run",
    "RunCancelled",
    "RunFailed",
    "RunHandle",
    "RunNotFound",
    "RunPage",
    "RunResult",
    "RunStatus",
    "Schedule",
    "ScheduleNotFound",
    "SchemaValidationError",
    "Settled",
    "SignalTimeout",
    "StepFailed",
    "StepLogger",
    "StepRef",
    "SyncClient",
    "SyncRunHandle",
    "Transport",
    "TransportError",
    "WorkflowContext",
    "WorkflowNotRegistered",
    "WrongEventLoop",
    "is_control_flow",
]

__version__ = "0.1.0"
