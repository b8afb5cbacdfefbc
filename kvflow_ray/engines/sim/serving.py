"""The simulator as a serving engine: a `SimReplica` (GPU cost profile, compute and copy streams,
the shared `ReplicaScheduler`) run against the wall clock, behind the Engine protocol.

It answers real requests, with GPU timing from a profile (e.g. `a10g-llama3.1-8b`) and made-up
output tokens, so the whole serving stack (router, Ray Serve, metrics) can run at GPU-like speed and
scale on machines without a GPU: a dozen simulated A10G replicas cost almost no CPU.
`time_scale` stretches or shrinks simulated time (0.1: ten times faster than the profile's GPU).

Threading: one clock thread runs every event (the replica's steps, copy completions, new requests,
hints) in time order; other threads only enqueue.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvflow_ray.core.kv_budget import KvBudget, parse_scorer
from kvflow_ray.engines.base import (
    BackgroundEngine,
    CacheEvent,
    GenerateRequest,
    GenerateResult,
    Hints,
    ended_turn,
    request_tokens,
    session_turn,
    thread_cpu_seconds,
)
from kvflow_ray.engines.events import CacheEventLog
from kvflow_ray.engines.sim.profile import Profile, load_profile
from kvflow_ray.engines.sim.replica import SimReplica, SimRequest
from kvflow_ray.engines.stops import StopTokens
from kvflow_ray.engines.tokenizer import ByteTokenizer

MAX_CONTEXT = 131_072  # the profiles' models (Llama 3.1, Qwen 2.5) take 128k tokens


@dataclass(eq=False)
class ServedRequest(SimRequest):
    result: GenerateResult | None = None
    error: BaseException | None = None  # never set: a simulated step does not fail


class WallClock:
    """The simulator's event interface (`now`, `at`, `measuring`) on the wall clock: simulated time
    is elapsed wall time divided by `time_scale`; each event runs when its time comes."""

    measuring = True

    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.time_scale = time_scale
        self._t0 = time.monotonic()
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvflow-sim-clock", daemon=True)
        self._thread.start()

    @property
    def now(self) -> float:
        return (time.monotonic() - self._t0) / self.time_scale

    def at(self, when: float, fn: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._events, (when, next(self._seq), fn))
            self._cond.notify()

    def soon(self, fn: Callable[[], None]) -> None:
        self.at(self.now, fn)

    def cpu_seconds(self) -> float:
        """CPU time the clock's thread has used: all of the simulated engine's work runs on it."""
        return thread_cpu_seconds(self._thread)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (not self._events or self._events[0][0] > self.now):
                    wait = (self._events[0][0] - self.now) * self.time_scale if self._events else None
                    self._cond.wait(wait)
                if self._stop:
                    return
                _when, _seq, fn = heapq.heappop(self._events)
            fn()  # outside the lock: events schedule more events


class SimEngine(BackgroundEngine):
    """Engine protocol over a wall-clock `SimReplica`."""

    def __init__(self, profile: str | Profile = "a10g-llama3.1-8b", *, policy: str = "kvflow", horizon: int = 1,
                 time_scale: float = 1.0, device_kv_tokens: int | None = None, max_inflight: int = 4,
                 session_retain_tokens: int | None = None) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.policy = policy
        self.tokenizer = ByteTokenizer()
        self.events = CacheEventLog()
        self.clock = WallClock(time_scale)
        try:
            self.replica = SimReplica(self.clock, 0, self.profile, policy, horizon=horizon,
                                      max_inflight=max_inflight, gpu_capacity=device_kv_tokens, events=self.events,
                                      serving_on="the simulator engine", session_retain_tokens=session_retain_tokens)
        except ValueError:
            self.clock.close()
            raise
        self.book = self.replica.scheduler.book
        self.cache = self.replica.cache
        self.scheduler = self.replica.scheduler
        self.requests_done = 0
        self.requests_rejected = 0

    @property
    def model_name(self) -> str:
        return f"sim-{self.profile.name}"

    # ------------------------------------------------------------------ the Engine protocol
    def submit(self, request: GenerateRequest, on_token: Callable[[int], None] | None = None,
               on_done: Callable[[ServedRequest], None] | None = None) -> ServedRequest:
        """Queue a request (any thread); ValueError, changing nothing, for one that can never run."""
        try:
            kv_budget = None if request.kv_budget is None else KvBudget(request.kv_budget)
            if request.kv_scorer is not None:
                parse_scorer(request.kv_scorer)
            tokens = request_tokens(request, model_name=self.model_name, encode=self.tokenizer.encode,
                                    vocab_size=self.tokenizer.vocab_size, max_context=MAX_CONTEXT,
                                    device_tokens=self.cache.gpu_capacity, kv_budget=kv_budget, budgets=True)
            session = session_turn(request)
        except ValueError:
            self.requests_rejected += 1
            raise
        # made-up output: printable bytes, a function of the prompt (and the seed), so replays agree;
        # temperature and top_p do not change it. A stop string ends it where a real engine would: the
        # tokens up to the one that completes the stop string are generated (and simulated), the
        # result is cut before it.
        rng = random.Random(hash((tokens, request.seed or 0)))
        stops = StopTokens(request.stop, self.tokenizer.decode)
        generated: list[int] = []
        while len(generated) < request.max_tokens and not stops.stopped:
            generated.append(rng.randrange(32, 127))
            stops.push(generated[-1])
        stops.finish()
        output = tuple(generated)
        reason = "stop" if stops.stopped else "length"
        submitted = time.perf_counter()
        fixed = request.fixed_prefix_tokens

        def done(req: SimRequest) -> None:
            assert isinstance(req, ServedRequest)
            now = time.perf_counter()
            ttft = (req.first_token_at - req.arrival) * self.clock.time_scale
            req.result = GenerateResult(
                tokens=stops.tokens, text=stops.text, prompt_tokens=len(tokens),
                gpu_hit_tokens=req.gpu_hit, cpu_hit_tokens=req.cpu_hit, miss_tokens=req.miss,
                stall_s=req.stall * self.clock.time_scale, ttft_s=ttft, latency_s=now - submitted,
                finish_reason=reason)
            self.requests_done += 1
            for token in req.result.tokens if on_token is not None else ():
                on_token(token)
            if on_done is not None:
                on_done(req)

        req = ServedRequest(workflow=request.workflow, agent=request.agent, tokens=tokens,
                            fixed_len=fixed if fixed is not None else -1, max_new=request.max_tokens,
                            cache_salt=request.cache_salt, output_tokens=output, on_done=done, kv_budget=kv_budget,
                            session=None if session is None else ended_turn(session, stops.text))

        self.clock.soon(lambda: self.replica.submit(req))
        return req

    def stream(self, request: GenerateRequest) -> Iterator[int | GenerateResult]:
        result = self.generate(request)  # tokens appear when the simulated request finishes
        yield from result.tokens
        yield result

    def apply_hints(self, hints: Hints) -> None:
        def apply() -> None:
            self.scheduler.apply_hints(hints.steps, hints.prompts, hints.retire, hints.salts, hints.elsewhere)
            self.replica.kick()

        self.clock.soon(apply)

    def cache_snapshot(self) -> list[CacheEvent] | None:
        """Taken on the clock's thread, where every change to the cache happens."""
        done = threading.Event()
        out: list[CacheEvent] = []

        def take() -> None:
            out.extend(self.events.snapshot(self.cache.tree.nodes()))
            done.set()

        self.clock.soon(take)
        return out if done.wait(30) else None

    def cache_events(self) -> list[CacheEvent]:
        return self.events.drain()

    def stats(self) -> dict[str, Any]:
        return {"policy": self.policy, "profile": self.profile.name, "requests_done": self.requests_done,
                "requests_failed": 0, "requests_rejected": self.requests_rejected,
                **self.scheduler.snapshot().to_dict(), "kv_bytes_per_token": self.profile.kv_bytes_per_token,
                "compute_cpu_s": self.clock.cpu_seconds()}

    def start(self) -> SimEngine:
        return self  # the clock thread runs from construction

    def close(self) -> None:
        self.clock.close()
