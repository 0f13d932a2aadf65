"""The worker handshake: descriptors, their hash, and who can serve what.

A worker publishes, per routing token, a liveness key (its value carries
``descriptorHash``) and a descriptor (what it runs: runtime, SDK, protocol
range, capabilities, workflows, steps, registrations). The hash is FNV-1a 64
over a canonical JSON of the normalised descriptor, folded per UTF-16 code
unit (low byte, high byte, one multiply), so it is the same number the
upstream TypeScript and Python SDKs compute.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LEGACY_CAPABILITIES",
    "LiveWorker",
    "descriptor_hash",
    "fnv1a64",
    "live_workers",
    "negotiate",
    "normalize",
]

LEGACY_CAPABILITIES = (
    "saga",
    "signals",
    "search-attributes",
    "priority",
    "entities",
    "child-workflows",
    "singleton",
    "schedules",
    "continue-as-new",
    "queries",
    "cancellation",
)
"""What a descriptor without ``capabilities`` (protocol v1) is taken to offer."""

ENGINE_RANGE = (1, 1)
"""The protocol majors this engine speaks."""

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def fnv1a64(text: str) -> str:
    """FNV-1a 64 of ``text`` as the upstream folds it: per UTF-16 code unit,
    xor the low byte, xor the high byte, multiply once; 16 hex digits."""
    h = _FNV_OFFSET
    data = text.encode("utf-16-le", "surrogatepass")
    for low, high in zip(data[0::2], data[1::2], strict=True):
        h = ((h ^ low ^ high) * _FNV_PRIME) & _MASK
    return f"{h:016x}"


def normalize(raw: dict[str, Any]) -> dict[str, Any]:
    """A wire descriptor with the protocol-v1 defaults filled in (an absent
    ``capabilities`` is the legacy set; an explicit empty list stays empty)."""
    capabilities = raw.get("capabilities")
    return {
        "instanceId": raw.get("instanceId"),
        "runtime": raw.get("runtime"),
        "sdk": raw.get("sdk") or {"name": "unknown", "version": "0"},
        "protocol": raw.get("protocol") or {"version": 1, "range": [1, 1]},
        "capabilities": list(LEGACY_CAPABILITIES) if capabilities is None else list(capabilities),
        "workflows": list(raw.get("workflows") or []),
        "steps": list(raw.get("steps") or []),
        "registrations": raw.get("registrations"),
        "partition": raw.get("partition"),
        "namespace": raw.get("namespace"),
        "startedAt": raw.get("startedAt") or 0,
    }


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _sorted_unique(values: Iterable[Any]) -> list[Any]:
    return sorted(set(values))


def _by_json(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    unique = {_compact(entry): entry for entry in entries}
    return [unique[key] for key in sorted(unique)]


def _registration(raw: dict[str, Any]) -> dict[str, Any]:
    requires = raw.get("requires")
    entry: dict[str, Any] = {
        "name": raw.get("name"),
        "version": raw.get("version"),
        "group": raw.get("group"),
        "requires": None if requires is None else _sorted_unique(requires),
        "origin": raw.get("origin"),
    }
    routes = raw.get("onError")
    if routes is not None:
        entry["onError"] = _by_json(
            {"code": route.get("code"), "workflow": route.get("workflow")} for route in routes
        )
    return entry


def canonical(raw: dict[str, Any]) -> dict[str, Any]:
    """The normalised descriptor in the fixed key order the hash is taken over."""
    d = normalize(raw)
    sdk, protocol = d["sdk"], d["protocol"]
    out: dict[str, Any] = {
        "instanceId": d["instanceId"],
        "runtime": d["runtime"],
        "sdk": {"name": sdk.get("name"), "version": sdk.get("version")},
        "protocol": {
            "version": protocol.get("version"),
            "range": [protocol["range"][0], protocol["range"][1]],
        },
        "capabilities": _sorted_unique(d["capabilities"]),
        "workflows": _sorted_unique(d["workflows"]),
        "steps": _sorted_unique(d["steps"]),
    }
    if d["registrations"] is not None:
        out["registrations"] = _by_json(_registration(r) for r in d["registrations"])
    out["partition"] = d["partition"]
    out["namespace"] = d["namespace"]
    out["startedAt"] = d["startedAt"]
    return out


def descriptor_hash(raw: dict[str, Any]) -> str:
    """The upstream ``descriptorHash`` of a wire descriptor."""
    return fnv1a64(_compact(canonical(raw)))


def negotiate(descriptor: dict[str, Any], requires: Collection[str] = ()) -> str:
    """``compatible``, ``degraded`` or ``incompatible`` (protocol ranges that
    do not overlap: the only outcome that stops a dispatch)."""
    d = normalize(descriptor)
    low, high = d["protocol"]["range"][0], d["protocol"]["range"][1]
    if max(low, ENGINE_RANGE[0]) > min(high, ENGINE_RANGE[1]):
        return "incompatible"
    if not set(requires) <= set(d["capabilities"]):
        return "degraded"
    return "compatible"


@dataclass(frozen=True, slots=True)
class LiveWorker:
    """One live worker key (a worker holds one per routing token it consumes)."""

    token: str
    instance_id: str
    descriptor: dict[str, Any] | None
    """The normalised descriptor, or ``None`` if it published none."""
    beat: Any
    hash_ok: bool | None
    """Whether the beat's ``descriptorHash`` matches the descriptor (``None``: no hash)."""

    @property
    def capabilities(self) -> frozenset[str]:
        """What it advertises (the legacy set when it published no descriptor)."""
        if self.descriptor is None:
            return frozenset(LEGACY_CAPABILITIES)
        return frozenset(self.descriptor["capabilities"])

    @property
    def workflows(self) -> list[str]:
        """The workflows it serves."""
        return [] if self.descriptor is None else sorted(set(self.descriptor["workflows"]))

    @property
    def steps(self) -> list[str]:
        """The steps it serves."""
        return [] if self.descriptor is None else sorted(set(self.descriptor["steps"]))

    def can_serve(self, requires: Collection[str]) -> bool:
        """Whether it advertises every capability in ``requires`` and speaks our protocol."""
        if self.descriptor is not None and negotiate(self.descriptor) == "incompatible":
            return False
        return set(requires) <= self.capabilities


def live_workers(entries: Iterable[dict[str, Any]]) -> list[LiveWorker]:
    """Parse a transport's live-worker entries (``TurnCarrier.live_workers``)."""
    workers = []
    for entry in entries:
        raw = entry.get("descriptor")
        beat = entry.get("beat")
        descriptor = normalize(raw) if isinstance(raw, dict) else None
        claimed = beat.get("descriptorHash") if isinstance(beat, dict) else None
        hash_ok = None
        if isinstance(raw, dict) and isinstance(claimed, str):
            try:
                hash_ok = descriptor_hash(raw) == claimed
            except (KeyError, IndexError, TypeError):
                hash_ok = False
        workers.append(
            LiveWorker(
                str(entry.get("token")), str(entry.get("instanceId")), descriptor, beat, hash_ok
            )
        )
    return workers
