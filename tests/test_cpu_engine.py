"""The CPU engine end to end: every cache path (device hit, host load, prefetch, recompute, chunked prefill, batched
decode) yields the tokens of a model that saw the whole prompt at once; bad input is rejected without harming the
engine; pools and the cache's books agree after heavy eviction; hints, cache events, the bench driver and the CLI."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvflow_ray.core.radix import GpuState  # noqa: E402
from kvflow_ray.engines.base import GenerateRequest, GenerateResult, Hints, prefix_hash  # noqa: E402
from kvflow_ray.engines.cpu.bench import run_cpu_policies  # noqa: E402
from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig  # noqa: E402
from kvflow_ray.engines.cpu.engine import CpuEngine  # noqa: E402
from kvflow_ray.engines.cpu.model import CpuModel, sample  # noqa: E402
from kvflow_ray.engines.sim import workload  # noqa: E402
from kvflow_ray.engines.tokenizer import ByteTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# KV of equal computations done in different pieces (cached prefix + suffix, padded batches) differs by ~1e-6.
KV_TOL = {"atol": 1e-4, "rtol": 1e-4}

Reference = Callable[[Sequence[int], int], list[int]]


@pytest.fixture(scope="module")
def model() -> CpuModel:
    return CpuModel(ModelConfig())


def _greedy(model: CpuModel, tokens: Sequence[int], n: int, temperature: float = 0.0,
            seed: int | None = None) -> list[int]:
    """No cache at all: prefill the whole prompt in one piece, then decode one token at a time, in a pool of its own."""
    pool = model.pool("reference", len(tokens) + n)
    generator = torch.Generator().manual_seed(seed or 0) if temperature > 0 else None
    slots = pool.alloc(len(tokens) + n)
    logits = model.prefill(pool, list(tokens), slots[:len(tokens)])
    out: list[int] = []
    while True:
        out.append(sample(logits, temperature, generator))
        if len(out) == n:
            return out
        logits = model.decode(pool, [out[-1]], [slots[:len(tokens) + len(out)]])[0]


@pytest.fixture(scope="module")
def reference(model: CpuModel) -> Reference:
    """Greedy tokens of the no-cache run (`ignore_eos` semantics: exactly n tokens), memoised for the module."""
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def ref(tokens: Sequence[int], n: int) -> list[int]:
        key = (tuple(tokens), n)
        if key not in memo:
            memo[key] = _greedy(model, tokens, n)
        return memo[key]

    return ref


def _tokens(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 256, (n,), generator=g).tolist())


def _config(policy: str, device: int, host: int = 8_000, **kw: Any) -> CpuEngineConfig:
    return CpuEngineConfig(policy=policy, device_kv_tokens=device, host_kv_tokens=host, link_gbps=None, **kw)


def _state(engine: CpuEngine) -> str:
    s, c = engine.scheduler, engine.cache
    return (f"{len(s.waiting)} waiting, {len(s.running)} running, {engine.copier.inflight} copies in flight, "
            f"free {c.free_tokens}, locked {c.tree.locked_gpu_tokens}, private {c.private_tokens}, "
            f"queued_reserved {s.queued_reserved}")


def _drain(engine: CpuEngine, max_steps: int = 20_000) -> None:
    """Drive the engine (no background loop) until idle. A stuck engine returns from `step` at once, so the step
    bound ends a deadlock quickly instead of hanging the suite."""
    for _ in range(max_steps):
        if not engine.busy:
            return
        engine.step(timeout=0.01)
    raise AssertionError(f"the engine never became idle: {_state(engine)}")


# ---------------------------------------------------------------------------------------------------- the workflow
# Four agents with fixed prompts (two share an 80-token preamble), 760 distinct fixed tokens in all: more than the
# 600-token device pool, so every policy evicts; the host pool holds everything.
PREAMBLE = _tokens(80, 100)
FIXED = {"a0": PREAMBLE + _tokens(140, 1), "a1": PREAMBLE + _tokens(180, 2), "a2": _tokens(200, 3),
         "a3": _tokens(160, 4)}
AGENTS = tuple(FIXED)
ROUNDS = 3
CALLS = [(agent, FIXED[agent] + _tokens(10, 1000 + 10 * r + i))
         for r in range(ROUNDS) for i, agent in enumerate(AGENTS)]
MAX_TOKENS = 6
DEVICE_TOKENS = 600


def _request(agent: str, tokens: Sequence[int], workflow: str = "wf") -> GenerateRequest:
    return GenerateRequest(tokens=tokens, max_tokens=MAX_TOKENS, ignore_eos=True, workflow=workflow, agent=agent,
                           fixed_prefix_tokens=len(FIXED[agent]))


def _steps(agent: str) -> dict[str, float]:
    """Steps-to-execution in the cyclic order while `agent` runs."""
    k = AGENTS.index(agent)
    return {b: float((j - k) % len(AGENTS)) for j, b in enumerate(AGENTS)}


def _run_workflow(engine: CpuEngine) -> list[GenerateResult]:
    engine.apply_hints(Hints(prompts={("wf", a): FIXED[a] for a in AGENTS}))
    results = []
    for agent, tokens in CALLS:
        engine.apply_hints(Hints(steps={"wf": _steps(agent)}))
        results.append(engine.generate(_request(agent, tokens)))
    return results


def test_reference_outputs_are_not_degenerate(reference: Reference) -> None:
    """Identity below means something only if different prompts give different answers."""
    outputs = {tuple(reference(tokens, MAX_TOKENS)) for _agent, tokens in CALLS}
    assert len(outputs) > len(CALLS) // 2


@pytest.mark.parametrize("policy", ["lru", "hicache", "kvflow", "kvflow-noprefetch"])
def test_greedy_outputs_equal_the_no_cache_run(model: CpuModel, reference: Reference, policy: str) -> None:
    with CpuEngine(_config(policy, DEVICE_TOKENS), model=model) as engine:
        results = _run_workflow(engine)
        stats = engine.stats()

    for (agent, tokens), result in zip(CALLS, results, strict=True):
        assert result.tokens == reference(tokens, MAX_TOKENS), (policy, agent)
        assert result.prompt_tokens == len(tokens)
        assert result.gpu_hit_tokens + result.cpu_hit_tokens + result.miss_tokens == len(tokens)
        assert result.finish_reason == "length"

    # the run went through the paths the identity is meant to cover
    hits = stats["prompt_tokens"]
    assert hits == {"gpu": sum(r.gpu_hit_tokens for r in results), "cpu": sum(r.cpu_hit_tokens for r in results),
                    "miss": sum(r.miss_tokens for r in results)}
    assert stats["requests_done"] == len(CALLS) and stats["requests_failed"] == 0
    assert stats["evicted_tokens"]["gpu"] > 0
    assert results[1].gpu_hit_tokens >= len(PREAMBLE)  # a1 reuses the preamble a0 computed (a split node)
    later = list(zip(CALLS, results, strict=True))[len(AGENTS):]
    if policy == "lru":
        assert hits["gpu"] > 0 and hits["miss"] > 0 and hits["cpu"] == 0
        assert stats["evicted_tokens"]["dropped"] > 0 and stats["loaded_tokens"] == 0
        # evicted prompts are recomputed: later rounds miss much of their fixed prompt again
        assert any(r.miss_tokens > len(FIXED[a]) // 2 for (a, _t), r in later)
    else:
        assert stats["evicted_tokens"]["written_back"] > 0 and stats["loaded_tokens"] > 0
        # with a host tier nothing fixed is ever recomputed after the first round
        assert all(r.gpu_hit_tokens + r.cpu_hit_tokens >= len(FIXED[a]) for (a, _t), r in later)
        if policy == "kvflow":
            assert stats["prefetch"]["completed"] > 0  # loads ahead of the calls (their hits count as device hits)
        else:
            assert hits["cpu"] > 0  # loads on demand


@pytest.mark.parametrize(("policy", "chunk"), [("hicache", 64), ("kvflow", 37)])
def test_chunked_prefill_gives_the_same_tokens(model: CpuModel, reference: Reference, policy: str,
                                               chunk: int) -> None:
    with CpuEngine(_config(policy, DEVICE_TOKENS, chunk_tokens=chunk, idle_chunk_tokens=None), model=model) as engine:
        results = _run_workflow(engine)
        steps = engine.stats()["forward_steps"]
    for (_agent, tokens), result in zip(CALLS, results, strict=True):
        assert result.tokens == reference(tokens, MAX_TOKENS)
    # the first call alone (230 uncached tokens) needs several prefill chunks
    assert steps > len(CALLS) * MAX_TOKENS


def test_a_lone_prompt_prefills_in_one_step_and_chunks_beside_decodes(model: CpuModel, reference: Reference) -> None:
    """Chunks bound how long a prefill holds decodes back: a prompt with no decode beside it takes one
    step up to `idle_chunk_tokens`; one that arrives while another request decodes takes `chunk_tokens`."""
    first, second = _tokens(230, 900), _tokens(230, 901)
    with CpuEngine(_config("lru", DEVICE_TOKENS, chunk_tokens=64), model=model) as engine:
        alone = engine.submit(GenerateRequest(tokens=first, max_tokens=MAX_TOKENS, ignore_eos=True))
        _drain(engine)
        assert engine.stats()["forward_steps"] == MAX_TOKENS  # one prefill step, then a decode step per token
        decoding = engine.submit(GenerateRequest(tokens=_tokens(20, 902), max_tokens=40, ignore_eos=True))
        while not decoding.out:
            engine.step()
        beside = engine.submit(GenerateRequest(tokens=second, max_tokens=MAX_TOKENS, ignore_eos=True))
        engine.step()
        assert beside.prefill_pos == 64
        _drain(engine)
    assert alone.result is not None and alone.result.tokens == reference(first, MAX_TOKENS)
    assert beside.result is not None and beside.result.tokens == reference(second, MAX_TOKENS)


def test_idle_chunk_tokens_must_be_positive(model: CpuModel) -> None:
    with pytest.raises(ValueError, match="idle_chunk_tokens must be positive or None, got 0"):
        CpuEngine(_config("lru", DEVICE_TOKENS, idle_chunk_tokens=0), model=model)


@pytest.mark.parametrize("policy", ["lru", "hicache"])
def test_concurrent_calls_batch_and_give_the_same_tokens(model: CpuModel, reference: Reference,
                                                         policy: str) -> None:
    """Each round's calls are submitted together: prefills share a step and decodes run batched (padded)."""
    with CpuEngine(_config(policy, DEVICE_TOKENS + 400), model=model) as engine:
        reqs = []
        for r in range(ROUNDS):
            wave = CALLS[r * len(AGENTS):(r + 1) * len(AGENTS)]
            reqs += [engine.submit(_request(agent, tokens)) for agent, tokens in wave]
            _drain(engine)
        steps = engine.stats()["forward_steps"]
    for (_agent, tokens), req in zip(CALLS, reqs, strict=True):
        assert req.error is None and req.result is not None
        assert req.result.tokens == reference(tokens, MAX_TOKENS)
    assert steps < len(CALLS) * MAX_TOKENS  # fewer steps than one request at a time: batching happened


