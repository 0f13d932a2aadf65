"""Capability routing: whether a live worker can take a remote workflow's
turn, and the fleet's health as ``engine.worker_health()`` reports it.

Before each turn goes out the live workers are read (liveness keys and
descriptors, cached for a second: a burst of turns costs one scan). A turn
nobody can take is not queued into a queue nobody drains: the run is parked
``blocked`` with the reason, and polled again (``sweep_blocked`` hands it
back for another turn, which checks again).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._registry import RemoteSpec
from ..transports.base import TurnCarrier
from .handshake import LiveWorker, live_workers

if TYPE_CHECKING:
    from .._registry import Registry, WorkflowDef
    from ..model import ErrorInfo, Run

__all__ = ["CapabilityRouter"]

_CACHE_S = 1.0


class CapabilityRouter:
    """Reads the live workers and judges who can serve a remote workflow."""

    def __init__(
        self,
        carrier: Callable[[], TurnCarrier | None],
        registry: Registry,
        namespace: Callable[[], str],
    ) -> None:
        """``namespace()``: the pool this engine starts runs in (their partition)."""
        self._carrier = carrier
        self._registry = registry
        self._namespace = namespace
        self._cached: tuple[float, list[LiveWorker]] | None = None

    async def workers(self, *, fresh: bool = False) -> list[LiveWorker]:
        """The live workers (cached for a second unless ``fresh``)."""
        carrier = self._carrier()
        if carrier is None:
            return []
        now = time.monotonic()
        if not fresh and self._cached is not None and now - self._cached[0] < _CACHE_S:
            return self._cached[1]
        workers = live_workers(await carrier.live_workers())
        self._cached = (now, workers)
        return workers

    async def check(self, run: Run, definition: WorkflowDef) -> ErrorInfo | None:
        """``None`` if a live worker can take a turn of ``run``, else why not."""
        requires = sorted(definition.remote.requires) if definition.remote else []
        token = (definition.remote or RemoteSpec()).token(run.workflow, run.namespace)
        serving = [
            w for w in await self.workers() if w.token == token or run.workflow in w.workflows
        ]
        if not serving:
            # Read again before parking: a worker that just started is not missed.
            serving = [
                w
                for w in await self.workers(fresh=True)
                if w.token == token or run.workflow in w.workflows
            ]
        if not serving:
            return _blocked(
                f"blocked: no live worker serves workflow {run.workflow!r}",
                "no_live_worker",
                {"workflow": run.workflow, "token": token},
            )
        if any(w.can_serve(requires) for w in serving):
            return None
        capable = [w for w in serving if set(requires) <= w.capabilities]
        if capable:
            return _blocked(
                "blocked: no protocol-compatible worker for workflow "
                f"{run.workflow!r} (requires {', '.join(requires)})",
                "protocol_incompatible",
                {"workflow": run.workflow, "requires": requires},
            )
        return _blocked(
            f"blocked: no compatible worker (requires {', '.join(requires)})",
            "capability_unavailable",
            {
                "workflow": run.workflow,
                "requires": requires,
                "workers": {w.instance_id: sorted(w.capabilities) for w in serving},
            },
        )

    async def check_step(self, token: str, requires: frozenset[str]) -> ErrorInfo | None:
        """``None`` if a step sent to ``token`` needing ``requires`` can be
        taken, else why not. Only the descriptors of that token count, and
        a token without any is not guarded (workers that predate the
        handshake, and durably's own, publish none)."""
        mine = [w for w in await self.workers() if w.token == token and w.descriptor]
        if not mine or any(w.can_serve(requires) for w in mine):
            return None
        needed = ", ".join(sorted(requires))
        if any(requires <= w.capabilities for w in mine):
            return _blocked(
                f"blocked: no protocol-compatible worker (requires {needed})",
                "protocol_incompatible",
                {"token": token, "requires": sorted(requires)},
            )
        return _blocked(
            f"blocked: no compatible worker (requires {needed})",
            "capability_unavailable",
            {
                "token": token,
                "requires": sorted(requires),
                "workers": {w.instance_id: sorted(w.capabilities) for w in mine},
            },
        )

    async def health(self) -> dict[str, Any]:
        """Live workers, what they serve, queue depths and starving work."""
        carrier = self._carrier()
        workers = await self.workers(fresh=True)
        tokens = {w.token for w in workers}
        pool = self._namespace()
        wanted = {d.remote.token(d.name, pool) for d in self._registry.remote() if d.remote}
        depths = await carrier.queue_depths(sorted(tokens | wanted)) if carrier is not None else {}
        by_instance: dict[str, dict[str, Any]] = {}
        for w in workers:
            entry = by_instance.setdefault(
                w.instance_id,
                {
                    "instance_id": w.instance_id,
                    "runtime": (w.descriptor or {}).get("runtime"),
                    "sdk": (w.descriptor or {}).get("sdk"),
                    "tokens": [],
                    "workflows": w.workflows,
                    "steps": w.steps,
                    "capabilities": sorted(w.capabilities),
                    "descriptor_hash_ok": w.hash_ok,
                },
            )
            entry["tokens"].append(w.token)
        starving = {
            token: depth for token, depth in depths.items() if depth > 0 and token not in tokens
        }
        return {
            "workers": sorted(by_instance.values(), key=lambda e: e["instance_id"]),
            "queues": depths,
            "starving": starving,
        }


def _blocked(message: str, code: str, details: dict[str, Any]) -> ErrorInfo:
    return {
        "message": message,
        "code": code,
        "type": "Blocked",
        "retryable": True,
        "details": details,
    }
