"""The contract between the SGLang plugin (inside SGLang's scheduler process) and whoever drives an
SGLang engine with it (the kvflow-ray engine adapter, the GPU smoke script). Pure Python: no sglang,
no torch (it imports only `engines.base`, which is pure too), so both sides and the tests import it
anywhere.

- **Per request**: `sampling_params["custom_params"]["kvflow"] = request_params(...)`, a *flat* dict
  (SGLang's msgpack IPC rejects nested values in `custom_params`). The request's cache namespace is
  SGLang's own `cache_salt` (an `async_generate` argument): SGLang keys its radix tree by it, so
  requests under different salts never share KV, and the plugin reads it back from the tree keys.
- **Control** (hints without a request): `sglang.Engine.collective_rpc(RPC_APPLY_HINTS,
  payload=encode_hints(...))` runs `Scheduler.kvflow_apply_hints(payload)` on every scheduler rank,
  on the scheduler thread, between batches.
- **Status out**: when `STATUS_DIR_ENV` is set, scheduler rank 0 keeps `<dir>/stats.json` (the keys
  of `core.scheduler.ReplicaScheduler.snapshot()` it can fill, replaced atomically at most once per
  `STATUS_INTERVAL_S`) and appends cache events, one JSON object per line, to `<dir>/events.jsonl`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvflow_ray.engines.base import META_FIELDS, meta_problem

PLUGIN_NAME = "kvflow"  # entry-point name; also the `--radix-eviction-policy` name
CUSTOM_PARAMS_KEY = "kvflow"
RPC_APPLY_HINTS = "kvflow_apply_hints"
STATUS_DIR_ENV = "KVFLOW_SGLANG_STATUS_DIR"
STATUS_INTERVAL_S = 1.0
TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
SGLANG_VERSION = "0.5.23"  # the plugin hooks internals of exactly this version

Tag = tuple[str, str]  # (workflow instance = client id, agent)


def request_params(client_id: str, agent: str, fixed_prefix_tokens: int | None = None) -> dict[str, Any]:
    """`custom_params["kvflow"]` for one request."""
    params: dict[str, Any] = {"client_id": str(client_id), "agent": str(agent)}
    if fixed_prefix_tokens is not None:
        params["fixed_prefix_tokens"] = int(fixed_prefix_tokens)
    return params


def parse_request_params(custom_params: Mapping[str, Any] | None) -> tuple[Tag, int | None] | None:
    """The (client id, agent) tag and the explicit fixed-prefix length of a request, or None for a
    plain request. Raises ValueError naming the bad field (the rules: `engines.base.meta_problem`)."""
    if not custom_params or CUSTOM_PARAMS_KEY not in custom_params:
        return None
    params = custom_params[CUSTOM_PARAMS_KEY]
    if not isinstance(params, Mapping):
        raise ValueError(f"custom_params.{CUSTOM_PARAMS_KEY} must be an object, got {type(params).__name__}")
    unknown = set(params) - set(META_FIELDS)
    if unknown:
        raise ValueError(f"custom_params.{CUSTOM_PARAMS_KEY}: unknown key(s) {sorted(unknown)}")
    for key in META_FIELDS:
        problem = meta_problem(key, params.get(key))
        if problem:
            raise ValueError(f"custom_params.{CUSTOM_PARAMS_KEY}.{key} {problem}")
    return (params["client_id"], params["agent"]), params.get("fixed_prefix_tokens")


def encode_hints(steps: Mapping[str, Mapping[str, float]] | None = None,
                 prompts: Mapping[Tag, Sequence[int]] | None = None,
                 retire: Iterable[str] = (), salts: Mapping[str, str] | None = None,
                 elsewhere: Mapping[str, Iterable[str]] | None = None) -> str:
    """JSON for `kvflow_apply_hints`: the fields of `engines.base.Hints` (an infinite
    steps-to-execution travels as null; `salts`: each workflow instance's cache namespace;
    `elsewhere`: agents another replica will run)."""
    return json.dumps({
        "elsewhere": {str(wf): [str(a) for a in agents] for wf, agents in (elsewhere or {}).items()},
        "steps": {wf: {a: (None if math.isinf(e) else e) for a, e in agents.items()}
                  for wf, agents in (steps or {}).items()},
        "prompts": [[wf, agent, [int(t) for t in tokens]] for (wf, agent), tokens in (prompts or {}).items()],
        "retire": list(retire),
        "salts": {str(wf): str(salt) for wf, salt in (salts or {}).items()},
    }, separators=(",", ":"))


def decode_hints(payload: str) -> tuple[dict[str, dict[str, float]], dict[Tag, tuple[int, ...]], list[str],
                                        dict[str, str], dict[str, list[str]]]:
    """Inverse of `encode_hints`: (steps, prompts, retire, salts, elsewhere); raises ValueError on a
    malformed payload."""
    try:
        data = json.loads(payload)
        steps = {str(wf): {str(a): (math.inf if e is None else float(e)) for a, e in agents.items()}
                 for wf, agents in data.get("steps", {}).items()}
        prompts = {(str(wf), str(agent)): tuple(int(t) for t in tokens)
                   for wf, agent, tokens in data.get("prompts", [])}
        retire = [str(wf) for wf in data.get("retire", [])]
        salts = {str(wf): str(salt) for wf, salt in data.get("salts", {}).items()}
        elsewhere = {str(wf): [str(a) for a in agents] for wf, agents in data.get("elsewhere", {}).items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed kvflow hints payload: {exc}") from exc
    return steps, prompts, retire, salts, elsewhere


# SGLang server arguments of a policy combination with a host tier (engine.policy_server_args).
HICACHE_ARGS: dict[str, Any] = {
    "enable_hierarchical_cache": True,
    "hicache_ratio": 2.0,
    # evicted device KV is written to the host tier on eviction (docs/design.md §3: "eviction from GPU
    # writes back to CPU when the node has no CPU copy")
    "hicache_write_policy": "write_back",
}
