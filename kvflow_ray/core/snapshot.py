"""`EngineSnapshot`: what every engine reports about its cache and queue, in one typed shape.

The core scheduler builds it (simulator, CPU engine); the SGLang plugin builds it from its scheduler
process; the serving layer's metrics and SGLang's `/metrics` read it. `to_dict()` is the JSON form
engines put in `stats()` (docs/design.md §9); `from_dict` reads it back (the SGLang adapter reads the
plugin's `stats.json`). Counters are cumulative since the engine started.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class EngineSnapshot:
    waiting: int = 0  # requests queued for admission
    running: int = 0  # requests in the running batch
    prompt_tokens: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "cpu": 0, "miss": 0})
    loaded_tokens: int = 0  # host -> device tokens copied (demand loads and prefetches)
    prefetch: dict[str, int] = field(default_factory=lambda: {"issued": 0, "completed": 0, "used": 0, "wasted": 0})
    prefetch_stall_s: float = 0.0  # total time requests waited for their KV to load
    # device copies freed (gpu), of which written back first (written_back) or lost (dropped); host copies freed
    evicted_tokens: dict[str, int] = field(
        default_factory=lambda: {"gpu": 0, "cpu": 0, "written_back": 0, "dropped": 0})
    cache_tokens: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "cpu": 0})
    capacity_tokens: dict[str, int] = field(default_factory=dict)
    held: int = 0  # admission passes that skipped a request whose prefix was loading
    # CPU seconds the engine's own compute threads used (None: the engine does not measure it); the rest
    # of a replica process's CPU is serving overhead
    compute_cpu_s: float | None = None
    # agent sessions in tool pauses (docs/design.md §11): pauses ended, the sum of their prediction
    # errors (|predicted - actual| seconds), prefetches due before / after the client came back, and
    # per tenant the paused history tokens ranked as needed (retained) and held whatever their rank
    # (pinned: Continuum's pins, SGLang's retention)
    sessions: dict[str, Any] = field(default_factory=lambda: {
        "pauses": 0, "abs_error_s": 0.0, "due_early": 0, "due_late": 0,
        "returned": {"ready": 0, "loading": 0, "missed": 0}, "retained_tokens": {}, "pinned_tokens": {}})
    kv_bytes_per_token: float = 0.0  # the engine's KV bytes per token (0: not known), for gauges in bytes
    # reuse of kept outputs beyond the prefix (docs/design.md §12): prompt tokens placed and not
    # recomputed (reused), and (token, layer) pairs the reusing prefills computed against a dense
    # prefill's (layer_tokens / dense_layer_tokens); segments kept and their KV bytes (gauges)
    reuse: dict[str, int] = field(default_factory=lambda: {
        "reused_tokens": 0, "layer_tokens": 0, "dense_layer_tokens": 0, "segments": 0, "segment_kv_bytes": 0})
    # per-request KV budgets (docs/design.md §13): compactions, private tokens they dropped, seconds spent
    kv_budget: dict[str, float] = field(default_factory=lambda: {
        "compactions": 0, "dropped_tokens": 0, "compaction_s": 0.0})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineSnapshot:
        """The fields of `data` this type has (an older writer may lack some: they keep defaults)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
