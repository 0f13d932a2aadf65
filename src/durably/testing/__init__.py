"""Test helpers: a virtual clock to drive timers, timeouts and retries without real waits."""

from __future__ import annotations

from .clock import VirtualClock

__all__ = ["VirtualClock"]
