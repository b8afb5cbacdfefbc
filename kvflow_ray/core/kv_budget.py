"""Per-request KV budgets for long agent turns (docs/design.md §13): how many private tokens a request
keeps, when it compacts, which queries score its keys, and which keys it keeps.

A request with a budget B holds at most B + Δ tokens of private KV (its uncached prompt part and its
output; never the shared radix prefix). Before it writes a token while holding B + Δ, it compacts:
its keys are scored by the attention that buffered queries pay them, the sinks (its first positions)
and the best-scored keys up to B stay, in position order, and the rest of its slots go back to the
pool. Kept keys keep their logical positions (nothing is re-rotated); tokens after the first dropped
position attended to a reduced context, so only the sequence before it may join the prefix cache.

The scorers, one small class each, by registry (`KV_SCORERS`), say which captured queries score the
keys; the engine holds the tensors (`engines/cpu/kv_budget.py`):
- `agentkv` (AgentKV, arXiv 2609.14872): a FIFO of the last 8 queries per phase (think, act, tool,
  other), scoring against their union; phases come from chat-template markers (`PhaseTracker`);
- `recent` (SnapKV / R-KV): the last 32 queries;
- `h2o` (H2O): attention accumulated by every query since the last re-score (at most `window`),
  added to what each kept key had gathered before;
- `streaming` (StreamingLLM): no queries; the sinks and the most recent keys.

This module is pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from kvflow_ray.core.registry import PolicyContext, Registry

PHASES = ("think", "act", "tool", "other")
MIN_BUDGET = 64  # tokens: a smaller budget leaves the sinks and little else
MAX_KV_BUDGET = 1 << 20
MAX_INTERVAL = 4096


@dataclass(frozen=True)
class KvBudget:
    """`tokens` (B): private KV kept at each compaction; `interval` (Δ): tokens written between
    compactions (so a request holds at most B + Δ); `sinks`: first positions never dropped."""

    tokens: int
    interval: int = 128
    sinks: int = 32

    def __post_init__(self) -> None:
        if (not isinstance(self.tokens, int) or isinstance(self.tokens, bool)
                or not MIN_BUDGET <= self.tokens <= MAX_KV_BUDGET):
            raise ValueError(f"kv_budget must be an integer from {MIN_BUDGET} to {MAX_KV_BUDGET} tokens, "
                             f"got {self.tokens!r}")
        if not 1 <= self.interval <= MAX_INTERVAL:
            raise ValueError(f"kv_budget interval must be in [1, {MAX_INTERVAL}], got {self.interval}")
        if not 0 <= self.sinks < self.tokens:
            raise ValueError(f"kv_budget sinks must be in [0, {self.tokens}), got {self.sinks}")

    @property
    def ceiling(self) -> int:
        """The most private KV a request holds once its prompt is done: B + Δ."""
        return self.tokens + self.interval

    def reserve(self, uncached: int, max_new: int, shared: int = 0) -> int:
        """Device slots a request reserves outside the tree: its `uncached` prompt while it is computed
        (whole, before any compaction), then, once the first `shared` of those tokens joined the tree
        (its agent's fixed prompt), B + Δ at most, never more than its prompt and output together."""
        private = uncached - shared
        return shared + max(private, min(private + max_new, self.ceiling))

    def due(self, private_kv: int, new: int = 1) -> bool:
        """Before writing `new` more tokens' KV while holding `private_kv` private tokens: compact first
        (it would hold more than B + Δ)."""
        return private_kv + new > self.ceiling


def select_kept(scores: Sequence[float], positions: Sequence[int], keep: int, sinks: int) -> list[int]:
    """Indices (ascending) of the private keys to keep: those at positions below `sinks`, then the best
    scored (the later position first among equals) until `keep` are kept."""
    protected = [i for i, p in enumerate(positions) if p < sinks]
    rest = sorted((i for i, p in enumerate(positions) if p >= sinks), key=lambda i: (-scores[i], -positions[i]))
    return sorted(protected[:keep] + rest[:max(0, keep - len(protected))])


class KeyScorer:
    """Which captured queries score a request's keys. `buffer(phase)`: the FIFO a query of that phase
    joins and its length (None: not kept); `accumulates`: each re-score adds to what the kept keys had
    and empties the buffers (H2O); `by_recency`: no queries, the latest keys win (StreamingLLM)."""

    name: ClassVar[str]
    accumulates: ClassVar[bool] = False
    by_recency: ClassVar[bool] = False

    def buffer(self, phase: str) -> tuple[str, int] | None:
        return None

    @property
    def buffered(self) -> int:
        """The most queries it scores with at once (what one re-score costs: this many x private keys)."""
        return 0

    def spec(self) -> str:
        return self.name


class AgentKV(KeyScorer):
    name = "agentkv"

    def __init__(self, context: PolicyContext | None = None, *, per_phase: int = 8) -> None:
        if not 1 <= per_phase <= 256:
            raise ValueError(f"agentkv's per_phase must be in [1, 256], got {per_phase}")
        self.per_phase = per_phase

    def buffer(self, phase: str) -> tuple[str, int] | None:
        return phase, self.per_phase

    @property
    def buffered(self) -> int:
        return self.per_phase * len(PHASES)

    def spec(self) -> str:
        return f"agentkv:per_phase={self.per_phase}"


class _LastQueries(KeyScorer):
    """The last `size` queries, whatever their phase, in one FIFO (`option`: what the spec calls `size`)."""

    option: ClassVar[str]

    def __init__(self, size: int, most: int) -> None:
        if not 1 <= size <= most:
            raise ValueError(f"{self.name}'s {self.option} must be in [1, {most}], got {size}")
        self.size = size

    def buffer(self, phase: str) -> tuple[str, int] | None:
        return "all", self.size

    @property
    def buffered(self) -> int:
        return self.size

    def spec(self) -> str:
        return f"{self.name}:{self.option}={self.size}"


class Recent(_LastQueries):
    name = "recent"
    option = "queries"

    def __init__(self, context: PolicyContext | None = None, *, queries: int = 32) -> None:
        super().__init__(queries, 1024)


class H2O(_LastQueries):
    name = "h2o"
    option = "window"
    accumulates = True

    def __init__(self, context: PolicyContext | None = None, *, window: int = 128) -> None:
        super().__init__(window, MAX_INTERVAL)


class Streaming(KeyScorer):
    name = "streaming"
    by_recency = True


KV_SCORERS: Registry[KeyScorer] = Registry("kv scorer")
KV_SCORERS.register("agentkv", AgentKV)
KV_SCORERS.register("recent", Recent)
KV_SCORERS.register("h2o", H2O)
KV_SCORERS.register("streaming", lambda context=None: Streaming())
# the scorer that kept most on the real model (docs/results/kv-budget.md): `recent`, at every budget measured
DEFAULT_SCORER = "recent"


def parse_scorer(spec: str) -> KeyScorer:
    """`agentkv`, `agentkv:per_phase=8`, `recent:queries=32`, `h2o:window=128`, `streaming`."""
    return KV_SCORERS.parse(spec, example="'agentkv', 'recent:queries=32', 'h2o' or 'streaming'")


# ---------------------------------------------------------------------- phases
# Hermes/Qwen tags (what this project's tool rendering writes too) and the reasoning tag: text after
# an opening marker belongs to its phase until the next marker
TAG_MARKERS: Mapping[str, str] = {
    "<think>": "think", "</think>": "other",
    "<tool_call>": "act", "</tool_call>": "other",
    "<tool_response>": "tool", "</tool_response>": "other",
}
# role headers of the chat formats the engines meet: a turn's role decides its phase
ROLE_HEADERS: Mapping[str, str] = {
    "<|im_start|>": "{role}",  # ChatML (SmolLM2, Qwen)
    "<|start_header_id|>": "{role}<|end_header_id|>",  # Llama 3
    "<|": "{role}|>",  # this project's role-tag format (`tokenizer.format_chat`)
}
ROLE_PHASES: Mapping[str, str] = {"system": "other", "user": "other", "assistant": "other", "tool": "tool",
                                  "ipython": "tool"}


@dataclass(frozen=True)
class PhaseMarkers:
    """Text markers that switch the phase: marker -> phase entered."""

    markers: Mapping[str, str] = field(default_factory=lambda: dict(TAG_MARKERS))

    def __post_init__(self) -> None:
        if not self.markers or len(self.markers) > 64:
            raise ValueError("phase markers: between 1 and 64 markers")
        for marker, phase in self.markers.items():
            if not isinstance(marker, str) or not 0 < len(marker) <= 64 or phase not in PHASES:
                raise ValueError(f"phase marker {marker!r}: a string of 1..64 characters entering one of {PHASES}")

    @classmethod
    def for_template(cls, template: str | None, extra: Mapping[str, str] | None = None) -> PhaseMarkers:
        """The tag markers, plus role headers in the form the chat template writes them (found in its
        source), plus `extra` (markers for a model whose template has others)."""
        markers = dict(TAG_MARKERS)
        for opener, form in ROLE_HEADERS.items():
            if template is None or opener in template:
                for role, phase in ROLE_PHASES.items():
                    markers[opener + form.format(role=role)] = phase
                if template is not None:
                    break  # the template's own format, not the fallbacks after it
        markers.update(extra or {})
        return cls(markers)


class PhaseTracker:
    """The phase of each token of a stream, from the text its tokens decode to: a marker switches the
    phase from the token that completes it on. O(longest marker) per token."""

    def __init__(self, markers: PhaseMarkers, phase: str = "other") -> None:
        self.markers = dict(markers.markers)
        self.longest = max(len(m) for m in self.markers)
        self.phase = phase
        self._tail = ""

    def push(self, text: str) -> str:
        """The phase of a token whose text is `text`."""
        tail = self._tail + text
        hits = [(tail.rfind(m), -len(m), m) for m in self.markers if m in tail[-(len(text) + len(m) - 1):]]
        if hits:  # the marker that ends last (the longest among those ending together) wins
            _at, _neg, marker = max(hits, key=lambda h: (h[0] + len(h[2]), -h[1]))
            self.phase = self.markers[marker]
        self._tail = tail[-(self.longest - 1):] if self.longest > 1 else ""
        return self.phase

    def extend(self, texts: Iterable[str]) -> list[str]:
        return [self.push(t) for t in texts]


__all__ = ["DEFAULT_SCORER", "KV_SCORERS", "MAX_KV_BUDGET", "MIN_BUDGET", "PHASES", "KeyScorer", "KvBudget",
           "PhaseMarkers", "PhaseTracker", "parse_scorer", "select_kept"]
