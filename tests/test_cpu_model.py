"""The CPU engine's compute half: KV read and written in a pool, and the result equals a model that saw everything at
once."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvflow_ray.engines.cpu.model as model_module  # noqa: E402
from kvflow_ray.engines.cpu.kv_pool import KVPool  # noqa: E402
from kvflow_ray.engines.cpu.model import CpuModel, ModelConfig, sample  # noqa: E402
from kvflow_ray.engines.cpu.packed_linears import packable  # noqa: E402
from kvflow_ray.engines.tokenizer import ByteTokenizer, HFTokenizer, format_chat, load_tokenizer  # noqa: E402

# float32 differences between mathematically equal computations (different matmul shapes, cat orders) are ~1e-6.
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def model() -> CpuModel:
    return CpuModel(ModelConfig())


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _pool(m: CpuModel, slots: int = 8192) -> KVPool:
    return m.pool("test", slots)


def _run(m: CpuModel, pool: KVPool, tokens: list[int], past: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill `tokens` after the context in `past` slots; returns (last logits, the context's slots)."""
    slots = pool.alloc(len(tokens)) if past is None else torch.cat([past, pool.alloc(len(tokens))])
    return m.prefill(pool, tokens, slots), slots


def test_interface(model: CpuModel) -> None:
    assert (model.n_layers, model.n_kv_heads, model.head_dim) == (4, 2, 64)
    assert (model.vocab_size, model.max_context, model.torch_dtype) == (260, 4096, torch.float32)
    assert model.kv_bytes_per_token == 4 * 2 * 64 * 2 * 4
    pool = _pool(model)
    logits, slots = _run(model, pool, _tokens(7, 0))
    assert logits.shape == (260,) and logits.dtype == torch.float32
    k, v = pool.gather(slots)
    assert k.shape == v.shape == (4, 2, 7, 64) and bool(k.abs().sum() > 0) and bool(v.abs().sum() > 0)


def _scattered(pool: KVPool, n: int) -> torch.Tensor:
    """`n` slots in several runs, out of address order (as a cached prefix, a load and a private part are)."""
    a, gap, b = pool.alloc(n // 2), pool.alloc(3), pool.alloc(n - n // 2)
    pool.free(gap)
    return torch.cat([b, a])


@pytest.mark.parametrize("split", [1, 17, 39])
def test_prefix_reuse_is_exact(model: CpuModel, split: int) -> None:
    tokens = _tokens(40, 1)
    pool = _pool(model)
    full_logits, full_slots = _run(model, pool, tokens)
    full_k, full_v = pool.gather(full_slots)
    slots = _scattered(pool, 40)
    model.prefill(pool, tokens[:split], slots[:split])
    logits = model.prefill(pool, tokens[split:], slots)

    torch.testing.assert_close(logits, full_logits, **TOL)
    assert sample(logits, 0.0, None) == sample(full_logits, 0.0, None)
    # Every position's KV is the KV the full pass computed for it (RoPE offsets included).
    k, v = pool.gather(slots)
    torch.testing.assert_close(k, full_k, **TOL)
    torch.testing.assert_close(v, full_v, **TOL)


@pytest.mark.parametrize("split", [0, 23])
def test_a_prefill_reading_its_last_logits_skips_the_last_layer_for_the_rest_exactly(model: CpuModel,
                                                                                  split: int) -> None:
    """Where only the last position's logits are read, the last layer computes its attention and MLP
    for that position alone (`model._last_position_only`); every position's KV and the last logits
    are what a pass computing every position (`every=True`) gives, over a cached past or none."""
    tokens = _tokens(50, 3)
    skipped, full = _pool(model), _pool(model)
    slots = _scattered(skipped, 50)
    if split:
        model.prefill(skipped, tokens[:split], slots[:split])
        model.prefill(full, tokens[:split], slots[:split], every=True)
    widths: list[int] = []  # positions the last layer's MLP computes, call by call
    handle = model.hf.model.layers[-1].mlp.register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[1]))
    try:
        logits = model.prefill(skipped, tokens[split:], slots)
        every = model.prefill(full, tokens[split:], slots, every=True)
    finally:
        handle.remove()
    assert widths == [1, 50 - split] and every.shape[0] == 50 - split
    torch.testing.assert_close(logits, every[-1], **TOL)
    for mine, theirs in zip(skipped.gather(slots), full.gather(slots), strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)


