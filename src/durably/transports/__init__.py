"""Transports: how dispatched-step tasks reach workers and results come back.

Chosen by URL: ``local://`` (the default, in-process queues), ``memory://``
(inline, for tests), ``db://`` (a message table in the store's database),
``redis://`` / ``rediss://`` (BullMQ queues and pub/sub, the upstream wire).
"""

from __future__ import annotations

from .._urls import redact_url
from ..stores.base import StateStore
from .base import Transport, TransportError
from .local import LocalTransport
from .memory import MemoryTransport

__all__ = ["LocalTransport", "MemoryTransport", "Transport", "TransportError", "open_transport"]


def open_transport(target: str | Transport | None, store: StateStore) -> Transport:
    """The transport for ``target``: a URL, a transport object, or ``None`` (local)."""
    if target is None:
        return LocalTransport()
    if not isinstance(target, str):
        if not isinstance(target, Transport):
            raise TypeError(f"transport must be a URL or a Transport, not {type(target).__name__}")
        return target
    scheme = target.partition("://")[0].lower()
    if scheme == "local":
        return LocalTransport()
    if scheme == "memory":
        return MemoryTransport()
    if scheme == "db":
        from .db import DbTransport

        return DbTransport(store)
    if scheme in ("redis", "rediss"):
        from .redis import RedisTransport

        return RedisTransport.from_url(target, retry_open=True)
    raise ValueError(
        f"unknown transport URL {redact_url(target)!r}: "
        "expected local://, memory://, db:// or redis://"
    )
