"""`SglangEngine`: the kvflow Engine protocol (engines/base.py) on an in-process `sglang.Engine`, one per
Ray replica (one per GPU). The KVFlow policy itself runs inside SGLang's scheduler process (the plugin,
`plugin.py`); this adapter only speaks the contract in `protocol.py`:

- requests: `input_ids` + sampling params, with `custom_params["kvflow"] = protocol.request_params(...)`
  when the request carries workflow metadata, and SGLang's own `cache_salt` for the request's cache
  namespace (`generate_kwargs`);
- hints: `Engine.collective_rpc(RPC_APPLY_HINTS, payload=encode_hints(...))`;
- stats and cache events: files the plugin writes into a status directory (`STATUS_DIR_ENV`).

Why in-process (`sglang.Engine`) and not `sglang serve` / `launch_server` as a subprocess:
- `collective_rpc` is the only control path into the scheduler that needs no new port: it reuses the
  engine's own ZMQ RPC socket and runs the plugin's method on every scheduler rank, on the scheduler
  thread, between batches. A subprocess server has no HTTP route for it, so hints would need a
  listener of our own inside the scheduler (docs/dev/sglang-plugin.md §10).
- One process per GPU actor: the Ray replica holding the GPU is the process that owns the engine
  (SGLang spawns its scheduler and detokenizer as children), so Ray's resource accounting, restarts
  and shutdown cover everything; no second server lifecycle or port to manage per replica.
- No HTTP hop: requests go from the replica to SGLang's TokenizerManager in the same process, and
  the adapter sees `meta_info` (`cached_tokens_details`) directly.

Tool calls (docs/serving.md "Tool calls"): requests reach SGLang as token ids through
`async_generate`, not through SGLang's OpenAI layer (`serving_chat`), so SGLang's own chat
templating never sees `tools`. The ingress renders them with the model's own chat template (the
tokenizer files SGLang loads) and parses the output with the parser `tool_call_parser` names, as for
every engine: `sglang:<name>` is SGLang's own (`engines/sglang/tool_parser.py`). Forced tool
choice needs constrained decoding: SGLang has it (`ebnf` / `json_schema` sampling params, xgrammar),
but this adapter sends no grammar, so a request with a `GenerateRequest.constraint` is refused
(`request_tokens`), and the ingress answers `tool_choice` "required" or named with a 400 on this
engine.

Threading: the `sglang.Engine` is built on, and every request runs on, one private asyncio loop
thread ("kvflow-sglang-loop"). SGLang binds its TokenizerManager to the loop that first uses it, and
`Engine.generate` drives `loop.run_until_complete`, which cannot serve concurrent callers; submitting
`async_generate` coroutines to one long-running loop gives continuous batching across callers of
`submit` from any thread. `collective_rpc` is a blocking socket round trip; it runs on the caller's
thread under a lock.

Importing this module never imports sglang (it is imported lazily when an engine starts), so the
serving app, the smoke script's `--help` and the tests run without it. The translation steps are
small module-level functions, unit-tested without sglang (tests/test_sglang_adapter.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import itertools
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow_ray.core.policies import StepBook
from kvflow_ray.core.routing import BLOCK_TOKENS
from kvflow_ray.core.scheduler import POLICIES, PolicyConfig, engine_policies, resolve_policy
from kvflow_ray.engines.base import BackgroundEngine, CacheEvent, GenerateRequest, GenerateResult, Hints, request_tokens
from kvflow_ray.engines.sglang import protocol
from kvflow_ray.engines.sglang.state import PLUGIN_KEYS, make_policies
from kvflow_ray.engines.stops import StopTokens

logger = logging.getLogger(__name__)

STATS_FILE = "stats.json"
EVENTS_FILE = "events.jsonl"
# ServerArgs the adapter sets from its own parameters; passing them as extra args would silently
# contradict the policy or the model the engine reports.
RESERVED_SERVER_ARGS = ("model_path", "radix_eviction_policy", "enable_hierarchical_cache", "schedule_policy")
HOST_TIER_ARGS = ("hicache_ratio", "hicache_size")
PLUGIN_CONFIG = "radix_eviction_policy_config"  # the plugin's policies and their options (state.make_policies)
# Core policies SGLang 0.5.23 implements itself, under its own name: a combination of only these runs
# on SGLang as shipped (no plugin, no hints), so it measures stock SGLang. Anything else runs through
# the plugin's strategy, which builds the named core policies.
SGLANG_OWN = {"eviction": {"lru": "lru"}, "prefetch": ("none",), "admission": {"fcfs": "fcfs", "lpm": "lpm"}}


# ---------------------------------------------------------------------------------------------- pure parts
def policy_server_args(config: PolicyConfig) -> dict[str, Any]:
    """How a policy combination maps onto SGLang server args: SGLang's own eviction and schedule policy
    (`lpm`: `--schedule-policy lpm`) when every part is one SGLang has (`SGLANG_OWN`), else the kvflow
    plugin's strategy with the parts as its config;
    HiCache when the combination has a host tier. Every policy runs on the Python tree core
    (`protocol.TREE_CORE_ENV`), so a comparison measures the policy, not Rust vs Python tree code."""
    own = SGLANG_OWN["eviction"].get(config.eviction)
    own_order = SGLANG_OWN["admission"].get(config.admission)
    if own is not None and config.prefetch in SGLANG_OWN["prefetch"] and own_order is not None:
        args: dict[str, Any] = {"radix_eviction_policy": own}
        if own_order != "fcfs":  # SGLang's default
            args["schedule_policy"] = own_order
    else:
        args = {"radix_eviction_policy": protocol.PLUGIN_NAME,
                PLUGIN_CONFIG: {"eviction": config.eviction, "prefetch": config.prefetch,
                                "admission": config.admission}}
    if config.host_tier:
        args.update(protocol.HICACHE_ARGS)
    return args


def uses_plugin(server_args: Mapping[str, Any]) -> bool:
    return server_args.get("radix_eviction_policy") == protocol.PLUGIN_NAME


def _plugin_config(args: dict[str, Any], policy: str, options: Any) -> None:
    """Add the extra server arg `radix_eviction_policy_config` (options of the plugin's policies, e.g.
    `horizon`) to what the policy set, and check the result as the plugin will."""
    if options is not None:
        if not uses_plugin(args):
            raise ValueError(f"{PLUGIN_CONFIG} configures the kvflow plugin, and policy {policy!r} runs "
                             "SGLang's own eviction")
        if not isinstance(options, Mapping):
            raise ValueError(f"{PLUGIN_CONFIG} must be an object, got {type(options).__name__}")
        clash = sorted(set(options) & set(PLUGIN_KEYS))
        if clash:
            raise ValueError(f"{PLUGIN_CONFIG}: {', '.join(clash)}: set by the adapter from policy {policy!r}")
        args[PLUGIN_CONFIG] = {**args[PLUGIN_CONFIG], **options}
    if uses_plugin(args):
        make_policies(StepBook(), **args[PLUGIN_CONFIG])  # a bad option fails here, not at SGLang's startup


def build_server_args(model_path: str, policy: str = "kvflow", *, skip_tokenizer_init: bool = False,
                      load_format: str | None = None, mem_fraction_static: float | None = None,
                      max_total_tokens: int | None = None, hicache_ratio: float | None = None,
                      hicache_size: float | None = None, random_seed: int | None = None,
                      extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keyword arguments for `sglang.Engine(**args)` (ServerArgs fields). Raises ValueError naming
    the bad argument. `extra` may override the policy's defaults (e.g. `hicache_write_policy`), not
    the model or the policy itself."""
    if not model_path:
        raise ValueError("model_path is required: the model directory (or hub id) SGLang loads")
    args: dict[str, Any] = {"model_path": str(model_path),
                            **policy_server_args(resolve_policy(policy, serving_on="SGLang"))}
    has_host_tier = bool(args.get("enable_hierarchical_cache"))
    knobs: dict[str, Any] = {"load_format": load_format, "mem_fraction_static": mem_fraction_static,
                             "max_total_tokens": max_total_tokens, "hicache_ratio": hicache_ratio,
                             "hicache_size": hicache_size, "random_seed": random_seed}
    if skip_tokenizer_init:  # only when asked: otherwise SGLang loads the model's tokenizer
        knobs["skip_tokenizer_init"] = True
    extra = dict(extra or {})
    _plugin_config(args, policy, extra.pop(PLUGIN_CONFIG, None))
    for key in extra:
        if not isinstance(key, str) or not key:
            raise ValueError(f"server args must be named by non-empty strings, got {key!r}")
    reserved = sorted(set(extra) & set(RESERVED_SERVER_ARGS))
    if reserved:
        raise ValueError(f"server args {reserved} are set by the adapter: use model_path and policy "
                         f"({' | '.join(engine_policies())}) instead")
    twice = sorted(k for k, v in knobs.items() if v is not None and k in extra)
    if twice:
        raise ValueError(f"server args {twice} given twice (as a parameter and in the extra server args)")
    for key, value in knobs.items():
        if value is not None:
            args[key] = value
    args.update(extra)
    if not has_host_tier:
        stray = sorted(k for k in HOST_TIER_ARGS if args.get(k) is not None)
        if stray:
            tiered = " or ".join(p for p in engine_policies() if POLICIES[p].host_tier)
            raise ValueError(f"{', '.join(stray)}: sizes a host tier, and policy {policy!r} has none "
                             f"(use {tiered})")
    if args.get("max_total_tokens") is not None and int(args["max_total_tokens"]) < 1:
        raise ValueError(f"max_total_tokens must be positive, got {args['max_total_tokens']}")
    ratio = args.get("hicache_ratio")
    if ratio is not None and float(ratio) <= 1.0 and args.get("hicache_size") in (None, 0):
        # SGLang sizes the host pool as ratio x device pool; at <= 1 it cannot hold more than the
        # device does, so a host tier would add copies and no capacity
        raise ValueError(f"hicache_ratio must be > 1 (host pool = ratio x device pool), got {ratio}")
    return args


