"""The StateStore conformance tests of durably.testing.conformance.stores.runs."""

from __future__ import annotations

from durably.testing.conformance.stores.runs import *  # noqa: F403
