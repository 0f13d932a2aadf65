"""The StateStore conformance tests of durably.testing.conformance.stores.contract."""

from __future__ import annotations

from durably.testing.conformance.stores.contract import *  # noqa: F403
