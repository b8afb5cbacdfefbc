"""Reused segments' KV on the CPU engine (docs/design.md §12): kept, re-rotated, and repaired by the
method `core.reuse` names.

`SegmentStore` holds each kept segment's K and V (`[n_layers, n_kv_heads, n, head_dim]`, copied out of
the pool) beside the bookkeeping of `core.reuse.SegmentBook`. `prefill_reusing` computes a prompt
region whose segments' KV is placed instead of computed: it writes their stored KV into the region's
slots (K re-rotated to the new positions with the model's own rotary embedding, in float32), then
runs the decoder layer by layer over only the tokens the method computes, every query attending over
the whole context in the pool (causal by position). Every other token is computed in every layer,
and the region's last token always is: its logits are the answer's first.

The layer loop is the Llama decoder's (`LlamaDecoderLayer`: pre-norm attention with RoPE, pre-norm
MLP, residuals), restricted to a subset of tokens; a model of another shape is refused.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvflow_ray.core.reuse import Placement, ReuseMethod, Segment, SegmentBook
from kvflow_ray.engines.cpu.kv_pool import KVPool
from kvflow_ray.engines.cpu.model import CpuModel

_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def check_reusable(model: CpuModel) -> str | None:
    """Why `model` cannot reuse segments (None: it can): the layer loop below needs a Llama-shaped decoder."""
    inner = getattr(model.hf, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "embed_tokens"):
        return f"{type(model.hf).__name__} has no Llama-style decoder (model.layers, rotary_emb)"
    for layer in layers:
        if not all(hasattr(layer, p) for p in _LAYER_PARTS) or not all(
                hasattr(layer.self_attn, p) for p in _ATTENTION_PARTS):
            return f"{type(layer).__name__} is not a Llama-style decoder layer"
        if hasattr(layer.self_attn, "q_norm"):
            return f"{type(layer).__name__} normalises its queries and keys (not built for reuse)"
    return None


def _rotary(model: CpuModel) -> tuple[Any, Any]:
    """The model's rotary embedding and its `apply_rotary_pos_emb`."""
    module = sys.modules[type(model.hf.model.layers[0].self_attn).__module__]
    return model.hf.model.rotary_emb, module.apply_rotary_pos_emb


def rerotate(model: CpuModel, k: Tensor, old: Tensor, new: Tensor) -> Tensor:
    """K (`[L, H, n, D]`, rotated at positions `old`) rotated at positions `new` instead, in float32:
    the old rotation undone with the very cos/sin that made it, the new one applied as a fresh prefill
    would, so that layer 0's K comes out equal to a fresh prefill's."""
    rotary, apply = _rotary(model)
    x = k.float()
    cos_o, sin_o = rotary(x, old[None])
    cos_n, sin_n = rotary(x, new[None])
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    # apply_rotary_pos_emb(q, k, cos, sin) -> (q', k'): x is passed as both and broadcast over [L, H]
    unrotated = apply(x, x, cos_o, -sin_o)[1] / (scale * scale)
    return apply(unrotated, unrotated, cos_n, sin_n)[1].to(k.dtype)


@dataclass
class ReuseCounts:
    """What one reuse prefill did: prompt tokens placed from segments, how many of those were
    computed in every layer all the same (EPIC's heads, CacheBlend's picks), and (token, layer) pairs
    computed against a dense prefill of the region."""

    reused: int = 0
    recomputed: int = 0
    layer_tokens: int = 0
    dense_layer_tokens: int = 0

    def add(self, other: ReuseCounts) -> None:
        self.reused += other.reused
        self.recomputed += other.recomputed
        self.layer_tokens += other.layer_tokens
        self.dense_layer_tokens += other.dense_layer_tokens


class SegmentStore:
    """Kept segments: the book's bookkeeping and their KV, copied out of the pool."""

    def __init__(self, capacity_tokens: int, book: SegmentBook | None = None) -> None:
        self.book = book if book is not None else SegmentBook(capacity_tokens)
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv.values())

    def keep(self, pool: KVPool, slots: Tensor, tokens: Sequence[int], base: int, namespace: str,
             workflow: str | None = None, agent: str | None = None, now: float = 0.0) -> Segment | None:
        """Keep `tokens`, whose KV lies in `slots` of `pool`, computed at positions `base`.."""
        segment, dropped = self.book.add(tokens, base, namespace, workflow, agent, now)
        self._drop(dropped)
        if segment is not None:
            self.kv[segment.id] = pool.gather(slots)  # a copy: the slots go back to the pool
        return segment

    def retire(self, workflows: Sequence[str]) -> None:
        self._drop(self.book.retire(workflows))

    def _drop(self, segments: list[Segment]) -> None:
        for segment in segments:
            self.kv.pop(segment.id, None)

    def placed_kv(self, placement: Placement) -> tuple[Tensor, Tensor]:
        k, v = self.kv[placement.segment.id]
        return k[:, :, placement.lo:placement.hi], v[:, :, placement.lo:placement.hi]


