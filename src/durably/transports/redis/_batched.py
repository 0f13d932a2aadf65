"""BullMQ's job state changes, many per round trip, with BullMQ's own Lua.

The ``bullmq`` Python worker takes one job per ``moveToActive`` call and
finishes one per ``moveToFinished`` call, each a round trip of its own, and
its queue adds jobs in a transaction preceded by a ``SCRIPT EXISTS`` round
trip. On the step path that is most of a dispatched step's cost. This module
does the same state changes, with the same scripts on the same keys (so any
BullMQ worker or producer, the upstream ``durable-worker`` among them, sees
exactly what it would see from bullmq), in fewer round trips:

- :func:`take_script`: BullMQ's ``moveToActive`` script run up to ``n`` times
  in one script call, stopping at the first miss (each job gets its own lock
  token);
- :func:`run_scripts`: any number of BullMQ script calls in one pipeline
  (``EVALSHA`` only, scripts loaded again after a ``SCRIPT FLUSH`` or a
  restart);
- :class:`Collector`: gathers calls made while the previous batch is written,
  one write per batch, each caller told its own outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import hiredis
import msgpack  # type: ignore[import-untyped]  # bullmq's own dependency
import redis.asyncio as aioredis
from bullmq.job import optsEncodeMap
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

_T = TypeVar("_T")
_R = TypeVar("_R")

_TAKE_TAIL = """
local take_opts = cmsgpack.unpack(ARGV[3])
local take_base = take_opts['token']
local take_argv = {ARGV[1], ARGV[2], ARGV[3]}
local taken = {}
for i = 1, tonumber(ARGV[4]) do
  take_opts['token'] = take_base .. ':' .. i
  take_argv[3] = cmsgpack.pack(take_opts)
  local got = bullmq_move_to_active(KEYS, take_argv)
  taken[#taken + 1] = got
  if type(got[1]) ~= 'table' then
    break
  end
end
-- Nothing left waiting: consume the wake-up marker (as the BZPOPMIN a
-- BullMQ worker blocks on next would), so this worker blocks at once instead
-- of popping the marker its own take put back, and no other worker wakes for
-- a job taken here (an add and a take in one transaction: see _add_jobs).
if redis.call('LLEN', KEYS[1]) == 0 and redis.call('ZCARD', KEYS[3]) == 0 then
  redis.call('ZREM', KEYS[11], '0')
end
return taken
"""


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script's text and SHA1 (what ``EVALSHA`` names it by)."""

    text: str
    sha: str

    @classmethod
    def of(cls, registered: Any) -> Script:
        """From a redis-py registered script (bullmq's ``commands[...]``)."""
        sha = str(registered.sha)
        known = _KNOWN.get(sha)
        if known is None:
            text = registered.script
            known = _KNOWN[sha] = cls(text if isinstance(text, str) else text.decode(), sha)
        return known


_KNOWN: dict[str, Script] = {}
"""Scripts by SHA (bullmq's are the same few for every queue)."""


def _wrapped(name: str, script: Script, tail: str) -> Script:
    """BullMQ's script as a local function ``name`` (its KEYS and ARGV as
    parameters, so its body runs unchanged), then ``tail`` calling it."""
    text = f"local function {name}(KEYS, ARGV)\n{script.text}\nend\n{tail}"
    return Script(text, hashlib.sha1(text.encode()).hexdigest())


def take_script(move_to_active: Script) -> Script:
    """BullMQ's ``moveToActive`` (same KEYS, ARGV 1-3) run up to ``ARGV[4]``
    times in one call; returns the list of its replies, ending at the first
    that holds no job. The token in the opts (ARGV[3]) gets ``:1``, ``:2``…
    appended, one per job taken. A call that leaves no job waiting removes
    the queue's base marker (``0``; a delayed job's marker ``1`` stays): the
    caller blocks on the marker next, and would otherwise pop the one its
    own take put back (or an add just before it) and take nothing."""
    return _wrapped("bullmq_move_to_active", move_to_active, _TAKE_TAIL)


@dataclass(frozen=True, slots=True)
class Call:
    """One script call: the script, its keys and its arguments."""

    script: Script
    keys: Sequence[Any]
    args: Sequence[Any]


async def run_scripts(
    client: aioredis.Redis,
    calls: Sequence[Call],
    *,
    transaction: bool = False,
    lane: Lane | None = None,
) -> list[Any]:
    """Run ``calls`` in one pipeline; each reply in order, an error as its
    exception (not raised). A call refused because Redis lost the script
    (``NOSCRIPT``: restarted, flushed) did not run: it is loaded and run again.
    With a ``lane``, on its kept connection when it is free (else on one
    from the pool)."""
    replies = await _pipeline(client, calls, transaction, lane)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {calls[i].script for i in missing}:
            await client.script_load(script.text)
        again = await _pipeline(client, [calls[i] for i in missing], transaction, lane)
        for i, reply in zip(missing, again, strict=True):
            replies[i] = reply
    return replies


class Lane:
    """One of a client's pooled connections, kept by a caller that sends a
    batch at a time (a :class:`Collector`'s writer, a worker's fetch loop).

    Taking a connection from redis-py's pool and putting it back per batch
    (its lock, condition, timeout, health check and metrics hooks) was about
    a tenth of a batch's client CPU on the step path. A call made while the
    kept connection is in use (or after :meth:`close`) takes one from the
    pool as before; a client other than the kept connection's (reopened)
    gets a connection of its own."""

    def __init__(self) -> None:
        self._kept: tuple[aioredis.Redis, Any] | None = None
        self._busy = False
        self._retired: aioredis.Redis | None = None

    async def take(self, client: aioredis.Redis) -> Any | None:
        """The kept connection for ``client`` (taken from its pool the first
        time), now in use; None: in use already, or closed for ``client``."""
        if self._busy or client is self._retired:
            return None
        self._busy = True
        try:
            kept = self._kept
            if kept is None or kept[0] is not client:
                self._kept = None
                if kept is not None:
                    await _released(kept)
                conn: Any = await client.connection_pool.get_connection()  # type: ignore[no-untyped-call,unused-ignore]  # untyped in some redis-py
                kept = self._kept = (client, conn)
            else:
                # What the pool checks before lending one: a connection the
                # server closed meanwhile (a restart, an idle timeout) is
                # opened again here, not failed by the batch (no retry).
                await client.connection_pool.ensure_connection(kept[1])  # type: ignore[no-untyped-call,unused-ignore]  # untyped in some redis-py
        except BaseException:
            self._busy = False
            raise
        return kept[1]

    async def put_back(self, client: aioredis.Redis, conn: Any) -> None:
        """Done with ``conn`` (from :meth:`take`): kept for the next batch,
        or back to the pool if the lane was closed meanwhile."""
        self._busy = False
        kept = self._kept
        if kept is None or kept[1] is not conn:
            await _released((client, conn))

    async def close(self) -> None:
        """Give the kept connection back to its pool (once it is free);
        calls for its client take pooled ones from now on, so a client
        closing next closes every connection it lent."""
        kept, self._kept = self._kept, None
        if kept is not None:
            self._retired = kept[0]
            if not self._busy:
                await _released(kept)


async def _released(kept: tuple[aioredis.Redis, Any]) -> None:
    with contextlib.suppress(Exception):
        await kept[0].connection_pool.release(kept[1])


_MULTI = hiredis.pack_command(("MULTI",))
_EXEC = hiredis.pack_command(("EXEC",))


async def _pipeline(
    client: aioredis.Redis, calls: Sequence[Call], transaction: bool, lane: Lane | None
) -> list[Any]:
    """The calls as one write (in ``MULTI``/``EXEC`` if ``transaction``), their
    replies in order, an error reply as its exception.

    What redis-py's ``Pipeline`` does for these calls, without its per-argument
    encoding in Python (hiredis packs each call whole) and its per-command
    reply callbacks: on the step path that was most of a batch's client CPU.
    A dropped connection is retried whole by the client's retry policy, as
    the ``Pipeline`` does."""
    packed = [
        hiredis.pack_command(("EVALSHA", c.script.sha, len(c.keys), *c.keys, *c.args))
        for c in calls
    ]
    data = b"".join([_MULTI, *packed, _EXEC] if transaction else packed)
    if client.connection_pool.connection_kwargs.get("socket_timeout"):
        return await _on_connection(client, data, len(calls), transaction, lane)
    # A batch client's (batch_client): one deadline for taking a connection
    # (connecting, its handshake) and the exchange, as redis-py's socket
    # timeout bounds each of those on other clients.
    try:
        async with asyncio.timeout(BATCH_TIMEOUT_S):
            return await _on_connection(client, data, len(calls), transaction, lane)
    except TimeoutError:
        raise RedisTimeoutError(f"no answer from Redis within {BATCH_TIMEOUT_S} s") from None


async def _on_connection(
    client: aioredis.Redis, data: bytes, count: int, transaction: bool, lane: Lane | None
) -> list[Any]:
    conn = None if lane is None else await lane.take(client)
    if conn is not None:
        try:
            return await _exchange_retried(conn, data, count, transaction)
        finally:
            assert lane is not None
            await lane.put_back(client, conn)
    pool = client.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call,unused-ignore]  # untyped in some redis-py
    try:
        return await _exchange_retried(conn, data, count, transaction)
    finally:
        await pool.release(conn)


