"""The upstream's names on Redis (queues, channels, keys), its priority
mapping, and the ``redis://`` URL's own options."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..._urls import redact_url

_NEUTRAL_PRIORITY = 1_048_576
_MAX_PRIORITY = 2_097_151


def bullmq_priority(priority: int | float | None) -> int:
    """The BullMQ priority for a durably/upstream priority (higher = more urgent).

    BullMQ serves *lower* numbers first, so the upstream inverts around 2**20.
    ``None`` maps to the neutral value (``p = 0``); see the package docstring.
    """
    p = 0 if priority is None else priority
    return min(_MAX_PRIORITY, max(1, round(_NEUTRAL_PRIORITY - p)))


@dataclass(frozen=True, slots=True)
class RedisNames:
    """The upstream's queue, channel and key names for one prefix and namespace."""

    prefix: str = "durable"
    namespace: str | None = None

    @property
    def base(self) -> str:
        """``P``: the prefix, with a non-default namespace folded in."""
        if self.namespace in (None, "", "default"):
            return self.prefix
        return f"{self.prefix}-{self.namespace}"

    def tasks(self, group: str) -> str:
        """The queue of step tasks routed to ``group`` (a routing token)."""
        return f"{self.base}-tasks-{group}"

    @property
    def results(self) -> str:
        """The queue step results travel on."""
        return f"{self.base}-results"

    @property
    def heartbeat(self) -> str:
        """The pub/sub channel of liveness beats."""
        return f"{self.base}-heartbeat"

    @property
    def control(self) -> str:
        """The pub/sub channel of control notices (cancel…)."""
        return f"{self.base}-control"

    def runs(self, pool: str | None) -> str:
        """The run queue of an engine pool (the engine's ``namespace=``, the
        upstream partition): ``{P}-runs``, or ``{P}-runs@{pool}`` for a pool
        other than ``default`` (``:`` folded to ``-``, as in routing tokens)."""
        if pool in (None, "", "default"):
            return f"{self.base}-runs"
        return f"{self.base}-runs@{pool.replace(':', '-')}"

    @property
    def runs_pattern(self) -> str:
        """A ``SCAN MATCH`` pattern for every pool's run queue meta key."""
        return f"bull:{glob_escape(self.base)}-runs*:meta"

    def step_beat(self, step_id: str) -> str:
        """The key holding a step's latest beat (durably workers only)."""
        return f"{self.base}-step-beat:{step_id}"


def glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis ``MATCH`` pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def split_url(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without durably's own query options, and those options
    (``prefix``, ``namespace``); :class:`ValueError` if the database is not a number."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in ("prefix", "namespace")}
    rest = [(k, v) for k, v in query if k not in ("prefix", "namespace")]
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"the Redis database must be a number: {redact_url(url)}")
    clean = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(rest), parts.fragment))
    return clean, ours
