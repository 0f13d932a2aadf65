"""The hold window's rules (:class:`durably.steps._holds.LiveHolds`), driven
through its bookkeeping: no engine, no clock.

A hold that ran out at the cap while the machine was loaded must not leave a
fast step parked one call in 16 for good (the cascade of bench/RESULTS.md's
``inflight`` section); a step truly slower than the cap must still end up
parked; and a step that is held is held up to the cap, whatever its average
(the average decides whether to hold, not how long)."""

from __future__ import annotations

from durably.steps._holds import _PROBE_EVERY, LiveHolds

CAP = 250


def windows(holds: LiveHolds, name: str, calls: int) -> list[float]:
    return [holds.window_ms(name) for _ in range(calls)]


def test_a_step_that_keeps_missing_the_cap_ends_up_parked() -> None:
    holds = LiveHolds(lambda: CAP)
    assert holds.window_ms("slow") == CAP  # first call: learn its latency
    holds.missed("slow", CAP)
    # Probes (held one call in _PROBE_EVERY, at the cap) keep missing.
    for _ in range(5):
        seen = windows(holds, "slow", _PROBE_EVERY)
        assert seen.count(0.0) == _PROBE_EVERY - 1
        assert seen[-1] == CAP
        holds.missed("slow", CAP)
    assert holds.misses == 6


def test_a_probe_heard_within_the_cap_holds_the_step_again() -> None:
    holds = LiveHolds(lambda: CAP)
    for _ in range(3):  # a fast step
        holds.window_ms("step")
        holds.heard("step", 2.0)
    # A burst: holds run out at the cap, and the step is held one call in 16.
    for _ in range(4):
        holds.missed("step", CAP)
    assert windows(holds, "step", _PROBE_EVERY - 1) == [0.0] * (_PROBE_EVERY - 1)
    assert holds.window_ms("step") == CAP  # the probe
    holds.heard("step", 3.0)
    # Held at once, every call, up to the cap (a nudged average would stay
    # above the cap for several probes).
    assert windows(holds, "step", 3) == [CAP, CAP, CAP]


def test_a_probe_heard_after_the_cap_is_only_averaged_in() -> None:
    holds = LiveHolds(lambda: CAP)
    holds.window_ms("step")
    holds.missed("step", CAP)  # average 2 x cap
    windows(holds, "step", _PROBE_EVERY)
    # A result heard past the cap (a settle under way held the turn on).
    holds.heard("step", CAP + 100.0)
    assert windows(holds, "step", _PROBE_EVERY).count(0.0) == _PROBE_EVERY - 1


def test_a_step_known_fast_is_held_up_to_the_cap() -> None:
    """Its average decides whether it is held, not how long: a window sized
    to its usual latency runs out when the machine is loaded, not the step."""
    holds = LiveHolds(lambda: CAP)
    for _ in range(3):
        assert holds.window_ms("step") == CAP
        holds.heard("step", 2.0)
    assert windows(holds, "step", _PROBE_EVERY) == [CAP] * _PROBE_EVERY


def test_hits_slower_than_the_cap_are_averaged_in() -> None:
    """Results heard past the cap (a settle under way held the turn on)
    count: a step answering that slowly ends up parked, probed one in 16."""
    holds = LiveHolds(lambda: CAP)
    holds.window_ms("step")
    holds.heard("step", 2.0)
    for _ in range(3):  # 2 -> 126.5 -> 188 -> 266 ms
        assert holds.window_ms("step") == CAP
        holds.heard("step", 2.0 * CAP)
    assert windows(holds, "step", _PROBE_EVERY).count(0.0) == _PROBE_EVERY - 1


def test_no_window_past_the_bound_or_with_holds_off() -> None:
    cap = CAP
    holds = LiveHolds(lambda: cap)
    holds.may_hold = lambda: False  # a drain, or the holds' bound reached
    assert holds.window_ms("step") == 0.0
    holds.may_hold = lambda: True
    assert holds.window_ms("step") == CAP
    cap = 0  # holds turned off
    assert holds.window_ms("step") == 0.0
