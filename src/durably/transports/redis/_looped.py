"""BullMQ's add and finish scripts looped server-side: many jobs per script call.

A pipeline of one ``EVALSHA`` per job already costs one round trip per batch,
but each call repeats the queue's keys (14 for ``moveToFinished``, 9 for an
add) and redis-py encodes every argument in Python: most of what a finished
or added job cost us. Here BullMQ's script text runs, unchanged, as a local
Lua function called once per job by a short loop (as :func:`._batched.take_script`
does for ``moveToActive``); the queue's keys and what its jobs share go once
per call, and each job adds only its own few arguments. Each job's call gets
exactly the KEYS and ARGV bullmq would send for it (tests compare them with
bullmq's own), so BullMQ workers and producers, the upstream ``durable-worker``
among them, see the same keys, hashes and events.

Each job runs under ``pcall``: a job whose call raises gets its error as its
own reply, and the jobs after it still run (as separate calls would).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]  # bullmq's own dependency

from ._batched import Call, Script, _wrapped

CALL_MAX = 100
"""Jobs per looped script call at most (Redis runs nothing else meanwhile)."""

# One reply per job: an error as an error reply, a nil (no reply) as false
# so the array keeps its length.
_EACH = """
  if ok then
    if got == nil then got = false end
    replies[i] = got
  elseif type(got) == 'table' and got.err then
    replies[i] = got
  else
    replies[i] = {err = tostring(got)}
  end
