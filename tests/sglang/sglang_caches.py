"""Real SGLang 0.5.23 caches on CPU for the plugin tests, and the request path that fills them.

Nothing here re-implements SGLang: the trees, pools, allocator and `Req` are SGLang's own; a request
is served the way SGLang's scheduler finishes one (KV slots allocated, the request's token table
written, then `checkpoint` into the tree, duplicates freed, lock released; see
`sglang.test.mem_cache_utils.finish_req`). SGLang must be importable (the conftest installs the
torchvision stand-in first).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import evict_from_tree_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.mem_cache_utils import finish_req

from kvflow_ray.engines.sglang import protocol

TREES = ("unified", "legacy")
_rids = itertools.count()


@dataclass
class CacheRig:
    """One SGLang tree cache with real CPU pools."""

    tree: str
    cache: Any
    req_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator

    # ------------------------------------------------------------------ requests
    def serve(self, tokens: Sequence[int], client_id: str | None = None, agent: str | None = None,
              fixed: int | None = None, cache_salt: str | None = None) -> Req:
        """One finished request whose whole prompt stays cached, with `custom_params.kvflow`, in the
        cache namespace `cache_salt` (SGLang's request field; None = the default namespace)."""
        custom = ({protocol.CUSTOM_PARAMS_KEY: protocol.request_params(client_id, agent, fixed)}
                  if client_id is not None else None)
        req = Req(rid=f"r{next(_rids)}", origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1, custom_params=custom))
        self.req_pool.alloc([req])
        req.output_ids = array("q")
        req.kv.kv_committed_len = len(tokens)
        req.kv.kv_allocated_len = len(tokens)
        req.kv.cache_protected_len = 0
        req.lock = None
        req.extra_key = None
        req.cache_salt = cache_salt
        if self.allocator.available_size() < len(tokens):  # SGLang's own path under memory pressure
            evict_from_tree_cache(self.cache, len(tokens))
        indices = self.allocator.alloc(len(tokens))
        assert indices is not None, "the test pool is too small for this request"
        self.req_pool.write((req.kv.req_pool_idx, slice(0, len(tokens))), indices)
        req.last_node = self.cache.root_node_handle() if self.tree == "unified" else self.cache.root_node
        finish_req(self.cache, req, len(tokens))
        self.req_pool.free(req)
        return req

    def insert(self, tokens: Sequence[int]) -> Any:
        """A bare tree insert (SGLang unit-test style), values from the real allocator."""
        value = self.allocator.alloc(len(tokens))
        return self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value))

    def hints(self, payload: str) -> None:
        """What the router sends, through the scheduler method `collective_rpc` calls (on the
        scheduler of this cache)."""
        getattr(Scheduler, protocol.RPC_APPLY_HINTS)(SimpleNamespace(tree_cache=self.cache), payload)

    # ------------------------------------------------------------------ inspection
    def match(self, tokens: Sequence[int], cache_salt: str | None = None) -> Any:
        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), cache_salt=cache_salt)))

    def matched(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        return self.match(tokens, cache_salt).device_prefix_len

    def node(self, handle: Any) -> Any:
        return self.cache.tree_core.node_by_id(handle) if isinstance(handle, int) else handle

    def evict(self, n: int) -> int:
        return self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted

    def evictable(self) -> int:
        return self.cache.evictable_size()

    def protected(self) -> int:
        return self.cache.protected_size()

    def lock(self, handle: Any) -> Any:
        return self.cache.inc_lock_ref(handle)

    def unlock(self, handle: Any, locked: Any) -> None:
        if self.tree == "unified":
            self.cache.dec_lock_ref(handle, locked.to_dec_params())
        else:
            self.cache.dec_lock_ref(handle)


def build(tree: str, policy: str, *, kv_tokens: int = 4096, page_size: int = 1,
          policy_config: dict[str, Any] | None = None) -> CacheRig:
    """A cache of SGLang's unified tree (Python tree core) or its legacy `RadixCache`; `policy_config`
    is `--radix-eviction-policy-config` (SGLang passes it to the eviction strategy's factory)."""
    req_pool = ReqToTokenPool(size=8, max_context_len=kv_tokens, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(size=kv_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=1, head_dim=8,
                          layer_num=1, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size=kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv,
                                       need_sort=False)
    if tree == "unified":
        # no tree_core_backend given: the plugin's hook must pick the Python core for kvflow
        cache = UnifiedRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=page_size,
            tree_components=(ComponentType.FULL,), eviction_policy=policy, eviction_policy_config=policy_config,
            tree_core_backend=None if policy == "kvflow" else "python"))
    elif tree == "legacy":
        cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=req_pool,
                                           token_to_kv_pool_allocator=allocator, page_size=page_size,
                                           eviction_policy=policy, eviction_policy_config=policy_config))
    else:
        raise ValueError(tree)
    return CacheRig(tree, cache, req_pool, allocator)


