"""The CPU engine's copier: moves radix nodes' KV between its device and host pools for the scheduler
(`core.scheduler.Copier`), on one copy thread each way (`CopyStream`), as a GPU has one copy engine
each way. Copies land on the engine's thread (`land`), where the scheduler hears of them: the cache's
books change on that thread only."""

from __future__ import annotations

import queue
from collections.abc import Callable

import torch

from kvflow_ray.core.radix import RadixNode
from kvflow_ray.engines.cpu.kv_pool import CopyJob, CopyStream, KVPool

# the scheduler's `load_done(nodes, prefetch, device slots per node)` and `offload_done(node, host slots)`
Loaded = Callable[[list[RadixNode], bool, list[object]], None]
Offloaded = Callable[[RadixNode, object], None]


class PoolCopier:
    """Host -> device loads and device -> host write-backs of whole radix nodes. `inflight` counts
    the copies submitted and not yet landed."""

    def __init__(self, device: KVPool, host: KVPool | None, link_gbps: float | None, loaded: Loaded,
                 offloaded: Offloaded) -> None:
        self.device, self.host = device, host
        self._loaded, self._offloaded = loaded, offloaded
        self._landed: queue.Queue[CopyJob] = queue.Queue()
        self.inflight = 0
        self.h2d = CopyStream("h2d", link_gbps, self._landed)
        self.d2h = CopyStream("d2h", link_gbps, self._landed)

    def load(self, nodes: list[RadixNode], tokens: int, prefetch: bool) -> None:
        assert self.host is not None
        dst = [self.device.alloc(len(node.key)) for node in nodes]
        src = torch.cat([node.cpu_value for node in nodes])  # type: ignore[misc]

        def done() -> None:
            self._loaded(nodes, prefetch, list(dst))

        self._submit(self.h2d, CopyJob(self.host, src, self.device, torch.cat(dst), done, speculative=prefetch))

    def write_back(self, nodes: list[RadixNode]) -> None:
        if not nodes:
            return
        assert self.host is not None
        for node in nodes:
            dst = self.host.alloc(len(node.key))

            def done(node: RadixNode = node, dst: torch.Tensor = dst) -> None:
                self._offloaded(node, dst)

            self._submit(self.d2h, CopyJob(self.device, node.gpu_value, self.host, dst, done))  # type: ignore[arg-type]

    def land(self, timeout: float = 0.0) -> None:
        """Report every landed copy (waiting up to `timeout` for a first one); on the engine's thread."""
        try:
            job = self._landed.get(timeout=timeout) if timeout > 0 else self._landed.get_nowait()
        except queue.Empty:
            return
        while True:
            self.inflight -= 1
            job.on_done()
            try:
                job = self._landed.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        self.h2d.close()
        self.d2h.close()

    def _submit(self, stream: CopyStream, job: CopyJob) -> None:
        self.inflight += 1
        stream.submit(job)
