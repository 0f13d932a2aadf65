"""The StateStore conformance tests of durably.testing.conformance.stores.attributes."""

from __future__ import annotations

from durably.testing.conformance.stores.attributes import *  # noqa: F403
