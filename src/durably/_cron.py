"""Cron windows in an IANA time zone, with daylight-saving changes resolved here.

croniter is asked only about naive wall-clock times (plain calendar arithmetic,
the same in every croniter release); mapping a wall time to the instants it
names is done with :mod:`zoneinfo`. croniter's own time-zone handling differs
between releases (2.0.7, which ``bullmq`` pins, repeats or drops windows
around DST changes), so it is never used.

The rules (see :mod:`durably.schedules`):

- a wall time skipped when clocks go forward fires at the instant the clocks
  jump (the first valid instant after it), except for expressions firing
  every hour (hour field ``*``), which have no window there;
- a wall time repeated when clocks go back fires at its first occurrence only,
  except for every-hour expressions, which fire at both.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from croniter import CroniterBadDateError, croniter

__all__ = ["every_hour", "latest_at", "next_after"]

_MINUTE = timedelta(minutes=1)
# Offsets are probed this far either side of the instant asked about: a DST
# change within it widens the wall-time search by the change's size. Zones
# change offset at most once in any such span.
_PROBE = timedelta(hours=3)
_SEARCH_LIMIT = 1000


def every_hour(expression: str) -> bool:
    """Whether the expression fires in every hour (hour field ``*``)."""
    hours = croniter(expression).expanded[1]
    return list(hours) == ["*"]


def next_after(expression: str, zone: ZoneInfo, after_ms: int) -> int | None:
    """The first window strictly after ``after_ms`` (``None``: none within croniter's range)."""
    hourly = every_hour(expression)
    margin = _shift_near(zone, after_ms)
    # A wall time before ``after``'s can still name a later instant (its second
    # occurrence) only near a change of offset; the margin covers it.
    wall = _floor_minute(_wall(zone, after_ms) - margin) - _MINUTE
    it = croniter(expression, wall)
    best: int | None = None
    limit: datetime | None = None
    try:
        for _ in range(_SEARCH_LIMIT):
            candidate: datetime = it.get_next(datetime)
            if limit is not None and candidate > limit:
                return best
            found = [ms for ms in _fires(candidate, zone, hourly) if ms > after_ms]
            if found and (best is None or min(found) < best):
                best = min(found)
                # A later wall time can name an earlier instant only within the
                # DST change's size of this one.
                limit = candidate + margin
                if not margin:
                    return best
    except CroniterBadDateError:
        return best
    return best  # pragma: no cover - needs a thousand skipped wall times in a row


def latest_at(expression: str, zone: ZoneInfo, at_ms: int) -> int | None:
    """The last window at or before ``at_ms`` (``None`` if there is none)."""
    hourly = every_hour(expression)
    margin = _shift_near(zone, at_ms)
    wall = _floor_minute(_wall(zone, at_ms) + margin) + _MINUTE
    it = croniter(expression, wall)
    best: int | None = None
    limit: datetime | None = None
    try:
        for _ in range(_SEARCH_LIMIT):
            candidate: datetime = it.get_prev(datetime)
            if limit is not None and candidate < limit:
                return best
            found = [ms for ms in _fires(candidate, zone, hourly) if ms <= at_ms]
            if found and (best is None or max(found) > best):
                best = max(found)
                limit = candidate - margin
                if not margin:
                    return best
    except CroniterBadDateError:
        return best
    return best  # pragma: no cover


def _fires(wall: datetime, zone: ZoneInfo, hourly: bool) -> list[int]:
    """The instants (epoch ms) a matching naive wall time fires at."""
    first = _ms(wall.replace(tzinfo=zone, fold=0))
    second = _ms(wall.replace(tzinfo=zone, fold=1))
    if first == second:
        return [first]
    if first < second:  # repeated when clocks went back
        return [first, second] if hourly else [first]
    # Skipped when clocks went forward: ``fold=1`` reads it with the later
    # offset (an instant before the jump), ``fold=0`` with the earlier one (after).
    return [] if hourly else [_jump(zone, second, first)]


def _jump(zone: ZoneInfo, before_ms: int, after_ms: int) -> int:
    """The instant in ``(before_ms, after_ms]`` the zone's offset changes."""
    offset = _offset(zone, before_ms)
    lo, hi = before_ms // 1000, -(-after_ms // 1000)
    while hi - lo > 1:  # offsets change on whole seconds
        mid = (lo + hi) // 2
        if _offset(zone, mid * 1000) == offset:
            lo = mid
        else:
            hi = mid
    return hi * 1000


def _shift_near(zone: ZoneInfo, at_ms: int) -> timedelta:
    """How far the zone's offset moves within a few hours of ``at_ms`` (zero mostly)."""
    span = int(_PROBE.total_seconds() * 1000)
    offsets = [_offset(zone, at_ms + d) for d in (-span, 0, span)]
    return max(offsets) - min(offsets)


def _offset(zone: ZoneInfo, at_ms: int) -> timedelta:
    offset = datetime.fromtimestamp(at_ms / 1000, zone).utcoffset()
    assert offset is not None
    return offset


def _wall(zone: ZoneInfo, at_ms: int) -> datetime:
    """The naive local wall time at an instant."""
    return datetime.fromtimestamp(at_ms / 1000, UTC).astimezone(zone).replace(tzinfo=None)


def _floor_minute(wall: datetime) -> datetime:
    return wall.replace(second=0, microsecond=0)


def _ms(moment: datetime) -> int:
    return round(moment.timestamp() * 1000)