def sampling_params(request: GenerateRequest, fixed_prefix_tokens: int | None = None) -> dict[str, Any]:
    """SGLang sampling params for one request; workflow metadata travels in `custom_params` as the
    plugin reads it (a flat dict: SGLang's msgpack IPC rejects nested values there)."""
    params: dict[str, Any] = {"max_new_tokens": int(request.max_tokens), "temperature": float(request.temperature),
                              "top_p": float(request.top_p), "ignore_eos": bool(request.ignore_eos)}
    if request.stop:  # SGLang ends the request at a stop string (`stop`: its API alias of `stop_strs`)
        params["stop"] = list(request.stop)
    if request.seed is not None and request.temperature > 0:  # a seed only matters when sampling
        params["sampling_seed"] = int(request.seed)
    if request.workflow is not None and request.agent is not None:
        fixed = request.fixed_prefix_tokens if fixed_prefix_tokens is None else fixed_prefix_tokens
        params["custom_params"] = {protocol.CUSTOM_PARAMS_KEY: protocol.request_params(request.workflow,
                                                                                       request.agent, fixed)}
    return params


def generate_kwargs(req: SglangRequest) -> dict[str, Any]:
    """`sglang.Engine.async_generate` arguments for one request. A non-empty cache salt travels as
    SGLang's own `cache_salt`: SGLang 0.5.23 keys its radix tree (and HiCache storage, KV events) by
    it, so the same prompt under two salts is two disjoint subtrees and no request reuses KV of
    another namespace."""
    kwargs: dict[str, Any] = {"input_ids": list(req.tokens), "sampling_params": req.params, "stream": True,
                              "rid": req.rid}
    if req.cache_salt:
        kwargs["cache_salt"] = req.cache_salt
    return kwargs


