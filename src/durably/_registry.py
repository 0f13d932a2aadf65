"""What an engine has registered: workflows (name → version → definition, with
their input contracts), step handlers, and flow-control queues."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from . import _codec as codec
from . import _typed as typed
from ._names import check_name
from ._singletons import Singleton
from .durations import Duration, to_ms
from .errors import SchemaValidationError, WorkflowNotRegistered
from .steps._flow import FlowQueue
from .steps.definition import StepDefinition
from .wire import routing_token

__all__ = [
    "UNPINNED",
    "Registry",
    "RemoteSpec",
    "WorkflowDef",
    "check_version",
    "parse_input",
    "validate_input",
]

WorkflowFn = Callable[..., Any]

UNPINNED = ""
"""The stored version of a run started without one (by a :class:`durably.Client`,
which knows no registrations): the first engine that executes it pins it to
that engine's current version of the workflow."""


def check_version(version: object) -> None:
    """Refuse a workflow version before anything is registered or stored: empty
    (that is how an unpinned run is stored), or one no store can keep."""
    if not str(version):
        raise ValueError("a workflow version must be a non-empty string")
    check_name(str(version), "workflow version")


def validate_input(workflow: str, kind: Any, value: Any) -> Any:
    """Check ``value`` against ``kind`` (a declared input type, ``None``: any)
    and return it as JSON data.

    Raises :class:`SchemaValidationError` for anything ``kind`` rejects or
    that cannot be stored as JSON.
    """
    parsed = parse_input(workflow, kind, value)
    try:
        return codec.to_jsonable(parsed, "input")
    except (TypeError, ValueError) as exc:
        raise SchemaValidationError(
            f"input of workflow {workflow!r} cannot be stored as JSON: {exc}"
        ) from exc


def parse_input(workflow: str, kind: Any, value: Any) -> Any:
    """Convert ``value`` (stored JSON, or what a caller passed) into ``kind``."""
    if kind is None:
        return value
    try:
        return codec.parse_as(kind, value)
    except Exception as exc:
        details = None
        errors = getattr(exc, "errors", None)
        if callable(errors):
            try:
                details = codec.to_jsonable(errors())
            except Exception:
                details = None
        raise SchemaValidationError(
            f"invalid input for workflow {workflow!r}: {exc}", details
        ) from exc


@dataclass(frozen=True, slots=True)
class RemoteSpec:
    """How a remote workflow is served: the capabilities its worker must advertise."""

    requires: frozenset[str] = frozenset()
    group: str | None = None
    """The queue token of a worker serving workflows by group (upstream
    ``WorkflowWorker(group=…)``); ``None``: the workflow's own routing token."""

    def token(self, workflow: str, namespace: str) -> str:
        """The routing token its turns are queued under."""
        return self.group if self.group is not None else routing_token(workflow, namespace)


async def _remote_body(*_: Any) -> Any:
    raise RuntimeError("a remote workflow has no body in this process")