BATCH_TIMEOUT_S = 5.0
"""How long one batch (taking a connection, its write and every reply) may
take on a :func:`batch_client`; redis-py's default socket timeout."""


def batch_client(url: str) -> aioredis.Redis:
    """A client for :func:`run_scripts` only: its connections have no socket
    timeout of their own (unless the URL sets one), and each batch gets one
    deadline (:data:`BATCH_TIMEOUT_S`) instead.

    With a socket timeout, redis-py sends each write through ``wait_for``
    (a task of its own per write) and reads each reply under a timeout of
    its own (a MULTI of two calls reads five): a third of a small batch's
    client CPU, on every batch of the step path. Its pool is not bounded:
    each batch writer (the transport's adds, each worker's takes and
    finishes) keeps a connection of it (:class:`Lane`)."""
    pool = aioredis.ConnectionPool.from_url(url, decode_responses=True, socket_timeout=None)
    return aioredis.Redis.from_pool(pool)  # aclose() closes the pool too


async def _exchange_retried(conn: Any, data: bytes, count: int, transaction: bool) -> list[Any]:
    replies: list[Any] = await conn.retry.call_with_retry(
        lambda: _exchange(conn, data, count, transaction),
        lambda _error: conn.disconnect(),
    )
    return replies


async def _exchange(conn: Any, data: bytes, count: int, transaction: bool) -> list[Any]:
    await conn.send_packed_command(data)
    replies: list[Any] = []
    try:
        if not transaction:
            for _ in range(count):
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            return replies
        # MULTI's OK and each call's QUEUED (or its refusal), then EXEC's array
        # (a call that failed when run is an error in it, not raised).
        refused: BaseException | None = None
        for _ in range(count + 1):
            try:
                await conn.read_response()
            except ResponseError as exc:
                refused = refused or exc
        try:
            done = await conn.read_response()
        except ResponseError:
            if refused is not None:
                raise refused from None
            raise
        if not isinstance(done, list) or len(done) != count:
            raise ResponseError(f"EXEC answered {done!r} for {count} calls")
        return done
    except BaseException:
        # replies of the rest may still be on the socket: never hand it on
        await conn.disconnect(nowait=True)
        raise


