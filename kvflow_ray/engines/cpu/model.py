"""The compute half of the CPU engine: a transformers causal LM that attends over the engine's KV pool in place.

The KV cache lives outside the model, in a paged pool owned by the engine (`KVPool`, `[n_layers, n_kv_heads,
n_slots, head_dim]`). A forward gets, per sequence, its new tokens and the pool slot of every
position of its context, the new tokens last. The new tokens' KV is written into their slots as each layer
computes it (`_PoolCache.update`), and each layer attends over the sequence's slots where they lie
(`_pool_attention`): a sequence's slots form a few contiguous runs (the pool allocates runs, `FreeRuns`), and a run
is a view of the pool, so the past is never copied. Decoding sequences that share a long first run (an agent's
cached prompt) score it and weight its values together, so a step reads the shared prefix once per layer. A
prefill chunk attends over its cached past run by run and over itself causally, and merges the parts by their
log-sum-exps. transformers runs everything else (embeddings, RoPE, MLPs, norms): any full-attention model whose
attention goes through `ALL_ATTENTION_FUNCTIONS` works. On a CPU its linear layers run over weights packed
once for oneDNN (`PackedLinears`), for the engine's forwards only.

The model and the device pool live on one torch device (`ModelConfig.device`): the CPU by default, or a
CUDA GPU (docs/gpu.md). Slot indices stay host-side int64 tensors, as the cache keeps them; a forward
moves what it needs. On a GPU a prefill chunk with a cached past gathers the past's runs and attends
once with a bottom-right causal mask (`_gathered_prefill_attention`): one fused kernel, where the CPU
path avoids the copy instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)
from transformers.cache_utils import DynamicLayer
from transformers.utils import logging as hf_logging

from kvflow_ray.engines.cpu.config import ModelConfig
from kvflow_ray.engines.cpu.kv_pool import KVPool, slot_runs
from kvflow_ray.engines.cpu.packed_linears import PackedLinears, packable

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Our attention, registered with transformers: a name it has no mask function for, so it builds no mask either.
ATTENTION = "kvflow_pool"


@dataclass
class _Pages:
    """Where one forward's sequences live in the pool."""

    k: Tensor  # the pool's K, [L, H, S, D]
    v: Tensor
    new_slots: Tensor  # slots of the new tokens, sequence by sequence ([B * T])
    runs: list[list[tuple[int, int]]]  # per sequence: its context (new tokens included) as slot runs, in position order
    past: int  # a prefill's cached context before its new tokens (0 for decodes)
    capture: QueryCapture | None = None  # where each layer's queries and their log-sum-exps go (KV budgets)
    last_only: bool = False  # only the last position's output is read: the last layer computes no other
    write_only: bool = False  # the attention writes the new tokens' KV and returns nothing worth reading
    # decoding without a capture: the sequences that attend to their shared first run together, found once
    # per forward (`sharing_first_run`), not once per layer
    sharing: list[list[int]] = field(default_factory=list)


@dataclass
class QueryCapture:
    """Each layer's queries (after RoPE, `[B, Hq, T, D]`) and the log-sum-exp of their scaled scores over
    the context they attended to (`[B, Hq, T]`), in layer order: what a KV budget's scorer reads
    (`engines/cpu/kv_budget.py`). Capturing costs no extra attention pass."""

    queries: list[Tensor]
    lses: list[Tensor]

    def __init__(self) -> None:
        self.queries, self.lses = [], []

    def stacked(self) -> tuple[Tensor, Tensor]:
        """`[B, T, L, Hq, D]` queries and `[B, T, L, Hq]` log-sum-exps."""
        return torch.stack(self.queries).permute(1, 3, 0, 2, 4), torch.stack(self.lses).permute(1, 3, 0, 2)


class _PoolCache:
    """What transformers' attention layers see as the cache: `update` writes the new tokens' KV into the pool."""

    is_compileable = False

    def __init__(self, pages: _Pages) -> None:
        self.pages = pages

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        p = self.pages
        b, h, t, d = key_states.shape
        p.k[layer_idx].index_copy_(1, p.new_slots, key_states.transpose(0, 1).reshape(h, b * t, d).to(p.k.dtype))
        p.v[layer_idx].index_copy_(1, p.new_slots, value_states.transpose(0, 1).reshape(h, b * t, d).to(p.v.dtype))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.pages.past