@dataclass(frozen=True, slots=True)
class WorkflowDef:
    """One registered version of a workflow."""

    name: str
    version: str
    fn: WorkflowFn
    input_type: Any = None
    execution_timeout_ms: int | None = None
    takes_input: bool = True
    singleton: Singleton | None = None
    output_type: Any = Any
    """``output=``, else the function's return annotation, else ``Any``."""
    typed_output: typed.Typed = typed.PLAIN
    """How the output is checked, stored and decoded as :attr:`output_type`."""
    remote: RemoteSpec | None = None
    """Set for a remote workflow: its body runs in a worker elsewhere."""
    tags: tuple[str, ...] = ()
    """Static tags every run ``start`` creates carries (checked at registration)."""

    @classmethod
    def build(
        cls,
        name: str,
        fn: WorkflowFn,
        *,
        version: str,
        input: Any,
        execution_timeout: Duration | None,
        singleton: Singleton | None = None,
        output: Any = None,
        tags: list[str] | None = None,
    ) -> WorkflowDef:
        """Validate ``engine.register``'s arguments and build the definition."""
        if not isinstance(name, str) or not name:
            raise ValueError("a workflow needs a non-empty name")
        check_name(name, "workflow name")
        check_version(version)
        typed.check_declared(output, f"workflow {name!r}")
        output_type = typed.output_type_of(fn, output)
        return cls(
            name=name,
            version=str(version),
            fn=fn,
            input_type=input,
            execution_timeout_ms=(
                None
                if execution_timeout is None
                else to_ms(execution_timeout, name="execution_timeout")
            ),
            takes_input=takes_input(fn),
            singleton=singleton,
            output_type=output_type,
            typed_output=typed.typed_for(output_type, f"the output of workflow {name!r}"),
            tags=tuple(tags or ()),
        )

    @property
    def decode_output(self) -> typed.Decoder:
        """A run's stored output (JSON data) as :attr:`output_type`."""
        return self.typed_output.decode

    def call(self, ctx: Any, value: Any) -> Awaitable[Any]:
        """The body's coroutine for one turn. Its output must fit the declared
        type: one that does not fails the run with the validation error."""
        body = self.fn(ctx, value) if self.takes_input else self.fn(ctx)
        if self.typed_output.plain:
            return cast(Awaitable[Any], body)
        return self._checked(body)

    async def _checked(self, body: Awaitable[Any]) -> Any:
        data, _ = self.typed_output.store(await body, "workflow output")
        return data

    def deadline_from(self, now_ms: int) -> int | None:
        """When a run of this version started at ``now_ms`` exceeds its
        ``execution_timeout`` (epoch ms), or ``None`` without one."""
        if self.execution_timeout_ms is None:
            return None
        return now_ms + self.execution_timeout_ms

    def validate_input(self, value: Any) -> Any:
        """Check ``value`` against the declared input and return it as JSON data
        (see :func:`validate_input`)."""
        return validate_input(self.name, self.input_type, value)

    def parse_input(self, value: Any) -> Any:
        """Convert stored JSON back into the declared input type."""
        return parse_input(self.name, self.input_type, value)


