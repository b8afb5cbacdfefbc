"""Configuration of the CPU engine and its model: plain dataclasses, importable without torch (the
CLI builds its `--help` from these defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow_ray.core.kv_budget import DEFAULT_SCORER

DTYPES = ("float32", "bfloat16")
DEVICES = "auto, cpu, cuda or cuda:N"
DEFAULT_PROFILE = "cpu-reference"  # the simulator profile `bench calibrate` writes unless named otherwise

# The random models by name: architecture fields over ModelConfig's defaults. `random-8b` is shaped like
# Llama-3.1-8B (32 layers, hidden 4,096, 32 query and 8 KV heads, MLP 14,336, bfloat16), so that compute,
# KV bytes per token (128 KiB) and the host link keep the paper's proportions on a GPU; its vocabulary
# stays the byte tokenizer's (only the last position goes through lm_head). No weights are downloaded.
RANDOM_SHAPES: dict[str, dict[str, int | str]] = {
    "random": {},
    "random-8b": dict(n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                      max_context=16384, dtype="bfloat16"),
}


@dataclass(frozen=True)
class ModelConfig:
    """What to run. With `path` set, the architecture fields are ignored and read from the checkpoint."""

    n_layers: int = 4
    hidden_size: int = 512
    n_heads: int = 8
    n_kv_heads: int = 2
    intermediate_size: int = 1376  # Llama's 8/3 * hidden, rounded up to a multiple of 32
    vocab_size: int = 260  # 256 bytes + 4 specials of the ByteTokenizer
    max_context: int = 4096
    dtype: str = "float32"  # "float32" | "bfloat16"
    seed: int = 0
    path: str | None = None  # local HF model directory; None = random weights built from the fields above
    name: str | None = None  # what requests call it (default: the path, or the random model's name)
    # where the model and the device KV pool live: "auto" is cuda when torch sees a GPU, else cpu
    # (the host pool is RAM either way, pinned on a GPU; docs/gpu.md)
    device: str = "auto"
    # on a CPU, the engine's forwards run the linear layers over weights packed once for oneDNN's matmul
    # (engines/cpu/packed_linears.py): faster, at the cost of one more copy of those weights in RAM
    packed_weights: bool = True

    @classmethod
    def named(cls, model: str, **fields: object) -> ModelConfig:
        """The config of model `model` (a random model's shape, `RANDOM_SHAPES`, else the defaults)
        with `fields` over it (a None dtype keeps the model's own)."""
        given = {key: value for key, value in fields.items() if not (key == "dtype" and value is None)}
        return cls(**{**RANDOM_SHAPES.get(model, {}), **given})  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.n_heads % self.n_kv_heads or self.hidden_size % self.n_heads:
            raise ValueError("hidden_size must divide by n_heads, and n_heads by n_kv_heads")
        if self.max_context < 1:
            raise ValueError(f"max_context must be positive, got {self.max_context}")


def check_device(device: str) -> None:
    """A ValueError unless `device` names a device kind the engine runs on (checked without torch)."""
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"device must be {DEVICES}, got {device[:32]!r}")


@dataclass
class CpuEngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    policy: str = "kvflow"
    # Device pool: 12,288 tokens (48 MiB of float32 KV for the default model). Deliberately small, so
    # that the default 10-agent workflow (10 x 2,048-token fixed prompts) does not fit on the device
    # tier, as in the paper (an A10G holds ~4.8 of its ten 8,192-token prompts).
    device_kv_tokens: int = 12_288
    host_kv_tokens: int = 65_536  # host tier: ~5x the device pool
    # Copies between the pools are paced to this bandwidth (None: as fast as memcpy). See
    # docs/cpu-engine.md: the default keeps the cost of reloading a prompt relative to recomputing it
    # close to the paper's A10G testbed, where that ratio decides what each policy gains. Never paced
    # on a GPU: the link is the real one there.
    link_gbps: float | None = 0.1
    chunk_tokens: int = 1024  # chunked prefill: at most this many prompt tokens per forward step
    # ... while a request decodes; while none does, at most this many (None: `chunk_tokens` always).
    # A chunk holds back the decodes, not a lone prompt, which then saves a pass over the weights per
    # chunk; the bound keeps arrivals' admission (and their host loads) within a few seconds.
    idle_chunk_tokens: int | None = 4096
    max_running: int = 16  # requests in the running batch
    horizon: int = 1  # prefetch agents at most this many steps ahead
    max_inflight: int = 4  # concurrent prefetch loads
    threads: int | None = None  # torch.set_num_threads; None keeps torch's default
    # kept segments (agents' outputs reused beyond the prefix, docs/design.md §12): at most this many
    # tokens of KV, held outside the pools (a request asking for reuse opts its output in)
    segment_kv_tokens: int = 16_384
    session_retain_tokens: int | None = None  # per tenant: paused session history ranked as needed (None: unbounded)
    # KV budgets (docs/design.md §13): each request's private KV capped at this many tokens (None: off;
    # a request's `kv_budget` sets its own), compacted every `kv_interval` tokens past it, the first
    # `kv_sinks` positions always kept, keys scored by `kv_scorer` (`core.kv_budget.KV_SCORERS`)
    kv_budget: int | None = None
    kv_interval: int = 128
    kv_sinks: int = 32
    kv_scorer: str = DEFAULT_SCORER
    kv_phase_markers: dict[str, str] | None = None  # marker -> phase, added to the template's (think/act/tool/other)
