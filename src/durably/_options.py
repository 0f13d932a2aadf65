"""EngineOptions: the engine's constructor keywords, validated once.

``Engine(...)`` takes 25 keywords. Holding them in one frozen value means the
checks run in one place (``__post_init__``), before the engine builds
anything, and again on every ``dataclasses.replace``: an option changed after
construction (``durably worker --instance-id``, ``engine.drive = False``) is
as valid as one given to the constructor, and the collaborators, which read
the engine's current options on each use, never see a half-applied change.
:class:`Option` and :class:`SettableOption` expose fields as the engine's
attributes (``engine.lease_ms``, ``engine.poll_interval = 0.5``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, Never, Protocol, TypeVar, cast, overload

from ._names import check_name
from .durations import Duration, to_ms

if TYPE_CHECKING:
    from .clock import Clock
    from .stores import StateStore
    from .transports import Transport

__all__ = ["Consumers", "EngineOptions", "Option", "SettableOption"]

T = TypeVar("T")

Consumers = Literal["auto", "always", "never"]
"""Whether an engine serves step handlers and settles step results (see ``Engine``)."""


@dataclass(frozen=True)
class EngineOptions:
    """The keywords of :class:`durably.Engine`, checked, with their durations in ms.

    Field names and defaults are exactly the constructor's (``serve_groups``
    and ``serve_steps`` are held as frozensets); the ``*_ms`` fields and
    ``drives`` are derived from them, and recomputed by ``dataclasses.replace``.
    Raises ``ValueError`` for a bad value.
    """

    store: str | StateStore | None = None
    namespace: str | None = None
    clock: Clock | None = None
    lease: Duration = "30s"
    reconcile: Duration = "5m"
    max_recovery_attempts: int = 5
    max_concurrent_runs: int = 256
    poll_interval: float = 1.0
    timer_batch_size: int = 500
    track_start: bool = True
    drive: bool = True
    instance_id: str | None = None
    drain_timeout: float = 10.0
    step_threads: int = 32
    retention: Duration | None = None
    buffer_ttl: Duration | None = "7d"
    stalled_after: Duration = "1h"
    transport: str | Transport | None = None
    consumers: Consumers = "auto"
    step_concurrency: int = 64
    serve_groups: Collection[str] | None = None
    serve_steps: Collection[str] | None = None
    remote_redispatch: Duration | None = None
    remote_redispatch_max: int = 3
    heartbeat_persist_throttle: Duration = "10s"
    webhook_base_url: str | None = None
    publish_events: bool = False
    remote_advance_silence: Duration = "30s"
    compensation_retries: int = 2
    sticky_runs: int = 1000
    step_hold: Duration | None = "250ms"

    lease_ms: int = field(init=False)
    """How long a turn's lease lasts without renewal."""
    reconcile_ms: int = field(init=False)
    """The fallback wake of a run waiting on someone else; ``0`` disables it."""
    retention_ms: int | None = field(init=False)
    """How long terminal runs are kept; ``None``: forever."""
    buffer_ttl_ms: int | None = field(init=False)
    """How long a signal or event nobody waited for stays buffered; ``None``: forever."""
    stalled_after_ms: int = field(init=False)
    """How long a live run may make no progress before it counts as stalled."""
    redispatch_ms: int | None = field(init=False)
    """When a dispatched step's task is sent again; ``None``: never."""
    heartbeat_throttle_ms: int = field(init=False)
    """At most one persisted heartbeat per step per this window."""
    remote_silence_ms: int = field(init=False)
    """How long a remote workflow turn may go unheard before it is re-driven."""
    drives: bool = field(init=False)
    step_hold_ms: int = field(init=False)
    """The longest a turn holds in memory for a dispatched step's result
    (steps without ``timeout``) before parking; ``0``: never holds."""
    """Whether runs execute here: a pure producer (``consumers="never"``) runs none."""

    def __post_init__(self) -> None:
        derive = self._derive
        if self.namespace is not None:
            check_name(self.namespace, "namespace")
        derive("lease_ms", to_ms(self.lease, name="lease"))
        if self.lease_ms < 100:
            raise ValueError("lease must be at least 100ms")
        derive("reconcile_ms", to_ms(self.reconcile, name="reconcile"))
        if (
            self.max_recovery_attempts < 0
            or self.max_concurrent_runs < 1
            or self.timer_batch_size < 1
        ):
            raise ValueError(
                "max_recovery_attempts must be >= 0, max_concurrent_runs and timer_batch_size >= 1"
            )
        derive(
            "retention_ms",
            None if self.retention is None else to_ms(self.retention, name="retention"),
        )
        derive(
            "buffer_ttl_ms",
            None if self.buffer_ttl is None else to_ms(self.buffer_ttl, name="buffer_ttl"),
        )
        derive("stalled_after_ms", to_ms(self.stalled_after, name="stalled_after"))
        # Held as sets: each step definition's name and group is looked up in them.
        if self.serve_groups is not None:
            derive("serve_groups", frozenset(self.serve_groups))
        if self.serve_steps is not None:
            derive("serve_steps", frozenset(self.serve_steps))
        if self.consumers not in ("auto", "always", "never"):
            raise ValueError("consumers must be 'auto', 'always' or 'never'")
        if (
            isinstance(self.compensation_retries, bool)
            or not isinstance(self.compensation_retries, int)
            or not 0 <= self.compensation_retries <= 100
        ):
            raise ValueError("compensation_retries must be an int from 0 to 100")
        if isinstance(self.sticky_runs, bool) or not isinstance(self.sticky_runs, int):
            raise ValueError("sticky_runs must be an int (0 disables the cache)")
        if self.sticky_runs < 0:
            raise ValueError("sticky_runs must be >= 0 (0 disables the cache)")
        if self.step_concurrency < 1 or self.remote_redispatch_max < 0:
            raise ValueError("step_concurrency must be >= 1 and remote_redispatch_max >= 0")
        derive(
            "heartbeat_throttle_ms",
            to_ms(self.heartbeat_persist_throttle, name="heartbeat_persist_throttle"),
        )
        derive(
            "redispatch_ms",
            None
            if self.remote_redispatch is None
            else to_ms(self.remote_redispatch, name="remote_redispatch"),
        )
        derive(
            "remote_silence_ms",
            to_ms(self.remote_advance_silence, name="remote_advance_silence"),
        )
        if self.remote_silence_ms < 100:
            raise ValueError("remote_advance_silence must be at least 100ms")
        derive("drives", self.drive and self.consumers != "never")
        hold = 0 if self.step_hold is None else to_ms(self.step_hold, name="step_hold")
        # Well inside a lease: a holding turn never has to renew it for the hold.
        derive("step_hold_ms", min(hold, self.lease_ms // 4))
        if self.webhook_base_url is not None and (
            not isinstance(self.webhook_base_url, str)
            or not self.webhook_base_url.startswith(("http://", "https://"))
        ):
            raise ValueError("webhook_base_url must be an http:// or https:// URL")

    def _derive(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ sets these


class _Configurable(Protocol):
    _options: EngineOptions


class Option(Generic[T]):
    """An engine attribute that reads one field of the engine's current options."""

    def __init__(self, field: str) -> None:
        self._field = field

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Option[T]: ...
    @overload
    def __get__(self, obj: _Configurable, owner: type[Any]) -> T: ...
    def __get__(self, obj: _Configurable | None, owner: type[Any]) -> Option[T] | T:
        if obj is None:
            return self
        return cast(T, getattr(obj._options, self._field))

    def __set__(self, obj: _Configurable, value: Never) -> None:
        # Without this, an assignment would shadow the option on the instance,
        # unseen by the collaborators that read the options themselves.
        raise AttributeError(f"{self._field} is fixed when the engine is built")


class SettableOption(Option[T]):
    """An :class:`Option` that assigning replaces, validated as the constructor's
    keywords are; ``keyword`` names the field written when it differs from the
    one read (``drive`` is written, ``drives`` read)."""

    def __init__(self, field: str, *, keyword: str | None = None) -> None:
        super().__init__(field)
        self._keyword = keyword or field

    def __set__(self, obj: _Configurable, value: T) -> None:
        # Collaborators read the current options on each use, so the change
        # reaches all of them at once.
        changes: dict[str, Any] = {self._keyword: value}
        obj._options = dataclasses.replace(obj._options, **changes)
