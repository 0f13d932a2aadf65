"""The hold window's rules (:class:`durably.steps._holds.LiveHolds`), driven
through its bookkeeping: no engine, no clock.

A hold that ran out at the cap while the machine was loaded must not leave a
fast step parked one call in 16 for good (the cascade of bench/RESULTS.md's
``inflight`` section); a step truly slower than the cap must still end up
parked."""

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
    # Held at once, every call, with the window its new latency gives
    # (a nudged average would stay above the cap for several probes).
    assert windows(holds, "step", 3) == [50.0, 50.0, 50.0]


def test_a_probe_heard_after_the_cap_is_only_averaged_in() -> None:
    holds = LiveHolds(lambda: CAP)
    holds.window_ms("step")
    holds.missed("step", CAP)  # average 2 x cap
    windows(holds, "step", _PROBE_EVERY)
    # A result heard past the cap (a settle under way held the turn on).
    holds.heard("step", CAP + 100.0)
    assert windows(holds, "step", _PROBE_EVERY).count(0.0) == _PROBE_EVERY - 1


def test_a_hit_of_a_step_held_as_usual_is_averaged_in() -> None:
    holds = LiveHolds(lambda: CAP)
    holds.window_ms("step")
    holds.heard("step", 20.0)
    holds.heard("step", 60.0)  # 20 + 0.25 * (60 - 20) = 30
    assert holds.window_ms("step") == 120.0


def test_a_window_below_the_cap_may_hold_on_up_to_the_cap() -> None:
    cap = CAP
    holds = LiveHolds(lambda: cap)
    assert holds.longer_ms(50.0) == CAP - 50.0
    assert holds.longer_ms(CAP) == 0.0
    holds.may_hold = lambda: False  # a drain, or the holds' bound reached
    assert holds.longer_ms(50.0) == 0.0
    holds.may_hold = lambda: True
    cap = 0  # holds turned off
    assert holds.longer_ms(50.0) == 0.0