def move_to_active_args(
    keys: dict[str, str], token: str, lock_ms: int, n: int
) -> tuple[list[str], list[Any]]:
    """The KEYS and ARGV of :func:`take_script` (those of bullmq's ``moveToActive``, and ``n``)."""
    names = (
        "wait",
        "active",
        "prioritized",
        "events",
        "stalled",
        "limiter",
        "delayed",
        "paused",
        "meta",
        "pc",
        "marker",
    )
    opts = msgpack.packb(
        {"token": token, "lockDuration": lock_ms, "limiter": None}, use_bin_type=True
    )
    return [keys[name] for name in names], [keys[""], round(time.time() * 1000), opts, n]


_ADD_KEYS = {
    "addPrioritizedJob": (
        "marker", "meta", "id", "prioritized", "delayed", "completed", "active", "events", "pc"
    ),
    "addStandardJob": (
        "wait", "paused", "meta", "id", "completed", "delayed", "active", "events", "marker"
    ),
}  # fmt: skip


class AddedJob(NamedTuple):
    """What bullmq's ``Queue.add`` would send for one job, taken apart: the
    script (``addPrioritizedJob`` or ``addStandardJob``) and its KEYS, then
    its ARGV: the packed arguments (name, timestamp…), the data JSON, the
    packed options and the timestamp."""

    script: Script
    keys: tuple[str, ...]
    packed: bytes
    data: str
    opts: bytes
    timestamp: int