# ---------------------------------------------------------------------------------- host tier (HiCache)
def _cpu_host_pool_stand_ins() -> None:
    """SGLang's HiCache needs two CUDA-only pieces; on CPU, plain stand-ins for exactly those two:
    - the host pool's pinned allocation (`pool_host.common.ALLOC_MEMORY_FUNCS`: its CPU entry
      registers host memory with `torch.cuda.cudart()`): a plain allocation;
    - the copy kernel `transfer_kv_direct` (sgl_kernel, imported by `pool_host/mha.py` only on
      CUDA/HIP/XPU): a per-layer index copy, what the kernel does for `direct` I/O, `layer_first`.
    The cache, its tree, the controller, the host pool and its allocator are SGLang's own."""
    from sglang.srt.mem_cache.pool_host import common, mha

    def allocate(dims: Any, dtype: Any, device: Any, pin_memory: bool, allocator: Any,
                 registration_granularity_bytes: Any = None) -> Any:
        return allocator.allocate(dims, dtype=dtype, device=device)

    def transfer_kv_direct(src_layers: Any, dst_layers: Any, src_indices: Any, dst_indices: Any,
                           page_size: int) -> None:
        for src, dst in zip(src_layers, dst_layers, strict=True):
            dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)]

    common.ALLOC_MEMORY_FUNCS["cpu"] = allocate
    mha.transfer_kv_direct = transfer_kv_direct


def build_hicache(*, kv_tokens: int, host_ratio: float = 2.0, write_policy: str = "write_back",
                  page_size: int = 1) -> CacheRig:
    """SGLang's unified tree with HiCache (`--enable-hierarchical-cache`), a host pool of
    `host_ratio` × the device pool, `direct` I/O, `layer_first` layout. Copies are queued as in the
    scheduler; `pump_hicache` runs the scheduler's per-step calls that complete them."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    _cpu_host_pool_stand_ins()
    args = ServerArgs(model_path="dummy", page_size=page_size, enable_hierarchical_cache=True,
                      hicache_io_backend="direct", hicache_mem_layout="layer_first", hicache_ratio=host_ratio,
                      hicache_write_policy=write_policy)
    set_global_server_args_for_scheduler(args)
    req_pool = ReqToTokenPool(size=8, max_context_len=kv_tokens, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(size=kv_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=1, head_dim=8,
                          layer_num=1, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size=kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv,
                                       need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
                             page_size=page_size, tree_components=(ComponentType.FULL,), eviction_policy="lru",
                             tree_core_backend="python")
    cache = UnifiedRadixCache(params)
    cache.init_hicache(args, params)
    return CacheRig("unified", cache, req_pool, allocator)


def pump_hicache(cache: Any) -> None:
    """What SGLang's scheduler calls each step: submit queued device -> host writes, reap finished
    writes, start and reap host -> device loads."""
    cache.flush_pending_backups()
    cache.writing_check()
    cache.ready_to_load_host_cache()
    cache.loading_check()
