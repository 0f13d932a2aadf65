"""The StateStore conformance tests of durably.testing.conformance.stores.turns."""

from __future__ import annotations

from durably.testing.conformance.stores.turns import *  # noqa: F403
