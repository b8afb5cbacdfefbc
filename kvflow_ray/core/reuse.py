"""Reuse of KV beyond the prefix (docs/design.md §12): which segments a prompt contains, which of their
tokens to recompute, and which segments to keep.

A *segment* is a run of tokens whose KV was computed elsewhere: an agent's output as it decoded it
(after its own prompt, at its own positions), or a document a client registered. When a later prompt
contains it verbatim, past the prompt's cached prefix, an engine may place the stored KV at the new
positions instead of computing it. That KV is approximate: it attended to other tokens than the new
prompt's. A `ReuseMethod` says how to repair it, one small class each, by registry (`REUSE`):

- `exact`: no reuse; every token is computed (the default, and the only exact one);
- `nofix`: the stored KV as it is, at its old positions' rotation (harness only: worse than no cache);
- `position`: K re-rotated to the new positions, nothing recomputed;
- `epic:k=16`: position-corrected, and each segment's first k tokens recomputed in every layer;
- `blend:r=0.15`: CacheBlend (LMCache `lmcache/blend/executor.py`, `CacheBlendImpl`): layer 0 is
  computed for every token, layer 1's fresh K and V replace the stored ones for every token, and the
  queries from layer 1 on are the fresh tokens plus the r share of reused tokens whose layer-1 V
  deviates most from the stored V (mean squared difference over heads and dims); from layer 2 on only
  those tokens' KV is recomputed.

This module is pure: the engine runs the tensors, the method decides. `SegmentBook` keeps the
segments' bookkeeping (which exist, where a prompt contains them, which to drop) for the engine,
which holds their KV; their rank comes from the workflow: the steps until the producer's workflow
next runs an agent (its readers are the agents still to run), and a finished workflow's segments go.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from kvflow_ray.core.policies import StepBook
from kvflow_ray.core.registry import PolicyContext, Registry

EXACT = "exact"


class ReuseMethod:
    """How an engine repairs a reused segment's KV. `rotate`: K is re-rotated to the new positions;
    `fresh_head`: each segment's first tokens computed in every layer; `full_layers`: leading layers
    computed for every token; `check_layer`: the layer whose fresh V picks the tokens recomputed from
    then on (`select`); None: none picked."""

    name: ClassVar[str]
    exact: ClassVar[bool] = False
    rotate: ClassVar[bool] = True
    full_layers: ClassVar[int] = 0
    check_layer: ClassVar[int | None] = None
    ratio: float = 0.0  # the share of reused tokens `select` picks (blend's r)

    def fresh_head(self, length: int) -> int:
        """How many of a segment's first tokens are computed in every layer."""
        return 0

    def select(self, deviations: Sequence[float]) -> list[int]:
        """At `check_layer`: indices of the reused tokens to recompute from here on, by their deviation."""
        return []

    def spec(self) -> str:
        return self.name

    def recomputed_share(self, n_layers: int, segment_tokens: int) -> float:
        """The share of a reused token's (token, layer) pairs that are computed, for segments of
        `segment_tokens` tokens (the simulator's compute model; the CPU engine counts what it computed)."""
        if self.exact:
            return 1.0
        head = min(self.fresh_head(segment_tokens), segment_tokens) / max(1, segment_tokens)
        if self.check_layer is None:
            return head + (1 - head) * self.full_layers / n_layers
        after = max(0, n_layers - self.check_layer)
        return (self.check_layer + self.ratio * after) / n_layers


def _plain(cls: type[ReuseMethod]) -> Callable[..., ReuseMethod]:
    return lambda context=None: cls()


class Exact(ReuseMethod):
    name = EXACT
    exact = True


class NoFix(ReuseMethod):
    name = "nofix"
    rotate = False


class Position(ReuseMethod):
    name = "position"


class Epic(ReuseMethod):
    """EPIC (arXiv 2410.15332) `LegoLink`: each chunk's first k tokens are recomputed, since the
    attention sinks a chunk formed alone are what misleads the tokens after it."""

    name = "epic"

    def __init__(self, context: PolicyContext | None = None, *, k: int = 16) -> None:
        if not 0 <= k <= 1 << 16:
            raise ValueError(f"epic's k must be in [0, 65536], got {k}")
        self.k = k

    def fresh_head(self, length: int) -> int:
        return min(self.k, length)

    def spec(self) -> str:
        return f"epic:k={self.k}"


class Blend(ReuseMethod):
    name = "blend"
    full_layers = 1
    check_layer = 1

    def __init__(self, context: PolicyContext | None = None, *, r: float = 0.15) -> None:
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"blend's r must be in [0, 1], got {r}")
        self.ratio = r

    def select(self, deviations: Sequence[float]) -> list[int]:
        # LMCache: int(valid * ratio) tokens, the largest deviations first
        n = int(len(deviations) * self.ratio + 1e-9)
        return sorted(sorted(range(len(deviations)), key=lambda i: -deviations[i])[:n])

    def spec(self) -> str:
        return f"blend:r={self.ratio:g}"


REUSE: Registry[ReuseMethod] = Registry("reuse method")
REUSE.register(EXACT, _plain(Exact))
REUSE.register("nofix", _plain(NoFix))
REUSE.register("position", _plain(Position))
REUSE.register("epic", Epic)
REUSE.register("blend", Blend)
# what a request may ask for (`nofix` is for the harness: unrepaired KV is worse than none)
SERVED = (EXACT, "position", "epic", "blend")


