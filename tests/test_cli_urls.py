"""Store URLs on the command line: credentials never reach a message, an empty URL is refused."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from durably._urls import redact_url, scrub, url_secrets
from durably.stores import MemoryStore, open_store
from durably.transports import open_transport
from test_cli import APPS, _env, run_cli

BAD_URLS = [
    pytest.param("mysql://user:secret@h/db", id="unknown-scheme"),
    pytest.param("postgresql://u:secret@h:abc/db", id="non-numeric-port"),
    pytest.param("postgresql://u@127.0.0.1:1/db?password=secret", id="password-in-query"),
    pytest.param("postgresql://u:secret@127.0.0.1:1/db", id="unreachable"),
    pytest.param("postgresql://u:sec/ret@127.0.0.1:1/db", id="unencoded-slash"),
    pytest.param("postgresql://u:secret@[::1/db", id="bad-ipv6"),
    pytest.param("redis://:secret@h:6379/0", id="password-only"),
    pytest.param("sqlite://u:secret@/db", id="sqlite-with-credentials"),
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_client_commands_never_print_a_password(url: str) -> None:
    commands = [
        ["runs", "list", "--store", url],
        ["runs", "show", "some-run", "--store", url],
        ["schedules", "list", "--store", url],
    ]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda args: run_cli(*args), commands))
    for args, result in zip(commands, results, strict=True):
        context = f"durably {' '.join(args)}: rc={result.returncode} stderr={result.stderr!r}"
        assert result.returncode in (1, 2), context
        assert "secret" not in result.stderr + result.stdout, context
        assert "ret@" not in result.stderr + result.stdout, context
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, context
        assert "Traceback" not in result.stderr, context


def test_an_unknown_scheme_still_says_what_is_wrong() -> None:
    result = run_cli("runs", "list", "--store", "mysql://user:secret@h/db")
    assert result.returncode == 2
    assert "unknown store URL" in result.stderr
    assert "mysql://user:***@h/db" in result.stderr


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("mysql://user:secret@h/db", id="unknown-scheme"),
        pytest.param("postgresql://u:secret@h:abc/db", id="non-numeric-port"),
        pytest.param("postgresql://u@127.0.0.1:1/db?password=secret", id="password-in-query"),
    ],
)
def test_the_worker_never_prints_a_password(url: str) -> None:
    result = run_cli("worker", "--app", "cli_app:engine", "--store", url, cwd=APPS)
    context = f"rc={result.returncode} stderr={result.stderr!r}"
    assert result.returncode in (1, 2), context
    assert "secret" not in result.stderr + result.stdout, context


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("postgresql://u:secret@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgresql://u:secret@h:abc/db", "postgresql://u:***@h:abc/db"),
        ("mysql://user:secret@h/db", "mysql://user:***@h/db"),
        ("redis://:secret@h/0", "redis://:***@h/0"),
        ("postgresql://u:sec/ret@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:sec@ret@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:secret@[::1/db", "postgresql://u:***@[::1/db"),
        (
            "postgresql://u@h/db?schema=s&password=secret&sslpassword=secret",
            "postgresql://u@h/db?schema=s&password=***&sslpassword=***",
        ),
        ("postgresql://h/db?PassWord=secret#frag", "postgresql://h/db?PassWord=***#frag"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("sqlite:///data/app.db", "sqlite:///data/app.db"),
        ("sqlite:////tmp/a@b.db", "sqlite:////tmp/a@b.db"),
        ("memory://", "memory://"),
        ("relative/path.db", "relative/path.db"),
    ],
)
def test_redact_url(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted


@pytest.mark.parametrize(
    "url",
    [
        "mysql://user:secret@h/db",
        "mysql://h/db?password=secret",
        "sqlite://u:secret@/",
    ],
)
def test_open_store_errors_redact_the_url(url: str) -> None:
    with pytest.raises(ValueError, match="URL") as caught:
        open_store(url)
    assert "secret" not in str(caught.value)


def test_open_transport_errors_redact_the_url() -> None:
    with pytest.raises(ValueError, match="URL") as caught:
        # (redis:// is a transport now: an unknown scheme stands in)
        open_transport("amqp://:secret@h:5672/0", MemoryStore())
    assert "secret" not in str(caught.value)
    assert "amqp://:***@h:5672/0" in str(caught.value)


# -- an empty store URL -------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["runs", "list", "--store", ""], id="runs-list"),
        pytest.param(["runs", "show", "r1", "--store", ""], id="runs-show"),
        pytest.param(["cancel", "r1", "--store", ""], id="cancel"),
        pytest.param(["signal", "tok", "--store", ""], id="signal"),
        pytest.param(["schedules", "list", "--store", ""], id="schedules-list"),
        pytest.param(["runs", "list", "--store", "  "], id="blank"),
        pytest.param(["worker", "--app", "cli_app:engine", "--store", ""], id="worker"),
    ],
)
def test_an_empty_store_url_is_a_usage_error(tmp_path: Path, args: list[str]) -> None:
    shutil.copy(APPS / "cli_app.py", tmp_path)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "durably", *args],
            capture_output=True,
            text=True,
            timeout=20,  # a worker that took the empty URL would serve ./durably.db forever
            cwd=tmp_path,
            env=_env(),
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"durably {' '.join(args)} ran on with an empty --store")
    context = f"rc={result.returncode} stderr={result.stderr!r}"
    assert result.returncode == 2, context
    assert "--store" in result.stderr, context
    assert "empty" in result.stderr, context
    assert len(result.stderr.strip().splitlines()) == 1, context
    assert not list(tmp_path.glob("*.db*")), "a database file was created"


def test_scrub_hides_the_secrets_wherever_a_message_repeats_them() -> None:
    urls = ["postgresql://u:p%40ssw0rd@h/db?sslpassword=t0ken&schema=s", "memory://"]
    message = (
        "cannot connect to postgresql://u:p%40ssw0rd@h/db?sslpassword=t0ken&schema=s: "
        "password 'p@ssw0rd' rejected (sslpassword t0ken)"
    )
    scrubbed = scrub(message, urls)
    for secret in ("p%40ssw0rd", "p@ssw0rd", "t0ken"):
        assert secret not in scrubbed
    assert "postgresql://u:***@h/db?sslpassword=***&schema=s" in scrubbed
    assert url_secrets("postgresql://u:ab@h/db") == ["ab"]
    assert scrub("ab cab", ["postgresql://u:ab@h/db"]) == "ab cab"  # too short to scrub text
