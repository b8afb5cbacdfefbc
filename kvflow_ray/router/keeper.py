"""The store's keeper: an asyncio task that writes a `BufferedStore` behind its owner's changes and
watches the store, so that no call waits on it.

Asleep until a write is queued, it waits `flush_period_s` for more to come and sends them (Redis's
from a worker thread, so the loop keeps serving meanwhile). Once every `probe_period_s` it probes
the store (down? back after an outage? back empty?), has the owner write its whole state back
(`reconcile`) when the store came back or lost its data, and runs the owner's periodic chores
(`every_probe`: expiry, pruning). The router actor keeps its store this way; so will any process
that holds router state (docs/dev/ingress-routing.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvflow_ray.router.store import BufferedStore

FLUSH_PERIOD_S = 0.02  # how far the store may lag the owner's memory
PROBE_PERIOD_S = 1.0  # store health checks and the owner's periodic chores
logger = logging.getLogger(__name__)
T = TypeVar("T")


class StoreKeeper:
    def __init__(self, store: BufferedStore, *, threaded: bool, reconcile: Callable[[], int],
                 every_probe: Callable[[], None] = lambda: None, flush_period_s: float = FLUSH_PERIOD_S,
                 probe_period_s: float = PROBE_PERIOD_S) -> None:
        """`threaded`: the store's calls block on the network (Redis), so they run in a worker
        thread; the in-process store's run on the loop (a thread would only add GIL handoffs)."""
        self.store = store
        self.threaded = threaded
        self.reconcile = reconcile
        self.every_probe = every_probe
        self.flush_period_s = flush_period_s
        self.probe_period_s = probe_period_s
        self._dirty = asyncio.Event()  # the store has writes queued
        store.notify = self._dirty.set
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start (or restart) the task on the running loop; idempotent. Called from the owner's first
        call: an actor's `__init__` runs before its event loop does."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        probed_at = 0.0
        while True:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns instead of raising when
                # its task is cancelled as the event is set, and this loop would then outlive its loop
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, probed_at + self.probe_period_s - time.monotonic())):
                        await self._dirty.wait()
                self._dirty.clear()
                await asyncio.sleep(self.flush_period_s)
                if self.store.up:
                    batch = self.store.take()
                    if batch:
                        self.store.sent(batch, await self._off_loop(self.store.send, batch))
                if time.monotonic() - probed_at >= self.probe_period_s:
                    probed_at = time.monotonic()
                    await self._probe()
                    self.every_probe()
            except Exception:  # a bug here must not end the task (the store would never be written)
                logger.exception("store maintenance failed; retrying")
                await asyncio.sleep(self.probe_period_s)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        if self.threaded:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _probe(self) -> None:
        was_up = self.store.up
        reason = self.store.probed(await self._off_loop(self.store.probe))
        if was_up and not self.store.up:
            logger.warning("the state store is unreachable: serving from memory, %d writes queued",
                           self.store.pending)
        if reason is not None:
            writes = self.reconcile()
            logger.warning("the state store is back (%s): writing the router's state to it again (%d writes)",
                           reason, writes)
