"""The StateStore conformance tests of durably.testing.conformance.stores.lifecycle."""

from __future__ import annotations

from durably.testing.conformance.stores.lifecycle import *  # noqa: F403
