"""The StateStore conformance tests of durably.testing.conformance.stores.decisions."""

from __future__ import annotations

from durably.testing.conformance.stores.decisions import *  # noqa: F403
