"""``durably demo``: an order run survives a SIGKILLed worker and finishes once.

The parent process (``run_demo``) drives the story; the runs execute in child
worker processes started as::

    python -m durably worker --app durably._demo:create_engine --instance-id demo-worker

with the SQLite URL in ``DURABLY_DATABASE_URL`` and the effects ledger in
``DURABLY_DEMO_LEDGER``. Every step function appends one line to the ledger
when its side effect happens, so the parent can count, at the end, how many
times each effect really ran: once each, although the worker that did the
first half of the work was killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ._cli_render import format_duration, format_time, make_console, render_run, timeline_table
from .context import WorkflowContext
from .engine import Engine
from .errors import SignalTimeout
from .model import Checkpoint, CheckpointKind, CheckpointStatus, Run, RunStatus

__all__ = [
    "EFFECTS",
    "LEDGER_ENV",
    "WORKER_ID",
    "WORKFLOW",
    "build_engine",
    "create_engine",
    "read_ledger",
    "run_demo",
]

WORKFLOW = "order-fulfilment"
"""The demo workflow's name."""
WORKER_ID = "demo-worker"
"""The stable instance id both child workers use, so the second reclaims at once."""
LEDGER_ENV = "DURABLY_DEMO_LEDGER"
"""The environment variable naming the effects ledger file for the child workers."""
EFFECTS = ("reserve-stock", "charge-card", "ship")
"""The side effects of a successful order, each of which must happen exactly once."""

POLL_INTERVAL = 0.2
COOLING_OFF_SECONDS = 3.0
STEP_LATENCY = 0.15
_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)


# -- the workflow (runs in the child workers) ---------------------------------------------