def tier_split(meta_info: Mapping[str, Any], prompt_tokens: int) -> tuple[int, int, int]:
    """(gpu, cpu, miss) prompt tokens of a finished request, from SGLang's `meta_info`.

    `cached_tokens_details` is {"device": n, "host": n[, "storage": n]} when HiCache reports a breakdown;
    SGLang leaves it out when nothing was cached, and reports everything as device hits when there is
    no host tier. Storage (L3) hits reach the GPU through the host tier, so they count as cpu hits.
    Without details, `cached_tokens` are device hits (SGLang's own convention). Clamped to the prompt."""
    details = meta_info.get("cached_tokens_details")
    if isinstance(details, Mapping):
        gpu = int(details.get("device") or 0)
        cpu = int(details.get("host") or 0) + int(details.get("storage") or 0)
    else:
        gpu, cpu = int(meta_info.get("cached_tokens") or 0), 0
    gpu = max(0, min(gpu, prompt_tokens))
    cpu = max(0, min(cpu, prompt_tokens - gpu))
    return gpu, cpu, prompt_tokens - gpu - cpu


def finish_reason(meta_info: Mapping[str, Any]) -> str:
    """"length" | "stop" from SGLang's finish reason ({"type": ...}); an abort raises: ValueError for a
    request SGLang refused (status 400), RuntimeError otherwise."""
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind == "abort":
        assert isinstance(reason, Mapping)
        message = str(reason.get("message") or "aborted by SGLang")
        if reason.get("status_code") == 400:
            raise ValueError(message)
        raise RuntimeError(f"SGLang aborted the request: {message}")
    return "stop" if kind == "stop" else "length"


