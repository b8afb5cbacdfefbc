"""The real SGLang 0.5.23 is installed (scripts/install-sglang-cpu.sh) and the internals the kvflow plugin
hooks are where the plugin expects them. A failure here means the recipe or SGLang moved, not the plugin."""

from __future__ import annotations

import importlib.metadata
import inspect
import os


def test_sglang_internals_the_plugin_hooks_are_importable() -> None:
    import sglang
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache import utils as mem_cache_utils
    from sglang.srt.mem_cache.evict_policy import EvictionStrategy
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert sglang.__version__ == "0.5.23"
    assert importlib.metadata.version("sglang") == "0.5.23"
    assert sglang.__file__ is not None  # the installed package, not tests/sglang as a namespace package
    assert "SGLANG_USE_CPU_ENGINE" not in os.environ  # conftest removes it: it would need sgl_kernel

    # the trees whose eviction the plugin replaces
    assert inspect.isclass(RadixCache) and callable(RadixCache.evict)
    assert inspect.isclass(UnifiedRadixCache) and callable(UnifiedRadixCache.evict)
    assert callable(UnifiedTreeCore._split_node)
    # eviction policies: the strategy base class and the registry the plugin adds "kvflow" to
    assert inspect.isclass(EvictionStrategy)
    assert callable(EvictionStrategy.get_priority)
    factories = mem_cache_utils._EVICTION_POLICY_FACTORIES
    assert isinstance(factories, dict) and "lru" in factories
    # admission: the scheduler picks its PrefillAdder class through an overridable method (not called here:
    # other tests in this process may have hooked it)
    assert inspect.isclass(PrefillAdder) and callable(PrefillAdder.add_one_req)
    assert callable(Scheduler.get_prefill_adder_class)
    # the hook API SGLang hands plugins
    assert inspect.isclass(HookRegistry) and callable(HookRegistry.register)
