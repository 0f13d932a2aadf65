"""Who may see the dashboard and change anything through it.

Three ways in, decided once per request and failing closed:

- an ``auth`` hook given by the host app (``request -> bool``, sync or
  async); an exception in it refuses;
- a token: ``Authorization: Bearer <token>``, or the session cookie the login
  form sets: ``<expiry>.<HMAC-SHA256(token, expiry)>``, so nothing is stored
  server side and changing the token ends every session;
- neither: open (the ``durably dashboard`` command refuses to listen anywhere
  but the loopback interface in that case).

State changes are POST only, and a POST must carry the CSRF token (the form
field ``csrf`` or the header ``X-Durably-CSRF``) equal to the ``durably_csrf``
cookie, unless it authenticated with a bearer header (which a browser never
sends on its own); an ``Origin`` naming another host is refused too.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CSRF_COOKIE", "SESSION_COOKIE", "AuthHook", "Guard", "SecurityHeaders"]

AuthHook = Callable[[Request], bool | Awaitable[bool]]
"""A host app's check of a request: true lets it in."""

SESSION_COOKIE = "durably_session"
CSRF_COOKIE = "durably_csrf"
SESSION_TTL_S = 8 * 3600

_log = logging.getLogger("durably.dashboard")


class Guard:
    """The dashboard's access decisions (see the module docstring)."""

    def __init__(self, *, token: str | None, auth: AuthHook | None, read_only: bool) -> None:
        if token is not None and not token.strip():
            # An empty token would accept an empty bearer: refuse to build at all.
            raise ValueError("the dashboard token is empty; pass a secret or no token")
        self.token = token
        self.auth = auth
        self.read_only = read_only
        self._key = (
            hashlib.sha256(f"durably-dashboard-session:{token}".encode()).digest() if token else b""
        )

    @property
    def uses_login(self) -> bool:
        """Whether a person without a session is sent to the login form."""
        return self.auth is None and self.token is not None

    def bearer(self, request: Request) -> bool:
        """Whether the request carries the token in an ``Authorization`` header."""
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        return (
            self.token is not None
            and scheme.lower() == "bearer"
            and hmac.compare_digest(value.strip().encode(), self.token.encode())
        )

    async def allowed(self, request: Request) -> bool:
        """Whether the request may see the dashboard."""
        if self.auth is not None:
            try:
                verdict = self.auth(request)
                if inspect.isawaitable(verdict):
                    verdict = await verdict
            except Exception:
                _log.exception("the dashboard's auth hook raised; refusing the request")
                return False
            return verdict is True
        if self.token is None:
            return True
        return self.bearer(request) or self.session_valid(request.cookies.get(SESSION_COOKIE))

    # -- sessions -----------------------------------------------------------------------

    def new_session(self, now: float | None = None) -> str:
        """A session cookie value valid for :data:`SESSION_TTL_S`."""
        expiry = int((now if now is not None else time.time()) + SESSION_TTL_S)
        return f"{expiry}.{self._sign(str(expiry))}"

    def session_valid(self, value: str | None, now: float | None = None) -> bool:
        """Whether ``value`` is an unexpired session this token signed."""
        if not value or not self._key:
            return False
        expiry, _, signature = value.partition(".")
        if not expiry.isdigit() or not hmac.compare_digest(signature, self._sign(expiry)):
            return False
        return int(expiry) > (now if now is not None else time.time())

    def check_login(self, offered: str) -> bool:
        """Whether the login form's token is the token."""
        return self.token is not None and hmac.compare_digest(offered.encode(), self.token.encode())

    def _sign(self, text: str) -> str:
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    # -- CSRF ---------------------------------------------------------------------------

    @staticmethod
    def csrf_token(request: Request) -> str:
        """The request's CSRF token: its cookie, or a new one to set."""
        existing = request.cookies.get(CSRF_COOKIE)
        return existing if existing and len(existing) >= 32 else secrets.token_urlsafe(32)

    def write_refusal(
        self, request: Request, offered: str | None, *, changes_state: bool = True
    ) -> str | None:
        """Why a POST may not go through (``None``: it may); the login form
        posts with ``changes_state=False`` (allowed on a read-only dashboard)."""
        if changes_state and self.read_only:
            return "the dashboard is read-only"
        origin = request.headers.get("origin")
        if origin is not None and origin.split("://", 1)[-1] != request.headers.get("host"):
            # Another site's page (or a sandboxed frame: "null") posting here.
            return "cross-origin request refused"
        if self.bearer(request):
            return None
        cookie = request.cookies.get(CSRF_COOKIE)
        offered = offered or request.headers.get("x-durably-csrf")
        if not cookie or not offered or not hmac.compare_digest(cookie, offered):
            return "missing or wrong CSRF token; reload the page and try again"
        return None


# Defence in depth behind the escaping: no script but the dashboard's own file
# runs even if markup slipped through, no other site frames the pages (a
# clickjacked "Cancel"), and no response is sniffed into another type. Inline
# styles stay allowed: the timeline positions its bars with them.
_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        b"img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]


class SecurityHeaders:
    """ASGI middleware adding :data:`_HEADERS` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request through, adding the headers to the response start."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)
