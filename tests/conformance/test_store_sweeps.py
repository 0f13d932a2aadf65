"""The StateStore conformance tests of durably.testing.conformance.stores.sweeps."""

from __future__ import annotations

from durably.testing.conformance.stores.sweeps import *  # noqa: F403
