"""The StateStore conformance tests of durably.testing.conformance.stores.steps."""

from __future__ import annotations

from durably.testing.conformance.stores.steps import *  # noqa: F403
