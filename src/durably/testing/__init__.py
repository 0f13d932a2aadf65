"""Test helpers: a virtual clock to drive timers, timeouts and retries without real waits,
and :func:`eventually` to wait, without fixed sleeps, for what the engine does in the background.
"""

from __future__ import annotations

from ._eventually import eventually
from .clock import VirtualClock

__all__ = ["VirtualClock", "eventually"]
