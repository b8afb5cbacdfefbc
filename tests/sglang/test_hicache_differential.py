"""The core's `hicache` baseline is SGLang 0.5.23's HiCache with `--hicache-write-policy write_back`, as
far as it runs on CPU: a seeded differential fuzz of the host tier.

SGLang's side is its unified tree with HiCache: its controller, host pool and allocator, on CPU, with
stand-ins for its two CUDA-only pieces (pinned host allocation, the copy kernel;
`sglang_caches.build_hicache`). Each sequence drives it and the core `TieredCache` with a host tier
(same device and host sizes, `host_duplicates_first` as the `hicache` policy has it) with the same
operations: insert, match, evict, load back. Device eviction writes a node back to the host; a full
host pool first gives up host copies of nodes still on the device, then host-only leaves by LRU; a
match reports device and host hits; a load brings a prompt's host nodes back. After every operation
the two agree on the match lengths per tier, the tokens evicted, and every node's (namespace,
sequence, device copy, host copy). Host pools of 2× the device pool (`--hicache-ratio 2`: nothing is
ever dropped from the host) and of 2% (constant host pressure).

How the core is driven where its engine contract differs (README, "What is exact and what is
modelled"): SGLang's eviction waits for each write-back before the next node, the core's copies
overlap compute, so the core evicts one node per call and its copy lands before the next; SGLang
refuses loads under 10 tokens (`load_back_threshold`), so only larger ones are made.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang_caches import build_hicache, pump_hicache
from test_radix_differential import Prompts, core_nodes, first_difference, prompt_op, sglang_key, sglang_nodes

from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.policies import LRUPolicy
from kvflow_ray.core.radix import GpuState, RadixNode, cache_namespace

SEQUENCES = 1000
OPERATIONS = 60
KV_TOKENS = 4096
LOAD_BACK_THRESHOLD = 10  # SGLang's `load_back_threshold`: it refuses smaller loads

class HostPair:
    """SGLang's unified tree with HiCache (write_back) and the core `TieredCache` with a host tier."""

    def __init__(self, host_ratio: float = 2.0) -> None:
        self.rig = build_hicache(kv_tokens=KV_TOKENS, host_ratio=host_ratio)
        host = self.rig.cache.cache_controller.mem_pool_host.anchor_entry.host_pool.size
        self.core = TieredCache(KV_TOKENS, LRUPolicy(), cpu_capacity=host, host_tier=True,
                                host_duplicates_first=True)
        self.log: list[str] = []
        self.loads = 0  # loads both ran

    def insert(self, tokens: list[int], salt: str | None, extra: str | None) -> None:
        value = self.rig.allocator.alloc(len(tokens))
        assert value is not None, "the SGLang pool ran out: raise KV_TOKENS"
        self.rig.cache.insert(InsertParams(key=sglang_key(tokens, salt, extra, 1), value=value))  # frees duplicates
        pump_hicache(self.rig.cache)
        self.core.alloc(len(tokens))
        self.core.commit(tokens, len(tokens), namespace=cache_namespace(salt, extra))

    def match(self, tokens: list[int], salt: str | None, extra: str | None) -> tuple[Any, list[Any]]:
        """Both look-ups; they must agree on the tokens on the device and on the host."""
        theirs = self.rig.cache.match_prefix(MatchPrefixParams(key=sglang_key(tokens, salt, extra, 1)))
        match = self.core.match(tokens, cache_namespace(salt, extra))
        ready, loading, host = match.split_by_tier()
        assert not loading
        ours = (ready, sum(len(node.key) for node in host))
        assert ours == (theirs.device_prefix_len, theirs.host_hit_length), (ours, theirs)
        return theirs, host

    def load(self, tokens: list[int], salt: str | None, extra: str | None) -> None:
        theirs, host = self.match(tokens, salt, extra)
        if theirs.host_hit_length < LOAD_BACK_THRESHOLD:
            return
        assert self.rig.cache.load_back(theirs.best_match_node)
        pump_hicache(self.rig.cache)
        self.core.start_load(host)
        # SGLang lands a load-back as one copy and marks its nodes from the deepest up (the load ack
        # walks from the anchor to the root); the core's nodes land as their copies do: deepest first
        for node in reversed(host):
            self.core.finish_load(node)
        self.loads += 1

    def evict(self, n: int) -> None:
        """SGLang's write-back eviction waits for each copy before it evicts the next node
        (`UnifiedRadixCache._evict_components`: the D->H copy, `writing_check(write_back=True)`, then
        the demotion); the core's copies are asynchronous. So the core is driven the same way: one
        node per call, its copy landed before the next."""
        theirs = self.rig.evict(n)
        pump_hicache(self.rig.cache)
        ours = 0
        while ours < n:
            evicted, writebacks = self.core.evict(1)
            for node in writebacks:
                self.core.finish_offload(node)
            if not evicted:
                break
            ours += evicted
        assert ours == theirs, (ours, theirs)

    def check(self) -> None:
        assert core_nodes(self.core, _core_tiers) == sglang_nodes(self.rig.cache, _sglang_tiers)
        assert self.core.tree.gpu_tokens == KV_TOKENS - self.rig.allocator.available_size()


def _core_tiers(node: RadixNode) -> tuple[bool, bool]:
    return node.gpu is GpuState.READY, node.cpu


def _sglang_tiers(node: Any) -> tuple[bool, bool]:
    full = node.component_data[ComponentType.FULL]
    return full.value is not None, full.host_value is not None


@pytest.fixture(autouse=True)
def _published_server_args() -> Iterator[None]:
    """`build_hicache` publishes SGLang's process-wide server args (HiCache on): the ones in effect
    before (the plugin tests') are published again after."""
    from sglang.srt.runtime_context import get_server_args
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    try:
        before = get_server_args()
    except Exception:  # none published yet
        before = None
    yield
    if before is not None:
        set_global_server_args_for_scheduler(before)


def replay(seed: int, host_ratio: float = 2.0) -> HostPair:
    rng = random.Random(seed)
    prompts = Prompts(rng, 8)
    pair = HostPair(host_ratio)
    with first_difference(pair.log, f"seed {seed}, host ratio {host_ratio}"):
        for _ in range(OPERATIONS):
            op = rng.random()
            if op < 0.4:
                prompt_op(pair, "insert", prompts)
            elif op < 0.6:
                prompt_op(pair, "match", prompts)
            elif op < 0.75:
                prompt_op(pair, "load", prompts)
            else:
                n = rng.randint(1, 64)
                pair.log.append(f"evict {n}")
                pair.evict(n)
            pair.check()
    return pair


@pytest.mark.slow
@pytest.mark.parametrize("host_ratio", [2.0, 0.02])
def test_core_host_tier_matches_sglang_hicache_write_back(host_ratio: float) -> None:
    torch.manual_seed(0)
    written = loaded = dropped = 0
    for seed in range(SEQUENCES):
        pair = replay(seed, host_ratio)
        written += pair.core.counters.written_back_tokens
        loaded += pair.loads
        dropped += pair.core.counters.evicted_cpu_tokens
    assert written > 0 and loaded > 0  # the fuzz reached write-backs and loads
    assert (dropped > 0) == (host_ratio < 1)  # and host evictions where the host pool is small
