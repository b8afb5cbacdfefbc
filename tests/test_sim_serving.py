"""The simulator as a serving engine: a SimReplica on the wall clock behind the Engine protocol. Real
requests get GPU timing from a profile; the cache decisions are the shared core's (device hits on
repeats, write-back to the host tier, prefetch on hints), and cache events report them."""

from __future__ import annotations

import threading
import time

import pytest

from kvflow_ray.engines.base import GenerateRequest, Hints, prefix_hash
from kvflow_ray.engines.sim.serving import SimEngine, WallClock

FAST = 0.02  # simulated seconds pass 50x faster than wall seconds


def test_the_wall_clock_runs_events_in_time_order() -> None:
    clock = WallClock(time_scale=0.01)
    seen: list[str] = []
    done = threading.Event()
    now = clock.now
    clock.at(now + 2.0, lambda: (seen.append("late"), done.set()))
    clock.at(now + 1.0, lambda: seen.append("early"))
    clock.soon(lambda: seen.append("now"))
    assert done.wait(5)
    assert seen == ["now", "early", "late"] and clock.now >= now + 2.0
    clock.close()
    with pytest.raises(ValueError, match="time_scale"):
        WallClock(0)


def _request(tokens: list[int], **kw: object) -> GenerateRequest:
    return GenerateRequest(tokens=tokens, max_tokens=8, **kw)  # type: ignore[arg-type]


def test_repeats_hit_the_device_and_timing_follows_the_profile() -> None:
    engine = SimEngine("a10g-llama3.1-8b", time_scale=FAST)
    try:
        fixed = [i % 256 for i in range(3000)]
        first = engine.generate(_request([*fixed, 1, 2], workflow="wf", agent="a", fixed_prefix_tokens=3000))
        second = engine.generate(_request([*fixed, 3, 4], workflow="wf", agent="a", fixed_prefix_tokens=3000))
        assert (first.miss_tokens, first.gpu_hit_tokens) == (3002, 0)
        assert second.gpu_hit_tokens == 3000 and second.miss_tokens == 2
        assert len(first.tokens) == 8 and first.text and first.finish_reason == "length"
        assert second.ttft_s < first.ttft_s  # a 3,000-token prefill saved
        events = engine.cache_events()
        assert ("stored", "gpu", prefix_hash(fixed), 3000) in {(e.kind, e.tier, e.prefix_hash, e.tokens)
                                                               for e in events}
        stats = engine.stats()
        assert stats["requests_done"] == 2 and stats["prompt_tokens"]["gpu"] == 3000
    finally:
        engine.close()


def test_bad_requests_are_value_errors_and_change_nothing() -> None:
    engine = SimEngine("a10g-llama3.1-8b", time_scale=FAST, device_kv_tokens=1000)
    try:
        with pytest.raises(ValueError, match="device KV pool"):
            engine.submit(_request(list(range(200)) * 5))
        with pytest.raises(ValueError, match="unknown model"):
            engine.submit(GenerateRequest(prompt="hi", model="gpt-9"))
        with pytest.raises(ValueError, match="both a workflow"):
            engine.submit(_request([1, 2, 3], workflow="wf"))
        assert engine.stats()["requests_rejected"] == 3
        assert engine.generate(GenerateRequest(prompt="still serving", max_tokens=3)).tokens
    finally:
        engine.close()


def test_a_stop_string_ends_the_made_up_output_before_it() -> None:
    engine = SimEngine("a10g-llama3.1-8b", time_scale=FAST)
    try:
        prompt = list(b"Tell me a story")
        full = engine.generate(GenerateRequest(tokens=prompt, max_tokens=32, seed=3))
        assert full.finish_reason == "length" and len(full.tokens) == 32
        at = 5
        stop = full.text[at:at + 3]
        at = full.text.find(stop)  # its first occurrence
        later = full.text[-2:]
        assert full.text.find(later) > at  # also in the output, but later: the earliest stop wins
        request = GenerateRequest(tokens=prompt, max_tokens=32, seed=3, stop=[later, stop])
        result = engine.generate(request)
        assert result.finish_reason == "stop"
        assert result.text == full.text[:at] and result.tokens == full.tokens[:at]
        *streamed, last = list(engine.stream(request))
        assert streamed == result.tokens and last.text == result.text  # type: ignore[union-attr]
        # the simulated request generated up to the end of the stop string, not its whole budget: that
        # is the output the cache holds (prompt + output), fresh engine by fresh engine
        fresh = SimEngine("a10g-llama3.1-8b", time_scale=FAST)
        try:
            fresh.generate(request)
            assert fresh.stats()["cache_tokens"]["gpu"] == len(prompt) + at + len(stop)
        finally:
            fresh.close()
        # top_p and temperature are accepted; the made-up output does not depend on them
        sampled = engine.generate(GenerateRequest(tokens=prompt, max_tokens=32, seed=3, temperature=0.7, top_p=0.5))
        assert sampled.tokens == full.tokens
        with pytest.raises(ValueError, match="top_p"):
            engine.submit(GenerateRequest(tokens=prompt, top_p=0.0))
        with pytest.raises(ValueError, match="at most 4 stop strings"):
            engine.submit(GenerateRequest(tokens=prompt, stop=["a", "b", "c", "d", "e"]))
    finally:
        engine.close()