def result_from_output(output_ids: Sequence[int], meta_info: Mapping[str, Any], *, prompt_tokens: int,
                       text: str, ttft_s: float, latency_s: float, stall_s: float = 0.0) -> GenerateResult:
    """A `GenerateResult` from a finished SGLang output. `prompt_tokens` is what the adapter sent (SGLang
    echoes it in `meta_info["prompt_tokens"]`, preferred when present). SGLang does not report how
    long a request waited for host->device loads, so `stall_s` is 0 unless the caller knows better."""
    reason = finish_reason(meta_info)
    prompt = int(meta_info.get("prompt_tokens") or prompt_tokens)
    gpu, cpu, miss = tier_split(meta_info, prompt)
    return GenerateResult(tokens=[int(t) for t in output_ids], text=text, prompt_tokens=prompt, gpu_hit_tokens=gpu,
                          cpu_hit_tokens=cpu, miss_tokens=miss, stall_s=stall_s, ttft_s=ttft_s,
                          latency_s=latency_s, finish_reason=reason)


def new_output_tokens(chunk: Mapping[str, Any], seen: int, incremental: bool) -> list[int]:
    """The output ids a streamed chunk adds. SGLang streams deltas with `incremental_streaming_output`
    and otherwise the whole output so far (the same list object, growing: copy what is needed)."""
    ids = chunk.get("output_ids") or []
    return [int(t) for t in (ids if incremental else ids[seen:])]


def parse_event(data: Any) -> CacheEvent | None:
    """One events.jsonl record ({"kind", "tier", "prefix_hash", "tokens", "blocks"}) as a CacheEvent;
    None when it is not one (skipped: a router is better served by the events that parse than by
    none). `blocks`, the prompt's KV block hashes, is optional (a plugin of an earlier release)."""
    if not isinstance(data, Mapping):
        return None
    kind, tier, prefix, tokens = (data.get(k) for k in ("kind", "tier", "prefix_hash", "tokens"))
    if kind not in ("stored", "removed") or tier not in ("gpu", "cpu") or not isinstance(prefix, str) or not prefix:
        return None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        return None
    blocks = data.get("blocks", [])
    if (not isinstance(blocks, list) or len(blocks) > tokens // BLOCK_TOKENS
            or not all(isinstance(h, int) and not isinstance(h, bool) and -(1 << 63) <= h < 1 << 63 for h in blocks)):
        return None
    return CacheEvent(kind, tier, prefix, tokens, tuple(blocks))


