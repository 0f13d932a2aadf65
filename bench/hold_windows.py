"""What the held steps' windows decided: ``dispatch_counts.py``'s run, with the holds'
bookkeeping (``durably.steps._holds.LiveHolds``) counted per hold.

    python hold_windows.py --db sqlite --transport db --n 1000 --k 5
    PYTHONPATH=/tmp/before/src python hold_windows.py ...   # another tree (before/after)

Each hold is followed from the window it was given (``window_ms``: 0, the cap, or a window
below the cap) to how it ended: heard within that window, heard after the window ran out and
was held on to the cap (``longer_ms``, where the tree has it), missed (at its window, or at the
cap after holding on), or neither (released). A turn's window, its holding on and its outcome
run in the turn's task, so the task keys the hold. Counted over the whole run, warm-up
included; the same other output as ``dispatch_counts.py``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from typing import Any

import dispatch_counts

_events: Counter[str] = Counter()
_open: dict[int, list[Any]] = {}  # task id -> [window, held on to, step name]
_late_ms: list[float] = []


def _key() -> int:
    return id(asyncio.current_task())


def _patch() -> None:
    from durably.steps._holds import LiveHolds

    window_ms, heard, missed = LiveHolds.window_ms, LiveHolds.heard, LiveHolds.missed
    longer_ms = getattr(LiveHolds, "longer_ms", None)

    def counted_window(self: LiveHolds, name: str) -> float:
        window = window_ms(self, name)
        cap = float(self.cap_ms())
        if window <= 0:
            _events["window 0 (bound or off)" if not self.may_hold() else "window 0 (slow)"] += 1
        else:
            _events["window = cap" if window >= cap else "window < cap"] += 1
            _open[_key()] = [window, None, name]
        return window

    def counted_heard(self: LiveHolds, name: str, latency_ms: float) -> None:
        hold = _open.pop(_key(), None)
        if hold is not None:
            window, longer = hold[0], hold[1]
            kind = "< cap" if window < float(self.cap_ms()) else "= cap"
            if latency_ms <= window:
                _events[f"hit within window ({kind})"] += 1
            else:
                _events[f"hit after window ran out ({kind}, held on: {longer is not None})"] += 1
                if window < float(self.cap_ms()):
                    _late_ms.append(latency_ms)
        heard(self, name, latency_ms)

    def counted_missed(self: LiveHolds, name: str, window: float) -> None:
        hold = _open.pop(_key(), None)
        if hold is not None:
            first, longer = hold[0], hold[1]
            if first >= float(self.cap_ms()):
                _events["miss (window = cap)"] += 1
            elif longer:
                _events["miss after holding on to the cap (window < cap)"] += 1
            else:
                _events["miss at the window, not held on (window < cap)"] += 1
        missed(self, name, window)

    LiveHolds.window_ms = counted_window  # type: ignore[method-assign]
    LiveHolds.heard = counted_heard  # type: ignore[method-assign]
    LiveHolds.missed = counted_missed  # type: ignore[method-assign]
    if longer_ms is not None:

        def counted_longer(self: LiveHolds, window: float) -> float:
            more: float = longer_ms(self, window)
            _events["held on to the cap" if more > 0 else "not held on (may_hold false)"] += 1
            hold = _open.get(_key())
            if hold is not None:
                hold[1] = more
            return more

        LiveHolds.longer_ms = counted_longer  # type: ignore[attr-defined]


def _report() -> None:
    print("holds, by window and outcome (whole run, warm-up included):")
    for name, n in sorted(_events.items()):
        print(f"  {n:7d} {name}")
    print(f"  {len(_open):7d} holds with no hit nor miss (released, or still open)")
    if _late_ms:
        late = sorted(_late_ms)
        print(
            "  latency of hits after a window < cap ran out, ms: "
            f"median {late[len(late) // 2]:.1f}, max {late[-1]:.1f}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--db", choices=["sqlite", "postgres"], required=True)
    p.add_argument("--n", type=int, default=600)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--transport", choices=["redis", "db", "local", "inline"], default="redis")
    p.add_argument("--one-at-a-time", action="store_true")
    args = p.parse_args()
    args.sites = args.callbacks = False
    args.cprofile = args.max_held = args.step_concurrency = None
    _patch()
    asyncio.run(dispatch_counts.main(args))
    _report()
