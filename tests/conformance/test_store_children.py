"""The StateStore conformance tests of durably.testing.conformance.stores.children."""

from __future__ import annotations

from durably.testing.conformance.stores.children import *  # noqa: F403
