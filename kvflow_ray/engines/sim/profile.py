"""GPU cost profiles for the simulator: data files in `profiles/`, each number with its derivation.

The cost model is a roofline per forward step: a step takes the longer of its compute time (FLOPs
at an achieved fraction of peak) and its memory time (weights + KV read at an achieved fraction of
HBM bandwidth), plus a fixed per-step overhead. Copies between tiers take bytes / link bandwidth.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import yaml

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    gpu_memory_bytes: float
    mem_fraction_static: float
    weight_bytes: float
    peak_flops: float
    hbm_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    params: float
    n_layers: int
    hidden_size: int
    n_kv_heads: int
    head_dim: int
    kv_bytes_per_token: float
    prefill_mfu: float
    decode_mbu: float
    iteration_overhead_s: float
    chunked_prefill_tokens: int
    max_running_requests: int
    host_kv_tokens: int
    # Achieved fraction of peak in attention (QK^T, AV), when it differs from the GEMMs' `prefill_mfu`.
    # Unset in the GPU profiles (one efficiency for both); the CPU calibration fits it, because a CPU's
    # attention over a long context runs several times slower per FLOP than its matmuls.
    attention_mfu: float = 0.0
    # The prefill budget of a step while no request decodes (`ReplicaScheduler.next_batch`'s
    # `idle_budget`): the CPU engine's `idle_chunk_tokens`. 0 in the GPU profiles: SGLang chunks always.
    idle_prefill_tokens: int = 0

    @property
    def gpu_kv_tokens(self) -> int:
        """Device KV pool: what SGLang's static memory fraction leaves after the weights."""
        return int((self.gpu_memory_bytes * self.mem_fraction_static - self.weight_bytes) // self.kv_bytes_per_token)

    # ------------------------------------------------------------------ costs
    def attention_flops(self, new_tokens: int, context_before: int) -> float:
        """QK^T and AV for `new_tokens` queries over a causal context that starts at `context_before`:
        2 matmuls x 2 FLOPs/MAC x hidden per (query, key) pair, summed over layers."""
        return 4.0 * self.n_layers * self.hidden_size * _pairs(new_tokens, context_before)

    def step_time(self, prefill: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        """One forward step: `prefill` is (new tokens, tokens already in context) per request chunk;
        `decode_contexts` the context length of each decoding request (one new token each)."""
        if not prefill and not decode_contexts:
            return 0.0
        context = sum(decode_contexts)
        return self._step_time(tokens=sum(n for n, _ in prefill) + len(decode_contexts),
                               pairs=sum(_pairs(n, ctx) for n, ctx in prefill) + context + len(decode_contexts),
                               kv_read=context + sum(ctx for _, ctx in prefill))

    def decode_step_time(self, requests: int, context: int) -> float:
        """`step_time` of a decode-only step from totals: `requests` decoding over `context` tokens
        of context together (what a simulator tracks incrementally across a run of decode steps)."""
        return self._step_time(tokens=requests, pairs=context + requests, kv_read=context) if requests else 0.0

    def _step_time(self, tokens: int, pairs: int, kv_read: int) -> float:
        # (query, key) pairs are summed as integers, so a step costs the same whatever the order its
        # requests are listed in, and a total kept incrementally gives exactly the same time
        gemm = 2.0 * self.params * tokens
        attention = 4.0 * self.n_layers * self.hidden_size * pairs
        bytes_moved = self.weight_bytes + kv_read * self.kv_bytes_per_token
        compute = (gemm / (self.peak_flops * self.prefill_mfu)
                   + attention / (self.peak_flops * (self.attention_mfu or self.prefill_mfu)))
        memory = bytes_moved / (self.hbm_bytes_per_s * self.decode_mbu)
        return max(compute, memory) + self.iteration_overhead_s

    def compaction_time(self, queries: int, keys: int, kept: int) -> float:
        """A KV budget's re-score and compaction (docs/design.md §13): `queries` buffered queries over
        `keys` private keys (QK^T, every layer and head), reading those keys, and moving `kept` tokens'
        KV to the front of the request's slots (read and write)."""
        scoring = 2.0 * self.n_layers * self.hidden_size * queries * keys
        compute = scoring / (self.peak_flops * (self.attention_mfu or self.prefill_mfu))
        moved = (keys / 2 + 2 * kept) * self.kv_bytes_per_token
        return max(compute, moved / (self.hbm_bytes_per_s * self.decode_mbu))

    def h2d_time(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.h2d_bytes_per_s

    def d2h_time(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.d2h_bytes_per_s


def user_profile_dir() -> Path:
    """Where measured profiles go (`cpu-reference`, written by `kvflow-ray bench calibrate`): they
    describe one machine, so they live with the user, not in the package."""
    env = os.environ.get("KVFLOW_RAY_PROFILES")
    return Path(env) if env else Path.home() / ".cache" / "kvflow-ray" / "profiles"


def _profile_files() -> dict[str, Path]:
    files = {p.stem: p for p in sorted(user_profile_dir().glob("*.yaml"))}
    files.update({p.stem: p for p in sorted(PROFILE_DIR.glob("*.yaml"))})  # built-ins win
    return files


def available_profiles() -> list[str]:
    return sorted(_profile_files())


def load_profile(name_or_path: str, overrides: dict[str, str] | None = None) -> Profile:
    """A profile by name (built in, or measured into the user profile directory) or by path to a
    YAML file; `overrides` replace fields (for sensitivity studies: `--set peak_flops=125e12`)."""
    files = _profile_files()
    path = files.get(name_or_path, Path(name_or_path))
    if name_or_path == "cpu-reference" and not path.exists():
        raise ValueError(f"profile 'cpu-reference' is measured on each machine: run `kvflow-ray bench calibrate` "
                         f"first (it writes {user_profile_dir() / 'cpu-reference.yaml'})")
    if not path.exists():
        raise ValueError(f"unknown profile {name_or_path!r} (available: {', '.join(available_profiles())})")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a profile is a mapping of fields")
    known = {f.name: f for f in fields(Profile)}
    for key, value in (overrides or {}).items():
        if key not in known:
            raise ValueError(f"--set {key}: not a profile field (fields: {', '.join(known)})")
        data[key] = value
    missing = sorted(name for name, f in known.items() if name not in data and f.default is MISSING)
    unknown = sorted(set(data) - set(known))
    if missing or unknown:
        raise ValueError(f"{path}: missing fields {missing}, unknown fields {unknown}")
    values = {}
    for name, f in known.items():
        if name not in data:
            continue  # optional, its default applies
        raw = data[name]
        try:
            values[name] = str(raw) if f.type == "str" else (int(float(raw)) if f.type == "int" else float(raw))
        except (TypeError, ValueError):
            raise ValueError(f"{path}: field {name} must be a number, got {raw!r}") from None
    profile = Profile(**values)
    if profile.gpu_kv_tokens <= 0:
        raise ValueError(f"{path}: weights leave no device memory for KV ({profile.gpu_kv_tokens} tokens)")
    return profile


def _pairs(new_tokens: int, context_before: int) -> int:
    """(query, key) pairs of `new_tokens` causal queries after `context_before` tokens of context."""
    return new_tokens * context_before + new_tokens * (new_tokens + 1) // 2