class Registry:
    """Everything registered on one engine, in one place.

    Workflows by name and version (the last version registered is the
    default), step definitions by name and flow-control queues by name. The
    engine writes here; the turn driver, the step dispatcher and the step
    server only read.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, dict[str, WorkflowDef]] = {}
        self._steps: dict[str, StepDefinition] = {}
        self._queues: dict[str, FlowQueue] = {}
        self._executable: frozenset[tuple[str, str]] = frozenset()
        self._has_singletons = False

    def add(self, definition: WorkflowDef) -> None:
        """Register ``definition``; a duplicate name and version is an error."""
        if not inspect.iscoroutinefunction(definition.fn):
            raise TypeError(
                f"workflow {definition.name!r} must be an 'async def' function taking (ctx, input)"
            )
        versions = self._by_name.setdefault(definition.name, {})
        if definition.version in versions and versions[definition.version].fn is not definition.fn:
            raise ValueError(
                f"workflow {definition.name!r} version {definition.version!r} is already registered"
            )
        versions.pop(definition.version, None)
        versions[definition.version] = definition
        # An unpinned run of this name is executable here too: its first turn
        # pins it to this engine's current version.
        self._executable = self._executable | {
            (definition.name, definition.version),
            (definition.name, UNPINNED),
        }
        self._has_singletons = self._has_singletons or definition.singleton is not None

    def add_remote(
        self,
        name: str,
        *,
        version: str,
        requires: frozenset[str],
        execution_timeout: Duration | None,
        group: str | None = None,
    ) -> WorkflowDef:
        """Register workflow ``name`` as served by a remote worker (no body here)."""
        definition = WorkflowDef.build(
            name, _remote_body, version=version, input=None, execution_timeout=execution_timeout
        )
        for capability in requires:
            check_name(capability, "capability")
        if group is not None and (not group or ":" in group):
            raise ValueError("a workflow group must be non-empty and without ':'")
        remote = WorkflowDef(
            name=definition.name,
            version=definition.version,
            fn=_remote_body,
            execution_timeout_ms=definition.execution_timeout_ms,
            remote=RemoteSpec(requires, group),
        )
        versions = self._by_name.get(name, {})
        if remote.version in versions and versions[remote.version] != remote:
            raise ValueError(f"workflow {name!r} version {remote.version!r} is already registered")
        self.add(remote)
        return remote

    def remote(self) -> list[WorkflowDef]:
        """Every registered remote workflow version."""
        return [d for versions in self._by_name.values() for d in versions.values() if d.remote]

    def get(self, name: str, version: str | None = None) -> WorkflowDef:
        """The definition for ``name`` (at ``version``, or the default version
        when ``version`` is ``None`` or :data:`UNPINNED`)."""
        versions = self._by_name.get(name)
        if not versions:
            known = ", ".join(sorted(self._by_name)) or "none"
            raise WorkflowNotRegistered(
                f"workflow {name!r} is not registered (registered: {known})"
            )
        if not version:
            return next(reversed(versions.values()))
        found = versions.get(version)
        if found is None:
            raise WorkflowNotRegistered(
                f"workflow {name!r} version {version!r} is not registered "
                f"(registered versions: {', '.join(versions)})"
            )
        return found

    def of_function(self, fn: object) -> WorkflowDef:
        """The definition whose body is ``fn`` (what ``@engine.workflow`` decorated)."""
        found = [d for versions in self._by_name.values() for d in versions.values() if d.fn is fn]
        name = getattr(fn, "__qualname__", repr(fn))
        if not found:
            raise WorkflowNotRegistered(
                f"function {name} is not a workflow registered on this engine; decorate it "
                "with @engine.workflow(...) or pass the workflow's name"
            )
        if len(found) > 1:
            names = ", ".join(f"{d.name!r} version {d.version!r}" for d in found)
            raise WorkflowNotRegistered(
                f"function {name} is registered as several workflows ({names}); pass the name"
            )
        return found[0]

    def output_decoder(self, name: str) -> typed.Decoder:
        """The decoder of workflow ``name``'s output (its default version's
        output type), or plain data when it is not registered here."""
        versions = self._by_name.get(name)
        if not versions:
            return typed.identity
        return next(reversed(versions.values())).typed_output.decode

    def executable(self) -> frozenset[tuple[str, str]]:
        """Every registered ``(name, version)``: the runs an engine holding
        this registry can execute (its claims take no other run). The same
        object until a workflow is added, so stores may cache its encoding."""
        return self._executable

    def names(self) -> list[str]:
        """Registered workflow names."""
        return sorted(self._by_name)

    # -- steps and queues -----------------------------------------------------------------

    def add_step(self, definition: StepDefinition) -> None:
        """Register a step handler; a name may be registered once."""
        if definition.name in self._steps:
            raise ValueError(f"step {definition.name!r} is already registered")
        self._steps[definition.name] = definition

    def step(self, name: str) -> StepDefinition | None:
        """The step registered under ``name``, if any."""
        return self._steps.get(name)

    def steps(self) -> list[StepDefinition]:
        """Every registered step definition, in registration order."""
        return list(self._steps.values())

    def add_queue(self, queue: FlowQueue) -> None:
        """Declare (or redeclare) a flow-control queue."""
        self._queues[queue.name] = queue

    def queue(self, name: str) -> FlowQueue | None:
        """The flow-control queue declared as ``name``, if any."""
        return self._queues.get(name)

    def has_queues(self) -> bool:
        """Whether any flow-control queue or singleton workflow is declared (a run's
        end then frees slots)."""
        return bool(self._queues) or self._has_singletons


def takes_input(fn: WorkflowFn) -> bool:
    """Whether ``fn`` accepts an input argument after ``ctx``."""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if not params:
        raise TypeError(f"workflow function {fn.__name__!r} must take a ctx argument")
    return len(params) >= 2 or params[0].kind is inspect.Parameter.VAR_POSITIONAL
