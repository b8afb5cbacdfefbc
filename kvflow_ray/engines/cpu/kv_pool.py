"""KV storage: token-slot pools (real tensors) and the threads that copy between them.

A pool is one K and one V tensor of shape [layers, slots, kv_heads, head_dim]; a token's KV lives in
one slot, and a radix node's payload is the int64 tensor of its slots (the tree slices it on splits).
The device pool is what the model reads; the host pool is the second tier. Copies between them run
on one thread per direction, as a GPU has one copy engine each way, optionally paced to `link_gbps`
to emulate a PCIe link.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


class KVPool:
    def __init__(self, name: str, slots: int, n_layers: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        if slots <= 0:
            raise ValueError(f"the {name} KV pool needs a positive capacity, got {slots} tokens")
        self.name = name
        self.capacity = slots
        shape = (n_layers, slots, n_kv_heads, head_dim)
        # zeros, not empty: the pages are touched now, so RSS shows the pool from the start
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        # numpy views of the same memory, for the copy threads (see `copy_slots`)
        self._np_k = _numpy_view(self.k)
        self._np_v = _numpy_view(self.v)
        self._free = list(range(slots - 1, -1, -1))  # a stack: recently freed slots are reused first
        self._lock = threading.Lock()  # copy threads allocate too

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def alloc(self, n: int) -> torch.Tensor:
        with self._lock:
            if n > len(self._free):
                raise MemoryError(f"{self.name} KV pool: {n} slots wanted, {len(self._free)} free "
                                  "(the cache's accounting and the pool disagree)")
            taken = self._free[len(self._free) - n:]
            del self._free[len(self._free) - n:]
        return torch.tensor(taken, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        with self._lock:
            self._free.extend(slots.tolist())

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of `slots`, each [layers, len(slots), kv_heads, head_dim]."""
        return self.k.index_select(1, slots), self.v.index_select(1, slots)

    def scatter(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.index_copy_(1, slots, k.to(self.k.dtype))
        self.v.index_copy_(1, slots, v.to(self.v.dtype))


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16: copy its bits as int16
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def copy_slots(src: KVPool, src_slots: torch.Tensor, dst: KVPool, dst_slots: torch.Tensor) -> int:
    """Copy KV between pools on the calling thread; returns the bytes copied.

    numpy, not torch: a torch indexing op on a second thread starts a second OpenMP team, whose
    spinning threads compete with the engine's forward pass for the same cores (measured: paced
    copies overlapping compute made every forward step ~25% slower on 2 cores). numpy copies on
    this thread alone."""
    si, di = src_slots.numpy(), dst_slots.numpy()
    dst._np_k[:, di] = src._np_k[:, si]
    dst._np_v[:, di] = src._np_v[:, si]
    return 2 * len(si) * src._np_k[:, :1].nbytes


@dataclass
class CopyJob:
    src: KVPool
    src_slots: torch.Tensor
    dst: KVPool
    dst_slots: torch.Tensor
    on_done: Callable[[], None]  # run on the engine's thread (see CopyStream.completed)
    speculative: bool = False  # a prefetch: every queued demand copy goes first
    started: float = 0.0
    finished: float = 0.0


class CopyStream:
    """A background thread that copies slots between pools, demand copies before speculative ones
    (prefetches), each kind in submission order; a copy under way always ends. With `link_gbps`,
    each copy takes at least bytes / bandwidth (the thread sleeps out the rest), like a DMA engine
    on a link of that speed. Completions are handed back through `completed()`, so the cache's
    bookkeeping stays on the engine's thread."""

    def __init__(self, name: str, link_gbps: float | None, done: queue.Queue[CopyJob]) -> None:
        if link_gbps is not None and link_gbps <= 0:
            raise ValueError(f"link_gbps must be positive (or unset for an unpaced copy), got {link_gbps}")
        self.name = name
        self.bytes_per_s = None if link_gbps is None else link_gbps * 1e9
        # (0 demand | 1 speculative | 2 stop, submission number, job)
        self._jobs: queue.PriorityQueue[tuple[int, int, CopyJob | None]] = queue.PriorityQueue()
        self._submitted = itertools.count()
        self._done = done
        self.busy_s = 0.0
        self.bytes_copied = 0
        self._thread = threading.Thread(target=self._run, name=f"kvflow-copy-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> None:
        self._jobs.put((int(job.speculative), next(self._submitted), job))

    def close(self) -> None:
        self._jobs.put((2, next(self._submitted), None))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            _kind, _n, job = self._jobs.get()
            if job is None:
                return
            job.started = time.perf_counter()
            nbytes = copy_slots(job.src, job.src_slots, job.dst, job.dst_slots)
            if self.bytes_per_s is not None:
                remaining = job.started + nbytes / self.bytes_per_s - time.perf_counter()
                if remaining > 0:
                    time.sleep(remaining)
            job.finished = time.perf_counter()
            self.busy_s += job.finished - job.started
            self.bytes_copied += nbytes
            self._done.put(job)
