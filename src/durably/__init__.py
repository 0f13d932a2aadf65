"""durably: durable execution for Python.

Write a workflow as an ordinary ``async def``; every step's result is
checkpointed, so a run survives crashes and deploys and never redoes finished
work. Start here: :class:`Engine` and :class:`WorkflowContext`.
"""

from __future__ import annotations

import importlib

from ._intercept import Interceptor, StepInfo, TurnInfo
from ._lifecycle_events import EventKind, LifecycleEvent, Subscription
from ._logs import RunContextFilter
from .client import Client, SyncClient, SyncRunHandle
from .context import ChildCall, ChildHandle, Settled, Webhook, WorkflowContext
from .durations import Duration
from .engine import Engine, RunNotFound
from .errors import (
    ChildFailed,
    DurablyError,
    EntityError,
    EventTimeout,
    FatalError,
    GatherFailed,
    NondeterminismError,
    RunCancelled,
    RunFailed,
    SchemaValidationError,
    SignalTimeout,
    SingletonQueueFull,
    StepFailed,
    WorkflowNotRegistered,
    WrongEventLoop,
    is_control_flow,
)
from .handle import RunHandle
from .model import (
    BulkCancel,
    Checkpoint,
    CheckpointStatus,
    Run,
    RunResult,
    RunStatus,
    UpdateResult,
)
from .retry import RetryPolicy
from .schedules import Schedule, ScheduleNotFound
from .steps import StepLogger, StepRef
from .stores import RunPage
from .transports import Transport, TransportError

__all__ = [
    "BulkCancel",
    "Checkpoint",
    "CheckpointStatus",
    "ChildCall",
    "ChildFailed",
    "ChildHandle",
    "Client",
    "DurablyError",
    "Duration",
    "Engine",
    "EntityError",
    "EventKind",
    "EventTimeout",
    "FatalError",
    "GatherFailed",
    "Interceptor",
    "LifecycleEvent",
    "NondeterminismError",
    "RetryPolicy",
    "Run",
    "RunCancelled",
    "RunContextFilter",
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
    "SingletonQueueFull",
    "StepFailed",
    "StepInfo",
    "StepLogger",
    "StepRef",
    "Subscription",
    "SyncClient",
    "SyncRunHandle",
    "Transport",
    "TransportError",
    "TurnInfo",
    "UpdateResult",
    "Webhook",
    "WorkflowContext",
    "WorkflowNotRegistered",
    "WrongEventLoop",
    "is_control_flow",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # ``durably.dashboard`` without an import of its own, loaded on first use:
    # it needs the ``dashboard`` extra, which ``import durably`` must not.
    if name == "dashboard":
        return importlib.import_module(".dashboard", __name__)
    raise AttributeError(f"module 'durably' has no attribute {name!r}")
