"""The StateStore conformance tests of durably.testing.conformance.stores.schedules."""

from __future__ import annotations

from durably.testing.conformance.stores.schedules import *  # noqa: F403
