"""The protocol every engine implements (docs/design.md §4), and the plain data it exchanges.

An engine owns compute and data movement only; every cache decision is made by `kvflow_ray.core`
(through `core.scheduler.ReplicaScheduler`). The serving layer talks to any engine through this
protocol: `generate` / `stream` for requests, `apply_hints` for what the workflow router knows
(steps-to-execution, agents' fixed prompts, retired workflows), `stats` and `cache_events` for
metrics and routing.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kvflow_ray.core.kv_budget import KvBudget
from kvflow_ray.core.radix import Namespace
from kvflow_ray.core.reuse import EXACT
from kvflow_ray.core.sessions import SESSION_AGENT, SessionTurn
from kvflow_ray.engines.tool_calls import get_parser

MAX_STOP_STRINGS = 4  # stop strings one request may give (OpenAI's limit)

# Workflow metadata (docs/design.md §7) enters through three doors: the OpenAI body's `kvflow` object
# (`serve.openai_api`), SGLang's `custom_params["kvflow"]` (`engines.sglang.protocol`) and the fields
# of `GenerateRequest` (`workflow` holds the client id there, tenant-scoped). `meta_problem` is the
# one rule for these fields; each door names the field in its own words. Lengths are bounded only
# where clients send the metadata (the OpenAI door): an engine's workflow key is a client id with
# the tenant in front, longer than any client id.
META_FIELDS = ("client_id", "agent", "fixed_prefix_tokens")


def meta_problem(field: str, value: object) -> str | None:
    """What is wrong with `value` as the workflow-metadata `field` (one of META_FIELDS), as
    "must be ..."; None when it is valid. `fixed_prefix_tokens` may be None (not given)."""
    if field == "fixed_prefix_tokens":
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return None
        return "must be a non-negative integer"
    if field not in META_FIELDS:
        raise ValueError(f"{field!r} is not a workflow metadata field ({', '.join(META_FIELDS)})")
    return None if isinstance(value, str) and value else "must be a non-empty string"


@dataclass
class GenerateRequest:
    """One completion. Give `prompt` (text, tokenized by the engine) or `tokens` (ids)."""

    prompt: str | None = None
    tokens: Sequence[int] | None = None
    model: str | None = None  # must name the engine's model when given (OpenAI `model`)
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # sampling seed (temperature > 0)
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)
    stop: Sequence[str] = ()  # stop strings: generation ends before the first one; the text excludes it
    # the cache namespace: KV is reused only between requests with the same salt (the serving layer
    # gives each tenant, or each sharing group of tenants, its own); "" is the default namespace
    cache_salt: str = ""
    # workflow metadata (docs/design.md §7); without it the request is served as a plain request
    workflow: str | None = None  # the workflow instance (client id, tenant-scoped by the caller)
    agent: str | None = None
    # the router's number for the call, reported back with its first token: the routers that price
    # its prefill work retire it by (workflow, agent, call). The ingress sets it; no client field reaches it
    call: int | None = None
    fixed_prefix_tokens: int | None = None  # explicit fixed-prompt boundary
    # constrained decoding: the output must spell one string of this grammar (`engines.constrained`:
    # [kind, value] segments; a forced tool call). Only engines that honour it accept it (`request_tokens`)
    constraint: Sequence[Sequence[Any]] | None = None
    # a turn of an agent session (docs/design.md §11; `workflow` is the session's key, `agent` "session"):
    # {"tenant": str, "agent": str, "hint_s": float | None, "final": bool, "tool_parser": str | None,
    # "tools": [tool names] | None}; a benchmark driver may also name the turn's "tool" and give
    # "true_pause_s" (the pause oracle's). The ingress builds this from validated fields (the agent's
    # name, the request's tools). None: not a session turn
    session: Mapping[str, Any] | None = None
    # reuse of kept segments (agents' outputs, registered documents) found in the prompt past its
    # cached prefix (docs/design.md §12; `core.reuse`): "exact" (none, the default), "position",
    # "epic:k=16", "blend:r=0.15". Approximate: only engines that implement it accept another method
    reuse: str = "exact"
    # documents the client marks in its prompt (retrieved chunks), as token ids: under an approximate
    # `reuse`, each is computed alone once (positions 0..) and kept as a segment of its namespace
    documents: Sequence[Sequence[int]] = ()
    # a cap on the request's private KV in tokens (docs/design.md §13; `core.kv_budget`): None takes
    # the engine's default (off unless configured); `kv_scorer` names how its keys are scored
    kv_budget: int | None = None
    kv_scorer: str | None = None


@dataclass
class GenerateResult:
    tokens: list[int]  # output token ids
    text: str
    prompt_tokens: int
    gpu_hit_tokens: int  # prompt tokens served from the device tier
    cpu_hit_tokens: int  # prompt tokens loaded from the host tier
    miss_tokens: int  # prompt tokens computed
    stall_s: float  # time the request waited for its KV to reach the device
    ttft_s: float
    latency_s: float
    finish_reason: str  # "length" | "stop"
    # prompt tokens whose KV was placed from a kept segment and not recomputed in every layer
    # (approximate: never counted as cached; the reuse method's recomputed picks count as computed)
    reused_tokens: int = 0


@dataclass
class Hints:
    """What the workflow layer tells an engine. `steps`: steps-to-execution per agent of each
    workflow instance (replacing what was known of that instance); `prompts`: each agent's fixed
    prompt (token ids), which prefetch loads; `retire`: finished workflow instances; `salts`: the
    cache namespace of each instance (absent: the default namespace "")."""

    steps: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    prompts: Mapping[tuple[str, str], Sequence[int]] = field(default_factory=dict)
    retire: Sequence[str] = ()
    # workflow instance -> the cache namespace (`GenerateRequest.cache_salt`) its prompts live in
    salts: Mapping[str, str] = field(default_factory=dict)
    # workflow instance -> agents the router will run on another replica: ranked by their steps here,
    # never prefetched here
    elsewhere: Mapping[str, Sequence[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheEvent:
    """A cached prefix changed tier. `prefix_hash` identifies the whole token sequence from the root
    to the end of the node (`prefix_hash(tokens)`), so a router can look up an agent's fixed prompt."""

    kind: str  # "stored" | "removed"
    tier: str  # "gpu" | "cpu"
    prefix_hash: str
    tokens: int
    # the chained hashes (`core.routing.block_hashes`) of the KV blocks that end inside the node: a
    # router's block index (Dynamo's, llm-d's view) learns from them which blocks the replica holds
    blocks: tuple[int, ...] = ()

    def as_tuple(self) -> tuple[str, str, str, int, tuple[int, ...]]:
        """Its fields in order, as the feed sends it (`CacheEvent(*t)` reads it back); shallow, unlike
        `dataclasses.astuple`, which copies each block hash."""
        return self.kind, self.tier, self.prefix_hash, self.tokens, self.blocks


