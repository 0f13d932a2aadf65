"""Where durably gets the time: the system clock, or a virtual one in tests."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """The engine's only source of time. Timers, leases, retries and deadlines
    all read it, so a test can swap in :class:`durably.testing.VirtualClock`."""

    def now_ms(self) -> int:
        """Epoch milliseconds."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""
        ...


def wall_ms() -> int:
    """Epoch milliseconds of the wall clock (message leases and worker-side
    timestamps, which no virtual clock governs)."""
    return int(time.time() * 1000)


class SystemClock:
    """Wall-clock time and real ``asyncio.sleep``."""

    def now_ms(self) -> int:
        """Epoch milliseconds from ``time.time()``."""
        return wall_ms()

    async def sleep(self, seconds: float) -> None:
        """``asyncio.sleep``."""
        await asyncio.sleep(max(0.0, seconds))
