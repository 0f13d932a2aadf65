"""``resolve_step``: a ``ctx.step`` call with no option of its own takes the
registration's policy exactly as a call naming every option as unset does
(the first skips the lookups: the usual call, on every dispatched step)."""

from __future__ import annotations

import durably
from durably._ops.env import Services
from durably._ops.step import resolve_step
from durably.retry import RetryPolicy


def _services(engine: durably.Engine) -> Services:
    return engine._turns._services  # the wiring's, as ctx.step gets them


async def test_a_call_with_no_options_resolves_as_one_naming_each_option_unset() -> None:
    engine = durably.Engine("memory://", drive=False, consumers="never")
    engine.register_queue("q", concurrency=2)

    @engine.step(
        "slow",
        retries=4,
        backoff="fixed",
        timeout="7s",
        pickup_timeout="3s",
        queue="q",
        priority=5,
        requires=["gpu"],
    )
    def slow(data: int) -> int:
        return data

    @engine.step("plain")
    def plain(data: int) -> int:
        return data

    services = _services(engine)
    unset = {
        key: None
        for key in (
            "retries",
            "backoff",
            "backoff_base",
            "backoff_max",
            "jitter",
            "timeout",
            "pickup_timeout",
            "queue",
            "priority",
        )
    }
    for step in (slow, plain, "served-elsewhere"):
        fast, fast_decode = resolve_step(services, step, {"n": 1}, None, "ctx", {})
        full, full_decode = resolve_step(services, step, {"n": 1}, None, "ctx", unset)
        assert fast == full
        assert fast_decode is full_decode
    slow_call, _ = resolve_step(services, slow, 1, None, None, {})
    assert (slow_call.timeout_ms, slow_call.pickup_ms) == (7000, 3000)
    assert (slow_call.queue, slow_call.priority, slow_call.requires) == ("q", 5, frozenset({"gpu"}))
    assert slow_call.policy.retries == 4 and slow_call.policy.backoff == "fixed"
    elsewhere, _ = resolve_step(services, "served-elsewhere", 1, None, None, {})
    assert elsewhere.policy == RetryPolicy()
    assert (elsewhere.timeout_ms, elsewhere.queue, elsewhere.priority) == (None, None, None)
