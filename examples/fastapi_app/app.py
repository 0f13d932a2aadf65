"""A FastAPI service on durably: the engine runs in the app's lifespan, and the
request handlers start and steer runs through a ``durably.Client``.

    pip install -e '.[postgres]' fastapi uvicorn
    export DURABLY_DATABASE_URL=postgresql://localhost/app   # or sqlite:///app.db
    uvicorn app:app --app-dir examples/fastapi_app --workers 2

    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"id": "o-1", "total": 1200}'
    curl -X POST localhost:8000/orders/o-1/approve -d '{"by": "ada"}' \\
         -H 'content-type: application/json'
    curl localhost:8000/orders/o-1/result

Every worker process runs one engine; all of them share the store, so any
process executes any run and a request can land on any worker.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel

import durably


class Order(BaseModel):
    id: str
    total: int


class Approval(BaseModel):
    by: str


async def checkout(ctx: durably.WorkflowContext, order: Order) -> dict[str, Any]:
    """Reserve, wait for a person's approval (durably: days, restarts), charge."""
    slot = await ctx.local_step("reserve", reserve, order.id)
    approval = await ctx.wait_for_signal(f"approve:{order.id}", timeout="7d")
    charged = await ctx.local_step("charge", charge, order.total)
    return {"order": order.id, "slot": slot, "approved_by": approval["by"], "charged": charged}


def reserve(order_id: str) -> dict[str, Any]:
    return {"order": order_id, "pid": os.getpid()}


def charge(total: int) -> int:
    return total


def create_app(store: str | None = None) -> FastAPI:
    """The app on ``store`` (default: ``DURABLY_DATABASE_URL``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The engine executes runs in this process for the app's lifetime;
        # handlers are producers: a Client starts and steers runs by name.
        engine = durably.Engine(store)
        engine.register("checkout", checkout, input=Order)
        async with engine, durably.Client(store, schemas={"checkout": Order}) as client:
            app.state.client = client
            yield

    app = FastAPI(lifespan=lifespan)

    def client_of(request: Request) -> durably.Client:
        client: durably.Client = request.app.state.client
        return client

    @app.post("/orders", status_code=202)
    async def place(order: Order, request: Request) -> dict[str, Any]:
        # Idempotent by run id: a retried POST returns the same run.
        handle = await client_of(request).start("checkout", order, run_id=f"checkout:{order.id}")
        return {"run_id": handle.run_id, "pid": os.getpid()}

    @app.post("/orders/{order_id}/approve")
    async def approve(order_id: str, approval: Approval, request: Request) -> dict[str, Any]:
        delivered_to = await client_of(request).signal(f"approve:{order_id}", approval.model_dump())
        return {"delivered_to": delivered_to}

    @app.get("/orders/{order_id}")
    async def status(order_id: str, request: Request) -> dict[str, Any]:
        run = await client_of(request).get_run(f"checkout:{order_id}")
        if run is None:
            raise HTTPException(404, f"no order {order_id!r}")
        return {"status": run.status, "output": run.output, "error": run.error}

    @app.get("/orders/{order_id}/result")
    async def result(order_id: str, request: Request, timeout: float = 10) -> dict[str, Any]:
        try:
            handle = await client_of(request).get_handle(f"checkout:{order_id}")
            return {"output": await handle.result(timeout=timeout)}
        except durably.RunNotFound:
            raise HTTPException(404, f"no order {order_id!r}") from None
        except TimeoutError:
            raise HTTPException(409, "not finished yet") from None
        except durably.RunFailed as failed:
            raise HTTPException(422, failed.error) from None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "pid": os.getpid()}

    return app


app = create_app()
