"""The serving app's configuration: one pydantic model, read from the `args` of a Ray Serve config
file (`deploy/*.yaml`), from `kvflow-ray serve` flags, or from code. Unknown keys are errors, so a
typo in a deployment file fails at deploy time rather than being ignored."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from kvflow_ray.core.kv_budget import KvBudget
from kvflow_ray.core.reuse import parse_reuse
from kvflow_ray.core.routing import DEFAULT_ROUTING
from kvflow_ray.core.scheduler import POLICIES
from kvflow_ray.engines.cpu.weights import DEFAULT_MODEL, check_model, resolve_model, served_name
from kvflow_ray.engines.tool_calls import DEFAULT_TOOL_CALL_PARSER, get_parser
from kvflow_ray.router.limits import TenantLimits
from kvflow_ray.router.settings import SYNC_S, RouterSettings

ENGINES = ("cpu", "sim", "sglang")
# engines that honour constrained decoding (`GenerateRequest.constraint`): forced tool choice runs there
CONSTRAINED_ENGINES = frozenset({"cpu"})
# request_router -> the Ray Serve request router that sends each engine call to a replica (an import
# path, as Serve's RequestRouterConfig takes it; None: Serve's own power-of-two-choices router)
REQUEST_ROUTERS: dict[str, str | None] = {
    "kvflow": "kvflow_ray.serve.request_router.WorkflowRequestRouter",  # honours the workflow router's choice
    "serve": None,  # Ray Serve's own, for comparison
}
# What serving gives a routing policy (`core.routing.ROUTING_INPUTS`), per engine: the ingress sends
# every call's tokens and output budget, the replicas report first tokens (with their cache events) and
# load (each second). The CPU and simulated engines' cache events carry the block hashes of all they
# cache; the SGLang plugin reports agents' fixed prompts only, so a policy reading every block is
# refused there rather than run on a partial index.
SERVING_INPUTS: dict[str, frozenset[str]] = {
    "cpu": frozenset({"tokens", "blocks", "first_token", "load"}),
    "sim": frozenset({"tokens", "blocks", "first_token", "load"}),
    "sglang": frozenset({"tokens", "first_token", "load"}),
}
# keys of earlier releases, and what took their place
RENAMED = {"route_policy": "routing (a routing policy name, as `kvflow-ray sim --routing` takes)"}


class AppConfig(BaseModel):
    """Validated on construction: unknown keys, wrong types and impossible values are errors that name
    the field (pydantic), so a typo in a deployment file fails at deploy time rather than being ignored."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=False)

    engine: str = "cpu"  # cpu (the embedded default) | sim (GPU timing from a profile) | sglang (GPU, SGLang + plugin)
    replicas: int = 2
    # HTTP ingress replicas (tenants' admission limits apply per ingress replica): each routes the
    # calls of the clients Serve keys to it by the session header; a client new to one is recalled
    # from Redis
    ingress_replicas: int = Field(1, ge=1)
    # how often a busy ingress replica syncs with the router actor (router/peers.py): the other
    # ingresses' loads and work in flight are this old; shorter costs CPU on every ingress and the actor
    ingress_sync_s: float = Field(SYNC_S, ge=0.02, le=1.0)
    redis: str | None = None  # redis://host:port/db; None = the embedded in-process store
    # which replica serves each agent call: a name in `core.routing.ROUTING`, the same names and objects
    # as `kvflow-ray sim --routing` (workflow: the workflow router the simulator measures)
    routing: str = DEFAULT_ROUTING
    # kvflow: Serve sends each call where the routing policy chose; serve: Ray Serve's own router
    # (power of two choices, blind to the choice: for comparison)
    request_router: str = "kvflow"
    # prefix-affinity routing: a prefix holder keeps the call while its queue is at most this many
    # requests longer than the least loaded replica's; low for slow engines
    balance_threshold: int = 2
    api_keys: dict[str, str] = Field(default_factory=dict)  # bearer key -> tenant; empty = one "default" tenant
    # the name of an environment variable holding more keys as JSON {"key": "tenant"} (a Kubernetes
    # Secret mounted as env), so keys stay out of config files; read where the app is built
    api_keys_env: str | None = None
    # /metrics answers only with `Authorization: Bearer <metrics_token>` when a token is set (directly,
    # or from the environment variable named by metrics_token_env: a Kubernetes Secret mounted as env)
    metrics_token: str | None = None
    metrics_token_env: str | None = None
    # Prefix caches are per tenant: a tenant's KV (and every signal of it: cached_tokens, routing,
    # timing) is reusable only by that tenant. A sharing group {name: [tenant, ...]} lets its tenants
    # reuse each other's KV (public preambles), at the price of learning what the others' prompts
    # start with (docs/security.md).
    cache_sharing_groups: dict[str, list[str]] = Field(default_factory=dict)
    # x-kvflow-route / x-kvflow-replica response headers (where a call went and why): for debugging only
    route_headers: bool = False
    limits: TenantLimits = Field(default_factory=TenantLimits)
    state_ttl_s: float = Field(3600.0, gt=0)  # idle workflow state expires after this long
    # a workflow template unused this long is dropped (at least state_ttl_s: a live client keeps its own)
    template_idle_ttl_s: float = Field(7 * 86400.0, gt=0)
    # a Redis outage this long is served from the router's memory (writes queued); past it, calls that
    # change state get 503 + Retry-After until Redis is back, as do calls while this many writes wait
    store_grace_s: float = Field(30.0, ge=0)
    store_max_pending_writes: int = Field(100_000, ge=1)
    max_ongoing_requests: int = Field(64, ge=1)  # per engine replica (the engine batches up to its max_running)
    replica_num_cpus: float = Field(0.5, ge=0)  # Ray CPUs reserved per engine replica
    replica_num_gpus: float | None = None  # Ray GPUs per engine replica; None: 1 for sglang, else 0
    # engine settings: see CpuEngineConfig (cpu), engines/sim/serving.py (sim) and
    # engines/sglang/engine.py (sglang) for what each means
    policy: str = "kvflow"
    # cpu: the model by name (engines/cpu/weights.py: smollm2-135m, random), unless model_path or gguf is set
    model: str = DEFAULT_MODEL
    # cpu: a local HF model directory; sglang (required): what SGLang loads
    model_path: str | None = None
    gguf: str | None = None  # cpu: a GGUF file, dequantized once into model_cache
    model_cache: str | None = None  # cpu: where dequantized models live (default KVFLOW_MODEL_CACHE or ~/.cache)
    profile: str = "a10g-llama3.1-8b"  # sim: the GPU cost profile each replica simulates
    time_scale: float = 1.0  # sim: wall seconds per simulated second (0.1 = ten times faster)
    # None: the engine's default (cpu 12,288; sim: the profile's GPU; sglang: what SGLang sizes from
    # mem_fraction_static); for sglang a value becomes max_total_tokens
    device_kv_tokens: int | None = Field(None, ge=1)
    host_kv_tokens: int = Field(65_536, ge=0)
    link_gbps: float | None = 0.1
    max_running: int = Field(16, ge=1)
    horizon: int = Field(1, ge=0)
    # agent sessions: per tenant and replica, at most this many tokens of paused histories rank as needed
    # (docs/design.md §11; beyond it a paused history ranks as unneeded); None: unbounded
    session_retain_tokens: int | None = Field(None, ge=1)
    threads: int | None = Field(None, ge=1)  # torch threads per replica; None: the machine's cores / replicas
    seed: int = 0
    # sglang: more `sglang.Engine` server args (ServerArgs fields), e.g. {mem_fraction_static: 0.8,
    # hicache_ratio: 4, load_format: dummy, skip_tokenizer_init: true, tp_size: 1}. The policy sets the
    # eviction policy and the host tier, device_kv_tokens sets max_total_tokens and seed random_seed;
    # host_kv_tokens, link_gbps, max_running, horizon and threads are CPU-engine settings.
    sglang_args: dict[str, Any] = Field(default_factory=dict)
    # how a model's output holds tool calls (engines/tool_calls.py `TOOL_CALL_PARSERS`, as SGLang's
    # --tool-call-parser): the ingress parses every engine's output with it when a request has tools
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER
    # reuse of earlier agents' outputs beyond the prefix (docs/design.md §12), per tenant: the method of
    # its workflow calls that name none (neither in `kvflow.reuse` nor in their workflow); absent: exact.
    # Approximate: never on unless asked for. cpu: kept outputs are bounded by segment_kv_tokens per replica
    tenant_reuse: dict[str, str] = Field(default_factory=dict)
    segment_kv_tokens: int = Field(16_384, ge=0)
    # per-request KV budgets (docs/design.md §13), per tenant: the cap on the private KV of its calls
    # that set no `kvflow.kv_budget`; absent: none (every token's KV kept). cpu and sim engines only
    tenant_kv_budget: dict[str, int] = Field(default_factory=dict)

    # keys and the metrics token from the environment are resolved wherever the config is built
    # (ingress, replicas) and kept out of the fields, so to_dict() never copies them into Ray's
    # deployment arguments
    _env_keys: dict[str, str] = PrivateAttr(default_factory=dict)
    _env_metrics_token: str | None = PrivateAttr(default=None)
    _salts: dict[str, str] = PrivateAttr(default_factory=dict)

    def __init__(self, **data: Any) -> None:
        _check_renamed(data)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ValueError(config_error(exc)) from None

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {_short(self.engine)}")
        if self.replica_num_gpus is None:
            self.replica_num_gpus = 1.0 if self.engine == "sglang" else 0.0
        if self.replica_num_gpus < 0:
            raise ValueError(f"replica_num_gpus must be >= 0, got {self.replica_num_gpus}")
        if self.sglang_args and self.engine != "sglang":
            raise ValueError(f"sglang_args apply to engine 'sglang' only (this config runs engine {self.engine!r})")
        if self.engine == "sglang":
            self._check_sglang()
        if self.engine == "sim":
            from kvflow_ray.engines.sim.profile import available_profiles

            if self.profile not in available_profiles() and not Path(self.profile).is_file():
                raise ValueError(f"unknown profile {_short(self.profile)} "
                                 f"(available: {', '.join(available_profiles())})")
            if self.time_scale <= 0:
                raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if self.engine == "cpu":
            check_model(self.model, model_path=self.model_path, gguf=self.gguf)
        elif self.gguf:
            raise ValueError(f"gguf applies to engine 'cpu' only (this config runs engine {self.engine!r})")
        if self.engine in ("cpu", "sim"):  # SGLang's policies are checked with its server args above
            from kvflow_ray.core.scheduler import resolve_policy

            resolve_policy(self.policy, serving_on=f"the {self.engine} engine")  # names those it can run
        from kvflow_ray.core.routing import ROUTING_INPUTS, missing_inputs

        # names the known policies, or the options a policy takes, when it is wrong
        policy = RouterSettings(routing=self.routing, balance_threshold=self.balance_threshold, seed=self.seed).policy()
        missing = missing_inputs(policy, SERVING_INPUTS[self.engine])
        if missing:
            raise ValueError(f"routing {self.routing!r} needs {'; '.join(ROUTING_INPUTS[m] for m in missing)}, which "
                             f"serving on the {self.engine} engine does not give; choose a routing policy that "
                             f"does not (e.g. workflow)")
        get_parser(self.tool_call_parser)  # names the known parsers when it is wrong
        if self.tenant_kv_budget and self.engine == "sglang":
            raise ValueError("tenant_kv_budget: the SGLang engine keeps every token's KV (docs/sglang.md); "
                             "KV budgets run on the cpu and sim engines")
        _check_tenant_defaults("tenant_kv_budget", self.tenant_kv_budget, KvBudget)
        _check_tenant_defaults("tenant_reuse", self.tenant_reuse, parse_reuse)
        if self.request_router not in REQUEST_ROUTERS:
            raise ValueError(f"request_router must be one of {tuple(REQUEST_ROUTERS)}, "
                             f"got {_short(self.request_router)}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.template_idle_ttl_s < self.state_ttl_s:
            raise ValueError(f"template_idle_ttl_s ({self.template_idle_ttl_s:g}) must be at least state_ttl_s "
                             f"({self.state_ttl_s:g}): a live client's template must outlive it")
        self._env_keys = _keys_from_env(self.api_keys_env) if self.api_keys_env else {}
        for keys in (self.api_keys, self._env_keys):
            if not all(isinstance(k, str) and isinstance(v, str) and k for k, v in keys.items()):
                raise ValueError("api_keys must map non-empty key strings to tenant names")
            for tenant in keys.values():
                _check_tenant("api_keys", tenant)
        if self.metrics_token_env:
            token = os.environ.get(self.metrics_token_env)
            if not token:
                raise ValueError(f"metrics_token_env: environment variable {self.metrics_token_env} is not set")
            self._env_metrics_token = token
        if self.metrics_token is not None and not self.metrics_token:
            raise ValueError("metrics_token must not be empty (omit it to leave /metrics open)")
        self._salts = {}
        for group, tenants in self.cache_sharing_groups.items():
            _check_tenant("cache_sharing_groups", group)
            for tenant in tenants:
                _check_tenant(f"cache_sharing_groups.{group}", tenant)
                if tenant in self._salts:
                    raise ValueError(f"cache_sharing_groups: tenant {tenant!r} is in two groups")
                self._salts[tenant] = f"group:{group}"
        return self

    def cpu_model_dir(self) -> str | None:
        """The model directory the CPU engine loads (dequantized on first use); None for the random model.
        A ValueError names what is missing (e.g. the command that installs a built-in model)."""
        return resolve_model(self.model, model_path=self.model_path, gguf=self.gguf, cache=self.model_cache)

    def _check_sglang(self) -> None:
        if not self.model_path:
            raise ValueError("engine 'sglang' needs model_path: the model directory (or hub id) the SGLang "
                             "plugin's engine loads on every replica")
        from kvflow_ray.engines.sglang.engine import build_server_args

        kwargs = self.sglang_engine_kwargs()
        # a bad policy or bad args fail at deploy time, not in every replica
        build_server_args(kwargs.pop("model_path"), kwargs.pop("policy"), extra=kwargs.pop("server_args"), **kwargs)
        # find_spec, not import: importing sglang takes seconds and initialises CUDA libraries
        if importlib.util.find_spec("sglang") is None:
            raise ValueError("engine 'sglang' needs the sglang package (with the kvflow SGLang plugin) on every "
                             "node that runs a replica: pip install 'kvflow-ray[sglang]'")

    def sglang_engine_kwargs(self) -> dict[str, Any]:
        """`SglangEngine` keyword arguments for engine 'sglang'."""
        return {"model_path": self.model_path or "", "policy": self.policy, "max_total_tokens": self.device_kv_tokens,
                "random_seed": self.seed, "server_args": dict(self.sglang_args)}

    def router_settings(self) -> RouterSettings:
        """The router actor's settings (the first process to create it wins)."""
        return RouterSettings(
            routing=self.routing, balance_threshold=self.balance_threshold, seed=self.seed,
            prefetch_horizon=self.horizon, limits=self.limits, store_url=self.redis, state_ttl_s=self.state_ttl_s,
            template_ttl_s=self.template_idle_ttl_s, store_grace_s=self.store_grace_s,
            store_max_pending=self.store_max_pending_writes, sync_s=self.ingress_sync_s,
            # the engines' policy says how the router ranks agents in its hints (`predictive`: learned)
            prediction=POLICIES[self.policy].prediction if self.policy in POLICIES else "graph")

    def tokenizer_path(self) -> str | None:
        """Where the tokenizer of the served model lives; None: byte-level (engines without one: sim, the
        CPU engine's random model, SGLang with skip_tokenizer_init, e.g. dummy weights)."""
        if self.engine == "cpu":
            return self.cpu_model_dir()
        if self.engine == "sglang" and not self.sglang_args.get("skip_tokenizer_init"):
            return self.sglang_args.get("tokenizer_path") or self.model_path
        return None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AppConfig:
        data = dict(data or {})
        _check_renamed(data)
        unknown = sorted(set(data) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown app config keys {[k[:64] for k in unknown[:10]]} "
                             f"(known: {sorted(cls.model_fields)})")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def field_names(cls) -> list[str]:
        return list(cls.model_fields)

    def model_name(self) -> str:
        """What `/v1/models` lists and requests may name."""
        if self.engine == "sim":
            return f"sim-{self.profile}"
        if self.engine == "cpu":
            return served_name(self.model, model_path=self.model_path, gguf=self.gguf)
        return self.model_path or ""

    def engine_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.replicas)

    def tenant_for(self, key: str | None) -> str | None:
        """The tenant of a bearer key; None when keys are configured and this one is not among them."""
        if not self.api_keys and not self._env_keys:
            return "default"
        return self.api_keys.get(key or "") or self._env_keys.get(key or "")

    def cache_salt(self, tenant: str) -> str:
        """The cache namespace of a tenant's requests: its own, or its sharing group's."""
        return self._salts.get(tenant) or f"tenant:{tenant}"

    def metrics_token_value(self) -> str | None:
        """The token /metrics requires, if any."""
        return self.metrics_token or self._env_metrics_token


