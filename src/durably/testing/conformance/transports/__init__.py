"""The ``Transport`` conformance suite.

``from durably.testing.conformance.transports import *`` in a test module
makes pytest collect it there; see :mod:`durably.testing.conformance`.
"""

from __future__ import annotations

from .contract import *  # noqa: F403
