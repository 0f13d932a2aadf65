"""``durably runs show`` prints a run's search attributes and ``durably runs
list --attr`` filters by them, through the real command in a subprocess."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from durably._cli_runs import parse_attribute_filter
from test_cli import acli, client
from test_cli import db as db  # the fixture (an explicit re-export)


async def test_runs_show_and_list_attr(db: str) -> None:
    async with client(db) as engine:
        due = datetime(2026, 5, 1, 9, tzinfo=UTC)
        await engine.start(
            "approval",
            "o-1",
            run_id="a1",
            attributes={"customer": "c-1", "total": 150, "vip": True, "due": due, "code": "42"},
        )
        await engine.start("approval", "o-2", run_id="a2", attributes={"customer": "c-1"})
        await engine.start("approval", "o-3", run_id="a3", attributes={"customer": "c-2"})

    shown = await acli("runs", "show", "a1", "--store", db)
    assert shown.returncode == 0, shown.stderr
    assert "customer=c-1" in shown.stdout and "total=150" in shown.stdout

    data = json.loads((await acli("runs", "show", "a1", "--store", db, "--json")).stdout)
    assert data["attributes"] == {
        "code": "42",
        "customer": "c-1",
        "due": "2026-05-01T09:00:00Z",
        "total": 150,
        "vip": True,
    }

    async def ids(*attrs: str) -> list[str]:
        args = [arg for attr in attrs for arg in ("--attr", attr)]
        done = await acli("runs", "list", "--store", db, "--json", *args)
        assert done.returncode == 0, done.stderr
        return [run["run_id"] for run in json.loads(done.stdout)["runs"]]

    assert await ids("customer=c-1") == ["a2", "a1"]
    assert await ids("customer=c-1", "total>=100") == ["a1"]
    assert await ids("customer!=c-1") == ["a3"]
    assert await ids("vip=true", "due<2026-05-02T00:00:00Z") == ["a1"]
    assert await ids("code=42") == []  # a number does not match the text "42"
    assert await ids('code="42"') == ["a1"]

    bad = await acli("runs", "list", "--store", db, "--attr", "vip>true")
    assert bad.returncode == 2 and "only with eq or ne" in bad.stderr
    bad = await acli("runs", "list", "--store", db, "--attr", "no-operator")
    assert bad.returncode == 2 and "KEY<OP>VALUE" in bad.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a=1", ("a", "eq", 1)),
        ("a>=1.5", ("a", "gte", 1.5)),
        ("a<=x", ("a", "lte", "x")),
        ("a!=false", ("a", "ne", False)),
        ("a=2026-01-01T00:00:00+00:00", ("a", "eq", datetime(2026, 1, 1, tzinfo=UTC))),
        ("a=2026-01-01", ("a", "eq", "2026-01-01")),  # no zone: text
        ('a=""', ("a", "eq", "")),
        ("a==b", ("a", "eq", "=b")),
    ],
)
def test_parse_attribute_filter(text: str, expected: tuple[str, str, object]) -> None:
    assert parse_attribute_filter(text) == expected