def _pool_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """Each sequence's queries ([B, Hq, T, D]) over its context in the pool; returns [B, T, Hq, D]."""
    pages: _Pages = kwargs["kvflow_pages"]
    k, v = pages.k[module.layer_idx], pages.v[module.layer_idx]  # [H, S, D]
    batch, heads, t, dim = query.shape
    if pages.write_only:
        return query.new_zeros(batch, t, heads, dim), None
    out = query.new_empty(batch, t, heads, dim)
    capture = pages.capture
    lses = query.new_empty(batch, heads, t, dtype=torch.float32) if capture is not None else None
    # decoding: every sequence's queries scaled at once (one operator per layer, not one per sequence)
    scaled = query * (scaling if scaling is not None else dim ** -0.5) if t == 1 and capture is None else None
    done: set[int] = set()
    if scaled is not None:
        for members in pages.sharing:
            _shared_runs_attention(scaled, k, v, pages.runs, members, out)
            done.update(members)
    for i, runs in enumerate(pages.runs):
        if i in done:
            continue
        q = query[i]
        if t > 1:  # a prefill chunk
            o, lse = _prefill_attention(q, k, v, runs, pages.past, scaling, with_lse=capture is not None)
            out[i] = o
        elif len(runs) == 1 and capture is None:
            lo, hi = runs[0]
            o = F.scaled_dot_product_attention(q[None], k[None, :, lo:hi], v[None, :, lo:hi], scale=scaling,
                                               enable_gqa=True)
            out[i] = o[0].transpose(0, 1)
            lse = None
        elif scaled is not None:
            out[i, 0] = _runs_attention(scaled[i, :, 0].reshape(k.shape[0], -1, dim), k, v, runs).reshape(heads, dim)
            lse = None
        else:
            out[i, 0], lse = _runs_attention_lse(q[:, 0], k, v, runs, scaling)
            lse = lse[:, None]
        if lses is not None and lse is not None:
            lses[i] = lse
    if capture is not None:
        assert lses is not None
        capture.queries.append(query.detach())
        capture.lses.append(lses)
    return out, None