def build_engine(store: str | None, ledger: Path, *, drive: bool = True) -> Engine:
    """An engine with the demo's order workflow registered.

    Its steps append what they did to ``ledger`` (one JSON line per effect).
    """
    engine = Engine(store, drive=drive, poll_interval=POLL_INTERVAL)

    def record(effect: str, order: dict[str, Any], **detail: Any) -> None:
        line = {"effect": effect, "order": order["id"], "pid": os.getpid(), "at": time.time()}
        with ledger.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({**line, **detail}) + "\n")

    def reserve_stock(order: dict[str, Any]) -> dict[str, Any]:
        time.sleep(STEP_LATENCY)  # the inventory service
        reservation = f"res_{secrets.token_hex(4)}"
        record("reserve-stock", order, reservation=reservation)
        return {"reservation": reservation, "sku": order["sku"], "qty": order["qty"]}

    def release_stock(order: dict[str, Any], reservation: dict[str, Any]) -> None:
        record("release-stock", order, reservation=reservation["reservation"])

    def charge_card(order: dict[str, Any]) -> dict[str, Any]:
        time.sleep(STEP_LATENCY)  # the payment provider
        charge_id = f"ch_{secrets.token_hex(6)}"
        record("charge-card", order, charge=charge_id, amount_cents=order["amount_cents"])
        return {"charge": charge_id, "amount_cents": order["amount_cents"]}

    def ship(order: dict[str, Any], charge_id: str) -> dict[str, Any]:
        time.sleep(STEP_LATENCY)  # the carrier's API
        tracking = f"1Z{secrets.token_hex(5).upper()}"
        record("ship", order, tracking=tracking, charge=charge_id)
        return {"tracking": tracking}

    @engine.workflow(WORKFLOW)
    async def fulfil_order(ctx: WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
        stock = await ctx.local_step("reserve-stock", reserve_stock, order, retries=3)
        try:
            decision = await ctx.wait_for_signal(f"approve:{order['id']}", timeout="10m")
        except SignalTimeout:
            await ctx.local_step("release-stock", release_stock, order, stock)
            return {"order": order["id"], "status": "expired"}
        if not decision.get("approved"):
            await ctx.local_step("release-stock", release_stock, order, stock)
            return {"order": order["id"], "status": "rejected"}
        charge = await ctx.local_step("charge-card", charge_card, order, retries=3)
        # Stands in for "ship once the cooling-off period is over": hours in
        # real life, during which no process needs to be alive.
        await ctx.sleep(COOLING_OFF_SECONDS)
        shipment = await ctx.local_step("ship", ship, order, charge["charge"], retries=3)
        return {
            "order": order["id"],
            "status": "shipped",
            "charge": charge["charge"],
            "tracking": shipment["tracking"],
        }

    return engine


def create_engine() -> Engine:
    """The child workers' engine, for ``durably worker --app durably._demo:create_engine``.

    The store comes from ``DURABLY_DATABASE_URL`` (``Engine()``'s default) and
    the ledger file from ``DURABLY_DEMO_LEDGER``.
    """
    ledger = os.environ.get(LEDGER_ENV)
    if not ledger:
        raise RuntimeError(f"set {LEDGER_ENV} to the demo's ledger file")
    return build_engine(None, Path(ledger))


def read_ledger(ledger: Path, order_id: str) -> list[dict[str, Any]]:
    """The effects recorded in ``ledger`` for one order, in order."""
    if not ledger.exists():
        return []
    entries = []
    for line in ledger.read_text(encoding="utf-8").splitlines():
        if line.strip():
            entry = json.loads(line)
            if entry.get("order") == order_id:
                entries.append(entry)
    return entries


# -- the story (runs in the parent) -------------------------------------------------------


class DemoFailed(Exception):
    """Something in the demo did not go as it must; the message says what."""


@dataclass
class _Worker:
    number: int
    process: asyncio.subprocess.Process
    log: Path


def _open_log(path: Path) -> TextIO:
    return path.open("w", encoding="utf-8")


def _tail(path: Path, lines: int = 15) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    except OSError:
        return []


class _Demo:
    def __init__(self, directory: Path, console: Console) -> None:
        self.dir = directory
        self.console = console
        self.db = directory / "demo.db"
        self.ledger = directory / "effects.jsonl"
        self.url = f"sqlite:///{self.db}"
        self.workers: list[_Worker] = []
        self.started = time.monotonic()
        self.run_id: str | None = None

    # narration

    def say(self, icon: str, text: str) -> None:
        """Print one line of the story, stamped with the seconds since the start."""
        elapsed = time.monotonic() - self.started
        self.console.print(f"[dim]{elapsed:5.1f}s[/dim]  {icon} {text}")

    # child workers

    async def start_worker(self) -> _Worker:
        """Start the next child worker, logging to ``worker-N.log`` in the demo folder."""
        number = len(self.workers) + 1
        log = self.dir / f"worker-{number}.log"
        env = dict(os.environ)
        env["DURABLY_DATABASE_URL"] = self.url
        env[LEDGER_ENV] = str(self.ledger)
        env["PYTHONUNBUFFERED"] = "1"
        # The child must import this very package, even from a source checkout.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_SOURCE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        out = _open_log(log)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "durably",
                "worker",
                "--app",
                "durably._demo:create_engine",
                "--instance-id",
                WORKER_ID,
                "--interval",
                str(POLL_INTERVAL),
                "--drain-timeout",
                "5",
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.dir),
            )
        finally:
            out.close()
        worker = _Worker(number, process, log)
        self.workers.append(worker)
        return worker

    def stop_all(self) -> None:
        """Kill every child worker still alive."""
        for worker in self.workers:
            if worker.process.returncode is None:
                worker.process.kill()

    # waiting on the store

    async def wait_for(
        self,
        engine: Engine,
        run_id: str,
        what: str,
        done: Callable[[Run, list[Checkpoint]], bool],
        timeout: float = 30.0,
    ) -> tuple[Run, list[Checkpoint]]:
        """Poll the store until ``done(run, history)``; fail if a worker dies or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            run = await engine.get_run(run_id)
            if run is None:
                raise DemoFailed(f"run {run_id} vanished")
            checkpoints = await engine.history(run_id)
            if done(run, checkpoints):
                return run, checkpoints
            if run.status.is_terminal:
                raise DemoFailed(
                    f"the run ended {run.status} while waiting for {what}: {run.error}"
                )
            for worker in self.workers:
                code = worker.process.returncode
                if code is not None and code != -signal.SIGKILL:
                    raise DemoFailed(
                        f"worker #{worker.number} exited with code {code} "
                        f"while waiting for {what} (log: {worker.log})"
                    )
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out after {timeout:g}s waiting for {what}")
            await asyncio.sleep(0.05)

    # the story

    async def run(self) -> int:
        """Tell the whole story; return the exit code :meth:`report` decides."""
        console = self.console
        console.print(
            "[bold]durably demo[/bold]: an order workflow in a worker process that gets "
            "killed with SIGKILL halfway, and finishes anyway.\n"
            f"[dim]database {self.db}\nledger   {self.ledger}[/dim]\n"
        )
        engine = build_engine(self.url, self.ledger, drive=False)
        await engine.open()
        try:
            order_id = f"A-{secrets.randbelow(9000) + 1000}"
            while await engine.get_run(f"order-{order_id}") is not None:  # a reused --dir
                order_id = f"A-{secrets.randbelow(9000) + 1000}"
            order = {
                "id": order_id,
                "customer": "ada@example.com",
                "sku": "espresso-machine",
                "qty": 1,
                "amount_cents": 24900,
            }
            run_id = self.run_id = f"order-{order_id}"
            token = f"approve:{order_id}"
            first = await self.start_worker()
            self.say(
                "▶",
                f"started worker #1 (pid {first.process.pid}, instance id {WORKER_ID!r})",
            )
            await engine.start(WORKFLOW, order, run_id=run_id, tags=["demo"])
            self.say("▶", f"started run [bold]{run_id}[/bold] of workflow {WORKFLOW!r}")

            def waiting_for_approval(run: Run, cps: list[Checkpoint]) -> bool:
                return run.status is RunStatus.SUSPENDED and any(
                    cp.kind == CheckpointKind.SIGNAL and cp.status is CheckpointStatus.PENDING
                    for cp in cps
                )

            _, cps = await self.wait_for(engine, run_id, "the approval wait", waiting_for_approval)
            reservation = next(cp.output for cp in cps if cp.name == "reserve-stock")
            self.say(
                "✔",
                f"worker #1 reserved stock ({reservation['reservation']}); the run is "
                f"[blue]suspended[/blue], waiting for signal {token!r}",
            )
            approval = {"approved": True, "by": "ops@shop.example"}
            await engine.signal(token, approval)
            self.say("▶", f"sent signal {token!r} {json.dumps(approval)}")

            def sleeping(run: Run, cps: list[Checkpoint]) -> bool:
                return run.status is RunStatus.SUSPENDED and any(
                    cp.kind == CheckpointKind.SLEEP and cp.status is CheckpointStatus.PENDING
                    for cp in cps
                )

            run, cps = await self.wait_for(engine, run_id, "the durable sleep", sleeping)
            charge = next(cp.output for cp in cps if cp.name == "charge-card")
            self.say(
                "✔",
                f"worker #1 charged the card ({charge['charge']}); the run is in a durable "
                f"sleep of {COOLING_OFF_SECONDS:g}s before shipping",
            )

            first.process.kill()
            await first.process.wait()
            self.say(
                "[bold red]✖[/bold red]",
                f"[bold red]SIGKILL worker #1[/bold red] (pid {first.process.pid}): the "
                "process is gone mid-run, with no chance to clean up",
            )
            run, cps = await self.wait_for(engine, run_id, "the run's state", lambda r, c: True)
            lease = f"leased by {run.locked_by}" if run.locked_by else "no lease held"
            self.say(
                "ℹ",  # noqa: RUF001 - the information sign, not a letter
                f"on disk the run is [blue]{run.status}[/blue] ({lease}); no process runs it. "
                "Its checkpoints:",
            )
            console.print(timeline_table(cps, title=None))

            second = await self.start_worker()
            self.say(
                "▶",
                f"started worker #2 (pid {second.process.pid}, same instance id {WORKER_ID!r})",
            )
            await self.wait_for(
                engine,
                run_id,
                "the run to complete",
                lambda r, c: r.status is RunStatus.COMPLETED,
                timeout=60.0,
            )
            result = await engine.wait_for_run(run_id, terminal=True, timeout=60.0)
            self.say(
                "✔",
                f"worker #2 woke the run when the sleep was due, shipped, and the run "
                f"[green]{result.status}[/green]: {escape(json.dumps(result.output))}",
            )

            second.process.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(second.process.wait(), timeout=20.0)
            except TimeoutError:
                raise DemoFailed("worker #2 did not stop within 20s of SIGTERM") from None
            self.say("■", f"sent SIGTERM to worker #2: it drained and exited with code {code}")

            run = await engine.get_run(run_id) or run
            cps = await engine.history(run_id)
        finally:
            self.stop_all()
            await engine.close()
        return self.report(run, cps, order_id, worker_exit=code)

    def report(self, run: Run, cps: list[Checkpoint], order_id: str, *, worker_exit: int) -> int:
        """Print the final timeline and the effects ledger; 0 when every effect ran once."""
        console = self.console
        console.print()
        console.print(f"[bold]Run {run.run_id}[/bold] (what `durably runs show` prints)")
        console.print(render_run(run, cps))

        entries = read_ledger(self.ledger, order_id)
        counts = Counter(entry["effect"] for entry in entries)
        by_pid = {w.process.pid: w.number for w in self.workers}
        table = Table(
            title="Effects ledger (one line per side effect that really happened)",
            box=box.SIMPLE_HEAD,
            title_justify="left",
            show_edge=False,
        )
        table.add_column("EFFECT", no_wrap=True)
        table.add_column("RAN", justify="right")
        table.add_column("BY")
        table.add_column("AT", no_wrap=True)
        table.add_column("CHECK")
        failures = []
        for effect in (*EFFECTS, *sorted(set(counts) - set(EFFECTS))):
            ran = counts.get(effect, 0)
            mine = [e for e in entries if e["effect"] == effect]
            who = ", ".join(
                f"worker #{by_pid[e['pid']]}" if e["pid"] in by_pid else f"pid {e['pid']}"
                for e in mine
            )
            when = ", ".join(format_time(int(e["at"] * 1000), with_date=False) for e in mine)
            expected = 1 if effect in EFFECTS else 0
            ok = ran == expected
            if not ok:
                failures.append(f"{effect} ran {ran} time(s), expected {expected}")
            table.add_row(
                effect,
                str(ran),
                who or "-",
                when or "-",
                "[green]✔ exactly once[/green]" if ok else f"[bold red]✖ expected {expected}[/]",
            )
        console.print()
        console.print(table)
        console.print()

        if run.status is not RunStatus.COMPLETED:
            failures.append(f"the run is {run.status}, not completed")
        if worker_exit != 0:
            failures.append(f"worker #2 exited with code {worker_exit} after SIGTERM")
        elapsed = time.monotonic() - self.started
        if failures:
            for failure in failures:
                console.print(f"[bold red]✖ {escape(failure)}[/bold red]")
            return 1
        console.print(
            "[green]✔[/green] Every effect ran exactly once. Worker #2 replayed reserve-stock, "
            "the approval and charge-card from their checkpoints without executing them "
            f"again, and executed only what was left. ({format_duration(elapsed * 1000)} in all)"
        )
        return 0

    def show_failure(self, exc: BaseException) -> None:
        """Report a failed demo with the tail of each worker's log."""
        self.console.print(f"[bold red]✖ demo failed:[/bold red] {escape(str(exc))}")
        for worker in self.workers:
            tail = _tail(worker.log)
            if tail:
                self.console.print(f"[dim]last lines of worker #{worker.number}'s log:[/dim]")
                for line in tail:
                    self.console.print(Text(f"  {line}", style="dim"))


def run_demo(directory: Path | None = None, console: Console | None = None) -> int:
    """Run the demo; return the process exit code (0 when every effect ran once).

    Files go to ``directory`` (kept), else to a temporary directory that is
    removed afterwards unless the demo fails.
    """
    console = console or make_console()
    temporary = directory is None
    folder = Path(tempfile.mkdtemp(prefix="durably-demo-")) if directory is None else directory
    folder.mkdir(parents=True, exist_ok=True)
    demo = _Demo(folder.resolve(), console)
    try:
        code = asyncio.run(demo.run())
    except KeyboardInterrupt:
        demo.stop_all()
        console.print("[bold red]interrupted[/bold red]")
        return 130
    except DemoFailed as exc:
        demo.show_failure(exc)
        code = 1
    if code == 0 and temporary:
        shutil.rmtree(folder, ignore_errors=True)
    elif not temporary or code:
        console.print(
            f"[dim]The demo's files are in {folder.resolve()}. Inspect the run with:\n"
            f"  durably runs show {demo.run_id or '<run id>'} "
            f"--store sqlite:///{folder.resolve() / 'demo.db'}[/dim]"
        )
    return code
