"""Small pieces every store implementation shares."""

from __future__ import annotations

import base64
import json

from ..model import ErrorInfo

__all__ = ["dead_error", "decode_cursor", "encode_cursor"]


def encode_cursor(created_at: int, run_id: str) -> str:
    """An opaque cursor pointing just past ``(created_at, run_id)``."""
    raw = json.dumps([created_at, run_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> tuple[int, str] | None:
    """The position a cursor points past; ``ValueError`` if it is malformed."""
    if not cursor:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, run_id = json.loads(raw)
        return int(created_at), str(run_id)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid cursor {cursor!r}") from exc


def dead_error(attempts: int) -> ErrorInfo:
    """The error a run carries once recovery gives up on it."""
    return {
        "message": f"the run crashed its executor {attempts} times; gave up",
        "code": "max_recovery_attempts",
        "type": "RecoveryExhausted",
    }
