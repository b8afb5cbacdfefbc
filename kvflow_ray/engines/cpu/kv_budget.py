"""The tensors of a per-request KV budget (docs/design.md §13; the decisions are `core.kv_budget`'s).

`KeyScores` keeps a request's buffered queries (as its scorer says which) and scores its private keys
by the softmax attention those queries pay them: each query's probability of a key is
exp(q·k × scale − lse), with the log-sum-exp its attention computed over its whole context at the
time (`model.QueryCapture`), so a re-score reads only the private keys: O(buffered queries × private
tokens) per layer. A query never scores a key after its own position.

`compact` keeps the chosen keys: their KV moves to the front of the request's own slots in position
order (one gather and one scatter), the slots past B + Δ go back to the pool, and the logical
positions stay with the keys (RoPE already rotated them; nothing is re-rotated).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvflow_ray.core.kv_budget import KeyScorer, KvBudget, PhaseTracker, select_kept
from kvflow_ray.engines.cpu.kv_pool import KVPool

Query = tuple[int, Tensor, Tensor]  # (position, queries [L, Hq, D], log-sum-exps [L, Hq])


class KeyScores:
    """One request's buffered queries and (H2O) accumulated scores."""

    def __init__(self, scorer: KeyScorer, scale: float) -> None:
        self.scorer = scorer
        self.scale = scale
        self.buffers: dict[str, deque[Query]] = {}
        self.accumulated: Tensor | None = None  # per private key, in order (scorers that accumulate)

    @property
    def wants_queries(self) -> bool:
        return not self.scorer.by_recency

    def observe(self, queries: Tensor, lses: Tensor, positions: Sequence[int], phases: Sequence[str]) -> None:
        """Tokens at `positions` were computed: their queries `[T, L, Hq, D]`, log-sum-exps `[T, L, Hq]`."""
        chosen: dict[str, tuple[int, list[int]]] = {}
        for t, phase in enumerate(phases):
            where = self.scorer.buffer(phase)
            if where is not None:
                chosen.setdefault(where[0], (where[1], []))[1].append(t)
        for name, (size, rows) in chosen.items():
            buffer = self.buffers.setdefault(name, deque(maxlen=size))
            for t in rows[-size:]:  # copies: the whole capture is not kept alive by a view
                buffer.append((positions[t], queries[t].float().clone(), lses[t].float().clone()))

    def scores(self, pool: KVPool, slots: Tensor, positions: Tensor) -> Tensor:
        """A score per private key (`slots`, at `positions`), higher kept first."""
        if self.scorer.by_recency:
            return positions.float()
        queries = [q for buffer in self.buffers.values() for q in buffer]
        if not self.scorer.accumulates:  # no query yet: the latest keys win
            return attention_paid(pool, slots, positions, queries, self.scale) if queries else positions.float()
        fresh = attention_paid(pool, slots, positions, queries, self.scale) if queries else torch.zeros(len(slots))
        self.buffers.clear()  # H2O: each query's attention counts once
        before = self.accumulated if self.accumulated is not None else torch.zeros(0)
        self.accumulated = fresh + torch.cat([before, torch.zeros(len(slots) - len(before))])
        return self.accumulated

    def kept(self, keep: Tensor) -> None:
        if self.accumulated is not None:
            self.accumulated = self.accumulated[keep]


def attention_paid(pool: KVPool, slots: Tensor, positions: Tensor, queries: Sequence[Query], scale: float) -> Tensor:
    """Per key (`slots`, at `positions`): the softmax attention the `queries` paid it, averaged over the
    queries, layers and heads (a query pays nothing to a key after its own position)."""
    q = torch.stack([entry[1] for entry in queries])  # [m, L, Hq, D]
    lse = torch.stack([entry[2] for entry in queries])  # [m, L, Hq]
    visible = torch.tensor([entry[0] for entry in queries])[:, None] >= positions[None, :]  # [m, n]
    m, layers, heads, dim = q.shape
    kv_heads = pool.k.shape[1]
    group = heads // kv_heads
    total = torch.zeros(len(slots))
    for layer in range(layers):
        keys = pool.k[layer].index_select(1, slots).float()  # [Hkv, n, D]
        qg = q[:, layer].reshape(m, kv_heads, group, dim).permute(1, 2, 0, 3)  # [Hkv, g, m, D]
        logits = torch.matmul(qg, keys[:, None].transpose(-1, -2)) * scale  # [Hkv, g, m, n]
        offsets = lse[:, layer].reshape(m, kv_heads, group).permute(1, 2, 0)[..., None]
        probs = torch.exp(logits - offsets) * visible
        total += probs.sum(dim=(0, 1, 2))
    return total / (m * layers * heads)


@dataclass(eq=False)
class BudgetedKV:
    """A budgeted request's private KV: the logical position of each private entry (entry i lives in the
    request's own slot i), what scores them, the phase of its stream, and what compaction dropped."""

    budget: KvBudget
    scores: KeyScores
    phases: PhaseTracker
    positions: list[int] = field(default_factory=list)
    first_dropped: int = -1  # the lowest position dropped (-1: none): the sequence before it is exact

    @property
    def wants_queries(self) -> bool:
        return self.scores.wants_queries

    def observe(self, queries: Tensor | None, lses: Tensor | None, positions: Sequence[int],
                texts: Sequence[str]) -> None:
        """Tokens whose texts are `texts` were computed at `positions`: private entries now; their
        queries `[T, L, Hq, D]` and log-sum-exps `[T, L, Hq]` (None: not captured) go to the scorer."""
        self.positions.extend(positions)
        phases = self.phases.extend(texts)
        if queries is not None and lses is not None:
            self.scores.observe(queries, lses, positions, phases)


def compact(pool: KVPool, own: Tensor, kv: BudgetedKV) -> tuple[Tensor, Tensor]:
    """Keep B of the request's private entries (`own[:len(kv.positions)]`); returns (the own slots it
    keeps: B kept + Δ free, the slots it gives back). Afterwards entry i still lives in `own[i]`."""
    budget = kv.budget
    n = len(kv.positions)
    positions = torch.tensor(kv.positions)
    scores = kv.scores.scores(pool, own[:n], positions)
    keep_list = select_kept(scores.tolist(), kv.positions, budget.tokens, budget.sinks)
    keep = torch.tensor(keep_list, dtype=torch.int64)
    dropped = torch.ones(n, dtype=torch.bool)
    dropped[keep] = False
    first = int(positions[dropped].min()) if bool(dropped.any()) else -1
    if first >= 0:
        kv.first_dropped = first if kv.first_dropped < 0 else min(kv.first_dropped, first)
    # entries before the first dropped one are in place already; the rest move down (a copy first:
    # sources and destinations overlap)
    start = int(dropped.nonzero()[0]) if first >= 0 else len(keep_list)
    if start < len(keep_list):
        k, v = pool.gather(own[keep[start:]])
        dst = own[start:len(keep_list)]
        pool.k.index_copy_(2, dst, k)
        pool.v.index_copy_(2, dst, v)
    kv.positions = [kv.positions[i] for i in keep_list]
    kv.scores.kept(keep)
    held = own[:budget.ceiling]
    return held, own[budget.ceiling:]
