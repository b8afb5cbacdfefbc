"""StoreKeeper: writes a buffered store behind its owner, probes it, and has the owner write its state
back when the store lost it (the router actor's store, kept on the actor's loop)."""

from __future__ import annotations

import asyncio

from kvflow_ray.router.keeper import StoreKeeper
from kvflow_ray.router.store import BufferedStore, MemoryStore


def test_the_keeper_writes_behind_probes_and_has_the_owner_write_back_after_data_loss() -> None:
    inner = MemoryStore()
    inner.set_marker("router")  # what a router writes to a store it starts on
    store = BufferedStore(inner)
    reconciled: list[int] = []
    chores: list[int] = []

    def reconcile() -> int:
        reconciled.append(1)
        store.set_marker("router")  # as RouterCore.reconcile does, with everything it holds
        store.put_client("acme", "c1", {"state": "again"})
        return 2

    async def main() -> None:
        keeper = StoreKeeper(store, threaded=False, reconcile=reconcile, every_probe=lambda: chores.append(1),
                             flush_period_s=0.01, probe_period_s=0.05)
        keeper.start()
        keeper.start()  # idempotent: one task
        store.put_client("acme", "c1", {"state": "first"})
        assert inner.get_client("acme", "c1") is None  # queued, not written yet
        await asyncio.sleep(0.04)
        assert inner.get_client("acme", "c1") == {"state": "first"} and store.pending == 0
        with inner._lock:
            inner._data.clear()  # the store restarted empty: its marker is gone
        await asyncio.sleep(0.2)
        assert reconciled == [1] and store.reconciles["data_loss"] == 1
        assert inner.get_client("acme", "c1") == {"state": "again"}  # the owner's write-back reached it
        assert len(chores) >= 2  # the owner's chores run at every probe

    asyncio.run(main())
