"""An ASGI app that receives the bodies posted to ``ctx.webhook()`` URLs.

Mount it wherever the engine's ``webhook_base_url`` points::

    app.mount("/hooks", durably.webhooks.app(engine))     # FastAPI / Starlette

``POST <base>/<token>`` with a JSON body (or none) answers ``202`` once the
body is handed to the run, and ``404`` for a token no live run's webhook has —
the same answer for a malformed, forged or stale token, so a caller learns
nothing about which runs exist. A body over ``max_body`` bytes gets ``413``,
one that is not JSON ``400``, any other method ``405``. Plain ASGI: no
framework needed.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol
from urllib.parse import unquote

__all__ = ["WebhookReceiver", "app"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class WebhookReceiver(Protocol):
    """What the app hands a body to: an :class:`~durably.Engine` (or anything with
    its ``deliver_webhook``)."""

    async def deliver_webhook(self, token: str, body: Any = None) -> bool:
        """Deliver ``body`` to the webhook ``token`` names; ``False`` if none has it."""
        ...


class _TooLarge(Exception):
    pass


def app(
    receiver: WebhookReceiver, *, max_body: int = 1 << 20
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI app delivering posted bodies to ``receiver.deliver_webhook``."""
    if max_body < 1:
        raise ValueError("max_body must be at least 1 byte")

    async def webhook_app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            await _answer(send, 405, {"error": "POST a JSON body"}, [(b"allow", b"POST")])
            return
        # The token is the last path segment (``ctx.webhook`` quotes it whole), so
        # the app works under any mount prefix.
        token = unquote(str(scope.get("path", "")).rstrip("/").rsplit("/", 1)[-1])
        try:
            raw = await _read_body(receive, max_body)
        except _TooLarge:
            await _answer(send, 413, {"error": f"the body is over {max_body} bytes"})
            return
        try:
            body = json.loads(raw) if raw.strip() else None
        except (ValueError, UnicodeDecodeError):
            await _answer(send, 400, {"error": "the body is not JSON"})
            return
        try:
            delivered = await receiver.deliver_webhook(token, body)
        except (TypeError, ValueError) as exc:
            # A body no store can keep (a NUL in a string, say).
            await _answer(send, 400, {"error": str(exc)})
            return
        if not delivered:
            await _answer(send, 404, {"error": "no such webhook"})
            return
        await _answer(send, 202, {"delivered": True})

    return webhook_app


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            # Stop reading at once: a hostile client must not make us buffer
            # an unbounded body.
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _answer(
    send: Send,
    status: int,
    payload: dict[str, Any],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