def test_batched_decode_equals_separate_calls(model: CpuModel) -> None:
    """Sequences of different lengths, one in one run of slots and others in several, decode together as alone."""
    seqs = [_tokens(n, 10 + n) for n in (5, 23, 11)]
    pool = _pool(model)
    contexts = [pool.alloc(5), _scattered(pool, 23), _scattered(pool, 11)]
    for s, ctx in zip(seqs, contexts, strict=True):
        model.prefill(pool, s[:-1], ctx[:-1])
    logits = model.decode(pool, [s[-1] for s in seqs], contexts)
    assert logits.shape == (3, 260)
    for i, (s, ctx) in enumerate(zip(seqs, contexts, strict=True)):
        one_logits = model.decode(pool, [s[-1]], [ctx])
        torch.testing.assert_close(logits[i], one_logits[0], **TOL)
        assert int(logits[i].argmax()) == int(one_logits[0].argmax())
        # ... and both equal the last position of a prefill of the whole sequence, KV included.
        full_logits, full_slots = _run(model, pool, s)
        torch.testing.assert_close(logits[i], full_logits, **TOL)
        torch.testing.assert_close(pool.gather(ctx)[0], pool.gather(full_slots)[0], **TOL)


def test_sequences_sharing_a_cached_prefix_decode_together_as_alone(model: CpuModel,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences whose contexts start with the same cached prefix (its slots shared, in the pool
    once), then go on in one run or several, and one that shares nothing: decoding them together
    scores and weights the shared prefix once for all three (`model._shared_runs_attention`) and gives
    each the logits it gets alone and at the end of a prefill of its whole sequence."""
    prefix = _tokens(model_module.SHARED_RUN_TOKENS + 2, 1)
    pool = _pool(model)
    shared = pool.alloc(len(prefix))
    pool.alloc(1)  # held: no sequence's own slots continue the prefix's run
    model.prefill(pool, prefix, shared)
    tails = [_tokens(n, 20 + n) for n in (6, 17, 4)]
    contexts = [torch.cat([shared, pool.alloc(6)]), torch.cat([shared, _scattered(pool, 17)]),
                torch.cat([shared, pool.alloc(4)])]
    alone = _tokens(12, 3)
    contexts.append(pool.alloc(12))
    seqs = [prefix + tail for tail in tails] + [alone]
    for seq, ctx in zip(seqs, contexts, strict=True):
        past = len(prefix) if seq is not alone else 0
        model.prefill(pool, seq[past:-1], ctx[:-1])
    groups: list[list[int]] = []  # the sequences each layer scored together over the shared prefix
    original = model_module._shared_runs_attention

    def recording(scaled: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list, members: list[int],
                  out: torch.Tensor) -> None:
        groups.append(members)
        original(scaled, k, v, runs, members, out)

    monkeypatch.setattr(model_module, "_shared_runs_attention", recording)
    logits = model.decode(pool, [seq[-1] for seq in seqs], contexts)
    monkeypatch.undo()
    assert groups == [[0, 1, 2]] * model.n_layers
    for i, (seq, ctx) in enumerate(zip(seqs, contexts, strict=True)):
        torch.testing.assert_close(logits[i], model.decode(pool, [seq[-1]], [ctx])[0], **TOL)
        full_logits, _slots = _run(model, _pool(model), seq)
        torch.testing.assert_close(logits[i], full_logits, **TOL)


def test_a_short_shared_head_is_not_scored_together() -> None:
    """Below `SHARED_RUN_TOKENS` a shared first run (a chat template's few tokens) is left to each
    sequence's own pass; so are sequences that share nothing or have no run past the shared one."""
    n = model_module.SHARED_RUN_TOKENS
    long_head, short_head = (0, n), (n, n + 2)
    runs = [[long_head, (500, 510)], [long_head, (600, 605), (700, 702)], [long_head],
            [short_head, (800, 810)], [short_head, (900, 910)], [(1000, 1100)], [long_head, (1200, 1201)]]
    assert model_module.sharing_first_run(runs) == [[0, 1, 6]]


def test_attention_over_runs_with_and_without_its_log_sum_exp() -> None:
    """A decode query over several runs of the pool: the fused-softmax path (decoding) and the
    log-sum-exp path (a KV budget's capture) give the output of attention over the runs' keys
    joined, and the log-sum-exp is that of the scaled scores."""
    from kvflow_ray.engines.cpu.model import _runs_attention, _runs_attention_lse

    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 64, 8, generator=gen), torch.randn(2, 64, 8, generator=gen)  # [KV heads, slots, D]
    q = torch.randn(6, 8, generator=gen)  # three query heads per KV head
    runs = [(40, 43), (5, 30), (50, 51)]
    keys = torch.cat([k[:, lo:hi] for lo, hi in runs], 1).repeat_interleave(3, 0)
    values = torch.cat([v[:, lo:hi] for lo, hi in runs], 1).repeat_interleave(3, 0)
    scores = torch.einsum("hd,hnd->hn", q, keys) * 0.3
    want = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), values)
    torch.testing.assert_close(_runs_attention((q * 0.3).reshape(2, 3, 8), k, v, runs).reshape(6, 8), want, **TOL)
    exact, lse = _runs_attention_lse(q, k, v, runs, 0.3)
    torch.testing.assert_close(exact, want, **TOL)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **TOL)


