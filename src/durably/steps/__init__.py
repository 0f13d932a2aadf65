"""Dispatched steps, named by side.

- :mod:`~durably.steps.definition`: what ``@engine.step`` registers (policy and
  handler) and the :class:`StepLogger` a handler gets; shared by every side.
- ``_dispatcher``: the engine side, sending tasks and settling their results.
- ``_server``: the worker side, running handlers and answering tasks.
- ``_flow``: flow-control queues (``engine.register_queue``).

The workflow side, ``ctx.step``, is :mod:`durably._ops.step`.
"""

from __future__ import annotations

from .definition import StepDecorator, StepDefinition, StepLogger, StepPolicy, StepRef

__all__ = ["StepDecorator", "StepDefinition", "StepLogger", "StepPolicy", "StepRef"]
