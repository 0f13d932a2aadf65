"""The StateStore conformance tests of durably.testing.conformance.stores.checkpoints."""

from __future__ import annotations

from durably.testing.conformance.stores.checkpoints import *  # noqa: F403