def added_job(
    scripts: Any,
    name: str,
    data: Any,
    opts: dict[str, Any],
    timestamp: int | None = None,
    packed_opts: bytes | None = None,
) -> AddedJob:
    """The script call adding a job, as bullmq's ``Queue.add`` would make it
    (a prioritized or a standard job, the same KEYS and ARGV byte for byte),
    without building a bullmq ``Job``; options are packed once per shape
    (``packed_opts``: what :func:`packed_opts` made of ``opts``)."""
    if packed_opts is None:
        packed_opts = packed_job_opts(opts)
    script = "addPrioritizedJob" if opts.get("priority") else "addStandardJob"
    keys = scripts.keys
    prefix = keys[""]
    shape = _ADD_SHAPES.get((prefix, script))
    if shape is None:
        if len(_ADD_SHAPES) >= 1024:
            _ADD_SHAPES.clear()
        shape = _ADD_SHAPES[prefix, script] = (
            Script.of(scripts.commands[script]),
            tuple(keys[k] for k in _ADD_KEYS[script]),
        )
    now = round(time.time() * 1000) if timestamp is None else timestamp
    custom_id = opts.get("jobId") or ""  # the script keeps the first job of an id
    if custom_id:
        # One of its kind (a run's start): cached, it would only push out
        # the arguments a burst of tasks shares.
        packed = msgpack.packb(
            [prefix, custom_id, name, now, None, None, None, None, None], use_bin_type=True
        )
    else:
        args = (prefix, name, now)
        packed = _PACKED_ARGS.get(args)
        if packed is None:
            if len(_PACKED_ARGS) >= 256:
                _PACKED_ARGS.clear()
            packed = _PACKED_ARGS[args] = msgpack.packb(
                [prefix, "", name, now, None, None, None, None, None], use_bin_type=True
            )
    return AddedJob(shape[0], shape[1], packed, compact_json(data), packed_opts, now)


_ADD_SHAPES: dict[tuple[str, str], tuple[Script, tuple[str, ...]]] = {}
"""An add script and its KEYS, per queue (key prefix) and script name."""
_PACKED_ARGS: dict[tuple[str, str, int], bytes] = {}
"""Packed add arguments (the jobs of a burst share a millisecond)."""


def add_job_call(
    scripts: Any, name: str, data: Any, opts: dict[str, Any], timestamp: int | None = None
) -> Call:
    """:func:`added_job` as one call of bullmq's own add script."""
    job = added_job(scripts, name, data, opts, timestamp)
    return Call(job.script, job.keys, [job.packed, job.data, job.opts, job.timestamp])


_PACKED_OPTS: dict[str, bytes] = {}