def parse_reuse(spec: str, *, served: bool = True) -> ReuseMethod:
    """`exact`, `position`, `blend`, `blend:r=0.15`, `epic:k=16` (and `nofix` where not `served`).
    Raises ValueError naming what is wrong."""
    return REUSE.parse(spec, allowed=SERVED if served else None,
                       example="'exact', 'position', 'blend:r=0.15' or 'epic:k=16'")


# ---------------------------------------------------------------------- segments
ANCHOR = 8  # tokens: a prompt is searched for segments by their first tokens
ANCHOR_OFFSETS = 3  # a segment's text re-tokenized may differ in its first tokens: anchors at 0..2
MIN_PLACED = 16  # a shorter match is not worth placing
MAX_DOCUMENTS = 16  # documents one request may mark


@dataclass(eq=False)
class Segment:
    """A run of tokens with stored KV, computed at positions `base`.. (`base + i` for token i)."""

    id: int
    tokens: tuple[int, ...]
    base: int
    namespace: str  # the cache salt of the requests that may reuse it
    workflow: str | None  # the producing workflow instance (None: a client's document)
    agent: str | None
    last_used: float = 0.0


@dataclass(frozen=True)
class Placement:
    """Tokens `lo..hi` of `segment` stand at prompt positions `at..at + hi - lo`."""

    segment: Segment
    lo: int
    hi: int
    at: int

    @property
    def length(self) -> int:
        return self.hi - self.lo


@dataclass
class SegmentBook:
    """The segments an engine holds (their KV lives in the engine), found in prompts by their first
    tokens, ranked by the workflow for dropping. Bounded by `capacity` tokens."""

    capacity: int
    book: StepBook | None = None
    segments: dict[int, Segment] = field(default_factory=dict)
    used: int = 0
    _anchors: dict[tuple[str, tuple[int, ...]], list[tuple[Segment, int]]] = field(default_factory=dict)
    _documents: dict[tuple[str, tuple[int, ...]], Segment] = field(default_factory=dict)
    _next_id: int = 0

    def document(self, tokens: Sequence[int], namespace: str) -> Segment | None:
        """The kept document with exactly these tokens in `namespace`, if any."""
        return self._documents.get((namespace, tuple(tokens)))

    def add(self, tokens: Sequence[int], base: int, namespace: str, workflow: str | None = None,
            agent: str | None = None, now: float = 0.0) -> tuple[Segment | None, list[Segment]]:
        """Keep a segment; returns it (None: too short or too large to keep) and the segments dropped
        to make room (the engine frees their KV)."""
        tokens = tuple(tokens)
        if len(tokens) < MIN_PLACED or len(tokens) > self.capacity:
            return None, []
        dropped = []
        while self.used + len(tokens) > self.capacity:
            victim = max(self.segments.values(), key=self._drop_rank)
            self.remove(victim)
            dropped.append(victim)
        segment = Segment(self._next_id, tokens, base, namespace, workflow, agent, now)
        self._next_id += 1
        self.segments[segment.id] = segment
        self.used += len(tokens)
        if workflow is None:
            self._documents[(namespace, tokens)] = segment
        for offset in range(min(ANCHOR_OFFSETS, len(tokens) - ANCHOR + 1)):
            key = (namespace, tokens[offset:offset + ANCHOR])
            self._anchors.setdefault(key, []).append((segment, offset))
        return segment, dropped

    def remove(self, segment: Segment) -> None:
        if self.segments.pop(segment.id, None) is None:
            return
        self.used -= len(segment.tokens)
        if segment.workflow is None:
            self._documents.pop((segment.namespace, segment.tokens), None)
        for offset in range(min(ANCHOR_OFFSETS, len(segment.tokens) - ANCHOR + 1)):
            key = (segment.namespace, segment.tokens[offset:offset + ANCHOR])
            entries = [e for e in self._anchors.get(key, []) if e[0] is not segment]
            if entries:
                self._anchors[key] = entries
            else:
                self._anchors.pop(key, None)

    def retire(self, workflows: Iterable[str]) -> list[Segment]:
        """Finished workflow instances: their outputs have no reader left."""
        gone = set(workflows)
        dropped = [s for s in self.segments.values() if s.workflow in gone]
        for segment in dropped:
            self.remove(segment)
        return dropped

    def _drop_rank(self, segment: Segment) -> tuple[float, float]:
        """Larger goes first: the workflow whose next agent is furthest away, then the least recently used.
        A segment of a workflow with no agent left to run goes before all."""
        steps = math.inf
        if self.book is not None and segment.workflow is not None:
            agents = list(self.book.agents(segment.workflow))
            steps = min((self.book.steps((segment.workflow, a)) for a in agents), default=math.inf)
        return steps, -segment.last_used

    def find(self, tokens: Sequence[int], start: int, namespace: str, now: float = 0.0) -> list[Placement]:
        """Non-overlapping placements of kept segments in `tokens[start:]`, left to right: at each
        position, the segment anchored there whose match runs longest (never the prompt's last token,
        whose logits the engine needs). O(len(tokens) - start) look-ups."""
        out: list[Placement] = []
        end = len(tokens) - 1
        i = start
        while i + ANCHOR <= end:
            best: Placement | None = None
            for segment, offset in self._anchors.get((namespace, tuple(tokens[i:i + ANCHOR])), ()):
                n = ANCHOR
                limit = min(len(segment.tokens) - offset, end - i)
                while n < limit and segment.tokens[offset + n] == tokens[i + n]:
                    n += 1
                if n >= MIN_PLACED and (best is None or n > best.length):
                    best = Placement(segment, offset, offset + n, i)
            if best is None:
                i += 1
                continue
            best.segment.last_used = now
            out.append(best)
            i += best.length
        return out
