"""The entry point SGLang calls in each of its processes (`[project.entry-points."sglang.srt.plugins"]`
`kvflow = "kvflow_ray.engines.sglang.plugin:register"`).

`register()` only registers: the `kvflow` eviction policy (CLI choice and factory; it runs whichever
core policies `--radix-eviction-policy-config` names) and the hooks of `hooks.py`, which SGLang's
`HookRegistry.apply_hooks()` installs right after. It starts no thread and imports no
prometheus_client (see hooks.py, metrics). Everything it adds acts only on a cache built
with `--radix-eviction-policy kvflow`; other policies behave exactly as without the plugin.
"""

from __future__ import annotations

import importlib.metadata
import logging
import pkgutil

from kvflow_ray.engines.sglang import protocol

logger = logging.getLogger("kvflow_ray.sglang")

_TREE = "sglang.srt.mem_cache"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_SCHEDULE_POLICY = "sglang.srt.managers.schedule_policy.SchedulePolicy"
# (target, hook name in hooks.py, hook type): the SGLang internals the plugin relies on
HOOKS: tuple[tuple[str, str, str], ...] = (
    (f"{_TREE}.unified_cache.tree_core_registry.select_tree_core_backend", "select_python_core", "AROUND"),
    (f"{_TREE}.unified_cache.unified_tree_core.UnifiedTreeCore._split_node", "after_split_unified", "AFTER"),
    (f"{_TREE}.radix_cache.RadixCache._split_node", "after_split_legacy", "AFTER"),
    (f"{_TREE}.unified_radix_cache.UnifiedRadixCache.checkpoint", "after_checkpoint", "AFTER"),
    (f"{_TREE}.radix_cache.RadixCache.checkpoint", "after_checkpoint", "AFTER"),
    (f"{_SCHEDULER}.get_prefill_adder_class", "prefill_adder_class", "REPLACE"),
    (f"{_SCHEDULE_POLICY}.calc_priority", "after_calc_priority", "AFTER"),
    (f"{_SCHEDULER}.get_next_batch_to_run", "before_next_batch", "BEFORE"),
)

_registered = False


def register() -> None:
    """Idempotent; SGLang calls it with no arguments and logs (does not raise) what it raises."""
    global _registered
    if _registered:
        return
    version = importlib.metadata.version("sglang")
    if version != protocol.SGLANG_VERSION:
        # The hooks target internals of one version; a silent partial install would be worse than
        # SGLang's own "Unknown eviction policy: kvflow" at startup.
        logger.error("kvflow plugin: needs sglang==%s, found %s; not registering", protocol.SGLANG_VERSION, version)
        return
    for target, _, _ in HOOKS:  # HookRegistry only logs a missing target: fail loudly here instead
        pkgutil.resolve_name(target)

    from sglang.srt.arg_groups import choices
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvflow_ray.engines.sglang import hooks

    if protocol.PLUGIN_NAME not in choices.RADIX_EVICTION_POLICY_CHOICES:
        choices.add_radix_eviction_policy_choices([protocol.PLUGIN_NAME])
    utils._EVICTION_POLICY_FACTORIES[protocol.PLUGIN_NAME] = hooks.KVFlowStrategy
    # the control path: HookRegistry cannot add a method, and collective_rpc calls it by name
    setattr(Scheduler, protocol.RPC_APPLY_HINTS, hooks.scheduler_apply_hints)
    for target, name, kind in HOOKS:
        HookRegistry.register(target, getattr(hooks, name), HookType[kind])
    _registered = True
    logger.info("kvflow plugin registered (sglang %s): --radix-eviction-policy kvflow", version)
