"""Failures and crashes a test arranges for steps, by step name.

Each engine holds one :class:`StepFaults`; the code that runs a step (a local
step in a turn, a dispatched step's handler) asks it before every execution.
With nothing arranged that is one counter increment and one dict lookup.
:class:`durably.testing.TestEnv` is what arranges them.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["InjectedFault", "StepFaults"]


class InjectedFault(RuntimeError):
    """The failure a test injected into a step (``TestEnv.fail_step``)."""


class StepFaults:
    """What to do to the next executions of a step, and how often each step ran."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        """Executions started per step name (every attempt counts)."""
        self.crashed: list[str] = []
        """The steps after which a crash was simulated, in order."""
        self._failures: dict[str, list[BaseException]] = {}
        self._crash_after: set[str] = set()

    def adopt(self, other: StepFaults) -> None:
        """Share ``other``'s plans and counts (a restarted process in one test)."""
        self.calls = other.calls
        self.crashed = other.crashed
        self._failures = other._failures
        self._crash_after = other._crash_after

    def fail(self, name: str, times: int, error: BaseException | None = None) -> None:
        """Make the next ``times`` executions of step ``name`` raise ``error``."""
        if not isinstance(times, int) or isinstance(times, bool) or times < 1:
            raise ValueError(f"times must be a positive int, got {times!r}")
        planned = self._failures.setdefault(name, [])
        for n in range(times):
            planned.append(
                error
                if error is not None
                else InjectedFault(f"injected failure {n + 1} of {times} of step {name!r}")
            )

    def crash_after(self, name: str) -> None:
        """Simulate a crash of the process once step ``name`` next completes."""
        self._crash_after.add(name)

    def starting(self, name: str) -> None:
        """Count an execution of step ``name``; raise the failure planned for it, if any."""
        self.calls[name] += 1
        planned = self._failures.get(name)
        if planned:
            raise planned.pop(0)

    def crash_due(self, name: str) -> bool:
        """Whether the process must "crash" now that step ``name`` completed (once)."""
        if name not in self._crash_after:
            return False
        self._crash_after.discard(name)
        self.crashed.append(name)
        return True