"""

_FINISH_TAIL = f"""
-- KEYS: moveToFinished's 1-11, its metrics and marker keys (its 13 and 14),
-- then each job's key (its 12). ARGV: its timestamp, property, target,
-- fetch-next and prefix (2, 3, 5, 6, 7), then per job its id, value, opts
-- (1, 4, 8).
local replies = {{}}
for i = 1, #KEYS - 13 do
  local keys = {{}}
  for k = 1, 11 do keys[k] = KEYS[k] end
  keys[12] = KEYS[13 + i]
  keys[13] = KEYS[12]
  keys[14] = KEYS[13]
  local at = 5 + 3 * (i - 1)
  local argv = {{ARGV[at + 1], ARGV[1], ARGV[2], ARGV[at + 2], ARGV[3], ARGV[4], ARGV[5],
    ARGV[at + 3]}}
  local ok, got = pcall(bullmq_move_to_finished, keys, argv)
{_EACH}
end
return replies
"""

_ADD_TAIL = f"""
-- KEYS: the add script's own (all the queue's). ARGV: the packed arguments
-- and the timestamp every job shares (its 1 and 4), then per job its data
-- and packed opts (2 and 3).
local replies = {{}}
for i = 1, (#ARGV - 2) / 2 do
  local argv = {{ARGV[1], ARGV[1 + 2 * i], ARGV[2 + 2 * i], ARGV[2]}}
  local ok, got = pcall(bullmq_add_job, KEYS, argv)
{_EACH}
end
return replies
"""

_ADD_EACH_TAIL = f"""
-- KEYS: the add script's own (all the queue's). ARGV: the timestamp every
-- job shares (its 4), then per job its packed arguments, data and packed
-- opts (1, 2 and 3): jobs of their own ids (runs' starts) differ in the first.
local replies = {{}}
for i = 1, (#ARGV - 1) / 3 do
  local at = 2 + 3 * (i - 1)
  local argv = {{ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[1]}}
  local ok, got = pcall(bullmq_add_job, KEYS, argv)
{_EACH}
end
return replies
"""

_FINISH_KEYS = (
    "wait", "active", "prioritized", "events", "stalled", "limiter", "delayed", "paused",
    "meta", "pc",
)  # fmt: skip


@functools.cache
def finish_script(move_to_finished: Script) -> Script:
    """BullMQ's ``moveToFinished`` run once per job of the call (see :func:`finish_call`)."""
    return _wrapped("bullmq_move_to_finished", move_to_finished, _FINISH_TAIL)


@functools.cache
def add_script(add_job: Script) -> Script:
    """BullMQ's ``addStandardJob`` or ``addPrioritizedJob`` run once per job
    of the call (see :func:`add_call`)."""
    return _wrapped("bullmq_add_job", add_job, _ADD_TAIL)


@functools.cache
def add_each_script(add_job: Script) -> Script:
    """BullMQ's ``addStandardJob`` or ``addPrioritizedJob`` run once per job
    of the call, each job with packed arguments of its own (its id: see
    :func:`add_each_call`)."""
    return _wrapped("bullmq_add_job", add_job, _ADD_EACH_TAIL)


def finish_call(
    script: Script,
    keys: dict[str, str],
    jobs: Sequence[tuple[str, str, bytes]],
    timestamp: int,
    target: str = "completed",
) -> Call:
    """The :func:`finish_script` call finishing ``jobs`` (id, value, packed
    opts: what :func:`finished_opts` makes) as ``target`` (``completed``: the
    value is the return value; ``failed``: the failure reason)."""
    prop = "returnvalue" if target == "completed" else "failedReason"
    prefix = keys[""]
    call_keys = [keys[name] for name in _FINISH_KEYS]
    call_keys += [keys[target], f"{prefix}metrics:{target}", keys["marker"]]
    call_keys += [f"{prefix}{job_id}" for job_id, _, _ in jobs]
    args: list[Any] = [timestamp, prop, target, "", prefix]
    for job_id, value, opts in jobs:
        args += [job_id, value, opts]
    return Call(script, call_keys, args)


def finished_opts(
    token: str,
    remove: bool | int | dict[str, Any] | None,
    queue_opts: dict[str, Any],
    job_opts: dict[str, Any],
    attempts: int,
    attempts_made: int,
) -> bytes:
    """``moveToFinished``'s packed opts (its ARGV 8), as bullmq packs them."""
    metrics = queue_opts.get("metrics")
    shape = (
        repr(remove),
        repr(queue_opts.get("limiter")),
        queue_opts.get("lockDuration"),
        attempts,
        attempts_made,
        metrics.get("maxDataPoints", "") if metrics is not None else "",
        job_opts.get("failParentOnFailure", False),
        job_opts.get("continueParentOnFailure", False),
        job_opts.get("ignoreDependencyOnFailure", False),
        job_opts.get("removeDependencyOnFailure", False),
    )
    parts = _FINISHED_PARTS.get(shape)
    if parts is None:
        parts = _finished_parts(remove, queue_opts, job_opts, attempts, attempts_made)
        if len(_FINISHED_PARTS) >= 256:
            _FINISHED_PARTS.clear()
        _FINISHED_PARTS[shape] = parts
    # A msgpack map is its header then its pairs in order: the token's pair
    # comes first, so only the token is packed per job (the bytes are bullmq's).
    token_packed: bytes = msgpack.packb(token, use_bin_type=True)
    return parts[0] + token_packed + parts[1]


_FINISHED_PARTS: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
"""Packed ``moveToFinished`` opts before and after the token, per shape
(the jobs a worker finishes share one)."""


def _finished_parts(
    remove: bool | int | dict[str, Any] | None,
    queue_opts: dict[str, Any],
    job_opts: dict[str, Any],
    attempts: int,
    attempts_made: int,
) -> tuple[bytes, bytes]:
    keep: dict[str, Any]
    if isinstance(remove, bool) or remove is None:
        keep = {"count": 0} if remove else {"count": -1}
    elif isinstance(remove, int):
        keep = {"count": remove}
    else:
        keep = remove
    metrics = queue_opts.get("metrics")
    whole: bytes = msgpack.packb(
        {
            "token": "",
            "keepJobs": keep,
            "limiter": queue_opts.get("limiter"),
            "lockDuration": queue_opts.get("lockDuration"),
            "attempts": attempts,
            "attemptsMade": attempts_made,
            "maxMetricsSize": metrics.get("maxDataPoints", "") if metrics is not None else "",
            "fpof": job_opts.get("failParentOnFailure", False),
            "cpof": job_opts.get("continueParentOnFailure", False),
            "idof": job_opts.get("ignoreDependencyOnFailure", False),
            "rdof": job_opts.get("removeDependencyOnFailure", False),
        },
        use_bin_type=True,
    )
    # the map's header and the key "token", the empty token (one byte), the rest
    head = len(msgpack.packb("token", use_bin_type=True)) + 1
    assert whole[head : head + 1] == msgpack.packb("", use_bin_type=True)
    return whole[:head], whole[head + 1 :]


def add_call(script: Script, keys: Sequence[str], packed: bytes, timestamp: int,
             jobs: Sequence[tuple[str, bytes]]) -> Call:  # fmt: skip
    """The :func:`add_script` call adding ``jobs`` (data JSON, packed opts)
    that share the packed arguments ``packed`` (name, timestamp…)."""
    args: list[Any] = [packed, timestamp]
    for data, opts in jobs:
        args += [data, opts]
    return Call(script, keys, args)


def add_each_call(script: Script, keys: Sequence[str], timestamp: int,
                  jobs: Sequence[tuple[bytes, str, bytes]]) -> Call:  # fmt: skip
    """The :func:`add_each_script` call adding ``jobs`` (packed arguments,
    data JSON, packed opts) that share the timestamp ``timestamp``."""
    args: list[Any] = [timestamp]
    for packed, data, opts in jobs:
        args += [packed, data, opts]
    return Call(script, keys, args)
