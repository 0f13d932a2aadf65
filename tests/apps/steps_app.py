"""The apps the steps-only worker tests serve with ``durably worker``.

``engine`` is built with ``drive=False``: a pure step-worker pool, which serves
the dispatched step ``shout`` and executes no run. ``full_engine`` would
drive runs too (``durably worker --no-drive`` makes it steps-only). Both use
the ``db://`` transport, so a step a run dispatches in another process (the
test's) reaches them through the shared SQLite file.
"""

from __future__ import annotations

import os
from typing import Any

import durably


def shout(text: str) -> dict[str, Any]:
    """The dispatched step: says which process served it."""
    return {"text": f"{text.upper()}!", "pid": os.getpid()}


async def shouting(ctx: durably.WorkflowContext, text: str) -> Any:
    """A workflow dispatching ``shout`` (the tests' driving engine registers it)."""
    return await ctx.step("shout", text)


engine = durably.Engine(transport="db://", drive=False, poll_interval=0.1)
engine.step("shout")(shout)

full_engine = durably.Engine(transport="db://", poll_interval=0.1)
full_engine.step("shout")(shout)
full_engine.workflow("shouting")(shouting)