def request_tokens(request: GenerateRequest, *, model_name: str, encode: Callable[[str], list[int]],
                   vocab_size: int, max_context: int, device_tokens: int, constrained: bool = False,
                   reuses: bool = False, kv_budget: KvBudget | None = None,
                   budgets: bool = False) -> tuple[int, ...]:
    """The prompt's token ids after every check an engine makes before queueing a request; raises
    ValueError naming what is wrong (the request can never run), so nothing is queued. `constrained`:
    the engine honours `request.constraint` (checks it itself); an engine that does not refuses one,
    since ignoring it would return an unconstrained output as if it were one. `reuses`: the engine
    honours `request.reuse` (an engine that does not refuses an approximate method rather than serve
    exact KV as if it were reused). `kv_budget`: the budget the request runs under (its device need is
    then the budget's reservation); `budgets`: the engine honours a request's `kv_budget`."""
    if request.constraint is not None and not constrained:
        raise ValueError("this engine does not support constrained decoding (forced tool choice)")
    if request.reuse != EXACT and not reuses:
        raise ValueError(f"reuse {request.reuse!r}: this engine reuses no KV beyond the prefix (only 'exact'); "
                         "the CPU engine does")
    if (request.kv_budget is not None or request.kv_scorer is not None) and not budgets:
        raise ValueError("kv_budget: this engine keeps every token's KV; the CPU engine compacts under a budget")
    if request.model is not None and request.model != model_name:
        raise ValueError(f"unknown model {request.model!r}: this engine serves {model_name!r}")
    if (request.prompt is None) == (request.tokens is None):
        raise ValueError("give exactly one of prompt (text) or tokens (ids)")
    tokens = (tuple(encode(request.prompt)) if request.prompt is not None
              else tuple(map(int, request.tokens or ())))
    if not tokens:
        raise ValueError("the prompt is empty")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
    if not request.temperature >= 0:  # NaN too
        raise ValueError(f"temperature must be >= 0, got {request.temperature}")
    if not 0 < request.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {request.top_p}")
    if isinstance(request.stop, str):
        raise ValueError("stop must be a list of strings, not one string")
    if len(request.stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}")
    if any(not isinstance(s, str) or not s for s in request.stop):
        raise ValueError("stop strings must be non-empty strings")
    if min(tokens) < 0 or max(tokens) >= vocab_size:  # the scan in C; the culprit found only then
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    need = len(tokens) + request.max_tokens
    if need > max_context:
        raise ValueError(f"prompt ({len(tokens)} tokens) + max_tokens ({request.max_tokens}) = {need} exceeds "
                         f"the model's context of {max_context} tokens")
    if kv_budget is not None:
        need = kv_budget.reserve(len(tokens), request.max_tokens)
        if need > device_tokens:
            raise ValueError(f"the prompt ({len(tokens)} tokens) under kv_budget {kv_budget.tokens} needs {need} "
                             f"device KV tokens, more than the pool's {device_tokens}")
    elif need > device_tokens:
        raise ValueError(f"prompt ({len(tokens)} tokens) + max_tokens ({request.max_tokens}) = {need} exceeds "
                         f"the device KV pool of {device_tokens} tokens")
    # `workflow` follows the client-id rule: it is the client id, tenant-scoped
    for name, rule, value in (("workflow", "client_id", request.workflow), ("agent", "agent", request.agent),
                              ("fixed_prefix_tokens", "fixed_prefix_tokens", request.fixed_prefix_tokens)):
        problem = None if value is None else meta_problem(rule, value)
        if problem:
            raise ValueError(f"{name} {problem}")
    fixed = request.fixed_prefix_tokens
    if fixed is not None and fixed > len(tokens):
        raise ValueError(f"fixed_prefix_tokens={fixed} is outside the prompt (0..{len(tokens)})")
    if (request.workflow is None) != (request.agent is None):
        raise ValueError("workflow metadata needs both a workflow (client id) and an agent")
    return tokens


