"""Test helpers: a virtual clock to drive timers, timeouts and retries without real waits,
:func:`eventually` to wait, without fixed sleeps, for what the engine does in the background,
and :class:`TestEnv`, an engine whose virtual time a test skips forward in big steps, with
fault injection and assertions.
"""

from __future__ import annotations

from .._step_faults import InjectedFault
from ._eventually import eventually
from .clock import VirtualClock
from .env import TestEnv
from .replay import ReplayMismatch, ReplayReport, assert_replayable

__all__ = [
    "InjectedFault",
    "ReplayMismatch",
    "ReplayReport",
    "TestEnv",
    "VirtualClock",
    "assert_replayable",
    "eventually",
]
