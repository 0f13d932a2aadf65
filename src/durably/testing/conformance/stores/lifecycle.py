"""The StateStore contract for the store's lifecycle (``StoreConnection``):
several objects on one database, reopening.

Same fixtures as every ``stores`` module: ``store`` is an open store on an
empty database, ``store_factory`` makes more store objects on the same
database; see :mod:`durably.testing.conformance`. Every time is an explicit
integer.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from durably.stores import StateStore

from ._helpers import (
    LEASE,
    NESTED,
    NOW,
    OWNER,
    leased,
    make_cp,
)

if TYPE_CHECKING:
    from .. import StoreFactory


# -- lifecycle -------------------------------------------------------------------------


async def test_stores_on_one_database_share_state(store_factory: StoreFactory) -> None:
    # two stores opening a fresh database at once both end up on the same schema
    first, second = await store_factory(opened=False), await store_factory(opened=False)
    await asyncio.gather(first.open(), second.open())
    await first.open()  # idempotent

    await leased(first, "r1")
    await first.save_checkpoint(make_cp("r1", 0, output=NESTED), OWNER)

    run = await second.get_run("r1")
    assert run is not None
    assert run.locked_by == OWNER
    assert (await second.load_checkpoints("r1"))[0].output == NESTED
    assert await second.renew_lease("r1", OWNER, NOW + 2 * LEASE) is True
    assert isinstance(first.url, str)
    assert isinstance(first, StateStore)


async def test_a_store_reopened_after_close_keeps_its_data(store: StateStore) -> None:
    await leased(store, "r1")
    await store.close()
    await store.close()  # idempotent

    await store.open()

    run = await store.get_run("r1")
    assert run is not None
    assert run.locked_by == OWNER