def prefix_hash(tokens: Sequence[int], salt: Namespace = "") -> str:
    """The id of a cached token sequence in one cache namespace (`GenerateRequest.cache_salt`, or a
    core `cache_namespace` with an extra key): the same tokens under two namespaces are two prefixes,
    so a location index keyed by it is isolated too. The default namespace "" keeps the unsalted hash."""
    import hashlib
    import json
    from array import array

    data = array("q", tokens).tobytes()  # token ids as 64-bit integers (ten times cheaper than text)
    if isinstance(salt, tuple):  # (extra key, salt): a label no plain salt's bytes can equal
        data = b"\x01" + json.dumps(salt).encode() + b"\x00" + data
    elif salt:
        data = salt.encode() + b"\x00" + data
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def thread_cpu_seconds(*threads: threading.Thread) -> float:
    """CPU time (user + system) the given threads have used so far, from their POSIX thread clocks;
    a thread not running (not started, or over) counts 0."""
    total = 0.0
    for thread in threads:
        ident = thread.ident
        if ident is not None and thread.is_alive():
            with contextlib.suppress(OSError):  # it ended between the check and the read
                total += time.clock_gettime(time.pthread_getcpuclockid(ident))
    return total


class Engine(Protocol):
    def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one request to completion (raises ValueError for a request that can never run)."""
        ...

    def stream(self, request: GenerateRequest) -> Iterator[int | GenerateResult]:
        """Yield output token ids as they are produced, then the `GenerateResult`."""
        ...

    def apply_hints(self, hints: Hints) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def cache_events(self) -> list[CacheEvent]:
        """Events since the last call (drained)."""
        ...

    def cache_snapshot(self) -> list[CacheEvent] | None:
        """What the cache holds now, as "stored" events, replacing the events not drained yet (for a
        router that lost track of them); None when the engine cannot tell."""
        ...


class BackgroundEngine:
    """`generate` and `stream` for an engine that runs requests in the background behind
    `submit(request, on_token=, on_done=)`, whose returned handle gets `result` (and `error` when it
    failed). An engine that may run without its own thread overrides `_block_until` to step itself."""

    def submit(self, request: GenerateRequest, on_token: Callable[[int], None] | None = None,
               on_done: Callable[[Any], None] | None = None) -> Any:
        raise NotImplementedError

    def _block_until(self, ready: Callable[[], bool], wait: Callable[[], object]) -> None:
        """Return once `ready()`; `wait()` blocks until it is."""
        wait()

    def generate(self, request: GenerateRequest) -> GenerateResult:
        done = threading.Event()
        req = self.submit(request, on_done=lambda _r: done.set())
        self._block_until(done.is_set, done.wait)
        if getattr(req, "error", None) is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def stream(self, request: GenerateRequest) -> Iterator[int | GenerateResult]:
        tokens: queue.Queue[int | None] = queue.Queue()
        req = self.submit(request, on_token=tokens.put, on_done=lambda _r: tokens.put(None))
        while True:
            self._block_until(lambda: not tokens.empty(), lambda: None)
            item = tokens.get()
            if item is None:
                break
            yield item
        if getattr(req, "error", None) is not None:
            raise req.error
        assert req.result is not None
        yield req.result


def session_turn(request: GenerateRequest) -> SessionTurn | None:
    """The core's view of a session turn (`core.sessions.SessionTurn`); raises ValueError on a malformed
    one. The tool its output calls is filled in when it ends (`ended_turn`)."""
    meta = request.session
    if meta is None:
        return None
    if request.workflow is None or request.agent != SESSION_AGENT:
        raise ValueError(f"a session turn names its session as workflow and {SESSION_AGENT!r} as agent")
    hint = meta.get("hint_s")
    if hint is not None and not (isinstance(hint, int | float) and 0 < hint <= 86_400):
        raise ValueError("session hint_s must be a number of seconds in (0, 86400]")
    tenant, agent, tool = meta.get("tenant", ""), meta.get("agent", SESSION_AGENT), meta.get("tool", "")
    parser, truth, tools = meta.get("tool_parser"), meta.get("true_pause_s"), meta.get("tools")
    names_ok = tools is None or (isinstance(tools, list) and all(isinstance(t, str) for t in tools))
    if not all(isinstance(v, str) for v in (tenant, agent, tool)) or not isinstance(meta.get("final", False), bool) \
            or not (parser is None or isinstance(parser, str)) or not names_ok \
            or not (truth is None or isinstance(truth, int | float)):
        raise ValueError("session: tenant, agent and tool are strings, final a boolean, tool_parser a parser name, "
                         "tools a list of tool names")
    return SessionTurn(tenant=tenant, agent=agent, tool=tool, hint_s=None if hint is None else float(hint),
                       final=bool(meta.get("final", False)), tool_parser=parser,
                       tool_names=None if tools is None else tuple(tools),
                       true_pause_s=None if truth is None else float(truth))


def ended_turn(turn: SessionTurn, output: str) -> SessionTurn:
    """`turn` with the tool its `output` calls (the first call's name, by the turn's parser; "" if none)."""
    if turn.tool_parser is None:
        return turn
    calls = get_parser(turn.tool_parser).parse(output, turn.tool_names).calls
    return replace(turn, tool=calls[0].name[:128] if calls else "")