def test_greedy_generation_matches_hf_generate(model: CpuModel) -> None:
    prompt = ByteTokenizer().encode("Hello, KV world")
    n_new = 16
    expected = model.hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False)[0, len(prompt) :]

    pool = _pool(model)
    logits, ctx = _run(model, pool, prompt)
    generated = []
    while True:
        token = sample(logits, 0.0, None)
        generated.append(token)
        if len(generated) == n_new or token == ByteTokenizer.EOS:  # generate stops at eos too
            break
        ctx = torch.cat([ctx, pool.alloc(1)])
        logits = model.decode(pool, [token], [ctx])[0]
    assert generated == expected.tolist()


def test_the_engine_runs_packed_linear_weights_and_leaves_the_model_stock(model: CpuModel) -> None:
    """On a CPU the engine's forwards compute every linear layer over its weight packed for oneDNN; the
    model's other callers (`generate`) keep `nn.Linear`'s forward, after a block that failed too."""
    if not packable(model.device, model.torch_dtype):
        pytest.skip("oneDNN does not run here")
    linears = [m for m in model.hf.modules() if type(m) is torch.nn.Linear]
    assert model.packed is not None and len(model.packed) == len(linears) == 4 * 7 + 1  # lm_head too
    x = torch.randn(3, linears[0].in_features)
    stock = linears[0](x)
    with model.linears():
        assert all("forward" in vars(m) for m in linears)
        packed = linears[0](x)
    assert not any("forward" in vars(m) for m in linears)
    torch.testing.assert_close(packed, stock, **TOL)
    with model.linears():
        with model.linears():
            pass
        assert all("forward" in vars(m) for m in linears)  # an inner block leaves them packed
    with pytest.raises(RuntimeError, match="inside"), model.linears():
        raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in linears)

    unpacked = CpuModel(ModelConfig(packed_weights=False))
    assert unpacked.packed is None
    tokens = _tokens(40, 5)
    logits = [_run(m, _pool(m), tokens)[0] for m in (model, unpacked)]
    torch.testing.assert_close(logits[0], logits[1], **TOL)


def test_bfloat16_builds_and_runs(model: CpuModel) -> None:
    bf16 = CpuModel(ModelConfig(dtype="bfloat16"))
    assert bf16.torch_dtype == torch.bfloat16 and bf16.kv_bytes_per_token == model.kv_bytes_per_token // 2
    tokens = _tokens(12, 3)
    pool = _pool(bf16)
    assert pool.k.dtype == torch.bfloat16
    logits, ctx = _run(bf16, pool, tokens[:-1])
    assert logits.dtype == torch.float32
    short = torch.cat([ctx[:4], pool.alloc(1)])
    ctx = torch.cat([ctx, pool.alloc(1)])
    step_logits = bf16.decode(pool, [tokens[-1], tokens[0]], [ctx, short])
    assert step_logits.shape == (2, 260) and torch.isfinite(step_logits).all()
    # Same seed, weights rounded from the float32 draw: close to the float32 model, not a different network.
    ref = _run(model, _pool(model), tokens)[0]
    assert torch.allclose(step_logits[0], ref, atol=0.1)


def test_unknown_model_path_is_a_value_error(tmp_path) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        CpuModel(ModelConfig(path=missing))
    with pytest.raises(ValueError, match="no-such-model"):
        load_tokenizer(missing)


def test_over_long_sequence_is_a_value_error(model: CpuModel) -> None:
    pool = _pool(model, 8200)
    with pytest.raises(ValueError, match="max_context"):
        model.prefill(pool, [1] * 4097, pool.alloc(4097))
    with pytest.raises(ValueError, match="max_context"):
        model.prefill(pool, [1] * 7, torch.arange(4097))
    with pytest.raises(ValueError, match="max_context"):
        model.decode(pool, [1, 2], [torch.arange(3), torch.arange(4097)])


