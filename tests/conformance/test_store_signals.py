"""The StateStore conformance tests of durably.testing.conformance.stores.signals."""

from __future__ import annotations

from durably.testing.conformance.stores.signals import *  # noqa: F403
