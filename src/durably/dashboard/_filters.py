"""The runs list's filter, read from a query string, and its store query."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from ..model import RunStatus
from ..stores.base import RunQuery

__all__ = ["BULK_CAP", "COUNT_CAP", "PAGE_SIZE", "FilterError", "RunFilter"]

PAGE_SIZE = 50
"""Runs on one page of the list (``?limit=`` may ask for 1 to 200)."""
MAX_PAGE = 200
COUNT_CAP = 10_000
"""Each status count on the runs list stops here (shown as "10000+"), so the
counts cost the same on a table of a hundred runs or of ten million."""
BULK_CAP = 500
"""A bulk cancel or retry acts on at most this many matching runs."""


class FilterError(ValueError):
    """A filter parameter that does not parse; the page answers 400 with it."""


@dataclass(frozen=True, slots=True)
class RunFilter:
    """What the runs list shows: every field optional, all of them AND-ed."""

    status: RunStatus | None = None
    workflow: str | None = None
    tag: str | None = None
    run_id: str | None = None
    """An id prefix."""
    since: int | None = None
    """Created at or after (epoch ms)."""
    until: int | None = None
    """Created before (epoch ms)."""
    limit: int = PAGE_SIZE
    cursor: str | None = None

    @classmethod
    def parse(cls, params: Any) -> RunFilter:
        """Read a filter from a query string or form (a mapping of text);
        empty fields count as absent."""

        def text(name: str) -> str | None:
            value = params.get(name)
            return value.strip() or None if isinstance(value, str) else None

        status = text("status")
        if status is not None and status not in RunStatus.__members__.values():
            raise FilterError(f"unknown status {status!r}")
        limit_text = text("limit")
        try:
            limit = int(limit_text) if limit_text else PAGE_SIZE
        except ValueError:
            raise FilterError("limit must be a whole number") from None
        if not 1 <= limit <= MAX_PAGE:
            raise FilterError(f"limit must be between 1 and {MAX_PAGE}")
        return cls(
            status=RunStatus(status) if status else None,
            workflow=text("workflow"),
            tag=text("tag"),
            run_id=text("q"),
            since=_parse_time(text("since"), "since"),
            until=_parse_time(text("until"), "until"),
            limit=limit,
            cursor=text("cursor"),
        )

    def query(self, **changes: Any) -> RunQuery:
        """The store query of this filter (``changes`` override fields)."""
        query = RunQuery(
            status=self.status,
            workflow=self.workflow,
            tag=self.tag,
            run_id_prefix=self.run_id,
            created_after=self.since,
            created_before=self.until,
            limit=self.limit,
            cursor=self.cursor,
        )
        return replace(query, **changes)

    def params(self, **changes: Any) -> dict[str, str]:
        """This filter as query-string parameters (for links and forms)."""
        values = {
            "status": self.status.value if self.status else None,
            "workflow": self.workflow,
            "tag": self.tag,
            "q": self.run_id,
            "since": _format_time(self.since),
            "until": _format_time(self.until),
            "limit": str(self.limit) if self.limit != PAGE_SIZE else None,
            "cursor": self.cursor,
        }
        values.update(changes)
        return {k: v for k, v in values.items() if v}

    def href(self, **changes: Any) -> str:
        """``?…`` for a link to this filter with ``changes``."""
        return "?" + urlencode(self.params(**changes))

    def as_json(self) -> dict[str, Any]:
        """The filter as the JSON API echoes it."""
        return {
            "status": self.status.value if self.status else None,
            "workflow": self.workflow,
            "tag": self.tag,
            "q": self.run_id,
            "since": self.since,
            "until": self.until,
        }


def _parse_time(value: str | None, name: str) -> int | None:
    # epoch milliseconds, or an ISO-8601 time (a browser's datetime-local has
    # no zone: read as UTC, which is what the pages display).
    if value is None:
        return None
    if value.isdigit():
        return int(value)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise FilterError(f"{name} must be an ISO-8601 time or epoch milliseconds") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def _format_time(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S")
