"""Flow-control queues: the caps a dispatched step is admitted under.

A queue bounds how many steps run at once (``concurrency``) and how many start
per period (``rate``) across every instance sharing the store; the slots live
in the store, so the cap holds for the fleet, not per process.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..durations import Duration, to_ms

__all__ = ["FlowQueue"]


@dataclass(frozen=True, slots=True)
class FlowQueue:
    """A flow-control queue registered with ``engine.register_queue``."""

    name: str
    concurrency: int | None
    rate_limit: int | None
    rate_period_ms: int
    retry_ms: int

    @classmethod
    def build(
        cls,
        name: str,
        concurrency: int | None,
        rate: tuple[int, Duration] | None,
        retry: Duration,
    ) -> FlowQueue:
        """Validate ``engine.register_queue``'s arguments."""
        if not isinstance(name, str) or not name:
            raise ValueError("a queue needs a non-empty name")
        if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
            raise ValueError(f"queue {name!r}: concurrency must be an int >= 1")
        limit, period = (None, 1000) if rate is None else (rate[0], to_ms(rate[1], name="rate"))
        if limit is not None and (not isinstance(limit, int) or limit < 1 or period < 1):
            raise ValueError(f"queue {name!r}: rate must be (count >= 1, period > 0)")
        if concurrency is None and limit is None:
            raise ValueError(f"queue {name!r}: give concurrency=, rate= or both")
        return cls(name, concurrency, limit, period, to_ms(retry, name="retry"))