def _prefill_attention(q: Tensor, k: Tensor, v: Tensor, runs: list[tuple[int, int]], past: int,
                       scaling: float | None, with_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """A chunk's queries ([Hq, T, D]) over its context: the cached past, every key visible, run by run as views;
    then the chunk itself, causal. The parts are merged by their log-sum-exps, so no [T, context] mask is built
    and the past is not copied (the same work as one causal pass over the whole prompt). `with_lse`: also
    each query's log-sum-exp over its context ([Hq, T])."""
    if q.device.type != "cpu":
        return _gathered_prefill_attention(q, k, v, runs, scaling, with_lse)
    past_runs, new_runs = _split_runs(runs, past)
    new_k, new_v = _joined(k, new_runs), _joined(v, new_runs)
    if not past_runs and not with_lse:
        o = F.scaled_dot_product_attention(q[None], new_k[None], new_v[None], is_causal=True, scale=scaling,
                                           enable_gqa=True)
        return o[0].transpose(0, 1), None
    heads, t, dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    folded = q.reshape(1, kv_heads, group * t, dim)  # no mask over the past: a group's queries as more rows
    outs, lses = [], []
    for lo, hi in past_runs:
        o, lse = _flash(folded, k[None, :, lo:hi], v[None, :, lo:hi], scale=scaling)[:2]
        outs.append(o.reshape(heads, t, dim))
        lses.append(lse.reshape(heads, t))
    # the chunk over itself, causal: flash wants as many KV heads as query heads (a copy of the chunk only)
    o, lse = _flash(q[None], new_k.repeat_interleave(group, 0)[None], new_v.repeat_interleave(group, 0)[None],
                    is_causal=True, scale=scaling)[:2]
    outs.append(o[0])
    lses.append(lse[0])
    lse_all = torch.stack(lses)
    if len(outs) == 1:
        return outs[0].transpose(0, 1), lse_all[0].float()
    top = lse_all.amax(0)
    weights = torch.exp(lse_all - top)  # [parts, Hq, T]
    total = weights.sum(0)
    merged = (torch.stack(outs).float() * weights[..., None]).sum(0) / total[..., None]
    return merged.to(q.dtype).transpose(0, 1), (top + torch.log(total)).float() if with_lse else None


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns the log-sum-exp with the output


def _gathered_prefill_attention(q: Tensor, k: Tensor, v: Tensor, runs: list[tuple[int, int]], scaling: float | None,
                                with_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """A chunk's queries ([Hq, T, D]) over its whole context gathered into one [H, n, D] K and V (the
    past, then the chunk), causal aligned at the bottom right: query i sees keys up to n - T + i. Any
    device; what a GPU runs (SDPA picks a fused kernel). `with_lse`: also each query's log-sum-exp,
    computed explicitly (the scores are [Hq, T, n]: KV budgets' capture, not the hot path)."""
    keys, values = _joined(k, runs), _joined(v, runs)
    heads, t, dim = q.shape
    n = keys.shape[1]
    group = heads // keys.shape[0]
    if not with_lse:
        # KV heads repeated for the query heads: the fused kernels a bottom-right causal mask dispatches to
        # take no grouped-query flag (a copy of this layer's context only)
        o = F.scaled_dot_product_attention(q[None], keys.repeat_interleave(group, 0)[None],
                                           values.repeat_interleave(group, 0)[None],
                                           attn_mask=causal_lower_right(t, n), scale=scaling)
        return o[0].transpose(0, 1), None
    scores = torch.matmul(q.float(), keys.float().repeat_interleave(group, 0).transpose(1, 2))
    scores = scores * (scaling if scaling is not None else dim ** -0.5)
    visible = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - t, n, device=q.device)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), values.float().repeat_interleave(group, 0))
    return out.to(q.dtype).transpose(0, 1), lse


def _joined(pool_layer: Tensor, runs: list[tuple[int, int]]) -> Tensor:
    """A layer's K or V ([H, S, D]) over `runs`, in order, as [H, n, D]: a view for one run, a copy for several."""
    if len(runs) == 1:
        return pool_layer[:, runs[0][0]:runs[0][1]]
    return torch.cat([pool_layer[:, lo:hi] for lo, hi in runs], dim=1)


