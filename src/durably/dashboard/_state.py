"""What every endpoint shares: the backend, the guard, and opening the store
once (a mounted app's lifespan never runs, so the first request opens it)."""

from __future__ import annotations

from starlette.requests import Request

from ._backend import DashboardBackend, DashboardStore
from ._security import Guard

__all__ = ["DashboardState"]


class DashboardState:
    """The backend and the access rules of one dashboard app."""

    def __init__(self, backend: DashboardBackend, guard: Guard) -> None:
        self.backend = backend
        self.guard = guard

    async def store(self) -> DashboardStore:
        """The backend's store, opened (idempotent)."""
        await self.backend.open()
        return self.backend.store

    @staticmethod
    def cookie_path(request: Request) -> str:
        """Cookies are scoped to the prefix the dashboard is mounted at."""
        return request.scope.get("root_path") or "/"