def _prefetch_after_eviction(engine: SimEngine, fixed: list[int], salt: str = "") -> None:
    """Agent a's prompt runs, goes to the host (a long plain request needs the room while a is far
    away), then comes back by prefetch when a is next; returns once the prefetch landed. With a `salt`,
    the workflow's calls and its registered prompt live in that cache namespace."""
    engine.apply_hints(Hints(prompts={("wf", "a"): tuple(fixed)}, steps={"wf": {"a": 0}}, salts={"wf": salt}))
    # boundary from the registered prompt
    engine.generate(_request([*fixed, 9], workflow="wf", agent="a", cache_salt=salt))
    engine.apply_hints(Hints(steps={"wf": {"a": 5}}))  # far away now
    engine.generate(_request([8] + [i % 200 for i in range(1500)]))  # pushes the prompt to the host
    stats = engine.stats()
    assert stats["evicted_tokens"]["written_back"] >= 1200 and stats["cache_tokens"]["cpu"] >= 1200
    engine.apply_hints(Hints(steps={"wf": {"a": 1}}))  # next: prefetch it back
    deadline = time.monotonic() + 10
    while engine.stats()["prefetch"]["completed"] == 0:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)


def test_evicted_prompts_are_written_back_and_prefetched_on_hints() -> None:
    engine = SimEngine("a10g-llama3.1-8b", time_scale=FAST, device_kv_tokens=2000)
    try:
        fixed = [7] + [i % 256 for i in range(1199)]
        _prefetch_after_eviction(engine, fixed)
        again = engine.generate(_request([*fixed, 10], workflow="wf", agent="a"))
        assert again.gpu_hit_tokens >= 1200 and again.miss_tokens <= 1
        assert engine.stats()["prefetch"]["used"] == 1 and engine.stats()["prefetch"]["wasted"] == 0
        kinds = {(e.kind, e.tier) for e in engine.cache_events()}
        assert {("stored", "cpu"), ("removed", "gpu")} <= kinds
    finally:
        engine.close()


def test_a_prefetch_evicted_before_its_agent_runs_counts_as_wasted() -> None:
    engine = SimEngine("a10g-llama3.1-8b", time_scale=FAST, device_kv_tokens=2000)
    try:
        _prefetch_after_eviction(engine, [5] + [i % 256 for i in range(1199)])
        engine.apply_hints(Hints(retire=["wf"]))  # ... but the workflow ends instead
        engine.generate(_request([4] + [i % 190 for i in range(1700)]))  # needs the room: the prompt goes
        prefetch = engine.stats()["prefetch"]
        assert (prefetch["used"], prefetch["wasted"]) == (0, 1), prefetch
    finally:
        engine.close()


def test_cache_salt_isolates_prefix_reuse() -> None:
    """The same prompt under two salts shares no KV; under the same salt it is reused."""
    engine = SimEngine("a10g-llama3.1-8b", time_scale=FAST)
    try:
        fixed = [i % 256 for i in range(3000)]
        first_a = engine.generate(_request(fixed, cache_salt="a"))
        b = engine.generate(_request(fixed, cache_salt="b"))
        plain = engine.generate(_request(fixed))
        second_a = engine.generate(_request(fixed, cache_salt="a"))
        for result in (first_a, b, plain):
            assert (result.gpu_hit_tokens, result.cpu_hit_tokens, result.miss_tokens) == (0, 0, 3000)
        assert second_a.gpu_hit_tokens == 3000 and second_a.miss_tokens == 0
        stored = {e.prefix_hash for e in engine.cache_events() if (e.kind, e.tier) == ("stored", "gpu")}
        assert {prefix_hash(fixed, "a"), prefix_hash(fixed, "b"), prefix_hash(fixed)} <= stored
        assert engine.stats()["cache_tokens"]["gpu"] >= 3 * 3000  # one copy per namespace
    finally:
        engine.close()


def test_hint_salts_prefetch_a_prompt_in_its_workflows_namespace() -> None:
    engine = SimEngine("a10g-llama3.1-8b", time_scale=FAST, device_kv_tokens=2000)
    try:
        fixed = [6] + [i % 256 for i in range(1199)]
        _prefetch_after_eviction(engine, fixed, salt="t")  # waits for the prefetch: it found the salted copy
        loaded = {(e.kind, e.tier, e.prefix_hash) for e in engine.cache_events()}
        assert ("stored", "gpu", prefix_hash(fixed, "t")) in loaded
        again = engine.generate(_request([*fixed, 10], workflow="wf", agent="a", cache_salt="t"))
        assert again.gpu_hit_tokens >= 1200 and again.miss_tokens <= 1
        assert engine.stats()["prefetch"]["used"] == 1
        # the same tokens outside the namespace find nothing
        assert engine.generate(_request([*fixed, 10])).gpu_hit_tokens == 0
    finally:
        engine.close()


