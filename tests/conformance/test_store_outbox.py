"""The StateStore conformance tests of durably.testing.conformance.stores.outbox."""

from __future__ import annotations

from durably.testing.conformance.stores.outbox import *  # noqa: F403
