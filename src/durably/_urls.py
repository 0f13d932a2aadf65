"""Printing store and transport URLs without their credentials.

A leaf module (it imports nothing from durably) so the CLI, the stores and the
transports can all put a URL in a message or a log line through one helper.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

__all__ = ["redact_url"]


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to print or log)."""
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        user = parts.username or ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return url
