"""The StateStore conformance tests of durably.testing.conformance.stores.events."""

from __future__ import annotations

from durably.testing.conformance.stores.events import *  # noqa: F403
