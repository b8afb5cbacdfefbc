"""The serving app's configuration: one plain dataclass, read from the `args` of a Ray Serve config
file (`deploy/*.yaml`), from `kvflow-ray serve` flags, or from code. Unknown keys are errors, so a
typo in a deployment file fails at deploy time rather than being ignored."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINES = ("cpu", "sim", "sglang")
ROUTINGS = ("workflow", "default")


@dataclass
class AppConfig:
    engine: str = "cpu"  # cpu (the embedded default) | sim (GPU timing from a profile) | sglang (GPU, SGLang + plugin)
    replicas: int = 2
    redis: str | None = None  # redis://host:port/db; None = the embedded in-process store
    routing: str = "workflow"  # workflow: honour the router's choice; default: Ray Serve's own router
    # a prefix holder keeps the call while its queue is at most this many requests longer than the
    # least loaded replica's; low for slow engines (a queued request costs seconds on a CPU engine)
    balance_threshold: int = 2
    api_keys: dict[str, str] = field(default_factory=dict)  # bearer key -> tenant; empty = one "default" tenant
    # the name of an environment variable holding more keys as JSON {"key": "tenant"} (a Kubernetes
    # Secret mounted as env), so keys stay out of config files; read where the app is built
    api_keys_env: str | None = None
    # /metrics answers only with `Authorization: Bearer <metrics_token>` when a token is set (directly,
    # or from the environment variable named by metrics_token_env: a Kubernetes Secret mounted as env)
    metrics_token: str | None = None
    metrics_token_env: str | None = None
    state_ttl_s: float = 3600.0  # idle workflow state expires after this long
    max_ongoing_requests: int = 64  # per engine replica (the engine batches up to its max_running)
    replica_num_cpus: float = 0.5  # Ray CPUs reserved per engine replica
    replica_num_gpus: float | None = None  # Ray GPUs per engine replica; None: 1 for sglang, else 0
    # engine settings: see CpuEngineConfig (cpu), engines/sim/serving.py (sim) and
    # engines/sglang/engine.py (sglang) for what each means
    policy: str = "kvflow"
    # cpu: a local HF model directory (default: random weights); sglang (required): what SGLang loads
    model_path: str | None = None
    profile: str = "a10g-llama3.1-8b"  # sim: the GPU cost profile each replica simulates
    time_scale: float = 1.0  # sim: wall seconds per simulated second (0.1 = ten times faster)
    # None: the engine's default (cpu 12,288; sim: the profile's GPU; sglang: what SGLang sizes from
    # mem_fraction_static); for sglang a value becomes max_total_tokens
    device_kv_tokens: int | None = None
    host_kv_tokens: int = 65_536
    link_gbps: float | None = 0.1
    max_running: int = 16
    horizon: int = 1
    threads: int | None = None  # torch threads per replica; None: the machine's cores / replicas
    seed: int = 0
    # sglang: more `sglang.Engine` server args (ServerArgs fields), e.g. {mem_fraction_static: 0.8,
    # hicache_ratio: 4, load_format: dummy, skip_tokenizer_init: true, tp_size: 1}. The policy sets the
    # eviction policy and the host tier, device_kv_tokens sets max_total_tokens and seed random_seed;
    # host_kv_tokens, link_gbps, max_running, horizon and threads are CPU-engine settings.
    sglang_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.replica_num_gpus is None:
            self.replica_num_gpus = 1.0 if self.engine == "sglang" else 0.0
        if self.replica_num_gpus < 0:
            raise ValueError(f"replica_num_gpus must be >= 0, got {self.replica_num_gpus}")
        if not isinstance(self.sglang_args, dict):
            raise ValueError(f"sglang_args must be a mapping of SGLang server args, got {self.sglang_args!r}")
        if self.sglang_args and self.engine != "sglang":
            raise ValueError(f"sglang_args apply to engine 'sglang' only (this config runs engine {self.engine!r})")
        if self.engine == "sglang":
            self._check_sglang()
        if self.engine == "sim":
            from kvflow_ray.engines.sim.profile import available_profiles

            if self.profile not in available_profiles() and not Path(self.profile).is_file():
                raise ValueError(f"unknown profile {self.profile!r} (available: {', '.join(available_profiles())})")
            if self.time_scale <= 0:
                raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        # keys from the environment are resolved wherever the config is built (ingress, replicas) and
        # kept out of the fields, so to_dict() never copies them into Ray's deployment arguments
        self._env_keys = _keys_from_env(self.api_keys_env) if self.api_keys_env else {}
        for keys in (self.api_keys, self._env_keys):
            if not isinstance(keys, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and k for k, v in keys.items()):
                raise ValueError("api_keys must map non-empty key strings to tenant names")

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

    def tokenizer_path(self) -> str | None:
        """Where the tokenizer of the served model lives; None: byte-level (engines without one: sim, the
        CPU engine's random model, SGLang with skip_tokenizer_init, e.g. dummy weights)."""
        if self.engine == "cpu":
            return self.model_path
        if self.engine == "sglang" and not self.sglang_args.get("skip_tokenizer_init"):
            return self.sglang_args.get("tokenizer_path") or self.model_path
        return None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AppConfig:
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown app config keys {unknown} (known: {sorted(known)})")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_name(self) -> str:
        """What `/v1/models` lists and requests may name."""
        if self.engine == "sim":
            return f"sim-{self.profile}"
        return self.model_path or "kvflow-cpu-random"

    def engine_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.replicas)

    def tenant_for(self, key: str | None) -> str | None:
        """The tenant of a bearer key; None when keys are configured and this one is not among them."""
        if not self.api_keys and not self._env_keys:
            return "default"
        return self.api_keys.get(key or "") or self._env_keys.get(key or "")


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
