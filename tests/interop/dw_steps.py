"""A ``durable-worker`` 0.26.1 step worker, run by the interop virtualenv's Python.

Not imported by the test suite (durable-worker pins bullmq 2.17, which cannot
share a virtualenv with durably's bullmq 3): ``test_durable_worker.py`` starts
it as a process. Usage: ``python dw_steps.py REDIS_URL PREFIX CONCURRENCY [NAMESPACE [PARTITION]]``.
Prints ``READY`` once every step queue is consumed, and one line per notable
event (``started slow <runId>``, ``stopped slow <runId> <i>``) for the tests
to follow.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from durable_worker import FatalError, Worker
from durable_worker.redis_runner import run_redis_worker

_flaky_calls: dict[str, int] = {}


def say(line: str) -> None:
    print(line, flush=True)


def build(partition: str | None) -> Worker:
    steps = Worker(auto_register=False)

    @steps.step("py-echo")
    def py_echo(data: Any, ctx: Any) -> Any:
        ctx.info("echoing", {"n": data["n"]})
        return {"echoed": data, "runtime": "python", "nPlusOne": data["n"] + 1}

    @steps.step("payments:charge")
    def charge(data: Any) -> Any:
        raise FatalError("card declined", code="declined", details={"last4": "4242"})

    @steps.step("flaky")
    def flaky(data: Any) -> Any:
        key = data["key"]
        _flaky_calls[key] = _flaky_calls.get(key, 0) + 1
        if _flaky_calls[key] <= data["failures"]:
            raise RuntimeError(f"transient boom {_flaky_calls[key]}")
        return {"calls": _flaky_calls[key]}

    @steps.step("slow", blocking=True)
    def slow(data: Any, ctx: Any) -> Any:
        say(f"started slow {data['key']}")
        for i in range(600):
            if ctx.cancelled:
                say(f"stopped slow {data['key']} {i}")
                return {"stoppedEarly": True, "i": i}
            time.sleep(0.05)
        return {"stoppedEarly": False}

    return steps


async def main() -> None:
    url, prefix, concurrency = sys.argv[1], sys.argv[2], int(sys.argv[3])
    namespace = sys.argv[4] if len(sys.argv) > 4 else "default"
    partition = sys.argv[5] if len(sys.argv) > 5 else None
    handle = await run_redis_worker(
        build(partition),
        connection=url,
        prefix=prefix,
        namespace=namespace,
        partition=partition,
        concurrency=concurrency,
    )
    say("READY")
    try:
        await asyncio.Event().wait()
    finally:
        await handle.close()


if __name__ == "__main__":
    asyncio.run(main())
