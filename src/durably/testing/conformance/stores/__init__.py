"""The ``StateStore`` conformance suite: every test of its five modules.

``from durably.testing.conformance.stores import *`` in a test module makes
pytest collect them there; see :mod:`durably.testing.conformance`.
"""

from __future__ import annotations

from .children import *  # noqa: F403
from .contract import *  # noqa: F403
from .events import *  # noqa: F403
from .schedules import *  # noqa: F403
from .steps import *  # noqa: F403