def test_bad_inputs_are_value_errors(model: CpuModel) -> None:
    pool = _pool(model)
    with pytest.raises(ValueError, match="token ids"):
        model.prefill(pool, [260], pool.alloc(1))
    with pytest.raises(ValueError, match="KV pool"):
        model.prefill(KVPool("odd", 16, 4, 8, 64, torch.float32), [1], torch.arange(1))
    with pytest.raises(ValueError, match="slots"):
        model.prefill(pool, [1, 2], torch.arange(1))
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="float16")


def test_sample() -> None:
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample(logits, 0.0, None) == 1
    draws = [sample(logits, 1.0, torch.Generator().manual_seed(s)) for s in range(50)]
    assert set(draws) <= {0, 1, 2, 3} and len(set(draws)) > 1
    assert draws == [sample(logits, 1.0, torch.Generator().manual_seed(s)) for s in range(50)]


def test_top_p_draws_from_the_smallest_set_reaching_it() -> None:
    logits = torch.log(torch.tensor([0.2, 0.5, 0.1, 0.05, 0.15]))  # ranking: 1, 0, 4, 2, 3

    def drawn(top_p: float) -> set[int]:
        return {sample(logits, 1.0, torch.Generator().manual_seed(s), top_p) for s in range(300)}

    assert drawn(1.0) == {0, 1, 2, 3, 4}
    assert drawn(0.9) == {0, 1, 4, 2}  # 0.5 + 0.2 + 0.15 = 0.85 < 0.9: the fourth is needed
    assert drawn(0.6) == {1, 0}  # 0.5 alone does not reach 0.6
    assert drawn(0.45) == {1}  # the top token alone reaches it
    assert drawn(1e-9) == {1}  # a tiny top_p is greedy
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, 1.0, None, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, 1.0, None, 1.5)


def test_tiny_temperatures_are_greedy_and_sampling_never_overflows() -> None:
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    for temperature in (1e-300, 5e-324, 1e-7):  # logits / T overflowed to inf -> softmax NaN -> crash
        assert sample(logits, temperature, torch.Generator().manual_seed(0)) == 1
    huge = torch.tensor([-3e38, 3e38, 0.0, 1e38])  # scaled naively, these overflow at any T < 1
    assert {sample(huge, 1e-3, torch.Generator().manual_seed(s)) for s in range(20)} == {1}
    assert {sample(huge, 1e-3, torch.Generator().manual_seed(s), 0.5) for s in range(20)} == {1}
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, float("nan"), None)


def test_byte_tokenizer_round_trip() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 260
    text = "héllo wörld — 你好, κόσμε 🙂\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([tok.BOS, *ids, tok.EOS, tok.PAD]) == text  # specials are skipped
    assert tok.decode(tok.encode("你")[:2]) == "\ufffd"  # a cut-off character does not raise


def test_chat_template() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = ByteTokenizer().apply_chat_template(messages)
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    with pytest.raises(ValueError, match="role"):
        format_chat([{"role": "robot", "content": "beep"}])


def test_local_hf_directory_loads_model_and_tokenizer(model: CpuModel, tmp_path) -> None:
    """A saved checkpoint + a byte-level BPE tokenizer (built offline) load through `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path)
    model.hf.save_pretrained(tmp_path)

    loaded = CpuModel(ModelConfig(path=str(tmp_path)))
    assert (loaded.n_layers, loaded.n_kv_heads, loaded.head_dim, loaded.vocab_size) == (4, 2, 64, 260)
    tokens = _tokens(9, 4)
    expected = _run(model, _pool(model), tokens)[0]
    torch.testing.assert_close(_run(loaded, _pool(loaded), tokens)[0], expected)

    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and tok.eos_id == 257
    text = "héllo 你好 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.bos_id, *tok.encode("ok"), tok.eos_id]) == "ok"
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<|user|>\nHi\n<|assistant|>\n"
    # an already loaded tokenizer (SGLang's, in the sglang engine adapter) behaves the same
    wrapped = HFTokenizer.wrap(tok.tok)
    assert (wrapped.vocab_size, wrapped.bos_id, wrapped.eos_id) == (tok.vocab_size, tok.bos_id, tok.eos_id)
    assert wrapped.encode(text) == tok.encode(text) and wrapped.decode(wrapped.encode(text)) == text