def packed_job_opts(opts: dict[str, Any]) -> bytes:
    """A job's options as bullmq's add script gets them (its ARGV 3);
    :class:`ValueError` for options only bullmq itself adds jobs with."""
    if any(opts.get(k) for k in ("delay", "parent", "deduplication", "backoff")):
        raise ValueError("such jobs are added through bullmq")
    if "jobId" in opts:
        # One of its kind (a run's start): packed, not cached (see above).
        return _pack_opts(opts)
    shape = repr(opts)  # key order and values: what the packed bytes depend on
    packed = _PACKED_OPTS.get(shape)
    if packed is None:
        packed = _pack_opts(opts)
        if len(_PACKED_OPTS) >= 256:
            _PACKED_OPTS.clear()
        _PACKED_OPTS[shape] = packed
    return packed


def _pack_opts(opts: dict[str, Any]) -> bytes:
    # bullmq's Job fills in these defaults, then Scripts.encodeOpts shortens
    # the names it knows, before packing
    full = {"attempts": 0, "delay": 0, **opts, "backoff": None}
    return bytes(msgpack.packb({optsEncodeMap.get(k, k): v for k, v in full.items()}))


def check_added(reply: Any) -> str:
    """A job id from an add script's reply; raise what bullmq would raise."""
    if isinstance(reply, BaseException):
        raise reply
    if isinstance(reply, int) and reply < 0:
        raise RuntimeError(f"BullMQ refused a job (code {reply})")
    return str(reply)


def parse_taken(reply: Any) -> tuple[list[tuple[dict[str, str], str]], int]:
    """The jobs a :func:`take_script` call took (raw hash, id), and the
    timestamp of the next delayed job (0: none) if it ran dry."""
    jobs: list[tuple[dict[str, str], str]] = []
    delay_until = 0
    for got in reply:
        raw = got[0]
        if isinstance(raw, list):
            jobs.append((dict(zip(raw[::2], raw[1::2], strict=True)), str(got[1])))
        elif len(got) > 3 and got[3]:
            delay_until = int(got[3])
    return jobs, delay_until


_COMPACT = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def compact_json(value: Any) -> str:
    """JSON as bullmq writes it (compact, no NaN)."""
    # One encoder for every call: json.dumps with options builds one per call.
    return _COMPACT(value)


class Collector(Generic[_T, _R]):
    """Gathers items while the previous batch is written: one write per batch
    (up to ``limit`` items). ``write`` returns one outcome per item, an
    exception for an item that failed; each caller of :meth:`add` gets its own."""

    def __init__(
        self,
        write: Callable[[list[_T]], Awaitable[list[_R | BaseException]]],
        limit: int = 500,
        *,
        patient: Callable[[_T], bool] | None = None,
        linger_s: float = 0.0,
    ) -> None:
        self._write = write
        self._limit = limit
        # Items that may wait: a write of such items only waits ``linger_s``
        # for others to go with it.
        self._patient = patient
        self._linger_s = linger_s
        self._lingering: asyncio.Future[None] | None = None
        self._items: list[tuple[_T, asyncio.Future[_R]]] = []
        self._task: asyncio.Task[None] | None = None

    async def add(self, item: _T) -> _R:
        """Queue ``item`` for the next write; its outcome (or its exception)."""
        future: asyncio.Future[_R] = asyncio.get_running_loop().create_future()
        self._items.append((item, future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        elif (
            self._lingering is not None
            and not self._lingering.done()
            and self._patient is not None
            and not self._patient(item)
        ):
            self._lingering.set_result(None)  # an item that may not wait: write now
        return await future

    async def drain(self) -> None:
        """Wait for the writes under way."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _linger(self) -> None:
        """Wait ``linger_s``, or until an item that may not wait is added."""
        loop = asyncio.get_running_loop()
        lingering = self._lingering = loop.create_future()
        timer = loop.call_later(self._linger_s, _wake, lingering)
        try:
            await lingering
        finally:
            timer.cancel()
            self._lingering = None

    async def _run(self) -> None:
        while self._items:
            patient = self._patient
            if patient is not None and all(patient(item) for item, _ in self._items):
                await self._linger()
            batch, self._items = self._items[: self._limit], self._items[self._limit :]
            try:
                outcomes = await self._write([item for item, _ in batch])
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), outcome in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
