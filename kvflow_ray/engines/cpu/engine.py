"""The CPU engine: real transformer compute over a two-tier KV cache whose every decision comes from
`kvflow_ray.core` (`ReplicaScheduler` over a `TieredCache`).

This file owns what an engine owns and nothing more: running the model on the batches the scheduler
picks and placing KV in pool slots; `PoolCopier` (copier.py) copies slots between the device and
host pools. A request's forward pass attends over the stored KV of its cached prefix where it lies
in the device pool and only computes the rest.

Constrained decoding (`GenerateRequest.constraint`, a forced tool call): each output token is the
model's most likely token (or a draw, when the request samples) among those `engines.constrained`
allows; the request ends when the grammar is complete.

Threading: everything below runs on one engine thread (the caller's, via `step()`, or a background
loop via `start()`), except the copy threads, whose completions come back through a queue. Other
threads talk to the engine only through `submit` / `apply_hints` (an inbox queue).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from kvflow_ray.core.kv_budget import PhaseMarkers, parse_scorer
from kvflow_ray.core.policies import StepBook
from kvflow_ray.core.radix import RadixNode
from kvflow_ray.core.reuse import MIN_PLACED, Placement, SegmentBook
from kvflow_ray.core.scheduler import build_replica, resolve_policy
from kvflow_ray.engines.base import (
    BackgroundEngine,
    CacheEvent,
    GenerateRequest,
    GenerateResult,
    Hints,
    ended_turn,
)
from kvflow_ray.engines.constrained import CANDIDATES
from kvflow_ray.engines.cpu.config import CpuEngineConfig
from kvflow_ray.engines.cpu.copier import PoolCopier
from kvflow_ray.engines.cpu.kv_budget import compact
from kvflow_ray.engines.cpu.kv_pool import paced_link
from kvflow_ray.engines.cpu.model import GREEDY_TEMPERATURE, CpuModel, QueryCapture, sample
from kvflow_ray.engines.cpu.requests import CpuRequest, RequestBuilder
from kvflow_ray.engines.cpu.reuse import ReuseCounts, SegmentStore, check_reusable, prefill_reusing
from kvflow_ray.engines.cpu.weights import RANDOM_MODEL_NAME
from kvflow_ray.engines.events import CacheEventLog
from kvflow_ray.engines.tokenizer import load_tokenizer

# An unpaced link's rate for the scheduler's load-time estimates: RAM to RAM on a CPU, PCIe on a GPU
NOMINAL_LINK_GBPS = {"cpu": 5.0, "cuda": 25.0}


class CpuEngine(BackgroundEngine):
    def __init__(self, config: CpuEngineConfig | None = None, *, model: CpuModel | None = None,
                 book: StepBook | None = None) -> None:
        self.config = config = config or CpuEngineConfig()
        policy = resolve_policy(config.policy, serving_on="the CPU engine")
        sizes = ("device_kv_tokens", "chunk_tokens", "max_running") + (("host_kv_tokens",) if policy.host_tier else ())
        for name in sizes:
            if getattr(config, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(config, name)}")
        if config.idle_chunk_tokens is not None and config.idle_chunk_tokens <= 0:
            raise ValueError(f"idle_chunk_tokens must be positive or None, got {config.idle_chunk_tokens}")
        self.model = model if model is not None else CpuModel(config.model, threads=config.threads)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.tokenizer = load_tokenizer(config.model.path)
        m = self.model
        self.device = m.pool("device", config.device_kv_tokens)
        self.host = m.host_pool("host", config.host_kv_tokens) if policy.host_tier else None
        self.events = CacheEventLog()
        on_cpu = m.device.type == "cpu"
        self.link_gbps = paced_link(config.link_gbps, m.device)
        # a history's copy back from the host: its bytes over the link (unpaced: a nominal rate)
        token_bytes = self.device.nbytes / config.device_kv_tokens
        link_bytes_per_s = (self.link_gbps or NOMINAL_LINK_GBPS[m.device.type]) * 1e9
        template = getattr(self.tokenizer, "chat_template", None)
        phase_markers = PhaseMarkers.for_template(template, config.kv_phase_markers)
        parse_scorer(config.kv_scorer)  # a bad default fails at start, not at the first request
        # after the checks above: a setting they refuse leaves no copy thread behind
        self.copier = PoolCopier(self.device, self.host, self.link_gbps,
                                 loaded=lambda nodes, prefetch, dst: self.scheduler.load_done(nodes, prefetch, dst),
                                 offloaded=lambda node, dst: self.scheduler.offload_done(node, dst))
        self.scheduler = build_replica(policy, self.copier, gpu_capacity=config.device_kv_tokens,
                                       cpu_capacity=config.host_kv_tokens, clock=time.perf_counter, book=book,
                                       horizon=config.horizon, max_inflight=config.max_inflight,
                                       max_running=config.max_running, events=self.events, free_value=self._free_value,
                                       load_seconds=lambda tokens: tokens * token_bytes / link_bytes_per_s,
                                       tenant_retain_tokens=config.session_retain_tokens)
        self.book = self.scheduler.book
        self.cache = self.scheduler.cache
        # kept segments (agents' outputs): ranked by the same step book; absent where the model's
        # decoder is not one `prefill_reusing` can run (requests asking for reuse are refused then)
        cannot_reuse = check_reusable(self.model) if on_cpu else f"reuse runs on the CPU only, not {m.device}"
        self.segments = None if cannot_reuse else SegmentStore(
            config.segment_kv_tokens, SegmentBook(config.segment_kv_tokens, self.book))
        self.reuse_counts = ReuseCounts()
        self.request_builder = RequestBuilder(config, self.model, self.tokenizer, self.model_name,
                                              self.cache.gpu_capacity, cannot_reuse, phase_markers)
        self.compactions = 0
        self.dropped_tokens = 0
        self.compaction_s = 0.0
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._loop: threading.Thread | None = None
        self._stop = threading.Event()
        self._step_lock = threading.Lock()
        self._wake = threading.Event()
        self.compute_s = 0.0
        self.forward_steps = 0
        self.requests_done = 0
        self.requests_failed = 0
        self.requests_rejected = 0  # refused by `submit` (bad input): never queued
        self._callbacks: deque[CpuRequest] = deque()

    @property
    def model_name(self) -> str:
        """The `model` requests name: the configured name, else the model directory or the random model's."""
        model = self.config.model
        return model.name or model.path or RANDOM_MODEL_NAME

    @property
    def policy(self) -> str:
        return self.config.policy

    # ------------------------------------------------------------------ the Engine protocol
    def submit(self, request: GenerateRequest, on_token: Callable[[int], None] | None = None,
               on_done: Callable[[CpuRequest], None] | None = None) -> CpuRequest:
        """Queue a request (any thread). Raises ValueError, changing nothing, for a request that can
        never run: empty, too long for the model's context or the device pool, bad parameters."""
        try:
            req = self.request_builder.build(request, on_token)
        except ValueError:
            self.requests_rejected += 1
            raise
        req.on_done = on_done
        self._inbox.put(("request", req))
        self._wake.set()
        return req

    def apply_hints(self, hints: Hints) -> None:
        self._inbox.put(("hints", hints))
        self._wake.set()

    def cache_events(self) -> list[CacheEvent]:
        return self.events.drain()

    def cache_snapshot(self) -> list[CacheEvent] | None:
        with self._step_lock:  # the cache changes only inside a step
            return self.events.snapshot(self.cache.tree.nodes())

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.config.policy,
            "device": str(self.model.device),
            "requests_done": self.requests_done,
            "requests_failed": self.requests_failed,
            "requests_rejected": self.requests_rejected,
            **self.scheduler.snapshot().to_dict(),
            "kv_bytes_per_token": float(self.model.kv_bytes_per_token),
            "reuse": {"reused_tokens": self.reuse_counts.reused - self.reuse_counts.recomputed,
                      "layer_tokens": self.reuse_counts.layer_tokens,
                      "dense_layer_tokens": self.reuse_counts.dense_layer_tokens,
                      "segments": len(self.segments.kv) if self.segments else 0,
                      "segment_kv_bytes": self.segments.nbytes if self.segments else 0},
            "kv_budget": {"compactions": self.compactions, "dropped_tokens": self.dropped_tokens,
                          "compaction_s": self.compaction_s},
            "pool_bytes": self.device.nbytes + (self.host.nbytes if self.host else 0),
            "compute_s": self.compute_s,
            "forward_steps": self.forward_steps,
            "copy_busy_s": {"h2d": self.copier.h2d.busy_s, "d2h": self.copier.d2h.busy_s},
        }

    # ------------------------------------------------------------------ running
    def start(self) -> CpuEngine:
        """Serve from a background thread (generate/stream from any thread then)."""
        if self._loop is None:
            self._stop.clear()
            self._loop = threading.Thread(target=self._run_loop, name="kvflow-cpu-engine", daemon=True)
            self._loop.start()
        return self

    def close(self) -> None:
        if self._loop is not None:
            self._stop.set()
            self._wake.set()
            self._loop.join(timeout=30)
            self._loop = None
        self.copier.close()
        self.device.release()
        if self.host is not None:
            self.host.release()

    def __enter__(self) -> CpuEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run_loop(self) -> None:
        while not self._stop.is_set():
            if not self.step(timeout=0.01):
                self._wake.wait(0.05)
                self._wake.clear()

    def _block_until(self, ready: Callable[[], bool], wait: Callable[[], object]) -> None:
        if self._loop is not None:
            wait()
            return
        while not ready():  # no background loop: drive the engine from here
            self.step(timeout=0.01)

    @property
    def busy(self) -> bool:
        return not (self.scheduler.idle and self.copier.inflight == 0 and self._inbox.empty())

    def step(self, timeout: float = 0.0) -> bool:
        """One scheduling iteration: take new requests and hints, land finished copies, run one forward
        step. Returns False when there is nothing at all to do. When work exists but none can run (it
        waits for copies), blocks up to `timeout` for a copy to land."""
        with self._step_lock:  # callers without a background loop may drive it from several threads
            try:
                return self._step(timeout)
            finally:
                self._run_callbacks()

    def _step(self, timeout: float) -> bool:
        self._drain_inbox()
        self.copier.land()
        wake = self.scheduler.wake_at()
        if wake is not None and time.perf_counter() >= wake:  # a paused session's rank or prefetch is due
            self.scheduler.tick()
        batch = self.scheduler.next_batch(self.config.chunk_tokens, self.config.idle_chunk_tokens)
        if batch is None:
            if not self.busy:
                return False
            if self.copier.inflight and timeout > 0:
                self.copier.land(timeout)
            return True
        started = time.perf_counter()
        if batch.prefill:
            for req, n in batch.prefill:
                self._guard(req, lambda req=req, n=n: self._prefill(req, n))
        else:
            reqs = batch.decode
            self._guard_all(reqs, lambda: self._decode(reqs))
        self.compute_s += time.perf_counter() - started
        self.forward_steps += 1
        return True

    # ------------------------------------------------------------------ inbox
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "request":
                self._admit_request(item)
            else:
                self._apply(item)

    def _admit_request(self, req: CpuRequest) -> None:
        try:
            self.scheduler.submit(req)
        except ValueError as exc:
            self._fail(req, exc)

    def _apply(self, hints: Hints) -> None:
        self.scheduler.apply_hints(hints.steps, hints.prompts, hints.retire, hints.salts, hints.elsewhere)
        if hints.retire and self.segments is not None:  # a finished workflow's outputs have no reader left
            self.segments.retire(list(hints.retire))

    def _free_value(self, node: RadixNode, tier: str, value: object) -> None:
        pool = self.device if tier == "gpu" else self.host
        if value is not None and pool is not None:
            pool.free(value)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ compute
    def _path_slots(self, node: RadixNode | None) -> torch.Tensor:
        """Device slots of the cached prefix ending at `node` (all READY: the request holds a lock)."""
        parts = [n.gpu_value for n in node.path()] if node is not None else []
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)  # type: ignore[arg-type]

    def _prefill(self, req: CpuRequest, n: int) -> None:
        if req.ctx is None:  # first chunk: the cached prefix's slots, then its own for the rest
            req.base = req.prefill_pos
            req.own = self.device.alloc(req.private)
            req.ctx = torch.cat([self._path_slots(req.locked)[:req.base], req.own])
            placements = self._placements(req)
            if placements:
                self._prefill_reusing(req, placements)
                return
        start = req.prefill_pos
        capture = QueryCapture() if req.kv is not None and req.kv.wants_queries else None
        logits = self.model.prefill(self.device, req.tokens[start:start + n], req.ctx[:start + n], capture=capture)
        if req.kv is not None:
            queries, lses = capture.stacked() if capture is not None else (None, None)
            self._observe(req, queries, lses, 0, range(start, start + n), req.tokens[start:start + n])
        if start + n < len(req.tokens):
            self.scheduler.prefill_done(req, n)
            return
        self._prompt_done(req, n, logits)

    def _placements(self, req: CpuRequest) -> list[Placement]:
        """Kept segments in the prompt past its cached prefix (none unless the request asks for reuse)."""
        if req.reuse is None or self.segments is None:
            return []
        for document in req.documents:
            self._keep_document(document, req.cache_salt)
        return self.segments.book.find(req.tokens, req.prefill_pos, req.cache_salt, time.perf_counter())

    def _keep_document(self, tokens: tuple[int, ...], namespace: str) -> None:
        """A client's document, computed alone (positions 0..) in a scratch pool once, kept as a segment."""
        assert self.segments is not None
        book = self.segments.book
        if not MIN_PLACED <= len(tokens) <= book.capacity or book.document(tokens, namespace) is not None:
            return
        scratch = self.model.pool("document", len(tokens))
        slots = torch.arange(len(tokens))
        self.model.prefill(scratch, tokens, slots)
        self.segments.keep(scratch, slots, tokens, 0, namespace, now=time.perf_counter())

    def _prefill_reusing(self, req: CpuRequest, placements: list[Placement]) -> None:
        """The rest of the prompt in one pass, its segments' KV placed by the request's method. KV from
        the first placed token on is approximate: it stays private (`exact_len`), never in the tree."""
        assert req.ctx is not None and req.reuse is not None and self.segments is not None
        start = req.prefill_pos
        logits, counts = prefill_reusing(self.model, self.device, req.tokens, req.ctx[:len(req.tokens)], start,
                                         placements, self.segments, req.reuse)
        # reported reused: placed and not recomputed in every layer (the method's picks count as computed)
        req.exact_len, req.reused = placements[0].at, counts.reused - counts.recomputed
        self.reuse_counts.add(counts)
        self._prompt_done(req, len(req.tokens) - start, logits)

    def _prompt_done(self, req: CpuRequest, n: int, logits: torch.Tensor) -> None:
        """The prompt's last `n` tokens have KV: its (exact) KV joins the tree; keep the slots the tree
        took, free the rest (already cached); the first output token."""
        assert req.ctx is not None
        prompt_len = len(req.tokens)
        adopted: list[tuple[int, int]] = []
        token = self._sample(req, logits)
        finished = self.scheduler.prefill_done(req, n, req.ctx[:prompt_len], adopted)
        assert req.own is not None
        # positions the tree now covers: freed where it already had them; the rest (an uncovered tail,
        # see TieredCache.commit) stays in the request's own slots, private, until it finishes
        covered = req.committed
        head, req.own = req.own[:covered - req.base], req.own[covered - req.base:]
        self._free_unadopted(head, req.base, adopted)
        req.ctx = torch.cat([self._path_slots(req.locked), req.own])
        if req.kv is not None:
            req.kv.positions = [p for p in req.kv.positions if p >= covered]
        else:
            assert len(req.ctx) == prompt_len + req.max_new, (len(req.ctx), prompt_len, req.max_new)
        if self._emit(req, token) or finished:
            self._finish(req)

    def _decode(self, reqs: list[CpuRequest]) -> None:
        for req in reqs:
            if req.kv is not None and req.kv.budget.due(len(req.kv.positions)):
                self._compact(req)
        positions = [len(r.tokens) + len(r.out) - 1 for r in reqs]  # of the token fed now
        # its KV entries so far (a compacted request's are fewer than its positions), then the new token's
        written = [pos if r.kv is None else r.committed + len(r.kv.positions) for r, pos in zip(reqs, positions,
                                                                                                 strict=True)]
        contexts = [r.ctx[:n + 1] for r, n in zip(reqs, written, strict=True)]  # type: ignore[index]
        capture = QueryCapture() if any(r.kv is not None and r.kv.wants_queries for r in reqs) else None
        logits = self.model.decode(self.device, [r.out[-1] for r in reqs], contexts, positions=positions,
                                   capture=capture)
        queries, lses = capture.stacked() if capture is not None else (None, None)
        for i, (req, pos) in enumerate(zip(reqs, positions, strict=True)):
            if req.kv is not None:
                self._observe(req, queries, lses, i, [pos], [req.out[-1]])
        for i, req in enumerate(reqs):
            token = self._sample(req, logits[i])
            eos = self._emit(req, token)
            if self.scheduler.decoded(req, eos):
                self._finish(req)

    def _observe(self, req: CpuRequest, queries: torch.Tensor | None, lses: torch.Tensor | None, row: int,
                 positions: range | list[int], tokens: tuple[int, ...] | list[int]) -> None:
        """A budgeted request computed `tokens` at `positions` (row `row` of the captured queries and
        log-sum-exps, `QueryCapture.stacked`): they are private KV entries now, and their queries go
        to its scorer."""
        assert req.kv is not None
        req.kv.observe(None if queries is None else queries[row], None if lses is None else lses[row],
                       list(positions), [self.tokenizer.piece(t) for t in tokens])

    def _compact(self, req: CpuRequest) -> None:
        """Keep B of its private entries (docs/design.md §13); the slots past B + Δ go back to the pool."""
        assert req.kv is not None and req.own is not None and req.ctx is not None
        started = time.perf_counter()
        before = len(req.kv.positions)
        held, freed = compact(self.device, req.own, req.kv)
        if len(freed):
            self.device.free(freed)
        req.own = held
        req.ctx = torch.cat([req.ctx[:req.committed], held])
        self.scheduler.compacted(req, len(held))
        self.compactions += 1
        self.dropped_tokens += before - len(req.kv.positions)
        self.compaction_s += time.perf_counter() - started

    def _sample(self, req: CpuRequest, logits: torch.Tensor) -> int:
        constraint = req.constraint
        if constraint is None:
            return sample(logits, req.temperature, req.generator, req.top_p)
        budget = req.max_new - len(req.out)  # tokens this request may still produce, this one included
        if req.temperature < GREEDY_TEMPERATURE:  # the most likely token the grammar allows
            return constraint.choose(torch.topk(logits, min(CANDIDATES, len(logits))).indices.tolist(), budget)
        # a draw from the model's distribution over the allowed tokens: a disallowed draw is masked out
        # and drawn again (exact for the renormalised distribution), at most CANDIDATES times
        masked = logits.float().clone()
        for _ in range(min(CANDIDATES, len(logits) - 1)):
            token = sample(masked, req.temperature, req.generator, req.top_p)
            if constraint.fits(token, budget):
                return token
            masked[token] = float("-inf")
        return constraint.forced()

    def _emit(self, req: CpuRequest, token: int) -> bool:
        """Record an output token; True if it ends the request (a stop string or end of sequence).
        Tokens reach `on_token` once their text cannot be part of a stop string (`StopTokens`)."""
        assert req.stops is not None
        req.out.append(token)
        if req.stops.push(token)[1]:
            req.finish_reason = "stop"
            return True
        if req.constraint is not None:  # a constrained output ends where its grammar does, not at EOS
            if req.constraint.advance(token):
                req.finish_reason = "stop"
                return True
            return False
        if not req.ignore_eos and token == self.tokenizer.eos_id:
            req.finish_reason = "stop"
            return True
        return False

    def _finish(self, req: CpuRequest) -> None:
        assert req.ctx is not None and req.own is not None
        prompt_len = len(req.tokens)
        sequence = req.tokens + tuple(req.out[:-1])  # the last token was sampled, never fed: no KV
        adopted: list[tuple[int, int]] = []
        own = req.own
        if req.session is not None:  # the tool its output calls: what its pause is learned under
            req.session = ended_turn(req.session, self.tokenizer.decode(list(req.out)))
        if req.reuse is not None and req.workflow is not None and self.segments is not None:
            # its output, as decoded, for the agents after it that read it (until the workflow ends)
            self.segments.keep(self.device, req.ctx[prompt_len:len(sequence)], sequence[prompt_len:], prompt_len,
                               req.cache_salt, req.workflow, req.agent, now=time.perf_counter())
        if req.kv is not None:  # the sequence before its first dropped position is exact (all, if none was)
            req.exact_len = req.kv.first_dropped
        # own[i] holds position committed + i up to the first dropped one: all the tree can adopt
        self.scheduler.finish(req, sequence, req.ctx[:len(req.exact(sequence))], adopted,
                              free_slots=lambda: self._free_unadopted(own, req.committed, adopted))
        req.ctx = req.own = None
        assert req.stops is not None
        req.stops.finish()  # streams what was held back in case it started a stop string
        now = time.perf_counter()
        # the output as the client sees it: cut before a stop string (the KV above kept every token)
        req.result = GenerateResult(
            tokens=req.stops.tokens, text=req.stops.text, prompt_tokens=prompt_len,
            gpu_hit_tokens=req.gpu_hit, cpu_hit_tokens=req.cpu_hit, miss_tokens=req.miss, stall_s=req.stall,
            ttft_s=req.first_token_at - req.submitted_at, latency_s=now - req.submitted_at,
            finish_reason=req.finish_reason, reused_tokens=req.reused)
        self.requests_done += 1
        self._callbacks.append(req)

    def _free_unadopted(self, slots: torch.Tensor, offset: int, adopted: list[tuple[int, int]]) -> None:
        """`slots` hold positions offset.. of a committed sequence; the tree took `adopted` ranges."""
        keep = torch.zeros(len(slots), dtype=torch.bool)
        for lo, hi in adopted:
            lo, hi = max(lo - offset, 0), min(hi - offset, len(slots))
            if lo < hi:
                keep[lo:hi] = True
        if not bool(keep.all()):
            self.device.free(slots[~keep])

    # ------------------------------------------------------------------ failures
    def _guard(self, req: CpuRequest, fn: Callable[[], None]) -> None:
        self._guard_all([req], fn)

    def _guard_all(self, reqs: list[CpuRequest], fn: Callable[[], None]) -> None:
        """A request whose step fails is dropped with its error; the engine keeps serving the rest."""
        try:
            fn()
        except Exception as exc:
            for req in reqs:
                if req.result is None and req.error is None:
                    self._release(req)
                    self._fail(req, exc)

    def _release(self, req: CpuRequest) -> None:
        if req.own is not None and req in self.scheduler.running:
            self.device.free(req.own)  # every own slot is private (see CpuRequest.own)
        self.scheduler.cancel(req)
        req.ctx = req.own = None

    def _fail(self, req: CpuRequest, exc: BaseException) -> None:
        req.error = exc
        self.requests_failed += 1
        self._callbacks.append(req)

    def _run_callbacks(self) -> None:
        """Completion callbacks run after the step, outside its error handling: a failing callback
        is the caller's bug and must surface, not be taken for a failed request."""
        while self._callbacks:
            req = self._callbacks.popleft()
            if req.on_done is not None:
                req.on_done(req)
