"""EngineReplica: one Ray Serve replica around one engine (one per GPU; CPU engines on CPU).

The replica serves `generate` / `stream` calls from the ingress and keeps one conversation with the
workflow router going on a background thread: a long poll (`exchange`), one at a time, that returns
as soon as the router has new steps-to-execution, agents' prompts or retired workflows for this
replica (they go straight to `engine.apply_hints`), else after a second. Each poll carries what the
replica has to say:
- the engine's cache events and its calls' first tokens since the last poll (the next numbered batch
  of its feed), so the router knows which prefixes live here; while a poll is held at the router
  (no hints coming), they go on their own every 250 ms;
- once a second, its report: a heartbeat with its metrics and its load (device KV pool, usage and
  queue, which routing policies read).
A busy replica's events and reports thus ride the polls its hints need anyway. Router calls that fail
(the router restarting) are retried; serving never waits on the router.

Its name towards the router is Serve's replica id (`unique_id`), which is what the request router
sees for each candidate replica, so a routing decision names a replica both sides recognise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import ray
from ray import serve

from kvflow_ray.engines.base import GenerateRequest, GenerateResult, Hints
from kvflow_ray.serve.config import AppConfig
from kvflow_ray.serve.metrics import ReplicaMetrics, as_snapshot
from kvflow_ray.serve.openai_api import agent_prefix
from kvflow_ray.serve.router_actor import get_router

logger = logging.getLogger("ray.serve")
REPORT_PERIOD_S = 1.0
EVENTS_PERIOD_S = 0.25
HINT_PULL_GAP_S = 0.1  # at most this often: with many ingresses syncing, pulls stay bounded (hints merge)
PROMPT_CACHE_TOKENS = 1 << 21  # tokenized agent prompts kept (about 16 MB of ids)
RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(GenerateResult))


def make_engine(config: AppConfig) -> Any:
    """The engine a replica runs, started on its background thread."""
    if config.engine == "cpu":
        from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig
        from kvflow_ray.engines.cpu.engine import CpuEngine

        sizes = {} if config.device_kv_tokens is None else {"device_kv_tokens": config.device_kv_tokens}
        engine_config = CpuEngineConfig(
            model=ModelConfig.named(config.model, path=config.cpu_model_dir(), name=config.model_name(),
                                    seed=config.seed),
            policy=config.policy,
            host_kv_tokens=config.host_kv_tokens, link_gbps=config.link_gbps, max_running=config.max_running,
            horizon=config.horizon, threads=config.engine_threads(), session_retain_tokens=config.session_retain_tokens,
            segment_kv_tokens=config.segment_kv_tokens, **sizes)
        return CpuEngine(engine_config).start()
    if config.engine == "sim":
        from kvflow_ray.engines.sim.serving import SimEngine

        return SimEngine(config.profile, policy=config.policy, horizon=config.horizon, time_scale=config.time_scale,
                         device_kv_tokens=config.device_kv_tokens, session_retain_tokens=config.session_retain_tokens)
    if config.engine == "sglang":
        from kvflow_ray.engines.sglang.engine import SglangEngine

        # one in-process SGLang engine on this replica's GPU (Ray sets CUDA_VISIBLE_DEVICES for the actor)
        return SglangEngine(**config.sglang_engine_kwargs())
    raise ValueError(f"engine {config.engine!r} cannot run in an EngineReplica yet")


def load_report(stats: Mapping[str, Any]) -> dict[str, float]:
    """What the router's routing policies read of an engine's `stats()`: its device KV pool in tokens
    (`capacity`), the share of it in use (`usage`) and its waiting queue (`waiting`)."""
    snapshot = as_snapshot(stats)
    capacity = int(snapshot.capacity_tokens.get("gpu", 0))
    used = snapshot.cache_tokens.get("gpu", 0)
    return {"capacity": capacity, "usage": used / capacity if capacity > 0 else 0.0, "waiting": snapshot.waiting}


class EngineReplica:
    """The deployment class (wrapped by `serve.deployment` in `app.py`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = AppConfig.from_dict(config)
        self.name: str = serve.get_replica_context().replica_id.unique_id
        self.engine = make_engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.metrics = ReplicaMetrics(self.name)  # engine series from the stats each report reads
        self.router = get_router(self.config.router_settings())
        # agent prompt text -> its token ids, least recently used first; bounded in tokens, since every
        # workflow instance may bring prompts of its own
        self._prefix_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._prefix_cache_tokens = 0
        self._stop = threading.Event()
        self._events_lock = threading.Lock()  # one drain of the engine's events at a time, in order
        # (workflow key, agent) of the calls prefilled since the last push; its own lock, since the engine's
        # thread appends (holding its own locks) while a push may be waiting on the engine
        self._first_tokens: list[tuple[str, str, int | None]] = []
        self._first_lock = threading.Lock()
        self._events_sent = 0  # batches of cache events sent (the feed's sequence number)
        self._polled_at = 0.0  # when the latest exchange went to the router (monotonic)
        self._register()
        for target in (self._hub_loop, self._event_loop):
            threading.Thread(target=target, name=f"kvflow-{target.__name__}", daemon=True).start()
        logger.info("EngineReplica %s serving %s (%s)", self.name, self.engine.model_name, self.config.policy)

    # ------------------------------------------------------------------ serving
    async def generate(self, request: dict[str, Any], kvflow_replica: str | None = None) -> dict[str, Any]:
        """Run one request. `kvflow_replica` is the router's choice, read by the request router
        (here only for the record). Bad input comes back as {"error": ..., "status": 400}."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        try:
            self.engine.submit(GenerateRequest(**request), on_token=self._first_token_hook(request),
                               on_done=lambda r: loop.call_soon_threadsafe(done.set_result, r))
        except ValueError as exc:
            return {"replica": self.name, "error": str(exc), "status": 400}
        req = await done
        return self._outcome(req)

    async def stream(self, request: dict[str, Any], kvflow_replica: str | None = None
                     ) -> AsyncIterator[dict[str, Any]]:
        """Yield {"text": delta} as tokens arrive, then the outcome of `generate`."""
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[Any] = asyncio.Queue()
        first = self._first_token_hook(request)

        def on_token(token: int) -> None:
            if first is not None:
                first(token)
            loop.call_soon_threadsafe(tokens.put_nowait, token)

        try:
            self.engine.submit(GenerateRequest(**request), on_token=on_token,
                               on_done=lambda r: loop.call_soon_threadsafe(tokens.put_nowait, r))
        except ValueError as exc:
            yield {"replica": self.name, "error": str(exc), "status": 400}
            return
        out: list[int] = []
        sent = ""
        while True:
            item = await tokens.get()
            if not isinstance(item, int):
                # the result's text is authoritative: a stop string that begins inside a token leaves
                # that token out of the stream but its text before the stop in the result
                text = item.result.text if item.error is None else ""
                if text.startswith(sent) and len(text) > len(sent):
                    yield {"text": text[len(sent):]}
                yield self._outcome(item)
                return
            out.append(item)
            text = self.tokenizer.decode(out)
            if text.endswith("\ufffd"):  # a character cut in the middle: wait for the rest
                continue
            if len(text) > len(sent):
                yield {"text": text[len(sent):]}
                sent = text

    def __del__(self) -> None:
        self._stop.set()
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ helpers
    def _outcome(self, req: Any) -> dict[str, Any]:
        if req.error is not None:
            status = 400 if isinstance(req.error, ValueError) else 500
            return {"replica": self.name, "error": str(req.error), "status": status}
        self.metrics.observe_result(req.result)
        # a shallow copy: its fields are plain values (`dataclasses.asdict` deep-copies each one)
        return {"replica": self.name, "result": {name: getattr(req.result, name) for name in RESULT_FIELDS}}

    def _first_token_hook(self, request: Mapping[str, Any]) -> Callable[[int], None] | None:
        """For a workflow call, an `on_token` that notes its first token (reported with the cache
        events: routing policies count prefill work in flight until then)."""
        key, agent, number = request.get("workflow"), request.get("agent"), request.get("call")
        if not key or not agent:
            return None
        seen = False

        def on_token(_token: int) -> None:
            nonlocal seen
            if not seen:
                seen = True
                with self._first_lock:
                    self._first_tokens.append((key, agent, number))

        return on_token

    def _next_batch(self) -> tuple[list[tuple[Any, ...]], list[tuple[str, str, int | None]], int] | None:
        """The engine's cache events and the calls' first tokens since the last batch, as the feed's
        next numbered batch (None: nothing new). The caller holds `_events_lock` and submits the batch
        before releasing it, so batches reach the router in their order (Ray runs one caller's calls
        to an actor in submission order); a batch lost on its way (the router restarting) shows the
        router a gap, and it then asks for a snapshot (`_send_snapshot`)."""
        events = self.engine.cache_events()
        with self._first_lock:
            first, self._first_tokens = self._first_tokens, []
        if not events and not first:
            return None
        self._events_sent += 1
        return [e.as_tuple() for e in events], first, self._events_sent

    def _send_snapshot(self) -> None:
        """What the engine's cache holds, as the next batch of the feed, in place of the events not
        sent yet (an engine that cannot tell sends None: the router keeps its view)."""
        with self._events_lock:
            events = self.engine.cache_snapshot()
            self._events_sent += 1
            self.router.cache_snapshot.remote(
                self.name, self._events_sent, None if events is None else [e.as_tuple() for e in events])
            logger.info("sent the router a snapshot of %s cache events",
                        "no" if events is None else len(events))

    def _register(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                ray.get(self.router.add_replica.remote(self.name), timeout=10)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _prompt_tokens(self, text: str) -> tuple[int, ...]:
        tokens = self._prefix_cache.get(text)
        if tokens is not None:
            self._prefix_cache.move_to_end(text)
            return tokens
        tokens = self._prefix_cache[text] = tuple(agent_prefix(self.tokenizer.apply_chat_template,
                                                               self.tokenizer.encode, text))
        self._prefix_cache_tokens += len(tokens)
        while self._prefix_cache_tokens > PROMPT_CACHE_TOKENS and len(self._prefix_cache) > 1:
            self._prefix_cache_tokens -= len(self._prefix_cache.popitem(last=False)[1])
        return tokens

    def _to_hints(self, batch: dict[str, Any]) -> Hints:
        prompts = {(key, agent): self._prompt_tokens(text)
                   for key, agents in batch["prompts"].items() for agent, text in agents.items()}
        return Hints(steps=batch["steps"], prompts=prompts, retire=batch["retire"], salts=batch.get("salts", {}),
                     elsewhere=batch.get("elsewhere", {}))

    def _hub_loop(self) -> None:
        """The conversation with the router actor (module docstring): at most one `exchange` per
        HINT_PULL_GAP_S, so that hints coming meanwhile arrive merged with the next."""
        reported = -REPORT_PERIOD_S
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                report = self._report() if started - reported >= REPORT_PERIOD_S else None
                with self._events_lock:  # the feed's batches are submitted in their order
                    ref = self.router.exchange.remote(self.name, 1.0, self._next_batch(), report)
                    self._polled_at = started
                answer = ray.get(ref, timeout=30)
                if report is not None:
                    reported = started
                if answer["hints"] is not None:
                    self.engine.apply_hints(self._to_hints(answer["hints"]))
                if answer["snapshot"]:
                    self._send_snapshot()
            except Exception as exc:  # the router is restarting (a batch lost with it shows it a gap)
                logger.debug("exchange with the router failed: %s", exc)
                time.sleep(0.5)
                continue
            self._stop.wait(max(0.0, HINT_PULL_GAP_S - (time.monotonic() - started)))

    def _event_loop(self) -> None:
        """Events wait for the next exchange, unless the last one has been held at the router for
        EVENTS_PERIOD_S (no hints for this replica): then they go on their own."""
        while not self._stop.wait(EVENTS_PERIOD_S):
            with self._events_lock:
                if time.monotonic() - self._polled_at < EVENTS_PERIOD_S:
                    continue
                batch = self._next_batch()
                if batch is None:
                    continue
                try:
                    self.router.cache_events.remote(self.name, *batch)
                except Exception:  # the router is restarting: the gap is repaired by a snapshot
                    logger.warning("could not send %d cache events to the router", len(batch[0]))

    def _report(self) -> tuple[bytes | None, dict[str, float]]:
        stats = self.engine.stats()  # once per report: the metrics and the load read the same
        self.metrics.observe_stats(stats)
        return self.metrics.exposition(), load_report(stats)
