"""Printing store and transport URLs without their credentials.

A leaf module (it imports nothing from durably) so the CLI, the stores and the
transports can all put a URL in a message or a log line through one helper.

The URLs to redact are often the malformed ones (a bad port, an unknown
scheme, a password with an unencoded ``/``), so nothing here relies on
``urllib.parse`` accepting the URL: it works on the text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote

__all__ = ["redact_url", "scrub", "url_secrets"]

REDACTED = "***"
"""What a password or a secret query value is replaced by."""

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_SENSITIVE_KEYS = ("pass", "pwd", "secret", "token", "key", "auth", "credential", "signature")
# A secret shorter than this is not scrubbed out of free text: replacing every
# "ab" in a message would garble it; redact_url still hides it in the URL.
_MIN_SCRUB = 3


def _split(url: str) -> tuple[str, str | None, str] | None:
    """``(scheme://, userinfo, the rest)`` of a URL, or ``None`` for a plain path.

    The userinfo ends at the last ``@`` of the authority. A password holding
    an unencoded ``/``, ``?`` or ``#`` seems to end the authority early; when
    the text before that cut has a ``:`` (``user:pa/ss@host``) and an ``@``
    follows, everything up to the last ``@`` before the query is taken as
    userinfo, erring toward hiding too much.
    """
    match = _SCHEME.match(url)
    if match is None:
        return None
    head, rest = match.group(), url[match.end() :]
    cut = next((i for i, char in enumerate(rest) if char in "/?#"), len(rest))
    at = rest.rfind("@", 0, cut)
    if at < 0 and ":" in rest[:cut]:
        query = rest.find("?", cut)
        at = rest.rfind("@", 0, len(rest) if query < 0 else query)
        if at < 0 and query >= 0:
            at = rest.rfind("@")
    if at < 0:
        return head, None, rest
    return head, rest[:at], rest[at + 1 :]


def _sensitive(key: str) -> bool:
    name = unquote(key).lower()
    return any(marker in name for marker in _SENSITIVE_KEYS)


def _redact_query(rest: str) -> tuple[str, list[str]]:
    """``rest`` with the values of sensitive query parameters redacted, and those values."""
    start = rest.find("?")
    if start < 0:
        return rest, []
    end = rest.find("#", start)
    end = len(rest) if end < 0 else end
    secrets: list[str] = []
    params = []
    for param in re.split(r"([&;])", rest[start + 1 : end]):
        key, eq, value = param.partition("=")
        if eq and value and _sensitive(key):
            secrets.append(value)
            param = f"{key}={REDACTED}"
        params.append(param)
    return rest[: start + 1] + "".join(params) + rest[end:], secrets


def _analyse(url: str) -> tuple[str, list[str]]:
    parts = _split(url)
    if parts is None:
        return url, []
    head, userinfo, rest = parts
    rest, secrets = _redact_query(rest)
    if userinfo is None:
        return head + rest, secrets
    user, colon, password = userinfo.partition(":")
    if not colon:
        return f"{head}{userinfo}@{rest}", secrets
    return f"{head}{user}:{REDACTED}@{rest}", [password, *secrets]


def redact_url(url: str) -> str:
    """``url`` with its password and the values of query parameters such as
    ``password=`` or ``token=`` replaced by ``***`` (safe to print or log),
    even when the URL is malformed. A path without ``scheme://`` is returned as is."""
    return _analyse(url)[0]


def url_secrets(url: str) -> list[str]:
    """The secrets :func:`redact_url` hides in ``url``, raw and percent-decoded."""
    found: list[str] = []
    for secret in _analyse(url)[1]:
        for form in (secret, unquote(secret)):
            if form and form not in found:
                found.append(form)
    return found


def scrub(text: str, urls: Iterable[str]) -> str:
    """``text`` with each of ``urls`` redacted and their secrets replaced by ``***``,
    wherever they appear (for messages built by code that did not redact, such
    as a database driver's exception)."""
    for url in urls:
        if not url:
            continue
        redacted = redact_url(url)
        if redacted != url:
            text = text.replace(url, redacted)
        for secret in url_secrets(url):
            if len(secret) >= _MIN_SCRUB:
                text = text.replace(secret, REDACTED)
    return text
