"""KV storage: token-slot pools (real tensors) and the threads that copy between them.

A pool is one K and one V tensor of shape [layers, kv_heads, slots, head_dim]; a token's KV lives in
one slot, and a radix node's payload is the int64 tensor of its slots (the tree slices it on splits).
The device pool is what the model reads; the host pool is the second tier. Copies between them run
on one thread per direction, as a GPU has one copy engine each way. On a CPU the two pools are both in
RAM and a copy can be paced to `link_gbps` to emulate a PCIe link; on a CUDA device the host pool is
pinned and each thread issues its copies on its own CUDA stream (docs/gpu.md): a copy waits for the
compute queued before it was submitted (an event), and is reported done only once its own event has
completed, so a request never reads KV before its copy lands.
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
                 dtype: torch.dtype, device: torch.device | str = "cpu", pinned: bool = False) -> None:
        if slots <= 0:
            raise ValueError(f"the {name} KV pool needs a positive capacity, got {slots} tokens")
        self.name = name
        self.capacity = slots
        # head-major: one head's keys of a run of slots are one contiguous block, which attention reads
        # fastest (measured: a decode step's attention over 8 contexts took 1.6x as long token-major)
        shape = (n_layers, n_kv_heads, slots, head_dim)
        self.device = torch.device(device)
        # zeros, not empty: the pages are touched now, so RSS shows the pool from the start; a host pool
        # that a GPU copies to and from is pinned (page-locked), so its copies are asynchronous DMA
        self.k = torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pinned)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pinned)
        # numpy views of a RAM pool's memory, for the copy threads (see `copy_slots`)
        on_cpu = self.device.type == "cpu"
        self._np_k = _numpy_view(self.k) if on_cpu else None
        self._np_v = _numpy_view(self.v) if on_cpu else None
        self._free = FreeRuns(slots)
        self._lock = threading.Lock()  # copy threads allocate too

    @property
    def free_slots(self) -> int:
        return self._free.total

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def release(self) -> None:
        """Give the pool's memory back now; the pool holds nothing after. An engine and its scheduler
        refer to each other, so a closed engine lives until the cycle collector runs, which tensor
        allocations hardly ever trigger, and its pools are gigabytes (SmolLM2's default host tier: 3 GB).
        Only a closed engine's pools are released."""
        self.k = self.k.new_empty((0,))
        self.v = self.v.new_empty((0,))
        self._np_k = self._np_v = None

    def alloc(self, n: int) -> torch.Tensor:
        """`n` free slots, as few contiguous runs as the free space allows, in ascending order within a
        run: the model attends over a sequence's runs in place (`CpuModel`), one view per run."""
        with self._lock:
            if n > self._free.total:
                raise MemoryError(f"{self.name} KV pool: {n} slots wanted, {self._free.total} free "
                                  "(the cache's accounting and the pool disagree)")
            runs = self._free.take(n)
        if len(runs) == 1:
            return torch.arange(runs[0][0], runs[0][1], dtype=torch.int64)
        return torch.cat([torch.arange(lo, hi, dtype=torch.int64) for lo, hi in runs])

    def free(self, slots: torch.Tensor) -> None:
        runs = slot_runs(slots)
        with self._lock:
            for lo, hi in runs:
                self._free.give(lo, hi)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of `slots` (host-side int64, as the cache keeps them), each [layers, kv_heads, len(slots), head_dim]."""
        index = slots.to(self.device)
        return self.k.index_select(2, index), self.v.index_select(2, index)


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """The maximal runs of consecutive slots in `slots`, in order: [(first, past the last), ...]."""
    if len(slots) == 0:
        return []
    s = slots.numpy()
    breaks = np.flatnonzero(np.diff(s) != 1) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), len(s)]
    return [(int(s[a]), int(s[b - 1]) + 1) for a, b in zip(starts, ends, strict=True)]


class FreeRuns:
    """A pool's free slots as maximal runs [lo, hi), merged with their neighbours when given back.
    `take` is best fit: the smallest run that holds the whole request, else the largest runs first,
    so that a sequence's KV stays in few runs. O(free runs) per call."""

    def __init__(self, slots: int) -> None:
        self.by_start: dict[int, int] = {0: slots}  # lo -> hi
        self.by_end: dict[int, int] = {slots: 0}  # hi -> lo
        self.total = slots

    def take(self, n: int) -> list[tuple[int, int]]:
        fits = [(hi - lo, lo) for lo, hi in self.by_start.items() if hi - lo >= n]
        if fits:
            _size, lo = min(fits)
            self._cut(lo, lo + n)
            return [(lo, lo + n)]
        out = []
        for size, lo in sorted(((hi - lo, lo) for lo, hi in self.by_start.items()), reverse=True):
            part = min(size, n)
            self._cut(lo, lo + part)
            out.append((lo, lo + part))
            n -= part
            if n == 0:
                break
        return out

    def _cut(self, lo: int, hi: int) -> None:
        """Take [lo, hi) from the front of the free run starting at lo."""
        end = self.by_start.pop(lo)
        del self.by_end[end]
        if hi < end:
            self.by_start[hi] = end
            self.by_end[end] = hi
        self.total -= hi - lo

    def give(self, lo: int, hi: int) -> None:
        self.total += hi - lo
        before = self.by_end.pop(lo, None)  # a free run ending where this one starts
        if before is not None:
            del self.by_start[before]
            lo = before
        after = self.by_start.pop(hi, None)  # one starting where this ends
        if after is not None:
            del self.by_end[after]
            hi = after
        self.by_start[lo] = hi
        self.by_end[hi] = lo


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16: copy its bits as int16
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def copy_slots(src: KVPool, src_slots: torch.Tensor, dst: KVPool, dst_slots: torch.Tensor) -> int:
    """Copy KV between two RAM pools on the calling thread; returns the bytes copied.

    numpy, not torch: a torch indexing op on a second thread starts a second OpenMP team, whose
    spinning threads compete with the engine's forward pass for the same cores (measured: paced
    copies overlapping compute made every forward step ~25% slower on 2 cores). numpy copies on
    this thread alone."""
    assert src._np_k is not None and src._np_v is not None and dst._np_k is not None and dst._np_v is not None
    si, di = src_slots.numpy(), dst_slots.numpy()
    dst._np_k[:, :, di] = src._np_k[:, :, si]
    dst._np_v[:, :, di] = src._np_v[:, :, si]
    return 2 * len(si) * src._np_k[:, :, :1].nbytes


def copy_slots_cuda(src: KVPool, src_slots: torch.Tensor, dst: KVPool, dst_slots: torch.Tensor,
                    stream: torch.cuda.Stream, after: torch.cuda.Event | None) -> int:
    """Copy KV between a CUDA pool and a pinned host pool on `stream`, once the compute queued before
    `after` was recorded is done (it may still read or write those device slots); returns the bytes
    copied, when the copy has landed. The host side goes through a pinned staging buffer (a token's
    KV is not contiguous in a head-major pool), so each of K and V crosses the link as one
    asynchronous DMA; the calling (copy) thread waits on the copy's event, never the compute stream."""
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host pool, pinned copy of the device KV)
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        for s_pool, d_pool in ((src.k, dst.k), (src.v, dst.v)):
            if src.device.type == "cuda":  # device -> host: gather on the GPU, DMA into pinned staging
                gathered = s_pool.index_select(2, src_slots.to(src.device))
                host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                host.copy_(gathered, non_blocking=True)
                staged.append((d_pool, host))
            else:  # host -> device: gather into pinned staging here, DMA, scatter on the GPU
                host = torch.empty((s_pool.shape[0], s_pool.shape[1], len(src_slots), s_pool.shape[3]),
                                   dtype=s_pool.dtype, pin_memory=True)
                torch.index_select(s_pool, 2, src_slots, out=host)
                moved = host.to(dst.device, non_blocking=True)
                d_pool.index_copy_(2, dst_slots.to(dst.device), moved)
        landed = torch.cuda.Event()
        landed.record(stream)
    landed.synchronize()  # releases the GIL: compute goes on meanwhile
    for d_pool, host in staged:
        d_pool.index_copy_(2, dst_slots, host)
    return 2 * len(src_slots) * src.k[:, :, :1].nbytes


