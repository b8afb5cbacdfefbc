"""Per-request KV budgets (docs/design.md §13): the pure rules (`core.kv_budget`: reservation, when to
compact, which keys stay, phases from template markers, the scorer registry), the CPU engine's
compaction on real KV tensors of the random model (exact when nothing is dropped, private KV within
B + Δ, the pool's slots back, only the uncompressed prefix cached), the scheduler's reservation, and
the simulator modelling the same reservation and cost. Fast: no services, the 4-layer random model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow_ray.core.kv_budget import (
    KV_SCORERS,
    KvBudget,
    PhaseMarkers,
    PhaseTracker,
    parse_scorer,
    select_kept,
)
from kvflow_ray.engines.base import GenerateRequest, request_tokens
from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig
from kvflow_ray.engines.cpu.engine import CpuEngine
from kvflow_ray.engines.cpu.kv_budget import BudgetedKV, KeyScores, compact
from kvflow_ray.engines.cpu.model import CpuModel, QueryCapture

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- the rules
def test_a_budget_reserves_its_prompt_then_b_plus_delta_never_more_than_it_can_use() -> None:
    budget = KvBudget(1024)  # Δ = 128
    assert budget.ceiling == 1152
    assert budget.reserve(1024, 3072) == 1152  # the turn: 1k prompt + 3k generated
    assert budget.reserve(300, 50) == 350  # a short request reserves what it can use
    assert budget.reserve(4000, 100) == 4000  # a long prompt is computed whole first
    # an agent's fixed prompt (first 800 uncached tokens) joins the tree: B + Δ for the rest
    assert budget.reserve(1000, 3000, shared=800) == 800 + 1152
    assert not budget.due(1151) and budget.due(1152) and budget.due(1100, new=128)


@pytest.mark.parametrize(("kwargs", "named"), [({"tokens": 10}, "at least|from 64"), ({"tokens": 512, "interval": 0},
                                               "interval"), ({"tokens": 64, "sinks": 64}, "sinks")])
def test_a_bad_budget_is_refused_naming_why(kwargs: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        KvBudget(**kwargs)


def test_selection_keeps_the_sinks_then_the_best_scored_in_position_order() -> None:
    positions = list(range(100, 110))  # private keys at positions 100..109; sinks below 102
    scores = [0.0, 0.0, 0.9, 0.1, 0.8, 0.2, 0.7, 0.3, 0.0, 0.0]
    assert select_kept(scores, positions, keep=5, sinks=102) == [0, 1, 2, 4, 6]
    # among equal scores the later position wins (streaming's recency on ties)
    assert select_kept([0.0] * 4, [0, 1, 2, 3], keep=2, sinks=0) == [2, 3]


def test_the_scorer_registry_builds_each_from_a_short_spec_and_names_bad_ones() -> None:
    assert set(KV_SCORERS.names()) >= {"agentkv", "recent", "h2o", "streaming"}
    agentkv = parse_scorer("agentkv")
    assert agentkv.buffered == 32 and agentkv.buffer("think") == ("think", 8)  # 8 per phase, 32 in all
    assert parse_scorer("recent").buffer("tool") == ("all", 32)
    assert parse_scorer("h2o:window=64").accumulates and parse_scorer("streaming").by_recency
    for spec, named in (("snapkv", "unknown kv scorer 'snapkv'"), ("agentkv:k=2", "takes per_phase="),
                        ("recent:queries=x", "must be a number")):
        with pytest.raises(ValueError, match=named):
            parse_scorer(spec)


def test_phases_follow_template_markers_split_across_tokens() -> None:
    tracker = PhaseTracker(PhaseMarkers.for_template("{{ '<|im_start|>' + message['role'] }}"))
    pieces = ["<|im_start|>", "system", "\nBe brief", "<th", "ink>", "hmm", "</think>", "<tool_call>", "{}",
              "</tool_call>", "<|im_start|>", "user", "\n<tool_response>", "rows", "</tool_response>",
              "<|im_start|>", "tool", "\nresult"]
    assert tracker.extend(pieces) == ["other", "other", "other", "other", "think", "think", "other", "act", "act",
                                      "other", "other", "other", "tool", "tool", "other", "other", "tool", "tool"]
    # markers for a model whose template has others, added by configuration
    custom = PhaseTracker(PhaseMarkers.for_template(None, {"[THINK]": "think", "[/THINK]": "other"}))
    assert custom.extend(["[THI", "NK]", "x", "[/THINK]"]) == ["other", "think", "think", "other"]
    with pytest.raises(ValueError, match="entering one of"):
        PhaseMarkers({"<x>": "dreaming"})


# ---------------------------------------------------------------------- compaction on real KV
@pytest.fixture(scope="module")
def model() -> CpuModel:
    return CpuModel(ModelConfig())


def test_a_compacted_context_decodes_as_the_same_keys_in_place(model: CpuModel) -> None:
    """Compaction moves kept KV (positions kept, nothing re-rotated): the next token's logits equal a decode
    over the original slots of the kept tokens; keeping every token moves them by at most 1e-5."""
    pool = model.pool("device", 512)
    tokens = [(7 * i) % 250 for i in range(200)]
    model.prefill(pool, tokens, torch.arange(200))
    reference_pool = model.pool("reference", 512)
    reference_pool.k.copy_(pool.k)
    reference_pool.v.copy_(pool.v)
    for keep in (200, 96):
        kv = BudgetedKV(KvBudget(keep, interval=8, sinks=16), KeyScores(parse_scorer("streaming"), model.attn_scale),
                        PhaseTracker(PhaseMarkers()), positions=list(range(200)))
        work = model.pool("work", 512)
        work.k.copy_(pool.k)
        work.v.copy_(pool.v)
        held, freed = compact(work, torch.arange(200), kv)
        assert len(held) == min(200, keep + 8) and len(freed) == 200 - len(held)
        kept = torch.tensor(kv.positions)
        assert kv.positions == sorted(kv.positions) and len(kept) == keep
        assert kv.first_dropped == (-1 if keep == 200 else 16)  # streaming drops the oldest after the sinks
        got = model.decode(work, [5], [torch.cat([held[:keep], torch.tensor([300])])], positions=[200])
        want = model.decode(reference_pool, [5], [torch.cat([kept, torch.tensor([300])])], positions=[200])
        assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


def test_captured_queries_score_keys_by_the_attention_they_paid(model: CpuModel) -> None:
    """The log-sum-exp captured with each query makes exp(q.k - lse) its softmax probability: a query's
    scores over its whole causal context sum to one (over layers and heads, averaged)."""
    pool = model.pool("device", 256)
    capture = QueryCapture()
    model.prefill(pool, list(range(40, 100)), torch.arange(60), capture=capture)
    queries, lses = capture.stacked()
    scores = KeyScores(parse_scorer("recent:queries=1"), model.attn_scale)
    scores.observe(queries[0], lses[0], list(range(60)), ["other"] * 60)
    total = scores.scores(pool, torch.arange(60), torch.arange(60))
    assert abs(float(total.sum()) - 1.0) < 1e-4


def engine(**config: object) -> CpuEngine:
    return CpuEngine(CpuEngineConfig(policy="lru", device_kv_tokens=2048, link_gbps=None, **config))  # type: ignore[arg-type]


def run(eng: CpuEngine, requests: list[GenerateRequest], watch: list | None = None) -> list:  # type: ignore[type-arg]
    handles = [eng.submit(r) for r in requests]
    while eng.busy:
        eng.step()
        if watch is not None:
            watch.append([(len(r.kv.positions), len(r.own)) for r in eng.scheduler.running
                          if r.kv is not None and r.own is not None and not r.prefilling])
    assert all(h.error is None for h in handles), [h.error for h in handles]
    return handles


def test_a_budget_above_the_sequence_is_token_identical_to_no_budget() -> None:
    prompts = [[(3 * i + j) % 250 for i in range(150)] for j in range(3)]
    plain = run(engine(), [GenerateRequest(tokens=p, max_tokens=60, ignore_eos=True) for p in prompts])
    budgeted = run(engine(), [GenerateRequest(tokens=p, max_tokens=60, ignore_eos=True, kv_budget=1024)
                              for p in prompts])
    assert [h.result.tokens for h in plain] == [h.result.tokens for h in budgeted]


@pytest.mark.parametrize("scorer", ["agentkv", "recent", "h2o", "streaming"])
def test_private_kv_stays_within_b_plus_delta_and_every_slot_comes_back(scorer: str) -> None:
    eng = engine(kv_interval=32, kv_scorer=scorer)
    watch: list = []  # type: ignore[type-arg]
    # prompts within B + Δ: held whole, then compacted; one longer prompt: held whole until its first output
    prompts = [[(5 * i + j) % 250 for i in range(90)] for j in range(3)] + [[(3 * i) % 250 for i in range(150)]]
    handles = run(eng, [GenerateRequest(tokens=p, max_tokens=300, ignore_eos=True, kv_budget=64) for p in prompts],
                  watch)
    held = [n for step in watch for n, _own in step]
    assert max(held) == 150 and sorted(held)[-2] <= 64 + 32  # the long prompt's first step only
    assert max(own for step in watch for n, own in step if n <= 96) <= 64 + 32  # its slots: no more than it holds
    stats = eng.stats()["kv_budget"]
    assert stats["compactions"] >= 4 * ((90 + 300 - 96) // 32) and stats["dropped_tokens"] > 0
    assert all(len(h.result.tokens) == 300 for h in handles)
    # every request's slots are back: what the pool lacks is what the tree holds
    assert eng.cache.private_tokens == 0
    assert eng.device.free_slots == eng.device.capacity - eng.cache.tree.gpu_tokens


def test_only_the_uncompressed_prefix_joins_the_tree() -> None:
    eng = engine(kv_interval=16)
    prompt = [(11 * i) % 250 for i in range(120)]
    (handle,) = run(eng, [GenerateRequest(tokens=prompt, max_tokens=80, ignore_eos=True, kv_budget=64)])
    first = handle.kv.first_dropped
    assert 32 <= first < 120  # the sinks stay; something of the prompt went
    sequence = tuple(prompt) + tuple(handle.result.tokens[:-1])
    assert eng.cache.tree.match_prefix(sequence).length == first


def test_an_agents_fixed_prompt_is_shared_at_once_and_the_budget_covers_the_rest() -> None:
    eng = engine(kv_interval=16)
    fixed = [(13 * i) % 250 for i in range(200)]
    first, second = (GenerateRequest(tokens=[*fixed, i, i + 1], max_tokens=120, ignore_eos=True, kv_budget=64,
                                      workflow="w1", agent="planner", fixed_prefix_tokens=200) for i in (1, 2))
    run(eng, [first])
    (again,) = run(eng, [second])
    assert again.result.gpu_hit_tokens == 200  # the fixed prompt stayed in the tree, exact


def test_a_budget_lets_more_requests_run_at_once_in_the_same_pool() -> None:
    prompts = [[(17 * i + j) % 250 for i in range(200)] for j in range(6)]

    def most_running(budget: int | None) -> int:
        eng = CpuEngine(CpuEngineConfig(policy="lru", device_kv_tokens=1700, link_gbps=None, kv_interval=32))
        handles = [eng.submit(GenerateRequest(tokens=p, max_tokens=400, ignore_eos=True, kv_budget=budget))
                   for p in prompts]
        most = 0
        while eng.busy:
            eng.step()
            most = max(most, len(eng.scheduler.running))
        assert all(h.error is None for h in handles)
        return most

    full, budgeted = most_running(None), most_running(128)
    assert full == 2 and budgeted >= 3 * full  # 600 tokens each against max(200, B + Δ = 160) reserved


def test_a_request_can_only_ask_for_what_its_engine_does() -> None:
    request = GenerateRequest(tokens=[1, 2, 3], kv_budget=128)
    with pytest.raises(ValueError, match="keeps every token"):
        request_tokens(request, model_name="m", encode=list, vocab_size=10, max_context=100, device_tokens=100)
    eng = engine()
    for bad, named in ((GenerateRequest(tokens=[1, 2], kv_budget=8), "kv_budget must be"),
                       (GenerateRequest(tokens=[1, 2], kv_budget=128, kv_scorer="nope"), "unknown kv scorer"),
                       (GenerateRequest(tokens=[1, 2], kv_budget=128, reuse="position"), "cannot be combined")):
        with pytest.raises(ValueError, match=named):
            eng.submit(bad)


# ---------------------------------------------------------------------- the simulator
def test_the_simulator_reserves_and_compacts_as_the_engine_does() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "sim", "--scenario", "concurrent", "--tasks", "6",
                           "--fixed", "512", "--dynamic", "512", "--output", "1024", "--iterations", "2",
                           "--policies", "kvflow", "--kv-budgets", "off,256", "--gpu-kv-tokens", "6000", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)["results"]
    assert set(results) == {"kvflow", "kvflow+kv256"}
    assert results["kvflow+kv256"]["compactions"] > 0
    bad = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "sim", "--scenario", "single", "--kv-budgets", "8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--kv-budgets" in bad.stderr
