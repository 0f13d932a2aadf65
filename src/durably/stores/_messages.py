"""The message queue contract under its older address.

The protocol and its message types live in the neutral :mod:`durably._queue`,
shared by the stores that implement it and the transports and run queue that
use it. This module only re-exports them, for code that still imports them
from here (``tests/fleet/test_run_queue.py``); new code imports
:mod:`durably._queue`.
"""

from __future__ import annotations

from .._queue import PUSH_CHUNK, Listener, Message, MessageQueue, OutMessage, Unlisten

__all__ = ["PUSH_CHUNK", "Listener", "Message", "MessageQueue", "OutMessage", "Unlisten"]
