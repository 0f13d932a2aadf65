"""The OpenAPI 3.1 document of the dashboard's JSON API (``/api/openapi.json``);
``tests/dashboard/test_api.py`` checks that it names every API route."""

from __future__ import annotations

from typing import Any

from ..model import RunStatus
from ._filters import BULK_CAP

__all__ = ["OPENAPI"]


def _param(name: str, description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": schema or {"type": "string"},
    }


_FILTER_PARAMS = [
    _param("status", "Run status.", {"type": "string", "enum": [s.value for s in RunStatus]}),
    _param("workflow", "Workflow name."),
    _param("tag", "A tag the run carries."),
    _param("q", "A run id prefix."),
    _param("since", "Created at or after: ISO-8601 (UTC if no zone) or epoch ms."),
    _param("until", "Created before: ISO-8601 (UTC if no zone) or epoch ms."),
]
_ERROR = {
    "description": "Refused",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}
_OBJECT = {"application/json": {"schema": {"type": "object"}}}
_AUTH_NOTE = (
    "With a token: `Authorization: Bearer <token>` or the login session cookie. "
    "A POST without a bearer header also needs `X-Durably-CSRF` equal to the `durably_csrf` cookie."
)

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "durably dashboard API", "version": "1", "description": _AUTH_NOTE},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {"type": "object", "properties": {"error": {"type": "string"}}},
            "RunSummary": {
                "type": "object",
                "properties": {
                    "run_id": {"type": "string"},
                    "workflow": {"type": "string"},
                    "version": {"type": "string"},
                    "status": {"type": "string"},
                    "namespace": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "parent_id": {"type": ["string", "null"]},
                    "created_at": {"type": "string", "format": "date-time"},
                    "updated_at": {"type": "string", "format": "date-time"},
                },
            },
        },
    },
    "security": [{"bearer": []}],
    "paths": {
        "/api/runs": {
            "get": {
                "summary": "Runs, newest first, filtered, with counts per status",
                "parameters": [
                    *_FILTER_PARAMS,
                    _param("limit", "Page size, 1-200 (50).", {"type": "integer"}),
                    _param("cursor", "The next_cursor of the previous page."),
                ],
                "responses": {
                    "200": {
                        "description": "A page",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "runs": {
                                            "type": "array",
                                            "items": {"$ref": "#/components/schemas/RunSummary"},
                                        },
                                        "next_cursor": {"type": ["string", "null"]},
                                        "counts": {
                                            "type": "object",
                                            "additionalProperties": {"type": "integer"},
                                            "description": "Per status, each at most count_cap "
                                            "(reaching it means at least that many).",
                                        },
                                        "count_cap": {"type": "integer"},
                                    },
                                }
                            }
                        },
                    },
                    "400": _ERROR,
                },
            }
        },
        "/api/runs/{run_id}": {
            "get": {
                "summary": "A run with its timeline, waits, children and lineage",
                "parameters": [
                    {"name": "run_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {"200": {"description": "The run", "content": _OBJECT}, "404": _ERROR},
            }
        },
        "/api/actions/{action}": {
            "post": {
                "summary": "Act on a run: cancel, cancel-compensate, retry, retry-with-input "
                "(`input`), signal (`token`, `payload`), redispatch",
                "parameters": [
                    {
                        "name": "action",
                        "in": "path",
                        "required": True,
                        "schema": {
                            "type": "string",
                            "enum": [
                                "cancel",
                                "cancel-compensate",
                                "retry",
                                "retry-with-input",
                                "signal",
                                "redispatch",
                            ],
                        },
                    }
                ],
                "requestBody": {"required": True, "content": _OBJECT},
                "responses": {
                    "200": {"description": "Done", "content": _OBJECT},
                    "400": _ERROR,
                    "403": _ERROR,
                    "404": _ERROR,
                    "409": _ERROR,
                },
            }
        },
        "/api/bulk/{action}": {
            "post": {
                "summary": f"Cancel or retry the runs of a filter (at most {BULK_CAP})",
                "parameters": [
                    {
                        "name": "action",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string", "enum": ["cancel", "retry"]},
                    },
                    *_FILTER_PARAMS,
                ],
                "responses": {
                    "200": {
                        "description": "How many runs matched and how many were acted on",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "matched": {"type": "integer"},
                                        "applied": {"type": "integer"},
                                        "cap": {"type": "integer"},
                                    },
                                }
                            }
                        },
                    },
                    "403": _ERROR,
                },
            }
        },
        "/api/schedules": {
            "get": {
                "summary": "Schedules with their next fire times",
                "responses": {"200": {"description": "Schedules", "content": _OBJECT}},
            }
        },
        "/api/schedules/{action}": {
            "post": {
                "summary": "Pause, resume or trigger a schedule (`name`)",
                "parameters": [
                    {
                        "name": "action",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string", "enum": ["pause", "resume", "trigger"]},
                    }
                ],
                "requestBody": {"required": True, "content": _OBJECT},
                "responses": {"200": {"description": "Done", "content": _OBJECT}, "404": _ERROR},
            }
        },
        "/api/queues": {
            "get": {
                "summary": "Flow-control queues holding slots or waiters",
                "responses": {"200": {"description": "Queues", "content": _OBJECT}},
            }
        },
        "/api/stream": {
            "get": {
                "summary": "Server-sent `runs` events as runs change",
                "description": (
                    "Without `run`: one event per batch of changed runs, each run's summary. "
                    'With `run`: an event `[{"run_id": ID}]` each time that run, one of its '
                    "steps or its children changes (re-read it); opened with `since` as well "
                    "(a page rendered before the stream began), one such event at once, after "
                    "the stream's first reading of the run, so that nothing changed between "
                    "the render and that reading is missed."
                ),
                "parameters": [
                    _param("run", "Only this run: its row, its steps and its children."),
                    _param(
                        "since",
                        "Changes after this time (epoch ms; default: now). With `run`, its "
                        "presence alone asks for one event at once (see above).",
                    ),
                ],
                "responses": {"200": {"description": "text/event-stream"}},
            }
        },
    },
}
