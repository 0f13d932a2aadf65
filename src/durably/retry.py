"""Retry policies for steps: how many attempts, and how long between them."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from .durations import Duration, to_ms

__all__ = ["Backoff", "RetryPolicy"]

Backoff = Literal["exp", "linear", "fixed"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``retries`` more attempts after the first, spaced by ``backoff``.

    The n-th retry waits ``base * 2^(n-1)`` (``"exp"``), ``base * n``
    (``"linear"``) or ``base`` (``"fixed"``), never more than ``max_delay``.
    With ``jitter`` each wait is scaled by a random factor in [0.5, 1] so that
    many runs failing together do not retry in lockstep.
    """

    retries: int = 0
    backoff: Backoff = "exp"
    base_ms: int = 1000
    max_delay_ms: int = 60_000
    jitter: bool = True

    @classmethod
    def build(
        cls,
        retries: int | None = None,
        backoff: str | None = None,
        backoff_base: Duration | None = None,
        backoff_max: Duration | None = None,
        jitter: bool | None = None,
        *,
        default: RetryPolicy | None = None,
    ) -> RetryPolicy:
        """Validate user-facing options, filling gaps from ``default``."""
        if (
            default is not None
            and retries is None
            and backoff is None
            and backoff_base is None
            and backoff_max is None
            and jitter is None
        ):
            return default  # the usual step: the default as it is (frozen, so shared)
        base = default or cls()
        if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)):
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if retries is not None and retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if backoff is not None and backoff not in ("exp", "linear", "fixed"):
            raise ValueError(f"backoff must be 'exp', 'linear' or 'fixed', got {backoff!r}")
        return cls(
            retries=base.retries if retries is None else retries,
            backoff=base.backoff if backoff is None else backoff,  # type: ignore[arg-type]
            base_ms=base.base_ms
            if backoff_base is None
            else to_ms(backoff_base, name="backoff_base"),
            max_delay_ms=(
                base.max_delay_ms if backoff_max is None else to_ms(backoff_max, name="backoff_max")
            ),
            jitter=base.jitter if jitter is None else jitter,
        )

    def delay_ms(self, retry_number: int, rng: random.Random | None = None) -> int:
        """The wait before retry ``retry_number`` (1 for the first retry)."""
        n = max(1, retry_number)
        if self.backoff == "exp":
            raw = self.base_ms * (2 ** min(n - 1, 62))
        elif self.backoff == "linear":
            raw = self.base_ms * n
        else:
            raw = self.base_ms
        delay: int = min(raw, self.max_delay_ms)
        if self.jitter and delay > 0:
            delay = int(delay * (0.5 + 0.5 * (rng or random).random()))
        return delay
