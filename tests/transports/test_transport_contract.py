"""The Transport conformance tests of durably.testing.conformance.transports."""

from __future__ import annotations

from durably.testing.conformance.transports.contract import *  # noqa: F403
