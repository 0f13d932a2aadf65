"""User values reach the operator's terminal as inert text.

Run ids, tags, workflow and step names, inputs, outputs, error messages and
schedule fields are written by applications (or by whoever can start runs),
and the CLI prints them. Rich markup in them must neither break the command
(``MarkupError``) nor style the terminal (``[conceal]``, ``[link=…]``), and
control characters (``ESC`` starting an ANSI/OSC sequence, 8-bit ``CSI``,
bidirectional overrides) must be shown as visible escapes, never sent raw.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import durably
from durably import RunStatus
from durably._cli_render import json_text, visible
from test_cli import Worker, acli, client, run_cli, wait_until

ESC = "\x1b"
MARKUP = "[/x][link=https://evil.example]click[/link][conceal]hid[/conceal]"
"""Rich markup: a stray closing tag (MarkupError), a hyperlink and hidden text."""
CLEAR = "\x1b[2J"
"""ANSI: clear the screen."""
OSC_LINK = "\x1b]8;;https://evil.example\x1b\\"
"""OSC 8: start a terminal hyperlink."""
CSI8 = "\x9b2J"
"""The 8-bit CSI form of "clear the screen"."""
RLO = "\u202e"
"""Right-to-left override: makes the following text read backwards."""

FORBIDDEN = (ESC, "\x9b", RLO, "\x07")


def assert_inert(result: Any, *literals: str) -> str:
    """The command succeeded, printed no control character and shows ``literals`` as text."""
    out: str = result.stdout + result.stderr
    context = f"rc={result.returncode}\nstdout={result.stdout!r}\nstderr={result.stderr!r}"
    assert result.returncode == 0, context
    assert "Traceback" not in result.stderr, context  # (a failed run's JSON error has one)
    assert "MarkupError" not in result.stderr, context
    for char in FORBIDDEN:
        assert char not in out, f"{char!r} reached the terminal raw\n{context}"
    for literal in literals:
        assert literal in out, f"{literal!r} is not shown\n{context}"
    return out


def _fail_with(message: str) -> str:
    raise RuntimeError(message)


def _evil_app(engine: durably.Engine) -> durably.Engine:
    @engine.workflow(f"wf{MARKUP}{CLEAR}")
    async def evil(ctx: durably.WorkflowContext, data: Any) -> Any:
        await ctx.local_step(f"step{MARKUP}{OSC_LINK}", lambda: "fine")
        if data.get("fail"):
            await ctx.local_step(
                "explode", _fail_with, f"boom {MARKUP} {CLEAR} {OSC_LINK} {CSI8} {RLO}"
            )
        return {"out": f"{MARKUP}{CLEAR}{CSI8}{RLO}"}

    return engine


EVIL_WORKFLOW = f"wf{MARKUP}{CLEAR}"
OK_RUN = f"ok-{MARKUP}-{CLEAR}"
FAILED_RUN = f"bad-{OSC_LINK}-{CSI8}-{RLO}"


@pytest.fixture
def evil_db(tmp_path: Path) -> str:
    """A SQLite store holding a completed and a failed run full of hostile text."""
    url = f"sqlite:///{tmp_path / 'evil.db'}"

    async def seed() -> None:
        engine = _evil_app(durably.Engine(url, poll_interval=0.05))
        async with engine:
            await engine.start(
                EVIL_WORKFLOW,
                {"in": f"{MARKUP}{CLEAR}{CSI8}"},
                run_id=OK_RUN,
                tags=[f"t{MARKUP}", f"u{CLEAR}"],
            )
            await engine.start(EVIL_WORKFLOW, {"fail": True}, run_id=FAILED_RUN)
            for run_id in (OK_RUN, FAILED_RUN):
                await engine.wait_for_run(run_id, terminal=True, timeout=30)
        async with client(url) as check:
            ok = await check.get_run(OK_RUN)
            bad = await check.get_run(FAILED_RUN)
            assert ok is not None and ok.status is RunStatus.COMPLETED, ok
            assert bad is not None and bad.status is RunStatus.FAILED, bad

    asyncio.run(seed())
    return url


def test_runs_list_prints_hostile_ids_tags_and_names_as_text(evil_db: str) -> None:
    listed = run_cli("runs", "list", "--store", evil_db)
    assert_inert(listed, "ok-[/x][link=https://evil.example]", "\\x1b[2J", "\\x9b2J", "\\u202e")
    assert "t[/x][link=https://ev" in listed.stdout  # a tag (cut to fit its column)
    assert "wf[/x]" in listed.stdout


def test_runs_list_json_escapes_control_characters(evil_db: str) -> None:
    listed = run_cli("runs", "list", "--store", evil_db, "--json")
    assert_inert(listed)
    data = json.loads(listed.stdout)
    assert {r["run_id"] for r in data["runs"]} == {OK_RUN, FAILED_RUN}  # the data is intact


@pytest.mark.parametrize("run_id", [OK_RUN, FAILED_RUN])
def test_runs_show_prints_hostile_values_as_text(evil_db: str, run_id: str) -> None:
    shown = run_cli("runs", "show", run_id, "--store", evil_db)
    out = assert_inert(shown, "step[/x][link=https://evil.example]click[/link]", "\\x1b]8;;")
    assert "[conceal]hid[/conceal]" in out
    if run_id == OK_RUN:
        assert "\\x1b[2J" in out  # the input and output
        assert "t[/x][link=https://evil.example]" in out  # a tag
    else:
        assert "boom [/x][link=https://evil.example]click[/link]" in out  # the error
        assert "\\x9b2J" in out


def test_runs_show_json_escapes_control_characters(evil_db: str) -> None:
    shown = run_cli("runs", "show", FAILED_RUN, "--store", evil_db, "--json")
    assert_inert(shown)
    data = json.loads(shown.stdout)
    assert data["run"]["run_id"] == FAILED_RUN
    assert RLO in data["run"]["error"]["message"]  # the data is intact once parsed


def test_schedules_list_prints_hostile_values_as_text(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sched.db'}"

    async def seed() -> None:
        engine = durably.Engine(url, drive=False)

        @engine.workflow(f"report{MARKUP}{CLEAR}")
        async def report(ctx: durably.WorkflowContext, data: Any = None) -> Any:
            return data

        engine.schedule(
            f"nightly{MARKUP}{OSC_LINK}",
            f"report{MARKUP}{CLEAR}",
            cron="0 3 * * *",
            input={"x": f"{MARKUP}{CSI8}{RLO}"},
        )
        await engine.open()
        await engine.close()

    asyncio.run(seed())
    listed = run_cli("schedules", "list", "--store", url)
    assert_inert(listed, "nightly[/x][link=https://evil.example]", "report[/x]", "\\x1b]8;;")
    as_json = run_cli("schedules", "list", "--store", url, "--json")
    assert_inert(as_json)
    assert json.loads(as_json.stdout)[0]["name"] == f"nightly{MARKUP}{OSC_LINK}"


async def test_signal_and_cancel_echo_hostile_ids_as_text(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sig.db'}"
    run_id = f"sig-{MARKUP}-{CLEAR}"
    async with client(url, drive=True) as engine:
        await engine.start_worker()
        await engine.start("approval", "o1", run_id=run_id)
        await wait_until(engine, run_id, lambda run, _: run.status is RunStatus.SUSPENDED)
    sent = await acli("signal", "approve:o1", "--store", url)
    assert_inert(sent, "\\x1b[2J")
    cancelled = await acli("cancel", f"x{CLEAR}", "--store", url)
    assert cancelled.returncode == 1
    assert ESC not in cancelled.stderr + cancelled.stdout


def test_errors_show_hostile_text_as_text(tmp_path: Path) -> None:
    (tmp_path / "evil_app.py").write_text(f"raise RuntimeError({'boom ' + CLEAR + MARKUP!r})\n")
    result = run_cli("worker", "--app", "evil_app:engine", cwd=tmp_path)
    assert result.returncode == 2
    assert ESC not in result.stderr
    assert "boom \\x1b[2J[/x]" in result.stderr

    url = f"sqlite:///{tmp_path / 'sched.db'}"
    (tmp_path / "sched.db").touch()
    paused = run_cli("schedules", "pause", f"x{CLEAR}", "--store", url)
    assert paused.returncode == 1
    assert ESC not in paused.stderr
    assert "\\x1b[2J" in paused.stderr


async def test_worker_log_shows_hostile_text_as_text(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    worker = Worker(url, tmp_path / "worker.log", "--instance-id", f"pod{OSC_LINK}")
    try:
        async with client(url) as engine:
            # A failed dispatched step is logged with its exception's message.
            await engine.start("complaint", f"{CLEAR}{RLO}{OSC_LINK}{CSI8}", run_id="complain")
            await wait_until(
                engine, "complain", lambda run, _: run.status.is_terminal, worker=worker
            )
            assert await worker.stop() == 0, worker.output()
    finally:
        worker.close()
    log = worker.log.read_text()
    assert "pod\\x1b]8;;https://evil.example" in log
    assert "\\x1b[2J\\u202e" in log
    for char in FORBIDDEN:
        assert char not in log, f"{char!r} reached the worker log raw:\n{log!r}"


def test_visible_and_json_text() -> None:
    assert visible(f"a{CLEAR}b\n{CSI8}{RLO}\u2028") == "a\\x1b[2Jb\\x0a\\x9b2J\\u202e\\u2028"
    assert visible("line\none\x1b", keep="\n") == "line\none\\x1b"
    assert visible("[/x] ünïcødé ok") == "[/x] ünïcødé ok"
    data = {"k": f"{CLEAR}{CSI8}{RLO}\x7f", f"{MARKUP}": [1, None]}
    text = json_text(data)
    assert not any(char in text for char in (*FORBIDDEN, "\x7f"))
    assert json.loads(text) == data