def _check_renamed(data: dict[str, Any]) -> None:
    """A key (or value) of an earlier release is an error naming what replaced it."""
    for old, new in RENAMED.items():
        if old in data:
            raise ValueError(f"{old}: renamed; use {new}")
    if data.get("routing") == "default":
        raise ValueError("routing: 'default' (Ray Serve's own request router) is now request_router: serve; "
                         "routing names the routing policy (default workflow)")


def _short(value: object, limit: int = 80) -> str:
    """A value for an error message: its repr, cut short (never echo unbounded input back)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_tenant(where: str, name: object) -> None:
    from kvflow_ray.core.graph import KEY_PART_RE as NAME

    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}: tenant name {_short(name)} is not valid (1-128 of A-Z a-z 0-9 _ . @ -)")


def _check_tenant_defaults(where: str, defaults: dict[str, Any], check: Callable[[Any], object]) -> None:
    """Per-tenant defaults: each key a valid tenant name, each value one `check` accepts (its
    ValueError, prefixed with the field and tenant, names what is wrong)."""
    for tenant, value in defaults.items():
        _check_tenant(where, tenant)
        try:
            check(value)
        except ValueError as exc:
            raise ValueError(f"{where}.{tenant}: {exc}") from None


def config_error(exc: ValidationError) -> str:
    """One line per problem, naming the field; the offending values are not echoed back."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False)[:10]:
        where = ".".join(str(part) for part in error["loc"]) or "config"
        message = str(error["msg"]).removeprefix("Value error, ")
        lines.append(message if error["type"] == "value_error" else f"{where}: {message}")
    return "; ".join(lines)


def _keys_from_env(name: str) -> dict[str, str]:
    raw = os.environ.get(name)
    if raw is None:
        raise ValueError(f"api_keys_env: environment variable {name} is not set "
                         '(expected JSON {"key": "tenant"})')
    try:
        keys = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"api_keys_env: {name} is not valid JSON: {exc.msg}") from None
    if not isinstance(keys, dict):
        raise ValueError(f"api_keys_env: {name} must hold a JSON object mapping keys to tenants")
    return keys