def _split_runs(runs: list[tuple[int, int]], at: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Slot runs in position order, split into those of positions [0, at) and [at, ...)."""
    before, after, pos = [], [], 0
    for lo, hi in runs:
        cut = lo + max(0, min(hi - lo, at - pos))
        if cut > lo:
            before.append((lo, cut))
        if hi > cut:
            after.append((cut, hi))
        pos += hi - lo
    return before, after


def _runs_attention(q: Tensor, k: Tensor, v: Tensor, runs: list[tuple[int, int]]) -> Tensor:
    """Scaled queries grouped by KV head ([H, Hq / H, D]) over several runs of the pool, one softmax
    across them all (torch's fused one), no copy of the keys. What a decode step runs once per
    sequence and layer where a sequence shares a cached prefix (two runs or more): its operator
    count is what it costs."""
    scores = torch.cat(_run_scores(q, k, runs), dim=-1)
    return _weighted_values(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v, runs)


# the shortest shared first run worth scoring once for all its sequences: below it the extra operators per
# sequence cost more than reading the shared keys again (a 2-token shared head measured 2% slower)
SHARED_RUN_TOKENS = 128


def sharing_first_run(runs: list[list[tuple[int, int]]]) -> list[list[int]]:
    """Groups of two or more decoding sequences whose contexts start with the same run of slots, of at
    least `SHARED_RUN_TOKENS` (a cached prefix they share, such as an agent's prompt), and go on past it."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, seq in enumerate(runs):
        if len(seq) > 1 and seq[0][1] - seq[0][0] >= SHARED_RUN_TOKENS:
            groups.setdefault(seq[0], []).append(i)
    return [members for members in groups.values() if len(members) > 1]


def _shared_runs_attention(scaled: Tensor, k: Tensor, v: Tensor, runs: list[list[tuple[int, int]]],
                           members: list[int], out: Tensor) -> None:
    """Decode attention of sequences that share their first run (`members`; `scaled`: the step's scaled
    queries, [B, Hq, 1, D]), cascade style: the shared keys are scored, and their values weighted, once
    for all of them (one matmul each, every member's query heads as rows), so the shared prefix is read
    once per layer, not once per sequence; the rest of each context run by run as `_runs_attention`
    does, with one softmax over each sequence's whole context. Writes `out[i, 0]` for each member."""
    kv_heads, dim = k.shape[0], k.shape[2]
    lo, hi = runs[members[0]][0]
    queries = scaled[members, :, 0].reshape(len(members), kv_heads, -1, dim)  # [m, H, G, D]
    group = queries.shape[2]
    stacked = queries.transpose(0, 1).reshape(kv_heads, len(members) * group, dim)  # [H, m * G, D]
    shared_scores = torch.bmm(stacked, k[:, lo:hi].transpose(1, 2))  # [H, m * G, n]
    shared_probs, rest = [], []
    for j, i in enumerate(members):
        own = runs[i][1:]
        scores = torch.cat([shared_scores[:, j * group:(j + 1) * group], *_run_scores(queries[j], k, own)], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        shared_probs.append(probs[..., :hi - lo])
        rest.append(_weighted_values(probs[..., hi - lo:], v, own))
    shared_out = torch.bmm(torch.cat(shared_probs, dim=1), v[:, lo:hi])  # [H, m * G, D]
    for j, i in enumerate(members):
        out[i, 0] = shared_out[:, j * group:(j + 1) * group].add_(rest[j]).reshape(-1, dim)


def _run_scores(q: Tensor, k: Tensor, runs: list[tuple[int, int]]) -> list[Tensor]:
    """Scaled queries ([H, G, D]) against each run's keys, as views of the pool: one [H, G, n] per run."""
    return [torch.bmm(q, k[:, lo:hi].transpose(1, 2)) for lo, hi in runs]


def _weighted_values(probs: Tensor, v: Tensor, runs: list[tuple[int, int]]) -> Tensor:
    """Attention weights over the runs' keys joined ([H, G, n]) times their values, run by run as
    views of the pool ([H, G, D])."""
    out, start = None, 0
    for lo, hi in runs:
        part = torch.bmm(probs[..., start:start + hi - lo], v[:, lo:hi])
        out = part if out is None else out.add_(part)
        start += hi - lo
    assert out is not None
    return out


def _runs_attention_lse(q: Tensor, k: Tensor, v: Tensor, runs: list[tuple[int, int]],
                        scaling: float | None) -> tuple[Tensor, Tensor]:
    """One query per head ([Hq, D]) over several runs, as `_runs_attention`, with each head's
    log-sum-exp of its scaled scores ([Hq]): what a KV budget's capture reads."""
    kv_heads, dim = k.shape[0], k.shape[2]
    qg = q.reshape(kv_heads, -1, dim)  # grouped-query: each KV head's query heads together
    scores = torch.cat([torch.matmul(qg, k[:, lo:hi].transpose(1, 2)) for lo, hi in runs], dim=-1)
    scaled = scores.float() * (scaling if scaling is not None else dim ** -0.5)
    lse = torch.logsumexp(scaled, dim=-1)
    probs = torch.exp(scaled - lse[..., None]).to(v.dtype)
    return _weighted_values(probs, v, runs).reshape(q.shape), lse.reshape(-1)


AttentionInterface.register(ATTENTION, _pool_attention)


def _last_position_only(layer: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A forward pre-hook on the last decoder layer: where only the last position's output is read (a
    prefill chunk's logits; `_Pages.last_only`), the layer writes every new token's KV but computes its
    attention, output projection and MLP for the last position alone. That is most of a layer's work
    per token (its K and V projections are what the cache needs), so a prefill does 1/n_layers less."""
    pages: _Pages | None = kwargs.get("kvflow_pages")
    hidden: Tensor = args[0] if args else kwargs["hidden_states"]
    t = hidden.shape[1]
    if pages is None or not pages.last_only or t < 2:
        return None
    cos, sin = kwargs["position_embeddings"]
    # the first t - 1 tokens: their K and V into the pool, nothing else read
    head = replace(pages, new_slots=pages.new_slots[:-1], write_only=True)
    layer.self_attn(hidden_states=layer.input_layernorm(hidden[:, :-1]), attention_mask=None,
                    position_embeddings=(cos[:, :-1], sin[:, :-1]), cache=_PoolCache(head), kvflow_pages=head)
    # the last token: the whole layer, over a context whose past now includes the others
    tail = replace(pages, new_slots=pages.new_slots[-1:], past=pages.past + t - 1)
    kwargs = {**kwargs, "hidden_states": hidden[:, -1:], "position_embeddings": (cos[:, -1:], sin[:, -1:]),
              "cache": _PoolCache(tail), "kvflow_pages": tail}
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = kwargs["position_ids"][:, -1:]
    return (), kwargs


def _llama_style_last_layer(hf: PreTrainedModel) -> torch.nn.Module | None:
    """The last decoder layer when it is Llama-style (`input_layernorm`, `self_attn` called with the
    cache and position embeddings; Llama, Qwen, Mistral and SmolLM2 are), else None."""
    layers = getattr(getattr(hf, "model", None), "layers", None)
    if not layers:
        return None
    last = layers[-1]
    return last if hasattr(last, "input_layernorm") and hasattr(last, "self_attn") else None


def _random_llama(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        max_position_embeddings=config.max_context,
        # The ByteTokenizer's specials, so that HF `generate` (used in tests) stops and pads like the engine.
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        attn_implementation="sdpa",
    )
    torch.manual_seed(config.seed)
    if device.type == "cpu":
        # built in float32 and cast: the bfloat16 model is the rounded float32 one, not a different draw
        return LlamaForCausalLM(hf_config).to(dtype)
    # on a GPU, drawn there in its own dtype (an 8B-sized float32 draw on the host takes minutes and 32 GB)
    torch.cuda.manual_seed(config.seed)
    with torch.device(device):
        return LlamaForCausalLM._from_config(hf_config, dtype=dtype)


def resolve_device(name: str) -> torch.device:
    """`ModelConfig.device` as a torch device: "auto" is the first CUDA GPU torch sees, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this torch build sees no CUDA GPU (torch {torch.__version__})")
    return device


def _pretrained(path: str, dtype: torch.dtype) -> PreTrainedModel:
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"model path {path!r} is not a local model directory (no config.json there)")
    # a local load takes a second: no progress bar per replica in the server's log
    hf_logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                    attn_implementation="sdpa")
    except (OSError, ValueError) as e:  # missing weights, unknown architecture, ...
        raise ValueError(f"cannot load a causal LM from {path!r}: {e}") from e


class CpuModel:
    """A causal LM that reads and writes its KV in a `KVPool` (see the module docstring).

    `hf` stays a plain transformers model (sdpa attention; what `generate` runs); the engine's forwards
    switch its attention to the pool's for their duration only."""

    def __init__(self, config: ModelConfig, threads: int | None = None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)  # process-wide: torch has a single intra-op pool
        self.config = config
        self.torch_dtype: torch.dtype = _DTYPES[config.dtype]
        self.device = resolve_device(config.device)
        if config.path is None:
            hf = _random_llama(config, self.torch_dtype, self.device)
        else:
            hf = _pretrained(config.path, self.torch_dtype).to(self.device)
        self.hf: PreTrainedModel = hf.eval().requires_grad_(False)
        self.packed = (PackedLinears(hf) if config.packed_weights and packable(self.device, self.torch_dtype)
                       else None)
        last = _llama_style_last_layer(hf)
        if last is not None:
            last.register_forward_pre_hook(_last_position_only, with_kwargs=True)

        text = hf.config.get_text_config(decoder=True)
        self.n_layers: int = text.num_hidden_layers
        self.n_kv_heads: int = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.vocab_size: int = text.vocab_size
        self.max_context: int = min(config.max_context, getattr(text, "max_position_embeddings", None) or 2**31)
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        self.kv_bytes_per_token: int = self.n_layers * self.n_kv_heads * self.head_dim * 2 * elem
        self.hidden_size: int = text.hidden_size
        self.n_params: int = sum(p.numel() for p in hf.parameters())
        self.weight_bytes: int = sum(p.numel() * p.element_size() for p in hf.parameters())
        # the softmax scale of its attention (what captured log-sum-exps were computed with)
        attention = next((m for m in hf.modules() if hasattr(m, "scaling") and hasattr(m, "layer_idx")), None)
        self.attn_scale: float = float(getattr(attention, "scaling", None) or self.head_dim ** -0.5)

        # sliding-window/hybrid/linear-attention layers keep other state than one K and V per token
        probe = DynamicCache(config=hf.config)
        if len(probe.layers) != self.n_layers or any(type(layer) is not DynamicLayer for layer in probe.layers):
            raise ValueError(f"only full-attention models are supported; {type(hf).__name__} has other cache layers")

    def pool(self, name: str, slots: int) -> KVPool:
        """A KV pool shaped for this model, on its device (what it attends over)."""
        return KVPool(name, slots, self.n_layers, self.n_kv_heads, self.head_dim, self.torch_dtype, self.device)

    def host_pool(self, name: str, slots: int) -> KVPool:
        """A KV pool in RAM for the host tier, pinned when the model is on a GPU (asynchronous copies)."""
        return KVPool(name, slots, self.n_layers, self.n_kv_heads, self.head_dim, self.torch_dtype,
                      pinned=self.device.type == "cuda")

    def _check_pool(self, pool: KVPool) -> None:
        if pool.device != self.device and not (pool.device.type == self.device.type == "cuda"):
            raise ValueError(f"the KV pool is on {pool.device}, the model on {self.device}")
        want = (self.n_layers, self.n_kv_heads, self.head_dim)
        if (pool.k.shape[0], pool.k.shape[1], pool.k.shape[3]) != want:
            raise ValueError(f"the KV pool must be [n_layers, n_kv_heads, slots, head_dim] = [{want[0]}, {want[1]}, *, "
                             f"{want[2]}], got {list(pool.k.shape)}")

    def linears(self) -> AbstractContextManager[None]:
        """For the block, `hf`'s linear layers run the engine's kernels (packed weights where `packed`),
        as every engine forward does; outside, they are stock."""
        return self.packed.active() if self.packed is not None else nullcontext()

    def _input_ids(self, tokens: Sequence[int], shape: tuple[int, int]) -> Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long).view(shape)
        # A clear error here instead of an IndexError from deep inside the embedding.
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        return ids.to(self.device)

    def _forward(self, ids: Tensor, positions: Tensor, pages: _Pages, every: bool = False) -> Tensor:
        """Run `ids` [B, T] at `positions`; their KV lands in the pool. Returns the last logits [B, vocab]
        float32 on the host (`every`: every position's, [B, T, vocab])."""
        if pages.new_slots.device != self.device:
            pages.new_slots = pages.new_slots.to(self.device)
        config = self.hf.config
        before, config._attn_implementation = config._attn_implementation, ATTENTION
        try:
            with self.linears():
                # logits_to_keep=1: only the last position goes through lm_head (no [T, vocab] matmul in prefill)
                out = self.hf(input_ids=ids, position_ids=positions.to(self.device), cache=_PoolCache(pages),
                              use_cache=True, logits_to_keep=0 if every else 1, kvflow_pages=pages)
        finally:
            config._attn_implementation = before
        return (out.logits if every else out.logits[:, -1]).float().cpu()

    @torch.inference_mode()
    def prefill(self, pool: KVPool, tokens: Sequence[int], slots: Tensor, every: bool = False, *,
                start: int | None = None, capture: QueryCapture | None = None) -> Tensor:
        """Run the new `tokens` of one sequence whose context (cached past, then these tokens) lies in `slots`:
        the first `len(slots) - len(tokens)` hold the past's KV, the rest receive the new tokens'. The new
        tokens sit at positions `start`.. (default: right after the past; a compacted past is shorter than
        the positions it covers). Returns the logits of the last token `[vocab]` float32 (`every`: of each
        token, `[T, vocab]`); `capture` receives each layer's queries."""
        self._check_pool(pool)
        n_past, n_new = len(slots) - len(tokens), len(tokens)
        start = n_past if start is None else start
        if n_new == 0:
            raise ValueError("prefill needs at least one new token")
        if n_past < 0 or start < n_past:
            raise ValueError(f"{n_new} new tokens at position {start} need {n_past} past slots at most before them")
        if start + n_new > self.max_context:
            raise ValueError(f"sequence of {start + n_new} tokens exceeds max_context={self.max_context}")
        ids = self._input_ids(tokens, (1, n_new))
        positions = torch.arange(start, start + n_new).view(1, n_new)
        pages = _Pages(pool.k, pool.v, slots[n_past:], [slot_runs(slots)], n_past, capture,
                       last_only=not every and capture is None)
        return self._forward(ids, positions, pages, every)[0]

    @torch.inference_mode()
    def decode(self, pool: KVPool, tokens: Sequence[int], slots: Sequence[Tensor], *,
               positions: Sequence[int] | None = None, capture: QueryCapture | None = None) -> Tensor:
        """One new token for each of B sequences; `slots[i]` holds sequence i's context, its new token's slot last
        (the lengths may differ). The new tokens sit at `positions` (default: each context's length - 1; a
        compacted context is shorter). Returns logits `[B, vocab]` float32; `capture` receives each layer's
        queries."""
        self._check_pool(pool)
        batch = len(tokens)
        if batch == 0 or len(slots) != batch:
            raise ValueError("decode needs one token and one slot list per sequence, at least one sequence")
        lengths = [len(s) for s in slots]
        if min(lengths) < 1:
            raise ValueError("every sequence needs a slot for its new token")
        at = [n - 1 for n in lengths] if positions is None else list(positions)
        if len(at) != batch or any(p < n - 1 for p, n in zip(at, lengths, strict=True)):
            raise ValueError("decode needs one position per sequence, none before its context's end")
        if max(at) >= self.max_context:
            raise ValueError(f"sequence of {max(at) + 1} tokens exceeds max_context={self.max_context}")
        ids = self._input_ids(tokens, (batch, 1))
        # each sequence's own position: RoPE must see what a batch-1 call would
        runs = [slot_runs(s) for s in slots]
        pages = _Pages(pool.k, pool.v, torch.stack([s[-1] for s in slots]), runs, 0, capture,
                       sharing=sharing_first_run(runs) if capture is None else [])
        return self._forward(ids, torch.tensor(at, dtype=torch.long).view(batch, 1), pages)


# Temperatures below this are greedy. Dividing float32 logits by a temperature near zero overflows
# (1e-300 is 0 in float32: logits / T became inf and softmax NaN, and the draw crashed), and long
# before that softmax(logits / T) is one-hot on the largest logit: with T = 1e-6 a logit 1e-4 below
# the top one already has probability e^-100. 1e-6 is SGLang's own cut-off (`_SAMPLING_EPS`, below
# which it sets top_k = 1), so the CPU engine and the SGLang engine agree on which requests are greedy.
GREEDY_TEMPERATURE = 1e-6


def sample(logits: Tensor, temperature: float, generator: torch.Generator | None, top_p: float = 1.0) -> int:
    """Next token from `[vocab]` logits: argmax when temperature < GREEDY_TEMPERATURE (0 = greedy), else a
    draw from softmax(logits / T), restricted to the nucleus when top_p < 1: the smallest set of most
    likely tokens whose probabilities add up to at least top_p (always the top token)."""
    if not temperature >= 0:  # NaN too
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature < GREEDY_TEMPERATURE:
        return int(torch.argmax(logits))
    logits = logits.float()
    # shift first: every scaled logit is <= 0 and the largest exactly 0, so nothing overflows and the
    # softmax's sum is at least 1 (no inf, no NaN) for any temperature
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    if top_p >= 1:
        return int(torch.multinomial(probs, 1, generator=generator))
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # probability of the tokens ranked above
    kept = sorted_probs[before < top_p]  # a prefix of the ranking, never empty (before[0] == 0)
    return int(order[torch.multinomial(kept, 1, generator=generator)])
