"""The StateStore conformance tests of durably.testing.conformance.stores.updates."""

from __future__ import annotations

from durably.testing.conformance.stores.updates import *  # noqa: F403