def read_events(path: str | Path, offset: int) -> tuple[list[CacheEvent], int]:
    """Cache events appended to `path` since byte `offset`, and the offset to continue from. Only whole
    lines are consumed: a last line without its newline is being written and is read next time. A file
    shorter than `offset` was replaced (a restarted scheduler): read it from the start."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size < offset:
                offset = 0
            f.seek(offset)
            data = f.read(size - offset)
    except FileNotFoundError:
        return [], 0
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    events: list[CacheEvent] = []
    bad = 0
    for line in data[:end].split(b"\n"):
        if not line.strip():
            continue
        try:
            event = parse_event(json.loads(line))
        except ValueError:
            event = None
        if event is None:
            bad += 1
        else:
            events.append(event)
    if bad:
        logger.warning("skipped %d malformed line(s) in %s", bad, path)
    return events, offset + end + 1


def read_status(path: str | Path) -> dict[str, Any] | None:
    """The plugin's stats.json, or None when it is missing or unreadable (the plugin replaces it
    atomically, so a torn file means something else wrote it: treat it as absent)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def empty_snapshot() -> dict[str, Any]:
    """Every key of `core.scheduler.ReplicaScheduler.snapshot()`, zeroed: what the serving layer's
    metrics read from any engine's `stats()`."""
    return {
        "waiting": 0, "running": 0,
        "prompt_tokens": {"gpu": 0, "cpu": 0, "miss": 0},
        "loaded_tokens": 0,
        "prefetch": {"issued": 0, "completed": 0, "used": 0, "wasted": 0},
        "prefetch_stall_s": 0.0,
        "evicted_tokens": {"gpu": 0, "cpu": 0, "written_back": 0, "dropped": 0},
        "cache_tokens": {"gpu": 0, "cpu": 0, "private": 0},
        "capacity_tokens": {"gpu": 0, "cpu": 0},
    }


def merge_stats(status: Mapping[str, Any] | None, own: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's `stats()`: the snapshot shape, filled with what the adapter knows (`own`), then
    with what the plugin reported (`status`), which wins: it sees the scheduler. Exception: keys the
    plugin leaves out keep the adapter's values (e.g. prompt tokens counted from `meta_info`)."""
    out = empty_snapshot()
    for source in (own, status or {}):
        for key, value in source.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **value}
            else:
                out[key] = value
    return out


def plugin_registered() -> bool:
    """Whether SGLang will load the kvflow plugin: the entry point is installed (`pip install -e .`
    registers it) and `SGLANG_PLUGINS`, if set, lets it through."""
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed is not None and protocol.PLUGIN_NAME not in {p.strip() for p in allowed.split(",")}:
        return False
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    return any(ep.name == protocol.PLUGIN_NAME for ep in eps)


# ---------------------------------------------------------------------------------------------- the engine
@dataclass(eq=False)
class SglangRequest:
    """One submitted request; `result` or `error` is set before `on_done` runs."""

    rid: str
    tokens: tuple[int, ...]
    params: dict[str, Any]
    cache_salt: str = ""  # the request's cache namespace (`GenerateRequest.cache_salt`)
    on_done: Callable[[SglangRequest], None] | None = None
    submitted_at: float = 0.0
    first_token_at: float = 0.0
    out: list[int] = field(default_factory=list)  # every output id SGLang sent
    # the stop strings over `out`: it streams the output to the caller's on_token, and cuts the result
    stops: StopTokens | None = None
    result: GenerateResult | None = None
    error: BaseException | None = None


