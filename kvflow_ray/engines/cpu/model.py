"""The compute half of the CPU engine: a transformers causal LM that takes past KV as plain tensors.

The KV cache lives outside the model, in paged pools owned by the engine. Each call therefore gets the past KV of
its sequence(s) as ordinary tensors, wraps them in a transformers `DynamicCache` for the duration of one forward,
and hands back only the KV of the tokens it just processed, for the engine to write into its pools.

KV layout at this boundary (engine side): `[n_layers, n_tokens, n_kv_heads, head_dim]`, token-major so that a
paged pool `[n_layers, n_slots, n_kv_heads, head_dim]` can be gathered/scattered with one index along dim 1.
transformers wants `[batch, n_kv_heads, n_tokens, head_dim]` per layer. On the way in, the past is copied once into a
(left-padded) buffer with room for the new tokens, which the attention layers fill in place (`_BufferLayer`); on
the way out, the new tokens' columns are copied into a compact token-major tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from kvflow_ray.engines.cpu.config import ModelConfig

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# sdpa rather than eager: both honour a 2-D padding mask (masking_utils turns it into a 4-D boolean mask), sdpa is
# faster on CPU, and for a single query token it skips the mask entirely when nothing is padded.
_ATTN_IMPLEMENTATION = "sdpa"


def _random_llama(config: ModelConfig, dtype: torch.dtype) -> PreTrainedModel:
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
        attn_implementation=_ATTN_IMPLEMENTATION,
    )
    # Seed, then build in float32 and cast: the bfloat16 model is the rounded float32 one, not a different draw.
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(hf_config).to(dtype)


def _pretrained(path: str, dtype: torch.dtype) -> PreTrainedModel:
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"model path {path!r} is not a local model directory (no config.json there)")
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, attn_implementation=_ATTN_IMPLEMENTATION
        )
    except (OSError, ValueError) as e:  # missing weights, unknown architecture, ...
        raise ValueError(f"cannot load a causal LM from {path!r}: {e}") from e


class CpuModel:
    """A causal LM whose KV cache is passed in and out as plain tensors (see the module docstring for layouts)."""

    def __init__(self, config: ModelConfig, threads: int | None = None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)  # process-wide: torch has a single intra-op pool
        self.config = config
        self.torch_dtype: torch.dtype = _DTYPES[config.dtype]
        if config.path is None:
            hf = _random_llama(config, self.torch_dtype)
        else:
            hf = _pretrained(config.path, self.torch_dtype)
        self.hf: PreTrainedModel = hf.eval().requires_grad_(False)

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

        # `_BufferLayer` stands in for plain DynamicLayers; sliding-window/hybrid/linear layers keep other state.
        probe = DynamicCache(config=hf.config)
        if len(probe.layers) != self.n_layers or any(type(layer) is not DynamicLayer for layer in probe.layers):
            raise ValueError(f"only full-attention models are supported; {type(hf).__name__} has other cache layers")

    def _check_past(self, past: Tensor, what: str) -> None:
        want = (self.n_layers, self.n_kv_heads, self.head_dim)
        if past.dim() != 4 or (past.shape[0], past.shape[2], past.shape[3]) != want:
            raise ValueError(f"{what} must be [n_layers, n_past, n_kv_heads, head_dim] = [{want[0]}, n, *{want[1:]}]")

    def _input_ids(self, tokens: Sequence[int], shape: tuple[int, int]) -> Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long).view(shape)
        # A clear error here instead of an IndexError from deep inside the embedding.
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        return ids

    def _buffer(self, pasts: Sequence[Tensor], n_past: int, n_new: int) -> Tensor:
        """Copy B pasts `[L, n_i, H, D]` into one `[L, B, H, n_past + n_new, D]` buffer, left-padded to `n_past`.

        This is the only copy of the past per call: the new tokens' columns (from `n_past` on) are written in place by
        `_BufferLayer`. Pads must be zeros, not `empty` garbage: the mask gives them zero weight, but a NaN there
        would still leak through the softmax (NaN * 0 = NaN).
        """
        shape = (self.n_layers, len(pasts), self.n_kv_heads, n_past + n_new, self.head_dim)
        buf = torch.empty(shape, dtype=self.torch_dtype)
        for i, past in enumerate(pasts):
            pad = n_past - past.shape[1]
            buf[:, i, :, :pad].zero_()
            buf[:, i, :, pad:n_past] = past.transpose(1, 2)  # [L, n, H, D] -> [L, H, n, D]; casts dtype if needed
        return buf

    def _forward(
        self, ids: Tensor, positions: Tensor, mask: Tensor | None, pasts_k: Sequence[Tensor], pasts_v: Sequence[Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Run the model on `ids` [B, T] after the (left-padded) pasts. Returns (last logits [B, vocab] float32,
        K and V buffers [L, B, H, n_past + T, D] whose last T columns are the new tokens' KV)."""
        n_past, n_new = max(p.shape[1] for p in pasts_k), ids.shape[1]
        buf_k, buf_v = self._buffer(pasts_k, n_past, n_new), self._buffer(pasts_v, n_past, n_new)
        cache = DynamicCache(config=self.hf.config)
        cache.layers = [_BufferLayer(k, v, n_past) for k, v in zip(buf_k, buf_v, strict=True)]
        # logits_to_keep=1: only the last position goes through lm_head (saves a [T, vocab] matmul in prefill).
        out = self.hf(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        return out.logits[:, -1].float(), buf_k, buf_v

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int], past_k: Tensor, past_v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Run the new `tokens` of one sequence whose first `n_past` tokens' KV is `past_k`/`past_v`.

        past_k/past_v: `[n_layers, n_past, n_kv_heads, head_dim]` (n_past may be 0); positions start at n_past.
        Returns (logits of the last token `[vocab]` float32,
                 new_k, new_v `[n_layers, len(tokens), n_kv_heads, head_dim]`).
        """
        self._check_past(past_k, "past_k")
        self._check_past(past_v, "past_v")
        n_past, n_new = past_k.shape[1], len(tokens)
        if n_new == 0:
            raise ValueError("prefill needs at least one new token")
        if n_past + n_new > self.max_context:
            raise ValueError(f"sequence of {n_past + n_new} tokens exceeds max_context={self.max_context}")
        ids = self._input_ids(tokens, (1, n_new))
        positions = torch.arange(n_past, n_past + n_new).view(1, n_new)
        # No mask: with a cache, masking_utils builds the causal mask offset by n_past (or uses sdpa's is_causal when
        # n_past == 0, and none at all for a single token).
        logits, buf_k, buf_v = self._forward(ids, positions, None, [past_k], [past_v])
        # [L, H, T, D] -> [L, T, H, D], copied out so the caller owns a compact tensor and the buffer can be freed.
        new_k = buf_k[:, 0, :, n_past:].transpose(1, 2).contiguous()
        new_v = buf_v[:, 0, :, n_past:].transpose(1, 2).contiguous()
        return logits[0], new_k, new_v

    @torch.inference_mode()
    def decode(
        self, tokens: Sequence[int], past_k: Sequence[Tensor], past_v: Sequence[Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One new token for each of B sequences; sequence i has `n_i` past tokens in `past_k[i]`/`past_v[i]`.

        past_k[i]/past_v[i]: `[n_layers, n_i, n_kv_heads, head_dim]`, the n_i may differ.
        Returns (logits `[B, vocab]` float32, new_k, new_v `[n_layers, B, n_kv_heads, head_dim]`).
        """
        batch = len(tokens)
        if batch == 0 or len(past_k) != batch or len(past_v) != batch:
            raise ValueError("decode needs one token and one past_k/past_v per sequence, at least one sequence")
        for k, v in zip(past_k, past_v, strict=True):
            self._check_past(k, "past_k[i]")
            self._check_past(v, "past_v[i]")
        lengths = [k.shape[1] for k in past_k]
        longest = max(lengths)
        if longest + 1 > self.max_context:
            raise ValueError(f"sequence of {longest + 1} tokens exceeds max_context={self.max_context}")
        ids = self._input_ids(tokens, (batch, 1))
        # Each sequence's own position, not its padded column: RoPE must see what a batch-1 call would.
        positions = torch.tensor(lengths, dtype=torch.long).view(batch, 1)
        # Left padding puts every new token in column `longest`; the 2-D mask hides the pad columns. (An all-True
        # mask, e.g. equal lengths, is detected by masking_utils and dropped again.)
        mask = None
        if batch > 1:
            mask = torch.ones(batch, longest + 1, dtype=torch.bool)
            for i, n in enumerate(lengths):
                mask[i, : longest - n] = False
        logits, buf_k, buf_v = self._forward(ids, positions, mask, past_k, past_v)
        # Column `longest` of every layer: [L, B, H, D]; copied out of the (strided) buffer.
        return logits, buf_k[:, :, :, longest].contiguous(), buf_v[:, :, :, longest].contiguous()


class _BufferLayer(DynamicLayer):
    """A DynamicLayer over a buffer that already holds the past and has room for the new tokens.

    DynamicLayer.update appends with `torch.cat`, i.e. copies the whole past once more per layer per call (measured
    on 2 cores: a B=4 decode at 2k context took 33 ms that way, 15 ms this way). Here `update` writes the new KV
    into the reserved columns instead. `get_seq_length` (read by masking_utils before the layers run) reports the
    past only, as DynamicLayer would, so the mask is sized `n_past + n_new` and the queries are offset by `n_past`.
    """

    def __init__(self, keys: Tensor, values: Tensor, n_past: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)  # sets device and is_initialized
        self.keys, self.values, self.length = keys, values, n_past

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        end = self.length + key_states.shape[-2]
        self.keys[..., self.length : end, :] = key_states
        self.values[..., self.length : end, :] = value_states
        self.length = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def get_seq_length(self) -> int:
        return self.length


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
