"""The ``redis://`` transport: BullMQ queues and Redis pub/sub, on the upstream wire.

Speaks what the upstream engines and their workers (``durable-worker`` on PyPI,
the TypeScript runtimes) speak, so any of them can serve a ``ctx.step``:

- Step tasks go to the BullMQ queue ``{P}-tasks-{group}`` (job name ``task``,
  ``removeOnComplete``, failed jobs kept a day), results to ``{P}-results``
  (job name ``result``), both with BullMQ's default key prefix ``bull``.
  ``P`` is the prefix (``durable``), or ``{prefix}-{namespace}`` for an
  upstream namespace other than ``default``. ``group`` is the routing token
  (:func:`durably.wire.routing_token`): the engine's own ``namespace=`` is the
  upstream *partition*, the ``@…`` suffix of the token.
- BullMQ's competing consumers give each task to one server and each result
  to one engine instance (whichever takes it first): a result is settled
  once. A server that dies holding a task has it redelivered by BullMQ's
  stalled-job check; a task that stalls again, or fails in BullMQ for any
  other reason, is answered with a retryable failure (as the upstream workers'
  "failure bridge" does), so the engine's retry policy decides what follows.
- Jobs are added, taken and finished with BullMQ's own Lua scripts on
  BullMQ's keys, many per script call (:mod:`._batched`, :mod:`._looped`):
  ``moveToActive``, ``moveToFinished`` and the add scripts run unchanged as
  Lua functions called once per job by a short loop, the queue's keys sent
  once per call. A consumer takes as many jobs as it has room for in one
  call, finishes the jobs done meanwhile in one call, and every caller's
  tasks and results go out in one ``MULTI`` (one call per queue). Results
  are settled a fetch at a time. Locks, their renewal and the stalled-job
  check are bullmq's worker's.
- Within one instance: tasks for a group it serves, with room, are taken by
  its worker in the ``MULTI`` that adds them (BullMQ's ``moveToActive``, a
  lock token of that worker's each: other consumers see what a fetch right
  after the add would leave, and a crash leaves them to the stalled-job
  check); a result its server produces while it consumes results is settled
  here instead of going on ``{P}-results`` (queued after all if that settle
  fails), before the task job completes.
- Heartbeats are published on ``{P}-heartbeat``: every instance hears every
  beat (the engine throttles what it persists). A durably worker also keeps
  its step's latest beat in ``{P}-step-beat:{stepId}`` for 30 s, so an engine
  instance that starts listening later learns which steps are alive.
  Run-scoped beats (no ``stepId``; remote workflow turns) are ignored here.
- Cancel notices are ``{"from", "kind": "cancel", "runId"}`` on ``{P}-control``;
  the sender's own handlers are told directly and its echo (same ``from``) is
  dropped; malformed notices are logged once per channel. A subscription
  silent for 10 s is pinged, and one that does not answer (or fails) is
  replaced by a new one (the watchdog).
- The fleet's run queue is the BullMQ queue ``{P}-runs`` (``{P}-runs@{pool}``
  for an engine pool other than ``default``): see :mod:`._runs`.
- An engine's transport (``retry_open``) waits for an unreachable Redis at
  :meth:`~RedisTransport.open`: one log line, then retries.
- Priorities are inverted for BullMQ: ``min(2097151, max(1, round(1048576 - p)))``.
  A task without one is queued at the neutral ``p = 0`` rather than
  unprioritised, because BullMQ serves unprioritised jobs before every
  prioritised one (the task JSON itself still omits ``priority``).

A password in the URL is used to connect and never appears in
:attr:`RedisTransport.url`, a log line or an error message.
"""

from __future__ import annotations

from ._names import RedisNames, bullmq_priority
from ._transport import RedisTransport

__all__ = ["RedisNames", "RedisTransport", "bullmq_priority"]
