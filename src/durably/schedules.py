"""Schedules: start a workflow on a cron expression or a fixed interval.

A schedule is a row of the ``durably_schedules`` table, shared by every engine
on the store: its spec (workflow, cron or interval, time zone, input, overlap
and catch-up policies), whether it is paused, and its next window not yet
fired. Schedules declared in code (``engine.schedule(...)`` or
``@engine.workflow(..., schedule=...)``) are upserted when the engine opens;
``engine.add_schedule`` adds one at runtime.

Each window has one deterministic run id, ``sched:<name>:<window epoch ms>``,
and a window is claimed by a compare-and-set on the row's revision before its
run is started. The claim records the run as ``firing_run_id`` until the start
is confirmed, so a crash in between is repaired by whichever instance looks
next, and the start itself is idempotent by run id: several instances ticking
the same schedule never start a window twice.

Cron expressions have five fields (minute hour day-of-month month day-of-week)
or are one of ``@hourly``, ``@daily``, ``@weekly``, ``@monthly``, ``@yearly``,
evaluated in an IANA time zone with its daylight-saving changes:

- a local time skipped when clocks go forward fires at the first valid
  instant after it (``30 2 * * *`` runs at 03:00 that day), except for
  expressions firing every hour (hour field ``*``), which simply have one
  window fewer;
- a local time repeated when clocks go back fires once (at its first
  occurrence), except for every-hour expressions, which fire in both hours.

Intervals (``every="15m"``) have windows at whole multiples of the interval
since the Unix epoch (UTC).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from . import _codec as codec
from . import _cron
from ._logs import engine_logger
from ._names import check_name as check_key
from ._start import StartRun
from .durations import Duration, to_ms
from .errors import DurablyError, SchemaValidationError, WorkflowNotRegistered
from .model import RunStatus
from .stores.base import RunStore, ScheduleRecord, ScheduleStore

if TYPE_CHECKING:
    from ._registry import Registry
    from .clock import Clock

__all__ = [
    "Overlap",
    "Schedule",
    "ScheduleNotFound",
    "ScheduleSpec",
    "Scheduler",
    "manual_run_id",
    "window_run_id",
]

_log = engine_logger("durably.schedules")

Overlap = Literal["skip", "allow", "cancel_previous"]
"""What a window does while the schedule's previous run is still live: ``skip``
it, ``allow`` both to run, or ``cancel_previous`` and start the new one."""

_OVERLAPS = ("skip", "allow", "cancel_previous")
_ALIASES = frozenset(
    {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
)
_LIVE = frozenset({RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED, RunStatus.BLOCKED})
_MIN_EVERY_MS = 1000
_MAX_WINDOWS_PER_PASS = 100
"""Catch-up windows one schedule fires per pass; the rest fire on the next passes."""
_DUE_BATCH = 100


class ScheduleNotFound(DurablyError, LookupError):
    """No schedule has the given name."""

    code = "schedule_not_found"


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What a schedule fires and when: validated, with its window arithmetic.

    Build one with :meth:`build`; exactly one of ``cron`` and ``every_ms`` is set.
    """

    workflow: str
    cron: str | None = None
    every_ms: int | None = None
    tz: str = "UTC"
    input: Any = None
    overlap: Overlap = "skip"
    catchup: bool = False
    max_catchup: int | None = None
    """With ``catchup``: fire at most this many of the latest missed windows."""
    jitter_ms: int = 0
    """Each window's run starts up to this much later (fixed per window)."""
    source: str = "code"
    """``code`` (declared in the application) or ``runtime`` (``add_schedule``)."""

    @classmethod
    def build(
        cls,
        workflow: str,
        *,
        cron: str | None = None,
        every: Duration | None = None,
        tz: str | None = None,
        input: Any = None,
        overlap: str = "skip",
        catchup: bool = False,
        max_catchup: int | None = None,
        jitter: Duration | None = None,
        source: str = "code",
    ) -> ScheduleSpec:
        """Validate the arguments of ``engine.schedule`` into a spec (``ValueError`` if wrong)."""
        if not isinstance(workflow, str) or not workflow:
            raise ValueError("a schedule needs the name of the workflow it starts")
        if (cron is None) == (every is None):
            raise ValueError("give a schedule exactly one of cron= or every=")
        every_ms: int | None = None
        if cron is not None:
            cron = _check_cron(cron)
            zone = "UTC" if tz is None else tz
            _zone(zone)
        else:
            assert every is not None
            if tz is not None:
                raise ValueError("tz= applies to cron schedules; intervals are counted in UTC")
            every_ms = to_ms(every, name="every")
            if every_ms < _MIN_EVERY_MS:
                raise ValueError("a schedule interval must be at least 1s")
            zone = "UTC"
        if overlap not in _OVERLAPS:
            raise ValueError(f"overlap must be one of {', '.join(_OVERLAPS)}; got {overlap!r}")
        if max_catchup is not None and (
            isinstance(max_catchup, bool) or not isinstance(max_catchup, int) or max_catchup < 1
        ):
            raise ValueError("max_catchup must be an int >= 1 (or None: every missed window)")
        if max_catchup is not None and not catchup:
            raise ValueError("max_catchup bounds catchup=True; without catchup one window fires")
        jitter_ms = 0 if jitter is None else to_ms(jitter, name="jitter")
        try:
            stored_input = codec.to_jsonable(input, "schedule input")
        except (TypeError, ValueError) as exc:
            raise SchemaValidationError(f"schedule input cannot be stored as JSON: {exc}") from exc
        return cls(
            workflow=workflow,
            cron=cron,
            every_ms=every_ms,
            tz=zone,
            input=stored_input,
            overlap=overlap,  # type: ignore[arg-type]
            catchup=bool(catchup),
            max_catchup=max_catchup,
            jitter_ms=jitter_ms,
            source=source,
        )

    # -- persistence ---------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The spec as stored in the ``spec`` column."""
        return {
            "workflow": self.workflow,
            "cron": self.cron,
            "every_ms": self.every_ms,
            "tz": self.tz,
            "input": self.input,
            "overlap": self.overlap,
            "catchup": self.catchup,
            "max_catchup": self.max_catchup,
            "jitter_ms": self.jitter_ms,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScheduleSpec:
        """The spec stored in a ``spec`` column."""
        return cls(
            workflow=str(data["workflow"]),
            cron=data.get("cron"),
            every_ms=data.get("every_ms"),
            tz=str(data.get("tz") or "UTC"),
            input=data.get("input"),
            overlap=data.get("overlap", "skip"),
            catchup=bool(data.get("catchup", False)),
            max_catchup=data.get("max_catchup"),
            jitter_ms=int(data.get("jitter_ms") or 0),
            source=str(data.get("source", "code")),
        )

    def same_timing(self, other: ScheduleSpec) -> bool:
        """Whether both specs have the same windows."""
        return (self.cron, self.every_ms, self.tz) == (other.cron, other.every_ms, other.tz)

    # -- windows -------------------------------------------------------------------------

    def next_after(self, after_ms: int) -> int | None:
        """The first window strictly after ``after_ms`` (``None``: it never fires again)."""
        if self.every_ms is not None:
            return (after_ms // self.every_ms + 1) * self.every_ms
        assert self.cron is not None
        return _cron.next_after(self.cron, _zone(self.tz), after_ms)

    def latest_at(self, at_ms: int) -> int | None:
        """The last window at or before ``at_ms`` (``None`` if there is none)."""
        if self.every_ms is not None:
            return at_ms - at_ms % self.every_ms
        assert self.cron is not None
        return _cron.latest_at(self.cron, _zone(self.tz), at_ms)

    def earliest_caught_up(self, at_ms: int) -> int | None:
        """The oldest of the ``max_catchup`` latest windows at or before ``at_ms``
        (``None``: no bound, or no window yet)."""
        if self.max_catchup is None:
            return None
        window = self.latest_at(at_ms)
        for _ in range(self.max_catchup - 1):
            if window is None:
                return None
            earlier = self.latest_at(window - 1)
            if earlier is None:
                return window
            window = earlier
        return window

    def jitter_of(self, run_id: str) -> int:
        """The delay (ms, below ``jitter_ms``) of the window whose run is ``run_id``:
        derived from the id, so every instance and every retry of the start agree."""
        if self.jitter_ms <= 0:
            return 0
        digest = hashlib.blake2b(run_id.encode("utf-8", "surrogatepass"), digest_size=8)
        return int.from_bytes(digest.digest(), "big") % self.jitter_ms

    def windows(self, start_ms: int, end_ms: int) -> list[int]:
        """Every window in ``(start_ms, end_ms]``, in order (for inspection and tests)."""
        found: list[int] = []
        at = start_ms
        while True:
            nxt = self.next_after(at)
            if nxt is None or nxt > end_ms:
                return found
            found.append(nxt)
            at = nxt


@dataclass(frozen=True, slots=True)
class Schedule:
    """A schedule as ``engine.list_schedules()`` shows it. Times are epoch ms."""

    name: str
    workflow: str
    cron: str | None
    every_ms: int | None
    tz: str
    input: Any
    overlap: str
    catchup: bool
    paused: bool
    next_fire_at: int | None
    """The next window that will fire (while not paused)."""
    last_fired_at: int | None
    """The window of the last run the schedule started."""
    last_run_id: str | None
    """The last run the schedule started (by a window or a trigger)."""
    source: str
    """``code`` or ``runtime``."""
    namespace: str

    @classmethod
    def from_record(cls, record: ScheduleRecord) -> Schedule:
        """The view of a stored schedule row."""
        spec = ScheduleSpec.from_json(record.spec)
        return cls(
            name=record.name,
            workflow=spec.workflow,
            cron=spec.cron,
            every_ms=spec.every_ms,
            tz=spec.tz,
            input=spec.input,
            overlap=spec.overlap,
            catchup=spec.catchup,
            paused=record.paused,
            next_fire_at=record.next_fire_at,
            last_fired_at=record.last_fired_at,
            last_run_id=record.last_run_id,
            source=spec.source,
            namespace=record.namespace,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for JSON output)."""
        return {
            "name": self.name,
            "workflow": self.workflow,
            "cron": self.cron,
            "every_ms": self.every_ms,
            "tz": self.tz,
            "input": self.input,
            "overlap": self.overlap,
            "catchup": self.catchup,
            "paused": self.paused,
            "next_fire_at": self.next_fire_at,
            "last_fired_at": self.last_fired_at,
            "last_run_id": self.last_run_id,
            "source": self.source,
            "namespace": self.namespace,
        }


def window_run_id(name: str, window_ms: int) -> str:
    """The run id of a schedule's window: ``sched:<name>:<window epoch ms>``."""
    return f"sched:{name}:{window_ms}"


def _window_of(run_id: str) -> int | None:
    """The window a ``sched:<name>:<ms>`` run id names (``None`` for a manual one)."""
    head, _, tail = run_id.rpartition(":")
    return int(tail) if head.startswith("sched:") and tail.isdigit() else None


def manual_run_id(name: str, now_ms: int) -> str:
    """The run id of a manual trigger: ``sched:<name>:manual:<epoch ms>``."""
    return f"sched:{name}:manual:{now_ms}"


class _Store(ScheduleStore, RunStore, Protocol):
    """The slice of the store a :class:`Scheduler` uses: schedules, and the runs they start."""


class Scheduler:
    """The engine's schedules: those declared in code, and the firing phase.

    Internal: the engine's ``schedule``/``add_schedule``/``fire_schedules``…
    methods delegate here.
    """

    def __init__(
        self,
        store: _Store,
        clock: Clock,
        namespace: str,
        registry: Registry,
        *,
        start: StartRun,
        cancel: Callable[[str], Awaitable[Any]],
    ) -> None:
        """Schedules live in ``store`` under ``namespace``; a window's run is
        started with ``start`` (idempotent by run id), and ``cancel`` ends the
        previous run for ``overlap="cancel_previous"``. Only workflows in
        ``registry`` are fired here."""
        self._store = store
        self._clock = clock
        self._namespace = namespace
        self._registry = registry
        self._start_run = start
        self._cancel = cancel
        self._declared: dict[str, tuple[ScheduleSpec, bool]] = {}
        self._dirty = False

    # -- declared in code ----------------------------------------------------------------

    def declare(self, name: str, spec: ScheduleSpec, *, paused: bool = False) -> None:
        """Remember a schedule declared in code; it is upserted at the next open or pass."""
        _check_name(name)
        self._declared[name] = (spec, paused)
        self._dirty = True

    async def sync(self) -> None:
        """Upsert the schedules declared in code (once per change of the declarations).

        A declared schedule's spec replaces the stored one; its pause state,
        last run and next window are kept unless its windows changed.
        ``paused=`` in code applies only when the schedule is created.
        """
        if not self._dirty:
            return
        self._dirty = False
        try:
            for name, (spec, paused) in list(self._declared.items()):
                try:
                    self._validate(spec)
                except WorkflowNotRegistered as exc:
                    raise WorkflowNotRegistered(f"schedule {name!r}: {exc}") from exc
                except SchemaValidationError as exc:
                    raise SchemaValidationError(f"schedule {name!r}: {exc}", exc.details) from exc
                await self._upsert(name, spec, paused=None, initial_paused=paused)
        except BaseException:
            self._dirty = True
            raise

    # -- the client API ------------------------------------------------------------------

    async def add(self, name: str, spec: ScheduleSpec, *, paused: bool) -> Schedule:
        """Create or replace a persisted schedule."""
        _check_name(name)
        self._validate(spec)
        record = await self._upsert(name, spec, paused=paused, initial_paused=paused)
        return Schedule.from_record(record)

    async def remove(self, name: str) -> bool:
        """Delete a schedule (a schedule declared in code comes back on the next start)."""
        return await self._store.delete_schedule(name)

    async def get(self, name: str) -> Schedule | None:
        """One schedule, or ``None``."""
        record = await self._store.get_schedule(name)
        return Schedule.from_record(record) if record is not None else None

    async def list_all(self) -> list[Schedule]:
        """The schedules of the engine's namespace, by name."""
        records = await self._store.list_schedules(self._namespace)
        return [Schedule.from_record(r) for r in records]

    async def pause(self, name: str) -> Schedule:
        """Stop firing windows until resumed."""
        store = self._store
        record = await store.update_schedule(name, {"paused": True}, self._now())
        if record is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        return Schedule.from_record(record)

    async def resume(self, name: str) -> Schedule:
        """Fire again from the next window after now (windows missed while paused are skipped)."""
        store = self._store
        while True:
            record = await self._require(name)
            if not record.paused:
                return Schedule.from_record(record)
            now = self._now()
            spec = ScheduleSpec.from_json(record.spec)
            updated = await store.update_schedule(
                name,
                {"paused": False, "next_fire_at": spec.next_after(now)},
                now,
                revision=record.revision,
            )
            if updated is not None:
                return Schedule.from_record(updated)

    async def trigger(self, name: str) -> str:
        """Start a run of the schedule now, outside its windows; return its id.

        Started here when this engine has the workflow registered; otherwise
        queued on the schedule row for the next firing pass of an engine that has.
        """
        store = self._store
        while True:
            record = await self._require(name)
            spec = ScheduleSpec.from_json(record.spec)
            now = self._now()
            run_id = manual_run_id(name, now)
            if spec.workflow in self._registry.names():
                await self._start(name, spec, run_id, strict=True)
                await store.update_schedule(name, {"last_run_id": run_id}, now)
                return run_id
            if record.firing_run_id is not None:
                raise DurablyError(
                    f"schedule {name!r} already has a start queued ({record.firing_run_id}); "
                    "no engine with its workflow has picked it up yet"
                )
            changes = {"firing_run_id": run_id, "last_run_id": run_id}
            if await store.update_schedule(name, changes, now, revision=record.revision):
                return run_id

    # -- the firing phase ----------------------------------------------------------------

    async def fire(self) -> int:
        """Fire every due window of this namespace's schedules; return the runs started."""
        await self.sync()
        now = self._now()
        started = 0
        due = await self._store.list_due_schedules(
            self._namespace, now, _DUE_BATCH, self._registry.names()
        )
        for record in due:
            try:
                started += await self._fire_one(record, now)
            except Exception:
                _log.exception("firing schedule %s failed", record.name)
        return started

    async def _fire_one(self, record: ScheduleRecord, now: int) -> int:
        store, name = self._store, record.name
        spec = ScheduleSpec.from_json(record.spec)
        if spec.workflow not in self._registry.names():
            return 0  # an engine that has the workflow fires it
        started = 0
        if record.firing_run_id is not None:
            # A claimed start that was never confirmed (a crash, or a trigger
            # queued by an engine without the workflow): start it, idempotently.
            exists = await store.get_run(record.firing_run_id) is not None
            window = _window_of(record.firing_run_id)
            if not exists and await self._start(name, spec, record.firing_run_id, window=window):
                started += 1
            cleared = await store.update_schedule(
                name, {"firing_run_id": None}, now, revision=record.revision
            )
            if cleared is None:
                return started
            record = cleared
        for _ in range(_MAX_WINDOWS_PER_PASS):
            if record.paused or record.next_fire_at is None or record.next_fire_at > now:
                break
            window = record.next_fire_at if spec.catchup else spec.latest_at(now)
            if window is None or window < record.next_fire_at:
                window = record.next_fire_at
            floor = spec.earliest_caught_up(now) if spec.catchup else None
            if floor is not None and window < floor:
                window = floor  # older missed windows beyond max_catchup are skipped
            run_id = window_run_id(name, window)
            previous = record.last_run_id
            live = False
            if spec.overlap != "allow" and previous is not None:
                prior = await store.get_run(previous)
                live = prior is not None and prior.status in _LIVE
            fire = not (live and spec.overlap == "skip")
            changes: dict[str, Any] = {"next_fire_at": spec.next_after(window)}
            if fire:
                changes.update(last_fired_at=window, last_run_id=run_id, firing_run_id=run_id)
            claimed = await store.update_schedule(name, changes, now, revision=record.revision)
            if claimed is None:
                break  # another instance took this window
            record = claimed
            if not fire:
                _log.info(
                    "schedule %s skipped window %s: run %s is still live", name, window, previous
                )
                continue
            if live and spec.overlap == "cancel_previous" and previous is not None:
                await self._cancel(previous)
            if await self._start(name, spec, run_id, window=window):
                started += 1
                _log.info("schedule %s fired window %s: run %s", name, window, run_id)
            cleared = await store.update_schedule(
                name, {"firing_run_id": None}, now, revision=record.revision
            )
            if cleared is None:
                break
            record = cleared
        return started

    async def _start(
        self,
        name: str,
        spec: ScheduleSpec,
        run_id: str,
        strict: bool = False,
        window: int | None = None,
    ) -> bool:
        start_at = None
        if window is not None and spec.jitter_ms > 0:
            # Relative to the window, not to now: a late pass does not add the
            # delay again, and every instance computes the same time.
            due = window + spec.jitter_of(run_id)
            start_at = datetime.fromtimestamp(due / 1000, tz=UTC)
        try:
            await self._start_run(
                spec.workflow,
                spec.input,
                run_id=run_id,
                tags=[f"schedule:{name}"],
                start_at=start_at,
            )
        except (WorkflowNotRegistered, SchemaValidationError) as exc:
            if strict:
                raise
            _log.error("schedule %s could not start run %s (dropped): %s", name, run_id, exc)
            return False
        return True

    # -- helpers -------------------------------------------------------------------------

    def _now(self) -> int:
        return self._clock.now_ms()

    def _validate(self, spec: ScheduleSpec) -> None:
        definition = self._registry.get(spec.workflow)
        if definition.takes_input:
            definition.validate_input(spec.input)
        elif spec.input is not None:
            raise SchemaValidationError(f"workflow {spec.workflow!r} takes no input")

    async def _require(self, name: str) -> ScheduleRecord:
        record = await self._store.get_schedule(name)
        if record is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        return record

    async def _upsert(
        self, name: str, spec: ScheduleSpec, *, paused: bool | None, initial_paused: bool
    ) -> ScheduleRecord:
        store, namespace = self._store, self._namespace
        data = spec.to_json()
        while True:
            now = self._now()
            fresh = ScheduleRecord(
                name=name,
                spec=data,
                namespace=namespace,
                paused=initial_paused,
                next_fire_at=spec.next_after(now),
                created_at=now,
                updated_at=now,
            )
            stored, created = await store.create_schedule(fresh)
            if created:
                return stored
            changes: dict[str, Any] = {}
            if stored.spec != data:
                changes["spec"] = data
            if stored.namespace != namespace:
                changes["namespace"] = namespace
            if paused is not None and stored.paused != paused:
                changes["paused"] = paused
            if not ScheduleSpec.from_json(stored.spec).same_timing(spec) or (
                paused is False and stored.paused
            ):
                changes["next_fire_at"] = spec.next_after(now)
            if not changes:
                return stored
            updated = await store.update_schedule(name, changes, now, revision=stored.revision)
            if updated is not None:
                return updated


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name.strip():
        raise ValueError("a schedule needs a non-empty name")
    check_key(name, "schedule name")


def _check_cron(expression: str) -> str:
    if not isinstance(expression, str):
        raise ValueError("cron= must be a string such as '0 * * * *'")
    text = " ".join(expression.split())
    if text.lower() in _ALIASES:
        return text.lower()
    if len(text.split(" ")) != 5 or not croniter.is_valid(text):
        raise ValueError(
            f"invalid cron expression {expression!r}: use five fields (minute hour "
            "day-of-month month day-of-week) or @hourly/@daily/@weekly/@monthly/@yearly"
        )
    return text


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(
            f"unknown time zone {name!r}: use an IANA name such as 'Europe/Paris'"
        ) from exc