def test_sampling_is_seeded(model: CpuModel) -> None:
    prompt = _tokens(30, 7)
    req = GenerateRequest(tokens=prompt, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    with CpuEngine(_config("kvflow", 400), model=model) as engine:
        first = engine.generate(req).tokens
        again = engine.generate(req).tokens  # now from the cache: same draws
        other = engine.generate(GenerateRequest(tokens=prompt, max_tokens=8, temperature=1.0, seed=6,
                                                ignore_eos=True)).tokens
    assert first == again == _greedy(model, prompt, 8, temperature=1.0, seed=5)
    assert other != first


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def served(model: CpuModel):
    """An engine serving from its background loop; tests call it from their own thread."""
    engine = CpuEngine(_config("kvflow", 300, host=1_000), model=model).start()
    yield engine
    engine.close()


VALID = GenerateRequest(tokens=_tokens(40, 8), max_tokens=4, ignore_eos=True)

BAD_REQUESTS = {
    "longer than the pool": (GenerateRequest(tokens=_tokens(295, 9), max_tokens=10), "device KV pool of 300"),
    "unknown model": (GenerateRequest(tokens=[1, 2], model="some/other"), "unknown model 'some/other'"),
    "empty tokens": (GenerateRequest(tokens=[]), "empty"),
    "empty text": (GenerateRequest(prompt=""), "empty"),
    "no prompt": (GenerateRequest(), "exactly one of prompt"),
    "prompt and tokens": (GenerateRequest(prompt="hi", tokens=[1, 2]), "exactly one of prompt"),
    "max_tokens 0": (GenerateRequest(tokens=[1, 2], max_tokens=0), "max_tokens"),
    "token over vocab": (GenerateRequest(tokens=[1, 260]), "260 is outside the model's vocabulary"),
    "negative token": (GenerateRequest(tokens=[-1, 2]), "-1 is outside the model's vocabulary"),
    "negative temperature": (GenerateRequest(tokens=[1, 2], temperature=-0.5), "temperature"),
    "NaN temperature": (GenerateRequest(tokens=[1, 2], temperature=float("nan")), "temperature"),
    "top_p 0": (GenerateRequest(tokens=[1, 2], top_p=0.0), r"top_p must be in \(0, 1\]"),
    "top_p over 1": (GenerateRequest(tokens=[1, 2], top_p=1.5), "top_p"),
    "five stop strings": (GenerateRequest(tokens=[1, 2], stop=["a", "b", "c", "d", "e"]), "at most 4 stop strings"),
    "empty stop string": (GenerateRequest(tokens=[1, 2], stop=["ok", ""]), "stop strings must be non-empty"),
    "one stop string, not a list": (GenerateRequest(tokens=[1, 2], stop="###"), "stop must be a list"),
    "workflow without agent": (GenerateRequest(tokens=[1, 2], workflow="wf"), "agent"),
    "agent without workflow": (GenerateRequest(tokens=[1, 2], agent="a0"), "workflow"),
    "fixed prefix past the prompt": (GenerateRequest(tokens=[1, 2], fixed_prefix_tokens=3), "fixed_prefix_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_a_value_error_and_the_engine_keeps_serving(served: CpuEngine, reference: Reference,
                                                                   case: str) -> None:
    request, message = BAD_REQUESTS[case]
    done = served.stats()["requests_done"]
    with pytest.raises(ValueError, match=message):
        served.generate(request)
    with pytest.raises(ValueError, match=message):
        list(served.stream(request))
    rejected = served.stats()["requests_rejected"]
    assert served.generate(VALID).tokens == reference(VALID.tokens, VALID.max_tokens)
    stats = served.stats()
    assert stats["requests_done"] == done + 1 and stats["requests_failed"] == 0  # rejected before queueing
    assert rejected >= 2 and stats["requests_rejected"] == rejected
    assert stats["cache_tokens"]["private"] == 0


def test_the_engine_names_its_model(served: CpuEngine, reference: Reference) -> None:
    assert served.model_name == "kvflow-cpu-random"
    request = GenerateRequest(tokens=VALID.tokens, max_tokens=4, ignore_eos=True, model=served.model_name)
    assert served.generate(request).tokens == reference(VALID.tokens, 4)


def test_request_longer_than_the_model_context(model: CpuModel) -> None:
    small = CpuModel(ModelConfig(max_context=256))  # same seed and shapes: the same weights
    with CpuEngine(_config("hicache", 1_000), model=small).start() as engine:
        assert engine.model.max_context == 256
        with pytest.raises(ValueError, match="context of 256"):
            engine.generate(GenerateRequest(tokens=_tokens(250, 10), max_tokens=7))
        with pytest.raises(ValueError, match="context of 256"):
            engine.generate(GenerateRequest(tokens=_tokens(257, 10), max_tokens=1))
        ok = engine.generate(GenerateRequest(tokens=_tokens(250, 10), max_tokens=6, ignore_eos=True))
    assert ok.tokens == _greedy(model, _tokens(250, 10), 6)


def test_missing_model_path_is_a_value_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        CpuModel(ModelConfig(path=missing))
    with pytest.raises(ValueError, match="no-such-model"):
        CpuEngine(CpuEngineConfig(model=ModelConfig(path=missing)))


@pytest.mark.parametrize("field", ["device_kv_tokens", "host_kv_tokens", "chunk_tokens", "max_running"])
def test_non_positive_sizes_are_rejected(model: CpuModel, field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be positive"):
        CpuEngine(CpuEngineConfig(**{field: 0}), model=model)


def test_lru_needs_no_host_pool(model: CpuModel) -> None:
    with CpuEngine(CpuEngineConfig(policy="lru", device_kv_tokens=300, host_kv_tokens=0), model=model) as engine:
        assert engine.host is None
        assert len(engine.generate(GenerateRequest(tokens=_tokens(20, 3), max_tokens=2)).tokens) == 2


def test_zero_link_bandwidth_is_rejected(model: CpuModel) -> None:
    with pytest.raises(ValueError, match="link_gbps"):
        CpuEngine(CpuEngineConfig(device_kv_tokens=100, host_kv_tokens=100, link_gbps=0.0), model=model)


@pytest.mark.parametrize("policy", ["belady", "infinite", "nope"])
def test_policies_the_engine_cannot_run(model: CpuModel, policy: str) -> None:
    with pytest.raises(ValueError, match=f"policy '{policy}' cannot run on the CPU engine"):
        CpuEngine(CpuEngineConfig(policy=policy), model=model)


# ---------------------------------------------------------------------------------------------------- streaming
def _check_stream(items: list[Any], expected: list[int], prompt_tokens: int) -> None:
    *tokens, result = items
    assert all(isinstance(t, int) for t in tokens)
    assert isinstance(result, GenerateResult)
    assert tokens == result.tokens == expected
    assert result.text == ByteTokenizer().decode(expected)
    assert result.prompt_tokens == prompt_tokens


def test_stream_without_a_background_loop(model: CpuModel, reference: Reference) -> None:
    with CpuEngine(_config("hicache", 400), model=model) as engine:
        _check_stream(list(engine.stream(VALID)), reference(VALID.tokens, 4), 40)
        assert not engine.busy


def test_stream_from_the_background_loop(served: CpuEngine, reference: Reference) -> None:
    prompt = "Hello, KV world"
    ids = ByteTokenizer().encode(prompt)
    items = list(served.stream(GenerateRequest(prompt=prompt, max_tokens=5, ignore_eos=True)))
    _check_stream(items, reference(ids, 5), len(ids))


# ---------------------------------------------------------------------------------------------------- sampling
STOP_PROMPT = ByteTokenizer().encode("Hello, KV world")
STOP_BUDGET = 24


def _stop_in(text: str) -> tuple[str, int]:
    """A two-character stop string taken from `text`, first found at position >= 2 (so some text comes
    before it), without replacement characters (bytes that are no UTF-8); and where it starts."""
    for at in range(2, len(text) - 1):
        stop = text[at:at + 2]
        if "\ufffd" not in stop and text.find(stop) == at:
            return stop, at
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("how", ["generate", "stream"])
def test_a_stop_string_ends_the_output_before_it(model: CpuModel, reference: Reference, how: str) -> None:
    tokenizer = ByteTokenizer()
    full = reference(STOP_PROMPT, STOP_BUDGET)  # greedy, no stop
    text = tokenizer.decode(full)
    stop, at = _stop_in(text)
    generated = next(n for n in range(1, len(full) + 1) if stop in tokenizer.decode(full[:n]))
    request = GenerateRequest(tokens=STOP_PROMPT, max_tokens=STOP_BUDGET, ignore_eos=True, stop=["\x00never", stop])
    with CpuEngine(_config("kvflow", 400), model=model) as engine:
        if how == "generate":
            result = engine.generate(request)
        else:
            *streamed, result = list(engine.stream(request))
            assert isinstance(result, GenerateResult)
            assert streamed == result.tokens  # a streaming client never sees the stop string's tokens
        assert engine.forward_steps == generated  # the prefill's token, then one decode step each: none after
        assert not engine.busy and engine.stats()["cache_tokens"]["private"] == 0
    assert result.finish_reason == "stop"
    assert result.text == text[:at] and stop not in result.text
    assert tokenizer.decode(result.tokens) == result.text and result.tokens == full[:len(result.tokens)]
    assert len(result.tokens) < generated < STOP_BUDGET


def test_a_stop_string_that_never_comes_changes_nothing(served: CpuEngine, reference: Reference) -> None:
    full = reference(STOP_PROMPT, 12)
    result = served.generate(GenerateRequest(tokens=STOP_PROMPT, max_tokens=12, ignore_eos=True, stop=["\x00never"]))
    assert result.tokens == full and result.text == ByteTokenizer().decode(full)
    assert result.finish_reason == "length"


def test_top_p_tiny_and_temperature_tiny_are_greedy(served: CpuEngine, reference: Reference) -> None:
    prompt = _tokens(30, 7)
    greedy = reference(prompt, 8)
    nucleus = GenerateRequest(tokens=prompt, max_tokens=8, temperature=1.0, seed=5, top_p=1e-9, ignore_eos=True)
    assert served.generate(nucleus).tokens == greedy
    sampled = GenerateRequest(tokens=prompt, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    assert served.generate(sampled).tokens != greedy  # top_p is what made it greedy
    for temperature in (1e-300, 5e-324):  # crashed: logits / T overflowed to inf, softmax to NaN
        tiny = GenerateRequest(tokens=prompt, max_tokens=8, temperature=temperature, seed=5, ignore_eos=True)
        result = served.generate(tiny)
        assert result.tokens == greedy and result.finish_reason == "length"


# ---------------------------------------------------------------------------------------------------- accounting
def _stress_workload() -> tuple[dict[str, dict[str, tuple[int, ...]]], list[tuple[str | None, str | None,
                                                                                   tuple[int, ...], int]]]:
    """Three workflows x three agents (a shared 40-token preamble, 60-140 agent tokens) and some plain
    requests: ~1,000 distinct fixed tokens plus dynamic parts, against a 760-token device pool and a 1,000-token
    host pool, so both tiers evict."""
    rng = random.Random(0)
    preamble = _tokens(40, 200)
    prompts = {f"w{w}": {f"a{a}": preamble + _tokens(rng.randint(60, 140), 300 + 10 * w + a) for a in range(3)}
               for w in range(3)}
    calls: list[tuple[str | None, str | None, tuple[int, ...], int]] = []
    for i in range(60):
        if i % 7 == 3:
            calls.append((None, None, _tokens(rng.randint(20, 120), 500 + i), rng.randint(1, 5)))
        else:
            w, a = f"w{rng.randrange(3)}", f"a{rng.randrange(3)}"
            calls.append((w, a, prompts[w][a] + _tokens(rng.randint(1, 30), 500 + i), rng.randint(1, 5)))
    return prompts, calls


def _check_pool_contents(engine: CpuEngine, model: CpuModel) -> None:
    """Every cached node's KV, in whichever pools hold it, is the KV of its token sequence."""
    assert engine.host is not None
    device_slots: list[int] = []
    host_slots: list[int] = []
    leaves = [n for n in engine.cache.tree.nodes() if not n.children]
    for leaf in leaves:
        path = leaf.path()
        sequence = list(leaf.sequence())
        scratch = model.pool("scratch", len(sequence))
        slots = scratch.alloc(len(sequence))
        model.prefill(scratch, sequence, slots)
        k, v = scratch.gather(slots)
        start = 0
        for n in path:
            end = start + len(n.key)
            copies = []
            if n.gpu is GpuState.READY:
                copies.append(engine.device.gather(n.gpu_value))  # type: ignore[arg-type]
            if n.cpu:
                copies.append(engine.host.gather(n.cpu_value))  # type: ignore[arg-type]
            assert copies, n
            for got_k, got_v in copies:
                torch.testing.assert_close(got_k, k[:, :, start:end], **KV_TOL)
                torch.testing.assert_close(got_v, v[:, :, start:end], **KV_TOL)
            start = end
    for n in engine.cache.tree.nodes():
        if n.gpu is GpuState.READY:
            device_slots += n.gpu_value.tolist()  # type: ignore[attr-defined]
        if n.cpu:
            host_slots += n.cpu_value.tolist()  # type: ignore[attr-defined]
    # no slot is owned twice, and owned + free slots make up each pool
    assert len(set(device_slots)) == len(device_slots) == engine.cache.tree.gpu_tokens
    assert len(set(host_slots)) == len(host_slots) == engine.cache.tree.cpu_tokens
    assert len(device_slots) + engine.device.free_slots == engine.device.capacity
    assert len(host_slots) + engine.host.free_slots == engine.host.capacity


@pytest.mark.parametrize("policy", ["hicache", "kvflow"])
def test_memory_accounting_is_exact_after_many_requests(model: CpuModel, reference: Reference,
                                                        policy: str) -> None:
    prompts, calls = _stress_workload()
    rng = random.Random(1)
    # Waves of four, drained in between: 760 >= 3 queued prompts (<= 180 tokens each) + the largest call, so the
    # admission deadlock of test_queued_load_does_not_block_admission cannot occur here.
    with CpuEngine(_config(policy, 760, host=1_000, chunk_tokens=64), model=model) as engine:
        engine.apply_hints(Hints(prompts={(w, a): p for w, agents in prompts.items() for a, p in agents.items()}))
        reqs = []
        for i in range(0, len(calls), 4):
            engine.apply_hints(Hints(steps={w: {a: float(rng.randint(0, 3)) for a in prompts[w]} for w in prompts}))
            for w, a, tokens, n in calls[i:i + 4]:
                reqs.append(engine.submit(GenerateRequest(tokens=tokens, max_tokens=n, ignore_eos=True,
                                                          workflow=w, agent=a)))
            _drain(engine)

        stats = engine.stats()
        cache, tree = engine.cache, engine.cache.tree
        assert stats["requests_done"] == len(calls) and stats["requests_failed"] == 0
        assert stats["waiting"] == stats["running"] == 0
        assert engine.device.free_slots == cache.free_tokens
        assert engine.host is not None and engine.host.free_slots == cache.cpu_capacity - tree.cpu_tokens
        assert cache.private_tokens == 0 and cache.pending_free == 0 and cache.offloading_tokens == 0
        assert tree.locked_gpu_tokens == 0 and engine.scheduler.queued_reserved == 0
        assert engine.scheduler.prefetch_inflight == 0
        assert all(n.gpu is not GpuState.LOADING and not n.offloading for n in tree.nodes())
        tree.check_invariants()
        _check_pool_contents(engine, model)
        # the pools really were under pressure on both tiers
        evicted = stats["evicted_tokens"]
        assert evicted["gpu"] > 0 and evicted["written_back"] > 0 and evicted["cpu"] > 0
        assert stats["prompt_tokens"]["cpu"] > 0 or stats["prefetch"]["completed"] > 0
        if policy == "kvflow":
            assert stats["prefetch"]["issued"] > 0

    for req, (_w, _a, tokens, n) in zip(reqs, calls, strict=True):
        assert req.error is None and req.result is not None
        assert req.result.tokens == reference(tokens, n)


def test_a_closed_engine_gives_its_pools_back(model: CpuModel) -> None:
    """The engine and its scheduler refer to each other, so a closed engine may wait for the cycle
    collector; its pools' memory must not wait with it."""
    with CpuEngine(_config("kvflow", 300, host=2_000), model=model) as engine:
        engine.generate(GenerateRequest(tokens=_tokens(40, 1), max_tokens=2, ignore_eos=True))
        assert engine.device.nbytes > 0 and engine.host is not None and engine.host.nbytes > 0
    assert engine.device.nbytes == engine.host.nbytes == 0


@pytest.mark.parametrize("policy", ["kvflow", "kvflow-noprefetch"])
def test_queued_load_does_not_block_admission(model: CpuModel, policy: str) -> None:
    """A (ready, needs 210 of 300 tokens) arrives with B (its 100-token fixed prompt on the host). B's queued load
    locks those 100 tokens; A, first in the status-aware order, then never fits, and B waits behind A."""
    fixed = _tokens(100, 20)
    with CpuEngine(_config(policy, 300, host=2_000), model=model) as engine:
        engine.generate(GenerateRequest(tokens=fixed + _tokens(5, 21), max_tokens=2, ignore_eos=True,
                                        workflow="wf", agent="b", fixed_prefix_tokens=100))
        engine.generate(GenerateRequest(tokens=_tokens(250, 22), max_tokens=5, ignore_eos=True))  # B -> host
        a = engine.submit(GenerateRequest(tokens=_tokens(200, 23), max_tokens=10, ignore_eos=True))
        b = engine.submit(GenerateRequest(tokens=fixed + _tokens(5, 24), max_tokens=2, ignore_eos=True,
                                          workflow="wf", agent="b", fixed_prefix_tokens=100))
        _drain(engine)
        assert a.result is not None and b.result is not None


# ---------------------------------------------------------------------------------------------------- hints, events
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(model: CpuModel, reference: Reference,
                                                                        phase: str) -> None:
    """A forward pass that raises (fault injected into this engine's model calls) fails the requests in that step
    with the error; their memory and locks go back, and the next request is served."""
    with CpuEngine(_config("kvflow", 600), model=model) as engine:
        real = getattr(engine.model, phase)
        calls = {"n": 0}

        def failing(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError(f"injected {phase} failure")
            return real(*args, **kwargs)

        setattr(engine.model, phase, failing)
        try:
            with pytest.raises(RuntimeError, match=f"injected {phase} failure"):
                engine.generate(GenerateRequest(tokens=_tokens(120, 51), max_tokens=4, ignore_eos=True))
            assert engine.stats()["requests_failed"] == 1
            assert engine.cache.private_tokens == 0 and engine.device.free_slots == engine.cache.free_tokens
            assert all(node.lock_ref == 0 for node in engine.cache.tree.nodes())
            tokens = _tokens(120, 52)
            assert engine.generate(GenerateRequest(tokens=tokens, max_tokens=4, ignore_eos=True)).tokens == \
                reference(tokens, 4)
            engine.cache.tree.check_invariants()
        finally:
            setattr(engine.model, phase, real)


def test_retiring_a_workflow_removes_its_tags(model: CpuModel) -> None:
    with CpuEngine(_config("kvflow", 1_000), model=model) as engine:
        engine.apply_hints(Hints(steps={"wf": {"a0": 0.0, "a2": 1.0}, "wf2": {"a0": 0.0}},
                                 prompts={("wf", "a0"): FIXED["a0"], ("wf", "a2"): FIXED["a2"],
                                          ("wf2", "a0"): FIXED["a0"]}))
        for workflow, agent in (("wf", "a0"), ("wf", "a2"), ("wf2", "a0")):
            engine.generate(_request(agent, FIXED[agent] + _tokens(5, 30), workflow=workflow))
        tree = engine.cache.tree
        assert tree.workflow_nodes("wf") and tree.workflow_nodes("wf2")
        assert engine.book.live("wf")

        engine.apply_hints(Hints(retire=["wf"]))
        engine.step()
        assert tree.workflow_nodes("wf") == set()
        assert not any(tag[0] == "wf" for node in tree.nodes() for tag in node.tags)
        assert not engine.book.live("wf") and engine.book.prompt(("wf", "a0")) is None
        assert "wf" not in engine.cache.prompt_tails
        # the other workflow keeps its tags (on the very nodes it shares with the retired one)
        assert {("wf2", "a0")} <= set().union(*(n.tags for n in tree.workflow_nodes("wf2")))
        tree.check_invariants()
        # retiring untags, it does not drop: the prompt is still served from the device
        result = engine.generate(GenerateRequest(tokens=FIXED["a2"] + _tokens(3, 31), max_tokens=1))
        assert result.gpu_hit_tokens >= len(FIXED["a2"])


def _prompt_nodes(engine: CpuEngine, agent: str) -> list[Any]:
    return engine.cache.tree.match_prefix(FIXED[agent], split=False).path


def test_an_agents_prompt_ranks_by_its_steps_from_the_hint_not_from_its_first_call(model: CpuModel) -> None:
    """docs/design.md §3: an agent's E is set on its fixed prompt's nodes. A new workflow instance of
    the same template finds the prompt cached by an earlier, finished instance: the hint that names its
    agent (E = 1) ranks those nodes at once, before the agent's first call."""
    with CpuEngine(_config("kvflow", 1_000), model=model) as engine:
        engine.apply_hints(Hints(steps={"old": {"a2": 0.0}}, prompts={("old", "a2"): FIXED["a2"]}))
        engine.generate(_request("a2", FIXED["a2"] + _tokens(5, 60), workflow="old"))
        engine.apply_hints(Hints(retire=["old"]))
        engine.step()
        distance = engine.cache.eviction.node_distance
        nodes = _prompt_nodes(engine, "a2")
        assert nodes and all(distance(node) == float("inf") for node in nodes)  # a finished instance's: first to go

        engine.apply_hints(Hints(steps={"new": {"a2": 1.0}}, prompts={("new", "a2"): FIXED["a2"]}))
        engine.step()
        assert all(("new", "a2") in node.tags and distance(node) == 1.0 for node in _prompt_nodes(engine, "a2"))
        engine.cache.tree.check_invariants()


def test_a_cache_that_ranks_by_recency_gets_no_tags_ahead_of_calls(model: CpuModel) -> None:
    """`hicache` ranks by recency alone: a hint leaves its tree as SGLang's would be (no look-up
    splits a node, no tag is added)."""
    with CpuEngine(_config("hicache", 1_000), model=model) as engine:
        engine.generate(_request("a2", FIXED["a2"] + _tokens(5, 62), workflow="old"))
        before = [(len(node.key), frozenset(node.tags)) for node in engine.cache.tree.nodes()]
        engine.apply_hints(Hints(steps={"new": {"a2": 1.0}}, prompts={("new", "a2"): FIXED["a2"][:150]}))
        engine.step()
        assert [(len(node.key), frozenset(node.tags)) for node in engine.cache.tree.nodes()] == before


def test_a_prompt_computed_for_one_instance_carries_the_steps_of_the_others(model: CpuModel) -> None:
    """Two instances of one template await the same agent; the first computes its prompt. The new nodes
    carry the second's tag too, so they keep its steps once the first instance is done."""
    with CpuEngine(_config("kvflow", 1_000), model=model) as engine:
        engine.apply_hints(Hints(steps={"first": {"a3": 0.0}, "second": {"a3": 2.0}},
                                 prompts={("first", "a3"): FIXED["a3"], ("second", "a3"): FIXED["a3"]}))
        assert _prompt_nodes(engine, "a3") == []  # nothing cached yet: nothing to tag
        engine.generate(_request("a3", FIXED["a3"] + _tokens(5, 61), workflow="first"))
        nodes = _prompt_nodes(engine, "a3")
        assert nodes and all({("first", "a3"), ("second", "a3")} <= node.tags for node in nodes)
        engine.apply_hints(Hints(retire=["first"]))
        engine.step()
        distance = engine.cache.eviction.node_distance
        assert all(distance(node) == 2.0 for node in _prompt_nodes(engine, "a3"))
        # a third instance of another tenant (namespace) does not share the prompt's nodes
        engine.apply_hints(Hints(steps={"other": {"a3": 1.0}}, prompts={("other", "a3"): FIXED["a3"]},
                                 salts={"other": "tenant-b"}))
        engine.step()
        assert not any(("other", "a3") in node.tags for node in engine.cache.tree.nodes())


def test_cache_events_report_tier_changes_and_drain(model: CpuModel) -> None:
    fixed = _tokens(100, 40)
    # 300 device tokens; the host takes exactly what the first three calls write back (360), no more
    with CpuEngine(_config("hicache", 300, host=360), model=model) as engine:
        engine.generate(GenerateRequest(tokens=fixed + _tokens(5, 41), max_tokens=2, ignore_eos=True,
                                        workflow="wf", agent="a", fixed_prefix_tokens=100))
        engine.generate(GenerateRequest(tokens=_tokens(250, 42), max_tokens=5, ignore_eos=True))  # evicts the prompt
        first = engine.cache_events()
        engine.generate(GenerateRequest(tokens=fixed + _tokens(5, 43), max_tokens=2, ignore_eos=True,
                                        workflow="wf", agent="a", fixed_prefix_tokens=100))  # loads it back
        engine.generate(GenerateRequest(tokens=_tokens(280, 44), max_tokens=5, ignore_eos=True))  # host fills up
        second = engine.cache_events()
        assert engine.cache_events() == []  # drained
        stats = engine.stats()

    events = first + second
    assert {e.kind for e in events} == {"stored", "removed"}
    assert {e.tier for e in events} == {"gpu", "cpu"}
    assert all(e.tokens > 0 and len(e.prefix_hash) == 24 for e in events)
    key = prefix_hash(fixed)
    # the fixed prompt (its own node: the tag splits it from the dynamic part) was written back, then left the device
    assert ("stored", "gpu", key, 100) in {(e.kind, e.tier, e.prefix_hash, e.tokens) for e in first}  # computed
    assert ("stored", "cpu", key, 100) in {(e.kind, e.tier, e.prefix_hash, e.tokens) for e in first}
    assert ("removed", "gpu", key, 100) in {(e.kind, e.tier, e.prefix_hash, e.tokens) for e in first}
    assert ("stored", "gpu", key, 100) in {(e.kind, e.tier, e.prefix_hash, e.tokens) for e in second}
    assert any(e.kind == "removed" and e.tier == "cpu" for e in second)
    # events add up to the counters
    assert sum(e.tokens for e in events if e.kind == "stored" and e.tier == "cpu") == \
        stats["evicted_tokens"]["written_back"]
    assert sum(e.tokens for e in events if e.kind == "removed" and e.tier == "gpu") == stats["evicted_tokens"]["gpu"]
    assert sum(e.tokens for e in events if e.kind == "removed" and e.tier == "cpu") == stats["evicted_tokens"]["cpu"]


def test_cache_salt_isolates_prefix_reuse(model: CpuModel, reference: Reference) -> None:
    """The same prompt under two salts is computed twice (no shared KV, whatever the timing); under
    the same salt it is reused. Events name each copy by its own salted hash."""
    prompt = _tokens(80, 50)
    with CpuEngine(_config("kvflow", 1_000), model=model) as engine:
        def run(salt: str) -> GenerateResult:
            return engine.generate(GenerateRequest(tokens=prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                   cache_salt=salt))

        first_a, b, plain, second_a = run("a"), run("b"), run(""), run("a")
        events = engine.cache_events()
        tree = engine.cache.tree
        assert {node.namespace for node in tree.root.children.values()} == {"", "a", "b"}
        tree.check_invariants()

    for result in (first_a, b, plain):
        assert (result.gpu_hit_tokens, result.cpu_hit_tokens, result.miss_tokens) == (0, 0, len(prompt))
    assert second_a.gpu_hit_tokens == len(prompt) and second_a.miss_tokens == 0
    # reuse changes no output: every copy gives the no-cache tokens
    assert all(r.tokens == reference(prompt, MAX_TOKENS) for r in (first_a, b, plain, second_a))
    stored = {e.prefix_hash for e in events if (e.kind, e.tier) == ("stored", "gpu")}
    assert {prefix_hash(prompt, "a"), prefix_hash(prompt, "b"), prefix_hash(prompt)} <= stored
    assert len({prefix_hash(prompt, "a"), prefix_hash(prompt, "b"), prefix_hash(prompt)}) == 3


def test_hint_salts_prefetch_a_prompt_in_its_workflows_namespace(model: CpuModel) -> None:
    """A workflow's registered prompt is tagged and prefetched in the namespace `Hints.salts` gives it,
    where its requests find it: the call after an eviction is served from the device."""
    fixed = _tokens(100, 60)
    with CpuEngine(_config("kvflow", 300, host=2_000), model=model) as engine:
        engine.apply_hints(Hints(steps={"wf": {"a": 0.0}}, prompts={("wf", "a"): fixed}, salts={"wf": "t"}))
        engine.generate(GenerateRequest(tokens=fixed + _tokens(5, 61), max_tokens=2, ignore_eos=True,
                                        workflow="wf", agent="a", cache_salt="t"))
        tree = engine.cache.tree
        assert tree.workflow_nodes("wf") and all(n.namespace == "t" for n in tree.workflow_nodes("wf"))
        engine.generate(GenerateRequest(tokens=_tokens(250, 62), max_tokens=5, ignore_eos=True))  # evicts the prompt
        assert tree.match_prefix(fixed, namespace="t").gpu_length() < len(fixed)
        engine.cache_events()
        engine.apply_hints(Hints(steps={"wf": {"a": 0.0}}))  # the agent is about to run: prefetch its prompt
        while engine.busy:
            engine.step(timeout=0.01)
        assert tree.match_prefix(fixed, namespace="t").gpu_length() == len(fixed)
        loaded = engine.cache_events()
        result = engine.generate(GenerateRequest(tokens=fixed + _tokens(5, 63), max_tokens=2, ignore_eos=True,
                                                 workflow="wf", agent="a", cache_salt="t"))
        stats = engine.stats()
        tree.check_invariants()

    assert stats["prefetch"]["issued"] >= 1 and stats["prefetch"]["used"] >= 1
    assert result.gpu_hit_tokens >= len(fixed) and result.cpu_hit_tokens == 0
    assert ("stored", "gpu", prefix_hash(fixed, "t")) in {(e.kind, e.tier, e.prefix_hash) for e in loaded}


# ---------------------------------------------------------------------------------------------------- bench and CLI
RESULT_KEYS = {"latency_s", "p99_latency_s", "gpu_hit_ratio", "cpu_hit_ratio", "recomputed_tokens", "loaded_tokens",
               "prefetch_stall_s"}


def test_bench_driver_runs_a_tiny_scenario(model: CpuModel) -> None:
    scenario = workload.single(agents=4, fixed=200, dynamic=8, output=3, iterations=1)
    config = CpuEngineConfig(device_kv_tokens=500, host_kv_tokens=4000, link_gbps=None)
    out = run_cpu_policies(scenario, config, ["lru", "hicache", "kvflow"], model=model)

    assert out["scenario"] == "single" and out["engine"] == "cpu"
    assert out["config"]["device_kv_tokens"] == 500 and "policy" not in out["config"]
    assert set(out["results"]) == {"lru", "hicache", "kvflow"}
    for name, result in out["results"].items():
        assert set(result) >= RESULT_KEYS, name
        assert result["workflows_measured"] == 1
        assert result["latency_s"] > 0 and result["p99_latency_s"] >= result["latency_s"]
        assert 0 <= result["gpu_hit_ratio"] + result["cpu_hit_ratio"] <= 1
    lru, hicache, kvflow = (out["results"][p] for p in ("lru", "hicache", "kvflow"))
    assert lru["recomputed_tokens"] > kvflow["recomputed_tokens"]
    assert lru["recomputed_tokens"] > hicache["recomputed_tokens"]
    assert kvflow["gpu_hit_ratio"] + kvflow["cpu_hit_ratio"] > 0 and kvflow["loaded_tokens"] > 0
    assert lru["loaded_tokens"] == 0 and lru["cpu_hit_ratio"] == 0
    with pytest.raises(ValueError, match="belady cannot run on the CPU engine"):
        run_cpu_policies(scenario, config, ["lru", "belady"], model=model)


def test_cli_bench_cpu() -> None:
    """Three CLI runs at once (most of each is importing torch)."""
    tiny = ["--model", "random", "--scenario", "single", "--agents", "3", "--fixed", "100", "--dynamic", "4",
            "--output", "2", "--iterations", "1"]
    runs = {
        "ok": [*tiny, "--device-kv-tokens", "250", "--policies", "lru,kvflow", "--json"],
        "belady": [*tiny, "--device-kv-tokens", "250", "--policies", "belady"],
        "no pool": [*tiny, "--device-kv-tokens", "0"],
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "kvflow_ray.cli", "bench", "cpu", *args], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in runs.items()}
    out = {name: (*p.communicate(timeout=300), p.returncode) for name, p in procs.items()}

    stdout, stderr, rc = out["ok"]
    assert rc == 0, stderr
    result = json.loads(stdout)  # exactly one JSON document
    assert set(result["results"]) == {"lru", "kvflow"}
    assert result["config"]["device_kv_tokens"] == 250
    for policy_result in result["results"].values():
        assert set(policy_result) >= RESULT_KEYS

    stdout, stderr, rc = out["belady"]
    assert rc == 2 and stdout == ""
    assert "belady cannot run on the CPU engine" in stderr and "Traceback" not in stderr

    stdout, stderr, rc = out["no pool"]
    assert rc == 2 and stdout == ""
    assert "device_kv_tokens must be positive" in stderr and "Traceback" not in stderr


def test_cli_bench_cpu_sets_an_agentic_pool_by_pressure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench cpu --scenario agentic --pressure X`: the device pool at which the sessions' live histories
    are X times it, as the simulator measures them on the profile calibrated here (first, when missing);
    --pressure and --device-kv-tokens exclude each other, and --pressure needs the agentic scenario."""
    from kvflow_ray.commands.sim import add_scenario_arguments, build_scenario
    from kvflow_ray.engines.sim.profile import load_profile
    from kvflow_ray.engines.sim.runner import pressure_capacity

    env = {**os.environ, "KVFLOW_RAY_PROFILES": str(tmp_path)}
    agentic = ["--model", "random", "--scenario", "agentic", "--sessions", "2", "--shape", "tiny"]
    runs = {
        "ok": [*agentic, "--pressure", "2", "--policies", "kvflow", "--json"],
        "both": [*agentic, "--pressure", "2", "--device-kv-tokens", "4096"],
        "not agentic": ["--model", "random", "--scenario", "single", "--pressure", "2"],
    }
    out = {}
    for name, args in runs.items():  # one after another: the first writes the profile the others would read
        done = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "bench", "cpu", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        out[name] = done.stdout, done.stderr, done.returncode
    stdout, stderr, rc = out["ok"]
    assert rc == 0, stderr
    assert (tmp_path / "cpu-reference.yaml").exists()  # calibrated first
    result = json.loads(stdout)
    parser = argparse.ArgumentParser()
    add_scenario_arguments(parser, fleet=True)  # the simulator's flags: the same scenario, seed 0
    scenario = build_scenario(parser.parse_args(["--scenario", "agentic", "--sessions", "2", "--shape", "tiny",
                                                 "--pressure", "2"]))
    monkeypatch.setenv("KVFLOW_RAY_PROFILES", str(tmp_path))
    pool, _live = pressure_capacity(scenario, load_profile("cpu-reference"), replicas=1)
    assert result["config"]["device_kv_tokens"] == pool and result["params"]["pressure"] == 2.0
    assert f"device pool {pool:,} tokens" in stderr
    assert result["results"]["kvflow"]["workflows_measured"] == 2
    for name, message in (("both", "give it or --device-kv-tokens, not both"),
                          ("not agentic", "--pressure goes with --scenario")):
        stdout, stderr, rc = out[name]
        assert rc == 2 and stdout == "" and message in stderr and "Traceback" not in stderr, (name, stderr)


def test_a_sessions_final_turn_frees_its_history_past_its_first_prompt(model: CpuModel) -> None:
    """docs/design.md §11, Release: the final turn frees the session's history at once, from both tiers
    and with no write-back, except its first prompt (the system prompt its application's sessions
    share lies there: it stays cached, and another live session's tag on it is kept)."""
    from kvflow_ray.core.sessions import SESSION_AGENT

    system = _tokens(64, 70)
    with CpuEngine(_config("kvflow", 2_000, host=8_000), model=model) as engine:
        def turn(key: str, tokens: Sequence[int], final: bool = False) -> tuple[int, ...]:
            result = engine.generate(GenerateRequest(tokens=list(tokens), max_tokens=4, ignore_eos=True, workflow=key,
                                                     agent=SESSION_AGENT, session={"tenant": "t", "final": final}))
            _drain(engine)  # the write-ahead of a paused history lands
            return tuple(result.tokens)

        first = system + _tokens(8, 71)
        second = first + turn("s1", first) + _tokens(40, 72)  # the first output, then a tool's result
        other = system + _tokens(8, 73)
        other_history = other + turn("s2", other)  # another session of the application, left paused
        third = second + turn("s1", second) + _tokens(30, 74)
        assert engine.cache.tree.match_prefix(third, split=False).length > len(second)  # the history is cached
        written = engine.cache.counters.written_back_tokens
        device_before = engine.cache.tree.gpu_tokens
        final = third + turn("s1", third, final=True)

        kept = engine.cache.tree.match_prefix(final, split=False).length
        assert kept == len(first)  # the first prompt only
        released = engine.cache.counters.released_tokens
        assert released >= len(final) - len(second)
        assert engine.cache.tree.gpu_tokens < device_before
        assert engine.cache.counters.written_back_tokens == written  # freed, not written back
        system_node = engine.cache.tree.match_prefix(system, split=False).path[-1]
        assert ("s2", SESSION_AGENT) in system_node.tags  # the live session keeps its history's rank
        _check_pool_contents(engine, model)

        # the other session is finished by the client (`POST /v1/clients/s2/finish`: a retire hint)
        assert engine.cache.tree.match_prefix(other_history, split=False).length > len(other)  # its output
        engine.apply_hints(Hints(retire=["s2"]))
        _drain(engine)
        assert engine.cache.tree.match_prefix(other_history, split=False).length == len(other)
        assert engine.cache.counters.released_tokens > released and not system_node.tags
        _check_pool_contents(engine, model)


def test_a_prompt_diverging_inside_a_node_in_flight_keeps_its_uncached_tail(model: CpuModel,
                                                                           reference: Reference) -> None:
    """C shares the first 60 tokens of a 100-token prompt whose node is being loaded back (a node in flight
    is never split), so the tree takes none of C's prompt at commit. C's own KV for that tail must stay its
    own (not freed, still in its context and in the books) until C finishes. Found under load in the
    serving benchmark, where the engine freed the tail and failed the request."""
    fixed = _tokens(100, 50)
    slow = CpuEngineConfig(policy="kvflow", device_kv_tokens=300, host_kv_tokens=2_000, link_gbps=0.005)
    with CpuEngine(slow, model=model) as engine:
        engine.generate(GenerateRequest(tokens=fixed + _tokens(5, 51), max_tokens=2, ignore_eos=True,
                                        workflow="wf", agent="a", fixed_prefix_tokens=100))
        _ok, writebacks = engine.cache.make_room(engine.cache.gpu_capacity)  # everything to the host
        engine.copier.write_back(writebacks)
        _drain(engine)
        assert engine.cache.tree.gpu_tokens == 0
        engine.apply_hints(Hints(prompts={("wf", "a"): fixed}, steps={"wf": {"a": 1}}))  # prefetch: LOADING
        engine.step()
        assert engine.copier.inflight == 1
        c_tokens = fixed[:60] + _tokens(40, 53)
        c = engine.submit(GenerateRequest(tokens=c_tokens, max_tokens=8, ignore_eos=True))
        _drain(engine)
        assert c.error is None, repr(c.error)
        assert c.result is not None and c.result.tokens == reference(c_tokens, 8)
        assert c.result.miss_tokens == 100  # it could use nothing of the node in flight
        _check_pool_contents(engine, model)
        assert engine.cache.private_tokens == 0


def test_the_device_pool_never_falls_behind_the_cache_books() -> None:
    """Random workflow traffic on a tiny, paced engine (prefetch, write-backs, retirements): after every
    step the device pool has at least the free slots the cache counts (exactly as many when nothing is
    in flight), and no request fails. Regression: a prefetch planned inside `finish` took pool slots
    before the finished request's leftover slots were back, and failed with "60 slots wanted, 59 free"
    (found under load in the serving tests). The failing interleaving depends on copy timing: a
    standalone run of this very workload hit it at step 1396; under pytest it may not, so this test
    guards the invariant on every step rather than replaying that one moment."""
    rng = random.Random(23)
    config = CpuEngineConfig(model=ModelConfig(n_layers=1, hidden_size=64, n_heads=2, n_kv_heads=1,
                                               intermediate_size=64),
                             device_kv_tokens=400, host_kv_tokens=1200, link_gbps=0.001, chunk_tokens=64,
                             max_running=4)
    engine = CpuEngine(config)
    agents = ["a", "b", "c", "d"]
    own = {a: [rng.randrange(1, 250) for _ in range(60)] for a in agents}
    preamble = [rng.randrange(1, 250) for _ in range(30)]
    live: list[Any] = []
    for step in range(1600):
        r = rng.random()
        if r < 0.08 and len(live) < 10:
            workflow, agent = f"w{rng.randrange(3)}", rng.choice(agents)
            tokens = tuple(preamble + own[agent] + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 30))])
            live.append(engine.submit(GenerateRequest(
                tokens=tokens, max_tokens=rng.randrange(1, 12), workflow=workflow, agent=agent,
                fixed_prefix_tokens=len(preamble) + 60, ignore_eos=True)))
        elif r < 0.12:
            workflow = f"w{rng.randrange(3)}"
            steps = {a: rng.choice([0, 1, 2, 3, float("inf")]) for a in agents}
            retire = [workflow] if rng.random() < 0.2 else []
            engine.apply_hints(Hints(steps={workflow: steps},
                                     prompts={(workflow, a): tuple(preamble + own[a]) for a in agents}, retire=retire))
        engine.step(timeout=0.001 if rng.random() < 0.5 else 0)
        books_free = engine.cache.gpu_capacity - engine.cache.used_tokens
        assert engine.device.free_slots >= books_free, f"step {step}"
        if engine.scheduler.idle and engine.copier.inflight == 0 and engine._inbox.empty():
            assert engine.device.free_slots == books_free, f"step {step}"
        failed = [req.error for req in live if req.error is not None]
        assert not failed, f"step {step}: {failed[0]}"
        live = [req for req in live if req.result is None]
    assert engine.requests_done > 100


def test_a_cache_snapshot_names_every_copy_the_engine_holds(model: CpuModel) -> None:
    """The CPU engine's snapshot (taken under its step lock) is "stored" events for the device copies
    and host copies its tree holds, in place of the events not drained yet."""
    from kvflow_ray.core.radix import GpuState
    from kvflow_ray.engines.base import prefix_hash

    fixed = _tokens(100, 40)
    with CpuEngine(_config("hicache", 300, host=360), model=model) as engine:
        engine.generate(GenerateRequest(tokens=fixed + _tokens(5, 41), max_tokens=2, ignore_eos=True,
                                        workflow="wf", agent="a", fixed_prefix_tokens=100))
        engine.generate(GenerateRequest(tokens=_tokens(250, 42), max_tokens=5, ignore_eos=True))  # evicts it
        snapshot = engine.cache_snapshot()
        assert snapshot is not None and engine.cache_events() == []
        nodes = list(engine.cache.tree.nodes())
        assert len([e for e in snapshot if e.tier == "gpu"]) == sum(n.gpu is GpuState.READY for n in nodes)
        assert len([e for e in snapshot if e.tier == "cpu"]) == sum(n.cpu for n in nodes) > 0
        assert ("cpu", prefix_hash(fixed)) in {(e.tier, e.prefix_hash) for e in snapshot}  # written back