def paced_link(link_gbps: float | None, device: torch.device) -> float | None:
    """The pacing copies to and from a pool on `device` get: `link_gbps` on a CPU (an emulated PCIe
    link), none on a GPU (the link is the real one)."""
    return link_gbps if device.type == "cpu" else None


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
    after: torch.cuda.Event | None = None  # CUDA: recorded on the compute stream when submitted

    @property
    def cuda_device(self) -> torch.device | None:
        """The CUDA device this copy touches (None: both pools are in RAM)."""
        return next((pool.device for pool in (self.src, self.dst) if pool.device.type == "cuda"), None)


class CopyStream:
    """A background thread that copies slots between pools, demand copies before speculative ones
    (prefetches), each kind in submission order; a copy under way always ends. With `link_gbps`,
    each copy takes at least bytes / bandwidth (the thread sleeps out the rest), like a DMA engine
    on a link of that speed. Copies that touch a CUDA pool run on the thread's own CUDA stream
    (`cuda_stream`, made at the first such copy), after the compute submitted before them
    (`copy_slots_cuda`). Completions are handed back through the `done` queue, so the cache's
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
        self.cuda_stream: torch.cuda.Stream | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvflow-copy-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> None:
        device = job.cuda_device
        if device is not None:  # the copy must not overtake the kernels already queued on those slots
            job.after = torch.cuda.Event()
            job.after.record(torch.cuda.current_stream(device))
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
            device = job.cuda_device
            if device is not None:
                if self.cuda_stream is None:
                    self.cuda_stream = torch.cuda.Stream(device)
                nbytes = copy_slots_cuda(job.src, job.src_slots, job.dst, job.dst_slots, self.cuda_stream, job.after)
            else:
                nbytes = copy_slots(job.src, job.src_slots, job.dst, job.dst_slots)
            if self.bytes_per_s is not None:
                remaining = job.started + nbytes / self.bytes_per_s - time.perf_counter()
                if remaining > 0:
                    time.sleep(remaining)
            job.finished = time.perf_counter()
            self.busy_s += job.finished - job.started
            self.bytes_copied += nbytes
            self._done.put(job)