def test_cache_events_leave_no_location_behind_when_both_tiers_evict() -> None:
    """What a router learns from the events (stored minus removed, per tier) is only ever what the
    replica holds: prompts pushed out of the device and then out of the host tier are reported
    removed from both (a simulated host copy has no buffer, and is still reported)."""
    engine = SimEngine("a10g-llama3.1-8b", time_scale=0.001, device_kv_tokens=4000)
    held: dict[str, set[str]] = {}
    try:
        done = threading.Semaphore(0)
        for i in range(600):
            tokens = list((f"You are agent {i % 5}. " * 10 + f"unique task {i} " * 20).encode())
            engine.submit(_request(tokens, workflow=f"w{i}", agent="a", cache_salt="tenant:t"),
                          on_done=lambda _r: done.release())
            assert done.acquire(timeout=30)
            for event in engine.cache_events():
                tiers = held.setdefault(event.prefix_hash, set())
                (tiers.add if event.kind == "stored" else tiers.discard)(event.tier)
        holding = {prefix_hash(node.sequence(), node.namespace) for node in engine.cache.tree.nodes()
                   if node.gpu.name != "NONE" or node.cpu}
        reported = {h for h, tiers in held.items() if tiers}
        assert reported and reported <= holding  # nothing stale: bounded by the tiers, not by the requests
    finally:
        engine.close()


def test_the_engine_reports_its_own_compute_cpu_apart_from_the_process() -> None:
    """`compute_cpu_s` is the clock thread's CPU (all the simulated engine's work): it grows with the
    requests run, stays within the process's CPU, and /metrics exports it per replica."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvflow_ray.serve.metrics import COMPUTE_CPU, ReplicaMetrics

    engine = SimEngine("a10g-llama3.1-8b", time_scale=1e-4)
    try:
        idle = engine.stats()["compute_cpu_s"]
        process_before = time.process_time()
        for i in range(40):
            engine.generate(_request([(i + j) % 256 for j in range(2000)]))
        stats = engine.stats()
        busy = stats["compute_cpu_s"] - idle
        assert 0 < busy <= time.process_time() - process_before
        metrics = ReplicaMetrics("r1")
        metrics.observe_stats(stats)
        samples = {s.name: s for f in text_string_to_metric_families(metrics.exposition().decode())
                   for s in f.samples}
        sample = samples[COMPUTE_CPU + "_total"]
        assert sample.labels == {"replica": "r1"} and sample.value == stats["compute_cpu_s"]
    finally:
        engine.close()


def test_a_snapshot_holds_what_the_whole_event_feed_adds_up_to() -> None:
    """After evictions, write-backs and a prefetch, the replica's snapshot gives a router that lost its
    feed the view of one that applied every event, for every prefix the feed reported: the same
    holders, in the same tiers, and the same blocks. It also names the device copies of generated
    tokens, which the feed does not report. Events not drained when it is taken are in it, not after."""
    from kvflow_ray.core.routing import BlockIndex
    from kvflow_ray.router.holdings import Holdings
    from kvflow_ray.router.store import BufferedStore, MemoryStore

    engine = SimEngine("a10g-llama3.1-8b", time_scale=FAST, device_kv_tokens=2000)
    try:
        fed_blocks, fresh_blocks = BlockIndex(), BlockIndex()
        fed = Holdings(BufferedStore(MemoryStore()), fed_blocks)  # applied every batch
        fresh = Holdings(BufferedStore(MemoryStore()), fresh_blocks)  # a router restarted mid-feed
        _prefetch_after_eviction(engine, [i % 256 for i in range(1400)])
        first = engine.cache_events()
        fed.feed("r1", first, 1)
        engine.generate(_request([7] + [i % 100 for i in range(300)]))  # fits beside the prefetched prompt
        second = engine.cache_events()
        fed.feed("r1", second, 2)
        fresh.feed("r1", second, 2)  # its first batch is not the feed's first: stale
        assert fresh.stale("r1") and not fed.stale("r1")
        snapshot = engine.cache_snapshot()
        assert snapshot is not None and {e.kind for e in snapshot} == {"stored"}
        assert {"gpu", "cpu"} <= {e.tier for e in snapshot}  # device and host copies both
        fresh.replace("r1", 3, snapshot)
        assert not fresh.stale("r1")
        reported = [*first, *second]
        for e in reported:
            assert fresh.holders(e.prefix_hash) == fed.holders(e.prefix_hash), e
            assert fresh_blocks.overlaps(e.blocks) == fed_blocks.overlaps(e.blocks), e
        unreported = [e for e in snapshot if e.prefix_hash not in {r.prefix_hash for r in reported}]
        assert unreported and all(e.tier == "gpu" for e in unreported)  # the answers' tokens
        assert fresh_blocks.device_blocks("r1") > fed_blocks.device_blocks("r1") > 0
        engine.generate(_request([5] + [i % 90 for i in range(300)]))  # events left undrained
        assert engine.cache_snapshot() and engine.cache_events() == []  # in the snapshot, not after it
    finally:
        engine.close()