@torch.inference_mode()
def prefill_reusing(model: CpuModel, pool: KVPool, tokens: Sequence[int], slots: Tensor, start: int,
                    placements: Sequence[Placement], store: SegmentStore, method: ReuseMethod
                    ) -> tuple[Tensor, ReuseCounts]:
    """Compute `tokens[start:]` of a sequence whose context lies in `slots` (one per position; the
    first `start` hold the cached past's KV), placing `placements` (segments inside the region, never
    its last token) by `method`. Returns the last token's logits `[vocab]` float32 and the counts."""
    if method.exact:
        raise ValueError("the exact method reuses nothing: prefill normally")
    n, total = len(tokens) - start, len(tokens)
    if n < 1 or len(slots) != total:
        raise ValueError("prefill_reusing needs at least one new token and one slot per position")
    region = slots[start:]
    reused = torch.zeros(n, dtype=torch.bool)
    for placement in placements:
        lo, hi = placement.at - start, placement.at - start + placement.length
        if lo < 0 or hi >= n:
            raise ValueError("a placement must lie inside the region, before its last token")
        k, v = store.placed_kv(placement)
        if method.rotate:
            old = torch.arange(placement.segment.base + placement.lo, placement.segment.base + placement.hi)
            k = rerotate(model, k, old, torch.arange(placement.at, placement.at + placement.length))
        pool.k[:, :, region[lo:hi]] = k.to(pool.k.dtype)
        pool.v[:, :, region[lo:hi]] = v.to(pool.v.dtype)
        reused[lo + method.fresh_head(placement.length):hi] = True
    counts = ReuseCounts(reused=sum(p.length for p in placements), dense_layer_tokens=n * model.n_layers)

    # the engine's kernels, as its other forwards run (packed linear weights on a CPU)
    with model.linears():
        hf = model.hf
        rotary, apply = _rotary(model)
        ids = torch.as_tensor(list(tokens[start:]), dtype=torch.long)
        positions = torch.arange(start, total)
        # the tokens whose KV this layer computes (every one up to `full_layers`, then the fresh ones and
        # the method's picks), and their hidden states
        active = torch.arange(n) if method.full_layers > 0 else torch.nonzero(~reused).flatten()
        hidden = hf.model.embed_tokens(ids[active])[None]
        # causal by position, [queries, context]: changes only where the queries shrink (`keep`)
        mask = torch.arange(total)[None, :] <= positions[active][:, None]
        for index, layer in enumerate(hf.model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (1, len(active), -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            cos, sin = rotary(x, positions[active][None])
            q, k = apply(q, k, cos, sin)
            keep = None  # positions within `active` whose queries go on (None: all)
            if index == method.check_layer:
                was_reused = reused[active]
                fresh_v = v[0].transpose(0, 1)  # [t, H, D]
                stored_v = pool.v[index][:, region[active]].transpose(0, 1).to(fresh_v.dtype)
                deviation = ((fresh_v - stored_v) ** 2).mean(dim=(1, 2))
                candidates = torch.nonzero(was_reused).flatten()
                picked = candidates[method.select(deviation[candidates].tolist())]
                chosen = ~was_reused
                chosen[picked] = True
                keep = torch.nonzero(chosen).flatten()
            pool.k[index].index_copy_(1, region[active], k[0].to(pool.k.dtype))
            pool.v[index].index_copy_(1, region[active], v[0].to(pool.v.dtype))
            counts.layer_tokens += len(active)
            if keep is not None:
                q, hidden, active, mask = q[:, :, keep], hidden[:, keep], active[keep], mask[keep]
            keys = pool.k[index][:, slots][None].to(q.dtype)
            values = pool.v[index][:, slots][None].to(q.dtype)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, len(active), -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if int(active[-1]) != n - 1:
            raise AssertionError("the region's last token must be computed in every layer")
        computed = torch.zeros(n, dtype=torch.bool)
        computed[active] = True
        counts.recomputed = counts.reused - int((reused & ~computed).sum())  # placed, yet computed in every layer
        logits = hf.lm_head(hf.model.norm(hidden[:, -1:]))
        return logits[0, -1].float(), counts
