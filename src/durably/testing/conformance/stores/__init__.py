"""The ``StateStore`` conformance suite: every test of its modules.

``from durably.testing.conformance.stores import *`` in a test module makes
pytest collect them there; see :mod:`durably.testing.conformance`.
"""

from __future__ import annotations

from .attributes import *  # noqa: F403  # noqa: F403
from .checkpoints import *  # noqa: F403
from .children import *  # noqa: F403
from .decisions import *  # noqa: F403
from .events import *  # noqa: F403
from .lifecycle import *  # noqa: F403
from .outbox import *  # noqa: F403
from .schedules import *  # noqa: F403
from .signals import *  # noqa: F403
from .steps import *  # noqa: F403
from .sweeps import *  # noqa: F403
from .turns import *  # noqa: F403
from .updates import *  # noqa: F403