class SglangEngine(BackgroundEngine):
    """The Engine protocol on an in-process `sglang.Engine` with the kvflow plugin."""

    def __init__(self, model_path: str, *, policy: str = "kvflow", skip_tokenizer_init: bool = False,
                 load_format: str | None = None, mem_fraction_static: float | None = None,
                 max_total_tokens: int | None = None, hicache_ratio: float | None = None,
                 hicache_size: float | None = None, random_seed: int | None = None,
                 server_args: Mapping[str, Any] | None = None, status_dir: str | Path | None = None,
                 send_hints: bool | None = None, model_name: str | None = None,
                 start_timeout_s: float = 1800.0) -> None:
        self.policy = policy
        self.server_args = build_server_args(
            model_path, policy, skip_tokenizer_init=skip_tokenizer_init, load_format=load_format,
            mem_fraction_static=mem_fraction_static, max_total_tokens=max_total_tokens,
            hicache_ratio=hicache_ratio, hicache_size=hicache_size, random_seed=random_seed, extra=server_args)
        self._model_name = model_name or str(model_path)
        # a policy SGLang runs itself needs no hints (they would change nothing, and the comparison must
        # not depend on the control path); the plugin's policies read them
        plugin = uses_plugin(self.server_args)
        self.send_hints = plugin if send_hints is None else send_hints
        if plugin and not plugin_registered():
            raise ValueError(f"policy {policy!r} needs the kvflow SGLang plugin: install kvflow-ray into SGLang's "
                             "environment with `pip install -e '.[sglang]'` (it registers the "
                             "'sglang.srt.plugins' entry point), and let 'kvflow' through SGLANG_PLUGINS if set")
        self._own_status_dir = status_dir is None
        self.status_dir = Path(tempfile.mkdtemp(prefix="kvflow-sglang-") if status_dir is None else status_dir)
        self.status_dir.mkdir(parents=True, exist_ok=True)
        self._events_offset = 0
        self._events_lock = threading.Lock()
        self._rpc_lock = threading.Lock()
        self._lock = threading.Lock()  # counters and the in-flight set
        self._inflight: set[SglangRequest] = set()
        self._rids = itertools.count()
        self.requests_done = 0
        self.requests_failed = 0
        self.requests_rejected = 0
        self.prompt_tokens = {"gpu": 0, "cpu": 0, "miss": 0}
        self._closed = False
        self._engine: Any = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="kvflow-sglang-loop", daemon=True)
        self._started: queue.Queue[BaseException | None] = queue.Queue()
        self._start(start_timeout_s)
        skip = bool(self.server_args.get("skip_tokenizer_init"))
        if skip or getattr(self._engine.tokenizer_manager, "tokenizer", None) is None:
            from kvflow_ray.engines.tokenizer import ByteTokenizer

            # token ids in, token ids out: text (if any) is byte-level, as the ingress encodes it for engines
            # without a tokenizer of their own, so a dummy-weights model serves end to end
            self.tokenizer: Any = ByteTokenizer()
        else:
            from kvflow_ray.engines.tokenizer import HFTokenizer

            # SGLang's own tokenizer, loaded once: the replica decodes and renders chats exactly as SGLang does
            self.tokenizer = HFTokenizer.wrap(self._engine.tokenizer_manager.tokenizer)
        self.vocab_size, self.max_context, self.device_tokens = self._limits()
        self._incremental = bool(getattr(self._engine.server_args, "incremental_streaming_output", False))

    # ------------------------------------------------------------------ start / stop
    def _start(self, timeout_s: float) -> None:
        # The plugin's scheduler-side writer reads this when SGLang spawns the scheduler (inside
        # `sglang.Engine(...)`), so it must be set first. Every policy runs on the Python tree core
        # (protocol.py: compare policies, not Rust vs Python tree code); the plugin sets the same default.
        os.environ[protocol.STATUS_DIR_ENV] = str(self.status_dir)
        os.environ.setdefault(protocol.TREE_CORE_ENV, "python")
        self._thread.start()
        try:
            error = self._started.get(timeout=timeout_s)
        except queue.Empty:
            # the loop thread may still finish starting it; SGLang's own atexit handler shuts it down
            self._closed = True
            raise TimeoutError(f"SGLang did not start within {timeout_s:.0f} s") from None
        if error is not None:
            self._closed = True
            self._cleanup_status_dir()
            if isinstance(error, ImportError) and error.name is not None and error.name.split(".")[0] == "sglang":
                raise ImportError(f"engine 'sglang' needs the sglang package: pip install 'kvflow-ray[sglang]' "
                                  f"({error})", name=error.name) from error
            if isinstance(error, TypeError) and "argument" in str(error):  # an unknown ServerArgs field
                raise ValueError(f"SGLang rejected the server args: {error}") from error
            raise error

    def _serve(self) -> None:
        """The loop thread: build the engine on this thread's loop, then serve requests on it."""
        asyncio.set_event_loop(self._loop)
        try:
            import sglang  # lazy: heavy, and absent on machines without a GPU

            self._engine = sglang.Engine(**self.server_args)
        except BaseException as exc:
            self._started.put(exc)
            self._loop.close()
            return
        self._started.put(None)
        self._loop.run_forever()
        # stopped: drop what is left (in-flight requests are failed by close())
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        with contextlib.suppress(Exception):
            self._loop.run_until_complete(asyncio.sleep(0))
        self._loop.close()

    def start(self) -> SglangEngine:
        return self  # serving from construction

    def close(self) -> None:
        """Stop serving and shut SGLang down (its scheduler releases the GPU before this returns)."""
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)
        with self._lock:
            pending = list(self._inflight)
            self._inflight.clear()
        for req in pending:
            req.error = RuntimeError("the SGLang engine was closed")
            self._finish(req)
        if self._engine is not None:
            try:
                self._engine.shutdown()
            except Exception:  # shutting down anyway: nothing a caller could do about it
                logger.exception("SGLang shutdown failed")
        self._cleanup_status_dir()

    def _cleanup_status_dir(self) -> None:
        if self._own_status_dir:
            shutil.rmtree(self.status_dir, ignore_errors=True)

    def __enter__(self) -> SglangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _limits(self) -> tuple[int, int, int]:
        """(vocab size, context length, device KV pool tokens) for request checks; where SGLang does not
        say, a bound that lets SGLang's own checks decide."""
        tm = self._engine.tokenizer_manager
        vocab = int(getattr(getattr(tm, "model_config", None), "vocab_size", 0) or (1 << 31))
        context = int(getattr(tm, "context_len", 0) or (1 << 31))
        infos = getattr(getattr(self._engine, "_scheduler_init_result", None), "scheduler_infos", None) or [{}]
        device = int(infos[0].get("max_total_num_tokens") or (1 << 31))
        return vocab, context, device

    @property
    def model_name(self) -> str:
        return self._model_name

    # ------------------------------------------------------------------ the Engine protocol
    def submit(self, request: GenerateRequest, on_token: Callable[[int], None] | None = None,
               on_done: Callable[[SglangRequest], None] | None = None) -> SglangRequest:
        """Queue a request (any thread). Raises ValueError, changing nothing, for a request that can never
        run; `on_token` / `on_done` run on the engine's loop thread."""
        if self._closed:
            raise RuntimeError("the SGLang engine is closed")
        try:
            tokens = request_tokens(request, model_name=self.model_name, encode=self.tokenizer.encode,
                                    vocab_size=self.vocab_size, max_context=self.max_context,
                                    device_tokens=self.device_tokens)
        except ValueError:
            with self._lock:
                self.requests_rejected += 1
            raise
        req = SglangRequest(rid=f"kvflow-{os.getpid()}-{next(self._rids)}", tokens=tokens,
                            params=sampling_params(request), cache_salt=request.cache_salt,
                            stops=StopTokens(request.stop, self.tokenizer.decode, on_token),
                            on_done=on_done,
                            submitted_at=time.perf_counter())
        with self._lock:
            self._inflight.add(req)
        asyncio.run_coroutine_threadsafe(self._run(req), self._loop)
        return req

    def apply_hints(self, hints: Hints) -> None:
        """Steps-to-execution, agents' prompts and retired workflows to the plugin on every scheduler
        rank (blocks until the scheduler took them, between two batches)."""
        if not self.send_hints or not (hints.steps or hints.prompts or hints.retire or hints.salts):
            return
        payload = protocol.encode_hints(hints.steps, hints.prompts, hints.retire, hints.salts, hints.elsewhere)
        with self._rpc_lock:
            try:
                self._engine.collective_rpc(protocol.RPC_APPLY_HINTS, payload=payload)
            except AssertionError as exc:  # SGLang asserts on a failed RPC; say what it was
                raise RuntimeError(f"{protocol.RPC_APPLY_HINTS} failed in the SGLang scheduler "
                                   f"(is the kvflow plugin loaded?): {exc}") from exc

    def cache_snapshot(self) -> list[CacheEvent] | None:
        """SGLang's tree lives in its scheduler process, which writes events only: no snapshot."""
        return None

    def cache_events(self) -> list[CacheEvent]:
        with self._events_lock:
            events, self._events_offset = read_events(self.status_dir / EVENTS_FILE, self._events_offset)
        return events

    def stats(self) -> dict[str, Any]:
        with self._lock:
            own: dict[str, Any] = {
                "running": len(self._inflight),  # the plugin's waiting/running split replaces this
                "prompt_tokens": dict(self.prompt_tokens),
                "capacity_tokens": {"gpu": self.device_tokens},
            }
            counters = {"requests_done": self.requests_done, "requests_failed": self.requests_failed,
                        "requests_rejected": self.requests_rejected}
        path = self.status_dir / STATS_FILE
        status = read_status(path)
        age = None
        if status is not None:
            with contextlib.suppress(OSError):  # replaced between the read and the stat
                age = time.time() - path.stat().st_mtime
        # status_keys: what the plugin reported (the rest are the adapter's counts or zeros)
        return {"policy": self.policy, "engine": "sglang", **counters, **merge_stats(status, own),
                "status_age_s": age, "status_keys": sorted(status or {})}

    # ------------------------------------------------------------------ the loop thread
    async def _run(self, req: SglangRequest) -> None:
        try:
            meta: Mapping[str, Any] = {}
            stream = await self._engine.async_generate(**generate_kwargs(req))
            async for chunk in stream:
                new = new_output_tokens(chunk, len(req.out), self._incremental)
                if new and not req.first_token_at:
                    req.first_token_at = time.perf_counter()
                req.out.extend(new)
                self._emit(req, new)
                meta = chunk.get("meta_info") or meta
            now = time.perf_counter()
            first = req.first_token_at or now
            assert req.stops is not None
            req.stops.finish()  # streams what was held back in case it started a stop string; none came
            # SGLang stops at a stop string but sends its tokens (it trims only its own text): the
            # result is cut before it, as the other engines cut theirs
            req.result = result_from_output(req.stops.tokens, meta, prompt_tokens=len(req.tokens),
                                            text=req.stops.text, ttft_s=first - req.submitted_at,
                                            latency_s=now - req.submitted_at)
            if req.stops.stopped:
                req.result.finish_reason = "stop"
        except Exception as exc:  # the request fails; the engine keeps serving the others
            req.error = exc
        with self._lock:
            if req not in self._inflight:
                return  # close() already failed it
            self._inflight.discard(req)
        self._finish(req)

    @staticmethod
    def _emit(req: SglangRequest, new: list[int]) -> None:
        """Stream the output ids that cannot be part of a stop string (held back until they are known not
        to be; ids after a stop string are dropped)."""
        assert req.stops is not None
        for token in new:
            if req.stops.stopped:
                return
            req.stops.push(token)

    def _finish(self, req: SglangRequest) -> None:
        with self._lock:
            if req.result is not None and req.error is None:
                self.requests_done += 1
                self.prompt_tokens["gpu"] += req.result.gpu_hit_tokens
                self.prompt_tokens["cpu"] += req.result.cpu_hit_tokens
                self.prompt_tokens["miss"] += req.result.miss_tokens
            else:
                self.requests_failed += 1
        if req.on_done is not None:
            try:
                req.on_done(req)
            except Exception:  # a caller's callback must not take the loop down
                logger.exception("on_done callback of %s failed", req.rid)
